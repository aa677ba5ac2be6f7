"""Search results that MindSpore's own parallel unit tests expect (tests/ut/python/parallel/),
each also checked against the single-device program."""

from __future__ import annotations

import os

import pytest

from pcompile import reset_algo_parameters, set_algo_parameters
from pcompile.compiler.driver import compile as compile_model
from pcompile.compiler.model_file import load_model_file
from pcompile.compiler.oracle import check
from pcompile.compiler.trace_model import trace_model
from pcompile.passes.search import search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model(name: str) -> str:
    return os.path.join(ROOT, "tests", "models", name)


def strategies(program) -> dict[str, tuple]:
    assignment = program.state.assignment
    return {n.instance_name: assignment.sharding(n).strategy for n in program.graph.nodes
            if assignment.sharding(n) is not None}


def test_propagation_stops_at_a_reshape_chain() -> None:
    """test_auto_parallel_reshape.py (test_reshape_depend_reshape): sharding propagation does
    not cross an edge between two Reshapes (MindSpore: "has two Reshapes, please set the
    strategy for at least one"), so the ReLU after Reshape -> Reshape, with nothing configured
    after it, is not split like the Mul before the chain: ((1, 1)), as MindSpore leaves it."""
    program = compile_model(model("reshape_chain.py"), devices=8, dump=False)
    got = strategies(program)
    assert got["mul"] == ((8, 1), (8, 1))
    assert got["relu2"] == ((1, 1),)
    assert check(program, steps=1).ok(1e-5, 1e-4)


@pytest.mark.parametrize("fully_use_devices", [True, False])
def test_functional_shard_matmul_keeps_the_shard_layout(fully_use_devices: bool) -> None:
    """examples/functional_shard.py (seed functional-operator-sharding.md): the MatMul after
    `ms.shard(dense_relu, in_strategy=((4, 2), None, None))` takes MindSpore's ((4, 2), (2, 1)),
    which needs no redistribution from the shard, and its printed decision says so: the
    runner-up's CompareSwcCost terms are not below the choice's (issue 17, item 5)."""
    set_algo_parameters(fully_use_devices=fully_use_devices)
    try:
        program = compile_model(os.path.join(ROOT, "examples", "functional_shard.py"),
                                devices=8, dump=False)
    finally:
        reset_algo_parameters()
    matmul = next(n for n in program.graph.nodes if n.instance_name == "MatMul-op0")
    info = program.state.search.explain[id(matmul)]
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
        got = {n.instance_name: result.strategies.get(id(n)) for n in graph.nodes}
        assert got["matmul"] == ((1, 1), (1, 8))
        assert got["strided_slice"] == ((1, 1, 1),)
        return
    program = compile_model(path, devices=8, dump=False)
    got = strategies(program)
    assert got["strided_slice"] == ((1, 1, 1),)
    assert got["matmul"] == ((8, 1), (1, 1))
    assert check(program, steps=1).ok(1e-5, 1e-4)
