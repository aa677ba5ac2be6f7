"""Run options checked before anything is written, flags refused without --run, sys.exit() in a
model file, --fail-on-nan without the launcher, --run inside someone else's multi-process job."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from click.testing import CliRunner

from pcompile.cli import main
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")

TINY = """
import sys
import numpy as np
from pcompile import Parameter, nn, ops


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(np.full((4, 4), 0.1, np.float32), "w")
        self.matmul = ops.MatMul()

    def construct(self, x):
        {construct}
        return self.matmul(x, self.w)


def model():
    {model}
    return Net()


def inputs():
    return (np.ones((2, 4), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)


def dataset():
    for step in range(5):
        {dataset}
        yield (np.ones((2, 4), np.float32) * (np.inf if step == {bad_step} else 1.0),
               np.zeros((2, 4), np.float32))
"""


def write(tmp_path, construct: str = "pass", model: str = "pass", dataset: str = "pass",
          bad_step: int = 99) -> str:
    path = tmp_path / "tiny.py"
    path.write_text(textwrap.dedent(TINY).format(construct=construct, model=model,
                                                 dataset=dataset, bad_step=bad_step))
    return str(path)


def run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, catch_exceptions=False, env=env)
    return result.exit_code, result.output


@pytest.mark.parametrize("where", ["model", "construct", "dataset"])
def test_sys_exit_in_the_model_file_is_reported(tmp_path, where: str) -> None:
    model = write(tmp_path, **{where: "sys.exit(0)"})
    out = tmp_path / "out"
    code, output = run_cli([model, "--out", str(out), "--run", "--steps", "2"])
    assert code == 1, output
    assert "called sys.exit(0)" in output and "tiny.py:" in output
    assert "Traceback" not in output


def test_processes_that_do_not_divide_the_ranks_are_refused_before_writing(tmp_path) -> None:
    out = tmp_path / "out"
    code, output = run_cli([QUICKSTART, "--devices", "8", "--out", str(out), "--no-check",
                            "--run", "--processes", "3"])
    assert code == 1
    assert "--processes 3 cannot share 8 ranks evenly" in output and "1, 2, 4, 8" in output
    assert not out.exists()


@pytest.mark.parametrize("flags", [["--steps", "5"], ["--resume"], ["--checkpoint-every", "2"],
                                   ["--timeout", "9"], ["--no-fail-on-nan"]])
def test_run_flags_without_run_are_refused(tmp_path, flags: list[str]) -> None:
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(tmp_path / "o"), *flags])
    assert code == 2
    assert f"{flags[0]} only applies with --run" in output.replace("--fail-on-nan/", "")
    assert not (tmp_path / "o").exists()


def test_resume_without_a_checkpoint_is_refused_before_writing(tmp_path) -> None:
    out = tmp_path / "out"
    code, output = run_cli([QUICKSTART, "--devices", "8", "--out", str(out), "--no-check",
                            "--run", "--resume", "--steps", "3"])
    assert code == 1
    assert "--resume: no step has an intact checkpoint" in output
    assert not out.exists()
    code, output = run_cli([QUICKSTART, "--devices", "8", "--out", str(out), "--no-check",
                            "--run", "--resume", "--backend", "numpy"])
    assert code == 1 and "drop --backend numpy" in output


def test_a_non_finite_loss_stops_the_run_naming_the_step(tmp_path) -> None:
    model = write(tmp_path, bad_step=2)
    out = tmp_path / "out"
    code, output = run_cli([model, "--out", str(out), "--run", "--steps", "5"])
    assert code == 1, output
    assert "the loss is inf at step 3 (epoch 1, step 3)" in output
    assert len((out / "rank_0" / "train.log").read_text().splitlines()) == 3
    code, output = run_cli([model, "--out", str(out), "--run", "--steps", "5",
                            "--no-fail-on-nan"])
    assert code == 0, output
    assert len((out / "rank_0" / "train.log").read_text().splitlines()) == 5


@pytest.mark.parametrize("env", [
    {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_NODE_ID": "0"},
    {"OMPI_COMM_WORLD_SIZE": "2"},  # a world size without its rank: not understood
])
def test_run_inside_a_multi_process_job_is_refused(tmp_path, env: dict[str, str]) -> None:
    out = tmp_path / "out"
    code, output = run_cli([QUICKSTART, "--devices", "8", "--out", str(out), "--run"], env=env)
    assert code == 1, output
    assert "pcompile --run starts its own rank processes" in output
    assert not out.exists()


def test_a_one_device_run_writes_checkpoint_metrics_and_startup(tmp_path) -> None:
    """Issue 38 item 13: `pcompile --run` on one device (in this process) writes what a
    launched run writes: metrics.jsonl, the checkpoint at the end, the time to first step."""
    out = tmp_path / "out"
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check",
                            "--run", "--steps", "3"])
    assert code == 0, output
    assert "time to first step " in output and "this run: 3 steps (1..3)" in output, output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len({r["run"] for r in records}) == 1
    index = out / "checkpoints" / "rank_0" / "step_00000003.json"
    assert json.loads(index.read_text())["run"] == records[0]["run"]


def test_keep_checkpoint_max_and_a_profile_of_some_steps(tmp_path) -> None:
    """Issue 38 item 15: --keep-checkpoint-max K keeps the newest K steps (two before, not
    configurable); --profile-steps N..M writes a jax.profiler trace of those steps, a run
    output that a recompile keeps; a bad range is refused before anything is compiled."""
    out = tmp_path / "out"
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check",
                            "--run", "--steps", "4", "--checkpoint-every", "1",
                            "--keep-checkpoint-max", "3", "--profile-steps", "2..3"])
    assert code == 0, output
    kept = sorted(p.name for p in (out / "checkpoints" / "rank_0").glob("step_*.json"))
    assert kept == [f"step_0000000{s}.json" for s in (2, 3, 4)], kept
    assert f"profile of steps 2..3: {out / 'profile' / 'rank_0'}" in output, output
    traces = list((out / "profile" / "rank_0").rglob("*.xplane.pb"))
    assert len(traces) == 1, list((out / "profile").rglob("*"))
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(out), "--no-check"])
    assert code == 0, output  # the trace is a run output: the recompile keeps it
    assert traces[0].exists()
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(tmp_path / "o2"),
                            "--run", "--profile-steps", "3..2"])
    assert code == 2 and "1 <= N <= M" in output, output
    assert not (tmp_path / "o2").exists()


@pytest.mark.slow  # three one-device runs (~5 s)
def test_a_one_device_run_resumes_in_process_bit_for_bit(tmp_path) -> None:
    """One device, in this process: 4 steps with a checkpoint every 2, then --resume to 6,
    log the same losses, bit for bit, as 6 steps straight; metrics.jsonl keeps one run."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(straight), "--no-check",
                            "--run", "--steps", "6"])
    assert code == 0, output
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(resumed), "--no-check",
                            "--run", "--steps", "4", "--checkpoint-every", "2"])
    assert code == 0, output
    code, output = run_cli([QUICKSTART, "--devices", "1", "--out", str(resumed), "--no-check",
                            "--run", "--steps", "6", "--resume"])
    assert code == 0, output
    assert "2 steps (steps 5..6, resumed from step 4)" in output, output
    assert ((resumed / "rank_0" / "train.log").read_text()
            == (straight / "rank_0" / "train.log").read_text())
    records = [json.loads(line) for line in
               (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert len({r["run"] for r in records}) == 1
