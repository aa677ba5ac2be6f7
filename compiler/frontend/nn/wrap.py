"""MindSpore's training wrappers: `TrainOneStepCell`, `TrainOneStepWithLossScaleCell`,
`WithGradCell`, the loss-scale update cells, gradient clipping cells, `DistributedGradReducer`.

Each is written as MindSpore writes it (its `construct` asks `GradOperation` for the gradients
and calls the optimizer), and compiled by the two traces of `compiler.train_step`. Where
pcompile differs:

* the gradient reduction across ranks is done by the parallel passes (mirrors), so the
  `grad_reducer` of a training cell (and `DistributedGradReducer`) returns the gradients as they
  are; `gradients_mean` decides averaging, as for every other training form;
* MindSpore's `if not overflow: loss = F.depend(loss, self.optimizer(grads))` branches on a
  tensor, which a trace cannot; pcompile's cell writes it
  `loss = ops.depend(loss, self.optimizer(grads, skip=overflow))`, which skips the whole
  update (step counters included) on overflow, as MindSpore does;
* overflow is detected as MindSpore does on GPU: a gradient element that is inf or NaN (after
  unscaling), counted on every rank and summed over all ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.compiler.frontend import ops
from pcompile.compiler.frontend.grad import GradOperation, ParameterTuple
from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.ir.types import DType

__all__ = [
    "ClipByGlobalNorm",
    "ClipGradNorm",
    "DistributedGradReducer",
    "DynamicLossScaleUpdateCell",
    "FixedLossScaleUpdateCell",
    "TrainOneStepCell",
    "TrainOneStepWithLossScaleCell",
    "WithGradCell",
]


def _identity(grads: Any) -> Any:
    return grads


def _check_cell(value: Any, owner: str, name: str) -> Cell:
    if not isinstance(value, Cell):
        raise TypeError(f"{owner}: {name} must be a Cell, got {type(value).__name__}")
    return value


class _StepCell(Cell):
    """Base of the cells whose construct differentiates `self.network`: its parameters keep
    their own names (MindSpore's wrappers have `auto_prefix=False`)."""

    network: Cell

    def finalize_parameter_names(self) -> None:
        self.network.finalize_parameter_names()
        super().finalize_parameter_names()


class TrainOneStepCell(_StepCell):
    """One training step of `network` (which returns its loss) with `optimizer`: the loss,
    the gradients of `optimizer.parameters` (seeded with ones, or with `sens` everywhere), the
    update. Returns the loss (and the gradients with `return_grad`)."""

    def __init__(self, network: Cell, optimizer: Optimizer, sens: float | None = None,
                 return_grad: bool = False) -> None:
        super().__init__(auto_prefix=False)
        self.network = _check_cell(network, "TrainOneStepCell", "network")
        if not isinstance(optimizer, Optimizer):
            raise TypeError("TrainOneStepCell: optimizer must be an nn optimizer (nn.SGD, "
                            f"nn.Momentum, nn.Adam, ...), got {type(optimizer).__name__}")
        self.network.set_grad()
        self.optimizer = optimizer
        self.weights = ParameterTuple(optimizer.parameters)
        self.sens = sens
        self.grad = GradOperation(get_by_list=True, sens_param=sens is not None)
        self.grad_reducer = _identity
        self.return_grad = bool(return_grad)

    def construct(self, *inputs: Any) -> Any:
        loss = self.network(*inputs)
        if self.sens is None:
            grads = self.grad(self.network, self.weights)(*inputs)
        else:
            sens = ops.fill(loss.dtype, loss.shape, self.sens)
            grads = self.grad(self.network, self.weights)(*inputs, sens)
        grads = self.grad_reducer(grads)
        loss = ops.depend(loss, self.optimizer(grads))
        if self.return_grad:
            return loss, grads
        return loss


class TrainOneStepWithLossScaleCell(TrainOneStepCell):
    """A training step with loss scaling: the backward starts from the loss scale, the
    gradients are divided by it, and an overflow (an inf or NaN gradient on any rank) skips the
    update. `scale_sense` is a Tensor of shape () or (1,) (a fixed scale, still checked for
    overflow) or an update cell (`FixedLossScaleUpdateCell`, `DynamicLossScaleUpdateCell`) that
    gives the initial scale and updates it after each step. The scale is the stored tensor
    `scale_sense`. Returns (loss, overflow, the scale this step used)."""

    def __init__(self, network: Cell, optimizer: Optimizer, scale_sense: Any) -> None:
        super().__init__(network, optimizer, sens=None)
        self.loss_scaling_manager: Cell | None = None
        if isinstance(scale_sense, Cell):
            self.loss_scaling_manager = scale_sense
            value = np.asarray(scale_sense.get_loss_scale(), np.float32)  # type: ignore[attr-defined]
            self.scale_sense = Parameter(Tensor(value), name="scale_sense", requires_grad=False)
        elif isinstance(scale_sense, Tensor):
            if scale_sense.shape not in ((), (1,)):
                raise ValueError("For 'TrainOneStepWithLossScaleCell', the shape of "
                                 f"'scale_sense' must be (1,) or (), but got {scale_sense.shape}")
            self.scale_sense = Parameter(Tensor(scale_sense.asnumpy()), name="scale_sense",
                                         requires_grad=False)
        else:
            raise TypeError("For 'TrainOneStepWithLossScaleCell', the 'scale_sense' must be "
                            f"Cell or Tensor, but got 'scale_sense' type: {type(scale_sense)}.")
        self.grad = GradOperation(get_by_list=True, sens_param=True)

    def construct(self, *inputs: Any) -> Any:
        weights = self.weights
        loss = self.network(*inputs)
        scaling_sens = self.scale_sense
        status, scaling_sens = self.start_overflow_check(loss, scaling_sens)
        scaling_sens_filled = ops.ones_like(loss) * ops.cast(scaling_sens, loss.dtype)
        grads = self.grad(self.network, weights)(*inputs, scaling_sens_filled)
        inverse = ops.reshape(1.0 / scaling_sens, ())
        grads = tuple(g * ops.cast(inverse, g.dtype) for g in grads)
        grads = self.grad_reducer(grads)
        cond = self.get_overflow_status(status, grads)
        overflow = self.process_loss_scale(cond)
        loss = ops.depend(loss, self.optimizer(grads, skip=overflow))
        return loss, cond, scaling_sens

    def start_overflow_check(self, pre_cond: Any, compute_input: Any) -> tuple[Any, Any]:
        """MindSpore's GPU form: no status buffer; the gradients are checked afterwards."""
        return False, compute_input

    def get_overflow_status(self, status: Any, compute_output: Any) -> Tensor:
        """True when any gradient element on any rank is inf or NaN."""
        from pcompile.compiler.frontend.train_step import current_step

        step = current_step()
        if step is None:
            raise TypeError("get_overflow_status runs inside a compiled training step")
        grads = compute_output if isinstance(compute_output, (tuple, list)) else [compute_output]
        return step.overflow(list(grads))  # type: ignore[attr-defined]

    def process_loss_scale(self, overflow: Tensor) -> Tensor:
        if self.loss_scaling_manager is not None:
            return self.loss_scaling_manager(self.scale_sense, overflow)
        return overflow

    def set_sense_scale(self, sens: Tensor) -> None:
        if not isinstance(sens, Tensor):
            raise TypeError("For 'TrainOneStepWithLossScaleCell', the type of 'sens' must be "
                            f"Tensor, but got {type(sens)}")
        self.scale_sense.set_data(sens.asnumpy())


class FixedLossScaleUpdateCell(Cell):
    """A loss scale that never changes (an overflow still skips the update)."""

    def __init__(self, loss_scale_value: float) -> None:
        super().__init__(auto_prefix=False)
        self.loss_scale_value = loss_scale_value

    def get_loss_scale(self) -> float:
        return self.loss_scale_value

    def construct(self, loss_scale: Any, overflow: Any) -> Any:
        return overflow


class DynamicLossScaleUpdateCell(Cell):
    """MindSpore's dynamic loss scale: on overflow the scale becomes max(scale / scale_factor,
    1); after `scale_window` steps without overflow it is multiplied by `scale_factor`. State:
    `current_iterator_step` (1 before the first step) and `last_overflow_iterator_step` (0),
    updated as MindSpore does."""

    def __init__(self, loss_scale_value: float, scale_factor: int, scale_window: int) -> None:
        super().__init__(auto_prefix=False)
        self.scale_window = Tensor(np.asarray(scale_window, np.int32))
        self.scale_factor = Tensor(np.asarray(scale_factor, np.float32))
        self.loss_scale_value = loss_scale_value
        self.cur_iter = Parameter(Tensor(np.asarray(1, np.int32)),
                                  name="current_iterator_step", requires_grad=False)
        self.last_overflow_iter = Parameter(Tensor(np.asarray(0, np.int32)),
                                            name="last_overflow_iterator_step",
                                            requires_grad=False)
        self.minimum_loss_scale = Tensor(np.asarray(1.0, np.float32))

    def get_loss_scale(self) -> float:
        return self.loss_scale_value

    def construct(self, loss_scale: Any, overflow: Any) -> Any:
        overflow_cond = overflow
        reciprocal = Tensor(np.asarray(1.0, np.float32) / self.scale_factor.asnumpy())
        loss_scale_on_overflow = ops.select(
            overflow_cond, ops.maximum(loss_scale * reciprocal, self.minimum_loss_scale),
            loss_scale)
        should_inc = ops.less_equal(self.scale_window, self.cur_iter - self.last_overflow_iter)
        last_iter_cond = ops.logical_or(overflow_cond, should_inc)
        last_overflow_iter = ops.select(last_iter_cond, self.cur_iter, self.last_overflow_iter)
        last_iter = ops.assign(self.last_overflow_iter, last_overflow_iter)
        update_scale_cond = ops.logical_and(should_inc, ops.logical_not(overflow_cond))
        scale_mul_res = loss_scale_on_overflow * self.scale_factor
        scaled_loss_scale = ops.select(update_scale_cond, scale_mul_res, loss_scale_on_overflow)
        ops.assign(loss_scale, scaled_loss_scale)
        inc_cur_iter = self.cur_iter + 1
        inc_cur_iter = ops.depend(inc_cur_iter, last_iter)
        ops.assign(self.cur_iter, inc_cur_iter)
        return overflow


class WithGradCell(_StepCell):
    """The gradients of `network` (with `loss_fn` after it, when given) with respect to its
    trainable parameters, seeded with `sens` (ones without one). Returns them as a tuple."""

    def __init__(self, network: Cell, loss_fn: Cell | None = None, sens: Any = None) -> None:
        from pcompile.compiler.frontend.nn.loss import WithLossCell

        super().__init__(auto_prefix=False)
        self.network = _check_cell(network, "WithGradCell", "network")
        self.loss_fn = loss_fn
        self.weights = ParameterTuple(network.trainable_params())
        self.grad = GradOperation(get_by_list=True, sens_param=sens is not None)
        self.sens = sens
        if loss_fn is None:
            self.network_with_loss = network
        else:
            self.network_with_loss = WithLossCell(self.network, _check_cell(
                loss_fn, "WithGradCell", "loss_fn"))
        self.network_with_loss.set_train()

    def finalize_parameter_names(self) -> None:
        self.network_with_loss.finalize_parameter_names()
        super().finalize_parameter_names()

    def construct(self, *inputs: Any) -> Any:
        weights = self.weights
        if self.sens is None:
            return self.grad(self.network_with_loss, weights)(*inputs)
        return self.grad(self.network_with_loss, weights)(*inputs, self.sens)


class DistributedGradReducer(Cell):
    """Accepted for MindSpore scripts; returns the gradients as they are: pcompile's mirrors
    already reduce every gradient over the ranks that hold the same slice (averaged with
    `gradients_mean`)."""

    def __init__(self, parameters: Any = None, mean: bool = True, degree: Any = None,
                 fusion_type: int = 1, group: Any = None) -> None:
        super().__init__(auto_prefix=False)

    def construct(self, grads: Any) -> Any:
        return grads


class ClipByGlobalNorm(Cell):
    """`ops.clip_by_global_norm(x, clip_norm)` as a cell: x_i * clip_norm / max(global norm,
    clip_norm)."""

    def __init__(self, clip_norm: float = 1.0, use_norm: Any = None) -> None:
        super().__init__()
        if use_norm is not None:
            raise ValueError("ClipByGlobalNorm: input 'use_norm' only supports None currently, "
                             f"but got 'use_norm': {use_norm}")
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or \
                clip_norm <= 0:
            raise ValueError(f"ClipByGlobalNorm: clip_norm must be > 0, got {clip_norm!r}")
        self.clip_norm = float(clip_norm)

    def construct(self, x: Any) -> Any:
        return ops.clip_by_global_norm(x, self.clip_norm)


class ClipGradNorm(Cell):
    """mindformers' `ClipGradNorm(max_norm)`: returns (clipped gradients, global norm), with
    x_i * min(max_norm / (max(global norm, max_norm) + 1e-6), 1)."""

    def __init__(self, max_norm: float = 1.0, use_norm: Any = None) -> None:
        super().__init__()
        if use_norm is not None:
            raise ValueError("ClipGradNorm: input 'use_norm' only supports None currently, but "
                             f"got 'use_norm': {use_norm}")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm <= 0:
            raise ValueError(f"ClipGradNorm: max_norm must be > 0, got {max_norm!r}")
        self.clip_norm = float(max_norm)

    def construct(self, x: Any) -> Any:
        tensors = list(x) if isinstance(x, (tuple, list)) else [x]
        global_norm = ops.global_norm(tensors)
        clip = Tensor(np.asarray(self.clip_norm, np.float32))
        norm = ops.select(ops.greater_equal(global_norm, clip), global_norm, clip)
        coef = ops.minimum(clip / (norm + 1e-6), 1.0)
        clipped = tuple(ops.cast(ops.cast(t, DType.float32) * coef, t.dtype) for t in tensors)
        return clipped, global_norm
