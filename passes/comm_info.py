"""What a collective node moves and why it exists: the numbers behind the `bytes` and `reason`
annotations of the dumps, plan.json's collectives and `pcompile show`'s communication summary.

Bytes are what ONE rank receives in one step, the convention of the parallel passes
(`passes/step_parallel.py`, `passes/redistribution.py::comm_bytes`):

| collective | bytes per rank |
| --- | --- |
| AllReduce, Broadcast | the tensor (input) |
| AllGather | the (n - 1) pieces of the other ranks: input x (n - 1) |
| ReduceScatter | (n - 1) blocks of its own size: output x (n - 1) |
| AlltoAll | (n - 1) / n of the input |
| Send / Receive | 0 / the tensor (as `passes/pipeline_split.py` writes them) |

Each row is the op's `CommFacts.received` (`ir/registry.py`), declared in its op block
(`ir/ops/comm.py`, `ir/ops/pipeline.py`), as is whether comm_fusion buckets it
(`CommFacts.fusion_key`). n is the group size (`rank_list`). A `_MirrorOperator` is the
identity when the program runs; the bytes the parallel pass writes on it are those of the
gradient AllReduce that its vjp emits in the backward part (alone, or as a member of a fused
bucket), which is counted there.

The second convention, `ring_bytes` (plan.json, `pcompile show`), is what ONE rank SENDS when
the collective runs with ring algorithms, S the operand on one rank (one function per
communication op: its `CommFacts.ring_sent` in `ir/ops/comm.py` / `ir/ops/pipeline.py`):

| collective | bytes one rank sends |
| --- | --- |
| AllReduce | 2 (n - 1) / n x S (a ReduceScatter then an AllGather) |
| AllGather | (n - 1) x S (its own piece passed on n - 1 times: (n - 1) / n of the output) |
| ReduceScatter | (n - 1) / n x S |
| AlltoAll | (n - 1) / n x S |
| Broadcast | S (the root and every relay of the chain; the last rank sends nothing) |
| Send / Receive | S / 0 |

A group of one sends nothing. Received bytes favour an AllReduce over its ReduceScatter +
AllGather split (S against 2 (n - 1) / n x S); ring bytes count both the same, which is what
comparing plans with different collectives needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pcompile.ir.core import Node, ParallelInfo
from pcompile.ir.registry import Trait, all_ops, find_op, get_op, has_trait
from pcompile.ir.types import TensorType

PHASES = ("forward", "backward", "optimizer")


def collective_bytes(op: str, in_type: Any, out_type: Any, group_size: int) -> int:
    """Bytes one rank receives in collective `op` over `group_size` ranks (table above: the
    op's `CommFacts.received`; an op without facts: its operand)."""
    n = max(1, int(group_size))
    operand, result = _nbytes(in_type), _nbytes(out_type)
    opdef = find_op(op)
    if opdef is None or opdef.comm is None:
        return operand
    return opdef.comm.received(operand, result, n)


def _nbytes(t: Any) -> int:
    return t.nbytes if isinstance(t, TensorType) else 0


def ring_sent_ops() -> dict[str, Callable[[int, int], int]]:
    """Bytes one rank sends under ring algorithms, per communication op: f(operand bytes,
    group size) (its `CommFacts.ring_sent`), in registry order."""
    return {name: d.comm.ring_sent for name, d in all_ops().items() if d.comm is not None}


def ring_bytes(op: str, operand_bytes: int, group_size: int) -> int:
    """Bytes one rank sends in collective `op` over `group_size` ranks with ring algorithms,
    `operand_bytes` its operand on one rank (table above). Send / Receive are point to
    point: pass group size 2."""
    n = int(group_size)
    if n < 2:
        return 0
    comm = get_op(op).comm
    if comm is None:
        raise KeyError(f"{op} moves no bytes between ranks (its OpDef has no CommFacts)")
    return comm.ring_sent(int(operand_bytes), n)


def node_ring_bytes(node: Node) -> int:
    """`ring_bytes` of a communication node of a rank's graph (Send / Receive: its peer)."""
    if has_trait(node.op, Trait.POINT_TO_POINT):
        size = node.result.type.nbytes if isinstance(node.result.type, TensorType) else 0
        return ring_bytes(node.op, size, 2)
    operand = node.operands[0].type if node.operands else None
    size = operand.nbytes if isinstance(operand, TensorType) else 0
    return ring_bytes(node.op, size, _group_size(node))


def node_bytes(node: Node) -> int:
    """The node's `bytes` annotation, else what `collective_bytes` gives for it."""
    if node.parallel is not None and node.parallel.bytes is not None:
        return node.parallel.bytes
    size = _group_size(node)
    in_type = node.operands[0].type if node.operands else None
    return collective_bytes(node.op, in_type, node.result.type, size)


def phase_of(scope: str) -> str:
    """forward, backward (autodiff's `Gradients/...` scopes) or optimizer (the update)."""
    if scope.startswith("Gradients/") or scope == "Gradients":
        return "backward"
    if "/optimizer-" in scope or scope.startswith("optimizer"):
        return "optimizer"
    return "forward"


def is_communication(node: Node) -> bool:
    """Collectives and `_MirrorOperator`s (whose vjp is the gradient AllReduce)."""
    return get_op(node.op).collective or node.op == "_MirrorOperator"


def node_reason(node: Node) -> str:
    """The node's `reason` annotation, else: a collective written in the model."""
    if node.parallel is not None and node.parallel.reason is not None:
        return node.parallel.reason
    where = f" at {node.source}" if node.source else ""
    return f"{node.op} '{node.instance_name or node.op}' written in the model{where}"


def backward_annotation(forward: Node, created: list[Node]) -> None:
    """Annotate the collectives a vjp emitted for `forward` (autodiff): why they exist and
    their bytes, so every collective of a training step's dump says what it moves."""
    why = node_reason(forward) if forward.parallel is not None else (
        f"{forward.op} '{forward.instance_name or forward.op}'")
    for node in created:
        if not get_op(node.op).collective or node.parallel is not None:
            continue
        if _group_size(node) < 2:
            continue  # a group of one: the identity
        node.parallel = ParallelInfo(reason=f"vjp of {forward.op}: {why}",
                                     bytes=node_bytes(node))


def _group_size(node: Node) -> int:
    """len(rank_list): a tuple, or an `ir.rank.RankGroup` (the same size on every rank)."""
    ranks = node.attrs.get("rank_list", ())
    try:
        return len(ranks)
    except TypeError:
        return 1
