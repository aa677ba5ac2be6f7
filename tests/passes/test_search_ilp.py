"""`--search ilp` (passes/search/ilp.py) and the cost model in seconds (time_model.py):

* exact: on random small graphs the solver's plan costs what brute-force enumeration of the
  same candidates finds, on every mesh;
* within the memory: a budget between the least memory and the free optimum's is respected;
* valid: the plan is accepted by step_parallel_begin and computes what the single-device
  graph computes (float64);
* folding repeated layers changes nothing: Llama's layers solved once give the same step time
  as all layers solved together, and every layer gets the same strategies;
* every plan's prediction (predict.py) of a searched plan is the search's own;
* device profiles: built-in, from a file, and one clear message for a bad one."""

from __future__ import annotations

import itertools
import json
import os
from math import prod
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pcompile.passes.search import ilp as ilp_module
from pcompile.passes.search.cost_graph import CostGraph
from pcompile.passes.search.cost_model import CostConstants
from pcompile.passes.search.ilp import (
    Costs,
    IlpError,
    IlpOptions,
    evaluate,
    fold,
    mapped_edges,
    mesh_aligned,
    meshes,
    solve,
)
from pcompile.passes.search.time_model import (
    PROFILES,
    ProfileError,
    all_reduce_time,
    differentiable,
    load_profile,
    op_time,
    profile_from_dict,
)
from tests import ROOT
from tests.passes.test_search_random import check_plan, random_graphs

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
H100 = PROFILES["h100"]


def _graph(graph: Any, devices: int) -> CostGraph:
    return CostGraph(graph, devices, CostConstants(), "full_batch", False, None,
                     weight_casts=True)


def _brute(cg: CostGraph, options: IlpOptions, budget: float) -> float:
    """The least step time over every mesh-aligned assignment within `budget`, with and
    without the parallel optimizer (random graphs have no layers to recompute)."""
    folding = fold(cg)
    costs = Costs(cg, options)
    edges = mapped_edges(cg, folding)
    best = float("inf")
    for mesh in meshes(cg.devices):
        allowed = []
        for v in cg.vertices:
            ks = list(range(len(v.candidates)))
            if not v.configured and v.kind == "op":
                ks = [k for k in ks if mesh_aligned(v.candidates[k], mesh)] or ks
            allowed.append(ks)
        assume(prod(len(a) for a in allowed) <= 3000)
        for combo in itertools.product(*allowed):
            choice = dict(enumerate(combo))
            for popt in (False, True):
                compute, comm, memory = evaluate(cg, costs, folding, edges, choice, popt,
                                                 False)
                if memory.total <= budget and compute + comm < best:
                    best = compute + comm
    return best


@SETTINGS
@given(random_graphs(max_ops=5, dims=(2, 4, 8)), st.sampled_from([2, 4]))
def test_the_plan_is_the_brute_force_optimum(graph, devices) -> None:
    cg = _graph(graph, devices)
    options = IlpOptions(H100, 1e12)
    best = _brute(cg, options, options.memory)
    plan = solve(cg, options)
    assert plan.step_time == pytest.approx(best, rel=1e-7, abs=1e-12)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(random_graphs(max_ops=5, dims=(4, 8)), st.sampled_from([2, 4]))
def test_the_plan_fits_the_memory(graph, devices) -> None:
    cg = _graph(graph, devices)
    free = solve(cg, IlpOptions(H100, 1e12))
    budget = free.memory.total * 0.75
    try:
        bounded = solve(cg, IlpOptions(H100, budget))
    except IlpError as exc:
        assert "no plan of" in str(exc) and "B per device" in str(exc)
        assert exc.needed > budget
        return
    assert bounded.memory.total <= budget * (1 + 1e-9)
    assert bounded.step_time >= free.step_time * (1 - 1e-9)


@SETTINGS
@given(random_graphs(), st.sampled_from([2, 4, 8]))
def test_ilp_plans_compute_the_single_device_result(graph, devices) -> None:
    check_plan(graph, devices, "ilp")


def test_no_plan_fits_is_one_message() -> None:
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.types import DType, TensorType

    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (8, 64)), "x"))
    w = graph.add_param(GraphParam(TensorType(DType.float32, (64, 64)), "w", "weight", True))
    graph.outputs = [Builder(graph).emit("MatMul", [x, w], instance_name="mm")]
    with pytest.raises(IlpError, match=r"no plan of 2 devices fits 100 B per device \(the "
                                       r"smallest plan.*needs [0-9]+\.[0-9]{2} kB\)") as info:
        solve(_graph(graph, 2), IlpOptions(H100, 100.0))
    # at least w, its gradient and Adam's two states, each split over the 2 ranks
    assert info.value.needed >= 4 * 64 * 64 * 4 / 2
    assert f"{info.value.needed / 1e3:.2f} kB" in str(info.value)


def _llama_forward(monkeypatch: Any, **env: str) -> Any:
    from pcompile.compiler.driver.driver import compile_program

    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LLAMA_STRATEGIES", "none")
    for k, v in env.items():
        monkeypatch.setenv(f"LLAMA_{k}", v)
    return compile_program(os.path.join(ROOT, "examples", "llama.py"), devices=8,
                           search_mode="ilp", dump=False)


def test_folded_layers_solve_like_all_layers(monkeypatch: Any) -> None:
    program = _llama_forward(monkeypatch, LAYERS="3", HIDDEN="128", FFN="256", SEQ="32")
    state = program.state
    search = state.plan["search"]
    assert search["ilp"]["folded_layers"] == {
        "Default/network-LlamaForCausalLM/model-LlamaModel/layers-CellList": 3}
    # every layer got the strategies of layer 0
    by_layer: dict[str, list[Any]] = {}
    for name, op in search["ops"].items():
        if "/layers-CellList/" in name:
            layer = name.split("/layers-CellList/")[1].split("/", 1)
            by_layer.setdefault(layer[0], []).append(op["strategy"])
    assert len(by_layer) == 3 and len({json.dumps(s) for s in by_layer.values()}) == 1
    # the same search with folding turned off: folding restricts the program (every layer
    # takes the representative's choice), so it is never faster; on the plain candidates the
    # same step time, while the ReduceScatter forms let the last layer's output differ
    # from the others' (where the final norm reads it) by a few parts in 10^5
    cg = state.search.cost_graph
    options = IlpOptions(H100, H100.memory)
    folded = solve(cg, options)
    with monkeypatch.context() as m:
        m.setattr(ilp_module, "fold", _no_fold)
        unfolded = solve(cg, options)
    assert unfolded.folded == {}
    assert unfolded.step_time <= folded.step_time * (1 + 1e-9)
    plain = CostGraph(cg.graph, cg.devices, CostConstants(), "full_batch", False, None,
                      weight_casts=True)
    folded = solve(plain, options)
    monkeypatch.setattr(ilp_module, "fold", _no_fold)
    assert folded.step_time == pytest.approx(solve(plain, options).step_time, rel=1e-9)
    # the plan's prediction (every plan's, predict.py) is the search's own
    assert state.plan["prediction"]["step_time"] == pytest.approx(
        search["predicted_step_time"], rel=1e-5)
    assert state.plan["prediction"]["memory"] == search["predicted_memory"]


def _no_fold(cg: CostGraph, stages: Any = None, grad: Any = None) -> ilp_module.Folding:
    n = len(cg.vertices)
    return ilp_module.Folding(list(range(n)), [1] * n, {}, [False] * n, {})


@pytest.mark.slow
def test_a_memory_budget_gives_a_plan_that_fits(monkeypatch: Any) -> None:
    """With a budget between what the smallest plan needs and what the free plan needs, the
    search finds another plan that fits the budget (the prediction says so), and no faster
    than the free one (that one was the fastest); below the smallest plan it refuses, naming
    what that plan needs."""
    from pcompile.compiler.config.search_context import reset_cost_model_context
    from pcompile.compiler.driver.driver import compile_program
    from pcompile.passes.search.ilp import IlpError

    env = {"LAYERS": "2", "HIDDEN": "256", "FFN": "512", "VOCAB": "1024", "SEQ": "64",
           "BATCH": "2"}
    free = _llama_forward(monkeypatch, **env).state.plan
    model = os.path.join(ROOT, "examples", "llama.py")

    def bounded(budget: float) -> Any:
        try:
            return compile_program(model, devices=8, search_mode="ilp", dump=False,
                                   overrides={"device_memory_capacity": budget}).state.plan
        finally:
            reset_cost_model_context()

    with pytest.raises(IlpError, match="the smallest plan, with the parallel optimizer and "
                                       r"recompute, needs [0-9.]+ [kMG]?B") as refused:
        bounded(1.0)
    smallest, total = refused.value.needed, free["prediction"]["memory"]["total"]
    assert 1.0 < smallest < total
    budget = (smallest + total) / 2
    plan = bounded(budget)
    assert plan["prediction"]["fits"] and plan["prediction"]["memory"]["total"] <= budget
    assert plan["prediction"]["step_time"] >= free["prediction"]["step_time"] * (1 - 1e-9)
    assert plan["search"]["ops"] != free["search"]["ops"] or (
        plan["search"]["recompute"] != free["search"]["recompute"])


def test_collective_times_follow_the_links() -> None:
    nb = 1e9
    inside = all_reduce_time(nb, 8, H100.link(8))
    across = all_reduce_time(nb, 8, H100.link(64))
    assert inside < across
    assert inside == pytest.approx(2 * 7 * H100.intra.latency + 2 * 7 / 8 * nb
                                   / H100.intra.bandwidth)
    assert all_reduce_time(nb, 1, H100.intra) == 0.0


def test_profiles_built_in_and_from_a_file(tmp_path: Any) -> None:
    assert load_profile("h200").memory > load_profile("h100").memory
    path = tmp_path / "cluster.json"
    data = PROFILES["h100"].as_dict() | {"name": "mine", "memory": 40e9}
    path.write_text(json.dumps(data))
    mine = load_profile(str(path))
    assert mine.memory == 40e9 and mine.name == "mine" and mine.intra == H100.intra
    with pytest.raises(ProfileError, match="neither a built-in profile"):
        load_profile(str(tmp_path / "missing.json"))
    bad = dict(data, intra_node={"bandwidth": -1, "latency": 1e-6})
    with pytest.raises(ProfileError, match="intra_node: 'bandwidth' must be a positive"):
        profile_from_dict(bad)
    with pytest.raises(ProfileError, match="'node_size' must be a positive integer"):
        profile_from_dict(dict(data, node_size=0))


def test_an_unknown_profile_is_refused_where_it_is_set() -> None:
    from pcompile.compiler.config.search_context import (
        reset_cost_model_context,
        set_cost_model_context,
    )

    try:
        with pytest.raises(ValueError, match="device profile 'nope' is neither a built-in"):
            set_cost_model_context(device_profile="nope")
    finally:
        reset_cost_model_context()


def _matmul_chain(n: int = 3) -> Any:
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.types import DType, TensorType

    graph = Graph("chain")
    b = Builder(graph)
    v = graph.add_param(GraphParam(TensorType(DType.float32, (16, 16)), "x"))
    for k in range(n):
        w = graph.add_param(GraphParam(TensorType(DType.float32, (16, 16)), f"w{k}", "weight",
                                       True))
        v = b.emit("MatMul", [v, w], instance_name=f"mm{k}")
    graph.outputs = [v]
    return graph


@pytest.mark.parametrize("approximate", [False, True])
def test_a_too_large_dynamic_program_gives_advice_that_applies(approximate: bool) -> None:
    from pcompile.passes.search import SearchOptions, search
    from pcompile.passes.search.dynamic_programming import SearchTooLargeError

    with pytest.raises(SearchTooLargeError) as info:
        search(_matmul_chain(), 8, "dynamic_programming", dataset_strategy="full_batch",
               options=SearchOptions(max_table=1, approximate=approximate))
    message = str(info.value)
    assert ("enable_algo_approxi=True" in message) is not approximate
    assert ("already on" in message) is approximate
    assert "--search ilp" in message


def test_recursive_programming_warns_beyond_the_memory() -> None:
    from pcompile.passes.search import search

    graph = _matmul_chain()
    roomy = search(graph, 8, "recursive_programming", dataset_strategy="full_batch")
    assert roomy.warnings == []
    tight = search(graph, 8, "recursive_programming", dataset_strategy="full_batch",
                   constants=CostConstants(memory_capacity=64.0))
    assert len(tight.warnings) == 1 and "does not bound memory" in tight.warnings[0]
    assert tight.summary()["warnings"] == tight.warnings


@pytest.mark.slow
def test_parallel_optimizer_and_recompute_when_the_memory_needs_them(monkeypatch: Any) -> None:
    """Under 40 MB a 4-layer Llama fits 8 devices only with the parallel optimizer and
    recompute: the search chooses them, the program has them (sharded weights, recomputed
    nodes), the prediction fits, and the plan checks against one device (the shrunk check
    shards the weights the plan sharded)."""
    from pcompile.compiler.config.search_context import reset_cost_model_context
    from pcompile.tools.shrink import shrunk_check

    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    env = {"STRATEGIES": "none", "LAYERS": "4", "HIDDEN": "512", "FFN": "1408",
           "VOCAB": "4096", "SEQ": "128", "BATCH": "2"}
    for k, v in env.items():
        monkeypatch.setenv(f"LLAMA_{k}", v)
    from pcompile.compiler.driver.driver import compile_program

    try:
        program = compile_program(os.path.join(ROOT, "examples", "llama.py"), devices=8,
                                  search_mode="ilp", dump=False,
                                  overrides={"device_memory_capacity": 4.0e7})
        plan = program.state.plan
        assert plan["search"]["parallel_optimizer"] and plan["search"]["recompute"]
        assert plan["recompute"]["recomputed_nodes"] > 0 and plan["parallel_optimizer"]
        assert plan["prediction"]["fits"] and plan["prediction"]["parallel_optimizer"]
        result = shrunk_check(program, factor=16)
    finally:
        reset_cost_model_context()
    assert result.report.ok(), result.report.worst


def test_the_search_finds_expert_parallelism(monkeypatch: Any) -> None:
    """examples/mixtral.py with every shard() removed: the expert weights are split by
    expert (at this size every rank holds every token, so a rank takes its experts' slots
    locally and the combine is an AllReduce; at Mixtral-8x7B widths on 64 devices the
    dispatch and combine are AlltoAlls, docs/search.md)."""
    for name in [n for n in os.environ if n.startswith(("LLAMA_", "MIXTRAL_"))]:
        monkeypatch.delenv(name)
    env = {"LLAMA_STRATEGIES": "none", "MIXTRAL_HIDDEN": "256", "MIXTRAL_FFN": "1024",
           "MIXTRAL_SEQ": "64", "MIXTRAL_BATCH": "8"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from pcompile.compiler.driver.driver import compile_program

    program = compile_program(os.path.join(ROOT, "examples", "mixtral.py"), devices=8,
                              search_mode="ilp", dump=False)
    layouts = program.state.assignment.param_layouts
    w1 = layouts["layers.0.moe.experts.w1"]
    assert w1.splits[0] > 1, w1  # the expert axis split: expert parallelism
    for name in ("w2", "w3"):
        assert layouts[f"layers.0.moe.experts.{name}"].splits[0] == w1.splits[0]


@pytest.mark.parametrize("mode", ["ilp", "sharding_propagation"])
def test_an_op_without_candidates_is_one_message(monkeypatch: Any, mode: str) -> None:
    """An op the search finds no strategy for is an OpError naming it and what to do (it was
    an internal StrategyError traceback)."""
    from pcompile.ir.errors import OpError
    from pcompile.passes.search import candidates, search

    monkeypatch.setattr(candidates, "candidate_strategies", lambda ctx, fully: [])
    with pytest.raises(OpError, match=r"MatMul 'mm0'.*finds no strategy for it on 8 devices.*"
                                      r"give it a strategy with shard\(\)"):
        search(_matmul_chain(1), 8, mode, dataset_strategy="full_batch")


def _matmul_time(strategy: Any, devices: int, training: bool = True,
                 x_trained: bool = True) -> Any:
    """op_time of x[8, 64] @ w[64, 32] (w a trainable float32 weight, x another or data)
    under `strategy`."""
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.sharding import rule_for
    from pcompile.ir.types import DType, TensorType
    from pcompile.passes.search.candidates import op_context

    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (8, 64)), "x",
                                   *(("weight", True) if x_trained else ())))
    w = graph.add_param(GraphParam(TensorType(DType.float32, (64, 32)), "w", "weight", True))
    y = Builder(graph).emit("MatMul", [x, w], instance_name="mm")
    graph.outputs = [y]
    node = y.node
    rule = rule_for("MatMul")
    assert rule is not None
    sharding = rule.apply(op_context(node, devices), strategy)
    return op_time(node, sharding, devices, H100, training, differentiable(graph))


def test_gradients_follow_the_parallel_passes_convention() -> None:
    """passes/cotangents.py: a replicated weight's gradient is all-reduced over every rank that
    holds the same slice, whether the computation is split over them or repeated; a forward
    AllReduce's vjp is another; a Split's vjp is a zero pad."""
    from pcompile.ir.layout import TensorLayout
    from pcompile.passes.search.time_model import redistribution_time

    x_bytes, w_bytes, y_bytes = 8 * 64 * 4, 64 * 32 * 4, 8 * 32 * 4
    ring = 2 * 7 / 8  # an AllReduce over 8 ranks sends 2 (n - 1) / n of its operand
    # repeated on all 8 ranks: the mirrors still sum both gradients' shares over 8
    assert _matmul_time(((1, 1), (1, 1)), 8).comm_bytes == pytest.approx(
        ring * (x_bytes + w_bytes))
    # data parallel over 8: x is split, w's gradient all-reduced
    assert _matmul_time(((8, 1), (1, 1)), 8).comm_bytes == pytest.approx(ring * w_bytes)
    # row parallel over 8 (the reduced dim split): the forward AllReduce of y and its vjp, no
    # gradient reduction (each rank holds its own rows and columns)
    assert _matmul_time(((1, 8), (8, 1)), 8).comm_bytes == pytest.approx(2 * ring * y_bytes)
    assert _matmul_time(((1, 8), (8, 1)), 8, training=False).comm_bytes == pytest.approx(
        ring * y_bytes)
    # w the only input with a gradient and y replicated like it: the shares are summed on y
    # when that moves fewer bytes (passes/cotangents.py, an embedding's Gather)
    assert _matmul_time(((1, 1), (1, 1)), 8, x_trained=False).comm_bytes == pytest.approx(
        ring * min(y_bytes, w_bytes))
    # replicated -> split over 8: local both ways
    split = redistribution_time(TensorLayout((8,), (-1, -1), (8, 64)),
                                TensorLayout((8,), (0, -1), (8, 64)), 4, H100, training=True)
    assert split.comm_bytes == 0 and split.comm == 0


def test_reduce_scatter_forms_of_a_row_parallel_matmul() -> None:
    """`--search ilp` weighs a split reduced dim's sum reduce-scattered over the output's first
    dim (sequence parallelism's form), as MindSpore's `out_strategy` writes it."""
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.types import DType, TensorType
    from pcompile.passes.search.candidates import CandidateTable

    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (16, 64)), "x"))
    w = graph.add_param(GraphParam(TensorType(DType.float32, (64, 32)), "w", "weight", True))
    node = Builder(graph).emit("MatMul", [x, w], instance_name="mm").node
    plain = CandidateTable(4).for_node(node)
    both = CandidateTable(4, reduce_scatter=True).for_node(node)
    forms = [c for c in both if c.out_strategy is not None]
    assert len(both) == len(plain) + len(forms) and all(c.out_strategy is None for c in plain)
    row = next(c for c in forms if c.strategy == ((1, 4), (4, 1)))
    assert row.out_strategy == ((4, 1),)
    assert [f.kind for f in row.sharding.forward] == ["ReduceScatter"]
    assert row.out_layouts[0].slice_shape == (4, 32)
    # every form is a strategy whose plain form all-reduces
    by_strategy = {c.strategy: c for c in plain}
    assert all([f.kind for f in by_strategy[c.strategy].sharding.forward] == ["AllReduce"]
               for c in forms)


@pytest.mark.slow
def test_a_searched_reduce_scatter_form_is_applied_and_checked(monkeypatch: Any) -> None:
    """On the 4-layer Llama under 100 MB the search reduce-scatters the row-parallel outputs
    (sequence parallelism): the plan carries their out_strategy, moves no more than it
    predicts, and computes the single-device step (the shrunk float64 check)."""
    from pcompile.compiler.config.search_context import reset_cost_model_context
    from pcompile.compiler.driver.driver import compile_program
    from pcompile.passes.comm_info import is_communication, node_ring_bytes
    from pcompile.tools.shrink import shrunk_check

    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    for k, v in {"LAYERS": "4", "HIDDEN": "512", "FFN": "1408", "VOCAB": "4096", "SEQ": "128",
                 "BATCH": "2", "STRATEGIES": "none"}.items():
        monkeypatch.setenv(f"LLAMA_{k}", v)
    try:
        program = compile_program(os.path.join(ROOT, "examples", "llama.py"), devices=8,
                                  search_mode="ilp", dump=False,
                                  overrides={"device_memory_capacity": 1e8})
        result = shrunk_check(program, factor=16)
    finally:
        reset_cost_model_context()
    assert result.report.ok(), result.report.worst
    forms = program.state.plan["search"]["out_strategies"]
    assert forms
    nodes = {n.fullname: n for n in program.state.graph.nodes}
    assert all(nodes[name].parallel.out_strategy == tuple(tuple(s) for s in form)
               for name, form in forms.items())
    moved = sum(node_ring_bytes(n) for n in program.state.rank_graphs[0].nodes
                if is_communication(n) and n.op != "_MirrorOperator")
    assert moved <= program.state.plan["prediction"]["communication_bytes"]
    assert any(n.op == "ReduceScatter" for n in program.state.rank_graphs[0].nodes)


def test_a_plans_prediction_is_finite_where_a_weights_users_differ() -> None:
    """predict.py costs a given plan: where two users of a weight read it in layouts on
    different device matrices (here both whole, 2 x 4 and 4 x 2), the prediction is the
    program's redistribution, not the search's infinite refusal (which plan.json cannot
    hold)."""
    from math import isfinite

    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam, ParallelInfo
    from pcompile.ir.types import DType, TensorType
    from pcompile.passes.search.predict import predict

    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (8, 16)), "x"))
    w = graph.add_param(GraphParam(TensorType(DType.float32, (16, 16)), "w", "weight", True))
    b = Builder(graph)
    y1 = b.emit("MatMul", [x, w], instance_name="mm1")
    y2 = b.emit("MatMul", [x, w], instance_name="mm2")
    out = b.emit("Add", [y1, y2], instance_name="add")
    graph.outputs = [out]
    for value, strategy in ((y1, ((2, 1), (1, 1))), (y2, ((4, 1), (1, 1))),
                            (out, ((8, 1), (8, 1)))):
        value.node.parallel = ParallelInfo(in_strategy=strategy)
    p = predict(graph, 8, H100, H100.memory, training=True, parallel_optimizer=False,
                recompute=False)
    assert isfinite(p.step_time) and isfinite(p.comm_bytes)
