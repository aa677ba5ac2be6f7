"""The user's optimizer (`nn.Momentum`, `nn.AdamWeightDecay`, ...) traced into a graph that
already computes the loss and gradients: the front end's half of the `optimizer` pass
(`passes/optimizer.py` appends the update through `trace_update`, lays out the states and
completes whole-parameter sums over the slices). `append_optimizer` is both halves on one
graph: after it the graph is one training step, returning the loss, then the new value of
every trainable parameter, then the new optimizer state; `graph.attrs["outputs"]` names each
returned value (`loss`, the parameter names, `moments.w`, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pcompile.compiler.frontend import ops
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.compiler.frontend.tracing import current_tracer, tracing
from pcompile.ir.core import Graph, GraphParam, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.types import DType, TensorType
from pcompile.passes.optimizer import RankSum, StateSlicer


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
    """`slice_sum` for a rank's local graph (`passes.optimizer.RankSum` on front-end tensors):
    `total(local, owner)` divides a rank's partial sum over its slice of a parameter by the
    ranks holding that same slice and adds it over all ranks; `total(local, owner, along)`
    completes a partial sum over the parameter dims `along` over the ranks that split them."""
    return tensor_sum(RankSum(graph, devices, layouts))


def tensor_sum(summer: RankSum) -> Callable[..., Tensor]:
    """`summer` on the front end's tensors, in the tracer's current scope."""

    def total(local: Tensor, owner: str, along: tuple[int, ...] | None = None) -> Tensor:
        tracer = current_tracer()
        scope = tracer.scope if tracer is not None else ""
        if along is not None:
            return Tensor(_value=summer.along(_value_of(local, owner), owner, scope, along))
        copies = summer.copies(owner)
        if copies > 1:
            local = local * (1.0 / copies)
        return Tensor(_value=summer.whole(_value_of(local, owner), owner, scope))

    return total


def _value_of(tensor: Tensor, what: str) -> Value:
    if not isinstance(tensor, Tensor) or not tensor.is_symbolic or tensor._value is None:
        raise PcompileError(f"optimizer update of {what!r} did not produce a traced tensor")
    return tensor._value
