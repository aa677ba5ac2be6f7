"""The searches on random small graphs (hypothesis): dynamic programming equals brute-force
enumeration of the cost model; sharding propagation and recursive programming always return a
plan that step_parallel_begin accepts and that computes what the single-device graph computes."""

from __future__ import annotations

import itertools
from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.backends.numpy.simulate import run_ranks
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Value
from pcompile.ir.types import DType, TensorType
from pcompile.passes.search import SearchOptions, search
from pcompile.passes.search.cost_graph import CostGraph
from pcompile.passes.search.cost_model import CostConstants
from pcompile.passes.search.dynamic_programming import solve
from pcompile.passes.search.explain import swc_key
from pcompile.passes.step_parallel import SplitOptions, build_rank_graphs
from pcompile.passes.step_parallel_begin import assign
from pcompile.tools.oracle import FLOAT64_RTOL

F32 = DType.float32
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def random_graphs(draw: st.DrawFn, max_ops: int = 8, dims: tuple[int, ...] = (2, 4, 8)
                  ) -> Graph:
    """A forward graph of 1..max_ops ops over 2-D tensors: MatMul with fresh or shared weights,
    ReLU, Add, Transpose, Mul by a constant, Reshape, ReduceSum; a few outputs."""
    graph = Graph("random")
    x = graph.add_param(GraphParam(TensorType(F32, (draw(st.sampled_from(dims)),
                                                    draw(st.sampled_from(dims)))), "x"))
    values: list[Value] = [x]
    weights: list[GraphParam] = []
    b = Builder(graph)
    for k in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["matmul", "matmul", "shared", "relu", "add", "transpose",
                                     "scale", "reshape", "reduce"]))
        v = draw(st.sampled_from(values))
        rows, cols = v.shape
        if kind == "shared":
            fits = [w for w in weights if w.shape[0] == cols]
            if not fits:
                kind = "matmul"
            else:
                values.append(b.emit("MatMul", [v, draw(st.sampled_from(fits))],
                                     instance_name=f"mm{k}"))
                continue
        if kind == "matmul":
            w = graph.add_param(GraphParam(TensorType(F32, (cols, draw(st.sampled_from(dims)))),
                                           f"w{k}", "weight", True))
            weights.append(w)
            values.append(b.emit("MatMul", [v, w], instance_name=f"mm{k}"))
        elif kind == "relu":
            values.append(b.emit("ReLU", [v], instance_name=f"relu{k}"))
        elif kind == "add":
            same = [u for u in values if u.shape == v.shape]
            values.append(b.emit("Add", [v, draw(st.sampled_from(same))],
                                 instance_name=f"add{k}"))
        elif kind == "transpose":
            values.append(b.emit("Transpose", [v], {"perm": (1, 0)}, instance_name=f"t{k}"))
        elif kind == "scale":
            values.append(b.emit("Mul", [v, b.const(0.5)], instance_name=f"mul{k}"))
        elif kind == "reshape" and rows % 2 == 0:
            values.append(b.emit("Reshape", [v], {"shape": (rows // 2, cols * 2)}))
        elif kind == "reduce":
            values.append(b.emit("ReduceSum", [v], {"axis": (1,), "keep_dims": True},
                                 instance_name=f"sum{k}"))
    produced = [u for u in values[1:]]
    assume(any(n.op != "Reshape" for n in graph.nodes))
    graph.outputs = produced[-2:] if len(produced) > 1 else produced
    return graph


def brute_force(cg: CostGraph) -> float:
    """Minimum of the objective over every assignment, vectorised over the assignments."""
    sizes = [len(v.candidates) for v in cg.vertices]
    index = np.indices(sizes).reshape(len(sizes), -1)
    total = np.zeros(index.shape[1])
    for v in cg.vertices:
        total += cg.op_objectives(v)[index[v.index]]
    for e in cg.edges:
        total += cg.edge_matrix(e)[index[e.src], index[e.dst]]
    return float(total.min())


@SETTINGS
@given(random_graphs(max_ops=8, dims=(2, 4)), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["full_batch", "data_parallel"]), st.sampled_from([0, 256]),
       st.booleans())
def test_dynamic_programming_equals_brute_force(graph, devices, dataset, exact_classes,
                                                 training) -> None:
    """Exact under the cost model, also when every edge table starts from lower bounds
    (exact_edge_classes=0: the rounds of dynamic_programming.EdgeTables)."""
    assume(dataset == "full_batch" or graph.inputs[0].shape[0] % devices == 0)
    cg = CostGraph(graph, devices, CostConstants(training=training), dataset)
    assume(prod(len(v.candidates) for v in cg.vertices) <= 40000)
    result = solve(cg, SearchOptions(exact_edge_classes=exact_classes))
    best = brute_force(cg)
    assert np.isfinite(best)
    assert cg.total(result.choice) == pytest.approx(best, rel=1e-9, abs=1e-6)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_graphs(max_ops=5, dims=(2, 4)), st.sampled_from([2, 4]))
def test_dynamic_programming_respects_the_memory_bound(graph, devices) -> None:
    cg = CostGraph(graph, devices, CostConstants(), "full_batch")
    free = solve(cg, SearchOptions())
    least = min(cg.memory(c) for c in _all_choices(cg))
    assume(least < free.memory)
    bounded = CostGraph(graph, devices, CostConstants(memory_capacity=least), "full_batch")
    result = solve(bounded, SearchOptions(exact_edge_classes=0))
    assert bounded.memory(result.choice) <= least + 1e-6


def _all_choices(cg: CostGraph) -> list[tuple[int, ...]]:
    sizes = [len(v.candidates) for v in cg.vertices]
    assume(prod(sizes) <= 20000)
    return list(itertools.product(*(range(s) for s in sizes)))


def check_plan(graph: Graph, devices: int, mode: str) -> None:
    """The searched plan is accepted by assign and matches the single-device graph."""
    result = search(graph, devices, mode, dataset_strategy="full_batch")
    assignment = assign(graph, devices, "full_batch", searched=result.strategies)
    assignment.reshape_layouts.update(result.reshape_layouts)
    ranks, layouts = build_rank_graphs(graph, assignment, SplitOptions(devices, False), {})
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(p.shape) for p in graph.params]  # float64: see below
    want = run_graph(graph, arrays, float64=True)
    feeds = [[a[tuple(slice(lo, hi) for lo, hi in
                      assignment.param_layouts[p.name].slice_bounds(r))]
              for p, a in zip(graph.params, arrays)] for r in range(devices)]
    outs = run_ranks(ranks, feeds, float64=True)
    for i, (w, layout) in enumerate(zip(want, layouts)):
        full = np.zeros(layout.shape, np.float64)
        for r in range(devices):
            full[tuple(slice(lo, hi) for lo, hi in layout.slice_bounds(r))] = outs[r][i]
        # Evaluated in float64 on both sides: a correct plan is within FLOAT64_RTOL of the
        # scale (tools/oracle.py derives it), a wrong one off by whole terms.
        np.testing.assert_allclose(full, w, rtol=0, atol=FLOAT64_RTOL * np.abs(w).max())


@SETTINGS
@given(random_graphs(), st.sampled_from([2, 4, 6, 8, 16]))
def test_sharding_propagation_plans_are_valid(graph, devices) -> None:
    check_plan(graph, devices, "sharding_propagation")


def test_a_shared_weight_keeps_one_layout_under_neighbour_candidates() -> None:
    """A weight used by two MatMuls is stored sliced once, so both must split it alike. A
    candidate built under a decided neighbour's device matrix may split it on other device
    axes than a strategy tuple does: mm2 took w2 as (dev [1, 2, 1, 2], map [2, -1]) and mm5
    as (dev [2, 2, 1], map [1, -1]), which step_parallel_begin refused. Ops that share a
    weight keep their enumerated candidates (found by the property test above)."""
    graph = Graph("shared_weight")
    x = graph.add_param(GraphParam(TensorType(F32, (4, 2)), "x"))
    w0, w1, w2 = (graph.add_param(GraphParam(TensorType(F32, shape), f"w{i}", "weight", True))
                  for i, shape in enumerate([(2, 2), (2, 4), (4, 2)]))
    b = Builder(graph)
    h = b.emit("MatMul", [x, w0], instance_name="mm0")
    h = b.emit("MatMul", [h, w1], instance_name="mm1")
    b.emit("MatMul", [h, w2], instance_name="mm2")
    t = b.emit("Transpose", [x], {"perm": (1, 0)}, instance_name="t3")
    relu = b.emit("ReLU", [x], instance_name="relu4")
    graph.outputs = [relu, b.emit("MatMul", [t, w2], instance_name="mm5")]
    check_plan(graph, 4, "sharding_propagation")


@SETTINGS
@given(random_graphs(), st.sampled_from([2, 4, 8, 16]))
def test_recursive_programming_plans_are_valid(graph, devices) -> None:
    check_plan(graph, devices, "recursive_programming")


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_graphs(max_ops=5, dims=(2, 4)), st.sampled_from([2, 3, 4]))
def test_dynamic_programming_plans_are_valid(graph, devices) -> None:
    check_plan(graph, devices, "dynamic_programming")


def configure_randomly(graph: Graph, devices: int, rnd) -> None:
    """Give about a third of the ops a random valid user strategy."""
    from pcompile.passes.search.candidates import candidate_strategies, op_context

    for node in graph.nodes:
        if node.op == "Reshape" or rnd.random() > 0.35:
            continue
        cands = candidate_strategies(op_context(node, devices))
        node.attrs["in_strategy"] = rnd.choice(cands).strategy


def local_objective(cg: CostGraph, v, choice: list[int], k: int, lagrange: float) -> float:
    """The objective of v's own cost and of all its edges, v at candidate k, the others at
    `choice` (pair by pair, independently of the search's cached rows)."""
    c = cg.constants
    own = cg.op_costs(v)[k]
    value = own.objective(c) + lagrange * own.memory
    trial = list(choice)
    trial[v.index] = k
    for ei in v.in_edges + v.out_edges:
        e = cg.edges[ei]
        value += cg.edge_cost(e, trial[e.src], trial[e.dst]).objective(c)
    return value


def swc(cg: CostGraph, v, choice: list[int], k: int, edges: list[int]) -> tuple:
    trial = list(choice)
    trial[v.index] = k
    comm = comp = 0.0
    for ei in edges:
        e = cg.edges[ei]
        cost = cg.edge_cost(e, trial[e.src], trial[e.dst])
        comm += cost.communication
        comp += cost.computation
    return swc_key(cg, v, k, comm, comp)


def close(a: float | None, b: float) -> bool:
    """A printed value (None for infinity) equals `b` up to the printed rounding."""
    if not np.isfinite(b):
        return a is None
    return a is not None and abs(a - b) <= 1e-3 + 1e-9 * abs(b)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_graphs(max_ops=7), st.sampled_from([2, 4, 8]),
       st.sampled_from(["sharding_propagation", "dynamic_programming",
                        "recursive_programming"]),
       st.booleans(), st.randoms(use_true_random=False))
def test_choice_is_the_minimum_of_the_printed_candidates(graph, devices, mode, fully,
                                                         rnd) -> None:
    """The invariant of passes/search/explain.py: for every op a search decides by comparing
    candidates, the chosen one is the minimum, over all candidates, of the cost the explanation
    prints (recomputed here pair by pair from the cost model), and the printed runner-up is
    the minimum over the others."""
    configure_randomly(graph, devices, rnd)
    result = search(graph, devices, mode, dataset_strategy="full_batch",
                    options=SearchOptions(fully_use_devices=fully))
    cg = result.cost_graph
    assert cg is not None
    # users of one parameter configured with different layouts: no finite plan (an error
    # step_parallel_begin reports), nothing to compare
    assume(np.isfinite(result.objective))
    for v in cg.vertices:
        if v.kind != "op" or v.configured:
            continue
        info = result.explain[v.node]
        k = result.choice[v.index]
        n = len(v.candidates)
        assert info["strategy"] == v.candidates[k].strategy
        if mode == "dynamic_programming":
            local = [local_objective(cg, v, result.choice, i, 0.0) for i in range(n)]
            assert local[k] <= min(local) * (1 + 1e-9) + 1e-6
            assert close(info["local_objective"], local[k])
            if n > 1:
                assert close(info["runner_up"]["local_objective"],
                             min(x for i, x in enumerate(local) if i != k))
        elif result.decisions.get(v.index):
            edges = result.decisions[v.index]
            keys = [swc(cg, v, result.choice, i, edges) for i in range(n)]
            assert keys[k] == min(keys)
            assert close(info["decision"]["communication"], keys[k][0])
            assert close(info["decision"]["computation"], keys[k][1])
            if n > 1:
                r = min((i for i in range(n) if i != k), key=lambda i: keys[i])
                assert info["runner_up"]["strategy"] == v.candidates[r].strategy
                assert close(info["runner_up"]["communication"], keys[r][0])
        else:
            assert "runner_up" not in info
            assert info["decided_by"] in ("recursive programming",
                                          "first candidate (not reached)")
