"""`recompute`: forward values marked for recomputation are computed again for the backward
pass instead of being kept alive until it (MindSpore's `Primitive.recompute()` and
`Cell.recompute()`; JAX's `jax.checkpoint`).

A forward node is *recomputable* when it carries `recompute: true` (or is a TupleGetItem of
one). For every backward node (scope `Gradients/...`) that reads a recomputable value, the
pass makes a copy of the value's recomputable producers, back to the values they were
computed from (the *checkpoints*: inputs, parameters, kept activations), marks each copy
`duplicated: true`, and points the backward node at the copy. Copies are made once, at the
first backward node that needs them, and placed right before it.

Each checkpoint enters the copies through `Depend(checkpoint, trigger)`, the trigger being a
backward value of that first backward node (its incoming gradient). The JAX lowering of Depend
is `lax.optimization_barrier`: XLA can then neither start the recomputation before the backward
pass reaches it nor merge it with the forward computation it repeats, so the forward values
die after their forward uses and only the checkpoints live until the backward pass: what
`jax.checkpoint` achieves with its rematerialisation, here on the IR because pcompile's
backward pass is the IR's own (autodiff after the parallel split), not JAX's. Values read by
anything else (the optimizer, a training step's own computations) are not copied.
"""

from __future__ import annotations

from pcompile.ir.core import Constant, Graph, Node, NodeResult, ParallelInfo, Value
from pcompile.passes.unit import CompileUnit

BACKWARD_SCOPE = "Gradients/"


def is_backward(node: Node) -> bool:
    return node.scope.startswith(BACKWARD_SCOPE)


def saved_forward_values(graph: Graph) -> list[NodeResult]:
    """The forward node results the backward pass reads (what a step keeps between its
    forward and backward computations), each once; recomputed copies are not forward values."""
    seen: set[int] = set()
    out: list[NodeResult] = []
    for node in graph.nodes:
        if not is_backward(node):
            continue
        for value in node.operands:
            if (isinstance(value, NodeResult) and not is_backward(value.node)
                    and not value.node.attrs.get("duplicated") and id(value) not in seen):
                seen.add(id(value))
                out.append(value)
    return out


def recomputable(node: Node) -> bool:
    """A forward node whose result the backward pass recomputes."""
    if is_backward(node) or node.attrs.get("duplicated"):
        return False
    if node.op == "TupleGetItem":
        producer = node.operands[0]
        return isinstance(producer, NodeResult) and recomputable(producer.node)
    return node.attrs.get("recompute") is True


def marked(graph: Graph) -> bool:
    """Whether any node of `graph` is marked for recomputation."""
    return any(node.attrs.get("recompute") is True for node in graph.nodes)


class _Recomputer:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.copies: dict[int, Value] = {}  # id(original result) -> its copy
        self.barriers: dict[tuple[int, int], Value] = {}  # (id(checkpoint), id(trigger))
        self.count = 0

    def copy(self, node: Node, before: Node, trigger: Value | None) -> Value:
        key = id(node.result)
        if key in self.copies:
            return self.copies[key]
        operands = []
        for value in node.operands:
            if isinstance(value, NodeResult) and recomputable(value.node):
                operands.append(self.copy(value.node, before, trigger))
            else:
                operands.append(self.checkpoint(value, before, trigger))
        clone = Node(node.op, operands, {**node.attrs, "duplicated": True}, node.result.type,
                     instance_name=node.instance_name, scope=node.scope, source=node.source,
                     name_hint=node.result.name_hint, parallel=node.parallel)
        self.graph.insert_before(before, clone)
        self.copies[key] = clone.result
        self.count += 1
        return clone.result

    def checkpoint(self, value: Value, before: Node, trigger: Value | None) -> Value:
        """A kept value as the copies read it: after `trigger` (see the module docstring)."""
        if trigger is None or isinstance(value, Constant):
            return value
        key = (id(value), id(trigger))
        if key not in self.barriers:
            node = Node("Depend", [value, trigger], {}, value.type,
                        instance_name="recompute_depend", scope=before.scope,
                        source=before.source, name_hint="checkpoint",
                        parallel=ParallelInfo(
                            reason="recompute: the recomputed forward values are computed "
                                   "from this kept value once the backward pass reaches "
                                   f"{before.op} '{before.instance_name or before.fullname}'"))
            self.graph.insert_before(before, node)
            self.barriers[key] = node.result
        return self.barriers[key]


def _trigger(node: Node) -> Value | None:
    """A value of the backward pass that `node` reads (its incoming gradient)."""
    for value in node.operands:
        if isinstance(value, NodeResult) and is_backward(value.node):
            return value
    return None


def apply_recompute(graph: Graph) -> int:
    """Rematerialise the recomputable values the backward pass reads; returns how many nodes
    were copied."""
    work = _Recomputer(graph)
    for node in list(graph.nodes):
        if not is_backward(node):
            continue
        for index, value in enumerate(node.operands):
            if isinstance(value, NodeResult) and recomputable(value.node):
                node.set_operand(index, work.copy(value.node, node, _trigger(node)))
    return work.count


__all__ = ["apply_recompute", "is_backward", "marked", "recomputable"]


class RecomputePass:
    """`recompute`: forward values marked `recompute: true` computed again for the backward
    pass; the plan records how many nodes were copied."""

    name = "recompute"
    appends_only = False

    def apply(self, unit: CompileUnit) -> None:
        if not any(marked(graph) for graph in unit.graphs):
            return  # nothing asked for it (an ilp plan that chose no recompute)
        copied = sum(apply_recompute(graph) for graph in unit.graphs)
        unit.plan.recompute = {"recomputed_nodes": copied}
