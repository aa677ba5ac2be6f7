"""FloorDiv, Mod, Cos, Sin, IsFinite and Depend against JAX written directly (forward values and
gradients, `tests.op_harness.check_op`), their MindSpore semantics on edge values, their
sharding rules against the oracle (tests/e2e/test_parallel.py's harness), and Depend in a traced
forward graph: no strategy, its value's layout, its ordering operand never redistributed."""

from __future__ import annotations

import os
import textwrap
import warnings
from typing import Any

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.types import DType, TensorType
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests.e2e.test_parallel import draw_strategy, rnd, run_sharded
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
PAIRS = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=4)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5)
FEW = settings(max_examples=5, deadline=None)


def _away_from_zero(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * rng.uniform(0.5, 2.0, shape)).astype(np.float32)


@FEW
@given(PAIRS, SEEDS)
def test_floor_div_matches_jax(shapes: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    (sx, sy), _ = shapes
    x = (3.0 * rng.standard_normal(sx)).astype(np.float32)
    y = _away_from_zero(rng, sy)
    check_op("FloorDiv", [x, y], {}, lambda a, b: jnp.floor(a / b))


def test_floor_div_rounds_toward_minus_infinity() -> None:
    """MindSpore's FloorDiv: floor(x / y); integers divide with Python's floor division."""
    for dtype in (np.int32, np.int64, np.float32):
        x = np.array([7, -7, 7, -7, 6, 0], dtype)
        y = np.array([2, 2, -2, -2, 3, 5], dtype)
        out = _run1("FloorDiv", [x, y])
        np.testing.assert_array_equal(out, np.array([3, -4, -4, 3, 2, 0], dtype))


@FEW
@given(PAIRS, SEEDS)
def test_mod_matches_jax(shapes: Any, seed: int) -> None:
    """Values against jnp.fmod; gradients against jax.vjp of it (dx = cot, dy = -cot
    trunc(x / y))."""
    rng = np.random.default_rng(seed)
    (sx, sy), _ = shapes
    x = (3.0 * rng.standard_normal(sx)).astype(np.float32)
    y = _away_from_zero(rng, sy)
    check_op("Mod", [x, y], {}, jnp.fmod)


def test_mod_takes_the_sign_of_the_dividend() -> None:
    """MindSpore's Mod is fmod: -7 mod 2 is -1 (FloorMod would give 1), 7 mod -2 is 1."""
    for dtype in (np.int32, np.float32):
        x = np.array([7, -7, 7, -7, 6, 0], dtype)
        y = np.array([2, 2, -2, -2, 4, 5], dtype)
        np.testing.assert_array_equal(_run1("Mod", [x, y]), np.array([1, -1, 1, -1, 2, 0], dtype))
    # a remainder of positions by the tokens of a group, as mindformers' router takes it
    positions = np.array([0.0, 5.0, 16.0, 31.0, 40.0], np.float32)
    np.testing.assert_array_equal(_run1("Mod", [positions, np.float32(16.0)]),
                                  np.float32([0, 5, 0, 15, 8]))


@FEW
@given(SHAPES, SEEDS)
def test_cos_sin_match_jax(shape: tuple[int, ...], seed: int) -> None:
    x = (2.0 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)
    check_op("Cos", [x], {}, jnp.cos)
    check_op("Sin", [x], {}, jnp.sin)


def test_is_finite() -> None:
    x = np.array([1.0, np.inf, -np.inf, np.nan, 0.0], np.float32)
    np.testing.assert_array_equal(_run1("IsFinite", [x]), [True, False, False, False, True])
    np.testing.assert_array_equal(_run1("IsFinite", [np.array([3, -1], np.int32)]),
                                  [True, True])
    check_op("IsFinite", [x], {}, jnp.isfinite)


@FEW
@given(PAIRS, SEEDS)
def test_depend_matches_jax(shapes: Any, seed: int) -> None:
    """The value passes through with its gradient; the ordering operand gets none."""
    rng = np.random.default_rng(seed)
    (sx, sy), _ = shapes
    x = rng.standard_normal(sx).astype(np.float32)
    y = rng.standard_normal(sy).astype(np.float32)
    check_op("Depend", [x, y], {}, lambda a, b: lax.optimization_barrier((a, b))[0])


def test_overflow_gives_ieee_values_without_a_numpy_warning() -> None:
    """The interpreter computes as the devices do: float32 overflow (a loss scale's, on purpose)
    gives inf and inf - inf NaN, silently; runs and checks report non-finite results."""
    big = np.full((2, 2), 3e38, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy RuntimeWarning would fail here
        total = _run1("Add", [big, big])
        assert np.isposinf(total).all()
        assert np.isnan(_run1("Sub", [total, total])).all()
        assert np.isposinf(_run1("MatMul", [big, big])).all()


@FEW
@given(SHAPES, SEEDS)
def test_sign_matches_jax(shape: tuple[int, ...], seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_op("Sign", [x], {}, jnp.sign)


def test_sign_of_zero_and_integers() -> None:
    """MindSpore's Sign: 0 at 0, x's dtype kept, NaN stays NaN; Bool is refused by name."""
    x = np.array([-2.5, -0.0, 0.0, 3.0, np.nan], np.float32)
    out = _run1("Sign", [x])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[:4], [-1.0, 0.0, 0.0, 1.0])
    assert np.isnan(out[4])
    ints = np.array([-7, 0, 9], np.int32)
    np.testing.assert_array_equal(_run1("Sign", [ints]), np.array([-1, 0, 1], np.int32))
    graph = Graph("g")
    flag = graph.add_param(GraphParam(TensorType(DType.bool_, (2,)), "x"))
    with pytest.raises(OpError, match="Sign.*needs a numeric input, got Bool"):
        Builder(graph)("Sign", flag)


def test_depend_needs_a_tensor_value() -> None:
    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (2,)), "x"))
    b = Builder(graph)
    pair = b("MakeTuple", x, x)
    with pytest.raises(OpError, match="must be a tensor"):
        b("Depend", pair, x)


def _run1(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    graph = Graph(op)
    params = [graph.add_param(GraphParam(TensorType(DType.from_any(a.dtype), a.shape), f"x{i}"))
              for i, a in enumerate(arrays)]
    graph.outputs = [Builder(graph).emit(op, list(params), {})]
    return np.asarray(run_graph(graph, arrays)[0])


# -- sharding rules -----------------------------------------------------------------------------

CASES = {
    "FloorDiv": lambda: ([rnd((4, 6)), np.abs(rnd((6,), 1)) + 0.5], {}),
    "Mod": lambda: ([rnd((4, 6)), np.abs(rnd((6,), 1)) + 0.5], {}),
    "Cos": lambda: ([rnd((8, 6))], {}),
    "Sin": lambda: ([rnd((8, 2, 3))], {}),
    "Sign": lambda: ([rnd((4, 8))], {}),
}


@settings(max_examples=20, deadline=None)
@given(st.data(), st.sampled_from(sorted(CASES)), st.sampled_from([1, 2, 4, 8]))
def test_rules_match_the_oracle(data: Any, case: str, devices: int) -> None:
    arrays, attrs = CASES[case]()
    strategy = draw_strategy(data.draw, case, arrays, attrs, devices)
    run_sharded(case, arrays, attrs, strategy, devices)


# -- Depend in a traced forward graph -----------------------------------------------------------

DEPEND_MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, initializer, set_seed, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="{mode}", device_num=8{search})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(3)
        self.w1 = Parameter(initializer("normal", [16, 32]), "w1")
        self.w2 = Parameter(initializer("normal", [32, 16]), "w2")
        self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.matmul2 = ops.MatMul(){shard2}
        self.relu = ops.ReLU()
        self.depend = ops.Depend()
        self.reshape = ops.Reshape()

    def construct(self, x):
        h = self.matmul1(x, self.w1)
        r = self.relu(h)
        h = self.depend(h, r)           # h after r; r is never redistributed for it
        h = self.reshape(h, (16, 32))
        return self.matmul2(h, self.w2)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32),)


def labels():
    return (np.zeros((16, 16), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""


@pytest.mark.parametrize("mode,search,shard2", [
    ("semi_auto_parallel", "", ".shard(((4, 2), (2, 1)))"),
    ("auto_parallel", ", search_mode='sharding_propagation'", ""),
])
def test_depend_in_the_forward_graph_trains_like_one_device(tmp_path: Any, mode: str,
                                                            search: str, shard2: str) -> None:
    path = os.path.join(tmp_path, "depend_net.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(textwrap.dedent(DEPEND_MODEL.format(mode=mode, search=search, shard2=shard2)))
    program = compile_model(path, out_dir=str(tmp_path / "out"))
    depend = program.graph.find("Depend")[0]
    assert program.state.assignment.sharding(depend) is None  # no strategy of its own
    local = program.rank_graph(0)
    (local_depend,) = local.find("Depend")
    # The ordering operand is the ReLU's own output, not a redistribution of it.
    assert local_depend.operands[1].node.op == "ReLU"
    assert check(program, steps=2).ok()


def test_depend_skips_python_values() -> None:
    """`ops.depend(x, (a, None))`: Python values order nothing and are skipped."""
    from pcompile import Tensor, ops

    x = Tensor(np.ones(2, np.float32))
    assert ops.depend(x, (None, 3)) is x
    with pytest.raises((PcompileError, TypeError)):
        ops.Depend()(x)  # type: ignore[call-arg]
