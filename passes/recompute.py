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

Inside nn.PipelineCell's micro-batches (passes/micro_batch.py) with pipeline stages, `stages`
(node -> virtual stage) and `labels` (node -> ("F" | "B", micro-batch)) of the unit's pipeline
settings are extended to the copies: a copy runs in its forward node's stage, in the backward
unit of its micro-batch (("B", k)), and so does each checkpoint's Depend. A backward node reads
a recomputed copy only of a value of its own stage and micro-batch: a value another stage
computed reaches it by a Receive in the forward unit (recomputing it there would make its stage
wait in its backward for a stage that runs its own backward only after it), and a value no
micro-batch computes (a weight's cast, computed once a step) is kept. So each stage holds, from
a micro-batch's forward to its backward, the checkpoints instead of the recomputed values (the
schedule's 'activation memory per stage').
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


Label = tuple[str, int]


class _Recomputer:
    def __init__(self, graph: Graph, stages: dict[Node, int] | None = None,
                 labels: dict[Node, Label] | None = None) -> None:
        self.graph = graph
        self.stages = stages
        self.labels = labels if labels is not None else {}
        self.copies: dict[int, Value] = {}  # id(original result) -> its copy
        self.barriers: dict[tuple[int, int], Value] = {}  # (id(checkpoint), id(trigger))
        # the nodes made to go right before each backward node, in the order made (appended
        # now, moved into place by one reorder: an insertion per node renumbers the graph's
        # order keys each time the gaps run out, seconds at a 671B model's 16 stages)
        self.pending: dict[Node, list[Node]] = {}
        self.count = 0

    def eligible(self, node: Node, reader: Node) -> bool:
        """Whether `reader` (a backward node, or a copy) takes a recomputed copy of the
        recomputable `node`: always without pipeline stages; with them, only where `node` runs
        in `reader`'s stage and one micro-batch computes it (module docstring)."""
        if not recomputable(node):
            return False
        if self.stages is None:
            return True
        if self.stages.get(node) != self.stages.get(reader):
            return False
        mine, theirs = self.labels.get(node), self.labels.get(reader)
        return mine is not None and theirs is not None and mine[1] == theirs[1]

    def place(self, node: Node, like: Node) -> None:
        """`node` runs where `like` does: its stage, the backward unit of its micro-batch."""
        if self.stages is None:
            return
        if like in self.stages:
            self.stages[node] = self.stages[like]
        label = self.labels.get(like)
        if label is not None:
            self.labels[node] = ("B", label[1])

    def copy(self, node: Node, before: Node, trigger: Value | None) -> Value:
        key = id(node.result)
        if key in self.copies:
            return self.copies[key]
        operands = []
        for value in node.operands:
            if isinstance(value, NodeResult) and self.eligible(value.node, node):
                operands.append(self.copy(value.node, before, trigger))
            else:
                operands.append(self.checkpoint(value, before, trigger))
        clone = Node(node.op, operands, {**node.attrs, "duplicated": True}, node.result.type,
                     instance_name=node.instance_name, scope=node.scope, source=node.source,
                     name_hint=node.result.name_hint, parallel=node.parallel)
        self.insert_before(before, clone)
        self.place(clone, node)
        self.copies[key] = clone.result
        self.count += 1
        return clone.result

    def insert_before(self, before: Node, node: Node) -> None:
        self.graph.append(node)
        self.pending.setdefault(before, []).append(node)

    def finish(self, order: list[Node]) -> None:
        """Every made node right before its backward node (`order`: the graph's nodes before)."""
        if self.pending:
            self.graph.reorder([n for node in order
                                for n in (*self.pending.get(node, ()), node)])

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
            self.insert_before(before, node)
            self.place(node, before)
            self.barriers[key] = node.result
        return self.barriers[key]


def _trigger(node: Node) -> Value | None:
    """A value of the backward pass that `node` reads (its incoming gradient)."""
    for value in node.operands:
        if isinstance(value, NodeResult) and is_backward(value.node):
            return value
    return None


def apply_recompute(graph: Graph, stages: dict[Node, int] | None = None,
                    labels: dict[Node, Label] | None = None) -> int:
    """Rematerialise the recomputable values the backward pass reads; returns how many nodes
    were copied. With pipeline stages, `stages` and `labels` (the pipeline settings' of
    `graph`'s nodes) place the copies (module docstring)."""
    work = _Recomputer(graph, stages, labels)
    order = list(graph.nodes)
    for node in order:
        if not is_backward(node):
            continue
        for index, value in enumerate(node.operands):
            if isinstance(value, NodeResult) and work.eligible(value.node, node):
                node.set_operand(index, work.copy(value.node, node, _trigger(node)))
    work.finish(order)
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
        settings = unit.pipeline
        if unit.micro_batched and settings is not None and settings.pipelined:
            copied = sum(apply_recompute(graph, settings.local_stage, settings.labels)
                         for graph in unit.graphs)
        else:
            copied = sum(apply_recompute(graph) for graph in unit.graphs)
        unit.plan.recompute = {"recomputed_nodes": copied}
