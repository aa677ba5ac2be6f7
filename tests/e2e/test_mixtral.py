"""examples/mixtral.py: the router's dispatch, combine and balance loss against routing written
in numpy; the expert-parallel plans against one device (float64 oracle) with mindformers'
collectives (two AlltoAlls per MoE layer and direction, no expert activation gathered, expert
weights stored split by expert); 8 processes training like one device (slow)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT
from tests.multiprocess import clean_env

MIXTRAL = os.path.join(ROOT, "examples", "mixtral.py")
ROUTER = os.path.join(ROOT, "tests", "models", "moe_router.py")
EXPERT_WEIGHTS = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")


def knobs(monkeypatch: Any, **env: str) -> None:
    for name in [n for n in os.environ if n.startswith(("MIXTRAL_", "LLAMA_", "ROUTER_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name if name.startswith("ROUTER_") else f"MIXTRAL_{name}", value)


def numpy_routing(probs: np.ndarray, k: int, capacity_factor: float) -> tuple[Any, Any, Any]:
    """Top-k routing with capacity, written directly: per group, every token's first choice
    in token order, then its second ...; a choice takes its expert's next slot while the
    expert has fewer than C = ceil(k T factor / E) (at most k T); its combine weight is its
    probability over the sum of the token's k chosen probabilities."""
    groups, tokens, experts = probs.shape
    capacity = min(math.ceil(k * tokens * capacity_factor / experts), k * tokens)
    dispatch = np.zeros((groups, tokens, experts, capacity))
    combine = np.zeros_like(dispatch)
    share = np.zeros((groups, experts))
    for g in range(groups):
        order = np.argsort(-probs[g], axis=-1, kind="stable")[:, :k]
        chosen = np.take_along_axis(probs[g], order, axis=-1)
        gates = chosen / chosen.sum(-1, keepdims=True)
        used = np.zeros(experts, int)
        for choice in range(k):
            for t in range(tokens):
                e = order[t, choice]
                share[g, e] += 1.0 / (k * tokens)
                if used[e] < capacity:
                    dispatch[g, t, e, used[e]] = 1.0
                    combine[g, t, e, used[e]] = gates[t, choice]
                used[e] += 1
    aux = experts * float(np.mean(np.sum(share * probs.mean(axis=1), axis=-1)))
    flat = (groups, tokens, experts * capacity)
    return dispatch.reshape(flat), combine.reshape(flat), aux


@pytest.mark.parametrize("tokens,top_k,factor", [(16, 2, 1.1), (16, 1, 1.0), (24, 2, 0.5),
                                                 (4, 3, 4.0)])
def test_router_matches_routing_written_in_numpy(monkeypatch: Any, tokens: int, top_k: int,
                                                 factor: float) -> None:
    """Capacities that drop choices (factor 0.5, 1.0), keep all (1.1 at 16 tokens rarely
    drops; 4.0 never: C is capped at k T), top 1 to 3 of 8."""
    knobs(monkeypatch, TOP_K=str(top_k), CAPACITY=str(factor), ROUTER_TOKENS=str(tokens))
    program = compile_model(ROUTER, devices=1, dump=False)
    runner = StandAloneRunner(program, "numpy", float64=True)
    dispatch, combine, aux, probs = runner.run(list(next(batches(program, 1))[2]))
    want_dispatch, want_combine, want_aux = numpy_routing(probs, top_k, factor)
    assert np.array_equal(dispatch, want_dispatch)
    np.testing.assert_allclose(combine, want_combine, rtol=1e-12, atol=0)
    np.testing.assert_allclose(float(np.asarray(aux).sum()), want_aux, rtol=1e-12)
    if factor < 1.0:  # the case drops choices: some tokens keep fewer than k slots
        assert dispatch.sum() < top_k * dispatch.shape[0] * tokens


def _layout_of(program: Any, name: str) -> Any:
    return program.state.assignment.param_layouts[name]


@pytest.mark.parametrize("env,dp,ep", [pytest.param({}, 8, 8, marks=pytest.mark.slow),
                                       ({"MP": "2"}, 4, 4),
                                       ({"EP": "2", "DTYPE": "float32"}, 8, 2),
                                       ({"MP": "2", "EP": "2"}, 4, 2)])
def test_expert_parallel_plans_train_like_one_device(monkeypatch: Any, tmp_path: Any,
                                                     env: dict[str, str], dp: int,
                                                     ep: int) -> None:
    """The float64 oracle on two steps; mindformers' collectives: per MoE layer one dispatch
    and one combine AlltoAll over ep ranks forward and their transposes backward (also when
    ep < dp: the experts take the data-parallel axis's minor factor), no AllGather or
    ReduceScatter of expert activations; each expert weight split by expert over ep (and its
    FFN size over mp)."""
    knobs(monkeypatch, **env)
    out = tmp_path / "out"
    program = compile_model(MIXTRAL, devices=8, out_dir=str(out), dump_ranks="0")
    report = check(program, steps=2)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"
    plan = json.loads((out / "plan.json").read_text())
    rows = [r for r in plan["collectives"]["0"] if r["op"] != "_MirrorOperator"]
    layers = 2
    for phase in ("forward", "backward"):
        alltoall = [r for r in rows if r["op"] == "AlltoAll" and r["phase"] == phase]
        assert all("/moe-MoE/" in r["node"] for r in alltoall)
        assert len(alltoall) == 2 * layers, [r["node"] for r in alltoall]
        assert all(len(r["rank_list"]) == ep for r in alltoall)
    gathers = [r["node"] for r in rows if r["op"] in ("AllGather", "ReduceScatter")
               and "/moe-MoE/" in r["node"]]
    assert gathers == []
    mp = 8 // dp
    for layer in range(layers):
        for name in EXPERT_WEIGHTS:
            splits = _layout_of(program, f"layers.{layer}.{name}").splits
            ffn_dim = 2 if name.endswith(("w1", "w3")) else 1
            assert splits[0] == ep and splits[ffn_dim] == mp, (name, splits)


def test_routing_groups_must_divide_over_data_parallel(monkeypatch: Any) -> None:
    knobs(monkeypatch, GROUPS="4")
    with pytest.raises(Exception, match="MIXTRAL_GROUPS=4 routing groups must be a multiple"):
        compile_model(MIXTRAL, devices=8, dump=False)


@pytest.mark.slow
def test_8_processes_train_like_one_device(monkeypatch: Any, tmp_path: Any) -> None:
    """`pcompile examples/mixtral.py --devices 8 --run` (dp 8 x ep 8, float32): the generated
    program's losses on 8 JAX processes against the float64 single-device program, within
    t x eps x K at step t (K the longest reduction: test_llama's rule)."""
    steps = 3
    env = clean_env("MIXTRAL_", "LLAMA_", MIXTRAL_DTYPE="float32")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", MIXTRAL, "--devices", "8", "--out", str(out),
         "--run", "--steps", str(steps), "--no-check", "--dump-ranks", "0"],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every rank reports the same loss" in proc.stdout
    lines = (out / "rank_0" / "train.log").read_text().splitlines()
    got = [float(line.rsplit(" ", 1)[1]) for line in lines]
    knobs(monkeypatch, DTYPE="float32")
    one = compile_model(MIXTRAL, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    want = [runner.step(a) for _, _, a in batches(one, steps)]
    longest = max(max(v.type.shape, default=1) for node in one.graph.nodes
                  for v in node.operands if hasattr(v.type, "shape"))
    eps = 2.0 ** -23
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= step * eps * longest * abs(w), (step, g, w)


def test_shrunk_check_shrinks_the_capacity_the_router_computes(monkeypatch: Any) -> None:
    """The slot OneHot is indexed by positions the router computes (CumSum, ReduceSum): an
    index past a shrunk depth is a row of off_value on both sides, so the capacity dim
    shrinks with the tokens (it used to be pinned, leaving a real-size MoE unshrinkable), and
    the shrunk plan still agrees with its single device."""
    from pcompile.tools.shrink import shrunk_check

    knobs(monkeypatch, DTYPE="float32", SEQ="64")  # 64 tokens a group: capacity 18
    program = compile_model(MIXTRAL, devices=8, dump=False)
    result = shrunk_check(program, factor=4)
    assert result.report.ok(), result.report.worst

    def depths(p: Any) -> list[int]:
        return [n.attrs["depth"] for n in p.graph.nodes
                if n.op == "OneHot" and "router" in n.scope]

    full, small = depths(program), depths(result.program)
    assert len(full) == len(small) == 4  # experts and slots, two layers
    assert any(s < f for s, f in zip(small, full)), (full, small)
