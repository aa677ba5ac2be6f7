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

n is the group size (`rank_list`). A `_MirrorOperator` is the identity when the program runs;
the bytes the parallel pass writes on it are those of the gradient AllReduce that its vjp
emits in the backward part (alone, or as a member of a fused bucket), which is counted there.
"""

from __future__ import annotations

from typing import Any

from pcompile.ir.core import Node, ParallelInfo
from pcompile.ir.registry import get_op
from pcompile.ir.types import TensorType

PHASES = ("forward", "backward", "optimizer")


def collective_bytes(op: str, in_type: Any, out_type: Any, group_size: int) -> int:
    """Bytes one rank receives in collective `op` over `group_size` ranks (table above)."""
    n = max(1, int(group_size))

    def nbytes(t: Any) -> int:
        if isinstance(t, TensorType):
            return t.nbytes
        return 0

    if op == "AllGather":
        return nbytes(in_type) * (n - 1)
    if op == "ReduceScatter":
        return nbytes(out_type) * (n - 1)
    if op == "AlltoAll":
        return nbytes(in_type) * (n - 1) // n
    return nbytes(in_type)


def node_bytes(node: Node) -> int:
    """The node's `bytes` annotation, else what `collective_bytes` gives for it."""
    extra = node.parallel.extra if node.parallel is not None else {}
    if "bytes" in extra:
        return int(extra["bytes"])
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
    extra = node.parallel.extra if node.parallel is not None else {}
    if "reason" in extra:
        return str(extra["reason"])
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
        node.parallel = ParallelInfo(extra={
            "reason": f"vjp of {forward.op}: {why}",
            "bytes": node_bytes(node)})


def _group_size(node: Node) -> int:
    """len(rank_list): a tuple, or an `ir.rank.RankGroup` (the same size on every rank)."""
    ranks = node.attrs.get("rank_list", ())
    try:
        return len(ranks)
    except TypeError:
        return 1
