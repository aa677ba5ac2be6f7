"""A pass runs on a `CompileUnit` built without the front end (the fields the trace sets given
as data) and reads no file: what it needs from outside, the driver read before the passes."""

from __future__ import annotations

import builtins
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pcompile.ir.parser import parse_graph
from pcompile.passes.search.time_model import PROFILES
from pcompile.passes.step_parallel_begin import StepParallelBeginPass
from pcompile.passes.unit import CompileOptions, CompileUnit
from tests import ROOT

TRACE = Path(ROOT, "tests", "passes", "goldens", "semi_auto", "00_trace.ir")


def test_step_parallel_begin_predicts_with_the_profile_it_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prediction's device profile is the unit's option (a JSON file's, read by the
    driver), not a file the pass opens."""
    graph = parse_graph(TRACE.read_text(), TRACE.name)
    mine = replace(PROFILES["h100"], name="mine", memory=40e9)
    unit = CompileUnit(devices=2, parallel_mode="semi_auto_parallel",
                       search_mode="recursive_programming", training=True, backward=True,
                       graph=graph, options=CompileOptions(device_profile=mine))

    def no_file(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a pass opened {args[0]!r}")

    monkeypatch.setattr(builtins, "open", no_file)
    StepParallelBeginPass().apply(unit)
    prediction = unit.plan["prediction"]
    assert prediction["device_profile"] == "mine"
    assert prediction["device_memory"] == 40e9
