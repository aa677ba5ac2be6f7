"""Compile cost independent of the model's full size and of the rank count (issue: scale).

Speed is measured in benchmarks/compile_scale.py, never asserted here; these tests assert the
structure that makes it so: no parameter-sized allocation, one program for every rank, dumps
only of the ranks asked for, and per-rank views that are exactly each rank's."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from pcompile.tools.compile import compile as compile_model
from tests import ROOT

GPT = os.path.join(ROOT, "examples", "gpt_block.py")


def test_compiling_never_allocates_a_parameter(tmp_path) -> None:
    """A [320, 3200000] float32 weight is 4 GB (and Adam's two moments 8 GB more): the compile,
    dumps, plan and rank programs included, allocates a small fraction of one of them."""
    model = os.path.join(ROOT, "tests", "models", "huge_weight.py")
    tracemalloc.start()
    try:
        program = compile_model(model, devices=8, out_dir=str(tmp_path / "out"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    weight = program.initial_values.source("w")
    assert weight.nbytes == 320 * 3_200_000 * 4
    assert peak < weight.nbytes / 16, f"peak {peak / 2**20:.0f} MB"
    # Nothing of the model's size is written either: the parameters are described, not stored.
    written = sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written < 16 * 2**20, f"{written} bytes written"
    manifest = json.loads((tmp_path / "out" / "params.json").read_text())
    assert manifest["params"]["w"]["init"]["initializer"] == "Normal"


@pytest.mark.slow
def test_one_program_for_512_ranks_and_the_dumps_asked_for(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPT_BATCH", "512")
    out = tmp_path / "out"
    program = compile_model(GPT, devices=512, search_mode="sharding_propagation",
                            out_dir=str(out), dump_ranks="0,511")
    assert len(program.state.graphs) == 1  # every rank runs the same rank-parametric graph
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rank_")) == [
        "rank_0", "rank_511"]
    plan = json.loads((out / "plan.json").read_text())
    assert sorted(plan["collectives"]) == ["0", "511"]
    # Each dumped rank's view is that rank's: its collectives' groups contain it.
    last = program.rank_graph(511)
    groups = [n.attrs["rank_list"] for n in last.nodes if n.op in ("AllReduce", "AllGather")]
    assert groups and all(511 in g for g in groups)
    text = (out / "rank_511" / sorted(os.listdir(out / "rank_511"))[-2]).read_text()
    assert "rank: 511" in text
    # The default at 512 devices dumps rank 0 only.
    default = compile_model(GPT, devices=512, search_mode="sharding_propagation",
                            out_dir=str(tmp_path / "d"))
    assert default.state.dump_ranks == [0]


def test_rank_views_are_the_ranks_own(tmp_path) -> None:
    """The one program printed at rank r equals rank r's concrete graph printed (`at_rank`),
    for every rank of an 8-rank plan with slices, groups and rank-dependent constants."""
    from pcompile.ir.printer import print_graph

    program = compile_model(GPT, devices=8, parallel_mode="semi_auto_parallel", dump=False)
    graph = program.rank_graphs[0]
    texts = set()
    for rank in range(8):
        text = print_graph(graph, rank)
        assert text == print_graph(program.rank_graph(rank))
        texts.add(text)
    assert len(texts) == 8  # the ranks differ (their groups and slices)


def test_the_check_runs_when_affordable_and_says_when_it_does_not(tmp_path) -> None:
    """The rule: the float64 check runs when it holds at most CHECK_BUDGET_BYTES; beyond, the
    CLI says it was skipped and how to force it (a 4 GB weight: 12 GB with Adam's moments)."""
    from click.testing import CliRunner

    from pcompile.cli import main
    from pcompile.tools.oracle import CHECK_BUDGET_BYTES, check_cost

    small = compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=8,
                          dump=False)
    assert check_cost(small) < CHECK_BUDGET_BYTES
    model = os.path.join(ROOT, "tests", "models", "huge_weight.py")
    result = CliRunner().invoke(main, [model, "--devices", "8", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "check skipped" in result.output and "--force-check" in result.output
    # not at full size: the same plan is checked on a shrunk copy (tests/tools/test_shrink.py)
    head, _, tail = result.output.partition("shrunk check: factor")
    assert "worst relative error" not in head and "worst relative error" in tail
