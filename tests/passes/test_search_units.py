"""Unit tests of the search's parts: candidate order, cost formulas, reshape layouts, the
propagation tie-break, the elimination rules and recursive programming's schedule."""

from __future__ import annotations

import pytest

from pcompile.compiler.config.pass_options import search_options
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.sharding import OpContext
from pcompile.ir.types import DType, TensorType
from pcompile.passes.reshape_layout import dim_map, map_layout
from pcompile.passes.search import SearchOptions, search
from pcompile.passes.search.candidates import candidate_strategies, enumerate_splits
from pcompile.passes.search.cost_graph import CostGraph
from pcompile.passes.search.cost_model import (
    Cost,
    CostConstants,
    breaking_ties,
    op_cost,
    practical,
    redistribution_cost,
    refine_op,
)
from pcompile.passes.search.dynamic_programming import solve
from pcompile.passes.search.recursive_programming import build_ops, check_devices, matmul_costs

F32 = DType.float32


def ctx(op: str, shapes: list[tuple[int, ...]], out: tuple[int, ...], devices: int,
        **attrs) -> OpContext:
    return OpContext(op, [TensorType(F32, s) for s in shapes], TensorType(F32, out), attrs,
                     devices)


# -- candidates -----------------------------------------------------------------------------------


def test_matmul_candidates_enumerate_the_virtual_tensor_i_k_j() -> None:
    c = ctx("MatMul", [(16, 32), (32, 16)], (16, 16), 8)
    got = [s.strategy for s in candidate_strategies(c)]
    assert got[:6] == [((1, 1), (1, 1)), ((1, 1), (1, 2)), ((1, 1), (1, 4)), ((1, 1), (1, 8)),
                       ((1, 2), (2, 1)), ((1, 2), (2, 2))]
    assert got[-1] == ((8, 1), (1, 1)) and len(got) == 20
    transposed = ctx("MatMul", [(32, 16), (32, 16)], (16, 16), 8, transpose_a=True)
    first = [s.strategy for s in candidate_strategies(transposed)][:3]
    assert first == [((1, 1), (1, 1)), ((1, 1), (1, 2)), ((1, 1), (1, 4))]  # j fastest


def test_fully_use_devices_and_unsplittable_labels() -> None:
    c = ctx("MatMul", [(16, 32), (32, 16)], (16, 16), 8)
    full = [s.strategy for s in candidate_strategies(c, True)]
    assert {a[0] * a[1] * b[1] for a, b in full} == {1, 8}  # i * k * j
    assert len(full) == 11
    soft = ctx("Softmax", [(8, 8)], (8, 8), 4, axis=(-1,))
    assert all(s.strategy[0][1] == 1 for s in candidate_strategies(soft))


def test_odd_device_factor_goes_on_one_dim() -> None:
    from pcompile.ir.sharding import LabelDim

    dims = [LabelDim("a", 12, True), LabelDim("b", 4, True)]
    assert enumerate_splits(dims, 6) == [(3, 1), (3, 2), (6, 1)]
    relu = ctx("ReLU", [(12, 4)], (12, 4), 6)
    assert [s.strategy for s in candidate_strategies(relu)] == [((3, 1),), ((3, 2),), ((6, 1),)]


def test_gather_candidates_are_valid() -> None:
    c = OpContext("Gather", [TensorType(F32, (8, 4)), TensorType(DType.int32, (4, 2))],
                  TensorType(F32, (4, 2, 4)), {"axis": 0}, 4)
    from pcompile.ir.ops.shape import shard_batch_and_axis

    got = [s.strategy for s in candidate_strategies(c)]
    for strategy in got:
        table, idx = strategy
        assert table[0] == 1 or all(x == 1 for x in idx) or shard_batch_and_axis(c, strategy)
    assert ((2, 1), (2, 1)) in got  # MindSpore's shard-batch-and-axis mode is a candidate


# -- cost formulas --------------------------------------------------------------------------------


def test_practical_latency_model() -> None:
    c = CostConstants()
    assert practical(0.0, c) == 0.0
    assert practical(100.0, c) == 3072.0
    assert practical(2048.0, c) == 3072.0
    assert practical(5000.0, c) == 6024.0


def test_breaking_ties_and_refine() -> None:
    cost = Cost(100.0, 10.0, 8.0, 8.5, 0.0)
    assert breaking_ties(cost, ((8, 1),), 8) == Cost(99.0, 9.0, 7.0, 7.5, 0.0)
    assert breaking_ties(cost, ((4, 1),), 8) == cost
    refined = refine_op(Cost(0.0, 600.0, 100.0, 100.5, 0.0), CostConstants())
    assert refined.comm_forward == 3072.0
    assert refined.communication == 3072.0 + 500.0
    assert refined.comm_partial == pytest.approx(3072.0 + 0.5)


def test_matmul_op_cost_of_the_quickstart_strategy() -> None:
    from pcompile.ir.sharding import rule_for

    c = ctx("MatMul", [(16, 32), (32, 16)], (16, 16), 8)
    sharding = rule_for("MatMul").apply(c, ((2, 4), (4, 1)))
    cost = op_cost("MatMul", sharding, c.in_types, c.out_types[0], (False, True),
                   (False, True), 8, CostConstants())
    # x slice 8x8, w slice 8x16, output 8x16 (k is split), float32
    assert cost.computation == (64 + 128 + 128) * 4
    assert cost.comm_forward == 3072.0  # AllReduce of 512 bytes -> latency model
    assert cost.communication == 3072.0 + 512.0  # w is split 4 ways of 8: gradient AllReduce
    assert cost.comm_partial == pytest.approx(3072.0 + 0.001 * 512.0)


def test_redistribution_cost_of_a_gather() -> None:
    src = TensorLayout((8,), (0, -1), (128, 32))
    dst = TensorLayout((8,), (-1, -1), (128, 32))
    cost = redistribution_cost(src, dst, 4, False, CostConstants())
    # AllConcat of a 16x32 slice over 8 ranks: fwd 512*8*0.5, bwd 512*0.5 elements
    assert cost.comm_forward == 8192.0 + 1024.0
    assert cost.communication == 8192.0 + 1024.0 + 3072.0
    assert cost.computation == 512 * 4
    assert redistribution_cost(src, src, 4, False, CostConstants()) == Cost()
    assert redistribution_cost(src, dst, 1, True, CostConstants()).communication == float("inf")


# -- reshape layouts ------------------------------------------------------------------------------


def test_layouts_through_reshapes() -> None:
    rows = TensorLayout((8,), (0, -1), (128, 32))
    assert map_layout(rows, (8, 16, 32)) == TensorLayout((8,), (0, -1, -1), (8, 16, 32))
    both = TensorLayout((2, 4), (1, 0), (128, 32))
    assert map_layout(both, (8, 16, 4, 8)) == TensorLayout((2, 4), (1, -1, 0, -1),
                                                           (8, 16, 4, 8))
    assert map_layout(TensorLayout((2, 4), (1, 0, -1), (8, 16, 32)), (128, 32)) is None
    merged = map_layout(TensorLayout((2, 4), (1, 0), (2, 16)), (32,))
    assert merged is not None and merged.tensor_map == ((1, 0),)
    assert dim_map((8, 16, 4, 8), (8, 16, 32)) == {0: 0, 1: 1, 2: 2}


# -- algorithms on small graphs -------------------------------------------------------------------


def chain(ops: list[str], shape: tuple[int, int] = (8, 8)) -> Graph:
    graph = Graph("chain")
    x = graph.add_param(GraphParam(TensorType(F32, shape), "x"))
    b = Builder(graph)
    value = x
    for i, op in enumerate(ops):
        if op == "MatMul":
            w = graph.add_param(GraphParam(TensorType(F32, (value.shape[1], shape[1])),
                                           f"w{i}", "weight", True))
            value = b.emit("MatMul", [value, w], instance_name=f"mm{i}")
        else:
            value = b.emit(op, [value], instance_name=f"{op.lower()}{i}")
    graph.outputs = [value]
    return graph


def test_dynamic_programming_uses_op_eliminations_on_a_chain() -> None:
    graph = chain(["MatMul", "ReLU", "MatMul", "ReLU", "MatMul"])
    cg = CostGraph(graph, 4, CostConstants(), "data_parallel")
    result = solve(cg, SearchOptions())
    rules = [r for _, r in result.eliminations]
    assert "op" in rules and result.objective == cg.total(result.choice)


def test_propagation_prefers_larger_splits_on_ties() -> None:
    graph = chain(["ReLU"], (8, 8))
    result = search(graph, 4, "sharding_propagation", dataset_strategy="full_batch")
    # from a replicated input every candidate slices locally without communication; the
    # cheapest computation is no split at all
    relu = graph.nodes[0]
    assert result.strategies[relu] == ((1, 1),)
    graph = chain(["ReLU"], (8, 8))
    result = search(graph, 4, "sharding_propagation", dataset_strategy="data_parallel")
    assert result.strategies[graph.nodes[0]] == ((4, 1),)


def test_explanation_names_cost_and_runner_up() -> None:
    graph = chain(["MatMul", "ReLU"])
    result = search(graph, 4, "dynamic_programming", dataset_strategy="data_parallel")
    info = result.explain[graph.nodes[0]]
    assert info["strategy"] == result.strategies[graph.nodes[0]]
    assert info["runner_up"]["local_objective"] >= info["local_objective"]
    assert set(info["cost"]) >= {"computation", "communication", "comm_partial", "objective"}


def test_recursive_programming_matmul_costs_and_device_check() -> None:
    graph = chain(["MatMul"], (128, 32))
    cg = CostGraph(graph, 8, CostConstants(), "full_batch")
    (op,) = [o for o in build_ops(cg, False) if o.kind == "matmul"]
    costs = matmul_costs(op, 0.1)
    i, j, k = op.ijk
    assert costs[i] == pytest.approx(32 * 32 / 2 * 0.1)
    assert costs[j] == 128 * 32 / 2 and costs[k] == 128 * 32 / 2
    assert costs[None] == pytest.approx(min(costs[i], costs[j], costs[k]) ** 2 / 25)
    op.splits[j] = 2
    assert k not in matmul_costs(op, 0.1)  # J and K are never both cut
    with pytest.raises(PcompileError, match="requires the device num be the power of 2"):
        check_devices(6)


def test_interfered_sapp_fixes_user_strategies() -> None:
    graph = chain(["MatMul", "ReLU"], (16, 16))
    graph.nodes[0].attrs["in_strategy"] = ((2, 4), (4, 1))
    cg = CostGraph(graph, 8, CostConstants(), "full_batch")
    fixed = [o for o in build_ops(cg, True) if o.kind == "fixed" and o.vertex == 0]
    assert fixed and [x is not None for x in fixed[0].schedule] == [True, True, True]
    assert [o.kind for o in build_ops(cg, False) if o.vertex == 0] == ["matmul"]


def test_search_options_read_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("MS_INTERFERED_SAPP", "1")
    assert search_options().interfered_sapp
    monkeypatch.setenv("MS_INTERFERED_SAPP", "0")
    assert not search_options().interfered_sapp
