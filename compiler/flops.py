"""Model FLOPs of one step, counted on the traced forward graph (global shapes): the forward's
matrix products and attention (`ir.flops.node_flops`, which states what is counted), times 3
for a training step."""

from __future__ import annotations

from typing import Any

from pcompile.ir.core import Graph
from pcompile.ir.flops import TRAINING_FACTOR, node_flops

__all__ = ["TRAINING_FACTOR", "constant_learning_rate", "model_flops", "node_flops"]


def model_flops(graph: Graph | None, training: bool) -> int:
    """FLOPs of one step of the whole model (all ranks together): the forward's matrix
    products and attention, times 3 for a training step; 0 when there are none."""
    if graph is None:
        return 0
    forward = sum(node_flops(n) for n in graph.nodes)
    return forward * (TRAINING_FACTOR if training else 1)


def constant_learning_rate(optimizer: Any) -> float | None:
    """The optimizer's learning rate when it is a plain number (a schedule or a tensor: None;
    the step computes those)."""
    lr = getattr(optimizer, "learning_rate", None)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        return None
    return float(lr)
