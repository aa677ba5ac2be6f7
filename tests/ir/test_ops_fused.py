"""mindformers' fused kernels against their unfused math written directly in JAX (forward values
and gradients, `tests.op_harness.check_op`), their invalid inputs refused with one message, and
their sharding rules against the single-device oracle (every output and input gradient)."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.step_parallel_begin import assign
from tests.e2e.test_parallel import draw_strategy, rnd
from tests.ir.test_parallel_ops import case_graph, run_sharded
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
FEW = settings(max_examples=8, deadline=None)
SHAPES = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)


def swiglu_reference(dim: int) -> Any:
    """The unfused form: silu of the first half times the second half."""

    def ref(x: Any) -> Any:
        a, b = jnp.split(x, 2, axis=dim)
        return jax.nn.silu(a) * b

    return ref


@st.composite
def swiglu_case(draw: st.DrawFn) -> tuple[tuple[int, ...], int]:
    shape = list(draw(SHAPES))
    axis = draw(st.integers(0, len(shape) - 1))
    shape[axis] *= 2
    dim = axis - len(shape) if draw(st.booleans()) else axis
    return tuple(shape), dim


@FEW
@given(swiglu_case(), st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]), SEEDS)
def test_swiglu_matches_jax(case: tuple[tuple[int, ...], int], dtype: Any, seed: int) -> None:
    shape, dim = case
    x = (2.0 * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)
    check_op("Swiglu", [x], {"dim": dim}, swiglu_reference(dim), seed=seed)


@FEW
@given(swiglu_case(), SEEDS)
def test_swiglu_grad_matches_jax(case: tuple[tuple[int, ...], int], seed: int) -> None:
    shape, dim = case
    rng = np.random.default_rng(seed)
    x = (2.0 * rng.standard_normal(shape)).astype(np.float32)
    half = tuple(d // 2 if i == dim % len(shape) else d for i, d in enumerate(shape))
    dy = rng.standard_normal(half).astype(np.float32)

    def ref(dy_: Any, x_: Any) -> Any:
        return jax.vjp(swiglu_reference(dim), x_)[1](dy_)[0]

    check_op("SwigluGrad", [dy, x], {"dim": dim}, ref, grad=False, seed=seed)


@pytest.mark.parametrize("dtype,shape,attrs,message", [
    (DType.float32, (2, 3), {"dim": -1}, r"dim -1 of x \(2, 3\) has odd size 3"),
    (DType.float32, (2, 4), {"dim": 2}, r"dim 2 is out of range for x of rank 2"),
    (DType.int32, (2, 4), {}, "needs a floating-point x, got Int32"),
])
def test_swiglu_refuses_an_odd_dim(dtype: DType, shape: tuple[int, ...],
                                   attrs: dict[str, Any], message: str) -> None:
    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(dtype, shape), "x"))
    with pytest.raises(OpError, match="Swiglu.*" + message):
        Builder(graph).emit("Swiglu", [x], attrs)


def rotate_reference(x: Any, mode: int) -> Any:
    """The unfused rotation, as mindformers' `_rotate_half` writes it."""
    if mode == 0:
        first, second = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([-second, first], axis=-1)
    pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    return jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


@FEW
@given(SHAPES, st.sampled_from([0, 1]), SEEDS)
def test_rotate_half_matches_jax(shape: tuple[int, ...], mode: int, seed: int) -> None:
    shape = shape[:-1] + (2 * shape[-1],)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_op("RotateHalf", [x], {"mode": mode}, lambda x_: rotate_reference(x_, mode), seed=seed)


@st.composite
def rope_case(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """x (4-D, even last dim) and a shape of cos/sin broadcasting to it with x's last dim."""
    x = tuple(draw(st.integers(1, 3)) for _ in range(3)) + (2 * draw(st.integers(1, 3)),)
    table = tuple(d if draw(st.booleans()) else 1 for d in x[:3]) + (x[3],)
    return x, table


@FEW
@given(rope_case(), st.sampled_from([0, 1]),
       st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]), SEEDS)
def test_rope_matches_jax(case: Any, mode: int, dtype: Any, seed: int) -> None:
    """Forward and the gradients of x, cos and sin against the unfused form."""
    x_shape, table = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(dtype)
    angles = rng.uniform(0, 6.3, table)
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    check_op("RotaryPositionEmbedding", [x, cos, sin], {"mode": mode},
             lambda x_, c_, s_: x_ * c_ + rotate_reference(x_, mode) * s_, seed=seed)


@pytest.mark.parametrize("shapes,attrs,message", [
    (((2, 3, 4), (1, 3, 4), (1, 3, 4)), {}, r"x must be 4-D"),
    (((1, 2, 3, 5), (1, 1, 3, 5), (1, 1, 3, 5)), {}, r"last dim of x .* must be even"),
    (((1, 2, 3, 4), (1, 1, 3, 2), (1, 1, 3, 2)), {}, r"cos and sin \(1, 1, 3, 2\) must be 4-D"),
    (((1, 2, 3, 4), (1, 1, 3, 4), (1, 2, 3, 4)), {}, r"must have one shape"),
    (((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4)), {"mode": 2}, r"mode must be 0 .* or 1"),
])
def test_rope_refuses_bad_shapes(shapes: Any, attrs: dict[str, Any], message: str) -> None:
    graph = Graph("g")
    params = [graph.add_param(GraphParam(TensorType(DType.float32, s), f"x{i}"))
              for i, s in enumerate(shapes)]
    with pytest.raises(OpError, match="RotaryPositionEmbedding.*" + message):
        Builder(graph).emit("RotaryPositionEmbedding", list(params), attrs)


def rope_inputs(x_shape: tuple[int, ...], table: tuple[int, ...]) -> list[np.ndarray]:
    angles = np.random.default_rng(5).uniform(0, 6.3, table)
    return [rnd(x_shape), np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]


CASES: dict[str, Any] = {
    "Swiglu": lambda: ([rnd((4, 2, 2, 8))], {"dim": -2}),
    "Swiglu2": lambda: ([rnd((8, 4, 6))], {"dim": -1}),
    "RotaryPositionEmbedding": lambda: (rope_inputs((2, 4, 4, 8), (1, 1, 4, 8)), {"mode": 0}),
    "RotaryPositionEmbedding2": lambda: (rope_inputs((4, 2, 2, 4), (4, 1, 2, 4)), {"mode": 1}),
    "RotateHalf": lambda: ([rnd((4, 2, 8))], {"mode": 1}),
}


@settings(max_examples=30, deadline=None)
@given(st.data(), st.sampled_from(sorted(CASES)), st.sampled_from([1, 2, 4, 8]))
def test_rules_match_the_oracle(data: Any, case: str, devices: int) -> None:
    op = case.rstrip("0123456789")
    arrays, attrs = CASES[case]()
    strategy = draw_strategy(data.draw, op, arrays, attrs, devices)
    run_sharded(op, arrays, attrs, strategy, devices)


def test_swiglu_split_dim_split_is_refused_with_one_message() -> None:
    graph, _ = case_graph("Swiglu", [rnd((4, 2, 8))], {"dim": -1}, ((1, 1, 2),))
    with pytest.raises(OpError, match="Swiglu's split dim"):
        assign(graph, 2, "full_batch")


def test_rope_split_of_the_rotated_dim_is_refused_with_one_message() -> None:
    graph, _ = case_graph("RotaryPositionEmbedding", rope_inputs((2, 2, 4, 8), (1, 1, 4, 8)),
                          {"mode": 0}, ((1, 1, 1, 2), (1, 1, 1, 2), (1, 1, 1, 2)))
    with pytest.raises(OpError, match="rotated dim D"):
        assign(graph, 2, "full_batch")
