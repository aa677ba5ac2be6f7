"""Pipeline programs on JAX (issue 11): one program over a mesh with a stage axis on 8
virtual CPU devices (tests/pipeline_worker.py) against the numpy pipeline simulator and the
single-device program, in float64; and `pcompile examples/gpt_block.py --pipeline-stages 2
--run`: the generated program.py trained by 8 processes under jax.distributed, against the
simulator of the same float32 program and single-device training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver import compile as compile_model
from pcompile.compiler.oracle import FLOAT64_RTOL, rounding_rtol
from pcompile.compiler.runtime import ParallelRunner, StandAloneRunner, batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt_block.py")


def clean_env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items()
           if not k.startswith(("PCOMPILE_", "OMPI_", "SLURM_", "PMI_"))}
    out.update(JAX_PLATFORMS="cpu", **extra)
    return out


@pytest.mark.slow
def test_pipeline_on_jax_equals_the_simulator_and_one_device() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.pipeline_worker"], cwd=ROOT,
                          capture_output=True, text=True, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    assert set(report) == {"mlp_1f1b", "gpt_gpipe"}
    for case, result in report.items():
        # every rank's stored values (its stage's weights and optimizer state) were compared
        assert result["stored"] > 0 and result["compared"] >= result["stored"], case
        for what, err in result["worst"].items():
            assert err <= FLOAT64_RTOL, (case, what, err)
        for jax_loss, numpy_loss, single in result["losses"]:
            assert abs(jax_loss - single) <= FLOAT64_RTOL * abs(single), case
            assert abs(numpy_loss - single) <= FLOAT64_RTOL * abs(single), case


@pytest.mark.slow
def test_gpt_pipeline_trains_on_8_processes(tmp_path: Any, monkeypatch) -> None:
    """2 stages x 4 devices, 2 micro-batches, 1F1B: every rank logs the losses of the numpy
    simulator of the same float32 program, and of single-device float32 training (bound:
    `rounding_rtol`, unit roundoff x longest reduction x amplification per step)."""
    steps = 3
    env = clean_env(GPT_MICRO="2", GPT_BATCH="16")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", GPT, "--devices", "8", "--parallel-mode",
         "semi_auto_parallel", "--pipeline-stages", "2", "--out", str(out), "--run",
         "--steps", str(steps)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipeline schedule: 1f1b, 2 stages x 4 device(s), 2 micro-batch(es)" in proc.stdout
    assert "parallel plan vs single device (float64)" in proc.stdout  # the oracle ran
    monkeypatch.setenv("GPT_MICRO", "2")
    monkeypatch.setenv("GPT_BATCH", "16")
    program = compile_model(GPT, devices=8, dump=False, parallel_mode="semi_auto_parallel",
                            overrides={"pipeline_stages": 2})
    assert program.state.pipelined
    from pcompile.compiler.oracle import single_device

    ref = single_device(program)
    simulator = ParallelRunner(program)
    one = StandAloneRunner(ref, "numpy")
    data = [a for _, _, a in batches(ref, steps)]
    simulated = [simulator.step(a) for a in data]
    single = [one.step(a) for a in data]
    bound = rounding_rtol(program, np.float32, steps=steps)
    for rank in range(8):
        lines = (out / f"rank_{rank}" / "train.log").read_text().splitlines()
        got = [float(line.rsplit(" ", 1)[1]) for line in lines]
        assert len(got) == steps, rank
        np.testing.assert_allclose(got, simulated, rtol=bound)
        np.testing.assert_allclose(got, single, rtol=bound)
