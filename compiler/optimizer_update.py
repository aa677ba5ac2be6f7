"""Appends the optimizer update to a graph that already computes the loss and gradients.

The update is the user's optimizer (`nn.Momentum`, `nn.AdamWeightDecay`, ...) traced through
the front end into the rank's local graph, so this module belongs to the front end (compiler/),
not to the passes, which never import it. After it the graph is one training step: it returns
the loss, then the new value of every trainable parameter, then the new optimizer state;
`graph.attrs["outputs"]` names each returned value (`loss`, the parameter names, `moments.w`,
...), which is how runtimes write the results back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from pcompile.compiler import ops
from pcompile.compiler.nn.optim_base import Optimizer
from pcompile.compiler.tensor import Parameter, Tensor
from pcompile.compiler.tracing import current_tracer, tracing
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, ParallelInfo, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout, axis_index, group_name, map_axes
from pcompile.ir.rank import GroupName, RankGroup
from pcompile.ir.types import DType, TensorType


class StateSlicer(Protocol):
    """The local shape of an optimizer state in a rank's graph (`append_optimizer`)."""

    def __call__(self, name: str, owner: str, value: Any,
                 dims: tuple[int | None, ...] | None = None) -> tuple[int, ...]: ...


def append_optimizer(
    graph: Graph,
    optimizer: Optimizer,
    params: dict[str, Parameter],
    grads: dict[str, Value],
    loss: Value,
    slice_state: StateSlicer | None = None,
    slice_sum: Callable[[Tensor, str], Tensor] | None = None,
) -> dict[str, Any]:
    """Trace `optimizer` into `graph`; returns the initial values of the new state tensors.

    Initial values may be arrays or abstract data (anything with `shape` and `dtype`, such as
    `compiler.initializer.InitializedData`); they are returned as given. In a rank's local
    graph, `slice_state(state_name, param_name, global_value)` gives the local shape of a
    per-parameter state (the parameter's slice; global state has param_name ""); a state whose
    shape is not its parameter's (`Optimizer.state_dims`) is sliced by
    `slice_state(state_name, param_name, global_value, dims)`."""
    init, updates = trace_update(graph, optimizer, params, grads, slice_state,
                                 slice_sum=slice_sum)
    graph.outputs = [loss, *(value for _, value in updates)]
    graph.attrs["outputs"] = ("loss", *(name for name, _ in updates))
    return init


def trace_update(
    graph: Graph,
    optimizer: Optimizer,
    params: dict[str, Parameter],
    grads: dict[str, Value],
    slice_state: StateSlicer | None = None,
    skip: Value | None = None,
    slice_sum: Callable[[Tensor, str], Tensor] | None = None,
) -> tuple[dict[str, Any], list[tuple[str, Value]]]:
    """Trace one update of `optimizer` into `graph` from `grads` (by parameter name): returns
    the initial values of the new state tensors and `(name, new value)` of every updated
    parameter, then of every state, in that order. With `skip` (a Bool scalar), every new value
    is `Select(skip, old value, new value)`: the whole update, its step counters included, is
    skipped when `skip` is true (MindSpore's loss-scale cells on overflow). `slice_sum` (a
    rank's local graph: `rank_sum`) completes the per-parameter sums of `Optimizer.whole_sum`
    (Lamb's norms, AdaFactor's RMS) over the parameter's slices."""
    known = {id(p) for p in params.values()}
    for p in optimizer.parameters:
        if id(p) not in known:
            raise PcompileError(
                f"{type(optimizer).__name__} was given parameter {p.name!r}, which is not a "
                "parameter of the network"
            )
    init: dict[str, Any] = {}
    updates: list[tuple[str, Value]] = []
    new_states: list[tuple[str, Value]] = []
    olds: dict[str, Value] = {}
    scope = f"Default/optimizer-{type(optimizer).__name__}"
    object.__setattr__(optimizer, "_slice_sum", slice_sum)
    try:
        return _trace_update(graph, optimizer, grads, slice_state, skip, init, updates,
                             new_states, olds, scope)
    finally:
        object.__setattr__(optimizer, "_slice_sum", None)


def _trace_update(graph: Graph, optimizer: Optimizer, grads: dict[str, Value],
                  slice_state: StateSlicer | None,
                  skip: Value | None, init: dict[str, Any], updates: list[tuple[str, Value]],
                  new_states: list[tuple[str, Value]], olds: dict[str, Value], scope: str,
                  ) -> tuple[dict[str, Any], list[tuple[str, Value]]]:
    with tracing(graph) as tracer, tracer.absolute_scope(scope):

        def state_param(name: str, value: Any, owner: str = "",
                        dims: tuple[int | None, ...] | None = None) -> Tensor:
            if not (hasattr(value, "shape") and hasattr(value, "dtype")):
                value = np.asarray(value)
            shape = tuple(value.shape)
            if slice_state is not None:
                shape = tuple(slice_state(name, owner, value, dims) if dims is not None
                              else slice_state(name, owner, value))
            tensor_type = TensorType(DType.from_any(value.dtype), shape)
            gp = graph.add_param(GraphParam(tensor_type, name, "state"))
            init[name] = value
            olds[name] = gp
            return Tensor(_value=gp)

        global_in = {k: state_param(k, v) for k, v in optimizer.global_state().items()}
        global_new = optimizer.update_global(dict(global_in))
        for p in optimizer.parameters:
            if not p.requires_grad:
                continue
            assert p.name is not None
            if p.name not in grads:
                raise PcompileError(f"no gradient for parameter {p.name!r}")
            state = {
                prefix: state_param(f"{prefix}.{p.name}", optimizer.init_state(prefix, p), p.name,
                                    optimizer.state_dims(prefix, p))
                for prefix in optimizer.state_prefixes
            }
            weight = Tensor(_value=graph.param(p.name))
            olds[p.name] = weight._value  # type: ignore[assignment]
            with optimizer.learning_rate_for(weight.dtype):
                new_param, new_state = optimizer.update(
                    weight, Tensor(_value=grads[p.name]), state, global_new
                )
            updates.append((p.name, _value_of(new_param, p.name)))
            for prefix in optimizer.state_prefixes:
                new_states.append((f"{prefix}.{p.name}", _value_of(new_state[prefix], prefix)))
        for name, tensor in global_new.items():
            new_states.append((name, _value_of(tensor, name)))
        updates += new_states
        if skip is not None:
            cond = Tensor(_value=skip)
            if cond.shape != ():
                cond = cond.reshape(())
            updates = [(name, _value_of(ops.select(cond, Tensor(_value=olds[name]),
                                                   Tensor(_value=value)), name))
                       for name, value in updates]
    return init, updates


def rank_sum(graph: Graph, devices: int,
             layouts: dict[str, TensorLayout]) -> Callable[..., Tensor]:
    """`slice_sum` for a rank's local graph. `total(local, owner)`: the rank's partial sum over
    its slice of a parameter, divided by the number of ranks holding that same slice, summed by
    an AllReduce over all ranks (every rank computes every parameter's sum, in the same order).
    `total(local, owner, along)`: `local` is a partial sum over the parameter dims `along` (a
    row mean of AdaFactor's); it is completed by an AllReduce over only the ranks that split
    those dims (the ranks holding the other slices of the same rows), or returned as it is when
    none does."""
    ranks = tuple(range(devices))

    def total(local: Tensor, owner: str, along: tuple[int, ...] | None = None) -> Tensor:
        layout = layouts.get(owner)
        if along is not None:
            return _sum_along(graph, devices, local, owner, layout, along)
        copies = layout.repeat_count if layout is not None else devices
        if copies > 1:
            local = local * (1.0 / copies)
        value = local._value
        assert value is not None
        tracer = current_tracer()
        b = Builder(graph, scope=tracer.scope if tracer is not None else "")
        out = b.emit("AllReduce", [value],
                     {"op": "sum", "group": group_name(ranks, devices), "rank_list": ranks,
                      "fusion": 0},
                     instance_name=f"optimizer_sum_{owner}", name_hint="whole_sum",
                     parallel=ParallelInfo(
                         reason=f"the optimizer's sum over every slice of {owner!r}: each "
                                "rank's partial sum (divided by the ranks holding the same "
                                "slice) added over all ranks",
                         bytes=value.tensor_type.nbytes))
        return Tensor(_value=out)

    return total


def _sum_along(graph: Graph, devices: int, local: Tensor, owner: str,
               layout: TensorLayout | None, along: tuple[int, ...]) -> Tensor:
    """`local` summed over the ranks that split parameter `owner`'s dims `along`."""
    if layout is None:
        return local
    axes = sorted({axis_index(v, layout.dev_matrix)
                   for d in along for v in map_axes(layout.tensor_map[d])})
    if not axes:
        return local
    if layout.device_num != devices:
        raise PcompileError(
            f"the optimizer's partial sums of {owner!r} need its layout over all {devices} "
            f"devices, got device matrix {layout.dev_matrix}")
    group = RankGroup.along(layout.dev_matrix, axes)
    rank = graph.attrs.get("rank")
    attrs: dict[str, Any] = {"op": "sum", "fusion": 0}
    if isinstance(rank, int):
        members = group.at(rank)
        attrs.update(group=group_name(members, devices), rank_list=members)
    else:
        attrs.update(group=GroupName(group), rank_list=group)
    value = local._value
    assert value is not None
    tracer = current_tracer()
    b = Builder(graph, scope=tracer.scope if tracer is not None else "")
    dims = ", ".join(str(d) for d in along)
    out = b.emit("AllReduce", [value], attrs,
                 instance_name=f"optimizer_sum_{owner}_dims_{'_'.join(map(str, along))}",
                 name_hint="partial_sum",
                 parallel=ParallelInfo(
                     reason=f"the optimizer's sum over dims ({dims}) of {owner!r}: added "
                            "over the ranks holding the other slices of those dims",
                     bytes=value.tensor_type.nbytes))
    return Tensor(_value=out)


def _value_of(tensor: Tensor, what: str) -> Value:
    if not isinstance(tensor, Tensor) or not tensor.is_symbolic or tensor._value is None:
        raise PcompileError(f"optimizer update of {what!r} did not produce a traced tensor")
    return tensor._value
