"""Search results that MindSpore's own parallel unit tests expect (tests/ut/python/parallel/),
each also checked against the single-device program."""

from __future__ import annotations

import os

from pcompile.compiler.driver import compile as compile_model
from pcompile.compiler.oracle import check

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
