"""Element-wise primitives (numpy broadcasting) and the small ops their vjps need.

Binary: Add, Sub, Mul, RealDiv, Maximum, Minimum, Pow. Unary: ReLU, Neg, Abs, Exp, Log, Sqrt,
Rsqrt, Square, Tanh, Sigmoid, GeLU, Erf, SiLU. Others: BiasAdd, Cast, Select. Comparisons
(Equal, NotEqual, Greater, GreaterEqual, Less, LessEqual), logical ops (LogicalAnd, LogicalOr,
LogicalNot) and gradient helpers (ReluGrad, SqrtGrad, RsqrtGrad, TanhGrad, SigmoidGrad,
GeLUGrad, SiLUGrad) stop gradients (`differentiable=False`).

Gradient-helper operand order follows MindSpore: `SqrtGrad(y, dy)`, `RsqrtGrad(y, dy)`,
`TanhGrad(y, dy)`, `SigmoidGrad(y, dy)` take the forward output first; `ReluGrad(dy, y)`,
`GeLUGrad(dy, x)` and `SiLUGrad(dy, x)` take the incoming gradient first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Node, Value
from pcompile.ir.dims import DimRule, In, Out, Same, broadcast
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define, elementwise, grad_helper
from pcompile.ir.ops._jax import deferred, jax, jnp, lax
from pcompile.ir.ops._util import (
    broadcast_shapes,
    infer_binary,
    infer_compare,
    infer_unary,
    infer_unary_float,
    same_dtype,
    tensor,
    unbroadcast,
)
from pcompile.ir.registry import ALL, BOOL, FLOATS, NUMERIC, Trait
from pcompile.ir.sharding import ALPHA, LabelRule, Labels, OpContext
from pcompile.ir.types import DType, TensorType, ValueType

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_COEF = 0.044715

# -- shared helpers ---------------------------------------------------------------------------


def _infer_binary_numeric(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(infer_binary(types, attrs))
    if out.dtype is DType.bool_:
        raise ShapeError("needs numeric operands, got Bool")
    return out


def _infer_binary_float(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(infer_binary(types, attrs))
    if not out.dtype.is_float:
        raise ShapeError(f"needs floating-point operands, got {out.dtype.value}")
    return out


def _infer_unary_numeric(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    t = tensor(types[0])
    if t.dtype is DType.bool_:
        raise ShapeError("needs a numeric input, got Bool")
    return t


def _scalar(value: float, dtype: DType) -> Constant:
    """A scalar constant of `dtype` (needed where the first operand is a bool condition, so
    the builder would otherwise make a bool constant)."""
    return Constant(np.asarray(value), dtype)


def _binary_cotangents(
    b: Builder, node: Node, dx: Value | None, dy: Value | None
) -> list[Value | None]:
    """Sum full-shape cotangents back down to each operand's shape."""
    x, y = node.operands
    return [
        None if dx is None else unbroadcast(b, dx, x.shape),
        None if dy is None else unbroadcast(b, dy, y.shape),
    ]


def _np_in_f32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a numpy float formula in float32 for 16-bit inputs, so intermediate steps are not
    rounded to 16 bits (XLA also computes these in float32)."""

    def impl(*arrays: Any) -> Any:
        dtype = arrays[0].dtype
        if dtype.itemsize < 4:
            arrays = tuple(np.asarray(a, np.float32) for a in arrays)
        return np.asarray(fn(*arrays)).astype(dtype, copy=False)

    impl.__doc__ = fn.__doc__
    return impl


# -- Add ------------------------------------------------------------------------------------


def _add_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    return [unbroadcast(b, cot, x.shape), unbroadcast(b, cot, y.shape)]


elementwise("Add", infer_binary, lambda x, y: np.add(x, y), lambda x, y: jnp.add(x, y),
            vjp=_add_vjp, num_inputs=2, doc="x + y with broadcasting.", operands="x, y (broadcast)",
            dtypes=ALL,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

# -- Sub ------------------------------------------------------------------------------------


def _sub_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return _binary_cotangents(b, node, cot, b("Neg", cot))


elementwise("Sub", _infer_binary_numeric, lambda x, y: np.subtract(x, y),
            lambda x, y: jnp.subtract(x, y), vjp=_sub_vjp, num_inputs=2,
            doc="x - y with broadcasting.", operands="x, y (broadcast)", dtypes=NUMERIC,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

# -- Mul ------------------------------------------------------------------------------------


def _mul_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    return [unbroadcast(b, b("Mul", cot, y), x.shape), unbroadcast(b, b("Mul", cot, x), y.shape)]


elementwise("Mul", infer_binary, lambda x, y: np.multiply(x, y), lambda x, y: jnp.multiply(x, y),
            vjp=_mul_vjp, num_inputs=2, doc="x * y with broadcasting.", operands="x, y (broadcast)",
            dtypes=ALL,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

# -- RealDiv --------------------------------------------------------------------------------


def _real_div_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    _, y = node.operands
    dx = b("RealDiv", cot, y)
    # d(x/y)/dy = -(x/y)/y; reusing dx and the output avoids squaring a small y.
    dy = b("Neg", b("Mul", dx, node.result))
    return _binary_cotangents(b, node, dx, dy)


elementwise("RealDiv", _infer_binary_float, lambda x, y: np.true_divide(x, y),
            lambda x, y: jnp.true_divide(x, y), vjp=_real_div_vjp, num_inputs=2,
            doc="x / y with broadcasting (floating-point operands).", operands="x, y (broadcast)",
            dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

# -- Maximum / Minimum ------------------------------------------------------------------------


def _chooser_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    """Cotangent goes to the operand equal to the result; on ties each gets half (as lax.max
    and lax.min differentiate in JAX)."""
    x, y = node.operands
    out = node.result
    dtype = cot.dtype
    zero, half, one = _scalar(0.0, dtype), _scalar(0.5, dtype), _scalar(1.0, dtype)
    x_wins = b("Equal", x, out)
    y_wins = b("Equal", y, out)
    dx = b("Select", x_wins, b("Mul", cot, b("Select", y_wins, half, one)), zero)
    dy = b("Select", y_wins, b("Mul", cot, b("Select", x_wins, half, one)), zero)
    return _binary_cotangents(b, node, dx, dy)


elementwise("Maximum", infer_binary, lambda x, y: np.maximum(x, y), lambda x, y: jnp.maximum(x, y),
            vjp=_chooser_vjp, num_inputs=2, doc="Element-wise max(x, y) with broadcasting.",
            operands="x, y (broadcast)", dtypes=ALL,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_ops_elementwise.py::test_max_min_ties_split_gradient",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

elementwise("Minimum", infer_binary, lambda x, y: np.minimum(x, y), lambda x, y: jnp.minimum(x, y),
            vjp=_chooser_vjp, num_inputs=2, doc="Element-wise min(x, y) with broadcasting.",
            operands="x, y (broadcast)", dtypes=ALL,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_ops_elementwise.py::test_max_min_ties_split_gradient"))

# -- Pow ------------------------------------------------------------------------------------


def _pow_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    dx = b("Mul", cot, b("Mul", y, b("Pow", x, b("Sub", y, 1.0))))
    # As in JAX, the y-gradient uses log(1) = 0 where x == 0 instead of -inf.
    safe_x = b("Select", b("Equal", x, 0.0), _scalar(1.0, cot.dtype), x)
    dy = b("Mul", cot, b("Mul", b("Log", safe_x), node.result))
    return _binary_cotangents(b, node, dx, dy)


elementwise("Pow", _infer_binary_numeric, lambda x, y: np.power(x, y), lambda x, y: jnp.power(x, y),
            vjp=_pow_vjp, num_inputs=2,
            doc="x ** y with broadcasting; the y-gradient uses log(x), so needs x > 0.",
            operands="x, y (broadcast)", dtypes=NUMERIC,
            tests=("test_ops_elementwise.py::test_binary",
                   "test_ops_elementwise.py::test_pow_integer_exponents_and_zero_base"))

# -- ReLU -----------------------------------------------------------------------------------


def _relu_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("ReluGrad", cot, node.result)]


elementwise("ReLU", infer_unary, lambda x: np.maximum(x, np.zeros((), x.dtype)),
            lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)), vjp=_relu_vjp, doc="max(x, 0).",
            dtypes=ALL,
            tests=("test_ops_elementwise.py::test_unary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))


def _relu_grad_np(dy: Any, y: Any) -> Any:
    return np.where(y > 0, dy, np.zeros((), dy.dtype))


def _relu_grad_jax(dy: Any, y: Any) -> Any:
    return jnp.where(y > 0, dy, jnp.zeros((), dy.dtype))


elementwise("ReluGrad", infer_binary, _relu_grad_np, _relu_grad_jax, num_inputs=2,
            differentiable=False, doc="dy where y > 0 else 0 (y is ReLU's output).",
            operands="dy, y", dtypes=ALL, grad_of="ReLU",
            tests=("test_ops_elementwise.py::test_relu_grad",))

# -- Neg, Square ------------------------------------------------------------------------------

elementwise("Neg", _infer_unary_numeric, lambda x: np.negative(x), lambda x: jnp.negative(x),
            vjp=lambda b, node, cot: [b("Neg", cot)], doc="-x.", dtypes=NUMERIC,
            tests=("test_ops_elementwise.py::test_unary",))

elementwise("Square", _infer_unary_numeric, lambda x: np.square(x), lambda x: jnp.square(x),
            vjp=lambda b, node, cot: [b("Mul", cot, b("Mul", node.operands[0], 2.0))], doc="x * x.",
            dtypes=NUMERIC, tests=("test_ops_elementwise.py::test_unary",))

# -- Abs ------------------------------------------------------------------------------------


def sign_of(b: Builder, x: Value, dtype: DType) -> Value:
    """sign(x) as a `dtype` tensor (1, -1, or 0 at 0), built with Select: the derivative of
    |x| as MindSpore's AbsGrad takes it (0 at 0; JAX takes 1 there)."""
    one, zero = _scalar(1.0, dtype), _scalar(0.0, dtype)
    negative = b("Select", b("Less", x, _scalar(0.0, x.dtype)), _scalar(-1.0, dtype), zero)
    return b("Select", b("Greater", x, _scalar(0.0, x.dtype)), one, negative)


elementwise("Abs", _infer_unary_numeric, lambda x: np.abs(x), lambda x: jnp.abs(x),
            vjp=lambda b, node, cot: [b("Mul", cot, sign_of(b, node.operands[0], cot.dtype))],
            doc="|x| (MindSpore `ops.Abs`); the gradient is sign(x), 0 at 0.", dtypes=NUMERIC,
            tests=("test_ops_lp_norm.py::test_abs",
                   "test_ops_lp_norm.py::test_abs_gradient_is_sign",
                   "test_parallel_ops.py::test_rule_matches_the_oracle"))

# -- Exp, Log -------------------------------------------------------------------------------

elementwise("Exp", infer_unary_float, _np_in_f32(np.exp), lambda x: jnp.exp(x),
            vjp=lambda b, node, cot: [b("Mul", cot, node.result)], doc="e ** x.", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_unary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

elementwise("Log", infer_unary_float, _np_in_f32(np.log), lambda x: jnp.log(x),
            vjp=lambda b, node, cot: [b("RealDiv", cot, node.operands[0])],
            doc="Natural logarithm.", dtypes=FLOATS, tests=("test_ops_elementwise.py::test_unary",))

# -- Sqrt, Rsqrt ------------------------------------------------------------------------------

elementwise("Sqrt", infer_unary_float, _np_in_f32(np.sqrt), lambda x: jnp.sqrt(x),
            vjp=lambda b, node, cot: [b("SqrtGrad", node.result, cot)], doc="Square root.",
            dtypes=FLOATS, tests=("test_ops_elementwise.py::test_unary",))


@_np_in_f32
def _sqrt_grad_np(y: Any, dy: Any) -> Any:
    return dy * (0.5 / y)


grad_helper("SqrtGrad", _infer_binary_float, _sqrt_grad_np, lambda y, dy: dy * (0.5 / y),
            doc="dy * 0.5 / y, y = sqrt(x) (MindSpore operand order: y, dy).", grad_of="Sqrt",
            operands="y, dy", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_output_based_grad_helpers",),
            dims=DimRule(broadcast))

elementwise("Rsqrt", infer_unary_float, _np_in_f32(lambda x: 1.0 / np.sqrt(x)),
            lambda x: lax.rsqrt(x), vjp=lambda b, node, cot: [b("RsqrtGrad", node.result, cot)],
            doc="1 / sqrt(x).", dtypes=FLOATS, tests=("test_ops_elementwise.py::test_unary",))


@_np_in_f32
def _rsqrt_grad_np(y: Any, dy: Any) -> Any:
    return dy * (-0.5 * y * y * y)


grad_helper("RsqrtGrad", _infer_binary_float, _rsqrt_grad_np, lambda y, dy: dy * (-0.5 * y * y * y),
            doc="-0.5 * dy * y**3, y = rsqrt(x) (MindSpore operand order: y, dy).", grad_of="Rsqrt",
            operands="y, dy", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_output_based_grad_helpers",),
            dims=DimRule(broadcast))

# -- Tanh, Sigmoid ----------------------------------------------------------------------------

elementwise("Tanh", infer_unary_float, _np_in_f32(np.tanh), lambda x: jnp.tanh(x),
            vjp=lambda b, node, cot: [b("TanhGrad", node.result, cot)], doc="Hyperbolic tangent.",
            dtypes=FLOATS, tests=("test_ops_elementwise.py::test_unary",))


@_np_in_f32
def _tanh_grad_np(y: Any, dy: Any) -> Any:
    # (1 + y)(1 - y) rather than 1 - y*y: no cancellation when |y| is close to 1.
    return dy * (1.0 + y) * (1.0 - y)


grad_helper("TanhGrad", _infer_binary_float, _tanh_grad_np,
            lambda y, dy: dy * (1.0 + y) * (1.0 - y),
            doc="dy * (1 - y**2), y = tanh(x) (MindSpore operand order: y, dy).", grad_of="Tanh",
            operands="y, dy", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_output_based_grad_helpers",),
            dims=DimRule(broadcast))


@_np_in_f32
def _sigmoid_np(x: Any) -> Any:
    # Split by sign so exp never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


elementwise("Sigmoid", infer_unary_float, _sigmoid_np, lambda x: jax.nn.sigmoid(x),
            vjp=lambda b, node, cot: [b("SigmoidGrad", node.result, cot)], doc="1 / (1 + exp(-x)).",
            dtypes=FLOATS, tests=("test_ops_elementwise.py::test_unary",))


@_np_in_f32
def _sigmoid_grad_np(y: Any, dy: Any) -> Any:
    return dy * (y * (1.0 - y))


grad_helper("SigmoidGrad", _infer_binary_float, _sigmoid_grad_np,
            lambda y, dy: dy * (y * (1.0 - y)),
            doc="dy * y * (1 - y), y = sigmoid(x) (MindSpore operand order: y, dy).",
            grad_of="Sigmoid", operands="y, dy", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_output_based_grad_helpers",),
            dims=DimRule(broadcast))

# -- GeLU -----------------------------------------------------------------------------------


@_np_in_f32
def _gelu_np(x: Any) -> Any:
    inner = _SQRT_2_OVER_PI * (x + _GELU_COEF * (x * x * x))
    return x * (0.5 * (1.0 + np.tanh(inner)))


def _gelu_grad_formula(dy: Any, x: Any, tanh: Callable[[Any], Any]) -> Any:
    """d/dx of x * cdf(x), cdf = 0.5 * (1 + tanh(c * (x + a x^3)))."""
    t = tanh(_SQRT_2_OVER_PI * (x + _GELU_COEF * (x * x * x)))
    cdf = 0.5 * (1.0 + t)
    dinner = _SQRT_2_OVER_PI * (1.0 + (3.0 * _GELU_COEF) * (x * x))
    return dy * (cdf + x * (0.5 * (1.0 + t) * (1.0 - t)) * dinner)


elementwise("GeLU", infer_unary_float, _gelu_np, lambda x: jax.nn.gelu(x, approximate=True),
            vjp=lambda b, node, cot: [b("GeLUGrad", cot, node.operands[0])],
            doc="GeLU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).",
            operands="x (tanh form)", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_unary",
                   "test_parallel.py::test_every_rule_matches_the_oracle"))

grad_helper("GeLUGrad", _infer_binary_float,
            _np_in_f32(lambda dy, x: _gelu_grad_formula(dy, x, np.tanh)),
            lambda dy, x: _gelu_grad_formula(dy, x, jnp.tanh),
            doc="dy * d GeLU(x) / dx (tanh approximation); operands (dy, x).", grad_of="GeLU",
            operands="dy, x", dtypes=FLOATS, tests=("test_ops_elementwise.py::test_gelu_grad",),
            dims=DimRule(broadcast))

# -- Erf ------------------------------------------------------------------------------------


@_np_in_f32
def _erf_np(x: Any) -> Any:
    from scipy.special import erf  # scipy comes with JAX; imported on first use

    return erf(x)


# d erf(x) / dx = 2 / sqrt(pi) * exp(-x**2)
elementwise("Erf", infer_unary_float, _erf_np, lambda x: lax.erf(x),
            vjp=lambda b, node, cot: [b("Mul", cot, b("Mul", b("Exp", b("Neg", b(
                "Square", node.operands[0]))), 2.0 / math.sqrt(math.pi)))],
            doc="The Gauss error function (MindSpore `ops.Erf`); exact GeLU is "
                "0.5 x (1 + erf(x / sqrt(2))).",
            dtypes=FLOATS, tests=("test_ops_lp_norm.py::test_erf",
                                  "test_parallel_ops.py::test_rule_matches_the_oracle"))

# -- SiLU -----------------------------------------------------------------------------------


def _silu_np(x: Any) -> Any:
    return x * _sigmoid_np(x)


def _silu_grad_formula(dy: Any, x: Any, sigmoid: Callable[[Any], Any]) -> Any:
    """d/dx of x * s(x) = s + x s (1 - s), s = sigmoid(x)."""
    sig = sigmoid(x)
    return dy * (sig * (1.0 + x * (1.0 - sig)))


elementwise("SiLU", infer_unary_float, _np_in_f32(_silu_np), lambda x: jax.nn.silu(x),
            vjp=lambda b, node, cot: [b("SiLUGrad", cot, node.operands[0])],
            doc="x * sigmoid(x) (also called swish).", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_unary",
                   "test_parallel_ops.py::test_rule_matches_the_oracle"))

grad_helper("SiLUGrad", _infer_binary_float,
            _np_in_f32(lambda dy, x: _silu_grad_formula(dy, x, _sigmoid_np)),
            lambda dy, x: _silu_grad_formula(dy, x, jax.nn.sigmoid),
            doc="dy * d SiLU(x) / dx = dy * s (1 + x (1 - s)), s = sigmoid(x); operands (dy, x).",
            grad_of="SiLU", operands="dy, x", dtypes=FLOATS,
            tests=("test_ops_elementwise.py::test_silu_grad",), dims=DimRule(broadcast))

# -- BiasAdd --------------------------------------------------------------------------------

_CHANNEL_AXIS = {"NCHW": 1, "NCDHW": 1, "NHWC": -1}


def _bias_axis(data_format: Any, rank: int) -> int:
    """The channel axis of an input of `rank`; ShapeError for a bad format or rank."""
    if data_format not in _CHANNEL_AXIS:
        raise ShapeError(
            f"data_format must be one of {', '.join(_CHANNEL_AXIS)}, got {data_format!r}"
        )
    if rank < 2:
        raise ShapeError(f"x must have rank >= 2 (batch and channel axes), got rank {rank}")
    if data_format == "NCDHW" and rank != 5:
        raise ShapeError(f"data_format NCDHW needs a rank-5 x, got rank {rank}")
    return _CHANNEL_AXIS[data_format] % rank


def _bias_add_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x, bias = tensor(types[0], "x"), tensor(types[1], "bias")
    same_dtype([x, bias])
    if x.dtype is DType.bool_:
        raise ShapeError("needs numeric operands, got Bool")
    axis = _bias_axis(attrs["data_format"], x.rank)
    if bias.shape != (x.shape[axis],):
        raise ShapeError(
            f"bias must have shape ({x.shape[axis]},) to match channel axis {axis} of x "
            f"({attrs['data_format']}), got {bias.shape}"
        )
    return x


def _bias_shape(x: Any, bias: Any, data_format: str) -> tuple[int, ...]:
    """Shape that lines `bias` up with the channel axis of `x`."""
    axis = _bias_axis(data_format, x.ndim)
    return tuple(bias.shape[0] if i == axis else 1 for i in range(x.ndim))


def _bias_add_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, _ = node.operands
    axis = _bias_axis(node.attrs["data_format"], x.tensor_type.rank)
    others = tuple(i for i in range(len(x.shape)) if i != axis)
    return [cot, b("ReduceSum", cot, axis=others, keep_dims=False)]


def bias_add_labels(ctx: OpContext) -> Labels:
    x = ctx.in_types[0]
    lab = ALPHA[: x.rank]
    return Labels([lab, lab[1]], [lab])


define("BiasAdd", _bias_add_infer,
       lambda x, bias, data_format: x + bias.reshape(_bias_shape(x, bias, data_format)),
       lambda x, bias, data_format: x + bias.reshape(_bias_shape(x, bias, data_format)),
       vjp=_bias_add_vjp, attrs={"data_format": "NCHW"}, num_inputs=2,
       sharding=LabelRule(bias_add_labels),
       doc="x + bias along the channel axis (1 for NCHW/NCDHW, last for NHWC).",
       section="elementwise", operands="x, bias on the channel axis (`data_format`)",
       dtypes=NUMERIC, rule="bias follows the channel dim",
       tests=("test_ops_elementwise.py::test_bias_add",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       dims=DimRule(lambda ins, outs, attrs: [
           *broadcast(ins[:1], outs, attrs),
           Same(In(1, 0), Out(_bias_axis(attrs["data_format"], len(outs[0]))))]))

# -- Cast -----------------------------------------------------------------------------------


def _cast_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    dst = attrs["dst_type"]
    if not isinstance(dst, DType):
        raise ShapeError(
            f"dst_type must be an ir.types.DType ({', '.join(d.name for d in DType)}), "
            f"got {dst!r}; DType.from_any converts names and numpy dtypes"
        )
    return x.with_dtype(dst)


def _cast_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    src = node.operands[0].dtype
    if not src.is_float:
        return [None]
    return [b("Cast", cot, dst_type=src)]


def _cast_np(x: Any, dst_type: DType) -> Any:
    x = np.asarray(x)
    dst = dst_type.np
    if x.dtype.kind == "f" or x.dtype == DType.bfloat16.np:
        if dst.kind in "iu":
            # XLA's float -> int conversion: truncate toward zero, saturate at the integer
            # range, NaN -> 0 (numpy's cast of an out-of-range float is undefined).
            info = np.iinfo(dst)
            wide = np.nan_to_num(x.astype(np.float64), nan=0.0)
            return np.trunc(np.clip(wide, info.min, info.max)).astype(dst)
    return x.astype(dst)


_CAST_NOTE = """\
`Cast` from a float to an integer type truncates toward zero and saturates at the
integer range (NaN gives 0), as XLA does; integer to integer wraps."""

elementwise("Cast", _cast_infer, _cast_np,
            lambda x, dst_type: lax.convert_element_type(x, dst_type.np), vjp=_cast_vjp,
            attrs={"dst_type": DType.float32},
            traits=frozenset({Trait.VALUE_COPY, Trait.TRANSPARENT}),
            doc="Convert to dst_type (float->int truncates toward zero and saturates at the "
                "integer range, NaN -> 0; int->int wraps; to Bool is x != 0).",
            operands="x; `dst_type`", dtypes=ALL,
            tests=("test_ops_elementwise.py::test_cast",
                   "test_parallel.py::test_every_rule_matches_the_oracle"), note=_CAST_NOTE,
            dims=DimRule(broadcast, preserves_values=True))

# -- Select ---------------------------------------------------------------------------------


def _select_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    cond, x, y = tensor(types[0], "cond"), tensor(types[1], "x"), tensor(types[2], "y")
    if cond.dtype is not DType.bool_:
        raise ShapeError(f"cond must be Bool (use a comparison), got {cond.dtype.value}")
    dtype = same_dtype([x, y])
    return TensorType(dtype, broadcast_shapes(cond.shape, broadcast_shapes(x.shape, y.shape)))


def _select_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    cond, x, y = node.operands
    zero = _scalar(0.0, cot.dtype)
    return [
        None,
        unbroadcast(b, b("Select", cond, cot, zero), x.shape),
        unbroadcast(b, b("Select", cond, zero, cot), y.shape),
    ]


elementwise("Select", _select_infer, lambda cond, x, y: np.where(cond, x, y),
            lambda cond, x, y: jnp.where(cond, x, y), vjp=_select_vjp, num_inputs=3,
            doc="x where cond else y, all three broadcast together.",
            operands="Bool cond, x, y (all broadcast)", dtypes=ALL,
            tests=("test_ops_elementwise.py::test_select",
                   "test_ops_elementwise.py::test_select_other_dtypes",
                   "test_parallel_ops.py::test_rule_matches_the_oracle"))

# -- comparisons ----------------------------------------------------------------------------

_COMPARISONS: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "Equal": (np.equal, deferred(jnp, "equal"), "x == y"),
    "NotEqual": (np.not_equal, deferred(jnp, "not_equal"), "x != y"),
    "Greater": (np.greater, deferred(jnp, "greater"), "x > y"),
    "GreaterEqual": (np.greater_equal, deferred(jnp, "greater_equal"), "x >= y"),
    "Less": (np.less, deferred(jnp, "less"), "x < y"),
    "LessEqual": (np.less_equal, deferred(jnp, "less_equal"), "x <= y"),
}

# Sharding rules checked against the unsharded op (the others share their rule).
_COMPARISON_TESTS = {
    "Equal": ("test_parallel_ops.py::test_rule_matches_the_oracle",),
    "NotEqual": (
        "test_parallel_ops.py::test_rule_matches_the_oracle",
        "test_mindformers_ops.py::test_not_equal_with_a_scalar_and_its_empty_strategy",
    ),
    "LessEqual": ("test_parallel_ops.py::test_rule_matches_the_oracle",),
    "GreaterEqual": ("test_parallel_ops.py::test_rule_matches_the_oracle",),
}

for _name, (_np_fn, _jax_fn, _text) in _COMPARISONS.items():
    elementwise(_name, infer_compare, _np_fn, _jax_fn, num_inputs=2, differentiable=False,
                doc=f"{_text} with broadcasting; Bool result.",
                operands="x, y (broadcast) -> Bool", dtypes=ALL,
                rule="element-wise; stops gradients",
                tests=("test_ops_elementwise.py::test_comparison",
                       "test_ops_elementwise.py::test_comparison_stops_gradient",
                       *_COMPARISON_TESTS.get(_name, ())))


def _logical_not_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if x.dtype is not DType.bool_:
        raise ShapeError(f"needs a Bool input, got {x.dtype.value}")
    return x


def _logical_binary_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x, y = tensor(types[0], "x"), tensor(types[1], "y")
    for name, t in (("x", x), ("y", y)):
        if t.dtype is not DType.bool_:
            raise ShapeError(f"{name} must be Bool, got {t.dtype.value} (use a comparison)")
    return TensorType(DType.bool_, broadcast_shapes(x.shape, y.shape))


_LOGICAL: dict[str, tuple[Callable[..., Any], Callable[..., Any], str]] = {
    "LogicalAnd": (np.logical_and, deferred(jnp, "logical_and"), "x and y"),
    "LogicalOr": (np.logical_or, deferred(jnp, "logical_or"), "x or y"),
}

for _name, (_np_fn, _jax_fn, _text) in _LOGICAL.items():
    elementwise(_name, _logical_binary_infer, _np_fn, _jax_fn, num_inputs=2,
                differentiable=False,
                doc=f"Element-wise {_text} of Bool tensors, with broadcasting.",
                operands="Bool x, y (broadcast) -> Bool", dtypes=BOOL,
                rule="element-wise; stops gradients",
                tests=("test_ops_elementwise.py::test_logical_binary",
                       "test_parallel_ops.py::test_rule_matches_the_oracle",
                       "test_mindformers_ops.py::test_logical_ops_need_bool_operands"))

elementwise("LogicalNot", _logical_not_infer, lambda x: np.logical_not(x),
            lambda x: jnp.logical_not(x), differentiable=False, doc="Boolean not.",
            operands="Bool x -> Bool", dtypes=BOOL, rule="element-wise; stops gradients",
            tests=("test_ops_elementwise.py::test_logical_not",
                   "test_parallel_ops.py::test_rule_matches_the_oracle"))


# -- Identity ---------------------------------------------------------------------------------


def _identity_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [cot]


elementwise("Identity", infer_unary, lambda x: np.array(x, copy=True), lambda x: x,
            vjp=_identity_vjp, traits=frozenset({Trait.VALUE_COPY}),
            doc="x unchanged; carries a layout constraint (functional shard's in/out strategies).",
            dtypes=ALL, rule="element-wise (carries functional shard's layouts)",
            tests=("test_functional_shard.py::test_net2_compiles_with_sharding_propagation_and_matc"
                   "hes_single_device",),
            dims=DimRule(broadcast, preserves_values=True))
