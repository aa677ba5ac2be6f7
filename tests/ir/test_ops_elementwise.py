"""Element-wise primitives against JAX written directly: forward values and gradients over
random (broadcasting, rank-0) shapes, plus the errors bad operands raise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Value
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5)
PAIRS = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4)
TRIPLES = hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3, max_side=4)
# Each check_op compiles two JAX programs (~0.15 s), so example counts stay small; the
# parametrized tests get their budget per op.
FEW = settings(max_examples=5, deadline=None)
SOME = settings(max_examples=10, deadline=None)

Maker = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (2.0 * rng.standard_normal(shape)).astype(np.float32)


def positive(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.uniform(0.3, 3.0, shape).astype(np.float32)


def away_from_zero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * rng.uniform(0.5, 2.0, shape)).astype(np.float32)


def moderate(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """|x| <= 2: tanh/sigmoid outputs stay away from 1, where 1 - y amplifies the last-bit
    differences between numpy's and XLA's tanh beyond 1e-5."""
    return rng.uniform(-2.0, 2.0, shape).astype(np.float32)


def small_ints(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Integer-valued floats: equal elements (ties) are common."""
    return rng.integers(-2, 3, shape).astype(np.float32)


def maybe_ties(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Half the time integer-valued, so Maximum/Minimum see ties (gradient split in half)."""
    return small_ints(rng, shape) if rng.random() < 0.5 else normal(rng, shape)


# -- binary ---------------------------------------------------------------------------------

BINARY: dict[str, tuple[Callable[..., Any], Maker, Maker]] = {
    "Add": (jnp.add, normal, normal),
    "Sub": (jnp.subtract, normal, normal),
    "Mul": (jnp.multiply, normal, normal),
    "RealDiv": (jnp.divide, normal, away_from_zero),
    "Maximum": (jnp.maximum, maybe_ties, maybe_ties),
    "Minimum": (jnp.minimum, maybe_ties, maybe_ties),
    "Pow": (jnp.power, positive, normal),
}


@pytest.mark.parametrize("op", sorted(BINARY))
@FEW
@given(PAIRS, SEEDS)
def test_binary(op: str, shapes: Any, seed: int) -> None:
    reference, make_x, make_y = BINARY[op]
    rng = np.random.default_rng(seed)
    sx, sy = shapes.input_shapes
    check_op(op, [make_x(rng, sx), make_y(rng, sy)], {}, reference, seed=seed)


@pytest.mark.parametrize("op", ["Maximum", "Minimum"])
def test_max_min_ties_split_gradient(op: str) -> None:
    x = np.array([[1.0, 2.0, 3.0], [0.0, 2.0, 5.0]], np.float32)
    y = np.array([2.0, 2.0, 2.0], np.float32)
    check_op(op, [x, y], {}, BINARY[op][0])


@FEW
@given(PAIRS, SEEDS)
def test_pow_integer_exponents_and_zero_base(shapes: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sx, sy = shapes.input_shapes
    x = rng.integers(0, 3, sx).astype(np.float32)
    y = rng.integers(0, 3, sy).astype(np.float32)
    check_op("Pow", [x, y], {}, jnp.power, seed=seed)


@SOME
@given(
    st.sampled_from(["Add", "Sub", "Mul", "RealDiv", "Maximum", "Pow"]),
    st.sampled_from([np.float16, ml_dtypes.bfloat16]),
    PAIRS,
    SEEDS,
)
def test_binary_low_precision(op: str, dtype: Any, shapes: Any, seed: int) -> None:
    reference, make_x, make_y = BINARY[op]
    rng = np.random.default_rng(seed)
    sx, sy = shapes.input_shapes
    x, y = make_x(rng, sx).astype(dtype), make_y(rng, sy).astype(dtype)
    check_op(op, [x, y], {}, reference, seed=seed)


@SOME
@given(st.sampled_from(["Add", "Sub", "Mul", "Maximum", "Minimum"]), PAIRS, SEEDS)
def test_int_binary_forward(op: str, shapes: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sx, sy = shapes.input_shapes
    x = rng.integers(-5, 6, sx).astype(np.int32)
    y = rng.integers(-5, 6, sy).astype(np.int32)
    check_op(op, [x, y], {}, BINARY[op][0])


# -- unary ----------------------------------------------------------------------------------

UNARY: dict[str, tuple[Callable[..., Any], Maker]] = {
    "ReLU": (jax.nn.relu, normal),
    "Neg": (jnp.negative, normal),
    "Exp": (jnp.exp, normal),
    "Log": (jnp.log, positive),
    "Sqrt": (jnp.sqrt, positive),
    "Rsqrt": (lax.rsqrt, positive),
    "Square": (jnp.square, normal),
    "Tanh": (jnp.tanh, moderate),
    "Sigmoid": (jax.nn.sigmoid, moderate),
    "GeLU": (lambda x: jax.nn.gelu(x, approximate=True), moderate),
    "SiLU": (jax.nn.silu, moderate),
}


@pytest.mark.parametrize("op", sorted(UNARY))
@FEW
@given(SHAPES, SEEDS)
def test_unary(op: str, shape: tuple[int, ...], seed: int) -> None:
    reference, make = UNARY[op]
    rng = np.random.default_rng(seed)
    check_op(op, [make(rng, shape)], {}, reference, seed=seed)


@pytest.mark.parametrize("op", ["Sigmoid", "Tanh", "GeLU", "SiLU", "Exp"])
def test_unary_extreme_values(op: str) -> None:
    scale = 0.5 if op == "Exp" else 1.0  # exp(80) overflows float32
    x = np.array([-90.0, -30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0, 80.0], np.float32) * scale
    check_op(op, [x], {}, UNARY[op][0])


@SOME
@given(
    st.sampled_from(sorted(UNARY)),
    st.sampled_from([np.float16, ml_dtypes.bfloat16]),
    SHAPES,
    SEEDS,
)
def test_unary_low_precision(op: str, dtype: Any, shape: tuple[int, ...], seed: int) -> None:
    reference, make = UNARY[op]
    x = make(np.random.default_rng(seed), shape).astype(dtype)
    check_op(op, [x], {}, reference, seed=seed)


@FEW
@given(st.sampled_from(["Neg", "Square", "ReLU"]), SHAPES, SEEDS)
def test_int_unary_forward(op: str, shape: tuple[int, ...], seed: int) -> None:
    x = np.random.default_rng(seed).integers(-9, 10, shape).astype(np.int32)
    check_op(op, [x], {}, UNARY[op][0])


# -- gradient helpers -------------------------------------------------------------------------


@SOME
@given(st.sampled_from(["SqrtGrad", "RsqrtGrad", "TanhGrad", "SigmoidGrad"]), SHAPES, SEEDS)
def test_output_based_grad_helpers(op: str, shape: tuple[int, ...], seed: int) -> None:
    """Helpers taking (y, dy), y the forward output, against jax.vjp of the forward op."""
    forward = {"SqrtGrad": "Sqrt", "RsqrtGrad": "Rsqrt", "TanhGrad": "Tanh"}.get(op, "Sigmoid")
    fn, make = UNARY[forward]
    rng = np.random.default_rng(seed)
    x = make(rng, shape)
    y = np.asarray(fn(jnp.asarray(x)), np.float32)
    dy = normal(rng, shape)
    # The helper's arguments are y and dy: the reference differentiates the forward op at the
    # x that gives this y exactly (its inverse, in the reference's precision).
    inverse = {"SqrtGrad": jnp.square, "RsqrtGrad": lambda y: 1 / jnp.square(y),
               "TanhGrad": jnp.arctanh}.get(op, lambda y: jnp.log(y) - jnp.log1p(-y))
    check_op(op, [y, dy], {}, lambda y_, dy_: jax.vjp(fn, inverse(y_))[1](dy_)[0], grad=False)


@FEW
@given(SHAPES, SEEDS)
def test_gelu_grad(shape: tuple[int, ...], seed: int) -> None:
    rng = np.random.default_rng(seed)
    dy, x = normal(rng, shape), moderate(rng, shape)
    gelu = UNARY["GeLU"][0]
    check_op(
        "GeLUGrad",
        [dy, x],
        {},
        lambda dy_, x_: jax.vjp(gelu, x_)[1](dy_)[0],
        grad=False,
    )


@FEW
@given(SHAPES, SEEDS)
def test_silu_grad(shape: tuple[int, ...], seed: int) -> None:
    rng = np.random.default_rng(seed)
    dy, x = normal(rng, shape), moderate(rng, shape)
    check_op("SiLUGrad", [dy, x], {}, lambda dy_, x_: jax.vjp(jax.nn.silu, x_)[1](dy_)[0],
             grad=False)


@FEW
@given(SHAPES, SEEDS)
def test_relu_grad(shape: tuple[int, ...], seed: int) -> None:
    rng = np.random.default_rng(seed)
    dy, x = normal(rng, shape), normal(rng, shape)
    y = np.maximum(x, 0)
    check_op(
        # relu'(x) = relu'(y): y = max(x, 0) is positive exactly where x is.
        "ReluGrad", [dy, y], {}, lambda dy_, y_: jax.vjp(jax.nn.relu, y_)[1](dy_)[0], grad=False
    )


# -- BiasAdd --------------------------------------------------------------------------------


@SOME
@given(st.data(), SEEDS)
def test_bias_add(data: st.DataObject, seed: int) -> None:
    data_format = data.draw(st.sampled_from(["NCHW", "NHWC", "NCDHW"]))
    rank = 5 if data_format == "NCDHW" else data.draw(st.integers(2, 4))
    shape = data.draw(hnp.array_shapes(min_dims=rank, max_dims=rank, max_side=4))
    axis = rank - 1 if data_format == "NHWC" else 1
    rng = np.random.default_rng(seed)
    x, bias = normal(rng, shape), normal(rng, (shape[axis],))

    def reference(x: Any, bias: Any) -> Any:
        return x + jnp.expand_dims(bias, tuple(i for i in range(rank) if i != axis))

    attrs = (
        {} if data_format == "NCHW" and data.draw(st.booleans()) else {"data_format": data_format}
    )
    check_op("BiasAdd", [x, bias], attrs, reference, seed=seed)


# -- Cast -----------------------------------------------------------------------------------


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    if dtype is DType.bool_:
        return rng.random(shape) < 0.5
    if dtype.is_float:
        # Some exact zeros, so casts to Bool see both values.
        return np.where(rng.random(shape) < 0.2, 0.0, 4 * rng.standard_normal(shape)).astype(
            dtype.np
        )
    return rng.integers(-100, 100, shape).astype(dtype.np)


@settings(max_examples=25, deadline=None)
@given(SHAPES, st.sampled_from(list(DType)), st.sampled_from(list(DType) + [None]), SEEDS)
def test_cast(shape: tuple[int, ...], src: DType, dst: DType | None, seed: int) -> None:
    x = _values(np.random.default_rng(seed), shape, src)
    attrs = {} if dst is None else {"dst_type": dst}
    target = (dst or DType.float32).np
    check_op("Cast", [x], attrs, lambda x: x.astype(target), seed=seed)


# -- Select, comparisons --------------------------------------------------------------------


@SOME
@given(TRIPLES, SEEDS)
def test_select(shapes: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sc, sx, sy = shapes.input_shapes
    cond = rng.random(sc) < 0.5
    check_op("Select", [cond, normal(rng, sx), normal(rng, sy)], {}, jnp.where, seed=seed)


COMPARISONS = {
    "Equal": jnp.equal,
    "NotEqual": jnp.not_equal,
    "Greater": jnp.greater,
    "GreaterEqual": jnp.greater_equal,
    "Less": jnp.less,
    "LessEqual": jnp.less_equal,
}
COMPARED_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.uint8,
                   np.bool_]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(COMPARISONS)), PAIRS, st.sampled_from(COMPARED_DTYPES), SEEDS)
def test_comparison(op: str, shapes: Any, dtype: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sx, sy = shapes.input_shapes
    # Integer-valued operands in [0, 2]: equal elements are common, every dtype holds them.
    x, y = rng.integers(0, 3, sx).astype(dtype), rng.integers(0, 3, sy).astype(dtype)
    check_op(op, [x, y], {}, COMPARISONS[op])


@SOME
@given(st.sampled_from(["LogicalAnd", "LogicalOr"]), PAIRS, SEEDS)
def test_logical_binary(op: str, shapes: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sx, sy = shapes.input_shapes
    fn = {"LogicalAnd": jnp.logical_and, "LogicalOr": jnp.logical_or}[op]
    check_op(op, [rng.random(sx) < 0.5, rng.random(sy) < 0.5], {}, fn)


@SOME
@given(TRIPLES, st.sampled_from([np.float16, ml_dtypes.bfloat16, np.int32, np.uint8, np.bool_]),
       SEEDS)
def test_select_other_dtypes(shapes: Any, dtype: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sc, sx, sy = shapes.input_shapes
    x, y = rng.integers(0, 5, sx).astype(dtype), rng.integers(0, 5, sy).astype(dtype)
    check_op("Select", [rng.random(sc) < 0.5, x, y], {}, jnp.where, seed=seed)


def test_comparison_stops_gradient() -> None:
    # Gradient of x * (x > y): only the Mul path contributes.
    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (3,)), "x", "weight", True))
    y = graph.add_param(GraphParam(TensorType(DType.float32, (3,)), "y", "weight", True))
    b = Builder(graph)
    out = b("Mul", x, b("Cast", b("Greater", x, y), dst_type=DType.float32))
    grads = append_gradients(graph, [out], [x, y])
    graph.outputs = grads
    gx, gy = run_graph(graph, [np.array([1.0, -1.0, 2.0], np.float32), np.zeros(3, np.float32)])
    np.testing.assert_array_equal(gx, [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(gy, [0.0, 0.0, 0.0])


@FEW
@given(SHAPES, SEEDS)
def test_logical_not(shape: tuple[int, ...], seed: int) -> None:
    x = np.random.default_rng(seed).random(shape) < 0.5
    check_op("LogicalNot", [x], {}, jnp.logical_not)


# -- errors ---------------------------------------------------------------------------------


def _emit(op: str, types: list[tuple[DType, tuple[int, ...]]], **attrs: Any) -> Value:
    graph = Graph("errors")
    params = [
        graph.add_param(GraphParam(TensorType(dtype, shape), f"p{i}"))
        for i, (dtype, shape) in enumerate(types)
    ]
    return Builder(graph).emit(op, list(params), attrs)


F32, I32, BOOL = DType.float32, DType.int32, DType.bool_


@pytest.mark.parametrize(
    "op, types, attrs, message",
    [
        ("Sub", [(F32, (2, 3)), (F32, (4,))], {}, r"\(2, 3\) and \(4,\) cannot be broadcast"),
        ("Maximum", [(F32, (2,)), (I32, (2,))], {}, "one dtype"),
        ("Pow", [(F32, (5, 1)), (F32, (2, 3))], {}, "cannot be broadcast"),
        ("Sub", [(BOOL, (2,)), (BOOL, (2,))], {}, "numeric"),
        ("RealDiv", [(I32, (2,)), (I32, (2,))], {}, "floating-point"),
        ("Log", [(I32, (2,))], {}, "floating-point"),
        ("Neg", [(BOOL, (2,))], {}, "numeric"),
        ("GeLU", [(F32, (2,)), (F32, (2,))], {}, "expects 1 input"),
        ("Exp", [(F32, (2,))], {"axis": 0}, "no attribute"),
        ("BiasAdd", [(F32, (2, 3, 4)), (F32, (4,))], {}, r"bias must have shape \(3,\)"),
        ("BiasAdd", [(F32, (4,)), (F32, (4,))], {}, "rank >= 2"),
        ("BiasAdd", [(F32, (2, 3)), (F32, (3,))], {"data_format": "NCW"}, "data_format"),
        ("BiasAdd", [(F32, (2, 3, 4)), (F32, (3,))], {"data_format": "NCDHW"}, "rank-5"),
        ("Cast", [(F32, (2,))], {"dst_type": "float16"}, "dst_type must be an ir.types.DType"),
        ("Select", [(F32, (2,)), (F32, (2,)), (F32, (2,))], {}, "cond must be Bool"),
        ("Select", [(BOOL, (3,)), (F32, (2,)), (F32, (2,))], {}, "cannot be broadcast"),
        ("Greater", [(F32, (2,)), (F32, (3,))], {}, "cannot be broadcast"),
        ("LogicalNot", [(F32, (2,))], {}, "Bool"),
        ("LogicalAnd", [(BOOL, (2,)), (I32, (2,))], {}, "y must be Bool, got Int32"),
        ("LogicalOr", [(BOOL, (2,)), (BOOL, (3,))], {}, "cannot be broadcast"),
        ("NotEqual", [(F32, (2,)), (I32, (2,))], {}, "one dtype"),
        ("SiLU", [(I32, (2,))], {}, "floating-point"),
        ("SqrtGrad", [(I32, (2,)), (I32, (2,))], {}, "floating-point"),
    ],
)
def test_bad_inputs_raise_op_error(
    op: str, types: list[tuple[DType, tuple[int, ...]]], attrs: dict[str, Any], message: str
) -> None:
    with pytest.raises(OpError, match=message) as info:
        _emit(op, types, **attrs)
    assert str(info.value).startswith(op)
