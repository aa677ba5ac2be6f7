"""MindSpore's optimizers: `SGD`, `Momentum`, `Adam`, `AdamWeightDecay`.

Each `update` is written with ordinary tensor ops, so it runs eagerly on concrete tensors and is
traced into the training graph by `passes.optimizer.append_optimizer`. Gradients are first
divided by `loss_scale`; L2 weight decay (`grad + weight_decay * w`) is applied as MindSpore does:
by `SGD` to every parameter, by `Momentum` and `Adam` (and the decoupled decay of
`AdamWeightDecay`) only to parameters whose names contain neither 'beta' nor 'gamma'
(LayerNorm's shift and scale), MindSpore's default decay filter.

State (per parameter, named `<prefix>.<parameter name>`): SGD `accum` (+ `stat` with
dampening), Momentum `moments`, Adam and AdamWeightDecay `moment1`, `moment2`; Adam also keeps
the global scalars `beta1_power`, `beta2_power` (beta^t after step t, for bias correction).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pcompile.compiler import ops
from pcompile.compiler.initializer import initializer
from pcompile.compiler.nn.layers import check_bool, check_number
from pcompile.compiler.nn.optim_base import Optimizer
from pcompile.compiler.tensor import Parameter, Tensor

__all__ = ["SGD", "Adam", "AdamWeightDecay", "Momentum"]


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

    def init_state(self, prefix: str, param: Parameter) -> np.ndarray:
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


def _sqrt(x: Tensor) -> Tensor:
    return ops.Sqrt()(x)
