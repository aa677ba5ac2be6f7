"""MindSpore-style primitives (`ops.MatMul()`, `ops.ReLU()`, ...) and their functional forms
(`ops.matmul`, `ops.relu`, ...). Arguments that MindSpore passes at call time but that are
compile-time constants here (Reshape's shape, ReduceSum's axis, Cast's dtype) become IR
attributes of the node."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from pcompile.compiler.frontend.primitive import Primitive
from pcompile.compiler.frontend.tensor import Tensor
from pcompile.ir.types import DType as IRDType

# MindSpore splits this module into `ops.operations` (the primitives; `nn_ops`, `_inner_ops`,
# `_sequence_ops`),
# `ops.functional` and `ops.primitive`; here they are this one module. `__path__` lets
# `import pcompile.ops.operations.nn_ops` resolve through the package's aliases
# (pcompile/__init__.py); nothing is ever found on it.
__path__: list[str] = []
operations = functional = primitive = nn_ops = _inner_ops = _sequence_ops = sys.modules[__name__]
# MindSpore's generated primitives (`ops.auto_generate.gen_ops_prim.Swiglu()`, mindformers'
# fused kernels) are attributes of this module too.
auto_generate = gen_ops_prim = sys.modules[__name__]


def constexpr(fn: Any = None, **_options: Any) -> Any:
    """MindSpore's `@constexpr` (a function of compile-time values, evaluated while the graph is
    built): pcompile traces Python, so such a function already runs at trace time on plain
    values; the decorator returns it unchanged (`@constexpr` and `@constexpr(...)` both)."""
    if fn is None:
        return lambda f: f
    return fn


def _pair(value: Any, what: str) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (int(value[0]), int(value[1]))
    if isinstance(value, (tuple, list)) and len(value) == 4:  # MindSpore's (1, 1, h, w) form
        return (int(value[2]), int(value[3]))
    raise TypeError(f"{what} must be an int or a pair of ints, got {value!r}")


def _axes(axis: Any) -> tuple[int, ...]:
    if axis is None:
        return ()
    if isinstance(axis, int):
        return (axis,)
    return tuple(int(a) for a in axis)


class ReduceOp:
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


class _Simple(Primitive):
    """A primitive whose constructor takes no arguments."""

    def __init__(self) -> None:
        super().__init__()


def _simple(name: str, op: str | None = None) -> type[Primitive]:
    return type(name, (_Simple,), {"op": op or name, "__doc__": f"The {op or name} primitive."})


Add = _simple("Add")
TensorAdd = Add  # MindSpore's old name of Add
Sub = _simple("Sub")
Mul = _simple("Mul")
RealDiv = _simple("RealDiv")
Div = _simple("Div", "RealDiv")
Maximum = _simple("Maximum")
Minimum = _simple("Minimum")
Neg = _simple("Neg")
Abs = _simple("Abs")
Erf = _simple("Erf")
Exp = _simple("Exp")
Log = _simple("Log")
Sqrt = _simple("Sqrt")
Rsqrt = _simple("Rsqrt")
Square = _simple("Square")
Pow = _simple("Pow")
Tanh = _simple("Tanh")
Sigmoid = _simple("Sigmoid")
ReLU = _simple("ReLU")
GeLU = _simple("GeLU")
Flatten = _simple("Flatten")
ZerosLike = _simple("ZerosLike")
OnesLike = _simple("OnesLike")
SiLU = _simple("SiLU")
Equal = _simple("Equal")
NotEqual = _simple("NotEqual")
Greater = _simple("Greater")
GreaterEqual = _simple("GreaterEqual")
Less = _simple("Less")
LessEqual = _simple("LessEqual")
LogicalAnd = _simple("LogicalAnd")
LogicalOr = _simple("LogicalOr")
LogicalNot = _simple("LogicalNot")
Select = _simple("Select")
Identity = _simple("Identity")
FloorDiv = _simple("FloorDiv")
Mod = _simple("Mod")
Cos = _simple("Cos")
Sin = _simple("Sin")
IsFinite = _simple("IsFinite")
Sign = _simple("Sign")
Trunc = _simple("Trunc")
FloorMod = _simple("FloorMod")
Atan2 = _simple("Atan2")
DivNoNan = _simple("DivNoNan")
MulNoNan = _simple("MulNoNan")
BitwiseAnd = _simple("BitwiseAnd")
BitwiseOr = _simple("BitwiseOr")
BitwiseXor = _simple("BitwiseXor")


class AddExt(_Simple):
    """`ops.auto_generate.AddExt()(input, other, alpha=1)`: input + alpha * other."""

    op = "AddExt"

    def __call__(self, input: Any, other: Any, alpha: Any = 1) -> Any:  # noqa: A002
        return self._apply([input, other], alpha=_number(alpha, f"{self.op}: alpha"))


class SubExt(AddExt):
    """`ops.auto_generate.SubExt()(input, other, alpha=1)`: input - alpha * other."""

    op = "SubExt"


def _number(value: Any, what: str) -> int | float:
    if isinstance(value, Tensor) and not value.is_symbolic and value.shape == ():
        value = value.asnumpy().item()
    if isinstance(value, (np.integer, np.floating)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    return value


class Max(_Simple):
    """`ops.auto_generate.Max()(input)` (`mint.max(input)`): the largest element, a 0-d tensor
    (a ReduceMax over every dim: its strategy splits any dim, the ranks' maxima are combined
    by an AllReduce max)."""

    op = "ReduceMax"

    def __call__(self, input: Any) -> Any:  # noqa: A002
        return self._apply([input], axis=(), keep_dims=False)


class BatchNorm(Primitive):
    """`P.BatchNorm(is_training=False, epsilon=1e-5, momentum=0.1, data_format="NCHW")(x,
    scale, bias, mean, variance)` -> (y, batch_mean, batch_variance, reserve_1, reserve_2): in
    training the batch's statistics normalise x and update the moving `mean` / `variance`
    Parameters, otherwise those normalise it (compiler/frontend/batch_norm.py). Its strategy is
    MindSpore's `((n, c, h, w), (c,), (c,), (c,), (c,))`."""

    op = "BatchNorm"

    def __init__(self, is_training: bool = False, epsilon: float = 1e-5, momentum: float = 0.1,
                 data_format: str = "NCHW") -> None:
        from pcompile.compiler.frontend.batch_norm import _check_float

        if not isinstance(is_training, bool):
            raise TypeError(f"For 'BatchNorm', the 'is_training' must be bool, but got "
                            f"{type(is_training).__name__} {is_training!r}")
        if data_format != "NCHW":
            raise ValueError(f"For 'BatchNorm', the 'data_format' must be 'NCHW' (pcompile "
                             f"has no NHWC layout), but got {data_format!r}")
        super().__init__(is_training=is_training,
                         epsilon=_check_float(epsilon, "epsilon", 0.0, 1.0),
                         momentum=_check_float(momentum, "momentum", 0.0, 1.0),
                         data_format=data_format)

    def __call__(self, x: Any, scale: Any, bias: Any, mean: Any, variance: Any) -> Any:
        from pcompile.compiler.frontend.batch_norm import batch_norm

        return batch_norm(self, x, scale, bias, mean, variance)


class Embedding(Primitive):
    """`ops.auto_generate.Embedding()(input, weight, padding_idx=None, max_norm=None,
    norm_type=2.0, scale_grad_by_freq=False)`: the rows of `weight` at `input` (a Gather of
    the table's rows). Its strategy is MindSpore's operand order, `((input dims), (weight
    dims))`; the IR's Gather takes the table first."""

    op = "Gather"

    def __call__(self, input: Any, weight: Any, padding_idx: Any = None,  # noqa: A002
                 max_norm: Any = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False) -> Any:
        for name, value, default in (("padding_idx", padding_idx, None),
                                     ("max_norm", max_norm, None),
                                     ("scale_grad_by_freq", scale_grad_by_freq, False)):
            if value != default:
                raise ValueError(f"Embedding: {name}={value!r} is not supported; use "
                                 f"{default!r}")
        given = self.in_strategy
        if given is not None and len(given) == 2:  # MindSpore's order: input, then weight
            self.in_strategy = (given[1], given[0])
        try:
            return self._apply([weight, input], axis=0)
        finally:
            self.in_strategy = given


class Depend(_Simple):
    """`ops.Depend()(value, expr)`: value, computed after expr. `expr` may be a tuple or list
    of tensors (one Depend per tensor); entries that are not traced tensors (Python values,
    None) order nothing and are skipped."""

    op = "Depend"

    def __call__(self, value: Any, expr: Any) -> Any:
        items = list(expr) if isinstance(expr, (tuple, list)) else [expr]
        out = value
        for item in items:
            if isinstance(item, (tuple, list)):
                out = self(out, item)
            elif isinstance(item, Tensor) and item.is_symbolic:
                out = self._apply([out, item])
        return out


class Shape(_Simple):
    """`ops.Shape()(x)`: the static shape of x as a Python tuple of ints. Shapes are static
    at compile time (as in MindSpore's graph mode, which folds Shape to a constant), so no IR
    node is emitted; the tuple feeds Python arithmetic, Reshape shapes, slice bounds."""

    op = "Shape"

    def __call__(self, x: Any) -> tuple[int, ...]:
        shape = getattr(x, "shape", None)
        if shape is None:
            raise TypeError(f"Shape expects a tensor, got {type(x).__name__} {x!r}")
        return tuple(int(d) for d in shape)


class MatMul(Primitive):
    op = "MatMul"

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        super().__init__(transpose_a=bool(transpose_a), transpose_b=bool(transpose_b))


class BatchMatMul(Primitive):
    op = "BatchMatMul"

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False) -> None:
        super().__init__(transpose_a=bool(transpose_a), transpose_b=bool(transpose_b))


class BiasAdd(Primitive):
    op = "BiasAdd"

    def __init__(self, data_format: str = "NCHW") -> None:
        super().__init__(data_format=data_format)


class Softmax(Primitive):
    op = "Softmax"

    def __init__(self, axis: Any = -1) -> None:
        super().__init__(axis=_axes(axis))


class LogSoftmax(Primitive):
    op = "LogSoftmax"

    def __init__(self, axis: int = -1) -> None:
        super().__init__(axis=int(axis))


class Cast(Primitive):
    op = "Cast"

    def __init__(self) -> None:
        super().__init__()

    def __call__(self, x: Any, dtype: Any) -> Any:
        return self._apply([x], dst_type=IRDType.from_any(dtype))


class _Reduce(Primitive):
    def __init__(self, keep_dims: bool = False) -> None:
        super().__init__(keep_dims=bool(keep_dims))

    def __call__(self, x: Any, axis: Any = ()) -> Any:
        return self._apply([x], axis=_axes(axis))


class ReduceSum(_Reduce):
    op = "ReduceSum"


class ReduceMean(_Reduce):
    op = "ReduceMean"


class ReduceMax(_Reduce):
    op = "ReduceMax"


class ReduceMin(_Reduce):
    op = "ReduceMin"


class Reshape(_Simple):
    op = "Reshape"

    def __call__(self, x: Any, shape: Any) -> Any:
        return self._apply([x], shape=tuple(int(d) for d in shape))


class Transpose(_Simple):
    op = "Transpose"

    def __call__(self, x: Any, perm: Any) -> Any:
        return self._apply([x], perm=tuple(int(d) for d in perm))


class ExpandDims(_Simple):
    op = "ExpandDims"

    def __call__(self, x: Any, axis: int) -> Any:
        return self._apply([x], axis=int(axis))


class Squeeze(Primitive):
    op = "Squeeze"

    def __init__(self, axis: Any = ()) -> None:
        super().__init__(axis=_axes(axis))


class BroadcastTo(Primitive):
    op = "BroadcastTo"

    def __init__(self, shape: Any) -> None:
        super().__init__(shape=tuple(int(d) for d in shape))


class Tile(_Simple):
    """`Tile()(x, multiples)`: x repeated multiples[i] times along dim i. In a strategy, a dim
    whose multiple is > 1 splits its copies (MindSpore's rule); other dims split x. The
    strategy has one value per multiple (MindSpore's form, also when the multiples are longer
    than x's rank) or one per dim of x."""

    op = "Tile"
    _multiples: tuple[int, ...] = ()

    def __call__(self, x: Any, multiples: Any) -> Any:
        self._multiples = tuple(int(m) for m in multiples)
        return self._apply([x], multiples=self._multiples)

    def _check_strategy(self, op: str, values: list[Any], scope: str, source: Any) -> None:
        strategy = self.in_strategy or ()
        rank = getattr(values[0].type, "rank", -1) if values else -1
        if (len(values) == len(strategy) == 1 and isinstance(strategy[0], tuple)
                and len(strategy[0]) == len(self._multiples) > rank):
            return  # one value per multiple: the sharding rule checks the values
        super()._check_strategy(op, values, scope, source)


class Concat(Primitive):
    op = "Concat"

    def __init__(self, axis: int = 0) -> None:
        super().__init__(axis=int(axis))

    def __call__(self, tensors: Any) -> Any:
        return self._apply(list(tensors))


class Split(Primitive):
    op = "Split"

    def __init__(self, axis: int = 0, output_num: int = 1) -> None:
        super().__init__(axis=int(axis), output_num=int(output_num))


class StridedSlice(Primitive):
    op = "StridedSlice"

    def __init__(
        self,
        begin_mask: int = 0,
        end_mask: int = 0,
        ellipsis_mask: int = 0,
        new_axis_mask: int = 0,
        shrink_axis_mask: int = 0,
    ) -> None:
        super().__init__(
            begin_mask=begin_mask,
            end_mask=end_mask,
            ellipsis_mask=ellipsis_mask,
            new_axis_mask=new_axis_mask,
            shrink_axis_mask=shrink_axis_mask,
        )

    def __call__(self, x: Any, begin: Any, end: Any, strides: Any) -> Any:
        return self._apply(
            [x],
            begin=tuple(int(v) for v in begin),
            end=tuple(int(v) for v in end),
            strides=tuple(int(v) for v in strides),
        )


class Gather(Primitive):
    """`Gather(batch_dims=0)(input_params, input_indices, axis)`. With batch_dims = b the
    first b dims of params and indices are batch dims (MindSpore's batch mode: the gathered
    axis is never split, the batch dims split alike)."""

    op = "Gather"

    def __init__(self, batch_dims: int = 0) -> None:
        if isinstance(batch_dims, bool) or not isinstance(batch_dims, int):
            raise TypeError(f"Gather: batch_dims must be an int, got {batch_dims!r}")
        super().__init__(batch_dims=batch_dims)

    def __call__(self, params: Any, indices: Any, axis: int = 0) -> Any:
        return self._apply([params, indices], axis=int(axis))


class LpNorm(Primitive):
    """`LpNorm(axis, p=2, keep_dims=False, epsilon=1e-12)(input)`: max((sum |x|**p)**(1/p),
    epsilon) over `axis`."""

    op = "LpNorm"

    def __init__(self, axis: Any, p: int = 2, keep_dims: bool = False,
                 epsilon: float = 1e-12) -> None:
        if isinstance(p, bool) or not isinstance(p, int):
            raise TypeError(f"LpNorm: p must be an int, got {p!r}")
        if not isinstance(keep_dims, bool):
            raise TypeError(f"LpNorm: keep_dims must be a bool, got {keep_dims!r}")
        super().__init__(axis=_axes(axis), p=p, keep_dims=keep_dims, epsilon=float(epsilon))


class OneHot(Primitive):
    """`OneHot(axis)(indices, depth, on_value, off_value)`. Its strategy is MindSpore's
    `((dp, mp), (), ())` (the split of the [N, depth] output, depth included, then () for the
    on and off values) or one tuple for the indices."""

    op = "OneHot"

    def __init__(self, axis: int = -1) -> None:
        super().__init__(axis=int(axis))

    def _check_strategy(self, op: str, values: list[Any], scope: str, source: Any) -> None:
        strategy = self.in_strategy or ()
        rank = len(getattr(values[0].type, "shape", ())) if values else 0
        if (len(strategy) == 3 and strategy[1] == () and strategy[2] == ()
                and isinstance(strategy[0], tuple) and len(strategy[0]) == rank + 1):
            return
        super()._check_strategy(op, values, scope, source)

    def __call__(self, indices: Any, depth: int, on_value: Any = 1.0, off_value: Any = 0.0) -> Any:
        dtype = IRDType.float32
        if isinstance(on_value, Tensor):
            dtype = on_value.dtype
            on_value = float(on_value.asnumpy())
        if isinstance(off_value, Tensor):
            off_value = float(off_value.asnumpy())
        return self._apply(
            [indices],
            depth=int(depth),
            on_value=float(on_value),
            off_value=float(off_value),
            dtype=dtype,
        )


def _scalar_int(value: Any, what: str) -> int:
    """A Python int from an int or a 0-d constant Tensor (MindSpore passes k and axis either
    way); a traced (data-dependent) value cannot set a static shape."""
    if isinstance(value, Tensor):
        if value.is_symbolic:
            raise TypeError(f"{what} must be a constant int, got a traced tensor (its value "
                            "sets the result's static shape)")
        value = value.asnumpy()
    if isinstance(value, np.ndarray) and value.shape == () and value.dtype.kind in "iu":
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


class TopK(Primitive):
    """`TopK(sorted=True)(x, k)` -> (values, indices): the k largest values along the last
    axis, descending, and their Int32 positions. Its strategy splits x's dims but the last."""

    op = "TopK"

    def __init__(self, sorted: bool = True) -> None:  # noqa: A002  (MindSpore's name)
        if not isinstance(sorted, bool):
            raise TypeError(f"TopK: sorted must be a bool, got {sorted!r}")
        super().__init__(sorted=sorted)

    def __call__(self, x: Any, k: Any) -> Any:
        return self._apply([x], k=_scalar_int(k, "TopK: k"))


class TopKRouter(Primitive):
    """`P._inner_ops.TopKRouter()(x, capacity, expert_num, drop_type=0)` -> (dispatch_index,
    combine_index): mindformers' fused routing kernel (`use_fused_ops_topkrouter`) on the
    (groups, tokens, k) Int32 expert ids of a TopK; each expert keeps its first `capacity`
    choices, queued token by token (drop_type 0) or by choice rank (1). Its strategy splits
    the group dim only."""

    op = "TopKRouter"

    def __call__(self, x: Any, capacity: Any, expert_num: Any, drop_type: Any = 0) -> Any:
        return self._apply([x], capacity=_scalar_int(capacity, "TopKRouter: capacity"),
                           expert_num=_scalar_int(expert_num, "TopKRouter: expert_num"),
                           drop_type=_scalar_int(drop_type, "TopKRouter: drop_type"))


class Sort(Primitive):
    """`Sort(axis=-1, descending=False)(x)` -> (values, indices Int32). Its strategy splits x's
    dims but `axis`."""

    op = "Sort"

    def __init__(self, axis: int = -1, descending: bool = False) -> None:
        if not isinstance(descending, bool):
            raise TypeError(f"Sort: descending must be a bool, got {descending!r}")
        super().__init__(axis=_scalar_int(axis, "Sort: axis"), descending=descending)


class CumSum(Primitive):
    """`CumSum(exclusive=False, reverse=False)(x, axis)`: the cumulative sum along `axis`.
    Its strategy splits x's dims but `axis`."""

    op = "CumSum"

    def __init__(self, exclusive: bool = False, reverse: bool = False) -> None:
        for name, value in (("exclusive", exclusive), ("reverse", reverse)):
            if not isinstance(value, bool):
                raise TypeError(f"CumSum: {name} must be a bool, got {value!r}")
        super().__init__(exclusive=exclusive, reverse=reverse)

    def __call__(self, x: Any, axis: Any) -> Any:
        return self._apply([x], axis=_scalar_int(axis, "CumSum: axis"))


class _Filled(_Simple):
    """`Zeros()(size, type)` / `Ones()(size, type)`: a constant tensor of shape `size` (an int
    or a tuple of ints) and dtype `type` (default Float32; also `dtype=`, as mindformers
    passes it). As MindSpore's graph mode folds
    them, they emit no IR node: the tensor is a constant operand of the ops that use it."""

    fill_value = 0

    def __call__(self, size: Any, type: Any = None,  # noqa: A002  (MindSpore's)
                 dtype: Any = None) -> Tensor:
        if type is not None and dtype is not None:
            raise TypeError(f"{self.op}: give the dtype once, as `type` or as `dtype=`, got "
                            f"both ({type!r}, {dtype!r})")
        type = dtype if type is None else type  # mindformers passes `dtype=`
        if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
            shape: tuple[int, ...] = (int(size),)
        elif isinstance(size, (tuple, list)):
            shape = tuple(_scalar_int(d, f"{self.op}: size") for d in size)
        else:
            raise TypeError(f"{self.op}: size must be an int or a tuple of ints, got "
                            f"{size.__class__.__name__} {size!r}")
        if any(d < 0 for d in shape):
            raise ValueError(f"{self.op}: size must not hold negative dims, got {shape}")
        dtype = IRDType.float32 if type is None else IRDType.from_any(type)
        return Tensor(np.full(shape, self.fill_value, dtype.np))


class Zeros(_Filled):
    op = "Zeros"
    fill_value = 0


class Ones(_Filled):
    op = "Ones"
    fill_value = 1


class LayerNorm(Primitive):
    """Returns (y, mean, variance) like MindSpore; mean and variance are computed only when
    used (unused nodes are removed after tracing)."""

    op = "LayerNorm"

    def __init__(
        self, begin_norm_axis: int = 1, begin_params_axis: int = 1, epsilon: float = 1e-7
    ) -> None:
        super().__init__(
            begin_norm_axis=int(begin_norm_axis),
            begin_params_axis=int(begin_params_axis),
            epsilon=float(epsilon),
        )

    def __call__(self, x: Any, gamma: Any, beta: Any) -> Any:
        y = self._apply([x, gamma, beta])
        axis = self.attrs["begin_norm_axis"] % len(x.shape)
        axes = tuple(range(axis, len(x.shape)))
        mean = ReduceMean(keep_dims=True)(x, axes)
        centered = Sub()(x, mean)
        var = ReduceMean(keep_dims=True)(Mul()(centered, centered), axes)
        return y, mean, var


class RmsNorm(Primitive):
    """`RmsNorm(epsilon)(x, gamma)` -> (y, rstd): normalises over gamma's dims (the trailing
    dims of x); rstd is Float32 with those dims kept as 1."""

    op = "RmsNorm"

    def __init__(self, epsilon: float = 1e-6) -> None:
        super().__init__(epsilon=float(epsilon))


class FlashAttentionScore(Primitive):
    """MindSpore's `FlashAttentionScore(head_num, keep_prob, scale_value, pre_tokens,
    next_tokens, inner_precise, input_layout, sparse_mode)`, called with (query, key, value,
    real_shift, drop_mask, padding_mask, attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen)
    and returning (softmax_max, softmax_sum, softmax_out, attention_out). Of the optional
    inputs only attn_mask is supported; its strategy lists the passed inputs only, as in
    MindSpore."""

    op = "FlashAttentionScore"

    def __init__(self, head_num: int, keep_prob: float = 1.0, scale_value: float = 1.0,
                 pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
                 inner_precise: int = 0, input_layout: str = "BSH", sparse_mode: int = 0
                 ) -> None:
        super().__init__(head_num=int(head_num), keep_prob=float(keep_prob),
                         scale_value=float(scale_value), pre_tokens=int(pre_tokens),
                         next_tokens=int(next_tokens), inner_precise=int(inner_precise),
                         input_layout=str(input_layout), sparse_mode=int(sparse_mode))

    def __call__(self, query: Any, key: Any, value: Any, real_shift: Any = None,
                 drop_mask: Any = None, padding_mask: Any = None, attn_mask: Any = None,
                 prefix: Any = None, actual_seq_qlen: Any = None,
                 actual_seq_kvlen: Any = None) -> Any:
        given = {"real_shift": real_shift, "drop_mask": drop_mask,
                 "padding_mask": padding_mask, "prefix": prefix,
                 "actual_seq_qlen": actual_seq_qlen, "actual_seq_kvlen": actual_seq_kvlen}
        unsupported = [name for name, value in given.items() if value is not None]
        if unsupported:
            raise ValueError(
                f"FlashAttentionScore: the optional input(s) {', '.join(unsupported)} are not "
                "supported; pass None (attn_mask is the one optional input pcompile takes)"
            )
        operands = [query, key, value] + ([] if attn_mask is None else [attn_mask])
        return self._apply(operands)


class Swiglu(_Simple):
    """`Swiglu()(x, dim=-1)`: silu(a) * b, a and b the first and second halves of x along
    `dim` (MindSpore's `ops.auto_generate.gen_ops_prim.Swiglu`, mindformers' fused swiglu). Its
    strategy splits every dim but `dim`."""

    op = "Swiglu"

    def __call__(self, x: Any, dim: Any = -1) -> Any:
        return self._apply([x], dim=_scalar_int(dim, "Swiglu: dim"))


class RotaryPositionEmbedding(_Simple):
    """`RotaryPositionEmbedding()(x, cos, sin, mode=0)`: x * cos + rotate(x) * sin, x 4-D,
    cos and sin broadcast to it; mode 0 rotates the halves of the last dim (GPT-NeoX), 1 its
    interleaved pairs (GPT-J). MindSpore's `ops.auto_generate.gen_ops_prim` primitive
    (mindformers' fused rope). Its strategy splits x's dims but the last, cos and sin alike."""

    op = "RotaryPositionEmbedding"

    def __call__(self, x: Any, cos: Any, sin: Any, mode: Any = 0) -> Any:
        return self._apply([x, cos, sin], mode=_scalar_int(mode, "RotaryPositionEmbedding: mode"))


class GroupedMatmul(Primitive):
    """`GroupedMatmul(split_item=3, group_type=0)([x], [weight], None, None, None, None, None,
    group_list)` -> [y]: MindSpore's grouped matrix product as mindformers' MoEV3 calls it
    (`ops.auto_generate.GroupedMatmul`): x (M, K) rows sorted by expert, weight (E, K, N),
    group_list (E,) the cumulative row end of each expert; row m times its expert's matrix,
    rows after the last end zero. The lists hold one tensor each (split_item 3); bias,
    quantisation scales and offsets are not implemented. Its strategy splits K (the result
    all-reduced) and N, never the rows or the experts."""

    op = "GroupedMatmul"

    def __init__(self, split_item: int = 0, group_type: int = -1) -> None:
        super().__init__(split_item=_scalar_int(split_item, "GroupedMatmul: split_item"),
                         group_type=_scalar_int(group_type, "GroupedMatmul: group_type"))

    def __call__(self, x: Any, weight: Any, bias: Any = None, scale: Any = None,
                 offset: Any = None, antiquant_scale: Any = None, antiquant_offset: Any = None,
                 group_list: Any = None) -> Any:
        unsupported = [name for name, value in (
            ("bias", bias), ("scale", scale), ("offset", offset),
            ("antiquant_scale", antiquant_scale), ("antiquant_offset", antiquant_offset))
            if value is not None]
        if unsupported:
            raise ValueError(f"GroupedMatmul: {', '.join(unsupported)} must be None (pcompile "
                             "implements the unquantised product without bias, as MoEV3 calls "
                             "it)")
        x_list, w_list = (list(v) if isinstance(v, (list, tuple)) else [v] for v in (x, weight))
        if len(x_list) != 1 or len(w_list) != 1:
            raise ValueError(f"GroupedMatmul: x and weight must be lists of one tensor each "
                             f"(split_item=3), got {len(x_list)} and {len(w_list)}")
        if group_list is None:
            raise ValueError("GroupedMatmul: group_list is required (group_type=0: the "
                             "cumulative row end of each expert)")
        return [self._apply([x_list[0], w_list[0], group_list])]


class MoveTo(Primitive):
    """`MoveTo()(x, to="CPU", blocking=True)`: MindSpore copies x to another memory (MoEV3 moves
    AlltoAllV's counts to the host, where its kernel reads them). pcompile's collectives read
    run-time counts on the device (`AlltoAllV` takes them as operands), so the move is x
    itself: no node, no copy. `to` must be "CPU", "Ascend" or "GPU"."""

    op = "MoveTo"

    def __call__(self, x: Any, to: str = "CPU", blocking: bool = True) -> Any:
        if to not in ("CPU", "Ascend", "GPU"):
            raise ValueError(f"MoveTo: to must be 'CPU', 'Ascend' or 'GPU', got {to!r}")
        if not isinstance(blocking, bool):
            raise TypeError(f"MoveTo: blocking must be a bool, got {blocking!r}")
        return x


class SoftmaxCrossEntropyWithLogits(_Simple):
    """Returns (per-sample loss, gradient w.r.t. logits) like MindSpore; the second output is
    computed only when used."""

    op = "SoftmaxCrossEntropyWithLogits"

    def __call__(self, logits: Any, labels: Any) -> Any:
        loss = self._apply([logits, labels])
        backprop = Sub()(Softmax(-1)(logits), labels)
        return loss, backprop


class SparseSoftmaxCrossEntropyWithLogits(Primitive):
    op = "SparseSoftmaxCrossEntropyWithLogits"

    def __init__(self, is_grad: bool = False) -> None:
        super().__init__(is_grad=bool(is_grad))


class Conv2D(Primitive):
    op = "Conv2D"

    def __init__(
        self,
        out_channel: int,
        kernel_size: Any,
        mode: int = 1,
        pad_mode: str = "valid",
        pad: Any = 0,
        stride: Any = 1,
        dilation: Any = 1,
        group: int = 1,
        data_format: str = "NCHW",
    ) -> None:
        if isinstance(pad, int):
            pad = (pad, pad, pad, pad)
        super().__init__(
            out_channel=int(out_channel),
            kernel_size=_pair(kernel_size, "kernel_size"),
            stride=_pair(stride, "stride"),
            pad_mode=str(pad_mode).lower(),
            pad=tuple(int(p) for p in pad),
            dilation=_pair(dilation, "dilation"),
            group=int(group),
            data_format=data_format,
        )


class _Pool(Primitive):
    def __init__(
        self,
        kernel_size: Any = 1,
        strides: Any = 1,
        pad_mode: str = "valid",
        data_format: str = "NCHW",
    ) -> None:
        super().__init__(
            kernel_size=_pair(kernel_size, "kernel_size"),
            strides=_pair(strides, "strides"),
            pad_mode=str(pad_mode).upper(),
            data_format=data_format,
        )


class MaxPool(_Pool):
    op = "MaxPool"


class AvgPool(_Pool):
    op = "AvgPool"


# -- collectives (user-called, manual parallel) -----------------------------------------------


def _world(group: str, prim: str = "") -> tuple[Any, Any]:
    from pcompile.compiler.frontend.communication import group_ranks

    # MindSpore's check_value_type('group', ..., (str,)) and the created groups
    # (compiler/frontend/communication.py: inside a Morph region, every rank's own group)
    return group_ranks(group, prim)


class AllReduce(Primitive):
    op = "AllReduce"

    def __init__(self, op: str = ReduceOp.SUM, group: str = "nccl_world_group") -> None:
        name, ranks = _world(group, "AllReduce")
        super().__init__(op=op, group=name, rank_list=ranks)


class AllGather(Primitive):
    op = "AllGather"

    def __init__(self, group: str = "nccl_world_group") -> None:
        name, ranks = _world(group, "AllGather")
        super().__init__(group=name, rank_list=ranks)


class ReduceScatter(Primitive):
    op = "ReduceScatter"

    def __init__(self, op: str = ReduceOp.SUM, group: str = "nccl_world_group") -> None:
        name, ranks = _world(group, "ReduceScatter")
        super().__init__(op=op, group=name, rank_list=ranks)


class AlltoAll(Primitive):
    op = "AlltoAll"

    def __init__(
        self, split_count: int, split_dim: int, concat_dim: int, group: str = "nccl_world_group"
    ) -> None:
        name, ranks = _world(group, "AlltoAll")
        for arg, value in (("split_count", split_count), ("split_dim", split_dim),
                           ("concat_dim", concat_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"For 'AlltoAll', the '{arg}' must be int, but got "
                                f"{type(value).__name__} {value!r}")
        super().__init__(
            split_count=int(split_count),
            split_dim=int(split_dim),
            concat_dim=int(concat_dim),
            group=name,
            rank_list=ranks,
        )


class Broadcast(Primitive):
    op = "Broadcast"

    def __init__(self, root_rank: int, group: str = "nccl_world_group") -> None:
        name, ranks = _world(group, "Broadcast")
        super().__init__(root_rank=int(root_rank), group=name, rank_list=ranks)

    def __call__(self, inputs: Any) -> Any:
        if isinstance(inputs, (tuple, list)):
            return tuple(self._apply([x]) for x in inputs)
        return self._apply([inputs])


# -- MindSpore primitives pcompile does not implement -------------------------------------------


class _Unimplemented(Primitive):
    """A MindSpore primitive pcompile has no rules for. Model code may construct it (mindformers
    builds some it never calls, e.g. `_NLLLoss.gather_d`); calling it is one clear error that
    names the primitive, its instance and the source line."""

    hint = ("use the primitives listed in docs/ops.md (a missing one can be added as "
            "docs/CONTRIBUTING-ops.md describes)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from pcompile.compiler.frontend.tracing import current_tracer, user_source
        from pcompile.ir.errors import OpError

        tracer = current_tracer()
        raise OpError(self.op, "pcompile has no rules for this MindSpore primitive, so it "
                      "cannot be traced", instance_name=self.instance_name,
                      scope=tracer.scope if tracer is not None else "", source=user_source(),
                      hint=self.hint)


def _unimplemented(name: str, hint: str = "") -> type[Primitive]:
    fields: dict[str, Any] = {
        "op": name, "__doc__": f"MindSpore's {name}: constructible, not implemented."}
    if hint:
        fields["hint"] = hint
    return type(name, (_Unimplemented,), fields)


GatherD = _unimplemented("GatherD")
# built by mindformers' TopkRouterV2 and called only on paths a training step does not take
# (dynamic capacity, the V1 router, debugging)
TensorToScalar = _unimplemented("TensorToScalar")
ArgMaxWithValue = _unimplemented("ArgMaxWithValue")
Print = _unimplemented("Print")


# -- indexing -----------------------------------------------------------------------------------


def getitem(x: Tensor, index: Any) -> Tensor:
    """`x[a:b]`, `x[:, 3]`, `x[..., ::2]`: StridedSlice, then Reshape away integer indices."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        pos = next(k for k, i in enumerate(index) if i is Ellipsis)
        fill = x.ndim - (len(index) - 1)
        index = index[:pos] + (slice(None),) * fill + index[pos + 1 :]
    if len(index) > x.ndim:
        raise IndexError(f"too many indices for a tensor of rank {x.ndim}: {index!r}")
    index = index + (slice(None),) * (x.ndim - len(index))
    begin, end, strides, keep = [], [], [], []
    for dim, (size, i) in enumerate(zip(x.shape, index)):
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise IndexError("only positive slice steps are supported")
            begin.append(start)
            end.append(max(stop, start))
            strides.append(step)
            keep.append(True)
        elif isinstance(i, int) and not isinstance(i, bool):
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for dim {dim} of size {size}")
            i %= size
            begin.append(i)
            end.append(i + 1)
            strides.append(1)
            keep.append(False)
        else:
            raise TypeError(f"unsupported index {i!r}; use ints and slices")
    out = StridedSlice()(x, begin, end, strides)
    if not all(keep):
        shape = tuple(d for d, k in zip(out.shape, keep) if k)
        out = Reshape()(out, shape)
    return out


# -- functional forms (MindSpore's lower-case ops) ---------------------------------------------


def __getattr__(name: str) -> Any:
    """`ops.matmul`, `ops.relu`, ...: the functional forms live in `compiler.functional`
    (which imports the primitives above), loaded on first use."""
    from pcompile.compiler.frontend import functional

    if name in functional.__all__:
        return getattr(functional, name)
    if name.startswith("__"):  # Python's own probes (__path__, __wrapped__, ...)
        raise AttributeError(f"module 'pcompile.ops' has no attribute {name!r}")
    import difflib

    known = sorted(set(globals()) | set(functional.__all__))
    known = [k for k in known if not k.startswith("_")]
    lower: dict[str, list[str]] = {}
    for k in known:
        lower.setdefault(k.lower(), []).append(k)
    close = [k for key in difflib.get_close_matches(name.lower(), list(lower), n=3,
                                                    cutoff=0.6) for k in lower[key]][:4]
    near = f" (did you mean {', '.join(f'ops.{c}' for c in close)}?)" if close else ""
    raise AttributeError(
        f"pcompile.ops has no {'primitive' if name[:1].isupper() else 'function'} "
        f"{name!r}{near}: the primitives and functional ops pcompile has, with their sharding "
        "rules, are listed in docs/ops.md; a missing one can be added as "
        "docs/CONTRIBUTING-ops.md describes")


def __dir__() -> list[str]:
    from pcompile.compiler.frontend import functional

    return sorted(set(globals()) | set(functional.__all__))


# -- training steps (compiler/frontend/train_step.py) ----------------------------------------------

from pcompile.compiler.frontend.grad import GradOperation  # noqa: E402,F401  (MindSpore's name)


class Assign(_Simple):
    """`ops.Assign()(variable, value)`: the Parameter's new value. In the network's forward
    computation later reads see it and the step returns it (stored, checkpointed); in a
    training step cell after the gradients it is the step's own state
    (compiler/frontend/assign.py)."""

    op = "Assign"

    def __call__(self, variable: Any, value: Any) -> Any:
        from pcompile.compiler.frontend.assign import assign_parameter

        return assign_parameter(self, variable, value)


class AssignAdd(Assign):
    """`ops.AssignAdd()(variable, value)`: the Parameter's new value is variable + value."""

    op = "AssignAdd"


class AssignSub(Assign):
    """`ops.AssignSub()(variable, value)`: the Parameter's new value is variable - value."""

    op = "AssignSub"


# -- random ------------------------------------------------------------------------------------


def _seed_arg(name: str, value: Any, op: str = "Dropout") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"For '{op}', the '{name}' must be int, but got "
                        f"{type(value).__name__} {value!r}")
    return int(value)


class Dropout(Primitive):
    """`ops.Dropout(keep_prob=0.5, Seed0=0, Seed1=0)(x)` -> (output, mask): x / keep_prob
    where an element is kept (probability keep_prob), else 0, and the mask (1 kept, 0 dropped;
    x's dtype). New bits every step; any plan keeps the single-device program's elements
    (compiler/frontend/dropout.py). Its strategy is one tuple for x, as MindSpore's."""

    op = "Dropout"

    def __init__(self, keep_prob: float = 0.5, Seed0: int = 0, Seed1: int = 0) -> None:  # noqa: N803
        if isinstance(keep_prob, bool) or not isinstance(keep_prob, (float, np.floating)):
            raise TypeError(f"For 'Dropout', the 'keep_prob' must be float, but got "
                            f"{type(keep_prob).__name__} {keep_prob!r}")
        if not 0.0 < float(keep_prob) <= 1.0:
            raise ValueError(f"For 'Dropout', the 'keep_prob' must be in range (0, 1], but got "
                             f"{keep_prob!r}")
        super().__init__(keep_prob=float(keep_prob), seed0=_seed_arg("Seed0", Seed0),
                         seed1=_seed_arg("Seed1", Seed1))

    @property
    def keep_prob(self) -> float:
        return float(self.attrs["keep_prob"])

    def __call__(self, x: Any) -> tuple[Any, Any]:
        from pcompile.compiler.frontend.dropout import dropout

        return dropout(self, x)


class DropoutGenMask(Primitive):
    """`P.DropoutGenMask(Seed0=0, Seed1=0)(shape, keep_prob)`: MindSpore's packed UInt8 mask
    of a tensor of `shape` (length ceil(prod(shape) / 128) * 16), drawn as ops.Dropout draws
    its bits (compiler/frontend/dropout.py, ir/ops/random.py)."""

    op = "DropoutGenMask"

    def __init__(self, Seed0: int = 0, Seed1: int = 0) -> None:  # noqa: N803
        super().__init__(seed0=_seed_arg("Seed0", Seed0, "DropoutGenMask"),
                         seed1=_seed_arg("Seed1", Seed1, "DropoutGenMask"))

    def __call__(self, shape: Any, keep_prob: Any) -> Any:
        from pcompile.compiler.frontend.dropout import gen_mask

        return gen_mask(self, shape, keep_prob)


class DropoutDoMask(Primitive):
    """`P.DropoutDoMask()(x, mask, keep_prob)`: x / keep_prob where DropoutGenMask's mask
    keeps the element, else 0. Its strategy is one tuple for x, as MindSpore's."""

    op = "DropoutDoMask"

    def __init__(self) -> None:
        super().__init__()

    def __call__(self, x: Any, mask: Any, keep_prob: Any) -> Any:
        from pcompile.compiler.frontend.dropout import do_mask

        return do_mask(self, x, mask, keep_prob)


class DType(_Simple):
    """`P.DType()(x)`: the dtype of x (a compile-time value, as MindSpore folds it)."""

    op = "DType"

    def __call__(self, x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            raise TypeError(f"DType expects a tensor, got {type(x).__name__} {x!r}")
        return IRDType.from_any(dtype)


# mindformers' MoEV3: a region of user code on each rank's slices (self_define_shard) and the
# all-to-all with run-time counts, composed of the ops above
from pcompile.compiler.frontend.morph import Morph  # noqa: E402, F401
from pcompile.compiler.frontend.ragged import AlltoAllV  # noqa: E402, F401
