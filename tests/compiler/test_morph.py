"""`ops.Morph` (self_define_shard, issue 35 item 4): mindformers' MoEV3 with its experts in a
Morph region (tests/models/morph_moe.py: AlltoAllV with run-time counts, GroupedMatmul of the
rank's experts) on a batch where experts 2..7 get no tokens and 0 and 1 more than a capacity
would keep: the region's ops written into each rank's program on its slices, 8 ranks training
like one device (float64 oracle; 8 JAX processes, slow); one device runs the function itself;
a Morph without Layouts is refused with one message."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT
from tests.multiprocess import clean_env

MODEL = os.path.join(ROOT, "tests", "models", "morph_moe.py")


def test_morph_region_trains_like_one_device() -> None:
    """The global graph holds one Morph node; each rank's program holds its body instead, on
    the rank's slices: one expert's weights (1, h, 2F) in GroupedMatmul, the AlltoAlls over
    the 8 ranks; three steps equal one device's (every loss, weight and gradient, float64)."""
    program = compile_model(MODEL, devices=8, dump=False)
    morph = [n for n in program.graph.nodes if n.op == "Morph"]
    assert len(morph) == 1 and morph[0].attrs["body"] == "ffn_forward.1"
    rank = program.rank_graph(5)
    assert not any(n.op == "Morph" for n in rank.nodes)
    gmm = [n for n in rank.nodes if n.op == "GroupedMatmul"]
    assert [n.operands[1].shape for n in gmm][:2] == [(1, 8, 16), (1, 8, 8)]
    assert sum(n.op == "AlltoAll" and len(n.attrs["rank_list"]) == 8 for n in rank.nodes) >= 4
    layout = program.state.assignment.param_layouts["w1"]
    assert layout.splits == (8, 1, 1)
    report = check(program, steps=3)
    assert report.ok(), report


def test_morph_on_one_device_runs_the_function() -> None:
    program = compile_model(MODEL, devices=1, dump=False)
    assert not any(n.op == "Morph" for n in program.graph.nodes)
    assert any(n.op == "GroupedMatmul" for n in program.graph.nodes)


def test_morph_without_layouts_is_refused(tmp_path: Any) -> None:
    text = open(MODEL).read().replace(
        "self.hook_ffn_forward.shard(", "(lambda **_: None)(")
    path = tmp_path / "morph_no_layouts.py"
    path.write_text(text)
    with pytest.raises(PcompileError) as info:
        compile_model(str(path), devices=8, dump=False)
    message = str(info.value)
    for part in ("Morph", "ffn_forward", "self_define_shard", "in_strategy=", "morph_no_layouts"):
        assert part in message, (part, message)


@pytest.mark.slow
def test_8_processes_train_like_one_device(tmp_path: Any) -> None:
    """`pcompile tests/models/morph_moe.py --devices 8 --run` (8 JAX processes, float32): every
    rank the same loss, within t x eps x K of the float64 single device at step t (K the
    longest reduction, test_llama's rule)."""
    steps = 3
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", MODEL, "--devices", "8", "--out", str(out),
         "--run", "--steps", str(steps), "--no-check", "--dump-ranks", "0"],
        capture_output=True, text=True, env=clean_env(), timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every rank reports the same loss" in proc.stdout
    got = [float(line.rsplit(" ", 1)[1])
           for line in (out / "rank_0" / "train.log").read_text().splitlines()]
    one = compile_model(MODEL, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    want = [runner.step(a) for _, _, a in batches(one, steps)]
    longest = max(max(v.type.shape, default=1) for node in one.graph.nodes
                  for v in node.operands if hasattr(v.type, "shape"))
    eps = 2.0 ** -23
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= step * eps * longest * abs(w), (step, g, w)


def test_a_recomputed_region_is_recomputed(tmp_path: Any) -> None:
    """A Morph marked for recomputation (`recompute()`, as inside a recomputed cell): its
    body's ops are recomputed for the backward (a duplicated copy of each GroupedMatmul) and the
    plan still trains like one device."""
    text = open(MODEL).read().replace(
        'self.hook_ffn_forward.add_prim_attr("self_define_shard", True)',
        'self.hook_ffn_forward.add_prim_attr("self_define_shard", True).recompute()')
    path = tmp_path / "morph_recompute.py"
    path.write_text(text)
    program = compile_model(str(path), devices=8, dump=False)
    rank = program.rank_graph(0)
    assert sum(n.op == "GroupedMatmul" and n.attrs.get("duplicated") is True
               for n in rank.nodes) == 2
    assert check(program, steps=2).ok()


def test_the_shrunk_check_refuses_a_region_with_one_message() -> None:
    """One device runs the region's function itself, so a shrunk single-device copy is not the
    plan's graph: the shrunk check names the region and the way out (it said only that the
    graphs differ)."""
    from pcompile.tools.shrink import shrunk_check

    program = compile_model(MODEL, devices=8, dump=False)
    with pytest.raises(PcompileError) as info:
        shrunk_check(program, factor=2)
    message = str(info.value)
    for part in ("Morph region", "hook_ffn_forward", "morph_moe.py", "--force-check"):
        assert part in message, (part, message)


def test_expert_parallel_smaller_than_the_world(monkeypatch: Any) -> None:
    """MORPH_MOE_EP=4 of 8 devices (mindformers' FFN with outer_dp 2): the model creates its
    expert-parallel group as mindformers does (create_group of the 4 consecutive ranks of
    rank 0, the compiling rank); in each rank's program the region's AlltoAlls run over that
    rank's own group (ranks 0..3 or 4..7), a rank holds 2 of the 8 experts, and three steps
    equal one device's in float64. (Before, the region's collectives took the world group:
    `AlltoAll(4, ..., group)` was refused.)"""
    monkeypatch.setenv("MORPH_MOE_EP", "4")
    program = compile_model(MODEL, devices=8, dump=False)
    assert program.state.assignment.param_layouts["w1"].splits == (4, 1, 1)
    for rank, group in ((1, (0, 1, 2, 3)), (6, (4, 5, 6, 7))):
        graph = program.rank_graph(rank)
        groups = {n.attrs["rank_list"] for n in graph.nodes if n.op == "AlltoAll"}
        assert groups == {group}, (rank, groups)
        gmm = [n.operands[1].shape for n in graph.nodes if n.op == "GroupedMatmul"]
        assert gmm[:2] == [(2, 8, 16), (2, 8, 8)]
    report = check(program, steps=3)
    assert report.ok(), report


JAX_EP_CHECK = """
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)
import numpy as np
from pcompile.backends.jax.spmd import JaxSpmdRunner
from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import single_device
from pcompile.tools.runners import StandAloneRunner
program = compile_model(sys.argv[1], devices=8, dump=False)
ref = single_device(program)
jr = JaxSpmdRunner(program, float64=True)
one = StandAloneRunner(ref, "numpy", float64=True)
for name in one.values:
    if name in program.initial_values:
        one.values[name] = np.asarray(program.initial_values[name], np.float64)
losses = [(jr.step(a), one.step(a)) for _, _, a in batches(ref, 3)]
worst = 0.0
for name, want in one.values.items():
    got = np.asarray(jr.global_value(name), np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-6)
    worst = max(worst, float(np.max(np.abs(got - want))) / scale)
print("REPORT " + json.dumps({"losses": losses, "worst": worst,
                              "mesh": list(jr.plan.mesh.sizes),
                              "fallback": sum(1 for n in jr.plan.nodes if n.kind == "collective"
                                              and n.collective.axes is None)}))
"""


TP_MODEL = os.path.join(ROOT, "tests", "models", "morph_tp.py")


def test_a_region_over_a_strided_group() -> None:
    """tests/models/morph_tp.py: a region's AllGather and AlltoAll over the tp group a
    create_group of the strided ranks [0, 4] made (Layout (tp 2, dp 4)); on each rank they run
    over its own pair (rank 7: [3, 7]), and so do the backward's ReduceScatter and AlltoAll;
    two steps equal one device's in float64."""
    program = compile_model(TP_MODEL, devices=8, dump=False)
    for rank, group in ((0, (0, 4)), (7, (3, 7))):
        graph = program.rank_graph(rank)
        found = [(n.op, n.attrs["rank_list"]) for n in graph.nodes
               if n.op in ("AllGather", "AlltoAll", "ReduceScatter")]
        assert sorted(found) == sorted([("AllGather", group), ("AlltoAll", group),
                                        ("AlltoAll", group), ("ReduceScatter", group)]), found
    report = check(program, steps=2)
    assert report.ok(), report


@pytest.mark.slow  # a JAX process of 8 virtual CPU devices (3-5 s each)
@pytest.mark.parametrize("model, env", [(MODEL, {"MORPH_MOE_EP": "4"}), (TP_MODEL, {})],
                         ids=["ep4_of_8", "strided_tp"])
def test_regions_over_groups_on_jax(model: str, env: dict[str, str]) -> None:
    """The same plans (MORPH_MOE_EP=4 of 8; morph_tp's strided pairs) as one SPMD JAX program
    over 8 CPU devices in float64: the sub-group collectives lower to mesh axes (no fallback
    group), and three steps' losses and weights equal one device's within the oracle's float64
    bound."""
    import json

    from pcompile.tools.oracle import FLOAT64_RTOL

    proc = subprocess.run([sys.executable, "-c", JAX_EP_CHECK, model], cwd=ROOT,
                          env=dict(clean_env(), JAX_PLATFORMS="cpu", **env),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    assert report["fallback"] == 0, report
    for got, want in report["losses"]:
        assert abs(got - want) <= FLOAT64_RTOL * abs(want), report
    assert report["worst"] <= FLOAT64_RTOL, report
