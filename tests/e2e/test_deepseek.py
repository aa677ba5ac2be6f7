"""examples/deepseek.py (DeepSeek-V3 as mindformers writes it, issue 35 item 6): the tiny default
on 8 devices against one device (float64 oracle) with mindformers' expert-parallel collectives
(one dispatch and one combine AlltoAll per MoE layer and direction over ep ranks), the state the
step updates (the expert load and the aux-loss-free bias) stored in its layout and counted
independently, the fused router equal to the unfused one, the variants (dp 8 x ep 8, the
BatchMatMul attention, MTP, no sequence parallelism: slow), and 8 processes training like one
device (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, check
from pcompile.tools.runners import ParallelRunner, StandAloneRunner
from tests import ROOT
from tests.multiprocess import clean_env

DEEPSEEK = os.path.join(ROOT, "examples", "deepseek.py")
ROUTER = "model.layers.1.feed_forward.routed_experts.router"
LOAD, BIAS = f"{ROUTER}.expert_load", f"{ROUTER}.topk_bias"
EXPERT_WEIGHTS = tuple(f"model.layers.1.feed_forward.routed_experts.ffn.{w}"
                       for w in ("w1", "w2", "w3"))


def knobs(monkeypatch: Any, **env: str) -> None:
    for name in [n for n in os.environ if n.startswith(("DEEPSEEK_", "LLAMA_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name if name.startswith("LLAMA_") else f"DEEPSEEK_{name}", value)


def _plan_checks(program: Any, out: Any, dp: int, ep: int, moe_layers: int = 1,
                 recompute: bool = False) -> None:
    plan = json.loads((out / "plan.json").read_text())
    rows = [r for r in plan["collectives"]["0"] if r["op"] != "_MirrorOperator"]
    for phase in ("forward", "backward"):
        alltoall = [r for r in rows if r["op"] == "AlltoAll" and r["phase"] == phase]
        assert all("/routed_experts-MoEV2/" in r["node"] for r in alltoall)
        # a recomputed layer runs its forward AlltoAlls again for the backward (dumped as
        # forward ops)
        per_layer = 4 if recompute and phase == "forward" else 2
        assert len(alltoall) == per_layer * moe_layers, [r["node"] for r in alltoall]
        assert all(len(r["rank_list"]) == ep for r in alltoall)
    mp = 8 // dp
    for name in EXPERT_WEIGHTS:
        splits = program.state.assignment.param_layouts[name].splits
        ffn_dim = 2 if name.endswith(("w1", "w3")) else 1
        assert splits[0] == ep and splits[ffn_dim] == mp, (name, splits)
    for name in (LOAD, BIAS):  # state, stored whole on every rank as mindformers lays it out
        layout = program.state.assignment.param_layouts[name]
        assert all(e == -1 for e in layout.tensor_map), (name, layout)


@pytest.mark.slow  # a compile and a float64 check on 8 devices of three steps (~7 s of CPU)
def test_default_trains_like_one_device_with_the_state_the_step_updates(monkeypatch: Any,
                                                                        tmp_path: Any) -> None:
    """dp 4 x mp 2 x ep 4 with sequence parallelism, flash attention, the fused router: the
    float64 oracle on three steps (every weight, moment, the expert load and the bias); the
    load a step leaves sums to one (each group's choices are a distribution over the experts,
    averaged over the groups; the callback's arithmetic zeroes it at the next step's start),
    the bias moves by 0.001 a step from the second step on (the first starts from no load)."""
    knobs(monkeypatch)
    out = tmp_path / "out"
    program = compile_model(DEEPSEEK, devices=8, out_dir=str(out), dump_ranks="0")
    assert LOAD in program.output_names and BIAS in program.output_names
    assert any(n.op == "TopKRouter" for n in program.graph.nodes)
    assert sum(n.op == "AssignAdd" for n in program.graph.nodes) == 2
    report = check(program, steps=3)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"
    assert report.errors[LOAD] <= FLOAT64_RTOL and report.errors[BIAS] <= FLOAT64_RTOL
    _plan_checks(program, out, dp=4, ep=4)
    runner = ParallelRunner(program, float64=True)
    for step, (_, _, arrays) in enumerate(batches(program, 3), start=1):
        runner.step(arrays)
        assert abs(float(runner.global_value(LOAD).sum()) - 1.0) <= FLOAT64_RTOL
        moves = np.round(runner.global_value(BIAS) / 0.001)
        assert np.all(np.abs(moves) <= step - 1) and (step == 1 or np.any(moves != 0)), moves


@pytest.mark.slow  # two compiles and two float64 runs (~4 s of CPU)
def test_the_fused_router_trains_like_the_unfused_one(monkeypatch: Any) -> None:
    """use_fused_ops_topkrouter on and off: the same losses and the same updated values after
    a step, bit for bit (one device, float64)."""
    results = []
    for fused in ("1", "0"):
        knobs(monkeypatch, FUSED_ROUTER=fused)
        program = compile_model(DEEPSEEK, devices=1, dump=False)
        assert any(n.op == "TopKRouter" for n in program.graph.nodes) == (fused == "1")
        runner = StandAloneRunner(program, "numpy", float64=True)
        losses = [runner.step(a) for _, _, a in batches(program, 2)]
        results.append((losses, {k: np.asarray(v) for k, v in runner.values.items()}))
    (fused_losses, fused_values), (losses, values) = results
    assert fused_losses == losses
    assert fused_values.keys() == values.keys()
    for name, value in values.items():
        assert np.array_equal(fused_values[name], value), name


@pytest.mark.slow  # four compiles and float64 checks (~8 s)
@pytest.mark.parametrize("env,dp,ep,moe_layers", [
    ({"MP": "1"}, 8, 8, 1),                      # dp 8 x ep 8, as the target
    ({"LLAMA_FLASH": "0", "FUSED_ROUTER": "0"}, 4, 4, 1),
    ({"MTP": "1"}, 4, 4, 2),                     # the MTP layer is a MoE layer too
    ({"SEQ_PARALLEL": "0", "EP": "2", "DTYPE": "float32"}, 4, 2, 1),
    ({"TOPK_METHOD": "group_limited_greedy"}, 4, 4, 1),  # Tensor.ge/min/repeat, masked_fill
    ({"RECOMPUTE": "1", "PARALLEL_OPTIMIZER": "1"}, 4, 4, 1),  # the yaml's memory options
])
def test_variants_train_like_one_device(monkeypatch: Any, tmp_path: Any, env: dict[str, str],
                                        dp: int, ep: int, moe_layers: int) -> None:
    knobs(monkeypatch, **env)
    out = tmp_path / "out"
    program = compile_model(DEEPSEEK, devices=8, out_dir=str(out), dump_ranks="0")
    report = check(program, steps=2)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"
    _plan_checks(program, out, dp=dp, ep=ep, moe_layers=moe_layers,
                 recompute=bool(env.get("RECOMPUTE")))
    if env.get("RECOMPUTE"):
        assert any(n.attrs.get("recompute") is True for n in program.graph.nodes)
        assert program.state.opt_shard and LOAD not in program.state.opt_shard


@pytest.mark.slow  # a compile for 2048 devices (~3 s)
def test_the_671b_preset_compiles_for_2048_devices(monkeypatch: Any) -> None:
    """DEEPSEEK_PRESET=v3_671b's layers (4 of its 61: 3 dense, 1 MoE) at dp 512 x mp 4 x ep 8
    without pipeline stages and the parallel optimizer (DEEPSEEK_PP=1,
    DEEPSEEK_PARALLEL_OPTIMIZER=0; the yaml's stages: test_deepseek_pipeline.py): the yaml's
    sizes compile, the expert weights [256, 7168, 2048] stored split by expert over
    8 and by FFN over 4, the MLA projections' latents whole."""
    knobs(monkeypatch, PRESET="v3_671b", LAYERS="4", MP="4", EP="8", GROUPS="512", PP="1",
          PARALLEL_OPTIMIZER="0")
    program = compile_model(DEEPSEEK, devices=2048, dump=False, dump_ranks="0")
    layouts = program.state.assignment.param_layouts
    w1 = layouts["model.layers.3.feed_forward.routed_experts.ffn.w1"]
    assert w1.shape == (256, 7168, 2048) and w1.slice_shape == (32, 7168, 512)
    assert layouts["model.layers.0.attention.q2l_proj.weight"].slice_shape == (1536, 7168)
    assert layouts["model.layers.0.attention.lkv2kv_v.weight"].slice_shape == (128 * 128 // 4,
                                                                                512)


@pytest.mark.slow  # two compiles and a step each (~3 s)
def test_group_limited_routing_chooses_within_the_best_groups(monkeypatch: Any) -> None:
    """With 4 groups of 2 experts and 1 group per token, each token's 2 experts are its best
    group's both: the first step routes otherwise than greedy top 2 (another loss), and
    every choice pair is one group (the experts' load per group pair is even)."""
    losses = []
    for method in ("greedy", "group_limited_greedy"):
        knobs(monkeypatch, TOPK_METHOD=method, DTYPE="float32")
        program = compile_model(DEEPSEEK, devices=1, dump=False)
        runner = StandAloneRunner(program, "numpy", float64=True)
        _, _, arrays = next(batches(program, 1))
        losses.append(runner.step(arrays))
        load = np.asarray(runner.values[LOAD])
    assert losses[0] != losses[1]
    # each token chose both experts of one group: the two experts of a group share its load
    np.testing.assert_allclose(load[0::2], load[1::2], rtol=0, atol=1e-12)


def test_routing_groups_must_divide_over_data_parallel(monkeypatch: Any) -> None:
    knobs(monkeypatch, GROUPS="2")
    with pytest.raises(Exception, match="DEEPSEEK_GROUPS=2 routing groups must be a multiple"):
        compile_model(DEEPSEEK, devices=8, dump=False)


@pytest.mark.slow
def test_8_processes_train_like_one_device(monkeypatch: Any, tmp_path: Any) -> None:
    """`pcompile examples/deepseek.py --devices 8 --run` (float32): every rank reports the same
    loss; the losses against the float64 single-device program within t x eps x K at step t
    (K the longest reduction: test_llama's rule); the last checkpoint holds the last step's
    load, which sums to one."""
    from safetensors.numpy import load_file

    steps = 3
    env = clean_env("DEEPSEEK_", "LLAMA_", DEEPSEEK_DTYPE="float32")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", DEEPSEEK, "--devices", "8", "--out", str(out),
         "--run", "--steps", str(steps), "--no-check", "--dump-ranks", "0"],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every rank reports the same loss" in proc.stdout
    lines = (out / "rank_0" / "train.log").read_text().splitlines()
    got = [float(line.rsplit(" ", 1)[1]) for line in lines]
    knobs(monkeypatch, DTYPE="float32")
    one = compile_model(DEEPSEEK, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    want = [runner.step(a) for _, _, a in batches(one, steps)]
    longest = max(max(v.type.shape, default=1) for node in one.graph.nodes
                  for v in node.operands if hasattr(v.type, "shape"))
    eps = 2.0 ** -23
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= step * eps * longest * abs(w), (step, g, w)
    saved = sorted((out / "checkpoints" / "rank_5").glob("*.safetensors"))[-1]
    load = load_file(str(saved))[LOAD]
    assert load.shape == (8,) and abs(float(load.sum()) - 1.0) <= 1e-5
