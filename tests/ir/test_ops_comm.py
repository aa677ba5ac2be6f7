"""Communication primitives: shape inference, attrs, the collectives their vjps emit, and
single-rank execution (identity) in the numpy interpreter and the JAX lowering."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Node, Value
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.registry import get_op
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)
GROUP = {"group": "4-6301172352641561019", "rank_list": (0, 1, 2, 3), "fusion": 3}
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast")


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _graph(shape: tuple[int, ...]) -> tuple[Graph, GraphParam, Builder]:
    graph = Graph("comm")
    x = graph.add_param(GraphParam(TensorType(DType.float32, shape), "x", "weight", True))
    return graph, x, Builder(graph)


def _backward(op: str, shape: tuple[int, ...], attrs: dict[str, Any]) -> tuple[Graph, Value]:
    """Forward `op` on x, then the vjp for a random cotangent; returns the graph and dx."""
    graph, x, b = _graph(shape)
    y = b.emit(op, [x], attrs)
    seed = Constant(_rand(y.shape, 0), DType.float32)
    (dx,) = append_gradients(graph, [y], [x], [seed])
    graph.outputs = [y, dx]
    return graph, dx


def _backward_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.scope.startswith("Gradients/")]


def _identity_with_grad_scale(scale: float) -> Any:
    """Forward identity whose vjp multiplies by `scale` (what a virtual op does on one rank)."""
    return lambda x: x * scale + lax.stop_gradient(x - x * scale)


# -- registry -------------------------------------------------------------------------------


def test_collective_registry_entries() -> None:
    for name in COLLECTIVES:
        op = get_op(name)
        assert op.collective and op.numpy is None and op.jax is None, name
        for key, default in (("group", ""), ("rank_list", (0,)), ("fusion", 0)):
            assert op.attrs[key] == default, (name, key)
    assert get_op("AllReduce").attrs["op"] == "sum"
    assert get_op("AllGather").attrs["mean_flag"] is False
    assert get_op("ReduceScatter").attrs["op"] == "sum"
    assert get_op("Broadcast").attrs["root_rank"] == 0
    mirror = get_op("_MirrorOperator")
    assert not mirror.collective and mirror.numpy is not None and mirror.jax is not None
    assert {"group", "rank_list", "dev_num", "mean_flag", "fusion", "parameter"} <= set(
        mirror.attrs
    )
    assert get_op("_VirtualDiv").attrs == {"divisor": 1}


# -- shape inference ------------------------------------------------------------------------


def _infer(name: str, shape: tuple[int, ...], /, **attrs: Any) -> tuple[int, ...]:
    _, x, b = _graph(shape)
    return b.emit(name, [x], attrs).shape


def test_shape_inference() -> None:
    assert _infer("AllReduce", (3, 5), op="max", **GROUP) == (3, 5)
    assert _infer("AllGather", (3, 5), **GROUP) == (12, 5)
    assert _infer("ReduceScatter", (8, 5), **GROUP) == (2, 5)
    assert _infer("AlltoAll", (8, 6), split_count=4, split_dim=0, concat_dim=1, **GROUP) == (
        2,
        24,
    )
    assert _infer("AlltoAll", (3, 8), split_count=4, split_dim=-1, concat_dim=-1, **GROUP) == (
        3,
        8,
    )
    assert _infer("Broadcast", (2, 2), root_rank=1, **GROUP) == (2, 2)
    assert _infer("_MirrorOperator", (4,), dev_num=4, mean_flag=True, parameter="w", **GROUP) == (
        4,
    )
    assert _infer("_VirtualDiv", (), divisor=8) == ()


@settings(max_examples=20, deadline=None)
@given(SHAPES, st.integers(1, 4))
def test_gather_scatter_shapes(shape: tuple[int, ...], n: int) -> None:
    ranks = tuple(range(n))
    gathered = _infer("AllGather", shape, rank_list=ranks)
    assert gathered == (shape[0] * n,) + shape[1:]
    assert _infer("ReduceScatter", gathered, rank_list=ranks) == shape


def _raises(name: str, shape: tuple[int, ...], needle: str, /, **attrs: Any) -> None:
    with pytest.raises(OpError) as info:
        _infer(name, shape, **attrs)
    assert needle in str(info.value) and name in str(info.value), str(info.value)


def test_invalid_attrs_and_shapes() -> None:
    _raises("ReduceScatter", (6, 2), "divisible by the group size 4", **GROUP)
    _raises("ReduceScatter", (), "rank >= 1", **GROUP)
    _raises("AllGather", (), "rank >= 1", **GROUP)
    _raises("AllReduce", (2,), "op must be one of", op="mean")
    _raises("AllReduce", (2,), "rank_list", rank_list=[0, 1])
    _raises("AllReduce", (2,), "twice", rank_list=(0, 0))
    _raises("AllReduce", (2,), "fusion", fusion=-1)
    _raises("AllGather", (2,), "mean_flag", mean_flag=1)
    _raises("AlltoAll", (8, 2), "split_count 2 must equal the group size 4", split_count=2, **GROUP)
    _raises("AlltoAll", (6, 2), "divisible by split_count", split_count=4, **GROUP)
    _raises("AlltoAll", (8, 2), "concat_dim", split_count=4, concat_dim=2, **GROUP)
    _raises("_MirrorOperator", (2,), "dev_num", dev_num=0)
    _raises("_VirtualDiv", (2,), "divisor", divisor=0)
    with pytest.raises(OpError, match="no attribute"):
        _infer("AllReduce", (2,), root_rank=0)


# -- vjp rules: which collective, with which attrs -----------------------------------------


def _only(graph: Graph, op: str) -> Node:
    nodes = [n for n in _backward_nodes(graph) if n.op == op]
    assert len(nodes) == 1, [n.op for n in _backward_nodes(graph)]
    return nodes[0]


def _assert_group_copied(node: Node) -> None:
    for key, value in GROUP.items():
        assert node.attrs[key] == value, (node.op, key, node.attrs[key])


def test_all_reduce_sum_vjp_is_all_reduce_sum() -> None:
    graph, dx = _backward("AllReduce", (4, 3), {"op": "sum", **GROUP})
    node = _only(graph, "AllReduce")
    _assert_group_copied(node)
    assert node.attrs["op"] == "sum"
    assert [n.op for n in _backward_nodes(graph)] == ["AllReduce"]
    assert dx is node.result


@pytest.mark.parametrize("op", ["max", "min"])
def test_all_reduce_max_min_vjp_masks_summed_cotangent(op: str) -> None:
    graph, _ = _backward("AllReduce", (4, 3), {"op": op, **GROUP})
    node = _only(graph, "AllReduce")
    _assert_group_copied(node)
    assert node.attrs["op"] == "sum"
    assert [n.op for n in _backward_nodes(graph)] == ["AllReduce", "Equal", "Cast", "Mul"]


def test_all_reduce_prod_is_not_differentiable() -> None:
    with pytest.raises(PcompileError, match="no gradient rule"):
        _backward("AllReduce", (4,), {"op": "prod"})


@pytest.mark.parametrize("mean_flag", [False, True])
def test_all_gather_vjp_is_reduce_scatter(mean_flag: bool) -> None:
    graph, dx = _backward("AllGather", (2, 3), {"mean_flag": mean_flag, **GROUP})
    node = _only(graph, "ReduceScatter")
    _assert_group_copied(node)
    assert node.attrs["op"] == "sum"
    assert dx.shape == (2, 3)
    ops = [n.op for n in _backward_nodes(graph)]
    if mean_flag:
        assert ops == ["ReduceScatter", "Mul"]
        scale = dx.node.operands[1]  # type: ignore[attr-defined]
        assert isinstance(scale, Constant) and float(scale.array) == pytest.approx(0.25)
    else:
        assert ops == ["ReduceScatter"]


def test_reduce_scatter_vjp_is_all_gather() -> None:
    graph, dx = _backward("ReduceScatter", (8, 3), dict(GROUP))
    node = _only(graph, "AllGather")
    _assert_group_copied(node)
    assert node.attrs["mean_flag"] is False
    assert dx.shape == (8, 3)
    with pytest.raises(PcompileError, match="no gradient rule"):
        _backward("ReduceScatter", (8, 3), {"op": "max", **GROUP})


def test_all_to_all_vjp_swaps_dims() -> None:
    attrs = {"split_count": 4, "split_dim": 0, "concat_dim": 1, **GROUP}
    graph, dx = _backward("AlltoAll", (8, 6), attrs)
    node = _only(graph, "AlltoAll")
    _assert_group_copied(node)
    assert (node.attrs["split_dim"], node.attrs["concat_dim"]) == (1, 0)
    assert node.attrs["split_count"] == 4
    assert node.operands[0].shape == (2, 24) and dx.shape == (8, 6)


def test_broadcast_is_not_differentiable() -> None:
    with pytest.raises(PcompileError, match="cannot be differentiated"):
        _backward("Broadcast", (2,), {"root_rank": 0})


@pytest.mark.parametrize("mean_flag", [False, True])
def test_mirror_vjp_is_all_reduce(mean_flag: bool) -> None:
    attrs = {"dev_num": 4, "mean_flag": mean_flag, "parameter": "w", **GROUP}
    graph, dx = _backward("_MirrorOperator", (3, 2), attrs)
    node = _only(graph, "AllReduce")
    _assert_group_copied(node)
    assert node.attrs["op"] == "sum"
    ops = [n.op for n in _backward_nodes(graph)]
    assert ops == (["AllReduce", "Mul"] if mean_flag else ["AllReduce"])
    if mean_flag:
        scale = dx.node.operands[1]  # type: ignore[attr-defined]
        assert float(scale.array) == pytest.approx(0.25)


def test_virtual_div_vjp_divides() -> None:
    graph, dx = _backward("_VirtualDiv", (3,), {"divisor": 8})
    assert [n.op for n in _backward_nodes(graph)] == ["RealDiv"]
    divisor = dx.node.operands[1]  # type: ignore[attr-defined]
    assert float(divisor.array) == 8.0


# -- single-rank execution (numpy interpreter and JAX lowering) ----------------------------


@settings(max_examples=8, deadline=None)
@given(SHAPES, SEEDS)
def test_single_rank_collectives_are_identity(shape: tuple[int, ...], seed: int) -> None:
    x = _rand(shape, seed)
    one = {"rank_list": (0,), "group": "g0", "fusion": 1}
    for op in ("sum", "max", "min"):
        check_op("AllReduce", [x], {"op": op, **one}, lambda x: x)
    check_op("AllGather", [x], one, lambda x: x)
    check_op("AllGather", [x], {"mean_flag": True, **one}, lambda x: x)
    check_op("ReduceScatter", [x], one, lambda x: x)
    check_op(
        "AlltoAll", [x], {"split_count": 1, "split_dim": -1, "concat_dim": 0, **one}, lambda x: x
    )
    check_op("Broadcast", [x], one, lambda x: x, grad=False)


@settings(max_examples=6, deadline=None)
@given(SHAPES, st.integers(1, 8), st.booleans(), SEEDS)
def test_virtual_ops_single_rank(shape: tuple[int, ...], k: int, mean: bool, seed: int) -> None:
    x = _rand(shape, seed)
    attrs = {"rank_list": (0,), "dev_num": k, "mean_flag": mean, "parameter": "w"}
    check_op("_MirrorOperator", [x], attrs, _identity_with_grad_scale(1.0 / k if mean else 1.0))
    check_op("_VirtualDiv", [x], {"divisor": k}, _identity_with_grad_scale(1.0 / k))


def test_multi_rank_collective_refuses_single_rank_run() -> None:
    graph, x, b = _graph((4,))
    graph.outputs = [b("AllGather", x, rank_list=(0, 1))]
    with pytest.raises(RuntimeError, match="multi-rank"):
        run_graph(graph, [np.zeros(4, np.float32)])
