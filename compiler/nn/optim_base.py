"""`Optimizer`: the base of `nn.SGD`, `nn.Momentum`, `nn.Adam`, `nn.AdamWeightDecay`.

An optimizer is traced into the training graph after the backward pass: for every trainable
parameter, `update(param, grad, state, global_state)` computes the new value and new state with
ordinary ops, so the update is part of the IR like everything else and later passes can shard
it. Per-parameter state tensors are named `<prefix>.<parameter name>` (`moments.w`, as
MindSpore names them); global state (`beta1_power`, ...) by its own name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.compiler.initializer import initializer
from pcompile.compiler.nn.cell import Cell
from pcompile.compiler.tensor import Parameter, Tensor


class Optimizer(Cell):
    """Base class; subclasses define `state_prefixes`, `global_state` and `update`."""

    state_prefixes: tuple[str, ...] = ()

    def __init__(
        self,
        params: Any,
        learning_rate: float = 0.1,
        weight_decay: float = 0.0,
        loss_scale: float = 1.0,
    ) -> None:
        super().__init__()
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: the parameter list is empty")
        for p in params:
            if not isinstance(p, Parameter):
                raise TypeError(
                    f"{type(self).__name__}: expected Parameters (net.trainable_params()), "
                    f"got {type(p).__name__}"
                )
        for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay),
                            ("loss_scale", loss_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a number, got {value!r} "
                    "(schedules are not supported)"
                )
        if learning_rate < 0:
            raise ValueError(f"{type(self).__name__}: learning_rate must be >= 0")
        if weight_decay < 0:
            raise ValueError(f"{type(self).__name__}: weight_decay must be >= 0")
        if loss_scale <= 0:
            raise ValueError(f"{type(self).__name__}: loss_scale must be > 0")
        object.__setattr__(self, "parameters", params)
        self.learning_rate = float(learning_rate)
        self.weight_decay = float(weight_decay)
        self.loss_scale = float(loss_scale)

    def init_state(self, prefix: str, param: Parameter) -> Any:
        """Initial value of one per-parameter state tensor (zeros by default): an
        `initializer(...)` (abstract: each rank makes its own slice) or an array."""
        return initializer("zeros", param.shape, param.dtype)

    def global_state(self) -> dict[str, np.ndarray]:
        """Initial values of state shared by all parameters."""
        return {}

    def update_global(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """New global state, computed once per step before the parameter updates."""
        return state

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def construct(self, *args: Any) -> Any:
        raise TypeError(
            "optimizers are applied by the compiler after the backward pass; do not call them "
            "from construct()"
        )
