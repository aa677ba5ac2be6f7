"""Model FLOPs of one step, counted on the traced forward graph (global shapes): the forward's
matrix products and attention (`ir.flops.node_flops`, which states what is counted), times 3
for a training step."""

from __future__ import annotations

from typing import Any

from pcompile.ir.core import Graph
from pcompile.ir.flops import TRAINING_FACTOR, node_flops

__all__ = ["TRAINING_FACTOR", "constant_learning_rate", "model_flops", "node_flops",
           "training_optimizer"]


def model_flops(graph: Graph | None, training: bool) -> int:
    """FLOPs of one step of the whole model (all ranks together): the forward's matrix
    products and attention, times 3 for a training step; 0 when there are none."""
    if graph is None:
        return 0
    forward = sum(node_flops(n) for n in graph.nodes)
    return forward * (TRAINING_FACTOR if training else 1)


def training_optimizer(state: Any) -> Any:
    """The optimizer a compile trains with: the model file's `optimizer()` beside `loss()`
    (`state.optimizer`, once the optimizer pass called it), else the one its training step
    cell holds (a network computing its own loss with `optimizer()`, traced as
    `nn.TrainOneStepCell(net, opt)`; `model()` returning a step cell); None for inference."""
    if getattr(state, "optimizer", None) is not None:
        return state.optimizer
    traced = getattr(state, "traced", None)
    if traced is None or traced.step is None:
        return None
    from pcompile.compiler.frontend.nn.optim_base import Optimizer

    return next((cell for _, cell in traced.network.cells_and_names()
                 if isinstance(cell, Optimizer)), None)


def constant_learning_rate(optimizer: Any) -> float | None:
    """The optimizer's learning rate when it is a plain number (a schedule or a tensor: None;
    the step computes those)."""
    lr = getattr(optimizer, "learning_rate", None)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        return None
    return float(lr)
