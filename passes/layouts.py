"""The layout library of the pass floor: what the passes and the search share about laying
out one op or one graph input, with no pass in it.

`ParallelAssignment` is step_parallel_begin's result (a sharding per op, a layout per graph
parameter); `replicated`, `dataset_layouts` (graph inputs under `dataset_strategy`),
`physical_layout` and `layout_from_dict` (a user's `Layout`), `layout_sharding` (an op's
sharding from `Layout`s), `shard_node` (a strategy applied with the op's rule),
`default_strategy` (the semi-auto default) and `is_transparent_cast`. step_parallel_begin and
the search (`passes/search/`) both build on it; it imports `ir/` only. `OptShard` is how
the parallel optimizer (`passes/optimizer_shard.py`) stores one parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pcompile.ir.core import Graph, GraphParam, Node
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.layout import TensorLayout, devices_along_axes, map_axes
from pcompile.ir.rank import RankGroup
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.sharding import (
    ForwardComm,
    Labels,
    OpContext,
    OpSharding,
    StrategyError,
    rule_for,
)
from pcompile.ir.types import TensorType


@dataclass
class ParallelAssignment:
    """The result of step_parallel_begin: a sharding per op, a layout per graph parameter."""

    devices: int
    shardings: dict[Node, OpSharding] = field(default_factory=dict)
    param_layouts: dict[str, TensorLayout] = field(default_factory=dict)
    reshape_layouts: dict[Node, TensorLayout] = field(default_factory=dict)  # a Reshape's out

    def sharding(self, node: Node) -> OpSharding | None:
        return self.shardings.get(node)


def replicated(shape: tuple[int, ...], devices: int) -> TensorLayout:
    return TensorLayout((devices,), tuple(-1 for _ in shape), shape)


def dataset_layouts(graph: Graph, dataset_strategy: Any, devices: int) -> dict[str, TensorLayout]:
    """Layouts of the graph inputs: dim 0 split over all devices (data_parallel), replicated
    (full_batch), or per-input strategies / layouts."""
    out: dict[str, TensorLayout] = {}
    inputs = graph.inputs
    if dataset_strategy in (None, "data_parallel"):
        for p in inputs:
            if not p.shape:
                out[p.name] = replicated(p.shape, devices)
                continue
            if p.shape[0] % devices:
                raise PcompileError(
                    f"dataset_strategy 'data_parallel' splits dim 0 of input {p.name} "
                    f"{p.shape} over {devices} devices, but {p.shape[0]} is not divisible by "
                    f"{devices}; use a global batch that divides, or dataset_strategy="
                    "'full_batch'"
                )
            out[p.name] = TensorLayout((devices,), (0,) + (-1,) * (len(p.shape) - 1), p.shape)
        return out
    if dataset_strategy == "full_batch":
        return {p.name: replicated(p.shape, devices) for p in inputs}
    entries = list(dataset_strategy)
    if len(entries) != len(inputs):
        raise PcompileError(
            f"dataset_strategy has {len(entries)} entries but the program has {len(inputs)} "
            f"inputs ({', '.join(p.name for p in inputs)})"
        )
    for p, entry in zip(inputs, entries):
        if isinstance(entry, dict):
            out[p.name] = layout_from_dict(entry, p.shape, devices, f"input {p.name}")
            continue
        strategy = tuple(int(c) for c in entry)
        if len(strategy) != len(p.shape):
            raise PcompileError(
                f"dataset_strategy entry {strategy} for input {p.name} has {len(strategy)} "
                f"values; the input has rank {len(p.shape)}"
            )
        used = 1
        for c in strategy:
            used *= c
        if devices % used:
            raise PcompileError(
                f"dataset_strategy entry {strategy} for input {p.name} uses {used} devices, "
                f"which does not divide {devices}"
            )
        dev = list(strategy) + ([devices // used] if devices // used > 1 else [])
        n = len(dev)
        tmap = tuple(n - 1 - i if c > 1 else -1 for i, c in enumerate(strategy))
        try:
            out[p.name] = TensorLayout(tuple(dev), tmap, p.shape)
        except ValueError as exc:
            raise PcompileError(f"dataset_strategy for input {p.name}: {exc}") from None
    return out


def physical_layout(spec: dict[str, Any]) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The device matrix and tensor map of a Layout's dict without its
    `"interleaved_parallel"` axis. That axis (always the last, tensor-map value 0) is the
    micro-interleave factor of `nn.MicroBatchInterleaved`, which splits the work inside one
    device, not a device axis; a program without micro-interleaving computes as MindSpore does
    with the axis removed (the dims it maps keep their other axes)."""
    dev = tuple(spec["device_matrix"])
    tmap = tuple(tuple(e) if isinstance(e, tuple) else e for e in spec["tensor_map"])
    if not spec.get("interleaved_parallel"):
        return dev, tmap

    def drop(value: int) -> int:
        return -1 if value == 0 else (value - 1 if value > 0 else value)

    out = tuple(tuple(drop(v) for v in e) if isinstance(e, tuple) else drop(e) for e in tmap)
    return dev[:-1], out


def layout_from_dict(spec: dict[str, Any], shape: tuple[int, ...], devices: int, what: str
                     ) -> TensorLayout:
    dev, tmap = physical_layout(spec)
    total = 1
    for d in dev:
        total *= d
    if total != devices:
        raise StrategyError(
            f"the configured device_matrix {dev} of {what}: accumulate value {total} does not "
            f"equal to the device number in one stage {devices}; compile for {total} devices "
            f"(--devices {total}), or give the Layout a device matrix whose sizes multiply to "
            f"{devices}"
        )
    if len(tmap) != len(shape):
        raise StrategyError(
            f"the layout of {what} has {len(tmap)} tensor-map entries, but the tensor has rank "
            f"{len(shape)}"
        )
    try:
        return TensorLayout(dev, tmap, shape)
    except ValueError as exc:
        raise StrategyError(f"the layout of {what} is invalid: {exc}") from None


def layout_sharding(ctx: OpContext, labels: Labels, layouts: list[TensorLayout],
                    out_layout: TensorLayout | None) -> OpSharding:
    """Sharding given by `Layout`s: labels map to device-axis tuples instead of counts."""
    dev = layouts[0].dev_matrix
    for lay in layouts[1:]:
        if lay.dev_matrix != dev:
            raise StrategyError(
                f"all input layouts of one op must share a device matrix; got {dev} and "
                f"{lay.dev_matrix}"
            )
    axes_of: dict[str, tuple[int, ...]] = {}
    for i, (labs, lay) in enumerate(zip(labels.inputs, layouts)):
        for j, (name, entry) in enumerate(zip(labs, lay.tensor_map)):
            axes = map_axes(entry)
            if name in labels.unsplittable and axes:
                raise StrategyError(f"dim {j} of input {i} cannot be split by a layout")
            if name in axes_of and axes_of[name] != axes:
                raise StrategyError(
                    f"dim {j} of input {i} is mapped to device axes {axes}, but the dims it is "
                    f"matched with are mapped to {axes_of[name]}",
                    "map matched dims (e.g. MatMul's reduce dims) to the same aliases",
                )
            axes_of.setdefault(name, axes)
    n = len(dev)
    out_types = ctx.out_types
    outs = []
    for labs, t in zip(labels.outputs, out_types):
        tmap = []
        seen: set[int] = set()
        for name in labs:
            axes = axes_of.get(name, ())
            if seen & set(axes):
                raise StrategyError(
                    f"device axes {axes} would split two dims of the output; an alias may be "
                    "used once per tensor"
                )
            seen |= set(axes)
            tmap.append(-1 if not axes else (axes[0] if len(axes) == 1 else axes))
        outs.append(TensorLayout(dev, tuple(tmap), t.shape))
    out_names = set("".join(labels.outputs))
    partial_vals = sorted({v for name, axes in axes_of.items() if name not in out_names
                           for v in axes})
    partial = tuple(sorted(n - 1 - v for v in partial_vals))
    forward: list[ForwardComm] = []
    if out_layout is not None and out_layout == outs[0]:
        # MindSpore's AllReduce form: the output layout of the in_strategy, partial sums (if
        # any) all-reduced
        out_layout = None
    elif out_layout is not None and not partial:
        raise StrategyError(
            f"out_strategy layout {out_layout} differs from the output layout {outs[0]} of the "
            "in_strategy, and the op has no reduced axes to scatter",
            "leave out_strategy out, or give the output layout of in_strategy",
        )
    if partial:
        if out_layout is not None:
            first = map_axes(out_layout.tensor_map[0]) if out_layout.tensor_map else ()
            if not set(partial_vals) <= set(first):
                raise StrategyError(
                    f"out_strategy layout {out_layout} does not take the reduce axes "
                    f"{tuple(partial_vals)} on its first dim (ReduceScatter) and differs from "
                    "the AllReduce result"
                )
            forward.append(ForwardComm("ReduceScatter", partial, labels.reduce_op))
            # ReduceScatter hands chunk j of dim 0 to the j-th rank of the group in rank order:
            # the reduce axes split dim 0 below its own axes, left to right (row-major).
            base = outs[0]
            first = tuple(map_axes(base.tensor_map[0])) + tuple(n - 1 - a for a in partial)
            entry = first[0] if len(first) == 1 else first
            outs = [TensorLayout(dev, (entry,) + tuple(base.tensor_map[1:]), base.shape)]
        else:
            forward.append(ForwardComm("AllReduce", partial, labels.reduce_op))
        if labels.mean:
            size = 1
            for a in partial:
                size *= dev[a]
            forward.append(ForwardComm("Div", partial, divisor=size))
    strategy = tuple(lay.splits for lay in layouts)
    return OpSharding(strategy, dev, list(layouts), outs, forward)


def tensor_inputs(node: Node) -> list[TensorType]:
    """The operand types of an op with a sharding rule: tensors (no rule takes a tuple)."""
    return [v.tensor_type for v in node.operands]


def _op_error(node: Node, exc: StrategyError, strategy: Any) -> OpError:
    return OpError(
        node.op,
        str(exc),
        instance_name=node.instance_name,
        scope=node.scope,
        source=node.source,
        shapes=[getattr(v.type, "shape", None) for v in node.operands],
        strategy=strategy,
        hint=exc.hint,
    )


def shard_node(node: Node, devices: int, strategy: Any, out_strategy: Any = None
               ) -> OpSharding:
    """Apply `strategy` (tuples or layout dicts) to `node` with its op's rule."""
    rule = rule_for(node.op)
    if rule is None:
        raise OpError(node.op, "this op cannot be sharded yet", instance_name=node.instance_name,
                      scope=node.scope, source=node.source)
    ctx = OpContext(node.op, tensor_inputs(node), node.result.type, node.attrs, devices)
    try:
        if strategy and any(isinstance(s, dict) for s in strategy):
            if not all(isinstance(s, dict) for s in strategy):
                raise StrategyError("mix of Layouts and tuples in one in_strategy")
            layouts = [layout_from_dict(s, t.shape, devices, f"input {i}")
                       for i, (s, t) in enumerate(zip(strategy, ctx.in_types))]
            out_layout = None
            if out_strategy:
                out_layout = layout_from_dict(out_strategy[0], ctx.out_types[0].shape, devices,
                                              "the output")
            own = rule.apply_layouts(ctx, layouts, out_layout)
            if own is not None:
                return own
            return layout_sharding(ctx, rule.labels(ctx), layouts, out_layout)
        return rule.apply(ctx, tuple(strategy), tuple(out_strategy) if out_strategy else None)
    except StrategyError as exc:
        raise _op_error(node, exc, strategy) from None


def default_strategy(node: Node, devices: int) -> Any:
    """The semi-auto default: batch parallel on the first input's dim 0 — unless that input is
    a stored parameter, which data parallelism replicates rather than splits."""
    rule = rule_for(node.op)
    assert rule is not None
    ctx = OpContext(node.op, tensor_inputs(node), node.result.type, node.attrs, devices)
    first = node.operands[0] if node.operands else None
    if isinstance(first, GraphParam) and first.kind != "input":
        return tuple(tuple(1 for _ in t.shape) for t in ctx.in_types)
    return rule.default_strategy(ctx)


def is_transparent_cast(node: Node) -> bool:
    """A Cast without a user strategy that does not read a stored parameter (whose Cast
    follows the parameter's user instead, `_followers`)."""
    if not has_trait(node.op, Trait.TRANSPARENT) or len(node.operands) != 1:
        return False
    source = node.operands[0]
    return (node.attrs.get("in_strategy") is None
            and not (isinstance(source, GraphParam) and source.kind != "input"))


@dataclass(frozen=True)
class OptShard:
    """How one parameter is stored: `stored` layout and the device axes (left indices) of its
    shard group; the forward use keeps the layout `use`."""

    use: TensorLayout
    stored: TensorLayout
    shard_axes: tuple[int, ...]
    # the model-parallel layout as the strategies give it (`use` may split a replication axis
    # in two for optimizer_weight_shard_size); MindSpore's parameter_layout_dict shows it
    model: TensorLayout | None = None

    def shard_group(self, rank: int) -> tuple[int, ...]:
        return devices_along_axes(rank, self.use.dev_matrix, self.shard_axes)

    def mirror_group(self, rank: int) -> tuple[int, ...]:
        return devices_along_axes(rank, self.use.dev_matrix, self._free_axes())

    def _free_axes(self) -> list[int]:
        return [a for a in range(len(self.use.dev_matrix))
                if a not in self.use.used_axes and a not in self.shard_axes]

    @property
    def shard_rank_group(self) -> RankGroup:
        """`shard_group` for every rank (ir.rank)."""
        return RankGroup.along(self.use.dev_matrix, self.shard_axes)

    @property
    def mirror_rank_group(self) -> RankGroup:
        """`mirror_group` for every rank (ir.rank)."""
        return RankGroup.along(self.use.dev_matrix, self._free_axes())
