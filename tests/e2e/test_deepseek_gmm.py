"""examples/deepseek.py with DEEPSEEK_USE_GMM=1 (mindformers' use_gmm, MoEV3: dropless, the
experts in a Morph region with AlltoAllV and GroupedMatmul; issue 35 item 4): the region is
written into each rank's program on its slices (one expert per rank, the AlltoAlls over the 8
ranks, no capacity), 8 ranks train like one device in float64, and so do 8 JAX processes
(slow). The batch with empty and overfull experts is tests/compiler/test_morph.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT
from tests.e2e.test_deepseek import knobs
from tests.multiprocess import clean_env

DEEPSEEK = os.path.join(ROOT, "examples", "deepseek.py")


@pytest.mark.slow  # a compile and a float64 check on 8 devices of two steps (~5 s of CPU)
def test_gmm_variant_trains_like_one_device(monkeypatch: Any) -> None:
    """dp 4 x mp 2 with the MoE layer as MoEV3: one Morph per MoE layer in the global graph;
    on a rank its body (GroupedMatmul of the rank's expert, (1, h, 2F) and (1, F, h); the
    counts' AlltoAll and the AlltoAllVs' padded AlltoAlls over the 8 ranks), no TopKRouter
    (dropless); two steps equal one device's (float64: weights, moments, load and bias)."""
    knobs(monkeypatch, USE_GMM="1")
    program = compile_model(DEEPSEEK, devices=8, dump=False)
    assert [n.op for n in program.graph.nodes].count("Morph") == 1
    assert not any(n.op in ("TopKRouter", "Morph") for n in program.rank_graph(0).nodes)
    rank = program.rank_graph(6)
    gmm = [n.operands[1].shape for n in rank.nodes if n.op == "GroupedMatmul"]
    assert gmm[:2] == [(1, 64, 64), (1, 32, 64)], gmm
    assert sum(n.op == "AlltoAll" and len(n.attrs["rank_list"]) == 8
               for n in rank.nodes) >= 4
    report = check(program, steps=2)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"


def test_gmm_variant_needs_the_experts_over_every_rank(monkeypatch: Any) -> None:
    knobs(monkeypatch, USE_GMM="1", EXPERTS="4")
    with pytest.raises(Exception, match="DEEPSEEK_USE_GMM=1 puts E / ep experts"):
        compile_model(DEEPSEEK, devices=8, dump=False)


@pytest.mark.slow  # a compile and a float64 check on 8 devices of two steps (~5 s of CPU)
def test_gmm_variant_with_ep_smaller_than_the_devices(monkeypatch: Any) -> None:
    """DEEPSEEK_EP=4 of dp 4 x mp 2 (mindformers' FFN: Layout (2, 4, 1, 1, 1), ep dividing
    dp * mp): the expert-parallel groups are made with create_group as mindformers makes them;
    a rank holds 2 of the 8 experts and the region's AlltoAlls run over its own group of 4;
    two steps equal one device's (float64). Refused before (the region's collectives took the
    world group only)."""
    knobs(monkeypatch, USE_GMM="1", EP="4")
    program = compile_model(DEEPSEEK, devices=8, dump=False)
    for rank, group in ((1, (0, 1, 2, 3)), (6, (4, 5, 6, 7))):
        graph = program.rank_graph(rank)
        assert {n.attrs["rank_list"] for n in graph.nodes if n.op == "AlltoAll"} == {group}
        gmm = [n.operands[1].shape for n in graph.nodes if n.op == "GroupedMatmul"]
        assert gmm[:2] == [(2, 64, 64), (2, 32, 64)], gmm
    report = check(program, steps=2)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"


def test_gmm_variant_refuses_an_ep_that_does_not_divide_the_devices(monkeypatch: Any) -> None:
    knobs(monkeypatch, USE_GMM="1", EP="3")
    with pytest.raises(Exception, match="must divide data_parallel \\* model_parallel"):
        compile_model(DEEPSEEK, devices=8, dump=False)


@pytest.mark.slow
@pytest.mark.parametrize("ep", ["8", "4"])
def test_gmm_variant_8_processes_train_like_one_device(monkeypatch: Any, tmp_path: Any,
                                                       ep: str) -> None:
    """`DEEPSEEK_USE_GMM=1 DEEPSEEK_EP=<ep> pcompile examples/deepseek.py --devices 8 --run`
    (float32; ep 8 = every rank, ep 4 = two expert-parallel groups): every rank the same loss,
    within t x eps x K of the float64 single device at step t (K the longest reduction,
    test_llama's rule)."""
    steps = 3
    env = clean_env("DEEPSEEK_", "LLAMA_", DEEPSEEK_DTYPE="float32", DEEPSEEK_USE_GMM="1",
                    DEEPSEEK_EP=ep)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", DEEPSEEK, "--devices", "8", "--out", str(out),
         "--run", "--steps", str(steps), "--no-check", "--dump-ranks", "0"],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every rank reports the same loss" in proc.stdout
    got = [float(line.rsplit(" ", 1)[1])
           for line in (out / "rank_0" / "train.log").read_text().splitlines()]
    knobs(monkeypatch, DTYPE="float32", USE_GMM="1", EP=ep)
    one = compile_model(DEEPSEEK, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    want = [runner.step(a) for _, _, a in batches(one, steps)]
    longest = max(max(v.type.shape, default=1) for node in one.graph.nodes
                  for v in node.operands if hasattr(v.type, "shape"))
    eps = 2.0 ** -23
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= step * eps * longest * abs(w), (step, g, w)


@pytest.mark.slow  # a searched compile and a float64 check on 8 devices (~5 s of CPU)
def test_gmm_variant_searched_keeps_the_regions_layouts(monkeypatch: Any) -> None:
    """LLAMA_STRATEGIES=none (auto_parallel, every shard() removed): the search decides the
    other ops; the Morph keeps its Layouts (its own code's: a search cannot choose them), and
    the plan trains like one device."""
    knobs(monkeypatch, USE_GMM="1", LLAMA_STRATEGIES="none")
    program = compile_model(DEEPSEEK, devices=8, dump=False)
    morph = next(n for n in program.graph.nodes if n.op == "Morph")
    assert program.state.assignment.sharding(morph).strategy[3] == (8, 1, 1)
    report = check(program, steps=1)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"
