"""MindSpore's optimizers: `SGD`, `Momentum`, `Adam`, `AdamWeightDecay`, `Lamb`, `AdaFactor`.

Each `update` is written with ordinary tensor ops, so it runs eagerly on concrete tensors and is
traced into the training graph by `compiler.optimizer_update.append_optimizer`. Gradients are first
divided by `loss_scale`; L2 weight decay (`grad + weight_decay * w`) is applied as MindSpore does:
by `SGD` to every parameter, by `Momentum` and `Adam` (and the decoupled decay of
`AdamWeightDecay`) only to parameters whose names contain neither 'beta' nor 'gamma'
(LayerNorm's shift and scale), MindSpore's default decay filter.

State (per parameter, named `<prefix>.<parameter name>`): SGD `accum` (+ `stat` with
dampening), Momentum `moments`, Adam and AdamWeightDecay `moment1`, `moment2`, Lamb `lamb_m`,
`lamb_v`; Adam and Lamb also keep the global scalars `beta1_power`, `beta2_power` (beta^t after
step t, for bias correction). Lamb's norms are of whole parameters: in a parallel program each
rank's partial sum is completed over the parameter's slices (`Optimizer.whole_sum`).
AdaFactor keeps `exp_avg` (with beta1 > 0), `exp_avg_sq_row`, `exp_avg_sq_col` and `exp_avg_sq`
and the global `afactor_step`; its row and column statistics have their own shapes and layouts
(`Optimizer.state_dims`) and their means are completed over the ranks that split the averaged
dim (`Optimizer.dim_sum`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pcompile.compiler.frontend import ops
from pcompile.compiler.frontend.initializer import InitializedData, initializer
from pcompile.compiler.frontend.nn.layers import check_bool, check_number
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.ir.types import DType

__all__ = ["SGD", "AdaFactor", "Adam", "AdamWeightDecay", "Lamb", "Momentum"]


def _param_name(param: Tensor) -> str | None:
    """The parameter's name: a Parameter's own, or the graph parameter's while tracing."""
    name = getattr(param, "name", None)
    if name is None and param._value is not None:
        name = getattr(param._value, "name", None)
    return name if isinstance(name, str) else None


def decays(param: Tensor) -> bool:
    """MindSpore's default decay filter: no weight decay for names with 'beta' or 'gamma'."""
    name = _param_name(param)
    return name is None or ("beta" not in name and "gamma" not in name)


def _range(
    value: Any,
    name: str,
    owner: str,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = True,
) -> float:
    """`value` as a float in the interval, else TypeError / ValueError."""
    number = check_number(value, name, owner)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high or math.isnan(number):
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(f"{owner}: {name} must be in {left}{low}, {high}{right}, got {value!r}")
    return number


class _Base(Optimizer):
    """Shared gradient preprocessing."""

    def _grad(self, param: Tensor, grad: Tensor, decay: bool) -> Tensor:
        """grad / loss_scale (+ weight_decay * param when `decay`)."""
        if self.loss_scale != 1.0:
            grad = grad * (1.0 / self.loss_scale)
        if decay and self.weight_decay > 0.0:
            grad = grad + param * self.weight_decay
        return grad


class SGD(_Base):
    """Stochastic gradient descent with optional momentum (MindSpore `nn.SGD`, same as
    PyTorch's): g = grad / loss_scale + weight_decay * w;
    with momentum, accum = g on the first step, then momentum * accum + (1 - dampening) * g;
    w -= lr * (g + momentum * accum) with nesterov, else w -= lr * accum (lr * g without
    momentum).

    State: `accum` when momentum > 0, and `stat` (ones until the first step) when also
    dampening > 0 (without dampening the first step needs no flag: accum starts at zero)."""

    def __init__(
        self,
        params: Any,
        learning_rate: float = 0.1,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        loss_scale: float = 1.0,
    ) -> None:
        super().__init__(params, learning_rate, weight_decay, loss_scale)
        self.momentum = _range(momentum, "momentum", "SGD", 0.0)
        self.dampening = _range(dampening, "dampening", "SGD", 0.0)
        self.nesterov = check_bool(nesterov, "nesterov", "SGD")
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError(
                "SGD: nesterov momentum needs momentum > 0 and dampening = 0, got momentum="
                f"{momentum!r}, dampening={dampening!r}"
            )
        prefixes: tuple[str, ...] = ()
        if self.momentum > 0.0:
            prefixes = ("accum", "stat") if self.dampening > 0.0 else ("accum",)
        self.state_prefixes = prefixes

    def init_state(self, prefix: str, param: Parameter) -> InitializedData | np.ndarray:
        if prefix == "stat":
            return initializer("ones", param.shape, param.dtype)
        return super().init_state(prefix, param)

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        g = self._grad(param, grad, decay=True)
        new_state: dict[str, Tensor] = {}
        if self.momentum > 0.0:
            accum = state["accum"] * self.momentum
            accum = accum + (g * (1.0 - self.dampening) if self.dampening > 0.0 else g)
            if "stat" in state:
                stat = state["stat"]
                accum = stat * g + (1.0 - stat) * accum
                new_state["stat"] = stat * 0.0
            new_state["accum"] = accum
            step = g + accum * self.momentum if self.nesterov else accum
        else:
            step = g
        return param - step * self.learning_rate, new_state


class Momentum(_Base):
    """Momentum (MindSpore `nn.Momentum`, op ApplyMomentum): g = grad / loss_scale
    (+ weight_decay * w); moments = momentum * moments + g;
    w -= lr * (g + momentum * moments) with `use_nesterov`, else w -= lr * moments."""

    state_prefixes = ("moments",)

    def __init__(
        self,
        params: Any,
        learning_rate: float,
        momentum: float,
        weight_decay: float = 0.0,
        loss_scale: float = 1.0,
        use_nesterov: bool = False,
    ) -> None:
        super().__init__(params, learning_rate, weight_decay, loss_scale)
        self.momentum = _range(momentum, "momentum", "Momentum", 0.0)
        self.use_nesterov = check_bool(use_nesterov, "use_nesterov", "Momentum")

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        g = self._grad(param, grad, decays(param))
        moments = state["moments"] * self.momentum + g
        step = g + moments * self.momentum if self.use_nesterov else moments
        return param - step * self.learning_rate, {"moments": moments}


def _check_betas(beta1: Any, beta2: Any, eps: Any, owner: str) -> tuple[float, float, float]:
    return (
        _range(beta1, "beta1", owner, 0.0, 1.0, low_open=True),
        _range(beta2, "beta2", owner, 0.0, 1.0, low_open=True),
        _range(eps, "eps", owner, 0.0, low_open=True),
    )


class Adam(_Base):
    """Adam (MindSpore `nn.Adam`, op ApplyAdam) with bias correction:
    g = grad / loss_scale (+ weight_decay * w); after step t, beta1_power = beta1^t and
    beta2_power = beta2^t; lr_t = lr * sqrt(1 - beta2_power) / (1 - beta1_power);
    m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
    w -= lr_t * m / (sqrt(v) + eps), or with `use_nesterov`
    w -= lr_t * (beta1 m + (1 - beta1) g) / (sqrt(v) + eps).

    The arguments are in MindSpore's order; `use_locking` is accepted and has no effect, and
    `use_amsgrad=True` is not supported."""

    state_prefixes = ("moment1", "moment2")
    _lr_t_cache: tuple[Tensor, Tensor, Tensor, Any] | None

    def __init__(
        self,
        params: Any,
        learning_rate: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        use_locking: bool = False,
        use_nesterov: bool = False,
        weight_decay: float = 0.0,
        loss_scale: float = 1.0,
        use_amsgrad: bool = False,
    ) -> None:
        super().__init__(params, learning_rate, weight_decay, loss_scale)
        self.beta1, self.beta2, self.eps = _check_betas(beta1, beta2, eps, "Adam")
        self.use_locking = check_bool(use_locking, "use_locking", "Adam")
        self.use_nesterov = check_bool(use_nesterov, "use_nesterov", "Adam")
        if check_bool(use_amsgrad, "use_amsgrad", "Adam"):
            raise ValueError("Adam: use_amsgrad=True is not supported yet")
        object.__setattr__(self, "_lr_t_cache", None)

    def global_state(self) -> dict[str, np.ndarray]:
        one = np.ones((), dtype=np.float32)
        return {**super().global_state(), "beta1_power": one, "beta2_power": one.copy()}

    def update_global(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return {
            **super().update_global(state),
            "beta1_power": state["beta1_power"] * self.beta1,
            "beta2_power": state["beta2_power"] * self.beta2,
        }

    def _lr_t(self, global_state: dict[str, Tensor]) -> Tensor:
        """The bias-corrected step size, computed once per step (cached by state tensor)."""
        b1p, b2p = global_state["beta1_power"], global_state["beta2_power"]
        lr = self.learning_rate
        if isinstance(lr, Tensor) and lr.dtype != b1p.dtype:
            lr = ops.Cast()(lr, b1p.dtype)
        cached = self._lr_t_cache
        if cached is not None and cached[0] is b1p and cached[1] is b2p and cached[3] is (
                self.learning_rate):
            return cached[2]
        lr_t = _sqrt(1.0 - b2p) * lr / (1.0 - b1p)
        object.__setattr__(self, "_lr_t_cache", (b1p, b2p, lr_t, self.learning_rate))
        return lr_t

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        g = self._grad(param, grad, decays(param))
        m = state["moment1"] * self.beta1 + g * (1.0 - self.beta1)
        v = state["moment2"] * self.beta2 + g * g * (1.0 - self.beta2)
        numerator = m * self.beta1 + g * (1.0 - self.beta1) if self.use_nesterov else m
        step = numerator / (_sqrt(v) + self.eps)
        new_param = param - step * self._lr_t(global_state)
        return new_param, {"moment1": m, "moment2": v}


class AdamWeightDecay(_Base):
    """Adam with decoupled weight decay, no bias correction (MindSpore `nn.AdamWeightDecay`):
    m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
    update = m / (sqrt(v) + eps) (+ weight_decay * w for decayed parameters); w -= lr * update."""

    state_prefixes = ("moment1", "moment2")

    def __init__(
        self,
        params: Any,
        learning_rate: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, learning_rate, weight_decay, 1.0)
        self.beta1, self.beta2, self.eps = _check_betas(beta1, beta2, eps, "AdamWeightDecay")

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        m = state["moment1"] * self.beta1 + grad * (1.0 - self.beta1)
        v = state["moment2"] * self.beta2 + grad * grad * (1.0 - self.beta2)
        step = m / (_sqrt(v) + self.eps)
        if self.weight_decay > 0.0 and decays(param):
            step = step + param * self.weight_decay
        return param - step * self.learning_rate, {"moment1": m, "moment2": v}


class Lamb(Adam):
    """LAMB (MindSpore `nn.Lamb`, its Lamb kernel): with t the step (1 first),
    m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
    r = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) (+ weight_decay * w for
    decayed parameters); trust = ||w|| / ||r|| (1 when either norm is 0);
    w -= lr * trust * r. The norms are of the whole parameter (float32), also when it is split
    over ranks or by the parallel optimizer."""

    state_prefixes = ("lamb_m", "lamb_v")

    def __init__(
        self,
        params: Any,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        _Base.__init__(self, params, learning_rate, weight_decay, 1.0)
        self.beta1, self.beta2, self.eps = _check_betas(beta1, beta2, eps, "Lamb")
        object.__setattr__(self, "_lr_t_cache", None)

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        name = _param_name(param) or ""
        m = state["lamb_m"] * self.beta1 + grad * (1.0 - self.beta1)
        v = state["lamb_v"] * self.beta2 + grad * grad * (1.0 - self.beta2)
        b1p, b2p = global_state["beta1_power"], global_state["beta2_power"]
        m_hat = m / ops.Cast()(1.0 - b1p, m.dtype)
        v_hat = v / ops.Cast()(1.0 - b2p, v.dtype)
        r = m_hat / (_sqrt(v_hat) + self.eps)
        if self.weight_decay > 0.0 and decays(param):
            r = r + param * self.weight_decay
        w_norm, r_norm = self.whole_norm(param, name), self.whole_norm(r, name)
        one = ops.OnesLike()(w_norm)
        positive = ops.LogicalAnd()(ops.Greater()(w_norm, 0.0), ops.Greater()(r_norm, 0.0))
        # the ratio is taken of a positive r_norm only (Select), so no inf is formed
        trust = ops.Select()(positive, w_norm / ops.Select()(positive, r_norm, one), one)
        step = r * ops.Cast()(trust, r.dtype)
        return param - step * self.learning_rate, {"lamb_m": m, "lamb_v": v}


class AdaFactor(_Base):
    """Adafactor (MindSpore `nn.AdaFactor`, its non-fused graph): with t the step (1 first,
    the global `afactor_step`), beta2_t = 1 - t^(-decay_rate); the rate is
    min(1e-2, 1 / sqrt(t)) with `relative_step` (min(1e-6 t, 1 / sqrt(t)) with `warmup_init`),
    else `learning_rate`; with `scale_parameter` it is multiplied by max(eps[1], RMS(w)).
    s = g^2 + eps[0]. A parameter of rank >= 2 keeps factored statistics: row = beta2_t row
    + (1 - beta2_t) mean(s, -1), col = beta2_t col + (1 - beta2_t) mean(s, -2), and
    u = g / sqrt(row / mean(row, -1) (x) col); other parameters keep v = beta2_t v + (1 -
    beta2_t) s and u = g / sqrt(v). u /= max(1, RMS(u) / clip_threshold); u *= rate; with
    beta1 > 0, exp_avg = beta1 exp_avg + (1 - beta1) u and u = exp_avg; with weight_decay,
    w -= weight_decay * rate' * w (rate' the scaled rate); w -= u. RMS and the means are over
    whole parameters, also when they are split over ranks. As MindSpore's graph, the update
    does not divide by `loss_scale` and decays every parameter. `compression=True` stores v
    (the statistic of a parameter of rank < 2) in float16, as MindSpore does: each step
    rounds the new v to float16 and the update reads the rounded value back (the other
    states keep the parameter's dtype). Statistics read back in float16 (compressed, or of a
    float16 parameter) enter the update's float32 arithmetic; MindSpore's graph takes their
    inverse square root in float16."""

    def __init__(
        self,
        params: Any,
        learning_rate: Any = None,
        eps: Any = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = 0.8,
        beta1: float | None = 0.9,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        compression: bool = False,
        loss_scale: float = 1.0,
    ) -> None:
        owner = "AdaFactor"
        relative_step = check_bool(relative_step, "relative_step", owner)
        warmup_init = check_bool(warmup_init, "warmup_init", owner)
        if learning_rate is not None and relative_step:
            raise ValueError(f"{owner}: a learning_rate cannot be combined with "
                             "relative_step=True (pass relative_step=False)")
        if warmup_init and not relative_step:
            raise ValueError(f"{owner}: warmup_init=True requires relative_step=True")
        if learning_rate is None and not relative_step:
            raise ValueError(f"{owner}: relative_step=False needs a learning_rate")
        super().__init__(params, 0.0 if learning_rate is None else learning_rate,
                         weight_decay, loss_scale)
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"{owner}: eps must be a pair (eps1, eps2), got {eps!r}")
        self.eps = (_range(eps[0], "eps[0]", owner, 0.0), _range(eps[1], "eps[1]", owner, 0.0))
        self.clip_threshold = _range(clip_threshold, "clip_threshold", owner, 0.0)
        self.decay_rate = _range(decay_rate, "decay_rate", owner, 0.0, 1.0, low_open=True)
        self.beta1 = 0.0 if beta1 is None else _range(beta1, "beta1", owner, 0.0)
        _range(weight_decay, "weight_decay", owner, 0.0, 1.0)
        self.scale_parameter = check_bool(scale_parameter, "scale_parameter", owner)
        if self.dynamic_lr:
            self.scale_parameter = False  # MindSpore: a schedule's rate is not rescaled
        self.relative_step = relative_step
        self.warmup_init = warmup_init
        self.compression = check_bool(compression, "compression", owner)
        self.state_prefixes = (("exp_avg",) if self.beta1 > 0.0 else ()) + (
            "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")

    # -- state --------------------------------------------------------------------------------
    def _state_shape(self, prefix: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        factored = len(shape) >= 2
        if prefix == "exp_avg_sq_row":
            return shape[:-1] if factored else (1,)
        if prefix == "exp_avg_sq_col":
            return shape[:-2] + shape[-1:] if factored else (1,)
        if prefix == "exp_avg_sq":
            return (1,) if factored else shape
        return shape

    def init_state(self, prefix: str, param: Parameter) -> InitializedData | np.ndarray:
        dtype = param.dtype
        if self.compression and prefix == "exp_avg_sq" and len(param.shape) < 2:
            dtype = DType.float16  # MindSpore: compression stores this statistic in float16
        return initializer("zeros", self._state_shape(prefix, tuple(param.shape)), dtype)

    def state_dims(self, prefix: str, param: Parameter) -> tuple[int | None, ...] | None:
        n = len(param.shape)
        if prefix == "exp_avg" or (prefix == "exp_avg_sq" and n < 2):
            return None
        if n < 2:
            return (None,)  # an unused (1,) placeholder, as MindSpore keeps
        if prefix == "exp_avg_sq_row":
            return tuple(range(n - 1))
        if prefix == "exp_avg_sq_col":
            return (*range(n - 2), n - 1)
        return (None,)

    def global_state(self) -> dict[str, np.ndarray]:
        return {**super().global_state(), "afactor_step": np.zeros((1,), np.float32)}

    def update_global(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return {**super().update_global(state), "afactor_step": state["afactor_step"] + 1.0}

    # -- the update ---------------------------------------------------------------------------
    def _rms(self, x: Tensor, owner: str, size: int) -> Tensor:
        """sqrt(mean(x^2)) over the whole parameter-shaped `x`."""
        return _sqrt(self.whole_sum(x * x, owner) * (1.0 / size))

    def _rate_and_beta2(self, global_state: dict[str, Tensor]) -> tuple[Any, Tensor]:
        t = ops.reshape(global_state["afactor_step"], ())
        beta2t = 1.0 - ops.Pow()(t, -self.decay_rate)
        if not self.relative_step:
            rate = self.learning_rate
            if isinstance(rate, Tensor):
                rate = ops.cast(rate, t.dtype)
            return rate, beta2t
        floor = t * 1e-6 if self.warmup_init else Tensor(np.asarray(1e-2, np.float32))
        return ops.Minimum()(floor, 1.0 / _sqrt(t)), beta2t

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        global_state: dict[str, Tensor],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        name = _param_name(param) or ""
        dtype = param.dtype
        work = dtype if dtype.itemsize >= 4 else DType.float32  # float16 math in float32
        w, g = ops.Cast()(param, work), ops.Cast()(grad, work)
        # the whole parameter's shape (in a rank's local graph `param` is its slice)
        whole = next((p for p in self.parameters if p.name == name), param)
        shape = tuple(whole.shape)
        size = max(1, int(np.prod(shape)))
        rate, beta2t = self._rate_and_beta2(global_state)
        if self.scale_parameter:
            rms = self._rms(w, name, size)
            rate = rate * ops.Maximum()(rms, Tensor(np.asarray(self.eps[1], np.float32)))
        rate = ops.Cast()(rate, work) if isinstance(rate, Tensor) else rate
        beta2t = ops.Cast()(beta2t, work)
        square = g * g + self.eps[0]
        new_state = dict(state)
        n = len(shape)
        if n >= 2:
            rows, cols = shape[-2], shape[-1]
            row_mean = self.dim_sum(square, name, n - 1, n - 1) * (1.0 / cols)
            col_mean = self.dim_sum(square, name, n - 2, n - 2) * (1.0 / rows)
            row = ops.Cast()(state["exp_avg_sq_row"], work) * beta2t + row_mean * (1.0 - beta2t)
            col = ops.Cast()(state["exp_avg_sq_col"], work) * beta2t + col_mean * (1.0 - beta2t)
            new_state["exp_avg_sq_row"] = ops.Cast()(row, dtype)
            new_state["exp_avg_sq_col"] = ops.Cast()(col, dtype)
            # the stored (rounded) statistics are what MindSpore reads back
            row, col = ops.Cast()(new_state["exp_avg_sq_row"], work), ops.Cast()(
                new_state["exp_avg_sq_col"], work)
            row_norm = self.dim_sum(row, name, n - 2, n - 2, keep_dims=True) * (1.0 / rows)
            r_factor = ops.ExpandDims()(1.0 / _sqrt(row / row_norm), -1)
            c_factor = ops.ExpandDims()(1.0 / _sqrt(col), -2)
            u = r_factor * c_factor * g
        else:
            v = ops.Cast()(state["exp_avg_sq"], work) * beta2t + square * (1.0 - beta2t)
            new_state["exp_avg_sq"] = ops.Cast()(v, state["exp_avg_sq"].dtype)
            u = (1.0 / _sqrt(ops.Cast()(new_state["exp_avg_sq"], work))) * g
        clip = self._rms(u, name, size) * (1.0 / self.clip_threshold)
        u = u / ops.Maximum()(clip, ops.OnesLike()(clip)) * rate
        if self.beta1 > 0.0:
            m = ops.Cast()(state["exp_avg"], work) * self.beta1 + u * (1.0 - self.beta1)
            new_state["exp_avg"] = ops.Cast()(m, dtype)
            u = ops.Cast()(new_state["exp_avg"], work)
        if self.weight_decay > 0.0:
            w = w + w * (-self.weight_decay) * rate
        return ops.Cast()(w - u, dtype), new_state


def _sqrt(x: Tensor) -> Tensor:
    return ops.Sqrt()(x)
