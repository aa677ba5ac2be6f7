"""The training forms on JAX: one SPMD program on 8 virtual CPU devices (a subprocess,
tests/train_forms_worker.py) against the numpy simulator and the single-device program, in
float64; and `examples/train_step.py` (dynamic loss scale, clipping, schedule, loss inside the
network) trained by 8 JAX processes with an overflowing step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL
from tests import ROOT
from tests.multiprocess import clean_env


@pytest.mark.slow  # a multi-process run (~11 s of CPU)
def test_training_forms_on_jax_spmd_equal_the_simulator_and_one_device() -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.train_forms_worker"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    for case, result in report.items():
        for what, err in result["worst"].items():
            assert err <= FLOAT64_RTOL, (case, what, err)
    losses = report["train_step"]["losses"]
    assert len(losses) == 6
    for step, (jax_loss, numpy_loss, single) in enumerate(losses, start=1):
        if step == 3:  # the overflowing step: not finite in every program
            assert all(math.isnan(x) for x in (jax_loss, numpy_loss, single))
            continue
        assert abs(jax_loss - single) <= FLOAT64_RTOL * abs(single)
        assert abs(numpy_loss - single) <= FLOAT64_RTOL * abs(single)


@pytest.mark.slow
def test_train_step_example_trains_on_8_processes(tmp_path: Any) -> None:
    """`pcompile examples/train_step.py --devices 8 --run` with step 3 overflowing: every rank
    logs the losses of the numpy simulator of the same float32 program (NaN at step 3, where
    the update is skipped). Both sum the same float32 terms in different orders: reductions of
    at most 2^6 terms over 5 steps of Adam-like updates stay within 2^-24 * 2^6 * 2^4 = 2^-14
    of each other."""
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.runners import ParallelRunner

    env = clean_env(TRAIN_STEP_INF_AT="3")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", os.path.join(ROOT, "examples", "train_step.py"),
         "--devices", "8", "--out", str(out), "--run", "--steps", "5", "--no-fail-on-nan"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    os.environ["TRAIN_STEP_INF_AT"] = "3"
    try:
        program = compile_model(os.path.join(ROOT, "examples", "train_step.py"), devices=8,
                                dump=False)
        one = compile_model(os.path.join(ROOT, "examples", "train_step.py"), devices=1,
                            dump=False)
        runner = ParallelRunner(program)
        with np.errstate(all="ignore"):
            want = [runner.step(arrays) for _, _, arrays in batches(one, 5)]
    finally:
        del os.environ["TRAIN_STEP_INF_AT"]
    bound = 2.0 ** -14
    for rank in (0, 3, 7):
        lines = (out / f"rank_{rank}" / "train.log").read_text().splitlines()
        got = [float(line.rsplit(" ", 1)[1]) for line in lines]
        assert len(got) == 5
        for step, (g, w) in enumerate(zip(got, want), start=1):
            if step == 3:
                assert math.isnan(g) and math.isnan(w)
            else:
                assert abs(g - w) <= bound * abs(w), (rank, step, g, w)
