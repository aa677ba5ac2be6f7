"""Batch normalisation: MindSpore's `P.BatchNorm(is_training, epsilon, momentum)` and the cells
`nn.BatchNorm1d` / `nn.BatchNorm2d`, traced as the arithmetic they compute.

`BatchNorm(x, scale, bias, mean, variance)` on x (N, C) or (N, C, H, W), statistics per channel
C over the other dims:

* training: the batch's mean m and (biased) variance v; y = (x - m) / sqrt(v + epsilon) * scale
  + bias; the moving statistics, Parameters, are updated in place as MindSpore's kernel does:
  mean <- (1 - momentum) * mean + momentum * m, variance <- (1 - momentum) * variance +
  momentum * v * n / (n - 1) (the unbiased variance, n the elements per channel). The outputs
  are (y, m, v, m, v).
* inference: y = (x - mean) / sqrt(variance + epsilon) * scale + bias; the outputs are (y,
  mean, variance, mean, variance).

Tracing it as ReduceMean, Sub, Square, Rsqrt, Mul and Add (and `ops.assign` for the moving
statistics, compiler/frontend/assign.py) makes every plan compute the single-device statistics: a
split N, H or W dim is summed over the ranks by the ReduceMeans' AllReduce, which is what
MindSpore's BatchNormInfo does in training (a SyncBatchNorm over the ranks that split N, H or W).
Its strategy is MindSpore's `((n, c, h, w), (c,), (c,), (c,), (c,))`; the traced ops take the
splits it implies.
"""

from __future__ import annotations

from typing import Any

from pcompile.compiler.frontend.dropout import _data_parallel_ranks
from pcompile.compiler.frontend.primitive import Primitive
from pcompile.compiler.frontend.tensor import Parameter, Tensor


def _check_float(value: Any, name: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"For 'BatchNorm', the '{name}' must be float, but got "
                        f"{type(value).__name__} {value!r}")
    if not low <= float(value) <= high:
        raise ValueError(f"For 'BatchNorm', the '{name}' must be in [{low}, {high}], but got "
                         f"{value!r}")
    return float(value)


def batch_norm(prim: Primitive, x: Any, scale: Any, bias: Any, mean: Any,
               variance: Any) -> tuple[Any, ...]:
    """`prim(x, scale, bias, mean, variance)` for a `P.BatchNorm` primitive `prim`."""
    from pcompile.compiler.frontend import ops
    from pcompile.compiler.frontend.functional import assign, reshape

    if "group_size" in prim.user_attrs:
        raise ValueError(
            "For 'BatchNorm', the 'group_size' attribute (statistics synchronised over groups of "
            "that many ranks, MindSpore's Ascend SyncBatchNorm) is not supported: pcompile "
            "normalises by the whole batch's statistics on every plan; remove the attribute")
    training = bool(prim.attrs["is_training"])
    eps = float(prim.attrs["epsilon"])
    momentum = float(prim.attrs["momentum"])
    shape = tuple(x.shape)
    if len(shape) not in (2, 4):
        raise ValueError(f"For 'BatchNorm', the input must be 2-D (N, C) or 4-D (N, C, H, W), "
                         f"but got shape {shape}")
    channels = shape[1]
    for name, value in (("scale", scale), ("bias", bias), ("mean", mean),
                        ("variance", variance)):
        if tuple(value.shape) != (channels,):
            raise ValueError(f"For 'BatchNorm', '{name}' must have shape ({channels},) (the "
                             f"channels of x {shape}), but got {tuple(value.shape)}")
    axes = (0,) if len(shape) == 2 else (0, 2, 3)
    per_channel = (channels,) + (1,) * (len(shape) - 2)  # broadcasts against (N, C, ...)
    s = prim.in_strategy
    full = s[0] if s else None
    chan = tuple(s[1]) if s else None
    bshape = (1,) + per_channel  # the statistics kept with their dims: (1, C[, 1, 1])
    stat = (1, chan[0]) + (1,) * (len(shape) - 2) if chan else None
    pc = (chan[0],) + (1,) * (len(shape) - 2) if chan else None

    def op(cls: Any, *strategy: Any, **kwargs: Any) -> Any:
        p = cls(**kwargs)
        if s and all(part is not None for part in strategy):
            p.shard(tuple(strategy))
        return p

    def as_channels(t: Any) -> Any:
        return reshape(t, per_channel) if len(shape) == 4 else t

    count = 1
    for d in axes:
        count *= shape[d]
    ranks = _data_parallel_ranks()
    if training and ranks > 1:
        # data_parallel traces each rank's rows: the whole batch's statistics are the sums of
        # every rank's (MindSpore's SyncBatchNorm), so each rank normalises as one device does
        # and updates the moving statistics alike
        count *= ranks

        def whole_mean(t: Any) -> Any:
            return ops.AllReduce()(ops.ReduceSum(keep_dims=True)(t, axes)) / float(count)

        m = whole_mean(x)
        centered = x - m
        v = whole_mean(ops.Square()(centered))
    elif training:
        m = op(ops.ReduceMean, full, keep_dims=True)(x, axes)
        centered = op(ops.Sub, full, stat)(x, m)
        v = op(ops.ReduceMean, full, keep_dims=True)(op(ops.Square, full)(centered), axes)
    else:
        m = reshape(mean, bshape)
        centered = op(ops.Sub, full, stat)(x, m)
        v = reshape(variance, bshape)
    rstd = op(ops.Rsqrt, stat)(op(ops.Add, stat, ())(v, Tensor(eps)))
    y = op(ops.Mul, full, stat)(centered, rstd)
    y = op(ops.Mul, full, pc)(y, as_channels(scale))
    y = op(ops.Add, full, pc)(y, as_channels(bias))
    if not training:
        return y, mean, variance, mean, variance
    batch_mean = reshape(m, (channels,))
    batch_var = reshape(v, (channels,))
    unbiased = batch_var * (count / max(count - 1, 1))
    for stored, current in ((mean, batch_mean), (variance, unbiased)):
        if isinstance(stored, Parameter):
            assign(stored, stored * (1.0 - momentum) + current * momentum)
    return y, batch_mean, batch_var, batch_mean, batch_var
