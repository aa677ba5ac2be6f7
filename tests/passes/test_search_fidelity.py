"""Search results that MindSpore's own parallel unit tests expect (tests/ut/python/parallel/),
each also checked against the single-device program."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pcompile import reset_algo_parameters, set_algo_parameters
from pcompile.compiler.driver.trace_model import trace_model
from pcompile.compiler.frontend.model_file import load_model_file
from pcompile.passes.search import search
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT


def model(name: str) -> str:
    return os.path.join(ROOT, "tests", "models", name)


def strategies(program) -> dict[str, tuple]:
    assignment = program.state.assignment
    return {n.instance_name: assignment.sharding(n).strategy for n in program.graph.nodes
            if assignment.sharding(n) is not None}


def test_propagation_crosses_consecutive_reshapes_as_one() -> None:
    """test_auto_parallel_reshape.py's Reshape(96, 32, 4) -> Reshape(128, 96) without the Depend
    between them: MindSpore 2.10 merges the two Reshapes before its search (its
    step_auto_parallel_begin dump of this network holds one Reshape), so propagation crosses
    it and the ReLU keeps the Mul's row split, the chain being a local reshape."""
    program = compile_model(model("reshape_chain.py"), devices=8, dump=False)
    got = strategies(program)
    assert got["mul"] == ((8, 1), (8, 1))
    assert got["relu2"] == ((8, 1),)
    relu = next(n for n in program.graph.nodes if n.instance_name == "relu2")
    assert program.state.search.explain[relu]["decision"]["communication"] == 0.0
    assert check(program, steps=1).ok(1e-5, 1e-4)


def test_propagation_stops_between_two_reshape_operators() -> None:
    """With a node between the two Reshapes (MindSpore's test puts a Depend there), MindSpore's
    propagation refuses the edge between two Reshape operators ("has two Reshapes, please set
    the strategy for at least one"), and the ReLU gets its strategy from the loss side:
    ((1, 1)), as MindSpore leaves it. The edge is marked as crossing two Reshape operators here,
    as cost_graph marks an edge through Reshape, Depend, Reshape."""
    from pcompile.passes.search.cost_graph import CostGraph
    from pcompile.passes.search.cost_model import CostConstants
    from pcompile.passes.search.sharding_propagation import propagate

    graph = trace_model(load_model_file(model("reshape_chain.py"))).graph
    cg = CostGraph(graph, 8, CostConstants(), "full_batch", True)
    (chain,) = [e for e in cg.edges if e.reshapes]
    assert chain.reshapes == 1  # consecutive Reshapes are one operator
    chain.reshapes = 2
    choice = propagate(cg).choice
    relu = next(v for v in cg.vertices if v.name == "relu2")
    assert relu.candidates[choice[relu.index]].strategy == ((1, 1),)
    assert propagate(cg, cross_reshape_chains=True).choice[relu.index] != choice[relu.index]


@pytest.mark.parametrize("fully_use_devices", [True, False])
def test_functional_shard_matmul_keeps_the_shard_layout(fully_use_devices: bool) -> None:
    """examples/functional_shard.py (seed functional-operator-sharding.md): the MatMul after
    `ms.shard(dense_relu, in_strategy=((4, 2), None, None))` takes MindSpore's ((4, 2), (2, 1)),
    which needs no redistribution from the shard, and its printed decision says so: the
    runner-up's CompareSwcCost terms are not below the choice's."""
    set_algo_parameters(fully_use_devices=fully_use_devices)
    try:
        program = compile_model(os.path.join(ROOT, "examples", "functional_shard.py"),
                                devices=8, dump=False)
    finally:
        reset_algo_parameters()
    matmul = next(n for n in program.graph.nodes if n.instance_name == "MatMul-op0")
    info = program.state.search.explain[matmul]
    assert info["strategy"] == ((4, 2), (2, 1))
    assert info["decision"]["communication"] == 0.0
    chosen = tuple(info["decision"][k] for k in ("communication", "computation", "forward"))
    runner = tuple(info["runner_up"][k] for k in ("communication", "computation", "forward"))
    assert chosen <= runner
    assert check(program, steps=1).ok(1e-5, 1e-4)


@pytest.mark.parametrize("with_loss", [False, True])
def test_recursive_programming_keeps_the_sliced_parameter_unsplit(with_loss: bool,
                                                                   monkeypatch) -> None:
    """test_auto_parallel_sapp_strided_slice.py: the StridedSlice of a parameter, reshaped into
    the right operand of a MatMul, stays ((1, 1, 1)) whatever the MatMul takes (here ((1, 1),
    (1, 8)) without a loss, as MindSpore's test compiles it, and ((8, 1), (1, 1)) with one): an
    op reading only parameters takes no part in the partition."""
    monkeypatch.setenv("STRIDED_SLICE_LOSS", "1" if with_loss else "0")
    path = model("strided_slice_reshape.py")
    if not with_loss:
        graph = trace_model(load_model_file(path)).graph
        result = search(graph, 8, "recursive_programming", dataset_strategy="full_batch")
        got = {n.instance_name: result.strategies.get(n) for n in graph.nodes}
        assert got["matmul"] == ((1, 1), (1, 8))
        assert got["strided_slice"] == ((1, 1, 1),)
        return
    program = compile_model(path, devices=8, dump=False)
    got = strategies(program)
    assert got["strided_slice"] == ((1, 1, 1),)
    assert got["matmul"] == ((8, 1), (1, 1))
    assert check(program, steps=1).ok(1e-5, 1e-4)


def test_dynamic_programming_behind_a_parameter_cast() -> None:
    """test_auto_parallel_parameter_cast.py: MatMul-op0 (matmul2 in MindSpore 2.10's naming of
    this network) takes [[8, 1], [1, 1]] and both Casts of the parameter [[1, 1]]. (The test
    also names a MatMul-op4 with [[1, 1], [1, 8]]; the network has three MatMuls, op0 to op2,
    so that assertion matches nothing.) Training constants, as the test's set_train(); the
    compiled inference program matches the single-device one."""
    path = model("parameter_cast.py")
    graph = trace_model(load_model_file(path)).graph
    result = search(graph, 8, "dynamic_programming", dataset_strategy="full_batch")
    got = {n.instance_name: result.strategies.get(n) for n in graph.nodes}
    assert got["matmul2"] == ((8, 1), (1, 1))
    assert got["cast1"] == got["cast2"] == ((1, 1),)
    program = compile_model(path, devices=8, dump=False)
    assert check(program, steps=1).ok(1e-5, 1e-4)


def test_a_multi_input_op_waits_for_its_visited_edges_before_neighbour_layouts() -> None:
    """test_auto_parallel_out_strategy_propagation.py (test_out_strategy_propagate1), with
    fully_use_devices=True: the Add after MatMul ((4, 2), (1, 2)) takes ((4, 2), (4, 2)), a
    candidate using all 8 devices. MindSpore adds an op's candidates under its producers'
    device matrix (AddSwcUnderPrevOpDevMatrixMulti) only once all its in-edges are visited;
    the Add's other input comes from `_VirtualDataset`, whose search runs last, so it decides
    among its own candidates. pcompile counted the configured `_VirtualDataset` as visited and
    gave the Add ((4, 1), (4, 1)), built under the MatMul's device matrix: 4 of 8 devices."""
    set_algo_parameters(fully_use_devices=True)
    try:
        program = compile_model(model("out_strategy_propagation.py"), devices=8, dump=False)
    finally:
        reset_algo_parameters()
    got = strategies(program)
    assert got["matmul"] == ((4, 2), (1, 2))
    assert got["add"] == ((4, 2), (4, 2))
    assert got["relu"] == ((4, 2),)
    report = check(program, steps=1)
    assert report.ok(), report.errors


def test_a_multi_input_op_is_decided_from_its_visited_edges_only(tmp_path) -> None:
    """The same test with `dataset_strategy="data_parallel"` (MindSpore's test default): the
    Add's edge from `_VirtualDataset` is not visited when MindSpore decides the Add, so the
    Add takes ((4, 2), (4, 2)) as with full_batch. pcompile summed that edge too and gave
    ((8, 1), (8, 1)), the input's split."""
    text = Path(model("out_strategy_propagation.py")).read_text()
    path = tmp_path / "out_strategy_propagation_dp.py"
    path.write_text(text.replace('dataset_strategy="full_batch"',
                                 'dataset_strategy="data_parallel"'))
    set_algo_parameters(fully_use_devices=True)
    try:
        program = compile_model(str(path), devices=8, dump=False)
    finally:
        reset_algo_parameters()
    got = strategies(program)
    assert (got["matmul"], got["add"], got["relu"]) == (((4, 2), (1, 2)), ((4, 2), (4, 2)),
                                                         ((4, 2),))
    assert check(program, steps=1).ok()


@pytest.mark.parametrize("case,expected", [
    ("1", ((1, 1), (8, 1))), ("2", ((4, 1), (2, 1))), ("3", ((1,), (4,)))])
def test_recursive_programming_gives_gather_mindspores_strategy(case: str, expected: tuple,
                                                                 monkeypatch) -> None:
    """test_auto_parallel_sapp_gather.py: SAPP replaces the partition's Gather strategy by its
    own (PrepareGather): axis 0 halves the indices' dim 0, then the table's, until the 8
    devices are used, and puts a split table axis back to 1 next to split indices outside the
    shard-batch-and-axis mode. The table x [1024, 128] by indices [2, 1024] gets ((4, 1),
    (2, 1)) (pcompile gave ((1, 1), (2, 4))), the 1-D [128] by [4] ((1,), (4,)), a strategy of
    4 of the 8 devices that SAPP sets whatever fully_use_devices says (pcompile gave ((1,),
    (1,)))."""
    monkeypatch.setenv("SAPP_GATHER", case)
    program = compile_model(model("sapp_gather.py"), devices=8, dump=False)
    assert strategies(program)["gatherv2"] == expected


@pytest.mark.parametrize("layout", ["BNSD", "BSH", "SBH", "BSND"])
def test_recursive_programming_lays_flash_attention_out_as_its_matmul(layout: str,
                                                                      monkeypatch) -> None:
    """test_auto_parallel_sapp_flash_attention.py's rules: the query, key and value splits
    agree, the mask takes the batch and sequence splits, and (through the Reshape, on the
    first dims that fit) the MatMul's row split is the attention's batch split and its column
    split the query's dim 2. SAPP takes the attention's strategy from its producer; pcompile's
    partition gave BNSD ((1, 8, 1, 1), ...) next to a MatMul ((8, 1), (1, 1))."""
    from pcompile import reset_cost_model_context

    monkeypatch.setenv("FA_LAYOUT", layout)
    try:
        program = compile_model(model("sapp_flash_attention.py"), devices=8, dump=False)
    finally:
        reset_cost_model_context()
    got = strategies(program)
    mm, fa = got["matmul"], got["flash_attention"]
    dp, mp, sp = {"BNSD": (0, 1, 2), "BSH": (0, 2, 1), "SBH": (1, 2, 0),
                  "BSND": (0, 2, 1)}[layout]
    q, k, v, mask = fa
    assert q[dp] == k[dp] == mask[0] and q[mp] == k[mp] and k == v
    assert mask[1] == 1 and mask[2] == q[sp]
    assert (mm[0][0], mm[1][1]) == (q[0], q[2])
