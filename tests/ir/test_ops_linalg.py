"""MatMul and BatchMatMul against JAX written directly: forward, gradients, error messages."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
DIMS = st.integers(1, 5)


def _ref_matmul(ta: bool, tb: bool) -> Any:
    def ref(a: Any, b: Any) -> Any:
        a = jnp.swapaxes(a, -1, -2) if ta else a
        b = jnp.swapaxes(b, -1, -2) if tb else b
        return jnp.matmul(a, b)

    return ref


def _operand(
    rng: np.random.Generator, batch: tuple[int, ...], rows: int, cols: int, transposed: bool
) -> np.ndarray:
    shape = batch + ((cols, rows) if transposed else (rows, cols))
    return rng.standard_normal(shape).astype(np.float32)


@settings(max_examples=20, deadline=None)
@given(DIMS, DIMS, DIMS, st.booleans(), st.booleans(), SEEDS)
def test_matmul(m: int, k: int, n: int, ta: bool, tb: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = _operand(rng, (), m, k, ta)
    b = _operand(rng, (), k, n, tb)
    check_op("MatMul", [a, b], {"transpose_a": ta, "transpose_b": tb}, _ref_matmul(ta, tb))


@st.composite
def _batch_shapes(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two mutually broadcastable batch shapes, at least one non-empty (rank >= 3 overall)."""
    shapes = draw(
        hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3)
    )
    a, b = shapes.input_shapes
    if not a and not b:
        a = (draw(st.integers(1, 3)),)
    return a, b


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@settings(max_examples=25, deadline=None)
@given(_batch_shapes(), DIMS, DIMS, DIMS, st.booleans(), st.booleans(), SEEDS)
def test_batch_matmul(
    batches: tuple[tuple[int, ...], tuple[int, ...]],
    m: int,
    k: int,
    n: int,
    ta: bool,
    tb: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    a = _operand(rng, batches[0], m, k, ta)
    b = _operand(rng, batches[1], k, n, tb)
    check_op("BatchMatMul", [a, b], {"transpose_a": ta, "transpose_b": tb}, _ref_matmul(ta, tb))


@pytest.mark.parametrize(("batches", "ta", "tb"), [
    (((2, 1), (3,)), True, False),  # batch dims broadcast both ways
    (((), (1, 2)), False, True),  # a rank-2 a against batched b
])
def test_batch_matmul_fixed_cases(batches: tuple[tuple[int, ...], tuple[int, ...]], ta: bool,
                                  tb: bool) -> None:
    test_batch_matmul.hypothesis.inner_test(batches, 2, 3, 4, ta, tb, 5)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.booleans(), st.booleans(), SEEDS)
def test_batch_matmul_rank2_rhs(batch: int, n: int, ta: bool, tb: bool, seed: int) -> None:
    """A rank-2 b is shared by every batch (MindSpore broadcast); its gradient sums batches."""
    rng = np.random.default_rng(seed)
    a = _operand(rng, (batch, 2), 3, 4, ta)
    b = _operand(rng, (), 4, n, tb)
    check_op("BatchMatMul", [a, b], {"transpose_a": ta, "transpose_b": tb}, _ref_matmul(ta, tb))


def test_matmul_int32() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    b = np.arange(12, dtype=np.int32).reshape(3, 4)
    check_op("MatMul", [a, b], {}, jnp.matmul, grad=False)


# -- errors ---------------------------------------------------------------------------------


def _emit(
    op: str, shapes: list[tuple[int, ...]], dtypes: list[DType] | None = None, **attrs: Any
) -> Any:
    graph = Graph("errors")
    params = [
        graph.add_param(
            GraphParam(TensorType((dtypes or [DType.float32] * len(shapes))[i], s), f"x{i}")
        )
        for i, s in enumerate(shapes)
    ]
    return Builder(graph).emit(op, params, attrs)


def test_matmul_k_mismatch_message() -> None:
    with pytest.raises(OpError) as info:
        _emit("MatMul", [(2, 3), (4, 5)])
    msg = str(info.value)
    assert "MatMul" in msg and "a has 3 columns but b has 4 rows" in msg
    assert "transpose_a/transpose_b" in msg and "(2, 3), (4, 5)" in msg


def test_matmul_k_mismatch_with_transpose() -> None:
    with pytest.raises(OpError, match=r"a \(transposed\) has 2 columns"):
        _emit("MatMul", [(2, 3), (3, 5)], transpose_a=True)
    # The same shapes are fine when the flag makes K agree.
    assert _emit("MatMul", [(3, 2), (3, 5)], transpose_a=True).shape == (2, 5)
    assert _emit("MatMul", [(2, 3), (5, 3)], transpose_b=True).shape == (2, 5)


def test_matmul_rank_message() -> None:
    with pytest.raises(OpError, match="needs 2-D operands.*use BatchMatMul"):
        _emit("MatMul", [(2, 2, 3), (3, 5)])


def test_matmul_dtype_and_flag_messages() -> None:
    with pytest.raises(OpError, match="one dtype"):
        _emit("MatMul", [(2, 3), (3, 5)], [DType.float32, DType.float16])
    with pytest.raises(OpError, match="transpose_a must be a bool"):
        _emit("MatMul", [(2, 3), (3, 5)], transpose_a=1)
    with pytest.raises(OpError, match="no attribute.*transpose_c"):
        _emit("MatMul", [(2, 3), (3, 5)], transpose_c=True)


def test_batch_matmul_messages() -> None:
    with pytest.raises(OpError, match=r"batch dims \(2,\) and \(3,\) do not broadcast"):
        _emit("BatchMatMul", [(2, 4, 3), (3, 3, 5)])
    with pytest.raises(OpError, match="use MatMul for two 2-D operands"):
        _emit("BatchMatMul", [(4, 3), (3, 5)])
    with pytest.raises(OpError, match="contraction dims differ"):
        _emit("BatchMatMul", [(2, 4, 3), (2, 4, 5)])
    assert _emit("BatchMatMul", [(2, 1, 4, 3), (5, 3, 6)]).shape == (2, 5, 4, 6)
    assert _emit("BatchMatMul", [(4, 3), (7, 3, 6)]).shape == (7, 4, 6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.booleans(), st.sampled_from(["MatMul", "BatchMatMul"]),
       st.integers(0, 2**31 - 1))
def test_a_constant_signed_permutation_is_lowered_as_column_moves(d: int, tb: bool, op: str,
                                                                  seed: int) -> None:
    """x @ P for a constant signed permutation P (rotate-half's swap matrix among them) runs
    in JAX as slices and negations of x's columns: exactly the product for finite x; any
    other constant keeps the matrix product."""
    from pcompile.ir.core import Constant
    from pcompile.ir.registry import get_op

    rng = np.random.default_rng(seed)
    matrix = np.zeros((d, d), np.float32)
    matrix[rng.permutation(d), np.arange(d)] = rng.choice([-1.0, 1.0], d)
    shape = (3, d) if op == "MatMul" else (2, 3, d)
    g = Graph("g")
    x = g.add_param(GraphParam(TensorType(DType.float32, shape), "x"))
    node = Builder(g).emit(op, [x, Constant(matrix, DType.float32)],
                           {"transpose_b": tb}).node
    attrs = get_op(op).jax_attrs(node)
    assert "permutation" in attrs
    a = rng.standard_normal(shape).astype(np.float32)
    want = a @ (matrix.T if tb else matrix)
    # jitted: eagerly, every slice and negation would compile on its own
    lowered = jax.jit(lambda v: get_op(op).jax(v, matrix, **attrs))(a)
    np.testing.assert_array_equal(np.asarray(lowered), want)
    # not a signed permutation: a scaled one; one with a second entry in a row (d >= 2)
    others = [matrix * 2] + ([np.abs(matrix) + np.roll(np.abs(matrix), 1, axis=1)]
                             if d >= 2 else [])
    for other in others:
        node = Builder(g).emit(op, [x, Constant(other, DType.float32)],
                               {"transpose_b": tb}).node
        assert "permutation" not in get_op(op).jax_attrs(node)
