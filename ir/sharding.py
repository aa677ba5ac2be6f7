"""Operator sharding rules (reference §1.2-1.3, §3).

Most ops are described by einsum-like **dimension labels**: `MatMul` is `ik,kj->ij`, an
element-wise op with broadcasting labels each output dim once, a reduction drops the reduced
labels. From the labels and a strategy (the number of slices of every input dim) one function,
`label_sharding`, derives everything MindSpore's `OperatorInfo` derives:

* checks: one label is split the same way everywhere; size-1 (broadcast) dims and
  unsplittable labels (softmax axis, LayerNorm's normalised dims, ...) are not split; every dim
  divides by its split; powers of two when the device count is one; the strategy's device
  count divides the stage;
* the device matrix: one axis per label in order of first appearance (`[i, k, j]` for MatMul),
  plus the repeated-calculation factor appended on the right (or left with
  `repeated_num_in_dev_matrix_right_ = False`);
* input and output tensor layouts;
* forward communication: a label that is split but absent from the output is a partial result,
  reduced with AllReduce over its device axes (sum, max, ...; sum then division for means), or
  ReduceScatter when `out_strategy` asks for it.

This module holds that machinery and the label builders many ops share (element-wise,
reductions, softmax-like); each op's rule is declared in its block in `ir/ops/*.py`
(`OpDef.sharding`), beside the labels particular to it and, for what labels cannot say, a
`LabelRule` subclass (Gather on a split table, OneHot's depth split, Tile, FlashAttentionScore).
`rule_for(op)` reads the registry: the op's rule, or None for an op that cannot be sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import gcd, prod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pcompile.ir.layout import MapEntry, TensorLayout
from pcompile.ir.registry import Trait, find_op, has_trait
from pcompile.ir.types import TensorType, TupleType, ValueType

if TYPE_CHECKING:
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Constant, Node, ParallelInfo, Value
    from pcompile.ir.rank import RankValue

Strategy = tuple[tuple[int, ...], ...]


class StrategyError(Exception):
    """A strategy is invalid for an op; the message says why and what would be valid."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class ForwardComm:
    """A collective (or the division of a mean) appended after the local op.

    `axes` are left indices into the op's device matrix."""

    kind: str  # "AllReduce", "ReduceScatter", "Div"
    axes: tuple[int, ...]
    op: str = "sum"
    divisor: int = 1


class LocalLowering(Protocol):
    """What an op's `Expansion` may ask of the pass that writes one rank's program
    (`passes/step_parallel.py::RankBuilder`): a value that differs by rank, as a constant
    operand (`rank_constant`) or as an attribute (`rank_value`)."""

    def rank_constant(self, data: RankValue, dtype: Any) -> Constant: ...

    def rank_value(self, value: RankValue) -> Any: ...


class Expansion:
    """How a sharded op is written into a rank's program where the op itself on the local
    slices would compute something else (a table split on its rows, a split normalised dim,
    a split query sequence, ...). An op's rule sets an instance, made in the op's block, as the
    `expand` of the `OpSharding` it returns; step_parallel calls its hooks in order. Each
    default leaves the op as it is."""

    def operands(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
                 sharding: OpSharding) -> list[Value]:
        """The local operands (after their redistributions), before the op is emitted."""
        return operands

    def attrs(self, lower: LocalLowering, node: Node, sharding: OpSharding) -> dict[str, Any]:
        """Attributes of the local op added to the rule's `local_attrs`."""
        return {}

    def emit(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
             attrs: dict[str, Any], info: ParallelInfo, sharding: OpSharding) -> Value | None:
        """Local ops emitted instead of the op (None: the op itself); the sharding's forward
        collectives follow them."""
        return None

    def finish(self, node: Node, b: Builder, out: Value, attrs: dict[str, Any]) -> Value:
        """Local ops after the forward collectives (and an output's mirror)."""
        return out


@dataclass
class OpSharding:
    """Everything a strategy implies for one op."""

    strategy: Strategy
    dev_matrix: tuple[int, ...]
    in_layouts: list[TensorLayout]
    out_layouts: list[TensorLayout]
    forward: list[ForwardComm] = field(default_factory=list)
    local_attrs: dict[str, Any] = field(default_factory=dict)
    expand: Expansion | None = None  # a local expansion instead of the op (its block's)
    # MindSpore's OperatorInfo tensor maps on `dev_matrix` (inputs, outputs): every dim maps to
    # its label's axis, split or not (Gather ((1, 2), (4,)): ((1, 0), (2)) on (4, 1, 2)); None
    # where the rule derives no labels (then the layouts' maps are MindSpore's)
    tensor_maps: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def mindspore_maps(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(inputs_tensor_map, outputs_tensor_map) as MindSpore's parallel-detail dump shows
        them."""
        if self.tensor_maps is not None:
            return self.tensor_maps
        return (tuple(lay.tensor_map for lay in self.in_layouts),
                tuple(lay.tensor_map for lay in self.out_layouts))


@dataclass
class OpContext:
    """What a rule sees of the node it shards."""

    op: str
    in_types: list[TensorType]
    out_type: ValueType
    attrs: dict[str, Any]
    devices: int

    @property
    def repeat_on_right(self) -> bool:
        return bool(self.attrs.get("repeated_num_in_dev_matrix_right_", True))

    @property
    def out_types(self) -> list[TensorType]:
        t = self.out_type
        return list(t.elements) if isinstance(t, TupleType) else [t]


@dataclass
class Labels:
    """Dimension labels of one op application."""

    inputs: list[str]
    outputs: list[str]
    unsplittable: set[str] = field(default_factory=set)
    reduce_op: str = "sum"  # how partial results over dropped labels combine
    mean: bool = False  # dropped labels are averaged: divide after the AllReduce
    # The device-matrix order of the labels when it is not their order of first appearance
    # (MindSpore's Gather puts the indices' axes before the table's); labels left out follow.
    dev_order: tuple[str, ...] = ()
    # Size-1 dims broadcast against a larger one: no device axis of their own (MindSpore maps
    # them to -1 and its device matrix has no axis for them).
    broadcast: frozenset[str] = frozenset()


# One tensor map per input (or output).
_Maps = tuple[tuple[MapEntry, ...], ...]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fresh_labels(count: int, used: set[str]) -> list[str]:
    out: list[str] = []
    code = 0x100
    while len(out) < count:
        ch = chr(code)
        code += 1
        if ch not in used:
            out.append(ch)
            used.add(ch)
    return out


def label_sharding(
    ctx: OpContext,
    labels: Labels,
    strategy: Strategy,
    out_strategy: Strategy | None = None,
) -> OpSharding:
    """Derive layouts and forward communication of `strategy` from dimension labels."""
    if len(strategy) != len(ctx.in_types):
        raise StrategyError(
            f"the strategy has {len(strategy)} entries but the op has {len(ctx.in_types)} "
            "tensor inputs",
            "give one tuple per input",
        )
    split_of: dict[str, int] = {}
    order: list[str] = []
    broadcast = labels.broadcast
    for i, (lab, t, s) in enumerate(zip(labels.inputs, ctx.in_types, strategy)):
        if len(s) != t.rank:
            raise StrategyError(
                f"strategy {s} of input {i} has {len(s)} values but the input has rank {t.rank}",
                "give one split count per dimension",
            )
        for j, (name, size, count) in enumerate(zip(lab, t.shape, s)):
            if count < 1:
                raise StrategyError(f"strategy values must be >= 1, got {s}")
            if size % count:
                raise StrategyError(
                    f"shape value {size} at dim index {j} of input {i} cannot be divisible by "
                    f"strategy value {count}",
                    f"choose a split that divides {size}",
                )
            if is_power_of_two(ctx.devices) and not is_power_of_two(count):
                raise StrategyError(
                    f"the value of strategy must be the power of 2, got {count} in {s}"
                )
            if name in labels.unsplittable and count != 1:
                raise StrategyError(
                    f"dim {j} of input {i} cannot be split (it is {_role(ctx.op, name)}), "
                    f"but the strategy splits it {count} ways",
                    "use 1 for that dim",
                )
            if name not in split_of:
                split_of[name] = count
                if name not in broadcast:
                    order.append(name)
            elif split_of[name] != count:
                raise StrategyError(
                    f"dim {j} of input {i} must be split like the dims it is matched with "
                    f"({split_of[name]} ways), got {count}",
                    "use the same split for matched dims (e.g. MatMul's reduce dims)",
                )
    if labels.dev_order:
        first = [name for name in labels.dev_order if name in split_of]
        order = first + [name for name in order if name not in first]
    used = prod(split_of[name] for name in order)
    if ctx.devices % used:
        raise StrategyError(
            f"the strategy requires {used} devices, but the device number of this stage is "
            f"{ctx.devices}, it can not be divisible by {used}",
            f"Compile for a multiple of {used} devices (--devices {used} or "
            f"{2 * used}, ...), or give this op a strategy whose splits multiply to a divisor "
            f"of {ctx.devices}",
        )
    origin = [split_of[name] for name in order]
    repeat = ctx.devices // used
    if repeat > 1 and ctx.repeat_on_right:
        dev = origin + [repeat]
        offset = 0
    elif repeat > 1:
        dev = [repeat] + origin
        offset = 1
    else:
        dev = origin
        offset = 0
    n = len(dev)
    axis_of = {name: offset + i for i, name in enumerate(order)}

    def layout(labs: str, t: TensorType) -> TensorLayout:
        tmap = []
        for name in labs:
            a = axis_of.get(name)
            tmap.append(-1 if a is None or split_of.get(name, 1) == 1 else n - 1 - a)
        return TensorLayout(tuple(dev), tuple(tmap), t.shape)

    in_layouts = [layout(lab, t) for lab, t in zip(labels.inputs, ctx.in_types)]
    out_types = ctx.out_types

    def origin_map(labs: str) -> tuple[int, ...]:
        return tuple(n - 1 - axis_of[name] if name in axis_of else -1 for name in labs)

    tensor_maps: tuple[_Maps, _Maps] = (tuple(origin_map(lab) for lab in labels.inputs),
                                         tuple(origin_map(lab) for lab in labels.outputs))
    out_labels = set("".join(labels.outputs))
    partial = tuple(
        axis_of[name] for name in order if name not in out_labels and split_of[name] > 1
    )
    forward: list[ForwardComm] = []
    out_layouts = [layout(lab, t) for lab, t in zip(labels.outputs, out_types)]
    if partial:
        scattered = None
        if out_strategy is not None:
            scattered = _reduce_scatter_layout(ctx, labels, out_strategy, dev, axis_of,
                                               split_of, partial, out_types[0])
        if scattered is not None:
            out_layouts = [scattered]
            forward.append(ForwardComm("ReduceScatter", partial, labels.reduce_op))
        else:
            forward.append(ForwardComm("AllReduce", partial, labels.reduce_op))
        if labels.mean:
            forward.append(ForwardComm("Div", partial, divisor=prod(dev[a] for a in partial)))
    elif out_strategy is not None:
        expected = tuple(
            tuple(split_of.get(name, 1) for name in lab) for lab in labels.outputs
        )
        if tuple(out_strategy) != expected:
            raise StrategyError(
                f"out_strategy {out_strategy} does not match the output of in_strategy; "
                f"expected {expected}"
            )
    if any(f.kind == "ReduceScatter" for f in forward):
        tensor_maps = (tensor_maps[0], tuple(lay.tensor_map for lay in out_layouts))
    return OpSharding(tuple(strategy), tuple(dev), in_layouts, out_layouts, forward,
                      tensor_maps=tensor_maps)


def _reduce_scatter_layout(
    ctx: OpContext,
    labels: Labels,
    out_strategy: Strategy,
    dev: list[int],
    axis_of: dict[str, int],
    split_of: dict[str, int],
    partial: tuple[int, ...],
    out_type: TensorType,
) -> TensorLayout | None:
    """The output layout of an `out_strategy` whose first dim also takes the reduced axes
    (ReduceScatter on dim 0), or None for the AllReduce form (the output of in_strategy,
    MindSpore's `allreduce_strategy`: the partial sums are all-reduced)."""
    out_lab = labels.outputs[0]
    want = tuple(split_of.get(name, 1) for name in out_lab)
    red = prod(dev[a] for a in partial)
    if len(out_strategy) != 1 or len(out_strategy[0]) != len(out_lab):
        raise StrategyError(f"out_strategy {out_strategy} must have one entry of rank "
                            f"{len(out_lab)}")
    got = out_strategy[0]
    if tuple(got) == want:
        return None
    if got[0] != want[0] * red or tuple(got[1:]) != want[1:]:
        raise StrategyError(
            f"out_strategy {out_strategy} is invalid: with the reduce dims split {red} ways, "
            f"it must be {((want[0] * red,) + want[1:],)} (ReduceScatter) or {(want,)} "
            "(AllReduce)"
        )
    n = len(dev)
    first = out_lab[0]
    axes0 = ([axis_of[first]] if split_of.get(first, 1) > 1 else []) + list(partial)
    tmap: list[Any] = []
    for k, name in enumerate(out_lab):
        if k == 0:
            vals = tuple(n - 1 - a for a in axes0)
            tmap.append(vals[0] if len(vals) == 1 else vals)
        else:
            a = axis_of.get(name)
            tmap.append(-1 if a is None or split_of.get(name, 1) == 1 else n - 1 - a)
    if out_type.shape[0] % got[0]:
        raise StrategyError(f"output dim 0 ({out_type.shape[0]}) is not divisible by {got[0]}")
    return TensorLayout(tuple(dev), tuple(tmap), out_type.shape)


def _role(op: str, name: str) -> str:
    """What the unsplittable dim `name` of `op` is, from the op's rule."""
    rule = rule_for(op)
    return rule.role(name) if rule is not None else LabelRule.UNSPLITTABLE


# -- label builders --------------------------------------------------------------------------

LabelFn = Callable[[OpContext], Labels]
ALPHA = "abcdefghijklmnopqrstuvwxyz"


def aligned_labels(shape: tuple[int, ...], out_shape: tuple[int, ...], out_lab: str,
                   used: set[str]) -> tuple[str, set[str]]:
    """The labels of dims `shape` right-aligned with `out_shape` (labelled `out_lab`), and the
    fresh labels (taken from `used`'s complement) of its size-1 dims broadcast against larger
    ones, which are never split."""
    lead = len(out_shape) - len(shape)
    lab, fresh = "", set()
    for j, size in enumerate(shape):
        if size == 1 and out_shape[lead + j] != 1:
            name = fresh_labels(1, used)[0]
            fresh.add(name)
            lab += name
        else:
            lab += out_lab[lead + j]
    return lab, fresh


def elementwise_labels(ctx: OpContext) -> Labels:
    """Inputs right-aligned with the output; broadcast (size-1) dims get their own unsplit
    label."""
    out = ctx.out_types[0]
    out_lab = ALPHA[: out.rank]
    used = set(out_lab)
    ins, unsplit = [], set()
    for t in ctx.in_types:
        lab, fresh = aligned_labels(t.shape, out.shape, out_lab, used)
        ins.append(lab)
        unsplit |= fresh
    return Labels(ins, [out_lab], unsplit, broadcast=frozenset(unsplit))


def _axes(ctx: OpContext, key: str = "axis") -> tuple[int, ...]:
    rank = ctx.in_types[0].rank
    axis = ctx.attrs.get(key, ())
    if isinstance(axis, int):
        axis = (axis,)
    if not axis:
        return tuple(range(rank))
    return tuple(sorted(a % rank for a in axis))


def reduce_labels(op: str, mean: bool = False) -> LabelFn:
    def fn(ctx: OpContext) -> Labels:
        rank = ctx.in_types[0].rank
        lab = ALPHA[:rank]
        axes = _axes(ctx)
        used = set(lab)
        if ctx.attrs.get("keep_dims"):
            fresh = fresh_labels(len(axes), used)
            out = "".join(fresh[axes.index(i)] if i in axes else c for i, c in enumerate(lab))
            unsplit = set(fresh)
        else:
            out = "".join(c for i, c in enumerate(lab) if i not in axes)
            unsplit = set()
        return Labels([lab], [out], unsplit, reduce_op=op, mean=mean)

    return fn


def identity_labels(unsplit_axes: Callable[[OpContext], Sequence[int]] = lambda c: ()) -> LabelFn:
    def fn(ctx: OpContext) -> Labels:
        rank = ctx.in_types[0].rank
        lab = ALPHA[:rank]
        bad = {lab[a % rank] for a in unsplit_axes(ctx)} if rank else set()
        return Labels([lab], [lab], bad)

    return fn


@dataclass
class LabelRule:
    """A sharding rule given by dimension labels: an op's `OpDef.sharding`.

    `unsplittable` names what the op's unsplittable dims are, for the message that refuses
    a split of one ("the softmax axis"); `cross_batch` says that the op honours the `cross_batch`
    attribute (each rank reduces its own part only, as in data_parallel: no forward
    AllReduce and no division of a mean across ranks)."""

    UNSPLITTABLE: ClassVar[str] = "not splittable for this op"

    labels: LabelFn
    unsplittable: str = ""
    cross_batch: bool = False

    def role(self, name: str) -> str:
        """What the unsplittable dim labelled `name` is."""
        return self.unsplittable or self.UNSPLITTABLE

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        result = label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        if self.cross_batch and ctx.attrs.get("cross_batch"):
            result.forward = []
        return result

    def apply_layouts(self, ctx: OpContext, layouts: list[TensorLayout],
                      out_layout: TensorLayout | None) -> OpSharding | None:
        """The sharding of in and out `Layout`s where the labels cannot say it (Tile's out
        layout splitting copies); None: derived from the labels
        (`passes.layouts.layout_sharding`)."""
        return None

    def searchable(self, ctx: OpContext, strategy: Strategy) -> bool:
        """Whether the searches enumerate `strategy`, a valid one (MindSpore's strategy
        generation leaves some valid strategies to the user: Gather's)."""
        return True

    def default_strategy(self, ctx: OpContext) -> Strategy:
        """MindSpore's semi-auto default: split dim 0 of the first input that has dims (and
        every dim that shares its label) by gcd(size, devices); everything else 1. A scalar
        input has no dim to split (MindSpore's batch strategy is empty for it): `ops.mul(2.5,
        x)` splits x's batch as `ops.mul(x, 2.5)` does."""
        labels = self.labels(ctx)
        ones = tuple(tuple(1 for _ in t.shape) for t in ctx.in_types)
        ranked = next((i for i, t in enumerate(ctx.in_types) if t.rank), None)
        if ranked is None:
            return ones
        first = labels.inputs[ranked][0]
        if first in labels.unsplittable:
            return ones
        count = gcd(ctx.in_types[ranked].shape[0], ctx.devices)
        if is_power_of_two(ctx.devices):
            while not is_power_of_two(count):
                count -= 1
        return tuple(
            tuple(count if name == first else 1 for name in lab) for lab in labels.inputs
        )


def rule_for(op: str) -> LabelRule | None:
    """The sharding rule of `op` (its `OpDef.sharding`); None for an op without one or a name
    the registry does not know."""
    opdef = find_op(op)
    return None if opdef is None else opdef.sharding


ELEMENTWISE = LabelRule(elementwise_labels)  # the rule of every element-wise op


# -- candidate enumeration helpers (used by passes.search) -----------------------------------


@dataclass(frozen=True)
class LabelDim:
    """One distinct input label of an op application: its size and whether it may be split."""

    name: str
    size: int
    splittable: bool


def label_dims(ctx: OpContext, labels: Labels) -> list[LabelDim]:
    """Distinct input labels in order of first appearance (MindSpore's depth-first order over
    the dims of all inputs, with tied dims enumerated once). MatMul-like ops use the virtual
    tensor order `[batch..., i, k, j]` whatever their transpose flags."""
    sizes: dict[str, int] = {}
    for lab, t in zip(labels.inputs, ctx.in_types):
        for name, size in zip(lab, t.shape):
            sizes.setdefault(name, size)
    order = list(sizes)
    if has_trait(ctx.op, Trait.MATMUL) and labels.outputs:
        out = labels.outputs[0]
        reduced = [name for name in order if name not in out]
        virtual = [name for name in out[:-1] if name in sizes] + reduced
        virtual += [name for name in out[-1:] if name in sizes]
        order = virtual + [name for name in order if name not in virtual]
    return [
        LabelDim(name, sizes[name], name not in labels.unsplittable and sizes[name] > 1)
        for name in order
    ]


def strategy_from_splits(labels: Labels, splits: dict[str, int]) -> Strategy:
    """The per-input strategy that splits every label `splits[label]` ways (1 if absent)."""
    return tuple(tuple(splits.get(name, 1) for name in lab) for lab in labels.inputs)
