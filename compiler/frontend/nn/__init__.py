"""MindSpore-style `nn`: Cell, layers, losses, optimizers."""

from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.nn.layers import (
    GELU,
    BatchNorm1d,
    BatchNorm2d,
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
from pcompile.compiler.frontend.nn.loss import (
    CrossEntropyLoss,
    L1Loss,
    MSELoss,
    SoftmaxCrossEntropyWithLogits,
    WithEvalCell,
    WithLossCell,
)
from pcompile.compiler.frontend.nn.lr import (
    CosineDecayLR,
    ExponentialDecayLR,
    LearningRateSchedule,
    PolynomialDecayLR,
    WarmUpLR,
)
from pcompile.compiler.frontend.nn.optim import (
    SGD,
    AdaFactor,
    Adam,
    AdamWeightDecay,
    Lamb,
    Momentum,
)
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.compiler.frontend.nn.pipeline import MicroBatchInterleaved, Pipeline, PipelineCell
from pcompile.compiler.frontend.nn.wrap import (
    ClipByGlobalNorm,
    ClipGradNorm,
    DistributedGradReducer,
    DynamicLossScaleUpdateCell,
    FixedLossScaleUpdateCell,
    TrainOneStepCell,
    TrainOneStepWithLossScaleCell,
    WithGradCell,
)

__all__ = [
    "BatchNorm1d",
    "BatchNorm2d",
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
    "WithEvalCell",
    "WithLossCell",
    "PipelineCell",
    "Pipeline",
    "MicroBatchInterleaved",
    "Optimizer",
    "SGD",
    "Momentum",
    "Adam",
    "AdamWeightDecay",
    "Lamb",
    "AdaFactor",
    "LearningRateSchedule",
    "WarmUpLR",
    "CosineDecayLR",
    "PolynomialDecayLR",
    "ExponentialDecayLR",
    "TrainOneStepCell",
    "TrainOneStepWithLossScaleCell",
    "WithGradCell",
    "FixedLossScaleUpdateCell",
    "DynamicLossScaleUpdateCell",
    "DistributedGradReducer",
    "ClipByGlobalNorm",
    "ClipGradNorm",
]


def __getattr__(name: str) -> object:
    """A name MindSpore's `nn` has and pcompile's does not: one message that says so and
    suggests the closest names, as `ops` does."""
    if name.startswith("__"):  # Python's own probes (__path__, __wrapped__, ...)
        raise AttributeError(f"module 'pcompile.nn' has no attribute {name!r}")
    import difflib

    close = difflib.get_close_matches(name, __all__, n=3, cutoff=0.6)
    near = f" (did you mean {', '.join(f'nn.{c}' for c in close)}?)" if close else ""
    raise AttributeError(
        f"pcompile.nn has no {name!r}{near}: the cells, losses, optimizers and wrappers "
        "pcompile has are listed in docs/ops.md (Cells) and docs/user-guide.md (Training); a "
        "missing cell can be written as a Cell of the ops in docs/ops.md")
