"""Reductions, BroadcastTo, ZerosLike and OnesLike against JAX written directly: random shapes
(rank 0 included), random axes (negative, repeated-free, () = all) and keep_dims, forward values
and gradients, plus the errors bad axes and shapes raise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Value
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4)
# Each check_op compiles two JAX programs (~0.15 s), so example counts stay small.
SOME = settings(max_examples=20, deadline=None)

REFERENCES: dict[str, Callable[..., Any]] = {
    "ReduceSum": jnp.sum,
    "ReduceMean": jnp.mean,
    "ReduceMax": jnp.max,
    "ReduceMin": jnp.min,
}


@st.composite
def reduce_attrs(draw: st.DrawFn, rank: int) -> tuple[tuple[int, ...], bool]:
    """(axis, keep_dims): a subset of the axes, each possibly written negative; () = all."""
    axes = draw(st.lists(st.integers(0, max(rank - 1, 0)), unique=True, max_size=rank))
    signed = tuple(a - rank if draw(st.booleans()) else a for a in axes)
    return signed, draw(st.booleans())


def _jax_axis(axis: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if axis == () else axis


def _values(rng: np.random.Generator, shape: tuple[int, ...], ties: bool) -> np.ndarray:
    if ties:
        return rng.integers(-2, 3, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op", sorted(REFERENCES))
@SOME
@given(st.data(), SHAPES, SEEDS)
def test_reduce(op: str, data: st.DataObject, shape: tuple[int, ...], seed: int) -> None:
    axis, keep_dims = data.draw(reduce_attrs(len(shape)))
    # Integer-valued inputs give ReduceMax ties, where the gradient is shared.
    x = _values(np.random.default_rng(seed), shape, ties=data.draw(st.booleans()))
    attrs: dict[str, Any] = {"axis": axis, "keep_dims": keep_dims}
    if axis == () and not keep_dims and data.draw(st.booleans()):
        attrs = {}  # the defaults: all axes, no kept dims
    ref = REFERENCES[op]
    check_op(op, [x], attrs, lambda x: ref(x, axis=_jax_axis(axis), keepdims=keep_dims), seed=seed)


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(["ReduceSum", "ReduceMax", "ReduceMin"]),
    st.sampled_from([np.int32, np.int64]),
    st.data(),
    SHAPES,
    SEEDS,
)
def test_reduce_integer(
    op: str, dtype: Any, data: st.DataObject, shape: tuple[int, ...], seed: int
) -> None:
    axis, keep_dims = data.draw(reduce_attrs(len(shape)))
    x = np.random.default_rng(seed).integers(-50, 50, shape).astype(dtype)
    ref = REFERENCES[op]
    check_op(
        op,
        [x],
        {"axis": axis, "keep_dims": keep_dims},
        lambda x: ref(x, axis=_jax_axis(axis), keepdims=keep_dims).astype(dtype),
    )


@settings(max_examples=15, deadline=None)
@given(st.data(), SHAPES, SEEDS)
def test_reduce_max_bool(data: st.DataObject, shape: tuple[int, ...], seed: int) -> None:
    axis, keep_dims = data.draw(reduce_attrs(len(shape)))
    x = np.random.default_rng(seed).random(shape) < 0.3
    check_op(
        "ReduceMax",
        [x],
        {"axis": axis, "keep_dims": keep_dims},
        lambda x: jnp.max(x, axis=_jax_axis(axis), keepdims=keep_dims),
    )


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(sorted(REFERENCES)),
    st.sampled_from([np.float16, ml_dtypes.bfloat16]),
    st.data(),
    SHAPES,
    SEEDS,
)
def test_reduce_low_precision(
    op: str, dtype: Any, data: st.DataObject, shape: tuple[int, ...], seed: int
) -> None:
    axis, keep_dims = data.draw(reduce_attrs(len(shape)))
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    ref = REFERENCES[op]
    check_op(
        op,
        [x],
        {"axis": axis, "keep_dims": keep_dims},
        lambda x: ref(x, axis=_jax_axis(axis), keepdims=keep_dims),
        seed=seed,
    )


def test_reduce_single_int_axis() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    check_op("ReduceSum", [x], {"axis": -1}, lambda x: jnp.sum(x, axis=-1))


def test_reduce_max_gradient_shared_by_ties() -> None:
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    check_op("ReduceMax", [x], {"axis": (1,)}, lambda x: jnp.max(x, axis=1))


def test_reduce_min_of_bool_and_ties() -> None:
    """ReduceMin of Bool is all(); tied minima share the gradient evenly (as JAX's min)."""
    flags = np.array([[True, False, True], [True, True, True]])
    check_op("ReduceMin", [flags], {"axis": (1,)}, lambda x: jnp.min(x, axis=1))
    x = np.array([[1.0, 1.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    check_op("ReduceMin", [x], {"axis": (1,), "keep_dims": True},
             lambda x: jnp.min(x, axis=1, keepdims=True))


# -- BroadcastTo ----------------------------------------------------------------------------


@st.composite
def broadcast_case(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input shape, attribute shape): the input drops leading dims of the target and has
    some dims 1; the attribute may say -1 where it keeps the input's dim."""
    target = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4))
    rank = draw(st.integers(0, len(target)))
    src = tuple(1 if draw(st.booleans()) else d for d in target[len(target) - rank :])
    lead = len(target) - rank
    attr = tuple(
        -1 if i >= lead and src[i - lead] == d and draw(st.booleans()) else d
        for i, d in enumerate(target)
    )
    return src, attr


@SOME
@given(broadcast_case(), SEEDS)
def test_broadcast_to(case: tuple[tuple[int, ...], tuple[int, ...]], seed: int) -> None:
    src, attr = case
    target = tuple(src[i - (len(attr) - len(src))] if d == -1 else d for i, d in enumerate(attr))
    x = np.random.default_rng(seed).standard_normal(src).astype(np.float32)
    check_op("BroadcastTo", [x], {"shape": attr}, lambda x: jnp.broadcast_to(x, target), seed=seed)


# -- ZerosLike / OnesLike -------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["ZerosLike", "OnesLike"]),
    st.sampled_from([np.float32, np.float16, np.int32, np.bool_]),
    SHAPES,
    SEEDS,
)
def test_zeros_ones_like(op: str, dtype: Any, shape: tuple[int, ...], seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    ref = jnp.zeros_like if op == "ZerosLike" else jnp.ones_like
    # Gradient is checked too: none flows through, as in JAX.
    check_op(op, [x], {}, ref, seed=seed)


# -- errors ---------------------------------------------------------------------------------


def _emit(op: str, dtype: DType, shape: tuple[int, ...], attrs: dict[str, Any]) -> Value:
    graph = Graph("errors")
    x = graph.add_param(GraphParam(TensorType(dtype, shape), "x"))
    return Builder(graph).emit(op, [x], attrs)


F32 = DType.float32


@pytest.mark.parametrize(
    "op, dtype, shape, attrs, message",
    [
        ("ReduceSum", F32, (2, 3), {"axis": (2,)}, r"axis 2 is out of range for rank 2"),
        ("ReduceMean", F32, (2, 3), {"axis": (-3,)}, r"valid axes: \[-2, 1\]"),
        ("ReduceMax", F32, (), {"axis": (0,)}, "input is a scalar"),
        ("ReduceSum", F32, (2, 3), {"axis": (1, -1)}, "more than once"),
        ("ReduceSum", F32, (2, 3), {"axis": [0, 1]}, r"tuple of ints.*write \(0, 1\)"),
        ("ReduceSum", F32, (2, 3), {"axis": (0.0,)}, "tuple of ints"),
        ("ReduceSum", F32, (2, 3), {"keep_dims": 1}, "keep_dims must be a bool"),
        ("ReduceSum", DType.bool_, (2,), {}, "numeric"),
        ("ReduceMean", DType.int32, (2,), {}, "floating-point"),
        ("ReduceMax", F32, (2, 0), {"axis": (1,)}, "empty axis 1"),
        ("ReduceSum", F32, (2,), {"axes": (0,)}, "no attribute"),
        ("BroadcastTo", F32, (3,), {}, "needs attribute shape"),
        ("BroadcastTo", F32, (3,), {"shape": (2, 4)}, r"input dim 0 is 3, which is neither"),
        ("BroadcastTo", F32, (2, 3), {"shape": (3,)}, "lower rank"),
        ("BroadcastTo", F32, (3,), {"shape": (-1, 3)}, "new leading dim"),
        ("BroadcastTo", F32, (3,), {"shape": [2, 3]}, r"write \(2, 3\)"),
        ("ZerosLike", F32, (3,), {"shape": (3,)}, "no attribute"),
    ],
)
def test_bad_inputs_raise_op_error(
    op: str, dtype: DType, shape: tuple[int, ...], attrs: dict[str, Any], message: str
) -> None:
    with pytest.raises(OpError, match=message) as info:
        _emit(op, dtype, shape, attrs)
    assert str(info.value).startswith(op)
