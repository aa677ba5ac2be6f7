"""Assignments to a Parameter in the forward computation: Assign, AssignAdd, AssignSub.

MindSpore's `P.Assign()(variable, value)`, `P.AssignAdd()(variable, value)` and
`P.AssignSub()(variable, value)` update a Parameter in place; the new value is what later reads
of the Parameter see, and what the next step starts from. In the IR an assignment is a pure op
whose result is the variable's new value (`value`, `variable + value`, `variable - value`,
`value` broadcast to the variable's shape); the front end makes that result the value later
reads of the Parameter get, and the graph returns the last one under the Parameter's name
(`graph.attrs["assigned"]`), so that the step's runtime stores it (see docs/state.md).

Sharding: MindSpore's `AssignInfo`, `AssignAddInfo` and `AssignSubInfo` are `ArithmeticBase`
ops, so the element-wise rule with broadcasting; the stored value takes the Parameter's own
layout whatever the op's strategy (a redistribution at the step's end where they differ).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Node, NodeResult, Value
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.ops._define import elementwise
from pcompile.ir.ops._jax import jnp
from pcompile.ir.ops._util import broadcast_shapes, same_dtype, tensor, unbroadcast
from pcompile.ir.registry import ALL, NUMERIC
from pcompile.ir.types import DType, TensorType, ValueType

#: the graph attribute naming the Parameters whose new values are the graph's last outputs
ASSIGNED = "assigned"


def assigned_names(graph: Graph) -> tuple[str, ...]:
    """The Parameters whose new values are `graph`'s last outputs, in order."""
    return tuple(graph.attrs.get(ASSIGNED, ()))


def split_assigned(graph: Graph) -> tuple[list[Value], list[Value]]:
    """`graph`'s outputs: (its own, the assigned Parameters' new values)."""
    count = len(assigned_names(graph))
    cut = len(graph.outputs) - count
    return list(graph.outputs[:cut]), list(graph.outputs[cut:])


#: the ops whose result is a Parameter's new value
ASSIGN_OPS = frozenset({"Assign", "AssignAdd", "AssignSub"})


def batch_assigned_names(graph: Graph) -> tuple[str, ...]:
    """The assigned Parameters whose assignment reads the graph's inputs (the batch): the
    others (a step counter's AssignAdd(counter, 1), statistics summed over every rank by an
    AllReduce of the world group) compute the same on every rank."""
    from pcompile.ir.layout import WORLD_GROUP

    batch: set[int] = {id(p) for p in graph.inputs}
    for node in graph.nodes:
        if node.op == "AllReduce" and node.attrs.get("group") == WORLD_GROUP:
            continue  # every rank holds the same sum
        if any(id(v) in batch for v in node.operands):
            batch.add(id(node.result))
    names: list[str] = []
    for node in graph.nodes:
        if node.op not in ASSIGN_OPS or id(node.result) not in batch:
            continue
        target = node.operands[0]
        while isinstance(target, NodeResult) and target.node.op in ASSIGN_OPS:
            target = target.node.operands[0]
        if isinstance(target, GraphParam) and target.name not in names:
            names.append(target.name)
    return tuple(names)


def assignment_sites(graph: Graph, names: tuple[str, ...] | None = None) -> list[str]:
    """Where the forward assigns each Parameter of `names` (default: every assigned one), as
    "AssignAdd 'assign_add' of Parameter 'load' at model.py:12 (cell Default/network-Net)"."""
    wanted = set(assigned_names(graph) if names is None else names)
    sites: list[str] = []
    for node in graph.nodes:
        if node.op not in ASSIGN_OPS:
            continue
        target = node.operands[0]
        while isinstance(target, NodeResult) and target.node.op in ASSIGN_OPS:
            target = target.node.operands[0]  # an assignment of an assigned value
        name = target.name if isinstance(target, GraphParam) else ""
        if name in wanted:
            place = str(node.source) if node.source is not None else "an unknown line"
            sites.append(f"{node.op} '{node.instance_name}' of Parameter {name!r} at {place} "
                         f"(cell {node.scope})")
    return sites


def refuse_assignments(graph: Graph, why: str, names: tuple[str, ...] | None = None) -> None:
    """One message naming every forward assignment of `graph` (of the Parameters `names`,
    default every assigned one), when it has any: `why` says what cannot hold them."""
    if not (assigned_names(graph) if names is None else names):
        return
    sites = assignment_sites(graph, names)
    raise PcompileError(f"{'; '.join(sites) or 'an assignment to a Parameter'}: {why}")


_TESTS = ("test_ops_state.py::test_assign_ops_match_numpy",
          "test_ops_state.py::test_assign_rules_match_the_oracle")


def _assign_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    variable, value = tensor(types[0], "variable"), tensor(types[1], "value")
    same_dtype([variable, value])
    if broadcast_shapes(variable.shape, value.shape) != variable.shape:
        raise ShapeError(f"the value {value.shape} must broadcast to the variable's shape "
                         f"{variable.shape} (the Parameter keeps its shape)")
    return TensorType(variable.dtype, variable.shape)


def _numeric_assign_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = _assign_infer(types, attrs)
    assert isinstance(out, TensorType)
    if out.dtype is DType.bool_:
        raise ShapeError("needs a numeric variable, got Bool")
    return out


def _assign_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    # the old value is overwritten: only the assigned value carries the gradient
    return [None, unbroadcast(b, cot, node.operands[1].shape)]


def _assign_add_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [cot, unbroadcast(b, cot, node.operands[1].shape)]


def _assign_sub_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [cot, unbroadcast(b, b("Neg", cot), node.operands[1].shape)]


def _np_assign(variable: Any, value: Any) -> Any:
    return np.broadcast_to(np.asarray(value), np.shape(variable)).copy()


_NOTE = ("`Assign`, `AssignAdd` and `AssignSub` (`ops.assign`, `ops.assign_add`, "
         "`ops.assign_sub`) on a Parameter in the network's forward computation give its new "
         "value: later reads of the Parameter in the step see it, and the step returns it under "
         "the Parameter's name, stored in the Parameter's own layout (a redistribution at the "
         "end of the step where the op's strategy lays it out otherwise), checkpointed and "
         "resumed with the other stored values (docs/state.md). A Parameter the optimizer "
         "trains cannot also be assigned in the forward (requires_grad=False).")

elementwise("Assign", _assign_infer, _np_assign,
            lambda x, y: jnp.broadcast_to(y, jnp.shape(x)),
            vjp=_assign_vjp, num_inputs=2, dtypes=ALL,
            doc="The variable's new value: value broadcast to the variable's shape.",
            operands="variable, value (broadcast) -> new variable", tests=_TESTS, note=_NOTE)

elementwise("AssignAdd", _numeric_assign_infer, lambda x, y: np.add(x, y),
            lambda x, y: jnp.add(x, y), vjp=_assign_add_vjp, num_inputs=2, dtypes=NUMERIC,
            doc="The variable's new value: variable + value.",
            operands="variable, value (broadcast) -> new variable", tests=_TESTS)

elementwise("AssignSub", _numeric_assign_infer, lambda x, y: np.subtract(x, y),
            lambda x, y: jnp.subtract(x, y), vjp=_assign_sub_vjp, num_inputs=2,
            dtypes=NUMERIC, doc="The variable's new value: variable - value.",
            operands="variable, value (broadcast) -> new variable", tests=_TESTS)
