"""The front end's passes take what the tools ask of them (the shrunk check's shrink, the
oracle's reference rewrite, custom bprops off) as their options, which the driver builds; they
read no tool hook from the compile state."""

from __future__ import annotations

import os

from pcompile.compiler.config.context import reset_auto_parallel_context, reset_context
from pcompile.compiler.driver.compiled import CompileState
from pcompile.compiler.driver.front_passes import TraceOptions, TracePass
from pcompile.compiler.frontend.model_file import load_model_file
from pcompile.ir.core import Graph
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def test_the_trace_applies_the_rewrite_it_is_given() -> None:
    reset_auto_parallel_context()
    reset_context()
    try:
        seen: list[Graph] = []
        state = CompileState(model_file=load_model_file(QUICKSTART), devices=1,
                             parallel_mode="stand_alone", search_mode="recursive_programming")
        TracePass(TraceOptions(transform=seen.append)).apply(state)
        assert state.reference is None and seen == [state.graph]
        assert state.rank_graphs == [state.graph] and state.training == state.backward
    finally:
        reset_auto_parallel_context()
        reset_context()
