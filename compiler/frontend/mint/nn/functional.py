"""`pcompile.mint.nn.functional`: MindSpore's `mindspore.mint.nn.functional` (PyTorch-style
signatures: `softmax(input, dim)`, `linear(input, weight, bias)`, ...)."""

from __future__ import annotations

from typing import Any

from pcompile.compiler.frontend import functional as fn
from pcompile.compiler.frontend.ops import Conv2D, Gather, LpNorm, OneHot, RealDiv

relu = fn.relu
silu = fn.silu
sigmoid = fn.sigmoid
tanh = fn.tanh


def gelu(input: Any, approximate: str = "none") -> Any:
    return fn.gelu(input, approximate)


def softmax(input: Any, dim: int | None = None, dtype: Any = None) -> Any:
    """Softmax over `dim` (None: the last dim)."""
    return fn.softmax(input, -1 if dim is None else dim, dtype=dtype)


def log_softmax(input: Any, dim: int | None = None, dtype: Any = None) -> Any:
    return fn.log_softmax(fn._with_dtype(input, dtype), -1 if dim is None else dim)


def layer_norm(input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
               eps: float = 1e-5) -> Any:
    return fn.layer_norm(input, tuple(normalized_shape) if not isinstance(normalized_shape, int)
                        else normalized_shape, weight, bias, eps)


def linear(input: Any, weight: Any, bias: Any = None) -> Any:
    """input @ weight.T + bias."""
    return fn.dense(input, weight, bias)


def conv2d(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Any:
    """padding: an int, a pair, "valid" or "same"."""
    if isinstance(padding, str):
        if padding not in ("valid", "same"):
            raise ValueError(f"conv2d: padding={padding!r} is not supported; use 'valid', "
                             "'same', an int or a pair")
        return fn.conv2d(input, weight, bias, stride, padding, 0, dilation, groups)
    pair = (padding, padding) if isinstance(padding, int) else tuple(padding)
    pad = (pair[0], pair[0], pair[1], pair[1])
    mode = "pad" if any(pad) else "valid"
    out = Conv2D(weight.shape[0], tuple(weight.shape[2:]), pad_mode=mode, pad=pad,
                 stride=stride, dilation=dilation, group=groups)(input, weight)
    return out if bias is None else fn.bias_add(out, bias)


def max_pool2d(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               dilation: Any = 1, *, ceil_mode: bool = False,
               return_indices: bool = False) -> Any:
    return fn.max_pool2d(input, kernel_size, stride, padding, dilation, return_indices,
                        ceil_mode)


def avg_pool2d(input: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: Any = None) -> Any:
    return fn.avg_pool2d(input, kernel_size, kernel_size if stride is None else stride, padding,
                        ceil_mode, count_include_pad, divisor_override)


def one_hot(tensor: Any, num_classes: int = -1) -> Any:
    """One-hot of integer classes (int64 ones and zeros, as PyTorch); `num_classes` must be
    given (the data's maximum is not known when compiling)."""
    if num_classes < 0:
        raise ValueError("one_hot: give num_classes (the largest class is not known when "
                         "compiling)")
    from pcompile.ir.types import DType

    return fn.cast(OneHot(-1)(tensor, num_classes, 1.0, 0.0), DType.int64)


def embedding(input: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False) -> Any:
    """The rows of `weight` at `input` (Gather)."""
    for name, value, default in (("padding_idx", padding_idx, None), ("max_norm", max_norm, None),
                                 ("scale_grad_by_freq", scale_grad_by_freq, False)):
        if value != default:
            raise ValueError(f"embedding: {name}={value!r} is not supported; use {default!r}")
    return Gather()(weight, input, 0)


def normalize(input: Any, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Any:
    """input / max(||input||_p over dim, eps)."""
    order = int(p) if float(p).is_integer() else p
    if not isinstance(order, int) or order < 1:
        raise ValueError(f"normalize: p={p!r} is not supported; use an integer >= 1")
    return RealDiv()(input, LpNorm((dim,), order, True, float(eps))(input))


def cross_entropy(input: Any, target: Any, weight: Any = None, ignore_index: int = -100,  # noqa: A002
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
    """Cross entropy of logits (N, C) against class ids (N,) or probabilities (N, C)."""
    return fn.cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)


__all__ = sorted(name for name, value in globals().items()
                 if not name.startswith("_") and callable(value) and not isinstance(value, type)
                 and name != "Any")
