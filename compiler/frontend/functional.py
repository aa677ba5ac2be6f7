"""MindSpore's functional ops (`ops.matmul`, `ops.add`, `ops.relu`, ...), re-exported by
`pcompile.ops`: each calls the primitives of `compiler.ops`, with MindSpore 2.x's signatures.

Arguments that are compile-time constants here (shapes, axes, dtypes) become IR attributes, as
for the primitives. What an op cannot express (a rounding mode, pooling with padding, a
data-dependent size) raises ValueError naming the argument; `docs/ops.md` lists every name.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pcompile.compiler.frontend.ops import (
    Abs,
    Add,
    Assign,
    AssignAdd,
    AssignSub,
    Atan2,
    AvgPool,
    BatchMatMul,
    BiasAdd,
    BitwiseAnd,
    BitwiseOr,
    BitwiseXor,
    BroadcastTo,
    Cast,
    Concat,
    Conv2D,
    Cos,
    CumSum,
    Depend,
    Equal,
    Erf,
    Exp,
    ExpandDims,
    FlashAttentionScore,
    Flatten,
    FloorDiv,
    FloorMod,
    Gather,
    GeLU,
    Greater,
    GreaterEqual,
    IsFinite,
    LayerNorm,
    Less,
    LessEqual,
    Log,
    LogicalAnd,
    LogicalNot,
    LogicalOr,
    LogSoftmax,
    LpNorm,
    MatMul,
    Maximum,
    MaxPool,
    Minimum,
    Mul,
    Neg,
    NotEqual,
    OneHot,
    OnesLike,
    Pow,
    RealDiv,
    ReduceMax,
    ReduceMean,
    ReduceMin,
    ReduceSum,
    ReLU,
    Reshape,
    RmsNorm,
    RotaryPositionEmbedding,
    Rsqrt,
    Select,
    Shape,
    Sigmoid,
    Sign,
    SiLU,
    Sin,
    Softmax,
    Sort,
    Split,
    Sqrt,
    Square,
    Squeeze,
    StridedSlice,
    Sub,
    Swiglu,
    Tanh,
    Tile,
    TopK,
    Transpose,
    Trunc,
    ZerosLike,
)
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.ir.types import DType

# -- helpers ------------------------------------------------------------------------------------


def _ndim(x: Any) -> int:
    return len(x.shape)


def _axis_tuple(axis: Any) -> tuple[int, ...]:
    """None -> () (all axes), an int -> (axis,), a list -> tuple."""
    if axis is None:
        return ()
    if isinstance(axis, int) and not isinstance(axis, bool):
        return (axis,)
    return tuple(int(a) for a in axis)


def _with_dtype(x: Any, dtype: Any) -> Any:
    return x if dtype is None else Cast()(x, dtype)


def _unsupported(op: str, what: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"{op}: {what}={value!r} is not supported; {valid}")


# -- element-wise -------------------------------------------------------------------------------


def abs(input: Any) -> Any:  # noqa: A001  (MindSpore's name)
    return Abs()(input)


absolute = abs


def add(input: Any, other: Any) -> Any:
    return Add()(input, other)


def sub(input: Any, other: Any) -> Any:
    return Sub()(input, other)


subtract = sub


def mul(input: Any, other: Any) -> Any:
    return Mul()(input, other)


multiply = mul


def div(input: Any, other: Any, *, rounding_mode: str | None = None) -> Any:
    """input / other; `rounding_mode="floor"` rounds the quotient down (FloorDiv), "trunc"
    toward zero (Trunc of the quotient), as MindSpore's `ops.div`."""
    if rounding_mode is not None and rounding_mode not in ("floor", "trunc"):
        raise ValueError("For ops.div, rounding_mode value should be None, 'floor' or 'trunc', "
                         f"but got {rounding_mode!r}")
    if rounding_mode == "floor":
        return FloorDiv()(input, other)
    out = RealDiv()(input, other)
    return Trunc()(out) if rounding_mode == "trunc" else out


def true_divide(dividend: Any, divisor: Any) -> Any:
    return RealDiv()(dividend, divisor)


divide = true_divide


def maximum(input: Any, other: Any) -> Any:
    return Maximum()(input, other)


def minimum(input: Any, other: Any) -> Any:
    return Minimum()(input, other)


def pow(input: Any, exponent: Any) -> Any:  # noqa: A001
    return Pow()(input, exponent)


def neg(input: Any) -> Any:
    return Neg()(input)


negative = neg


def square(input: Any) -> Any:
    return Square()(input)


def exp(input: Any) -> Any:
    return Exp()(input)


def log(input: Any) -> Any:
    return Log()(input)


def sqrt(x: Any) -> Any:
    return Sqrt()(x)


def rsqrt(input: Any) -> Any:
    return Rsqrt()(input)


def tanh(input: Any) -> Any:
    return Tanh()(input)


def sigmoid(input: Any) -> Any:
    return Sigmoid()(input)


def erf(input: Any) -> Any:
    return Erf()(input)


def cos(input: Any) -> Any:
    return Cos()(input)


def sin(input: Any) -> Any:
    return Sin()(input)


def floor_div(input: Any, other: Any) -> Any:
    """floor(input / other), MindSpore's `ops.floor_div`."""
    return FloorDiv()(input, other)


floor_divide = floor_div


def floor_mod(x: Any, y: Any) -> Any:
    """x - floor(x / y) * y: the remainder with the sign of y, MindSpore's `ops.floor_mod`."""
    return FloorMod()(x, y)


def trunc(input: Any) -> Any:
    """input rounded toward zero, MindSpore's `ops.trunc`."""
    return Trunc()(input)


def atan2(input: Any, other: Any) -> Any:
    """atan(input / other) in the quadrant of (other, input), MindSpore's `ops.atan2`."""
    return Atan2()(input, other)


def bitwise_and(input: Any, other: Any) -> Any:
    return BitwiseAnd()(input, other)


def bitwise_or(input: Any, other: Any) -> Any:
    return BitwiseOr()(input, other)


def bitwise_xor(input: Any, other: Any) -> Any:
    return BitwiseXor()(input, other)


def isfinite(input: Any) -> Any:
    return IsFinite()(input)


def sign(input: Any) -> Any:
    return Sign()(input)


def reciprocal(input: Any) -> Any:
    return 1.0 / input


def relu(input: Any) -> Any:
    return ReLU()(input)


def silu(input: Any) -> Any:
    return SiLU()(input)


def rotary_position_embedding(x: Any, cos: Any, sin: Any, mode: int = 0) -> Any:
    return RotaryPositionEmbedding()(x, cos, sin, mode)


def swiglu(input: Any, dim: int = -1) -> Any:
    return Swiglu()(input, dim)


def gelu(input_x: Any, approximate: str = "none") -> Any:
    """GeLU: `approximate="none"` is x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2))) (MindSpore's
    default), `"tanh"` the tanh approximation (the GeLU primitive)."""
    if approximate == "tanh":
        return GeLU()(input_x)
    if approximate != "none":
        raise _unsupported("gelu", "approximate", approximate, "use 'none' or 'tanh'")
    cdf = Mul()(Add()(Erf()(Mul()(input_x, 1.0 / math.sqrt(2.0))), 1.0), 0.5)
    return Mul()(input_x, cdf)


def cast(input: Any, dtype: Any) -> Any:
    return Cast()(input, dtype)


def bias_add(input_x: Any, bias: Any) -> Any:
    return BiasAdd()(input_x, bias)


# -- comparison and logic -----------------------------------------------------------------------


def equal(input: Any, other: Any) -> Any:
    return Equal()(input, other)


def not_equal(input: Any, other: Any) -> Any:
    return NotEqual()(input, other)


ne = not_equal


def greater(input: Any, other: Any) -> Any:
    return Greater()(input, other)


gt = greater


def greater_equal(input: Any, other: Any) -> Any:
    return GreaterEqual()(input, other)


ge = greater_equal


def less(input: Any, other: Any) -> Any:
    return Less()(input, other)


lt = less


def less_equal(input: Any, other: Any) -> Any:
    return LessEqual()(input, other)


le = less_equal


def logical_and(input: Any, other: Any) -> Any:
    return LogicalAnd()(input, other)


def logical_or(input: Any, other: Any) -> Any:
    return LogicalOr()(input, other)


def logical_not(input: Any) -> Any:
    return LogicalNot()(input)


def select(cond: Any, input: Any, other: Any) -> Any:
    return Select()(cond, input, other)


def where(condition: Any, input: Any, other: Any) -> Any:
    return Select()(condition, input, other)


def masked_fill(input_x: Any, mask: Any, value: Any) -> Any:
    """`value` where the Bool `mask` is True, else `input_x` (broadcast together), in
    `input_x`'s dtype: MindSpore's `ops.masked_fill`, traced as a `Select`. `value` is a
    number or a 0-d tensor."""
    if not isinstance(mask, Tensor) or mask.dtype is not DType.bool_:
        what = f"a {mask.dtype.value} tensor" if isinstance(mask, Tensor) else repr(mask)
        raise TypeError(f"masked_fill: mask must be a Bool tensor (a comparison), got {what}")
    dtype = DType.from_any(input_x.dtype)
    if isinstance(value, Tensor):
        if value.shape != ():
            raise ValueError(f"masked_fill: value must be a number or a 0-d tensor, got a "
                             f"tensor of shape {value.shape}")
        fill_value = value if value.dtype is dtype else Cast()(value, dtype)
    elif isinstance(value, (bool, int, float, np.number, np.bool_)):
        fill_value = Tensor(np.asarray(value, dtype.np))
    else:
        raise TypeError(f"masked_fill: value must be a number or a 0-d tensor, got "
                        f"{type(value).__name__} {value!r}")
    return Select()(mask, fill_value, input_x)


# -- linear algebra -----------------------------------------------------------------------------


def matmul(input: Any, other: Any) -> Any:
    """numpy's matmul: 2-D x 2-D is MatMul, batched (broadcast batch dims) is BatchMatMul; a
    1-D operand gains a dim for the product and loses it after."""
    a, b = input, other
    vec_a, vec_b = _ndim(a) == 1, _ndim(b) == 1
    if vec_a:
        a = ExpandDims()(a, 0)
    if vec_b:
        b = ExpandDims()(b, -1)
    out = MatMul()(a, b) if _ndim(a) == 2 and _ndim(b) == 2 else BatchMatMul()(a, b)
    drop = (-2,) * vec_a + (-1,) * vec_b
    if drop:
        out = Squeeze(tuple(range(-len(drop), 0)) if vec_a and vec_b else drop)(out)
    return out


def mm(input: Any, mat2: Any) -> Any:
    return MatMul()(input, mat2)


def bmm(input_x: Any, mat2: Any) -> Any:
    return BatchMatMul()(input_x, mat2)


def dense(input: Any, weight: Any, bias: Any = None) -> Any:
    """input @ weight.T (+ bias): MindSpore's `ops.dense`."""
    if _ndim(input) == 2:
        out = MatMul(transpose_b=True)(input, weight)
    else:
        out = BatchMatMul(transpose_b=True)(input, weight)
    return out if bias is None else Add()(out, bias)


# -- reductions and norms -----------------------------------------------------------------------


def sum(input: Any, dim: Any = None, keepdim: bool = False, *,  # noqa: A001
        dtype: Any = None) -> Any:
    return ReduceSum(keepdim)(_with_dtype(input, dtype), _axis_tuple(dim))


def mean(input: Any, axis: Any = None, keep_dims: bool = False) -> Any:
    return ReduceMean(keep_dims)(input, _axis_tuple(axis))


def amax(input: Any, axis: Any = None, keepdims: bool = False, *, initial: Any = None,
         where: Any = None) -> Any:
    if initial is not None or where is not None:
        raise ValueError("amax: initial and where are not supported; reduce the whole axis")
    return ReduceMax(keepdims)(input, _axis_tuple(axis))


def reduce_sum(x: Any, axis: Any = (), keep_dims: bool = False) -> Any:
    return ReduceSum(keep_dims)(x, axis)


def reduce_mean(x: Any, axis: Any = (), keep_dims: bool = False) -> Any:
    return ReduceMean(keep_dims)(x, axis)


def reduce_max(x: Any, axis: Any = (), keep_dims: bool = False) -> Any:
    return ReduceMax(keep_dims)(x, axis)


def reduce_min(x: Any, axis: Any = (), keep_dims: bool = False) -> Any:
    return ReduceMin(keep_dims)(x, axis)


def amin(input: Any, axis: Any = None, keepdims: bool = False, *, initial: Any = None,
         where: Any = None) -> Any:
    if initial is not None or where is not None:
        raise ValueError("amin: initial and where are not supported; reduce the whole axis")
    return ReduceMin(keepdims)(input, _axis_tuple(axis))


def lp_norm(input_x: Any, axis: Any, p: int = 2, keep_dims: bool = False,
            epsilon: float = 1e-12) -> Any:
    return LpNorm(axis, p, keep_dims, epsilon)(input_x)


def norm(A: Any, ord: Any = None, dim: Any = None, keepdim: bool = False, *,  # noqa: A002,N803
         dtype: Any = None) -> Any:
    """Vector norms: ord None or "fro" (2-norm, of all elements when dim is None) or an int
    >= 1, over `dim` (an int, or a tuple when ord is None / "fro")."""
    x = _with_dtype(A, dtype)
    axes = _axis_tuple(dim)
    if ord in (None, "fro"):
        return LpNorm(axes, 2, keepdim, 0.0)(x)
    if isinstance(ord, int) and not isinstance(ord, bool) and ord >= 1 and len(axes) <= 1:
        return LpNorm(axes, ord, keepdim, 0.0)(x)
    raise _unsupported("norm", "ord", ord, "use None, 'fro' or an int >= 1 (a vector norm "
                       "over one dim); matrix norms are not supported")


def softmax(input: Any, axis: int = -1, *, dtype: Any = None) -> Any:
    return Softmax(axis)(_with_dtype(input, dtype))


def log_softmax(logits: Any, axis: int = -1) -> Any:
    return LogSoftmax(axis)(logits)


def layer_norm(input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
               eps: float = 1e-5) -> Any:
    """MindSpore 2.x's `layer_norm(input, normalized_shape, weight, bias, eps)`; the older
    `layer_norm(x, gamma, beta, begin_norm_axis=-1, epsilon=1e-5)` still works."""
    if hasattr(normalized_shape, "shape") and not isinstance(normalized_shape, tuple):
        gamma, beta = normalized_shape, weight
        axis = -1 if bias is None else int(bias)
        return LayerNorm(axis, axis, eps)(input, gamma, beta)[0]
    shape = (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(
        int(d) for d in normalized_shape)
    if tuple(input.shape[_ndim(input) - len(shape):]) != shape:
        raise ValueError(f"layer_norm: normalized_shape {shape} must be the trailing dims of "
                         f"the input {tuple(input.shape)}")
    dtype = input.dtype.np
    gamma = np.ones(shape, dtype) if weight is None else weight
    beta = np.zeros(shape, dtype) if bias is None else bias
    begin = _ndim(input) - len(shape)
    return LayerNorm(begin, begin, eps)(input, gamma, beta)[0]


def rms_norm(x: Any, gamma: Any, epsilon: float = 1e-6) -> Any:
    """(y, rstd), as MindSpore's `ops.rms_norm`."""
    return RmsNorm(epsilon)(x, gamma)


# -- sorting and scans --------------------------------------------------------------------------


def _moved_last(x: Any, dim: int) -> tuple[Any, tuple[int, ...] | None]:
    """`x` with its dim `dim` moved last (TopK works on the last axis), and the permutation
    that moves it back (None when it is last already; the permutation is its own inverse)."""
    rank = _ndim(x)
    dim = dim + rank if dim < 0 else dim
    if not 0 <= dim < rank:
        raise ValueError(f"topk: dim {dim} is out of range for a tensor of rank {rank}")
    if dim == rank - 1:
        return x, None
    perm = list(range(rank))
    perm[dim], perm[-1] = perm[-1], perm[dim]
    return Transpose()(x, tuple(perm)), tuple(perm)


def topk(input: Any, k: int, dim: Any = None, largest: bool = True, sorted: bool = True  # noqa: A002
         ) -> Any:
    """MindSpore 2.x's `topk(input, k, dim=None, largest=True, sorted=True)` -> (values,
    Int32 indices): the k largest (or, with largest=False, smallest) entries along `dim` (the
    last by default). TopK on the last axis; another dim is transposed there and back, and the
    smallest are the largest of the negated input."""
    if not isinstance(largest, bool):
        raise TypeError(f"topk: largest must be a bool, got {largest!r}")
    x, perm = _moved_last(input, -1 if dim is None else int(dim))
    if not largest:
        x = Neg()(x)
    values, indices = TopK(sorted)(x, k)
    if not largest:
        values = Neg()(values)
    if perm is not None:
        values, indices = Transpose()(values, perm), Transpose()(indices, perm)
    return values, indices


def sort(input_x: Any, axis: int = -1, descending: bool = False) -> Any:
    """MindSpore's `sort(input_x, axis=-1, descending=False)` -> (values, Int32 indices)."""
    return Sort(axis, descending)(input_x)


def cumsum(x: Any, axis: int, dtype: Any = None) -> Any:
    """MindSpore's `cumsum(x, axis, dtype=None)`: the cumulative sum along `axis`, x cast to
    `dtype` first when one is given."""
    return CumSum()(_with_dtype(x, dtype), axis)


# -- shape and data movement --------------------------------------------------------------------


def shape(input: Any) -> tuple[int, ...]:
    return Shape()(input)


def reshape(input: Any, shape: Any) -> Any:
    return Reshape()(input, shape)


def transpose(input: Any, input_perm: Any) -> Any:
    return Transpose()(input, input_perm)


def permute(input: Any, axis: Any) -> Any:
    return Transpose()(input, axis)


def expand_dims(input_x: Any, axis: int) -> Any:
    return ExpandDims()(input_x, axis)


def unsqueeze(input: Any, dim: int) -> Any:
    return ExpandDims()(input, dim)


def squeeze(input: Any, axis: Any = None) -> Any:
    return Squeeze(_axis_tuple(axis))(input)


def flatten(input: Any, order: str = "C", *, start_dim: int = 1, end_dim: int = -1) -> Any:
    """Merge dims start_dim..end_dim (the Flatten primitive for the default 1..-1)."""
    if order != "C":
        raise _unsupported("flatten", "order", order, "only 'C' (row-major)")
    return _flatten(input, start_dim, end_dim)


def _flatten(x: Any, start: int, end: int) -> Any:
    rank = _ndim(x)
    if rank == 0:
        return Reshape()(x, (1,))
    start, end = start % rank, end % rank
    if start == 1 and end == rank - 1 and rank >= 2:
        return Flatten()(x)
    if start > end:
        raise ValueError(f"flatten: start_dim {start} must not come after end_dim {end}")
    shape = tuple(x.shape)
    merged = int(np.prod(shape[start:end + 1]))
    return Reshape()(x, shape[:start] + (merged,) + shape[end + 1:])


def broadcast_to(input: Any, shape: Any) -> Any:
    return BroadcastTo(shape)(input)


def tile(input: Any, dims: Any) -> Any:
    return Tile()(input, dims)


def repeat_interleave(input: Any, repeats: Any, axis: Any = None) -> Any:
    """Each element of `input` repeated along `axis` (the flattened input when None), as
    MindSpore's `ops.repeat_interleave`: `repeats` an int (every element the same number of
    times: ExpandDims, Tile, Reshape) or one constant count per element of the axis (a
    Gather of the repeated positions)."""
    x = input
    if axis is None:
        x = Reshape()(x, (int(np.prod(x.shape, dtype=np.int64)),))
        axis = 0
    rank = _ndim(x)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not (
            -rank <= axis < rank):
        raise ValueError(f"repeat_interleave: axis must be an int in [{-rank}, {rank - 1}] for "
                         f"an input of shape {tuple(x.shape)}, got {axis!r}")
    axis = int(axis) % rank
    if isinstance(repeats, Tensor):
        if repeats.is_symbolic:
            raise ValueError("repeat_interleave: repeats must be constant (its values set the "
                             "result's static shape), got a traced tensor")
        repeats = repeats.asnumpy()
    counts = np.asarray(repeats)
    if counts.dtype.kind not in "iu" or counts.ndim > 1:
        raise ValueError(f"repeat_interleave: repeats must be an int or a 1-D sequence of ints, "
                         f"got {repeats!r}")
    size = x.shape[axis]
    if counts.ndim == 1 and counts.size == 1:
        counts = counts.reshape(())
    if (counts < 1).any():
        raise ValueError(f"repeat_interleave: repeats must be >= 1, got {counts.tolist()}")
    if counts.ndim == 0:
        times = int(counts)
        shape = tuple(x.shape)
        multiples = (1,) * (axis + 1) + (times,) + (1,) * (rank - axis - 1)
        spread = Tile()(ExpandDims()(x, axis + 1), multiples)
        return Reshape()(spread, shape[:axis] + (size * times,) + shape[axis + 1:])
    if counts.size != size:
        raise ValueError(f"repeat_interleave: repeats has {counts.size} counts for axis {axis} "
                         f"of size {size}; give one count per element, or one int")
    positions = np.repeat(np.arange(size, dtype=np.int32), counts)
    return Gather()(x, Tensor(positions), axis)


def zeros_like(input: Any, *, dtype: Any = None) -> Any:
    return _with_dtype(ZerosLike()(input), dtype)


def ones_like(input: Any, *, dtype: Any = None) -> Any:
    return _with_dtype(OnesLike()(input), dtype)


def concat(tensors: Any, axis: int = 0) -> Any:
    return Concat(axis)(tensors)


cat = concat


def stack(tensors: Any, axis: int = 0) -> Any:
    """Concat of the inputs, each given a new dim at `axis`."""
    rank = _ndim(tensors[0]) + 1
    return Concat(axis)([ExpandDims()(t, axis % rank) for t in tensors])


def split(tensor: Any, split_size_or_sections: Any = None, axis: int = 0, *,
          output_num: int | None = None) -> tuple[Any, ...]:
    """MindSpore 2.x's split: chunks of `split_size_or_sections` elements along `axis` (the
    last may be shorter), or sections of the listed sizes. Equal chunks are one Split;
    others are StridedSlices. `output_num=n` (the older form) splits into n equal parts."""
    size = tensor.shape[axis]
    if output_num is not None:
        return Split(axis, output_num)(tensor)
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        step = split_size_or_sections
        if step < 1:
            raise ValueError(f"split: split_size_or_sections must be >= 1, got {step}")
        sections = [min(step, size - k) for k in range(0, size, step)]
    elif isinstance(split_size_or_sections, Sequence):
        sections = [int(s) for s in split_size_or_sections]
        if builtins.sum(sections) != size:
            raise ValueError(f"split: the sections {sections} must add up to the size {size} "
                             f"of axis {axis}")
    else:
        raise TypeError("split: split_size_or_sections must be an int or a list of ints, got "
                        f"{split_size_or_sections!r}")
    return _split_sections(tensor, sections, axis)


def _split_sections(x: Any, sections: list[int], axis: int) -> tuple[Any, ...]:
    if len(set(sections)) == 1:
        parts = Split(axis, len(sections))(x)
        return parts if isinstance(parts, tuple) else (parts,)
    rank = _ndim(x)
    axis %= rank
    out, start = [], 0
    for length in sections:
        begin = [0] * rank
        end = list(x.shape)
        begin[axis], end[axis] = start, start + length
        out.append(StridedSlice()(x, begin, end, [1] * rank))
        start += length
    return tuple(out)


def strided_slice(input_x: Any, begin: Any, end: Any, strides: Any, begin_mask: int = 0,
                  end_mask: int = 0, ellipsis_mask: int = 0, new_axis_mask: int = 0,
                  shrink_axis_mask: int = 0) -> Any:
    return StridedSlice(begin_mask, end_mask, ellipsis_mask, new_axis_mask,
                        shrink_axis_mask)(input_x, begin, end, strides)


def narrow(input: Any, axis: int, start: int, length: int) -> Any:
    rank = _ndim(input)
    axis %= rank
    begin, end = [0] * rank, list(input.shape)
    begin[axis], end[axis] = start, start + length
    return StridedSlice()(input, begin, end, [1] * rank)


def gather(input_params: Any, input_indices: Any, axis: int, batch_dims: int = 0) -> Any:
    return Gather(batch_dims)(input_params, input_indices, axis)


def one_hot(indices: Any, depth: int, on_value: Any = 1, off_value: Any = 0,
            axis: int = -1) -> Any:
    return OneHot(axis)(indices, depth, on_value, off_value)


# -- convolution, pooling, attention ------------------------------------------------------------


def conv2d(input: Any, weight: Any, bias: Any = None, stride: Any = 1, pad_mode: str = "valid",
           padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Any:
    if isinstance(padding, int):
        padding = (padding,) * 4
    elif len(padding) == 2:
        padding = (padding[0], padding[0], padding[1], padding[1])
    if pad_mode == "valid" and any(padding):
        pad_mode = "pad"
    out = Conv2D(weight.shape[0], tuple(weight.shape[2:]), pad_mode=pad_mode, pad=padding,
                 stride=stride, dilation=dilation, group=groups)(input, weight)
    return out if bias is None else BiasAdd()(out, bias)


def _pool_check(op: str, padding: Any, dilation: Any, ceil_mode: bool,
                return_indices: bool = False) -> None:
    if padding not in (0, (0, 0)):
        raise _unsupported(op, "padding", padding, "use 0 (pcompile pools 'valid' windows)")
    if dilation not in (1, (1, 1)):
        raise _unsupported(op, "dilation", dilation, "use 1")
    if ceil_mode:
        raise _unsupported(op, "ceil_mode", ceil_mode, "use False")
    if return_indices:
        raise _unsupported(op, "return_indices", return_indices, "use False")


def max_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               dilation: Any = 1, return_indices: bool = False, ceil_mode: bool = False) -> Any:
    _pool_check("max_pool2d", padding, dilation, ceil_mode, return_indices)
    return MaxPool(kernel_size, kernel_size if stride is None else stride)(x)


def avg_pool2d(input_x: Any, kernel_size: Any = 1, stride: Any = 1, padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: Any = None) -> Any:
    _pool_check("avg_pool2d", padding, 1, ceil_mode)
    if divisor_override is not None:
        raise _unsupported("avg_pool2d", "divisor_override", divisor_override, "use None")
    return AvgPool(kernel_size, stride)(input_x)


def flash_attention_score(query: Any, key: Any, value: Any, head_num: int,
                          real_shift: Any = None, drop_mask: Any = None,
                          padding_mask: Any = None, attn_mask: Any = None, prefix: Any = None,
                          actual_seq_qlen: Any = None, actual_seq_kvlen: Any = None,
                          keep_prob: float = 1.0, scalar_value: float = 1.0,
                          pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
                          inner_precise: int = 0, input_layout: str = "BSH",
                          sparse_mode: int = 0) -> Any:
    """MindSpore's functional form (its scale argument is spelled `scalar_value`): returns
    attention_out only."""
    prim = FlashAttentionScore(head_num, keep_prob, scalar_value, pre_tokens, next_tokens,
                               inner_precise, input_layout, sparse_mode)
    return prim(query, key, value, real_shift, drop_mask, padding_mask, attn_mask, prefix,
                actual_seq_qlen, actual_seq_kvlen)[3]



def cross_entropy(input: Any, target: Any, weight: Any = None, ignore_index: int = -100,  # noqa: A002
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Any:
    """MindSpore 2.x's `ops.cross_entropy`: logits (N, C) against class ids (N,) or class
    probabilities (N, C), as `nn.CrossEntropyLoss`; `weight` is a constant (C,) tensor of class
    weights."""
    from pcompile.compiler.frontend.nn.loss import CrossEntropyLoss

    if isinstance(weight, Parameter) or (isinstance(weight, Tensor) and weight.is_symbolic):
        what = f"Parameter {weight.name!r}" if isinstance(weight, Parameter) else "a traced tensor"
        raise _unsupported("cross_entropy", "weight", what, "class weights must be a constant "
                           "(a Tensor of data, a numpy array or a list)")
    return CrossEntropyLoss(weight, ignore_index, reduction, label_smoothing)(input, target)

# -- dependencies and training steps ------------------------------------------------------------


def depend(value: Any, expr: Any) -> Any:
    """`value`, computed after `expr` (MindSpore's `ops.depend`)."""
    return Depend()(value, expr)


def fill(type: Any, shape: Any, value: Any) -> Tensor:  # noqa: A002  (MindSpore's name)
    """A tensor of `shape` filled with `value` (a constant)."""
    return Tensor(np.full(tuple(int(d) for d in shape), value, DType.from_any(type).np))


def assign(variable: Any, value: Any) -> Any:
    """The Parameter `variable`'s new value is `value` (MindSpore's `ops.assign`)."""
    return Assign()(variable, value)


def assign_add(variable: Any, value: Any) -> Any:
    """The Parameter `variable`'s new value is variable + value (`ops.assign_add`)."""
    return AssignAdd()(variable, value)


def assign_sub(variable: Any, value: Any) -> Any:
    """The Parameter `variable`'s new value is variable - value (`ops.assign_sub`)."""
    return AssignSub()(variable, value)


def global_norm(x: Any) -> Any:
    """sqrt of the sum of squares of every element of the tensors in `x` (float32); in a
    parallel training step each gradient slice is counted once over the ranks."""
    from pcompile.compiler.frontend.train_step import current_step

    tensors = list(x) if isinstance(x, (tuple, list)) else [x]
    step = current_step()
    if step is not None:
        return step.global_norm(tensors)
    total: Any = None
    for t in tensors:
        term = ReduceSum(False)(Square()(Cast()(t, DType.float32)), ())
        total = term if total is None else total + term
    return Sqrt()(total)


def clip_by_global_norm(x: Any, clip_norm: float = 1.0, use_norm: Any = None) -> Any:
    """MindSpore's `ops.clip_by_global_norm`: x_i * clip_norm / max(global_norm(x), clip_norm)
    for every tensor of `x` (computed in float32, cast back to each tensor's dtype)."""
    if use_norm is not None:
        raise ValueError("clip_by_global_norm: input 'use_norm' only supports None currently, "
                         f"but got 'use_norm': {use_norm}")
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or clip_norm <= 0:
        raise ValueError(f"clip_by_global_norm: clip_norm must be > 0, got {clip_norm!r}")
    single = not isinstance(x, (tuple, list))
    tensors = [x] if single else list(x)
    norm = global_norm(tensors)
    clip = Tensor(np.asarray(clip_norm, np.float32))
    norm = Select()(GreaterEqual()(norm, clip), norm, clip)
    out = tuple(Cast()(Cast()(t, DType.float32) * clip / norm, t.dtype) for t in tensors)
    return out[0] if single else out


# -- MindSpore's `ops.functional` helpers (`F.dtype`, `F.tuple_to_array`) -----------------------


def dtype(input: Any) -> DType:  # noqa: A002  (MindSpore's name)
    """The element type of `input` (MindSpore's `ops.dtype`, `F.dtype`)."""
    return DType.from_any(input.dtype)


def tuple_to_array(input_x: Any) -> Tensor:
    """A constant 1-D tensor of a tuple of numbers (MindSpore's `F.tuple_to_array`): float32
    when any element is a float, else int64, as MindSpore makes it."""
    if not isinstance(input_x, (tuple, list)) or not input_x or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in input_x):
        raise TypeError(f"tuple_to_array takes a non-empty tuple of numbers, got {input_x!r}")
    kind = np.float32 if any(isinstance(v, float) for v in input_x) else np.int64
    return Tensor(np.asarray(input_x, kind))


#: Every functional name (aliases included): `pcompile.ops` re-exports them.
__all__ = sorted(name for name, value in globals().items()
                 if not name.startswith("_") and callable(value)
                 and getattr(value, "__module__", None) == __name__)
