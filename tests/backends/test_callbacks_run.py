"""A model file's `callbacks()` in a run (compiler/frontend/callbacks.py,
backends/jax/rank_loop.py): a callback of the user's own records what MindSpore's hooks give it,
against the losses the run writes; LossMonitor, TimeMonitor and ModelCheckpoint act as MindSpore's
do, through the run's options (which the command line overrides)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT
from tests.multiprocess import clean_env, mlp_source

RECORDER = '''

class Recorder(Callback):
    """What MindSpore's hooks see (the older name step_end for the step's end)."""

    def __init__(self):
        self.seen = []

    def on_train_begin(self, run_context):
        self.seen.append(["begin"])

    def on_train_epoch_begin(self, run_context):
        self.seen.append(["epoch_begin", run_context.original_args().cur_epoch_num])

    def on_train_step_begin(self, run_context):
        self.seen.append(["step_begin", run_context.original_args().cur_step_num])

    def step_end(self, run_context):
        cb = run_context.original_args()
        self.seen.append(["step_end", cb.cur_epoch_num, cb.cur_step_num, cb.batch_num,
                          float(cb.net_outputs.asnumpy())])

    def on_train_epoch_end(self, run_context):
        self.seen.append(["epoch_end", run_context.original_args().cur_epoch_num])

    def on_train_end(self, run_context):
        self.seen.append(["end"])
        with open(os.environ["CALLBACK_RECORD"] + f".{os.getpid()}", "w") as f:
            json.dump(self.seen, f)


def callbacks():
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=3)
    return [LossMonitor(2), TimeMonitor(), ModelCheckpoint(config=config), Recorder()]
'''


def _model(tmp_path, strategy: str) -> str:
    source = mlp_source(strategy, imports="import json\nimport os\n\nfrom pcompile.train import "
                        "Callback, CheckpointConfig, LossMonitor, ModelCheckpoint, "
                        "TimeMonitor\n")
    path = tmp_path / "model.py"
    path.write_text(source + RECORDER)  # three batches an epoch
    return str(path)


def _run(tmp_path, model: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pcompile", model, "--out", str(tmp_path / "out"),
                           "--run", "--steps", "5", *flags], capture_output=True, text=True,
                          cwd=ROOT, timeout=600,
                          env=clean_env(CALLBACK_RECORD=str(tmp_path / "record")))


def _losses(tmp_path) -> list[float]:
    lines = (tmp_path / "out" / "rank_0" / "train.log").read_text().splitlines()
    return [float(line.rpartition(" ")[2]) for line in lines]


def _expected(losses: list[float]) -> list[list]:
    """MindSpore's order over 5 steps of 3-batch epochs; batch_num: the epoch's steps once one
    is complete, the current one's so far before that."""
    seen: list[list] = [["begin"], ["epoch_begin", 1]]
    for step, loss in enumerate(losses, start=1):
        epoch = 1 if step <= 3 else 2
        if step == 4:
            seen += [["epoch_end", 1], ["epoch_begin", 2]]
        seen += [["step_begin", step], ["step_end", epoch, step, min(step, 3), loss]]
    return seen + [["epoch_end", 2], ["end"]]


@pytest.mark.slow
def test_callbacks_of_a_one_device_run(tmp_path) -> None:
    model = _model(tmp_path, "((1, 1), (1, 1))")
    done = _run(tmp_path, model, "--devices", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    records = sorted(tmp_path.glob("record.*"))
    assert len(records) == 1  # in pcompile's own process
    losses = _losses(tmp_path)
    assert len(losses) == 5 and json.loads(records[0].read_text()) == _expected(losses)
    shown = [line for line in done.stdout.splitlines()
             if " loss is " in line or line.startswith("Train epoch time: ")]
    # LossMonitor(2): steps 2 and 4, and the last; TimeMonitor: one line per epoch
    kinds = ["Train epoch time" if line.startswith("Train epoch time: ") else line.split(",")[0]
             for line in shown]
    assert kinds == ["epoch: 1 step: 2", "Train epoch time", "epoch: 2 step: 1",
                     "epoch: 2 step: 2", "Train epoch time"], done.stdout
    # ModelCheckpoint(save_checkpoint_steps=2, keep_checkpoint_max=3): steps 2, 4 and the end
    folder = tmp_path / "out" / "checkpoints" / "rank_0"
    assert sorted(p.name for p in folder.glob("step_*.json")) == [
        "step_00000002.json", "step_00000004.json", "step_00000005.json"]


@pytest.mark.slow
def test_callbacks_run_in_every_rank_process_and_the_command_line_wins(tmp_path) -> None:
    model = _model(tmp_path, "((2, 1), (1, 1))")
    done = _run(tmp_path, model, "--devices", "2", "--parallel-mode", "semi_auto_parallel",
                "--no-check", "--processes", "2", "--checkpoint-every", "3",
                "--keep-checkpoint-max", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    records = sorted(tmp_path.glob("record.*"))
    assert len(records) == 2  # one per rank process, each with its own losses: the same
    losses = _losses(tmp_path)
    for record in records:
        assert json.loads(record.read_text()) == _expected(losses)
    assert sum(line.startswith("Train epoch time: ") for line in done.stdout.splitlines()) == 2
    # --checkpoint-every 3 and --keep-checkpoint-max 1 over ModelCheckpoint's 2 and 3
    for rank in (0, 1):
        folder = tmp_path / "out" / "checkpoints" / f"rank_{rank}"
        assert sorted(p.name for p in folder.glob("step_*.json")) == ["step_00000005.json"]
    assert "checkpoint of step 3" in (tmp_path / "out" / "rank_0" / "run.log").read_text()


STOPPER = '''

class Stop(Callback):
    """run_context.request_stop() at a step's end or at an epoch's end."""

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == int(os.environ.get("STOP_STEP", 0)):
            run_context.request_stop()

    def on_train_epoch_end(self, run_context):
        if run_context.original_args().cur_epoch_num == int(os.environ.get("STOP_EPOCH", 0)):
            run_context.request_stop()


def callbacks():
    return [Stop()]
'''


@pytest.mark.slow
@pytest.mark.parametrize("where, trained, epoch, in_epoch", [
    ("STOP_STEP", 4, 2, 1), ("STOP_EPOCH", 3, 1, 3)])
def test_request_stop_ends_the_run_after_that_step_with_its_checkpoint(
        tmp_path, where, trained, epoch, in_epoch) -> None:
    source = mlp_source("((1, 1), (1, 1))", imports="import os\n\nfrom pcompile.train import "
                        "Callback\n")
    model = tmp_path / "model.py"
    model.write_text(source + STOPPER)
    done = subprocess.run([sys.executable, "-m", "pcompile", str(model), "--devices", "1",
                           "--out", str(tmp_path / "out"), "--run", "--steps", "10"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=clean_env(**{where: "1" if where == "STOP_EPOCH" else "4"}))
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(_losses(tmp_path)) == trained
    assert f"a callback asked to stop after step {trained}" in done.stdout
    index = tmp_path / "out" / "checkpoints" / "rank_0" / f"step_{trained:08d}.json"
    meta = json.loads(index.read_text())
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"]) == (trained, epoch, in_epoch)
