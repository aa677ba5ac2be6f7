"""`pcompile.mint`: MindSpore's `mindspore.mint` (PyTorch-style functional names and
signatures: `mint.matmul`, `mint.add(input, other, alpha=1)`, `mint.sum(input, dim, keepdim)`,
`mint.nn.functional.relu`, ...), over the same primitives as `pcompile.ops`.

`import pcompile.mint as mint` and `from pcompile import mint` both work. What a primitive
cannot express raises ValueError naming the argument; docs/ops.md lists every name.
"""

from __future__ import annotations

from typing import Any

from pcompile.compiler.frontend import functional as fn
from pcompile.compiler.frontend.mint import nn as nn  # `mint.nn.functional`
from pcompile.compiler.frontend.ops import (
    Add,
    Concat,
    ExpandDims,
    Gather,
    LpNorm,
    Mul,
    ReduceMax,
    ReduceMean,
    ReduceSum,
    Squeeze,
    Sub,
    Transpose,
)

# Same signature as in `ops`.
abs = fn.abs  # noqa: A001
mul = fn.mul
maximum = fn.maximum
minimum = fn.minimum
pow = fn.pow  # noqa: A001
neg = fn.neg
negative = fn.neg
square = fn.square
exp = fn.exp
log = fn.log
sqrt = fn.sqrt
rsqrt = fn.rsqrt
tanh = fn.tanh
sigmoid = fn.sigmoid
erf = fn.erf
cos = fn.cos
sin = fn.sin
floor_divide = fn.floor_divide
isfinite = fn.isfinite
eq = fn.equal
ne = fn.not_equal
not_equal = fn.not_equal
gt = fn.greater
greater = fn.greater
ge = fn.greater_equal
greater_equal = fn.greater_equal
lt = fn.less
less = fn.less
le = fn.less_equal
less_equal = fn.less_equal
logical_and = fn.logical_and
logical_or = fn.logical_or
logical_not = fn.logical_not
where = fn.where
matmul = fn.matmul
bmm = fn.bmm
reshape = fn.reshape
tile = fn.tile
zeros_like = fn.zeros_like
ones_like = fn.ones_like
narrow = fn.narrow


def add(input: Any, other: Any, *, alpha: Any = 1) -> Any:
    """input + alpha * other."""
    return Add()(input, other if alpha == 1 else Mul()(other, alpha))


def sub(input: Any, other: Any, *, alpha: Any = 1) -> Any:
    """input - alpha * other."""
    return Sub()(input, other if alpha == 1 else Mul()(other, alpha))


def div(input: Any, other: Any, *, rounding_mode: str | None = None) -> Any:
    return fn.div(input, other, rounding_mode=rounding_mode)


def _dims(dim: Any) -> tuple[int, ...]:
    if dim is None:
        return ()
    return (dim,) if isinstance(dim, int) else tuple(int(d) for d in dim)


def sum(input: Any, dim: Any = None, keepdim: bool = False, *,  # noqa: A001
        dtype: Any = None) -> Any:
    return ReduceSum(keepdim)(fn._with_dtype(input, dtype), _dims(dim))


def mean(input: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    return ReduceMean(keepdim)(fn._with_dtype(input, dtype), _dims(dim))


def amax(input: Any, dim: Any = (), keepdim: bool = False) -> Any:
    return ReduceMax(keepdim)(input, _dims(dim))


def norm(input: Any, p: Any = "fro", dim: Any = None, keepdim: bool = False, *,
         dtype: Any = None) -> Any:
    """Vector norms: p "fro" (2-norm) or an int >= 1 over `dim` (None: all elements)."""
    x = fn._with_dtype(input, dtype)
    order = 2 if p in ("fro", None) else p
    if isinstance(order, float) and order.is_integer():
        order = int(order)
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"norm: p={p!r} is not supported; use 'fro' or an int >= 1")
    return LpNorm(_dims(dim), order, keepdim, 0.0)(x)


def broadcast_to(input: Any, size: Any) -> Any:
    return fn.broadcast_to(input, size)


def permute(input: Any, dims: Any) -> Any:
    return Transpose()(input, dims)


def transpose(input: Any, dim0: int, dim1: int) -> Any:
    """Swap dims dim0 and dim1."""
    rank = len(input.shape)
    perm = list(range(rank))
    perm[dim0 % rank], perm[dim1 % rank] = perm[dim1 % rank], perm[dim0 % rank]
    return Transpose()(input, tuple(perm))


swapaxes = transpose


def unsqueeze(input: Any, dim: int) -> Any:
    return ExpandDims()(input, dim)


def squeeze(input: Any, dim: Any = None) -> Any:
    return Squeeze(_dims(dim))(input)


def flatten(input: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    return fn._flatten(input, start_dim, end_dim)


def cat(tensors: Any, dim: int = 0) -> Any:
    return Concat(dim)(tensors)


concat = cat


def stack(tensors: Any, dim: int = 0) -> Any:
    return fn.stack(tensors, dim)


def split(tensor: Any, split_size_or_sections: Any, dim: int = 0) -> tuple[Any, ...]:
    return fn.split(tensor, split_size_or_sections, dim)


def index_select(input: Any, dim: int, index: Any) -> Any:
    """The slices of `input` along `dim` at the 1-D `index` (Gather)."""
    if len(index.shape) != 1:
        raise ValueError(f"index_select: index must be 1-D, got shape {tuple(index.shape)}")
    return Gather()(input, index, dim)


__all__ = sorted(
    [name for name, value in globals().items()
     if not name.startswith("_") and callable(value) and not isinstance(value, type)
     and name not in ("annotations", "Any")] + ["nn"]
)
