"""Assignments to a Parameter: `P.Assign`, `P.AssignAdd`, `P.AssignSub` (`ops.assign`,
`ops.assign_add`, `ops.assign_sub`).

MindSpore updates the Parameter in place. pcompile traces the update as a pure op whose result
is the Parameter's new value (`ir/ops/state.py`) and keeps the newest value per Parameter in
the tracer (`Tracer.assigned`): later reads of the Parameter in the trace get it, and the
forward graph returns it, after its own outputs, under the Parameter's name
(`graph.attrs["assigned"]`, `finish_assignments`). The training passes keep those outputs
after the loss, the gradients and the optimizer's updates, so that the step's runtime stores
the new value as it stores an updated weight: in the numpy reference backend, in the JAX rank
programs (kept on the device between steps), in checkpoints and `--resume`.

In a training step cell, an assignment after the gradients (the step's own state: a smoothed
loss, a loss scale) is the step's own update (`compiler.train_step.Replay.assign`).
"""

from __future__ import annotations

from typing import Any

from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.compiler.frontend.tracing import current_tracer, name_hint, user_source
from pcompile.ir.core import Graph, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.ops.state import ASSIGNED

_SPELLING = {"Assign": "ops.assign", "AssignAdd": "ops.assign_add", "AssignSub": "ops.assign_sub"}


def _where(source: Any, scope: str) -> str:
    place = f"{source.file}:{source.line}" if source is not None else "the model file"
    return f"at {place} (cell {scope})"


def assign_parameter(prim: Any, variable: Any, value: Any) -> Any:
    """`prim(variable, value)` for Assign, AssignAdd and AssignSub: the variable's new value
    (a Tensor), recorded as the Parameter's value from here on."""
    from pcompile.compiler.frontend.primitive import _eager
    from pcompile.compiler.frontend.train_step import Capture, Replay, current_step

    op = prim.op
    tracer = current_tracer()
    if not isinstance(variable, Parameter):
        source = user_source()
        where = _where(source, tracer.scope) if tracer is not None else ""
        raise PcompileError(
            f"{op}: the variable must be a Parameter, got {type(variable).__name__} {where}; "
            f"{_SPELLING[op]} updates a Parameter (a plain tensor has no value to update)")
    if tracer is None:  # eager: the Parameter's data is updated
        result = _eager(op, [variable, _value_like(value, variable)], {}, prim)
        variable.set_data(result.asnumpy())
        return variable
    step = current_step()
    if isinstance(step, Replay):  # the training step cell's own state, after its gradients
        if op == "Assign":
            return step.assign(variable, value)
        from pcompile.compiler.frontend.ops import Add, Sub

        new = (Add if op == "AssignAdd" else Sub)()(variable, _value_like(value, variable))
        return step.assign(variable, new)
    source = user_source()
    assert variable.name is not None
    if variable.requires_grad:
        raise PcompileError(
            f"{op} updates Parameter {variable.name!r} {_where(source, tracer.scope)}, "
            "which the optimizer also trains; a Parameter updated by the network's forward "
            "computation (a running statistic, an expert-load count) is state, not a weight: "
            "create it with requires_grad=False")
    target = tracer.to_value(variable, None)
    new = tracer.to_value(_value_like(value, variable), variable.dtype)
    if new.dtype != target.dtype:  # MindSpore converts the value to the variable's dtype
        new = tracer.builder.emit("Cast", [new], {"dst_type": target.dtype},
                                  instance_name=tracer.next_instance_name("Cast"),
                                  scope=tracer.scope, source=source,
                                  name_hint=name_hint(source))
    user_attrs: dict[str, Any] = dict(prim.user_attrs)
    if prim.in_strategy is not None:
        prim._check_strategy(op, [target, new], tracer.scope, source)
        from pcompile.compiler.frontend.primitive import attr_value

        user_attrs["in_strategy"] = attr_value(prim.in_strategy)
    result = tracer.builder.emit(
        op, [target, new], {}, instance_name=prim.instance_name or tracer.next_instance_name(op),
        scope=tracer.scope, source=source, name_hint=name_hint(source),
        user_attrs=user_attrs or None)
    # In a step cell's first trace, what its construct does outside the network (before
    # asking for gradients) is traced again after the split: only the network's count here.
    if not (isinstance(step, Capture) and step.depth == 0):
        tracer.assigned[id(variable)] = (variable.name, result)
    return Tensor(_value=result)


def _value_like(value: Any, variable: Parameter) -> Any:
    """A Python number becomes a constant of the variable's dtype."""
    if isinstance(value, (bool, int, float)):
        import numpy as np

        return Tensor(np.asarray(value, variable.dtype.np))
    return value


def finish_assignments(tracer: Any, graph: Graph) -> None:
    """Append the newest value of every Parameter the trace assigned to `graph.outputs`, and
    name them in `graph.attrs["assigned"]` (after the graph's own outputs, in the order of
    their first assignment)."""
    if not tracer.assigned:
        return
    names = tuple(name for name, _ in tracer.assigned.values())
    values: list[Value] = [value for _, value in tracer.assigned.values()]
    graph.outputs = [*graph.outputs, *values]
    graph.attrs[ASSIGNED] = names
