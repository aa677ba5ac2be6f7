"""Trunc, FloorMod, Atan2, DivNoNan, MulNoNan and the bitwise ops (ir/ops/numeric.py) against
JAX written directly (values and gradients, `tests.op_harness.check_op`), MindSpore's semantics
on edge values, and their element-wise rule against the oracle."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from tests.e2e.test_parallel import draw_strategy, rnd, run_sharded
from tests.op_harness import check_op


def _run(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    graph = Graph(op)
    params = [graph.add_param(GraphParam(TensorType(DType.from_any(a.dtype), a.shape), f"x{i}"))
              for i, a in enumerate(arrays)]
    graph.outputs = [Builder(graph).emit(op, list(params), {})]
    return np.asarray(run_graph(graph, arrays)[0])


def _away_from_zero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * rng.uniform(0.5, 2.0, shape)).astype(np.float32)


def test_values_match_jax() -> None:
    rng = np.random.default_rng(0)
    x = (3.0 * rng.standard_normal((3, 4))).astype(np.float32)
    y = _away_from_zero(rng, (4,))
    check_op("Trunc", [x], {}, jnp.trunc, grad=False)
    check_op("FloorMod", [x, y], {}, lambda a, b: a - jnp.floor(a / b) * b)
    ints = rng.integers(0, 64, (3, 4)).astype(np.int32), rng.integers(0, 64, (4,)).astype(
        np.int32)
    for op, fn in (("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or),
                   ("BitwiseXor", np.bitwise_xor)):
        np.testing.assert_array_equal(_run(op, list(ints)), fn(*ints))
        flags = [np.array([True, False, True]), np.array([True, True, False])]
        np.testing.assert_array_equal(_run(op, flags), fn(*flags))
        with pytest.raises(OpError, match="Float32"):
            _run(op, [x, x])


def test_atan2_and_no_nan_ops_match_jax() -> None:
    rng = np.random.default_rng(1)
    x = (3.0 * rng.standard_normal((3, 4))).astype(np.float32)
    y = _away_from_zero(rng, (4,))
    check_op("Atan2", [x, y], {}, jnp.arctan2)
    check_op("DivNoNan", [x, y], {}, lambda a, b: a / b)
    check_op("MulNoNan", [x, y], {}, lambda a, b: a * b)


def test_add_ext_and_sub_ext() -> None:
    """MindSpore's AddExt / SubExt: input +- alpha * other (alpha 1: plain Add / Sub)."""
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4,)).astype(
        np.float32)
    check_op("AddExt", [x, y], {"alpha": 2.5}, lambda a, b: a + b * 2.5)
    check_op("SubExt", [x, y], {"alpha": 1}, lambda a, b: a - b)
    ints = [np.array([5, -2], np.int32), np.array([3, 4], np.int32)]
    graph = Graph("ext")
    params = [graph.add_param(GraphParam(TensorType(DType.int32, (2,)), f"x{i}"))
              for i in range(2)]
    b = Builder(graph)
    graph.outputs = [b.emit("SubExt", list(params), {"alpha": 2})]
    np.testing.assert_array_equal(run_graph(graph, ints)[0], [-1, -10])
    with pytest.raises(OpError, match="float alpha"):
        b.emit("AddExt", list(params), {"alpha": 0.5})


def test_mindspore_semantics_on_edge_values() -> None:
    """FloorMod takes the sign of y (Mod: of x); DivNoNan and MulNoNan give 0 where y is 0, even
    with an inf or NaN x; Trunc rounds toward zero and leaves integers."""
    for dtype in (np.int32, np.float32):
        x = np.array([7, -7, 7, -7, 6, 0], dtype)
        y = np.array([2, 2, -2, -2, 4, 5], dtype)
        np.testing.assert_array_equal(_run("FloorMod", [x, y]),
                                      np.array([1, 1, -1, -1, 2, 0], dtype))
    x = np.array([1.0, np.inf, np.nan, -3.0], np.float32)
    y = np.array([0.0, 0.0, 0.0, 2.0], np.float32)
    np.testing.assert_array_equal(_run("DivNoNan", [x, y]), [0.0, 0.0, 0.0, -1.5])
    np.testing.assert_array_equal(_run("MulNoNan", [x, y]), [0.0, 0.0, 0.0, -6.0])
    np.testing.assert_array_equal(_run("Trunc", [np.array([-1.7, 1.7, -0.2], np.float32)]),
                                  np.array([-1.0, 1.0, -0.0], np.float32))
    np.testing.assert_array_equal(_run("Trunc", [np.array([-3, 4], np.int32)]), [-3, 4])


CASES = {
    "FloorMod": lambda: ([rnd((4, 6)), np.abs(rnd((6,), 1)) + 0.5], {}),
    "Atan2": lambda: ([rnd((4, 6)), rnd((4, 6), 1)], {}),
    "DivNoNan": lambda: ([rnd((8, 6)), np.abs(rnd((8, 6), 1)) + 0.5], {}),
    "MulNoNan": lambda: ([rnd((4, 8)), rnd((8,), 1)], {}),
    "Trunc": lambda: ([rnd((8, 4))], {}),
    "AddExt": lambda: ([rnd((4, 8)), rnd((8,), 1)], {"alpha": 0.5}),
    "SubExt": lambda: ([rnd((8, 4)), rnd((8, 4), 1)], {"alpha": 2.0}),
}


@settings(max_examples=10, deadline=None)
@given(st.data(), st.sampled_from(sorted(CASES)), st.sampled_from([2, 4, 8]))
def test_rules_match_the_oracle(data: Any, case: str, devices: int) -> None:
    arrays, attrs = CASES[case]()
    strategy = draw_strategy(data.draw, case, arrays, attrs, devices)
    run_sharded(case, arrays, attrs, strategy, devices)
