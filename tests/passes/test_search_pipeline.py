"""`--search ilp` and every plan's prediction with pipeline stages (passes/search/stages.py):
repeated layers fold per stage, each stage holds the micro-batches its scheduler keeps in
flight, a stage's memory is its own parameters' (the memory row is per stage, so a budget
below the whole model's fits), the step is the slowest stage's, and the bytes predicted for
the step's micro-batches are what the plan moves."""

from __future__ import annotations

import os
from math import prod
from typing import Any

import numpy as np
import pytest

from pcompile.passes.search.ilp import IlpError
from tests import ROOT

MODEL = os.path.join(ROOT, "tests", "models", "pipeline_search.py")
ITEMSIZE = {"Float32": 4, "Float16": 2, "BFloat16": 2}


def _compile(monkeypatch: Any, memory: float | None = None, **env: str) -> Any:
    from pcompile.compiler.config.search_context import reset_cost_model_context
    from pcompile.compiler.driver.driver import compile_program

    for k, v in env.items():
        monkeypatch.setenv(f"PIPE_SEARCH_{k}", v)
    overrides = {"device_memory_capacity": memory} if memory is not None else {}
    try:
        return compile_program(MODEL, devices=8, dump=False, overrides=overrides)
    finally:
        reset_cost_model_context()


def _stage_weights(plan: dict[str, Any], blocks: int) -> list[float]:
    """Bytes of each stage's stored weight slices, from the plan's parameter layouts (the
    parallel optimizer's shards where it stores them)."""
    out = [0.0, 0.0]
    shards = plan.get("parallel_optimizer") or {}
    for name, p in plan["parameters"].items():
        if p["kind"] == "weight" and "blocks." in name:
            stage = 2 * int(name.split(".")[1]) // blocks
            shape = (shards[name]["stored_slice_shape"] if name in shards
                     else p["slice_shape"])
            out[stage] += prod(shape) * ITEMSIZE[p["dtype"]]
    return out


@pytest.mark.parametrize("scheduler,held", [("1f1b", [2, 1]), ("gpipe", [4, 4])])
def test_stages_fold_apart_and_hold_their_micro_batches(monkeypatch: Any, scheduler: str,
                                                        held: list[int]) -> None:
    from pcompile.compiler.driver.plan import build_plan

    plan = build_plan(_compile(monkeypatch, SCHEDULER=scheduler, BLOCKS="6").state).model_dump()
    search, pred = plan["search"], plan["prediction"]
    # 6 blocks, 3 a stage: block 0 reads the data (no gradient into it), so it does not
    # stand for blocks 1 and 2; stage 1's three fold together
    folded = {k.rsplit("/", 1)[-1]: n for k, n in search["ilp"]["folded_layers"].items()}
    assert folded == {"blocks-CellList (stage 0) [1-2]": 2, "blocks-CellList (stage 1)": 3}
    stages = pred["stages"]["per_stage"]
    assert [s["held_micro_batches"] for s in stages] == held
    # each stage stores its own blocks' weights, as the plan lays them out
    assert [s["memory"]["weights"] for s in stages] == pytest.approx(_stage_weights(plan, 6))
    # the rank's memory is its stage's, the plan's the largest stage's; the step the
    # slowest stage's, its m + S - 1 ticks idle (S - 1) / (m + S - 1) of the time
    assert pred["memory"]["total"] == max(s["memory"]["total"] for s in stages)
    assert pred["stages"]["micro_batches"] == 4
    assert pred["stages"]["bubble"] == pytest.approx(1 / 5)
    slowest = max(s["compute"] + s["communication"] for s in stages)
    assert pred["step_time"] == pytest.approx(slowest, rel=1e-5)
    assert search["predicted_step_time"] == pytest.approx(pred["step_time"], rel=1e-5)
    # activations: a stage holding k micro-batches holds k traced micro-batches' (the two
    # stages' blocks are alike, the last one's loss aside)
    acts = [s["memory"]["activations"] for s in stages]
    assert acts[0] / held[0] == pytest.approx(acts[1] / held[1], rel=0.2)
    # the bytes a rank moves per step (every micro-batch's collectives and transfers, the
    # weights' once): the prediction is at least what the plan's busiest rank moves
    moved = max(sum(r["ring_bytes"] or 0 for r in rows if r["op"] != "_MirrorOperator")
                for rows in plan["collectives"].values())
    assert moved <= pred["communication_bytes"] <= 1.25 * moved


@pytest.mark.slow
def test_a_budget_below_the_whole_model_fits_per_stage(monkeypatch: Any) -> None:
    """Each stage stores half the blocks: a budget that holds one stage's parameters (with
    the parallel optimizer's shards) but not the whole model's is met per stage."""
    free = _compile(monkeypatch).state.plan["prediction"]
    stage = free["memory"]["total"]
    whole = sum(s["memory"]["weights"] + s["memory"]["gradients"] + s["memory"]["optimizer"]
                for s in free["stages"]["per_stage"])
    assert whole > stage
    budget = float(np.floor(stage * 1.01))
    plan = _compile(monkeypatch, memory=budget).state.plan
    assert plan["prediction"]["fits"]
    assert plan["prediction"]["memory"]["total"] <= budget
    with pytest.raises(IlpError, match=r"no plan of 4 devices per stage \(2 pipeline "
                       r"stages\) fits .* more pipeline stages"):
        _compile(monkeypatch, memory=stage / 40)


@pytest.mark.slow
def test_recompute_inside_stages_when_the_memory_needs_it(monkeypatch: Any) -> None:
    """Under a budget the free plan (the parallel optimizer already on) does not meet, the
    search recomputes the stages' layers (pcompile recomputes inside stages since 5dfec2d):
    the program recomputes, fits the budget as predicted, and computes what one device does
    (float64)."""
    from pcompile.tools.oracle import check

    free = _compile(monkeypatch, BLOCKS="6").state.plan["prediction"]["memory"]["total"]
    budget = float(np.floor(free * 0.88))
    program = _compile(monkeypatch, memory=budget, BLOCKS="6")
    plan = program.state.plan
    assert plan["search"]["recompute"] and plan["recompute"]["recomputed_nodes"] > 0
    assert plan["prediction"]["fits"] and plan["prediction"]["memory"]["total"] <= budget
    report = check(program, steps=1)
    assert report.ok(), report.worst


def test_micro_batches_without_stages_move_what_is_predicted(monkeypatch: Any) -> None:
    """One stage, 4 micro-batches (gradient accumulation): the program is traced for one
    micro-batch; the prediction counts each micro-batch's collectives and the weights' once
    per step, and equals what every rank moves (it counted one micro-batch before)."""
    from pcompile.compiler.driver.plan import build_plan

    program = _compile(monkeypatch, STAGES="1")
    plan = build_plan(program.state).model_dump()
    pred = plan["prediction"]
    assert pred["stages"]["micro_batches"] == 4 and len(pred["stages"]["per_stage"]) == 1
    assert "(stage" not in " ".join(plan["search"]["ilp"]["folded_layers"])
    moved = [sum(r["ring_bytes"] or 0 for r in rows if r["op"] != "_MirrorOperator")
             for rows in plan["collectives"].values()]
    assert max(moved) > 0
    assert pred["communication_bytes"] == pytest.approx(max(moved), rel=0.02)
