"""`--search ilp`'s third mesh axis: expert parallelism as a minor factor of the data axis
(mindformers' ep), tried where the model has expert weights (passes/search/ilp.py `meshes`)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pcompile.passes.search import ilp as ilp_module
from pcompile.passes.search.ilp import IlpOptions, mesh_groups, meshes, solve
from pcompile.passes.search.time_model import PROFILES
from tests import ROOT


def test_a_mesh_offers_its_axes_and_their_runs() -> None:
    # (data, model): data (stride m, size d), model (1, m), both (1, d m)
    assert mesh_groups((2, 4)) == {(4, 2), (1, 4), (1, 8)}
    assert mesh_groups((8, 1)) == {(1, 8)}
    # (outer data, expert, model): each axis and each run of neighbours
    assert mesh_groups((2, 2, 2)) == {(4, 2), (2, 2), (1, 2), (2, 4), (1, 4), (1, 8)}
    # expert axes only where the model has experts, dividing an expert count, inside data
    assert meshes(8) == [(8, 1), (4, 2), (2, 4)]
    assert meshes(8, {4}) == [(8, 1), (4, 2, 1), (2, 4, 1), (4, 2), (2, 2, 2), (2, 4)]
    assert all(len(m) == 2 or (m[1] > 1 and m[0] > 1) for m in meshes(64, {8}))


@pytest.mark.slow
def test_the_expert_axis_gives_a_faster_mixture_of_experts_plan(monkeypatch: Any) -> None:
    """examples/mixtral.py with its shard()s removed on 8 devices: with the expert axis the
    search finds a plan faster than every (data, model) mesh gives, the experts split over it
    (a (2, 2, 2) mesh at this size), and plan.json names it."""
    for name in [n for n in os.environ if n.startswith(("LLAMA_", "MIXTRAL_"))]:
        monkeypatch.delenv(name)
    env = {"LLAMA_STRATEGIES": "none", "MIXTRAL_HIDDEN": "256", "MIXTRAL_FFN": "1024",
           "MIXTRAL_SEQ": "64", "MIXTRAL_BATCH": "16"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from pcompile.compiler.driver import compile_program

    program = compile_program(os.path.join(ROOT, "examples", "mixtral.py"), devices=8,
                              search_mode="ilp", dump=False)
    from pcompile.tools.render import prediction_text

    search = program.state.plan["search"]
    assert search["mesh"].get("expert", 1) > 1, search["mesh"]
    summary = " ".join(t for t, _ in prediction_text(program.state.plan["prediction"], search,
                                                      None))
    assert f"(expert axis {search['mesh']['expert']} of data)" in summary, summary
    w1 = program.state.assignment.param_layouts["layers.0.moe.experts.w1"]
    assert w1.splits[0] > 1, w1
    cg = program.state.search.cost_graph
    options = IlpOptions(PROFILES["h100"], PROFILES["h100"].memory)
    with_expert = solve(cg, options)
    monkeypatch.setattr(ilp_module, "meshes", lambda devices, experts=(): meshes(devices))
    without = solve(cg, options)
    assert len(without.mesh) == 2 and len(with_expert.mesh) == 3
    assert with_expert.step_time < without.step_time * (1 - 1e-6)
