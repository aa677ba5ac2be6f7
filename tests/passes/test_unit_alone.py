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
from pcompile.passes.unit import CompileOptions, CompileUnit, PlanRecord
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
    prediction = unit.plan.prediction
    assert prediction is not None
    assert prediction["device_profile"] == "mine"
    assert prediction["device_memory"] == 40e9


def test_the_plan_record_has_a_field_per_section() -> None:
    """The passes write typed sections; seen as a mapping (what plan.json is built from) the
    record holds the written ones, and a name no section has is refused."""
    plan = PlanRecord()
    assert dict(plan) == {} and plan.get("recompute") is None
    plan.recompute = {"recomputed_nodes": 3}
    plan["comm_fusion"] = {"buckets": []}
    assert dict(plan) == {"recompute": {"recomputed_nodes": 3}, "comm_fusion": {"buckets": []}}
    assert plan.comm_fusion == {"buckets": []}
    with pytest.raises(KeyError, match="plan section 'predicton' is not one of search, "
                                       "prediction"):
        plan["predicton"] = {}
    del plan["recompute"]
    assert plan.recompute is None and list(plan) == ["comm_fusion"]
