"""LpNorm and Abs against JAX written directly: random shapes, axes (negative, () = all),
keep_dims and orders p, forward values and gradients (tests/op_harness.py); MindSpore's
documented example; the epsilon floor and its zero gradient; a split normalised dim (partial
sums all-reduced, then the root) against the unsharded op; the errors bad attributes raise."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from tests.ir.test_parallel_ops import run_sharded
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
SHAPES = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)
SOME = settings(max_examples=8, deadline=None)  # each example jits a new shape (~1 s)


def reference(axis: tuple[int, ...], p: int, keep: bool, eps: float = 1e-12) -> Any:
    ax = None if axis == () else axis
    return lambda x: jnp.maximum(jnp.sum(jnp.abs(x) ** p, axis=ax, keepdims=keep) ** (1.0 / p),
                                 eps)


@st.composite
def norm_attrs(draw: st.DrawFn, rank: int) -> dict[str, Any]:
    axes = draw(st.lists(st.integers(0, rank - 1), unique=True, max_size=rank))
    signed = tuple(a - rank if draw(st.booleans()) else a for a in axes)
    return {"axis": signed, "p": draw(st.sampled_from([1, 2, 3, 4])),
            "keep_dims": draw(st.booleans())}


@SOME
@given(st.data(), SHAPES, SEEDS)
def test_lp_norm(data: st.DataObject, shape: tuple[int, ...], seed: int) -> None:
    attrs = data.draw(norm_attrs(len(shape)))
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_op("LpNorm", [x], attrs, reference(attrs["axis"], attrs["p"], attrs["keep_dims"]),
             seed=seed)


@settings(max_examples=5, deadline=None)
@given(st.sampled_from([np.float16, ml_dtypes.bfloat16]), st.data(), SHAPES, SEEDS)
def test_lp_norm_low_precision(dtype: Any, data: st.DataObject, shape: tuple[int, ...],
                               seed: int) -> None:
    attrs = data.draw(norm_attrs(len(shape)))
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    ref = reference(attrs["axis"], attrs["p"], attrs["keep_dims"])
    # The op computes in (at least) float32 and rounds the result to the input's dtype.
    wide = lambda x: jnp.promote_types(x.dtype, jnp.float32)  # noqa: E731
    check_op("LpNorm", [x], attrs, lambda x: ref(x.astype(wide(x))).astype(x.dtype), seed=seed)


def test_lp_norm_mindspore_example() -> None:
    """MindSpore's documented example: LpNorm(axis=[0, 1], p=2) of 1..8 as (2, 2, 2)."""
    x = np.arange(1.0, 9.0, dtype=np.float32).reshape(2, 2, 2)
    got = _run("LpNorm", x, {"axis": (0, 1), "p": 2})
    np.testing.assert_allclose(got, [9.165152, 10.954452], rtol=2 * np.finfo(np.float32).eps)


def test_lp_norm_epsilon_floor_has_no_gradient() -> None:
    """A norm below epsilon is replaced by epsilon, and nothing flows back through it; an
    all-zero row gives a zero gradient (not NaN)."""
    x = np.array([[0.0, 0.0, 0.0], [1e-4, -2e-4, 2e-4], [3.0, -4.0, 0.0]], np.float32)
    graph = Graph("floor")
    param = graph.add_param(GraphParam(TensorType(DType.float32, x.shape), "x", "weight", True))
    b = Builder(graph)
    out = b.emit("LpNorm", [param], {"axis": (1,), "p": 2, "epsilon": 1e-3})
    loss = b("ReduceSum", b("Mul", out, Constant(np.array([1.0, 2.0, 3.0], np.float32),
                                                  DType.float32)), axis=())
    graph.outputs = [out, *append_gradients(graph, loss, [param])]
    norm, grad = run_graph(graph, [x])
    np.testing.assert_allclose(norm, [1e-3, 1e-3, 5.0], rtol=1e-6)
    np.testing.assert_array_equal(grad[:2], 0.0)
    np.testing.assert_allclose(grad[2], 3.0 * x[2] / 5.0, rtol=1e-6)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("strategy, devices", [(((2, 4, 1),), 8), (((1, 2, 2),), 4),
                                                (((4, 1, 1),), 8)])
def test_lp_norm_split_normalised_dims(p: int, strategy: Any, devices: int) -> None:
    """Normalised dims split: partial sums of |x|**p all-reduced, then the root; loss, output
    and gradient equal the unsharded op's (float64, the oracle's bound). One row is zero, so
    the zero-norm branch is taken too."""
    x = np.random.default_rng(p).standard_normal((4, 8, 2)).astype(np.float32)
    x[:, :, 1] = 0.0
    run_sharded("LpNorm", [x], {"axis": (0, 1), "p": p}, strategy, devices)


def test_lp_norm_split_emits_partial_sum_and_all_reduce() -> None:
    from pcompile.passes.step_parallel import SplitOptions, build_rank_graphs
    from pcompile.passes.step_parallel_begin import assign
    from tests.ir.test_parallel_ops import case_graph

    x = np.ones((4, 8, 2), np.float32)
    graph, _ = case_graph("LpNorm", [x], {"axis": (0, 1), "p": 3}, ((2, 4, 1),))
    assignment = assign(graph, 8, "full_batch")
    ranks, _ = build_rank_graphs(graph, assignment, SplitOptions(8, False), {})
    ops = [n.op for n in ranks[0].nodes]
    assert "LpNorm" not in ops
    start = ops.index("Abs")
    assert ops[start:start + 4] == ["Abs", "Pow", "ReduceSum", "AllReduce"]
    reduce = ranks[0].nodes[start + 3]
    assert len(reduce.attrs["rank_list"].at(0)) == 8 and reduce.attrs["op"] == "sum"


@SOME
@given(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4), SEEDS)
def test_abs(shape: tuple[int, ...], seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_op("Abs", [x], {}, jnp.abs, seed=seed)


def test_abs_gradient_is_sign() -> None:
    """d|x|/dx = sign(x), 0 at 0 (MindSpore's AbsGrad, TF and PyTorch; JAX gives 1 there)."""
    x = np.array([-2.0, 0.0, 3.0], np.float32)
    graph = Graph("abs")
    param = graph.add_param(GraphParam(TensorType(DType.float32, x.shape), "x", "weight", True))
    b = Builder(graph)
    loss = b("ReduceSum", b.emit("Abs", [param]), axis=())
    graph.outputs = append_gradients(graph, loss, [param])
    np.testing.assert_array_equal(run_graph(graph, [x])[0], [-1.0, 0.0, 1.0])


def _run(op: str, x: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    graph = Graph(op)
    param = graph.add_param(GraphParam(TensorType(DType.from_any(x.dtype), x.shape), "x"))
    graph.outputs = [Builder(graph).emit(op, [param], attrs)]
    return run_graph(graph, [x])[0]


@pytest.mark.parametrize("attrs, dtype, message", [
    ({"axis": (0,), "p": 0}, DType.float32, "p must be an int >= 1"),
    ({"axis": (0,), "p": 2.5}, DType.float32, "p must be an int >= 1"),
    ({"axis": (3,), "p": 2}, DType.float32, "axis 3 is out of range for rank 2"),
    ({"axis": (0,), "epsilon": -1.0}, DType.float32, "epsilon must be a float >= 0"),
    ({"axis": (0,)}, DType.int32, "x must be a floating-point tensor, got Int32"),
])
def test_lp_norm_errors(attrs: dict[str, Any], dtype: DType, message: str) -> None:
    graph = Graph("errors")
    x = graph.add_param(GraphParam(TensorType(dtype, (2, 3)), "x"))
    with pytest.raises(OpError, match=message):
        Builder(graph).emit("LpNorm", [x], attrs)


@SOME
@given(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4), SEEDS)
def test_erf(shape: tuple[int, ...], seed: int) -> None:
    import jax

    x = 2 * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    check_op("Erf", [x], {}, jax.lax.erf, seed=seed)
