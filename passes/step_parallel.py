"""`step_parallel_end` / `split_ranks`: one local forward graph per rank.

For rank r, the global forward graph is rebuilt with local slice shapes:

* graph inputs and parameters become their slices (parameters are stored sliced, never
  redistributed);
* a trainable parameter replicated over a group of ranks gets a `_MirrorOperator` (identity
  forward; its vjp all-reduces the gradient over that group, ÷ group size with
  `gradients_mean`);
* an operand whose layout differs from what its consumer's strategy needs gets the
  redistribution op list of `passes.redistribution`, instantiated for rank r (slice offsets,
  gather groups);
* each op runs on local shapes and is followed by its forward communication (AllReduce over a
  split reduce dim, ReduceScatter, the division of a mean);
* a loss held by k ranks gets `_VirtualDiv(k)` when `loss_repeated_mean` (its vjp divides the
  sensitivity, so gradients are not counted k times).

Every inserted op's parallel annotation says why it exists and how many bytes it moves.
Autodiff then runs on each local graph: the vjps of the collectives produce the backward
communication (AllReduce <-> AllReduce, AllGather <-> ReduceScatter, StridedSlice <-> zero pad).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import (
    Constant,
    Graph,
    GraphParam,
    Node,
    NodeResult,
    ParallelInfo,
    RankConstant,
    Value,
)
from pcompile.ir.layout import TensorLayout, group_name, std_hash
from pcompile.ir.ops.state import assigned_names
from pcompile.ir.rank import (
    GroupName,
    RankGroup,
    RankId,
    RankValue,
    SlicedArray,
    resolve,
)
from pcompile.ir.registry import Trait, get_op, has_trait
from pcompile.ir.sharding import OpSharding
from pcompile.ir.types import TensorType
from pcompile.passes.comm_info import collective_bytes
from pcompile.passes.cotangents import (
    REPLICATED_COTANGENT,
    CotangentReductions,
    OutputReduction,
    plan_cotangent_reductions,
    replicated_cotangents,
)
from pcompile.passes.forward_scatter import scatter_layouts
from pcompile.passes.layouts import ParallelAssignment, replicated
from pcompile.passes.redistribution import plan_redistribution
from pcompile.passes.unit import CompileUnit, ParameterFacts


@dataclass
class SplitOptions:
    devices: int
    training: bool
    gradients_mean: bool = False
    loss_repeated_mean: bool = True
    enable_alltoall: bool = False
    gradient_fp32_sync: bool = True
    opt_shard: dict[str, Any] = field(default_factory=dict)  # name -> OptShard
    # the backward pass is seeded alike on every rank at output 0 (the standard training
    # form; a training step cell seeds it with a value of its own)
    seeded_loss: bool = False
    # where partial cotangents are summed, when decided by the caller (the driver decides once,
    # so that the shrunk check can pin it); None: decided here (`plan_cotangent_reductions`)
    reductions: CotangentReductions | None = None
    # a prediction's outputs, MindSpore's `_VirtualOutput`: "data_parallel" (dim 0 split over
    # every device where it divides), "full_batch" (whole on every rank), or None (each
    # output stays in its producer's layout)
    virtual_output: str | None = None


def virtual_output_layout(shape: tuple[int, ...], devices: int, mode: str | None
                          ) -> TensorLayout:
    """MindSpore's `_VirtualOutput` layout of a prediction's output: with "full_batch" whole
    on every rank; otherwise dim 0 split over every device where it divides (whole where it
    does not), the other dims whole."""
    if mode == "full_batch" or not shape or shape[0] % devices:
        return replicated(shape, devices)
    return TensorLayout((devices,), (0,) + (-1,) * (len(shape) - 1), shape)


def slice_array(array: np.ndarray, layout: TensorLayout, rank: int) -> np.ndarray:
    """`rank`'s slice of a global array under `layout`."""
    arr = np.asarray(array)
    if not arr.shape:
        return arr
    return arr[tuple(slice(b, e) for b, e in layout.slice_bounds(rank))]


class RankBuilder:
    """Builds the local forward graph from the global graph and its assignment: for every
    rank at once (`rank=None`: what differs between ranks is an `ir.rank` value), or for one
    rank (hybrid mode's per-rank traces)."""

    #: whether the layouts say which ranks hold the same values, so that partial sums may be
    #: reduced where it is cheapest (`scatter_layouts`, `plan_cotangent_reductions`,
    #: `replicated_cotangents`)
    reduce_cotangents = True

    def __init__(self, graph: Graph, assignment: ParallelAssignment, rank: int | None,
                 options: SplitOptions, fusion_ids: dict[str, int]) -> None:
        self.global_graph = graph
        self.assignment = assignment
        self.rank = rank
        self.options = options
        self.fusion_ids = fusion_ids
        self.graph = Graph(graph.name)
        self.graph.attrs = dict(graph.attrs)
        self.graph.attrs["rank"] = self.rank_value(RankId())
        self.local: dict[int, tuple[Value, Any]] = {}
        self.redistributed: dict[tuple[int, TensorLayout], Value] = {}
        self.reshaped: dict[tuple[int, TensorLayout], Value] = {}
        self.gathered: dict[tuple[int, TensorLayout, tuple[Any, ...]], Value] = {}
        self.mirrors: dict[int, Value] = {}
        self.anchor_counts: dict[str, int] = {}
        self.output_layouts: list[TensorLayout | None] = []
        self.reductions = CotangentReductions()
        self.alike: set[tuple[Node, int]] = set()  # forward AllReduces, replicated_cotangents
        self.scatter: dict[Node, TensorLayout] = {}  # forward AllReduces that reduce-scatter

    # -- naming ---------------------------------------------------------------------------------
    def inserted_name(self, anchor: Node, kind: str, op: str = "") -> str:
        k = self.anchor_counts.get(anchor.fullname, 0)
        self.anchor_counts[anchor.fullname] = k + 1
        return f"{kind}_{std_hash(f'{anchor.fullname}_{k}')}{op}"

    def rank_value(self, value: RankValue) -> Any:
        """`value` for every rank (symbolic), or at this builder's one rank."""
        return value if self.rank is None else value.at(self.rank)

    def group_attrs(self, group: RankGroup) -> dict[str, Any]:
        return {"group": self.rank_value(GroupName(group)),
                "rank_list": self.rank_value(group)}

    # -- build ------------------------------------------------------------------------------------
    def build(self) -> Graph:
        if self.reduce_cotangents:
            self.scatter = scatter_layouts(self.global_graph, self.assignment)
        if self.options.training and self.reduce_cotangents:
            self.reductions = self.options.reductions or plan_cotangent_reductions(
                self.global_graph, self.assignment, self.options.opt_shard)
            if self.options.seeded_loss:
                self.alike = replicated_cotangents(self.global_graph, self.assignment)
        for p in self.global_graph.params:
            layout = self.assignment.param_layouts[p.name]
            local_type = TensorType(p.dtype, layout.slice_shape)
            lp = self.graph.add_param(GraphParam(local_type, p.name, p.kind, p.requires_grad))
            shard = self.options.opt_shard.get(p.name)
            # A parameter stored split by the parallel optimizer is *used* in its own layout.
            self.local[id(p)] = (lp, shard.use if shard is not None else layout)
        for node in self.global_graph.nodes:
            self.lower_node(node)
        outputs = []
        names = assigned_names(self.global_graph)
        first_assigned = len(self.global_graph.outputs) - len(names)
        for i, value in enumerate(self.global_graph.outputs):
            local, layout = self.operand(value)
            if i >= first_assigned:  # a Parameter's new value: stored in its own layout
                local, layout = self.stored_value(names[i - first_assigned], value, local,
                                                  layout)
            elif self.options.virtual_output is not None and value.shape:
                local, layout = self.virtual_output(value, local, layout)
            outputs.append(local)
            self.output_layouts.append(layout)
        if self.options.training and outputs:
            loss_layout = self.output_layouts[0]
            assert loss_layout is not None, "the loss is a tensor: it has a layout"
            outputs[0] = self.virtual_div(outputs[0], loss_layout)
        self.graph.outputs = outputs
        return self.graph

    def stored_value(self, name: str, value: Value, local: Value, layout: TensorLayout
                     ) -> tuple[Value, TensorLayout]:
        """The new value of Parameter `name` (assigned in the forward) in the layout the
        Parameter is stored in, redistributed where the assignment's strategy differs."""
        want = self.assignment.param_layouts[name]
        if layout == want:
            return local, layout
        assert isinstance(value, NodeResult), "an assigned value is an Assign op's result"
        plan = plan_redistribution(layout, want, self.options.enable_alltoall)
        reason = (f"the new value of Parameter {name!r} ({value.node.op} "
                  f"'{value.node.instance_name}') is stored in the Parameter's layout: "
                  f"{layout} -> {want}")
        return self.emit_plan(value.node, local, plan, reason), want

    def virtual_output(self, value: Value, local: Value, layout: TensorLayout
                       ) -> tuple[Value, TensorLayout]:
        """A prediction's output in MindSpore's `_VirtualOutput` layout
        (`virtual_output_layout`), redistributed from its producer's where they differ."""
        want = virtual_output_layout(value.shape, self.options.devices,
                                     self.options.virtual_output)
        if layout == want:
            return local, layout
        plan = plan_redistribution(layout, want, self.options.enable_alltoall)
        what = (f"{value.node.op} '{value.node.instance_name}'"
                if isinstance(value, NodeResult) else f"input {getattr(value, 'name', '')}")
        reason = (f"the prediction's output ({what}) in _VirtualOutput's layout "
                  f"({self.options.virtual_output}): {layout} -> {want}")
        anchor = value.node if isinstance(value, NodeResult) else None
        if anchor is None:
            return local, layout
        return self.emit_plan(anchor, local, plan, reason), want

    def operand(self, value: Value) -> tuple[Value, Any]:
        if isinstance(value, Constant):
            return value, replicated(value.shape, self.options.devices)
        return self.local[id(value)]

    def virtual_div(self, loss: Value, layout: TensorLayout) -> Value:
        copies = layout.repeat_count
        if copies <= 1 or not self.options.loss_repeated_mean:
            return loss
        node = loss.node if hasattr(loss, "node") else None
        b = Builder(self.graph, scope=node.scope if node else "Default",
                    source=node.source if node else None)
        out = b.emit("_VirtualDiv", [loss], {"divisor": copies}, instance_name="_VirtualDiv",
                     name_hint="loss",
                     parallel=ParallelInfo(
                         reason=f"the loss is held by {copies} ranks: divide its "
                                "sensitivity (loss_repeated_mean)"))
        return out

    def mirror(self, param: GraphParam, user: Node) -> Value:
        """The parameter as its users see it: behind a mirror when replicated."""
        if id(param) in self.mirrors:
            return self.mirrors[id(param)]
        local = self.local[id(param)][0]
        value = self.mirror_value(local, param, user)
        self.mirrors[id(param)] = value
        return value

    def mirror_value(self, local: Value, param: GraphParam, user: Node) -> Value:
        """`local` (the parameter, or its low-precision Cast) behind a mirror over the ranks
        holding the same slice, when there are several."""
        layout = self.local[id(param)][1]
        value = local
        shard = self.options.opt_shard.get(param.name)
        if shard is not None and self.options.training and local is self.local[id(param)][0]:
            return self.gather_shard(local, param, user, shard)
        if self.options.training and param.kind == "weight" and param.requires_grad:
            axes = self.reductions.param_axes.get(param.name, layout.repeat_axes)
            group = RankGroup.along(layout.dev_matrix, axes)
            if len(group) > 1:
                b = Builder(self.graph, scope=user.scope, source=user.source)
                nbytes = local.tensor_type.nbytes
                value = b.emit(
                    "_MirrorOperator",
                    [local],
                    {**self.group_attrs(group), "dev_num": len(group),
                     "mean_flag": self.options.gradients_mean,
                     "fusion": self.fusion_ids.get(param.name, 1), "parameter": param.name},
                    instance_name=self.inserted_name(user, "mirror_op"),
                    name_hint=param.name.replace(".", "_"),
                    parallel=ParallelInfo(
                        reason=self.mirror_reason(param, layout, len(group)),
                        bytes=nbytes),
                )
        return value

    def mirror_reason(self, param: GraphParam, layout: TensorLayout, size: int) -> str:
        if param.name in self.reductions.param_axes:
            return (f"gradient of parameter {param.name} is all-reduced over {size} of the "
                    f"{layout.repeat_count} ranks that hold the same slice {layout} (the "
                    "others' shares are summed on its user's output)")
        return (f"gradient of parameter {param.name} is all-reduced over the {size} ranks "
                f"that hold the same slice {layout}")

    def gather_shard(self, local: Value, param: GraphParam, user: Node, shard: Any) -> Value:
        """Parallel optimizer: mirror the stored part over the ranks that store the same part,
        then AllGather the parts of the shard group (its vjp reduce-scatters the gradient)."""
        b = Builder(self.graph, scope=user.scope, source=user.source)
        fusion = self.fusion_ids.get(param.name, 1)
        value = local
        rest = shard.mirror_rank_group
        if len(rest) > 1:
            value = b.emit(
                "_MirrorOperator", [value],
                {**self.group_attrs(rest), "dev_num": len(rest),
                 "mean_flag": self.options.gradients_mean, "fusion": fusion,
                 "parameter": param.name},
                instance_name=self.inserted_name(user, "mirror_op"),
                name_hint=param.name.replace(".", "_"),
                parallel=ParallelInfo(
                    reason=f"gradient part of parameter {param.name} is all-reduced over "
                           f"the {len(rest)} ranks that store the same part"))
        group = shard.shard_rank_group
        nbytes = local.tensor_type.nbytes * (len(group) - 1)
        return b.emit(
            "AllGather", [value],
            {**self.group_attrs(group), "fusion": fusion,
             "mean_flag": self.options.gradients_mean},
            instance_name=self.inserted_name(user, "parallel_optimizer_allgather"),
            name_hint=param.name.replace(".", "_"),
            parallel=ParallelInfo(
                reason=f"parallel optimizer: parameter {param.name} is stored split over "
                       f"{len(group)} ranks {shard.stored}; gather it for use "
                       f"{shard.use} (its vjp reduce-scatters the gradient)",
                bytes=nbytes, parameter=param.name))

    def required(self, node: Node, index: int, value: Value, want: TensorLayout) -> Value:
        if isinstance(value, Constant):
            return self.constant(value, want)
        if isinstance(value, GraphParam) and value.kind != "input":
            return self.mirror(value, node)
        local, have = self.local[id(value)]
        if have is None or have == want:
            return local
        key = (id(value), want)
        if key not in self.redistributed:
            self.redistributed[key] = self.redistribute(node, index, local, have, want)
        return self.redistributed[key]

    def _group_attrs_of(self, group: Any) -> dict[str, Any]:
        """Group attributes of a redistribution step (a `RankGroup`, or one rank's members)."""
        if isinstance(group, RankGroup):
            return self.group_attrs(group)
        return {"group": group_name(group, self.options.devices), "rank_list": tuple(group)}

    def constant(self, value: Constant, want: TensorLayout) -> Constant:
        """A constant operand as `want` lays it out: the whole constant, or each rank's part."""
        if isinstance(value, RankConstant):  # already each rank's own (data_parallel's offsets)
            return self.rank_constant(value.data, value.dtype)
        if all(s == 1 for s in want.splits) or not value.shape:  # whole on every rank
            return Constant(value.array, value.dtype)
        return self.rank_constant(SlicedArray(value.array, want), value.dtype)

    def rank_constant(self, data: RankValue, dtype: Any) -> Constant:
        if self.rank is not None:
            return Constant(np.asarray(data.at(self.rank)), dtype)
        return RankConstant(data, dtype)

    def redistribute(self, node: Node, index: int, local: Value, have: TensorLayout,
                     want: TensorLayout) -> Value:
        plan = plan_redistribution(have, want, self.options.enable_alltoall)
        reason = (f"redistribution of {node.op} '{node.instance_name}' input {index}: "
                  f"{have} -> {want}")
        return self.emit_plan(node, local, plan, reason)

    def emit_plan(self, node: Node, local: Value, plan: Any, reason: str) -> Value:
        b = Builder(self.graph, scope=node.scope, source=node.source)
        keep = self.inherited(node)
        value = local
        steps = plan.symbolic_ops()
        if self.rank is not None:
            steps = [tuple(resolve(x, self.rank) for x in step) for step in steps]
        for step in steps:
            kind = step[0]
            if kind == "Reshape":
                value = b.emit("Reshape", [value], {"shape": tuple(step[1])},
                               instance_name=self.inserted_name(node, "redistribution_op",
                                                                "Reshape"),
                               parallel=ParallelInfo(reason=reason),
                               user_attrs=keep)
            elif kind == "StridedSlice":
                value = b.emit("StridedSlice", [value],
                               {"begin": step[1], "end": step[2], "strides": step[3]},
                               instance_name=self.inserted_name(node, "redistribution_op",
                                                                "StridedSlice"),
                               parallel=ParallelInfo(reason=reason),
                               user_attrs=keep)
            elif kind == "AllConcat":
                ranks, axis = step[1], step[2]
                nbytes = value.tensor_type.nbytes * (len(ranks) - 1)
                gathered = b.emit("AllGather", [value], self._group_attrs_of(ranks),
                                  instance_name=self.inserted_name(node, "redistribution_op",
                                                                   "AllGather"),
                                  parallel=ParallelInfo(reason=reason, bytes=nbytes),
                                  user_attrs=keep)
                if axis != 0:
                    parts = b.emit("Split", [gathered], {"axis": 0, "output_num": len(ranks)},
                                   instance_name=self.inserted_name(node, "redistribution_op",
                                                                    "Split"), user_attrs=keep)
                    pieces = [b.emit("TupleGetItem", [parts], {"index": i})
                              for i in range(len(ranks))]
                    gathered = b.emit("Concat", pieces, {"axis": axis},
                                      instance_name=self.inserted_name(node,
                                                                       "redistribution_op",
                                                                       "Concat"),
                                      user_attrs=keep)
                value = gathered
            elif kind == "AlltoAll":
                _, ranks, split_dim, concat_dim, count = step
                nbytes = value.tensor_type.nbytes * (count - 1) // count
                value = b.emit("AlltoAll", [value],
                               {"split_count": count, "split_dim": split_dim,
                                "concat_dim": concat_dim, **self._group_attrs_of(ranks)},
                               instance_name=self.inserted_name(node, "redistribution_op",
                                                                "AlltoAll"),
                               parallel=ParallelInfo(reason=reason, bytes=nbytes),
                               user_attrs=keep)
        return value

    def lower_node(self, node: Node) -> None:
        if node.op == "TupleGetItem":
            (tup,) = node.operands
            local, tuple_layouts = self.local[id(tup)]
            b = Builder(self.graph, scope=node.scope, source=node.source)
            index = node.attrs["index"]
            out = b.emit("TupleGetItem", [local], {"index": index},
                         instance_name=node.instance_name, name_hint=node.result.name_hint)
            self.local[id(node.result)] = (out, tuple_layouts[index] if tuple_layouts else None)
            return
        if node.op == "Reshape":
            self.lower_reshape(node)
            return
        if has_trait(node.op, Trait.FIRST_OPERAND):
            self.lower_pass_through(node)
            return
        sharding = self.assignment.sharding(node)
        assert sharding is not None, f"{node.where()} has no sharding"
        if self.low_precision_cast_of_weight(node):
            self.lower_cast_before_mirror(node, sharding)
            return
        operands = [self.required(node, i, v, want)
                    for i, (v, want) in enumerate(zip(node.operands, sharding.in_layouts))]
        b = Builder(self.graph, scope=node.scope, source=node.source)
        opdef = get_op(node.op)
        attrs = opdef.impl_attrs(node.attrs)
        attrs.update(sharding.local_attrs)
        user = {k: v for k, v in node.attrs.items() if k not in opdef.attrs}
        old = node.parallel or ParallelInfo()
        info = ParallelInfo(in_strategy=sharding.strategy, out_strategy=old.out_strategy,
                            in_layout=old.in_layout, out_layout=old.out_layout)
        expand = sharding.expand  # the op block's local expansion, if its rule set one
        expanded = None
        if expand is not None:
            operands = expand.operands(self, node, b, operands, sharding)
            attrs.update(expand.attrs(self, node, sharding))
            expanded = expand.emit(self, node, b, operands, attrs, info, sharding)
        out = expanded if expanded is not None else b.emit(
            node.op, operands, attrs, instance_name=node.instance_name,
            name_hint=node.result.name_hint, parallel=info, user_attrs=user)
        out = self.forward_comm(node, b, out, sharding)
        if node in self.reductions.outputs:
            out = self.output_mirror(node, b, out, self.reductions.outputs[node])
        if expand is not None:
            out = expand.finish(node, b, out, attrs)
        layouts: Any = (sharding.out_layouts if len(sharding.out_layouts) > 1
                        or node.op == "Split" else
                        self.scatter.get(node, sharding.out_layouts[0]))
        self.local[id(node.result)] = (out, layouts)

    def output_mirror(self, node: Node, b: Builder, out: Value,
                      choice: OutputReduction) -> Value:
        """The cotangent of `node`'s output summed over the ranks that hold the same slice of
        it (a `_MirrorOperator` with no parameter: identity forward, AllReduce backward)."""
        group = RankGroup.along(choice.dev_matrix, choice.axes)
        return b.emit(
            "_MirrorOperator", [out],
            {**self.group_attrs(group), "dev_num": len(group),
             "mean_flag": self.options.gradients_mean, "fusion": 0, "parameter": ""},
            instance_name=self.inserted_name(node, "mirror_op"),
            name_hint=node.result.name_hint,
            user_attrs=self.inherited(node),
            parallel=ParallelInfo(
                reason=f"the cotangent of {node.op} '{node.instance_name}' is summed over "
                       f"the {len(group)} ranks that hold the same slice, so parameter "
                       f"{choice.parameter}'s gradient is all-reduced over "
                       f"{choice.param_group} ranks instead of {choice.full_group} "
                       f"(ring bytes {choice.chosen_bytes:.0f} instead of "
                       f"{choice.default_bytes:.0f})",
                bytes=out.tensor_type.nbytes))

    def as_is(self, node: Node, value: Value) -> tuple[Value, Any]:
        """An operand in whatever layout it has (a parameter behind its mirror)."""
        if isinstance(value, Constant):
            return value, replicated(value.shape, self.options.devices)
        if isinstance(value, GraphParam) and value.kind != "input":
            return self.mirror(value, node), self.local[id(value)][1]
        return self.local[id(value)]

    def lower_pass_through(self, node: Node) -> None:
        """Depend: the first operand in its own layout, ordered after the others (which are
        not redistributed)."""
        operands = [self.as_is(node, v) for v in node.operands]
        b = Builder(self.graph, scope=node.scope, source=node.source)
        opdef = get_op(node.op)
        user = {k: v for k, v in node.attrs.items() if k not in opdef.attrs}
        out = b.emit(node.op, [v for v, _ in operands], opdef.impl_attrs(node.attrs),
                     instance_name=node.instance_name, name_hint=node.result.name_hint,
                     user_attrs=user or None)
        self.local[id(node.result)] = (out, operands[0][1])

    def low_precision_cast_of_weight(self, node: Node) -> bool:
        """With gradient_fp32_sync=False, a Cast of an fp32 weight to fp16/bf16 takes the
        mirror after it (the gradient is all-reduced in low precision)."""
        if self.options.gradient_fp32_sync or node.op != "Cast":
            return False
        (value,) = node.operands
        target = node.attrs.get("dst_type")
        return (isinstance(value, GraphParam) and value.kind == "weight"
                and value.dtype.value == "Float32" and target is not None
                and target.value in ("Float16", "BFloat16"))

    def lower_cast_before_mirror(self, node: Node, sharding: OpSharding) -> None:
        (param,) = node.operands
        assert isinstance(param, GraphParam)
        local = self.local[id(param)][0]
        b = Builder(self.graph, scope=node.scope, source=node.source)
        opdef = get_op(node.op)
        cast = b.emit("Cast", [local], opdef.impl_attrs(node.attrs),
                      instance_name=node.instance_name, name_hint=node.result.name_hint,
                      parallel=ParallelInfo(in_strategy=sharding.strategy))
        self.local[id(node.result)] = (self.mirror_value(cast, param, node),
                                       sharding.out_layouts[0])

    @staticmethod
    def inherited(node: Node) -> dict[str, Any] | None:
        """Attributes an inserted op takes from the op it serves: a recomputed op's
        communication is recomputed with it (MindSpore's mp_comm_recompute)."""
        return {"recompute": True} if node.attrs.get("recompute") is True else None

    def forward_comm(self, node: Node, b: Builder, out: Value, sharding: OpSharding) -> Value:
        keep = self.inherited(node)
        for index, comm in enumerate(sharding.forward):
            group = RankGroup.along(sharding.dev_matrix, comm.axes)
            if comm.kind == "Div":
                out = b.emit("RealDiv", [out, Constant(np.asarray(comm.divisor), out.dtype)],
                             instance_name=self.inserted_name(node, "forward_op", "RealDiv"),
                             parallel=ParallelInfo(
                                 reason=f"mean of {node.op} '{node.instance_name}' over "
                                        f"{comm.divisor} slices"), user_attrs=keep)
                continue
            if len(group) <= 1:
                continue
            reason = (f"forward: {node.op} '{node.instance_name}' leaves partial results over "
                      f"split reduced dims (device axes {list(comm.axes)} of "
                      f"{list(sharding.dev_matrix)})")
            info = ParallelInfo(reason=reason)
            partial = out
            marks = dict(keep or {})
            kind = comm.kind
            if node in self.scatter:
                kind = "ReduceScatter"
                info.reason = (f"{reason}; every user takes its block of the sum "
                               f"{self.scatter[node]}")
            elif (node, index) in self.alike:
                marks[REPLICATED_COTANGENT] = True
            out = b.emit(kind, [out], {"op": comm.op, **self.group_attrs(group)},
                         instance_name=self.inserted_name(node, "forward_op"),
                         parallel=info, user_attrs=marks or None)
            info.bytes = collective_bytes(kind, partial.type, out.type, len(group))
        return out

    def lower_reshape(self, node: Node) -> None:
        (value,) = node.operands
        want = self.assignment.reshape_layouts[node]
        local: Value
        if isinstance(value, Constant):
            local, have = value, replicated(value.shape, self.options.devices)
        elif isinstance(value, GraphParam) and value.kind != "input":
            local = self.mirror(value, node)
            have = self.local[id(value)][1]
        else:
            local, have = self.local[id(value)]
        plan = plan_redistribution(have, want, self.options.enable_alltoall)
        # Reshapes of one value to one layout that communicate are done once (the Linears
        # that read one activation each flatten it: one AllGather, not one per Linear)
        key = (id(local), want)
        if plan.communicates and key in self.reshaped:
            self.local[id(node.result)] = (self.reshaped[key], want)
            return
        reason = f"Reshape '{node.instance_name}': {have} -> {want}"
        if plan.communicates:
            # Reshapes of one value whose collectives are the same (to different shapes, or
            # through a Cast to the dtype it has) share them: the MoE layer's input flattened
            # for the router and for the shared expert is gathered once
            head, tail = plan.split_after_communication()
            shared = (id(_same_values(local)), have, tuple(head.ops))
            if shared not in self.gathered:
                self.gathered[shared] = self.emit_plan(node, local, head, reason)
            out = self.emit_plan(node, self.gathered[shared], tail, reason)
        else:
            out = self.emit_plan(node, local, plan, reason)
        if out.shape != want.slice_shape:
            b = Builder(self.graph, scope=node.scope, source=node.source)
            out = b.emit("Reshape", [out], {"shape": want.slice_shape},
                         instance_name=node.instance_name, name_hint=node.result.name_hint)
        if plan.communicates:
            self.reshaped[key] = out
        self.local[id(node.result)] = (out, want)


def _same_values(local: Value) -> Value:
    """`local` before any Casts to the dtype it already has (they change no value)."""
    while (isinstance(local, NodeResult) and local.node.op == "Cast"
           and len(local.node.operands) == 1 and local.node.operands[0].type == local.type):
        local = local.node.operands[0]
    return local


def build_spmd_graph(graph: Graph, assignment: ParallelAssignment, options: SplitOptions,
                     fusion_ids: dict[str, int], watch: dict[int, Value | None] | None = None
                     ) -> tuple[Graph, list[Any]]:
    """The one local graph every rank runs (rank differences as `ir.rank` values), and the
    layouts of its outputs. `watch` (id of a value of `graph` -> None) receives the local
    value each of those became, as made (before any redistribution for a user)."""
    builder = RankBuilder(graph, assignment, None, options, fusion_ids)
    local = builder.build()
    note_locals(builder, watch)
    return local, builder.output_layouts


def note_locals(builder: RankBuilder, watch: dict[int, Value | None] | None) -> None:
    if watch is None:
        return
    for key in watch:
        made = builder.local.get(key)
        watch[key] = made[0] if made is not None else None


class _StagedBuilder(RankBuilder):
    """`RankBuilder` that records which forward op each local node was made for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.origin: dict[Node, Node] = {}  # local node -> the forward op it was made for

    def lower_node(self, node: Node) -> None:
        start = len(self.graph.nodes)
        super().lower_node(node)
        for made in self.graph.nodes[start:]:
            self.origin[made] = node


def build_staged_spmd_graph(graph: Graph, assignment: ParallelAssignment, options: SplitOptions,
                            fusion_ids: dict[str, int], node_stage: dict[Node, int],
                            watch: dict[int, Any] | None = None
                            ) -> tuple[Graph, list[Any], dict[Node, int]]:
    """`build_spmd_graph` that also returns the stage of each local node (that
    of the forward op it was made for; `node_stage`: the forward ops')."""
    builder = _StagedBuilder(graph, assignment, None, options, fusion_ids)
    local = builder.build()
    note_locals(builder, watch)
    stages = {made: node_stage[op] for made, op in builder.origin.items()
              if op in node_stage}
    return local, builder.output_layouts, stages


def build_rank_graphs(graph: Graph, assignment: ParallelAssignment, options: SplitOptions,
                      fusion_ids: dict[str, int]) -> tuple[list[Graph], list[Any]]:
    """`build_spmd_graph` as the list of what every rank runs (the same graph, once per rank)."""
    local, layouts = build_spmd_graph(graph, assignment, options, fusion_ids)
    return [local] * options.devices, layouts


@dataclass(frozen=True)
class SplitPassOptions:
    """What `step_parallel_end` needs besides the unit: each parameter's facts, whether
    output 0 is the loss autodiff seeds (the standard training form), the forward values a
    custom bprop reads (their local values are recorded in `unit.bprop_locals`), and the
    parameters whose gradient reduction the shrunk check pins (None: decided here)."""

    parameters: Mapping[str, ParameterFacts]
    seeded_loss: bool = False
    bprop_values: tuple[Value, ...] = ()
    pinned_reductions: tuple[str, ...] | None = None


def _virtual_output(unit: CompileUnit) -> str | None:
    """MindSpore inserts `_VirtualOutput` after every output of a prediction (a program that
    does not train) in semi_auto_parallel and auto_parallel. Not where a `cross_batch`
    reduction makes the ranks' results differ: each rank keeps its own result's slice (a
    gathered output would join parts no one program computes)."""
    if unit.backward or unit.pipelined or unit.parallel_mode not in ("semi_auto_parallel",
                                                                      "auto_parallel"):
        return None
    assert unit.graph is not None
    if any(n.attrs.get("cross_batch") for n in unit.graph.nodes):
        return None
    return "full_batch" if unit.options.dataset_strategy == "full_batch" else "data_parallel"


class StepParallelEndPass:
    """`step_parallel_end`: one local forward graph per rank: slices, redistributions,
    forward communication, mirrors."""

    name = "step_parallel_end"
    appends_only = False

    def __init__(self, options: SplitPassOptions) -> None:
        self.options = options

    def apply(self, unit: CompileUnit) -> None:
        from pcompile.passes.optimizer_shard import optimizer_sharding

        assert unit.graph is not None and unit.assignment is not None
        opts = unit.options
        options = SplitOptions(
            devices=unit.stage_devices,
            training=unit.backward,
            gradients_mean=opts.gradients_mean,
            loss_repeated_mean=opts.loss_repeated_mean,
            enable_alltoall=opts.enable_alltoall,
            gradient_fp32_sync=opts.gradient_fp32_sync,
            seeded_loss=self.options.seeded_loss,
            virtual_output=_virtual_output(unit),
        )
        parameters = self.options.parameters
        fusion = {name: p.comm_fusion for name, p in parameters.items()}
        options.opt_shard = optimizer_sharding(unit, unit.assignment.param_layouts, parameters,
                                               opts.optimizer_shard)
        unit.opt_shard = dict(options.opt_shard)
        if options.training:
            options.reductions = plan_cotangent_reductions(
                unit.graph, unit.assignment, options.opt_shard,
                forced=self.options.pinned_reductions)
            unit.reduced_parameters = tuple(sorted(options.reductions.param_axes))
        for name, shard in options.opt_shard.items():
            unit.assignment.param_layouts[name] = shard.stored
        watch: dict[int, Value | None] = {id(v): None for v in self.options.bprop_values}
        if unit.pipelined:  # the stage of every local node
            pipeline = unit.pipeline
            assert pipeline is not None and pipeline.stage_map is not None
            graph, layouts, pipeline.local_stage = build_staged_spmd_graph(
                unit.graph, unit.assignment, options, fusion,
                pipeline.stage_map.node_stage, watch)
        else:
            graph, layouts = build_spmd_graph(unit.graph, unit.assignment, options, fusion,
                                              watch)
        unit.bprop_locals = watch
        unit.rank_graphs = [graph] * unit.devices
        unit.output_layouts = layouts
        unit.split = True
