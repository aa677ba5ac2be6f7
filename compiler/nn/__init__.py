"""MindSpore-style `nn`: Cell, layers, losses, optimizers."""

from pcompile.compiler.nn.cell import Cell
from pcompile.compiler.nn.layers import (
    GELU,
    CellList,
    Conv2d,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    LayerNorm,
    ReLU,
    SequentialCell,
    Sigmoid,
    SiLU,
    Softmax,
    Tanh,
)
from pcompile.compiler.nn.loss import (
    CrossEntropyLoss,
    L1Loss,
    MSELoss,
    SoftmaxCrossEntropyWithLogits,
    WithLossCell,
)
from pcompile.compiler.nn.optim import SGD, Adam, AdamWeightDecay, Momentum
from pcompile.compiler.nn.optim_base import Optimizer
from pcompile.compiler.nn.pipeline import MicroBatchInterleaved, Pipeline, PipelineCell

__all__ = [
    "Cell",
    "Dense",
    "Embedding",
    "LayerNorm",
    "ReLU",
    "GELU",
    "Tanh",
    "Sigmoid",
    "SiLU",
    "Softmax",
    "Flatten",
    "Dropout",
    "SequentialCell",
    "CellList",
    "Conv2d",
    "MSELoss",
    "L1Loss",
    "SoftmaxCrossEntropyWithLogits",
    "CrossEntropyLoss",
    "WithLossCell",
    "PipelineCell",
    "Pipeline",
    "MicroBatchInterleaved",
    "Optimizer",
    "SGD",
    "Momentum",
    "Adam",
    "AdamWeightDecay",
]
