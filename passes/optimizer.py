"""`optimizer`: the update of every trainable parameter appended after its gradient.

After `autodiff` a graph returns the loss and one gradient per trainable parameter
(`graph.attrs["outputs"]`: `loss`, `grad.<name>`, ...). This pass appends the optimizer's
update and makes the graph one training step: it returns the loss, then the new value of every
trainable parameter, then the new optimizer state, each named in `graph.attrs["outputs"]`
(`loss`, the parameter names, `moments.w`, ...), which is how runtimes write the results back.

The update's arithmetic is the user's optimizer (`nn.Momentum`, `nn.AdamWeightDecay`, ...),
traced by the front end: the pass receives it as an `UpdateTracer`. What is parallel is here:

* in a rank's local graph an optimizer state of a parameter takes that parameter's layout (its
  local shape is the parameter's slice shape), and a factored state (AdaFactor's row and column
  statistics) is split as the parameter dims it follows (`state_slicer`);
* a sum over a whole parameter (Lamb's norms, AdaFactor's RMS) is a rank's partial sum over its
  slice completed by an AllReduce (`RankSum`).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, ParallelInfo, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout, axis_index, group_name, map_axes
from pcompile.ir.rank import GroupName, RankGroup
from pcompile.passes.unit import CompileUnit


class StateSlicer(Protocol):
    """The local shape of an optimizer state in a rank's graph: `(state name, parameter name
    ("" for a global state), its global value, the parameter dim each of its dims follows
    (None: its parameter's shape))`."""

    def __call__(self, name: str, owner: str, value: Any,
                 dims: tuple[int | None, ...] | None = None) -> tuple[int, ...]: ...


#: `(graph, gradients by parameter name, state slicer or None, whole-parameter summer or
#: None) -> (initial values of the new states, (name, new value) of every parameter then every
#: state)`: the user's optimizer traced into `graph` (the front end's).
UpdateTracer = Callable[[Graph, dict[str, Value], "StateSlicer | None", "RankSum | None"],
                        tuple[dict[str, Any], list[tuple[str, Value]]]]


@dataclass(frozen=True)
class OptimizerOptions:
    """`trace`: the user's update (see `UpdateTracer`); `initial_values`: where the initial
    value of every new state is recorded (global values; a rank makes its block from them)."""

    trace: UpdateTracer
    initial_values: MutableMapping[str, Any]


class OptimizerPass:
    name = "optimizer"
    appends_only = True

    def __init__(self, options: OptimizerOptions) -> None:
        self.options = options

    def apply(self, unit: CompileUnit) -> None:
        for graph in unit.graphs:
            names = graph.attrs["outputs"]
            loss: Value = graph.outputs[0]
            grads = {n[len("grad."):]: v for n, v in zip(names[1:], graph.outputs[1:])
                     if n.startswith("grad.")}
            assigned = [(n, v) for n, v in zip(names[1:], graph.outputs[1:])
                        if not n.startswith("grad.")]
            slicer = state_slicer(unit, self.options.initial_values) if unit.parallel else None
            summer = (RankSum(graph, unit.devices, unit.assignment.param_layouts)
                      if unit.parallel and unit.assignment is not None else None)
            init, updates = self.options.trace(graph, grads, slicer, summer)
            # then the Parameters the forward assigned (stored like the updated weights)
            updates = [*updates, *assigned]
            graph.outputs = [loss, *(value for _, value in updates)]
            graph.attrs["outputs"] = ("loss", *(name for name, _ in updates))
            if not unit.parallel:
                self.options.initial_values.update(init)


def state_slicer(unit: CompileUnit, initial_values: MutableMapping[str, Any]) -> StateSlicer:
    """Optimizer state in a local graph: a per-parameter state takes its parameter's layout
    (its local shape is the parameter's slice shape); the global value is recorded in
    `initial_values`, abstract, and each rank's slice is made from it when needed."""
    assert unit.assignment is not None
    layouts = unit.assignment.param_layouts

    def cut(name: str, owner: str, value: Any,
            dims: tuple[int | None, ...] | None = None) -> tuple[int, ...]:
        initial_values.setdefault(name, value)
        if not owner:
            return tuple(value.shape)
        unit.state_owners[name] = owner
        if dims is None:
            layouts.setdefault(name, layouts[owner])
            return layouts[owner].slice_shape
        # a factored state: each of its dims is split as the parameter dim it follows (None:
        # not split)
        owner_layout = layouts[owner]
        layout = TensorLayout(owner_layout.dev_matrix,
                              tuple(-1 if d is None else owner_layout.tensor_map[d]
                                    for d in dims), tuple(value.shape))
        layouts.setdefault(name, layout)
        return layouts[name].slice_shape

    return cut


class RankSum:
    """Sums over a whole parameter in a rank's local graph, in two steps so that the front end
    scales with its own arithmetic: `copies(owner)` ranks hold the same slice of a parameter,
    so a rank's partial sum over its slice is divided by it, then `whole(local, owner, scope)`
    sums it by an AllReduce over all ranks (every rank computes every parameter's sum, in the
    same order). `along(local, owner, scope, dims)`: `local` is a partial sum over the
    parameter dims `dims` (a row mean of AdaFactor's); it is completed by an AllReduce over
    only the ranks that split those dims (the ranks holding the other slices of the same rows),
    or returned as it is when none does."""

    def __init__(self, graph: Graph, devices: int, layouts: dict[str, TensorLayout]) -> None:
        self.graph, self.devices, self.layouts = graph, devices, layouts

    def copies(self, owner: str) -> int:
        layout = self.layouts.get(owner)
        return layout.repeat_count if layout is not None else self.devices

    def whole(self, local: Value, owner: str, scope: str) -> Value:
        ranks = tuple(range(self.devices))
        return Builder(self.graph, scope=scope).emit(
            "AllReduce", [local],
            {"op": "sum", "group": group_name(ranks, self.devices), "rank_list": ranks,
             "fusion": 0},
            instance_name=f"optimizer_sum_{owner}", name_hint="whole_sum",
            parallel=ParallelInfo(
                reason=f"the optimizer's sum over every slice of {owner!r}: each rank's "
                       "partial sum (divided by the ranks holding the same slice) added over "
                       "all ranks",
                bytes=local.tensor_type.nbytes))

    def along(self, local: Value, owner: str, scope: str, along: tuple[int, ...]) -> Value:
        layout = self.layouts.get(owner)
        if layout is None:
            return local
        axes = sorted({axis_index(v, layout.dev_matrix)
                       for d in along for v in map_axes(layout.tensor_map[d])})
        if not axes:
            return local
        if layout.device_num != self.devices:
            raise PcompileError(
                f"the optimizer's partial sums of {owner!r} need its layout over all "
                f"{self.devices} devices, got device matrix {layout.dev_matrix}")
        group = RankGroup.along(layout.dev_matrix, axes)
        rank = self.graph.attrs.get("rank")
        attrs: dict[str, Any] = {"op": "sum", "fusion": 0}
        if isinstance(rank, int):
            members = group.at(rank)
            attrs.update(group=group_name(members, self.devices), rank_list=members)
        else:
            attrs.update(group=GroupName(group), rank_list=group)
        dims = ", ".join(str(d) for d in along)
        return Builder(self.graph, scope=scope).emit(
            "AllReduce", [local], attrs,
            instance_name=f"optimizer_sum_{owner}_dims_{'_'.join(map(str, along))}",
            name_hint="partial_sum",
            parallel=ParallelInfo(
                reason=f"the optimizer's sum over dims ({dims}) of {owner!r}: added over the "
                       "ranks holding the other slices of those dims",
                bytes=local.tensor_type.nbytes))
