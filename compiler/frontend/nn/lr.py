"""MindSpore's learning-rate schedules: `LearningRateSchedule`, `WarmUpLR`, `CosineDecayLR`,
`PolynomialDecayLR`, `ExponentialDecayLR`.

A schedule is a Cell whose `construct(global_step)` computes the rate from the step number (an
Int32 tensor of shape (1,): 0 before the first update). Given as an optimizer's
`learning_rate`, it is traced into the training step (the optimizer keeps `global_step` as
state and advances it after each update, `nn.Optimizer`), so the rate is computed by the
compiled program on every step, exactly as MindSpore's optimizer does. A user subclass writes
its own `construct` with ops (`ops.minimum`, `ops.cast`, `ops.cos`, ...).

Formulas (MindSpore's), with p the step as float32:
* `WarmUpLR(learning_rate, warmup_steps)`: learning_rate * min(p, warmup_steps) / warmup_steps;
* `CosineDecayLR(min_lr, max_lr, decay_steps)`:
  min_lr + 0.5 (max_lr - min_lr) (1 + cos(pi min(p, decay_steps) / decay_steps));
* `PolynomialDecayLR(learning_rate, end_learning_rate, decay_steps, power)`:
  (learning_rate - end_learning_rate) (1 - min(p, decay_steps) / decay_steps)^power
  + end_learning_rate;
* `ExponentialDecayLR(learning_rate, decay_rate, decay_steps, is_stair=False)`:
  learning_rate * decay_rate^(p / decay_steps) (the exponent floored with `is_stair`).
"""

from __future__ import annotations

import math
from typing import Any

from pcompile.compiler.frontend import ops
from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.tensor import Tensor
from pcompile.ir.types import DType

__all__ = ["CosineDecayLR", "ExponentialDecayLR", "LearningRateSchedule", "PolynomialDecayLR",
           "WarmUpLR"]


class LearningRateSchedule(Cell):
    """Base of the schedules: subclasses define `construct(global_step) -> rate`."""

    def construct(self, global_step: Tensor) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define construct(global_step)")


def _float(value: Any, name: str, owner: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, float):
        raise TypeError(f"For '{owner}', the argument '{name}' must be type of float, but got "
                        f"'{name}' type: {type(value).__name__}.")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"For '{owner}', '{name}' must be {'> 0' if positive else '>= 0'}, "
                         f"got {value}")
    return value


def _steps(value: Any, name: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise (TypeError if not isinstance(value, int) or isinstance(value, bool)
               else ValueError)(f"For '{owner}', '{name}' must be an int >= 1, got {value!r}")
    return value


def _step_float(global_step: Tensor, limit: int | None = None) -> Tensor:
    """The step as float32, capped at `limit` (MindSpore caps it before the cast)."""
    if limit is not None:
        global_step = ops.minimum(global_step, limit)
    return ops.cast(global_step, DType.float32)


class WarmUpLR(LearningRateSchedule):
    def __init__(self, learning_rate: float, warmup_steps: int) -> None:
        super().__init__()
        self.learning_rate = _float(learning_rate, "learning_rate", "WarmUpLR")
        self.warmup_steps = _steps(warmup_steps, "warmup_steps", "WarmUpLR")

    def construct(self, global_step: Tensor) -> Tensor:
        percent = _step_float(global_step, self.warmup_steps) / float(self.warmup_steps)
        return percent * self.learning_rate


class CosineDecayLR(LearningRateSchedule):
    def __init__(self, min_lr: float, max_lr: float, decay_steps: int) -> None:
        super().__init__()
        self.min_lr = _float(min_lr, "min_lr", "CosineDecayLR")
        self.max_lr = _float(max_lr, "max_lr", "CosineDecayLR", positive=True)
        self.decay_steps = _steps(decay_steps, "decay_steps", "CosineDecayLR")
        if min_lr >= max_lr:
            raise ValueError("For 'CosineDecayLR', the 'max_lr' must be greater than the "
                             f"'min_lr', but got 'max_lr' value: {max_lr}, 'min_lr' value: "
                             f"{min_lr}.")
        self.delta = 0.5 * (max_lr - min_lr)

    def construct(self, global_step: Tensor) -> Tensor:
        p = _step_float(global_step, self.decay_steps)
        return (ops.cos(p * math.pi / float(self.decay_steps)) + 1.0) * self.delta + self.min_lr


class PolynomialDecayLR(LearningRateSchedule):
    def __init__(self, learning_rate: float, end_learning_rate: float, decay_steps: int,
                 power: float, update_decay_steps: bool = False) -> None:
        super().__init__()
        self.learning_rate = _float(learning_rate, "learning_rate", "PolynomialDecayLR", True)
        self.end_learning_rate = _float(end_learning_rate, "end_learning_rate",
                                        "PolynomialDecayLR")
        self.decay_steps = _steps(decay_steps, "decay_steps", "PolynomialDecayLR")
        self.power = _float(power, "power", "PolynomialDecayLR", positive=True)
        if update_decay_steps:
            raise ValueError("PolynomialDecayLR: update_decay_steps=True is not supported yet")

    def construct(self, global_step: Tensor) -> Tensor:
        p = _step_float(global_step, self.decay_steps) / float(self.decay_steps)
        decay = ops.pow(1.0 - p, self.power)
        return decay * (self.learning_rate - self.end_learning_rate) + self.end_learning_rate


class ExponentialDecayLR(LearningRateSchedule):
    def __init__(self, learning_rate: float, decay_rate: float, decay_steps: int,
                 is_stair: bool = False) -> None:
        super().__init__()
        self.learning_rate = _float(learning_rate, "learning_rate", "ExponentialDecayLR", True)
        self.decay_rate = _float(decay_rate, "decay_rate", "ExponentialDecayLR", True)
        self.decay_steps = _steps(decay_steps, "decay_steps", "ExponentialDecayLR")
        self.is_stair = bool(is_stair)

    def construct(self, global_step: Tensor) -> Tensor:
        p = _step_float(global_step) / float(self.decay_steps)
        if self.is_stair:
            p = ops.floor_div(p, 1.0)
        rate = ops.fill(DType.float32, (1,), self.decay_rate)
        return ops.pow(rate, p) * self.learning_rate
