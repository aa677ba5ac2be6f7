"""`Optimizer`: the base of `nn.SGD`, `nn.Momentum`, `nn.Adam`, `nn.AdamWeightDecay`, `nn.Lamb`,
`nn.AdaFactor`.

An optimizer is traced into the training graph after the backward pass: for every trainable
parameter, `update(param, grad, state, global_state)` computes the new value and new state with
ordinary ops, so the update is part of the IR like everything else and later passes can shard
it. Per-parameter state tensors are named `<prefix>.<parameter name>` (`moments.w`, as
MindSpore names them); global state (`beta1_power`, ...) by its own name.

`learning_rate` is a number or an `nn.LearningRateSchedule` (`nn.WarmUpLR`, `nn.CosineDecayLR`,
your own subclass). With a schedule the optimizer keeps MindSpore's `global_step` (Int32, shape
(1,), 0 before the first step): each update uses `schedule(global_step)` and then adds 1, as
MindSpore's `Optimizer.get_lr` does; inside `update`, `self.learning_rate` is that step's rate
(a scalar tensor of the parameter's dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from pcompile.compiler.frontend.initializer import InitializedData, initializer
from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.ir.types import DType

if TYPE_CHECKING:
    from pcompile.compiler.frontend.nn.lr import LearningRateSchedule


class Optimizer(Cell):
    """Base class; subclasses define `state_prefixes`, `global_state` and `update`."""

    state_prefixes: tuple[str, ...] = ()
    # Set by compiler.optimizer_update.trace_update while tracing a rank's local graph: sums a
    # per-parameter partial sum over the ranks holding the parameter's other slices.
    _slice_sum: Any = None
    # Set by __init__ with object.__setattr__ (Cell.__setattr__ would file them as sub-cells).
    parameters: list[Parameter]
    _schedule: LearningRateSchedule | None
    _lr: float
    _lr_now: Tensor | None  # this step's scheduled rate, inside `learning_rate_for`

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
        from pcompile.compiler.frontend.nn.lr import LearningRateSchedule

        schedule = learning_rate if isinstance(learning_rate, LearningRateSchedule) else None
        object.__setattr__(self, "_schedule", schedule)
        if schedule is not None and not schedule._attr_name:
            object.__setattr__(schedule, "_attr_name", "learning_rate")
        object.__setattr__(self, "_lr_now", None)
        if schedule is not None:
            learning_rate = 0.0  # checked below as a number; the schedule gives the rate
        for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay),
                            ("loss_scale", loss_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a number"
                    + (" or an nn.LearningRateSchedule" if name == "learning_rate" else "")
                    + f", got {value!r}"
                )
        if learning_rate < 0:
            raise ValueError(f"{type(self).__name__}: learning_rate must be >= 0")
        if weight_decay < 0:
            raise ValueError(f"{type(self).__name__}: weight_decay must be >= 0")
        if loss_scale <= 0:
            raise ValueError(f"{type(self).__name__}: loss_scale must be > 0")
        object.__setattr__(self, "parameters", params)
        object.__setattr__(self, "_lr", float(learning_rate))
        self.weight_decay = float(weight_decay)
        self.loss_scale = float(loss_scale)

    # -- the learning rate ------------------------------------------------------------------------
    @property
    def learning_rate(self) -> Any:
        """The rate `update` uses: a float, or this step's scheduled rate (a scalar tensor)."""
        if self._lr_now is not None:
            return self._lr_now
        if self._schedule is not None:
            return self._schedule
        return self._lr

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        object.__setattr__(self, "_lr", float(value))

    @property
    def dynamic_lr(self) -> bool:
        return self._schedule is not None

    @contextlib.contextmanager
    def learning_rate_for(self, dtype: DType) -> Iterator[None]:
        """Inside the block `self.learning_rate` is this step's scheduled rate in `dtype`
        (computed by `update_global`); a fixed rate stays a float."""
        rate = self.__dict__.get("_scheduled_rate")
        if rate is None:
            yield
            return
        if rate.dtype != dtype:
            from pcompile.compiler.frontend import ops

            rate = ops.cast(rate, dtype)
        object.__setattr__(self, "_lr_now", rate)
        try:
            yield
        finally:
            object.__setattr__(self, "_lr_now", None)

    def _schedule_state(self) -> dict[str, Any]:
        if self._schedule is None:
            return {}
        return {"global_step": np.zeros((1,), np.int32)}

    def _advance_schedule(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """This step's rate from `global_step` (kept for `learning_rate_for`), and the next
        `global_step`."""
        if self._schedule is None:
            return {}
        from pcompile.compiler.frontend import ops

        step = state["global_step"]
        rate = self._schedule(step)
        if not isinstance(rate, Tensor):
            rate = Tensor(np.asarray(rate, np.float32))
        if rate.shape != ():
            rate = ops.reshape(rate, ())
        object.__setattr__(self, "_scheduled_rate", rate)
        return {"global_step": step + 1}

    def init_state(self, prefix: str, param: Parameter) -> InitializedData | np.ndarray:
        """Initial value of one per-parameter state tensor (zeros by default): an
        `initializer(...)` (abstract: each rank makes its own slice) or an array."""
        return initializer("zeros", param.shape, param.dtype)

    def global_state(self) -> dict[str, np.ndarray]:
        """Initial values of state shared by all parameters (`global_step` with a schedule;
        subclasses add theirs to `super().global_state()`)."""
        return self._schedule_state()

    def update_global(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """New global state, computed once per step before the parameter updates (subclasses
        add theirs to `super().update_global(state)`)."""
        return self._advance_schedule(state)

    def whole_sum(self, x: Tensor, owner: str) -> Tensor:
        """The sum of every element of `x`, a tensor sliced like parameter `owner` (its
        gradient, a state, an update), over the whole parameter: in a parallel program each
        rank sums its slice and the ranks' sums are added (each slice counted once)."""
        from pcompile.compiler.frontend import ops

        local = ops.ReduceSum(False)(x, ())
        return local if self._slice_sum is None else self._slice_sum(local, owner)

    def state_dims(self, prefix: str, param: Parameter) -> tuple[int | None, ...] | None:
        """How per-parameter state `prefix` of `param` is split over ranks: None when it has the
        parameter's shape (and layout), else for each of its dims the parameter dim whose split
        it follows (None: not split) — AdaFactor's row statistics follow the rows."""
        return None

    def dim_sum(self, x: Tensor, owner: str, axis: int, param_dim: int,
                keep_dims: bool = False) -> Tensor:
        """`x` (sliced like parameter `owner` on its other dims) summed over its dim `axis`,
        which is parameter dim `param_dim`: in a parallel program each rank sums its slice and
        the sums are added over the ranks that split that dim."""
        from pcompile.compiler.frontend import ops

        local = ops.ReduceSum(keep_dims)(x, (axis,))
        return local if self._slice_sum is None else self._slice_sum(local, owner, (param_dim,))

    def whole_norm(self, x: Tensor, owner: str) -> Tensor:
        """The 2-norm of `x` (sliced like parameter `owner`) over the whole parameter, in
        float32."""
        from pcompile.compiler.frontend import ops

        x = ops.Cast()(x, DType.float32)
        return ops.Sqrt()(self.whole_sum(x * x, owner))

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError

    def construct(self, gradients: Any, skip: Any = None) -> Any:
        """`optimizer(grads)` in a training step cell: the update of every parameter from its
        gradient (in `self.parameters`' order). `skip` (pcompile's spelling of MindSpore's
        `if not overflow: self.optimizer(grads)`): a Bool tensor; when true the update, step
        counters included, is skipped."""
        from pcompile.compiler.frontend.train_step import current_step

        step = current_step()
        if step is None:
            raise TypeError(
                "optimizers are applied after the backward pass: by pcompile (optimizer() in "
                "the model file) or by a training step cell (nn.TrainOneStepCell); do not call "
                "them from a network's construct()")
        return step.optimizer_step(self, gradients, skip)
