"""The primitives a mixture of experts routes with: TopK, Sort and CumSum against JAX written
directly (values, indices and gradients, `tests/op_harness.py`), their gradients against
float64 central differences, their sharding rules against the unsharded op under random
strategies, a batch-split router compiled for 8 devices against one device, and the constant
primitives Zeros and Ones."""

from __future__ import annotations

import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcompile import Tensor, ops
from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from pcompile.passes.step_parallel_begin import assign
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests.e2e.test_parallel import draw_strategy
from tests.ir.test_parallel_ops import case_graph, run_sharded
from tests.op_harness import check_op

# Each check_op compiles a few JAX programs (~0.2 s), so the example counts stay small.
FEW = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))


def normal(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Distinct values (no ties: the gradient of a tie is a choice, not a derivative)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@st.composite
def shapes(draw: Any, min_rank: int = 1) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 5), min_size=min_rank, max_size=3)))


# -- values and gradients against JAX -------------------------------------------------------


@FEW
@given(shape=shapes(), data=st.data(), seed=st.integers(0, 99))
def test_top_k_matches_jax(shape: tuple[int, ...], data: Any, seed: int) -> None:
    k = data.draw(st.integers(1, shape[-1]))
    x = normal(shape, seed)
    check_op("TopK", [x], {"k": k}, lambda x: jax.lax.top_k(x, k), seed=seed)


def test_top_k_ties_keep_the_lower_index_first() -> None:
    x = np.array([[1, 3, 3, 0, 3], [2, 2, 2, 2, 2]], np.int32)
    check_op("TopK", [x], {"k": 3}, lambda x: jax.lax.top_k(x, 3), grad=False)
    values, indices = ops.TopK()(Tensor(x), 3)
    np.testing.assert_array_equal(indices.asnumpy(), [[1, 2, 4], [0, 1, 2]])
    assert indices.asnumpy().dtype == np.int32 and values.asnumpy().dtype == np.int32


def _sort_ref(axis: int, descending: bool) -> Any:
    def ref(x: Any) -> Any:
        idx = jnp.argsort(x, axis=axis, stable=True, descending=descending)
        return jnp.take_along_axis(x, idx, axis=axis), idx.astype(jnp.int32)

    return ref


@FEW
@given(shape=shapes(), data=st.data(), descending=st.booleans(), seed=st.integers(0, 99))
def test_sort_matches_jax(shape: tuple[int, ...], data: Any, descending: bool,
                          seed: int) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check_op("Sort", [normal(shape, seed)], {"axis": axis, "descending": descending},
             _sort_ref(axis, descending), seed=seed)


def test_sort_ties_in_both_directions() -> None:
    x = np.array([[2, 0, 2, 1, 0], [1, 1, 1, 1, 1]], np.int64)
    for descending in (False, True):
        check_op("Sort", [x], {"axis": 1, "descending": descending},
                 _sort_ref(1, descending), grad=False)


def _cumsum_ref(axis: int, exclusive: bool, reverse: bool) -> Any:
    def ref(x: Any) -> Any:
        flipped = jnp.flip(x, axis) if reverse else x
        out = jnp.cumsum(flipped, axis=axis, dtype=x.dtype)
        if exclusive:
            out = out - flipped
        return jnp.flip(out, axis) if reverse else out

    return ref


@FEW
@given(shape=shapes(), data=st.data(), exclusive=st.booleans(), reverse=st.booleans(),
       seed=st.integers(0, 99))
def test_cumsum_matches_jax(shape: tuple[int, ...], data: Any, exclusive: bool, reverse: bool,
                            seed: int) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    attrs = {"axis": axis, "exclusive": exclusive, "reverse": reverse}
    check_op("CumSum", [normal(shape, seed)], attrs, _cumsum_ref(axis, exclusive, reverse),
             seed=seed)
    ints = np.random.default_rng(seed).integers(-5, 6, shape).astype(np.int32)
    check_op("CumSum", [ints], attrs, _cumsum_ref(axis, exclusive, reverse), grad=False)


# -- vjp rules against float64 central differences ------------------------------------------


def _gradient_and_differences(op: str, x: np.ndarray, attrs: dict[str, Any]
                              ) -> tuple[np.ndarray, np.ndarray, float]:
    """The IR gradient of sum(cot * op(x)[0]) in float64, its central differences with step h,
    and the bound they must meet: the loss is piecewise linear in x (a sort permutes, a cumsum
    adds), so the differences are exact up to the rounding of the loss, about n * eps64 * |loss
    terms| / h, as long as no two values trade places within h (the inputs are at least 1e-3
    apart, h is 1e-6)."""
    x64 = x.astype(np.float64)
    graph = Graph("fd_" + op)
    param = graph.add_param(GraphParam(TensorType(DType.float64, x.shape), "x", "weight", True))
    b = Builder(graph)
    out = b.emit(op, [param], attrs)
    values = b("TupleGetItem", out, index=0) if op != "CumSum" else out
    cot = np.random.default_rng(7).standard_normal(values.shape)
    loss = b("ReduceSum", b("Mul", values, Constant(cot, DType.float64)), axis=(),
             keep_dims=False)
    graph.outputs = [loss, *append_gradients(graph, loss, [param])]

    def f(v: np.ndarray) -> float:
        return float(run_graph(graph, [v], float64=True)[0])

    grad = np.asarray(run_graph(graph, [x64], float64=True)[1])
    h = 1e-6
    diffs = np.zeros_like(x64)
    for i in np.ndindex(x.shape):
        step = np.zeros_like(x64)
        step[i] = h
        diffs[i] = (f(x64 + step) - f(x64 - step)) / (2 * h)
    terms = float(np.sum(np.abs(cot)) * np.max(np.abs(x64), initial=1.0))
    bound = 4 * x.size * np.finfo(np.float64).eps * terms / h
    return grad, diffs, bound


def _spread(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Distinct values at least 1e-3 apart, in random order."""
    n = int(np.prod(shape))
    return np.random.default_rng(seed).permutation(np.arange(n) * 1e-2 - n * 5e-3).reshape(shape)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_gradient_by_finite_differences(k: int) -> None:
    grad, diffs, bound = _gradient_and_differences("TopK", _spread((3, 5), k), {"k": k})
    np.testing.assert_allclose(grad, diffs, rtol=0, atol=bound)
    assert np.count_nonzero(grad) == 3 * k  # unpicked values get no gradient


@pytest.mark.parametrize("axis,descending", [(0, False), (1, True), (-1, False)])
def test_sort_gradient_by_finite_differences(axis: int, descending: bool) -> None:
    grad, diffs, bound = _gradient_and_differences(
        "Sort", _spread((3, 4), axis + 3), {"axis": axis, "descending": descending})
    np.testing.assert_allclose(grad, diffs, rtol=0, atol=bound)


@pytest.mark.parametrize("exclusive,reverse", [(False, False), (True, False), (False, True),
                                               (True, True)])
def test_cumsum_gradient_by_finite_differences(exclusive: bool, reverse: bool) -> None:
    attrs = {"axis": 1, "exclusive": exclusive, "reverse": reverse}
    grad, diffs, bound = _gradient_and_differences("CumSum", _spread((2, 5), 1), attrs)
    np.testing.assert_allclose(grad, diffs, rtol=0, atol=bound)


# -- sharding rules against the unsharded op ------------------------------------------------

RULE_CASES: dict[str, Any] = {
    "TopK": lambda: ([normal((8, 4, 6), 1)], {"k": 2, "sorted": True}),
    "TopK2": lambda: ([normal((4, 8), 2)], {"k": 8, "sorted": True}),
    "Sort": lambda: ([normal((4, 6, 8), 3)], {"axis": 1, "descending": True}),
    "Sort2": lambda: ([normal((8, 4), 4)], {"axis": -1, "descending": False}),
    "CumSum": lambda: ([normal((4, 8, 2), 5)], {"axis": 1, "exclusive": False,
                                                "reverse": False}),
    "CumSum2": lambda: ([normal((8, 4), 6)], {"axis": 0, "exclusive": True, "reverse": True}),
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), devices=st.sampled_from([1, 2, 4, 8, 16, 6]))
def test_sort_rules_match_the_oracle(case: str, data: Any, devices: int) -> None:
    """Every output (the indices too) and the input's gradient, on every simulated rank,
    gathered by the rule's layouts, equal the unsharded op's (float64, the oracle's bound)."""
    op = case.rstrip("0123456789")
    arrays, attrs = RULE_CASES[case]()
    strategy = draw_strategy(data.draw, op, arrays, attrs, devices)
    run_sharded(op, arrays, attrs, strategy, devices)


@pytest.mark.parametrize("op,attrs,strategy,role", [
    ("TopK", {"k": 2}, ((2, 4),), "the sorted last axis"),
    ("Sort", {"axis": 0}, ((2, 1),), "the sorted axis"),
    ("CumSum", {"axis": -1}, ((1, 8),), "the summed axis; a split would need the totals"),
])
def test_sorted_axis_split_is_refused_with_one_message(op: str, attrs: dict[str, Any],
                                                       strategy: Any, role: str) -> None:
    graph, _ = case_graph(op, [normal((8, 8), 0)], attrs, strategy)
    with pytest.raises(OpError) as info:
        assign(graph, 8, "full_batch")
    text = str(info.value)
    for part in (op, role, "use 1 for that dim", str(strategy), "(8, 8)"):
        assert part in text, (part, text)


# -- a router split on its batch dim, compiled for 8 devices ---------------------------------

HEADER = """\
import numpy as np
from pcompile import nn, ops, Parameter, set_auto_parallel_context
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
"""

ROUTER_MODEL = """
DP, TOKENS, HIDDEN, EXPERTS, K = 8, 16, 8, 4, 2


class Router(nn.Cell):
    def __init__(self, dp=DP, cumsum_axis=0):
        super().__init__()
        r = np.random.default_rng(3)
        self.w = Parameter(r.standard_normal((HIDDEN, EXPERTS)).astype(np.float32), "w")
        self.matmul = ops.MatMul().shard(((dp, 1), (1, 1)))
        self.softmax = ops.Softmax().shard(((dp, 1),))
        self.topk = ops.TopK().shard(((dp, 1),))
        self.cumsum = ops.CumSum(exclusive=True).shard(((dp, 1),))
        self.cumsum_axis = cumsum_axis
        self.zeros = ops.Zeros()
        self.add = ops.Add().shard(((dp, 1), (dp, 1)))
        self.mul = ops.Mul().shard(((dp, 1), (dp, 1)))

    def construct(self, x):
        probs = self.softmax(self.matmul(x, self.w))
        gates, expert = self.topk(probs, K)
        gates = self.add(gates, self.zeros((TOKENS, K), gates.dtype))
        positions = self.cumsum(gates, self.cumsum_axis)
        return self.mul(gates, positions)

def model():
    return Router()

def inputs():
    return (np.random.default_rng(0).standard_normal((TOKENS, HIDDEN)).astype(np.float32),)

def labels():
    return (np.random.default_rng(1).standard_normal((TOKENS, K)).astype(np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def _compile(tmp_path: Any, body: str) -> Any:
    path = tmp_path / "router.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return compile_model(str(path), dump=False)


def test_top_k_and_cumsum_on_a_batch_split_compile_like_one_device(tmp_path: Any) -> None:
    """TopK split on the tokens; CumSum over the K axis split on the tokens (its summed axis
    whole): a training step on 8 devices gives the single-device loss, gradients and
    parameters, and each rank holds TOKENS / 8 rows."""
    program = _compile(tmp_path, ROUTER_MODEL.replace("cumsum_axis=0", "cumsum_axis=1"))
    graph = program.rank_graph(3)
    topk = next(n for n in graph.nodes if n.op == "TopK")
    assert topk.parallel.in_strategy == ((8, 1),)
    assert [e.shape for e in topk.result.type.elements] == [(2, 2), (2, 2)]
    assert "Zeros" not in [n.op for n in graph.nodes]  # a constant, not a node
    report = check(program, steps=2)
    assert report.ok(), report.errors


def test_cumsum_split_on_its_summed_axis_is_refused_by_the_compiler(tmp_path: Any) -> None:
    with pytest.raises(PcompileError, match=r"(?s)CumSum.*summed axis.*\(\(8, 1\),\)"):
        _compile(tmp_path, ROUTER_MODEL)


# -- Zeros and Ones -------------------------------------------------------------------------


def test_zeros_and_ones_are_constants_of_the_given_dtype() -> None:
    z = ops.Zeros()((2, 3), np.float16)
    o = ops.Ones()(4, DType.int32)
    assert z.asnumpy().dtype == np.float16 and z.shape == (2, 3) and not z.asnumpy().any()
    assert o.asnumpy().dtype == np.int32 and o.shape == (4,) and (o.asnumpy() == 1).all()
    assert ops.Ones()([2]).asnumpy().dtype == np.float32  # MindSpore's default type
    with pytest.raises(TypeError, match="Zeros: size must be an int or a tuple"):
        ops.Zeros()("3", np.float32)
    with pytest.raises(ValueError, match="negative"):
        ops.Ones()((2, -1), np.float32)


# -- dimension relations (the shrunk check) -------------------------------------------------


def test_shrunk_router_keeps_k_and_shrinks_the_tokens() -> None:
    """TopK's last axis and k stay (k must stay at most the axis); the tokens, Sort's and
    CumSum's dims shrink with the input; the shrunk graph verifies."""
    from pcompile.ir import dims
    from pcompile.ir.verifier import verify

    g = Graph("router")
    x = g.add_param(GraphParam(TensorType(DType.float32, (16, 4)), "x"))
    b = Builder(g)
    values = b("TupleGetItem", b("TopK", x, k=2), index=0)
    order = b("TupleGetItem", b("Sort", x, axis=0), index=1)
    g.outputs = [b("CumSum", values, axis=0), order]
    verify(g)
    dims.shrink_graph(g, [], 4).apply(g)
    verify(g)
    assert g.param("x").shape == (4, 4)
    assert values.shape == (4, 2) and order.shape == (4, 4)
