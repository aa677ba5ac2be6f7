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

Irregular ops (Reshape, Gather on a split table, Split's tuple output) are hand-written below.
`RULES` maps op names to rules; `rule_for(op)` gives the rule or raises for ops that cannot be
sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import gcd, prod
from typing import Any

from pcompile.ir.layout import MapEntry, TensorLayout
from pcompile.ir.types import TensorType, TupleType, ValueType

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


@dataclass
class OpSharding:
    """Everything a strategy implies for one op."""

    strategy: Strategy
    dev_matrix: tuple[int, ...]
    in_layouts: list[TensorLayout]
    out_layouts: list[TensorLayout]
    forward: list[ForwardComm] = field(default_factory=list)
    local_attrs: dict[str, Any] = field(default_factory=dict)
    expand: str = ""  # name of a local expansion (e.g. "masked_gather") instead of the op
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


def _fresh(count: int, used: set[str]) -> list[str]:
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
                    f"dim {j} of input {i} cannot be split (it is {_role(ctx, name, labels)}), "
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


_ATTENTION_ROLES = {
    "t": "the kv sequence",
    "d": "the head size",
    "m": "the kv heads of multi-query attention (one kv head)",
    "s": "the query sequence",
}


def _role(ctx: OpContext, name: str, labels: Labels) -> str:
    if ctx.op == "FlashAttentionScore":
        return _ATTENTION_ROLES.get(name, "a dim of a compressed or broadcast attn_mask")
    return {
        "Softmax": "the softmax axis",
        "LogSoftmax": "the softmax axis",
        "LayerNorm": "a normalised dim (from begin_norm_axis on)",
        "RmsNorm": "a normalised dim (one of gamma's dims; gamma is never split)",
        "SoftmaxCrossEntropyWithLogits": "the class axis",
        "SparseSoftmaxCrossEntropyWithLogits": "the class axis",
        "Concat": "the concat axis",
        "Split": "the split axis",
        "StridedSlice": "a sliced dim",
        "Conv2D": "a spatial or kernel dim",
        "MaxPool": "a spatial dim",
        "AvgPool": "a spatial dim",
        "OneHot": "the depth axis",
        "Gather": "the gathered axis, which batch mode (batch_dims > 0) never splits",
        "Tile": "a tiled dim (multiple > 1): the strategy splits its copies instead",
        "TopK": "the sorted last axis, which every rank needs whole to pick the top k",
        "Sort": "the sorted axis, which every rank needs whole",
        "CumSum": "the summed axis; a split would need the totals of the earlier ranks' "
                  "slices",
    }.get(ctx.op, "not splittable for this op")


# -- label builders --------------------------------------------------------------------------

LabelFn = Callable[[OpContext], Labels]
_ALPHA = "abcdefghijklmnopqrstuvwxyz"


def elementwise_labels(ctx: OpContext) -> Labels:
    """Inputs right-aligned with the output; broadcast (size-1) dims get their own unsplit
    label."""
    out = ctx.out_types[0]
    out_lab = _ALPHA[: out.rank]
    used = set(out_lab)
    ins, unsplit = [], set()
    for t in ctx.in_types:
        lead = out.rank - t.rank
        lab = ""
        for j, size in enumerate(t.shape):
            if size == 1 and out.shape[lead + j] != 1:
                fresh = _fresh(1, used)[0]
                unsplit.add(fresh)
                lab += fresh
            else:
                lab += out_lab[lead + j]
        ins.append(lab)
    return Labels(ins, [out_lab], unsplit, broadcast=frozenset(unsplit))


def _transpose_ab(lab: str, flag: bool) -> str:
    return lab[:-2] + lab[-1] + lab[-2] if flag else lab


def matmul_labels(ctx: OpContext) -> Labels:
    a = _transpose_ab("ik", bool(ctx.attrs.get("transpose_a")))
    b = _transpose_ab("kj", bool(ctx.attrs.get("transpose_b")))
    return Labels([a, b], ["ij"])


def batch_matmul_labels(ctx: OpContext) -> Labels:
    out = ctx.out_types[0]
    batch = out.rank - 2
    blab = _ALPHA[:batch]
    used = set(blab) | set("ikj")
    ins, unsplit = [], set()
    for t, tail, flag in ((ctx.in_types[0], "ik", ctx.attrs.get("transpose_a")),
                          (ctx.in_types[1], "kj", ctx.attrs.get("transpose_b"))):
        lead = batch - (t.rank - 2)
        lab = ""
        for j in range(t.rank - 2):
            if t.shape[j] == 1 and out.shape[lead + j] != 1:
                fresh = _fresh(1, used)[0]
                unsplit.add(fresh)
                lab += fresh
            else:
                lab += blab[lead + j]
        ins.append(_transpose_ab(lab + tail, bool(flag)))
    return Labels(ins, [blab + "ij"], unsplit, broadcast=frozenset(unsplit))


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
        lab = _ALPHA[:rank]
        axes = _axes(ctx)
        used = set(lab)
        if ctx.attrs.get("keep_dims"):
            fresh = _fresh(len(axes), used)
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
        lab = _ALPHA[:rank]
        bad = {lab[a % rank] for a in unsplit_axes(ctx)} if rank else set()
        return Labels([lab], [lab], bad)

    return fn


def softmax_axes(ctx: OpContext) -> Sequence[int]:
    axis = ctx.attrs.get("axis", -1)
    return axis if isinstance(axis, tuple) else (axis,)


def layer_norm_labels(ctx: OpContext) -> Labels:
    x = ctx.in_types[0]
    lab = _ALPHA[: x.rank]
    norm = ctx.attrs.get("begin_norm_axis", 1) % max(x.rank, 1)
    params = ctx.attrs.get("begin_params_axis", 1) % max(x.rank, 1)
    unsplit = set(lab[norm:])
    plab = lab[params:]
    return Labels([lab, plab, plab], [lab], unsplit)


def rms_norm_labels(ctx: OpContext) -> Labels:
    """x's trailing gamma.ndim dims are normalised (never split); gamma shares their labels;
    rstd keeps x's leading labels and size-1 normalised dims (MindSpore's rms_norm_info)."""
    x, gamma = ctx.in_types
    lab = _ALPHA[: x.rank]
    begin = x.rank - gamma.rank
    fresh = "".join(_fresh(gamma.rank, set(lab)))
    return Labels([lab, lab[begin:]], [lab, lab[:begin] + fresh], set(lab[begin:]) | set(fresh))


def bias_add_labels(ctx: OpContext) -> Labels:
    x = ctx.in_types[0]
    lab = _ALPHA[: x.rank]
    return Labels([lab, lab[1]], [lab])


def transpose_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = _ALPHA[:rank]
    perm = [p % rank for p in ctx.attrs["perm"]]
    return Labels([lab], ["".join(lab[p] for p in perm)])


def expand_dims_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = _ALPHA[:rank]
    axis = ctx.attrs["axis"] % (rank + 1)
    fresh = _fresh(1, set(lab))[0]
    return Labels([lab], [lab[:axis] + fresh + lab[axis:]], {fresh})


def squeeze_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    lab = _ALPHA[: t.rank]
    axes = ctx.attrs.get("axis", ())
    if isinstance(axes, int):
        axes = (axes,)
    gone = {a % t.rank for a in axes} if axes else {i for i, d in enumerate(t.shape) if d == 1}
    return Labels([lab], ["".join(c for i, c in enumerate(lab) if i not in gone)])


def flatten_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    lab = _ALPHA[: t.rank]
    fresh = _fresh(1, set(lab))[0]
    return Labels([lab], [lab[:1] + fresh], set(lab[1:]) | {fresh})


def concat_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = _ALPHA[:rank]
    axis = ctx.attrs.get("axis", 0) % rank
    return Labels([lab] * len(ctx.in_types), [lab], {lab[axis]})


def split_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = _ALPHA[:rank]
    axis = ctx.attrs.get("axis", 0) % rank
    return Labels([lab], [lab] * len(ctx.out_types), {lab[axis]})


def strided_slice_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    lab = _ALPHA[: t.rank]
    begin, end, strides = ctx.attrs["begin"], ctx.attrs["end"], ctx.attrs["strides"]
    sliced = set()
    for i, size in enumerate(t.shape):
        b = begin[i] if i < len(begin) else 0
        e = end[i] if i < len(end) else size
        s = strides[i] if i < len(strides) else 1
        if slice(b, e, s).indices(size) != (0, size, 1):
            sliced.add(lab[i])
    return Labels([lab], [lab], sliced)


def broadcast_to_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    out = ctx.out_types[0]
    olab = _ALPHA[: out.rank]
    lead = out.rank - t.rank
    used = set(olab)
    lab, unsplit = "", set()
    for j, size in enumerate(t.shape):
        if size == 1 and out.shape[lead + j] != 1:
            fresh = _fresh(1, used)[0]
            unsplit.add(fresh)
            lab += fresh
        else:
            lab += olab[lead + j]
    unsplit |= set(olab[:lead]) | {olab[lead + j] for j, s in enumerate(t.shape)
                                   if s == 1 and out.shape[lead + j] != 1}
    return Labels([lab], [olab], unsplit)


def gather_labels(ctx: OpContext) -> Labels:
    """The table's dims with the gathered axis replaced by the indices' dims. The device matrix
    is [indices' splits..., table's splits...] (MindSpore's gather_info, normal mode), so the
    output keeps the indices' axes in front: Gather ((1, 2), (4,)) has dev (4, 1, 2) and output
    map (2, 0), the layout of a following ((4, 2),) op."""
    table, idx = ctx.in_types
    axis = ctx.attrs.get("axis", 0) % table.rank
    tlab = _ALPHA[: table.rank]
    used = set(tlab)
    batch = int(ctx.attrs.get("batch_dims", 0) or 0)
    batch = batch + idx.rank if batch < 0 else batch
    # batch_dims (MindSpore's batch mode): the indices' leading dims are the table's; the
    # gathered axis is never split.
    ilab = tlab[:batch] + "".join(_fresh(idx.rank - batch, used))
    out = tlab[:axis] + ilab[batch:] + tlab[axis + 1 :]
    order = tuple(dict.fromkeys(ilab + tlab))  # the indices' splits first, as MindSpore
    return Labels([tlab, ilab], [out], {tlab[axis]} if batch else set(), dev_order=order)


def one_hot_labels(ctx: OpContext) -> Labels:
    idx = ctx.in_types[0]
    lab = _ALPHA[: idx.rank]
    fresh = _fresh(1, set(lab))[0]
    axis = ctx.attrs.get("axis", -1) % (idx.rank + 1)
    return Labels([lab], [lab[:axis] + fresh + lab[axis:]], {fresh})


def top_k_labels(ctx: OpContext) -> Labels:
    """TopK (MindSpore's TopKInfo): the last axis is sorted whole; values and indices keep the
    input's other dims, their last dim (k) is new and never split."""
    rank = ctx.in_types[0].rank
    lab = _ALPHA[:rank]
    fresh = _fresh(1, set(lab))[0]
    out = lab[:-1] + fresh
    return Labels([lab], [out, out], {lab[-1], fresh})


def sort_labels(ctx: OpContext) -> Labels:
    """Sort: values and indices keep the input's labels; the sorted axis never splits."""
    rank = ctx.in_types[0].rank
    lab = _ALPHA[:rank]
    axis = int(ctx.attrs.get("axis", -1)) % rank
    return Labels([lab], [lab, lab], {lab[axis]})


def cumsum_axes(ctx: OpContext) -> Sequence[int]:
    return (int(ctx.attrs.get("axis", 0)),)


def softmax_ce_labels(ctx: OpContext) -> Labels:
    return Labels(["nc", "nc"], ["n"], {"c"})


def sparse_softmax_ce_labels(ctx: OpContext) -> Labels:
    return Labels(["nc", "n"], [""], {"c"}, mean=True)


def conv2d_labels(ctx: OpContext) -> Labels:
    # x: n c h w; w: o c p q -> out: n o y z (spatial and kernel dims are not split)
    return Labels(["nchw", "ocpq"], ["noyz"], {"h", "w", "p", "q", "y", "z"})


def pool_labels(ctx: OpContext) -> Labels:
    return Labels(["nchw"], ["ncyz"], {"h", "w", "y", "z"})


@dataclass
class LabelRule:
    """A sharding rule given by dimension labels."""

    labels: LabelFn

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        result = label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        if ctx.op == "Conv2D":
            result.local_attrs["out_channel"] = ctx.out_types[0].shape[1] // strategy[1][0]
        if ctx.attrs.get("cross_batch") and ctx.op.startswith("Reduce"):
            # cross_batch: each rank reduces its own part only, as in data_parallel (no
            # forward AllReduce and no division of a mean across ranks).
            result.forward = []
        return result

    def default_strategy(self, ctx: OpContext) -> Strategy:
        """MindSpore's semi-auto default: split dim 0 of the first input (and every dim that
        shares its label) by gcd(size, devices); everything else 1."""
        labels = self.labels(ctx)
        ones = tuple(tuple(1 for _ in t.shape) for t in ctx.in_types)
        if not ctx.in_types or not ctx.in_types[0].rank:
            return ones
        first = labels.inputs[0][0]
        if first in labels.unsplittable:
            return ones
        count = gcd(ctx.in_types[0].shape[0], ctx.devices)
        if is_power_of_two(ctx.devices):
            while not is_power_of_two(count):
                count -= 1
        return tuple(
            tuple(count if name == first else 1 for name in lab) for lab in labels.inputs
        )


def shard_batch_and_axis(ctx: OpContext, strategy: Strategy) -> bool:
    """MindSpore's SHARD_BATCH_AND_AXIS mode of Gather (gather_info's ShardBatchAndAxis): axis
    0 of a 2-D table split `a` ways and the first dim of 2-D indices split `b` ways, nothing
    else split, a * b the whole stage, neither alone. Each rank looks up its vocabulary slice
    for its batch slice; the partial rows are summed by a forward AllReduce over the table's
    axis."""
    if len(strategy) != 2 or int(ctx.attrs.get("axis", 0)) % ctx.in_types[0].rank != 0:
        return False
    table, idx = strategy
    if len(table) != 2 or len(idx) != 2 or table[1] != 1 or idx[1] != 1:
        return False
    return (table[0] * idx[0] == ctx.devices and table[0] != ctx.devices
            and idx[0] != ctx.devices)


class GatherRule(LabelRule):
    """Gather: a split table axis needs the masked local gather plus AllReduce (reference
    §3.2, SHARD_AXIS_0), with the indices whole, or split on their batch dim in MindSpore's
    shard-batch-and-axis mode (`((mp, 1), (dp, 1))`, the vocab-parallel embedding)."""

    def __init__(self) -> None:
        super().__init__(gather_labels)

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        labels = self.labels(ctx)
        if ctx.attrs.get("batch_dims"):
            return label_sharding(ctx, labels, strategy)
        axis = ctx.attrs.get("axis", 0) % ctx.in_types[0].rank
        table_split = strategy[0][axis] if len(strategy) == 2 and len(strategy[0]) > axis else 1
        if table_split == 1:
            return label_sharding(ctx, labels, strategy, out_strategy)
        if axis != 0:
            raise StrategyError("only axis 0 of a gathered table can be split")
        if any(c != 1 for c in strategy[1]) and not shard_batch_and_axis(ctx, strategy):
            raise StrategyError(
                "when the table's gathered axis is split, the indices cannot be split, except "
                "in the shard-batch-and-axis mode: a 2-D table split only on axis 0 and 2-D "
                "indices split only on dim 0, the two splits together using every device "
                f"({ctx.devices}), neither alone",
                "use 1 for every dim of the indices, or ((mp, 1), (dp, 1)) with "
                f"mp * dp = {ctx.devices}",
            )
        result = label_sharding(ctx, labels, strategy, out_strategy)
        result.expand = "masked_gather"
        return result

    def default_strategy(self, ctx: OpContext) -> Strategy:
        if ctx.attrs.get("batch_dims"):
            return super().default_strategy(ctx)  # the shared batch dim 0
        table, idx = ctx.in_types
        count = gcd(idx.shape[0], ctx.devices) if idx.rank else 1
        return (tuple(1 for _ in table.shape),
                tuple(count if i == 0 else 1 for i in range(idx.rank)))


class OneHotRule(LabelRule):
    """OneHot takes its strategy in two forms: one tuple for the indices (the depth axis is
    whole on every rank), or MindSpore's `((dp, mp), (), ())`, which splits the output
    `indices.shape + (depth,)` (depth at `axis`), depth included, followed by empty strategies
    for the on/off values. A rank holding depth slice [start, start + depth / k) looks up
    `indices - start` with the local depth (indices outside fall off the table: all off_value);
    `start` differs by rank ("offset_one_hot")."""

    def __init__(self) -> None:
        super().__init__(one_hot_labels)

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        idx = ctx.in_types[0]
        if not (len(strategy) == 3 and strategy[1] == () and strategy[2] == ()):
            return label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        out_split = tuple(strategy[0])
        out = ctx.out_types[0]
        if len(out_split) != out.rank:
            raise StrategyError(
                f"the first strategy of OneHot's MindSpore form splits the output "
                f"{out.shape}, so it has {out.rank} values; got {out_split}"
            )
        axis = int(ctx.attrs.get("axis", -1)) % out.rank
        depth = out.shape[axis]
        if depth % out_split[axis]:
            raise StrategyError(
                f"the depth {depth} (dim {axis} of the output {out.shape}) cannot be divisible "
                f"by strategy value {out_split[axis]}",
                f"choose a split of the depth that divides {depth}",
            )
        lab = _ALPHA[: idx.rank]
        fresh = _fresh(1, set(lab))[0]
        virtual = OpContext(ctx.op, [idx, TensorType(idx.dtype, (depth,))], out, ctx.attrs,
                            ctx.devices)
        labels = Labels([lab, fresh], [lab[:axis] + fresh + lab[axis:]])
        idx_split = out_split[:axis] + out_split[axis + 1:]
        result = label_sharding(virtual, labels, (idx_split, (out_split[axis],)), out_strategy)
        result.in_layouts = result.in_layouts[:1]
        result.tensor_maps = None
        result.strategy = tuple(strategy)
        if out_split[axis] > 1:
            result.local_attrs["depth"] = depth // out_split[axis]
            result.expand = "offset_one_hot"
        return result


def flash_attention_labels(ctx: OpContext) -> Labels:
    """FlashAttentionScore (MindSpore's flash_attention_score_info): b batch, s query
    sequence, t kv sequence (never split), n query heads (or hidden N1 * D), d head dim (never
    split). The kv heads share n's label, so they split as the query heads do, except under
    multi-query attention (one kv head), where they are never split. The mask's batch and
    head dims follow b and n where it has them; a compressed mask is never split. A split
    query sequence splits the mask's rows with it, and every rank's window (sparse_mode,
    pre_tokens, next_tokens) is moved to its slice (expand "attention_query_split")."""
    from pcompile.ir.ops.attention import attention_dims

    q, k = ctx.in_types[0], ctx.in_types[1]
    layout = str(ctx.attrs.get("input_layout", "BSH"))
    dims = attention_dims(q.shape, k.shape, int(ctx.attrs["head_num"]), layout)
    kv = "n" if dims.kv_heads > 1 else "m"
    q_lab, k_lab = {"BSH": ("bsn", f"bt{kv}"), "SBH": ("sbn", f"tb{kv}"),
                    "BNSD": ("bnsd", f"b{kv}td"), "BSND": ("bsnd", f"bt{kv}d")}[layout]
    unsplit = {"t", "d", "m"}
    ins = [q_lab, k_lab, k_lab]
    if len(ctx.in_types) == 4:
        mask = ctx.in_types[3]
        used = set("bsntdm")
        if int(ctx.attrs.get("sparse_mode", 0)) in (2, 3, 4):
            m_lab = "".join(_fresh(mask.rank, used))
            unsplit |= set(m_lab)
        elif mask.rank == 2:
            m_lab = "st"
        else:
            m_lab = ""
            for size, name in zip(mask.shape[:2], "bn"):
                if size > 1:
                    m_lab += name
                else:
                    fresh = _fresh(1, used)[0]
                    unsplit.add(fresh)
                    m_lab += fresh
            m_lab += "st"
        ins.append(m_lab)
    e, f = _fresh(2, set("".join(ins)))
    return Labels(ins, ["bns" + e, "bns" + e, f, q_lab], unsplit | {e, f})


class FlashAttentionRule(LabelRule):
    """Labels plus what they cannot say: a split of the hidden size (BSH, SBH) or of the
    heads must keep whole heads on a rank, query and kv alike; the local op sees
    head_num / split heads."""

    def __init__(self) -> None:
        super().__init__(flash_attention_labels)

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        from pcompile.ir.ops.attention import attention_dims

        if len(strategy) != len(ctx.in_types):
            raise StrategyError(
                f"the strategy has {len(strategy)} entries but the op has {len(ctx.in_types)} "
                "tensor inputs (query, key, value and attn_mask when it is passed)",
                "give one tuple per passed input",
            )
        q, k = ctx.in_types[0], ctx.in_types[1]
        layout = str(ctx.attrs.get("input_layout", "BSH"))
        head_num = int(ctx.attrs["head_num"])
        dims = attention_dims(q.shape, k.shape, head_num, layout)
        axis = dims.head_axis
        heads_split = strategy[0][axis] if len(strategy[0]) > axis else 1
        kv_split = strategy[1][axis] if len(strategy[1]) > axis else 1
        if head_num % heads_split:
            raise StrategyError(
                f"the query has {head_num} heads, which cannot be split {heads_split} ways "
                "(head_num % split must be 0)",
                "split the heads by a divisor of head_num",
            )
        if dims.kv_heads == 1 and kv_split > 1:
            raise StrategyError(
                "the key and value have one head (multi-query attention), so their head dim "
                f"cannot be split, but the strategy splits it {kv_split} ways",
                "use 1 for the kv head dim; the query heads may still be split",
            )
        if dims.kv_heads > 1 and dims.kv_heads % kv_split:
            raise StrategyError(
                f"the key and value have {dims.kv_heads} heads, which cannot be split "
                f"{kv_split} ways; under grouped-query attention they split as the query "
                "heads do",
                "split the heads by a divisor of the kv head count",
            )
        result = label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        result.local_attrs["head_num"] = head_num // heads_split
        if strategy[0][dims.seq_dim] > 1:
            result.expand = "attention_query_split"
        return result


def tile_labels(ctx: OpContext) -> Labels:
    """A dim with multiple 1 is shared by input and output; a dim with multiple > 1 is never
    split in the input (every rank holds the whole input dim), and its output label appears
    in no input, so only an explicit strategy (TileRule.apply) splits its copies."""
    x = ctx.in_types[0]
    out = ctx.out_types[0]
    olab = _ALPHA[: out.rank]
    reps = _tile_reps(ctx)
    lead = out.rank - x.rank
    fresh = _fresh(x.rank, set(olab))
    lab = "".join(fresh[j] if reps[lead + j] > 1 else olab[lead + j] for j in range(x.rank))
    return Labels([lab], [olab], {c for c in lab if c not in olab})


def _tile_reps(ctx: OpContext) -> tuple[int, ...]:
    reps = tuple(ctx.attrs.get("multiples") or ())
    return (1,) * (ctx.out_types[0].rank - len(reps)) + reps


class TileRule(LabelRule):
    """Tile (MindSpore's tile_info): the strategy has one value per dim; a dim whose multiple
    is > 1 splits the multiple (each rank tiles its share of the copies of the whole input
    dim: local multiple = multiple / split), a dim whose multiple is 1 splits the input dim."""

    def __init__(self) -> None:
        super().__init__(tile_labels)

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        x, out = ctx.in_types[0], ctx.out_types[0]
        reps = _tile_reps(ctx)
        if x.rank != out.rank:
            raise StrategyError(
                f"a sharded Tile needs len(multiples) == x.ndim; x has rank {x.rank}, the "
                f"multiples {ctx.attrs.get('multiples')} give rank {out.rank}",
                "reshape x to the output rank first",
            )
        if len(strategy) != 1:
            raise StrategyError(
                f"the strategy has {len(strategy)} entries but Tile has 1 tensor input",
                "give one tuple with a split per dim",
            )
        for j, (m, count) in enumerate(zip(reps, strategy[0])):
            if m > 1 and m % count:
                raise StrategyError(
                    f"dim {j} is tiled {m} times, and the strategy of a tiled dim splits its "
                    f"multiple: {m} cannot be divisible by strategy value {count}",
                    f"choose a split that divides the multiple {m}",
                )
        # The strategy splits a virtual tensor: the multiple of a tiled dim, else the dim.
        extent = tuple(m if m > 1 else d for m, d in zip(reps, x.shape))
        virtual = OpContext(ctx.op, [TensorType(x.dtype, extent)], TensorType(x.dtype, extent),
                            ctx.attrs, ctx.devices)
        lab = _ALPHA[: x.rank]
        base = label_sharding(virtual, Labels([lab], [lab]), strategy, out_strategy)
        tmap = base.in_layouts[0].tensor_map
        in_map = tuple(-1 if m > 1 else e for m, e in zip(reps, tmap))
        split = strategy[0]
        return OpSharding(
            base.strategy, base.dev_matrix,
            [TensorLayout(base.dev_matrix, in_map, x.shape)],
            [TensorLayout(base.dev_matrix, tmap, out.shape)],
            local_attrs={"multiples": tuple(m // c if m > 1 else 1 for m, c in zip(reps, split))},
        )


class LpNormRule(LabelRule):
    """LpNorm: reduction labels (every dim may split). A split normalised dim leaves partial
    sums: each rank computes sum |x|**p over its slice, the forward AllReduce adds them and
    the root and the epsilon floor follow (expand "lp_norm_partial")."""

    def __init__(self) -> None:
        super().__init__(reduce_labels("sum"))

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        result = label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        if result.forward:
            result.expand = "lp_norm_partial"
        return result


RULES: dict[str, LabelRule] = {}


def _register(names: Sequence[str], rule: LabelRule) -> None:
    for name in names:
        RULES[name] = rule


_register(
    ["Add", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "Pow", "Equal", "NotEqual",
     "Greater", "GreaterEqual", "Less", "LessEqual", "LogicalAnd", "LogicalOr", "LogicalNot",
     "Select", "ReluGrad", "Neg", "Exp", "Log", "Sqrt", "Rsqrt", "Square", "Tanh", "Sigmoid",
     "ReLU", "GeLU", "SiLU", "Cast", "ZerosLike", "OnesLike", "Identity", "Abs", "Erf"],
    LabelRule(elementwise_labels),
)
_register(["MatMul"], LabelRule(matmul_labels))
_register(["BatchMatMul"], LabelRule(batch_matmul_labels))
_register(["ReduceSum"], LabelRule(reduce_labels("sum")))
_register(["ReduceMean"], LabelRule(reduce_labels("sum", mean=True)))
_register(["ReduceMax"], LabelRule(reduce_labels("max")))
_register(["Softmax", "LogSoftmax"], LabelRule(identity_labels(softmax_axes)))
_register(["TopK"], LabelRule(top_k_labels))
_register(["Sort"], LabelRule(sort_labels))
_register(["CumSum"], LabelRule(identity_labels(cumsum_axes)))
_register(["LayerNorm"], LabelRule(layer_norm_labels))
_register(["RmsNorm"], LabelRule(rms_norm_labels))
_register(["BiasAdd"], LabelRule(bias_add_labels))
_register(["Transpose"], LabelRule(transpose_labels))
_register(["ExpandDims"], LabelRule(expand_dims_labels))
_register(["Squeeze"], LabelRule(squeeze_labels))
_register(["Flatten"], LabelRule(flatten_labels))
_register(["Concat"], LabelRule(concat_labels))
_register(["Split"], LabelRule(split_labels))
_register(["StridedSlice"], LabelRule(strided_slice_labels))
_register(["BroadcastTo"], LabelRule(broadcast_to_labels))
RULES["OneHot"] = OneHotRule()
_register(["SoftmaxCrossEntropyWithLogits"], LabelRule(softmax_ce_labels))
_register(["SparseSoftmaxCrossEntropyWithLogits"], LabelRule(sparse_softmax_ce_labels))
_register(["Conv2D"], LabelRule(conv2d_labels))
_register(["MaxPool", "AvgPool"], LabelRule(pool_labels))
RULES["Gather"] = GatherRule()
RULES["Tile"] = TileRule()
RULES["FlashAttentionScore"] = FlashAttentionRule()
RULES["LpNorm"] = LpNormRule()

# Ops without a strategy of their own: Reshape is planned as a redistribution between the
# layouts around it; tuple plumbing passes layouts through.
NO_STRATEGY = {"Reshape", "TupleGetItem", "MakeTuple"}


def rule_for(op: str) -> LabelRule | None:
    return RULES.get(op)


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
    if ctx.op in ("MatMul", "BatchMatMul") and labels.outputs:
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
