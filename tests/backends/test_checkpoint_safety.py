"""Checkpoints never lost and never mixed (issue 38, items 1 and 16-20): a run prunes only its
own checkpoints and never the one it just wrote; an earlier run's stay until the new run has one
on every rank (the launcher says so); one rank's failed write never removes the newest step
every rank holds; an index is checked against its file name and place, its fields' types and
the program; params.json is checked against the program; an index does not grow with the steps
trained (the train.log lines go once to the run's log beside it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from pcompile.backends.async_checkpoint import AsyncCheckpointWriter
from pcompile.backends.checkpoint_files import (
    CheckpointError,
    checkpoint_path,
    read_checkpoint,
    resume_point,
    tensors_path,
    write_checkpoint,
)
from tests import ROOT
from tests.multiprocess import clean_env

# w (4, 6) split over 2 ranks along dim 0: each rank holds (2, 6); b replicated.
LAYOUTS = {"w": {"shape": [4, 6], "dtype": "float32", "dev_matrix": [2], "tensor_map": [0, -1]},
           "b": {"shape": [6], "dtype": "float32", "dev_matrix": [2], "tensor_map": [-1]}}


def values(rank: int, step: int) -> dict[str, np.ndarray]:
    w = np.arange(24, dtype=np.float32).reshape(4, 6) + step
    return {"w": w[2 * rank: 2 * rank + 2], "b": np.full(6, step, np.float32)}


def meta_of(rank: int, step: int, lines: int = 0) -> dict:
    return {"step": step, "epoch": 1, "step_in_epoch": step, "rank": rank, "num_ranks": 2,
            "plan_id": "p1", "log_lines": lines, "layouts": LAYOUTS}


def log_lines(count: int) -> list[str]:
    return [f"epoch: 1 step: {k + 1}, loss is {1.0 / (k + 1):.6f}" for k in range(count)]


def writer_for(folder, run: str, ranks, said: list[str], client=None, processes: int = 1,
               index: int = 0, complete: int | None = None,
               fault: tuple[int | None, str] = (None, "")) -> AsyncCheckpointWriter:
    """A process's background writer of run `run` for `ranks` (train.log empty so far)."""
    from pcompile.backends.async_checkpoint import StepAgreement

    writer = AsyncCheckpointWriter(str(folder), said.append, fault=fault)
    writer.start_run(StepAgreement(run, client, processes, index), {r: [] for r in ranks},
                     complete)
    return writer


def write(writer: AsyncCheckpointWriter, step: int, ranks, logs=None, final=False) -> None:
    logs = logs or {r: log_lines(step) for r in ranks}
    writer.submit(step, {r: (values(r, step), meta_of(r, step, len(logs[r]))) for r in ranks},
                  0.01, logs=logs, final=final)
    writer.wait()


def steps_of(folder, rank: int) -> list[str]:
    return sorted(n for n in os.listdir(folder / f"rank_{rank}") if n.startswith("step_"))


EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def write_steps(folder, steps=(2, 4), run: str = "run") -> None:
    """Checkpoints of `steps` on both ranks, written by `run` (its train.log empty)."""
    for step in steps:
        for r in (0, 1):
            write_checkpoint(str(folder), r, step, values(r, step),
                             dict(meta_of(r, step), run=run, written=float(step),
                                  log_sha256=EMPTY_SHA256))


def earlier_run(folder, steps=(12, 14)) -> None:
    write_steps(folder, steps, "earlier")


# -- 1: a run prunes only its own checkpoints, never what it just wrote ----------------------


def test_a_new_run_keeps_what_it_wrote_and_then_removes_the_earlier_runs(tmp_path) -> None:
    """A rank program started by hand in a folder that holds newer checkpoints of an earlier
    run (steps 12 and 14): its checkpoint of step 5 stays (pruning by step number deleted it),
    and once step 5 is on every rank the earlier run's go, said in one line; resume and merge
    then take step 5 of the new run."""
    folder = tmp_path / "checkpoints"
    earlier_run(folder)
    said: list[str] = []
    write(writer_for(folder, "new", (0, 1), said), 5, (0, 1), final=True)
    for r in (0, 1):
        assert steps_of(folder, r) == ["step_00000005.json", "step_00000005.safetensors"]
        assert not (folder / f"rank_{r}" / "run_earlier.log").exists()
        read_checkpoint(checkpoint_path(str(folder), r, 5), r)
    assert said[-1] == (f"removed an earlier run's checkpoints (step(s) 12, 14) from {folder}: "
                        "step 5 of this run is on every rank"), said
    point = resume_point(str(folder), 2)
    assert (point.step, point.run, point.skipped) == (5, "new", [])


def test_a_new_run_on_one_rank_only_is_not_mixed_with_the_earlier_run(tmp_path) -> None:
    """The new run's step 5 is on rank 0 only (its other process has not written it): the
    earlier run's checkpoints stay on both ranks, and resuming takes the earlier run's step 14,
    saying that step 5 is not on every rank; a step whose ranks hold different runs' indexes is
    never taken."""
    folder = tmp_path / "checkpoints"
    earlier_run(folder)
    said: list[str] = []
    store = FakeStore()
    write(writer_for(folder, "new", (0,), said, store, processes=2, index=0), 5, (0,))
    assert steps_of(folder, 0) == ["step_00000005.json", "step_00000005.safetensors",
                                   "step_00000012.json", "step_00000012.safetensors",
                                   "step_00000014.json", "step_00000014.safetensors"]
    point = resume_point(str(folder), 2)
    assert (point.step, point.run) == (14, "earlier"), point
    assert point.skipped == ["step 5: rank 1: no checkpoint"], point.skipped
    # rank 1's step 14 replaced by the new run's: step 14 is two runs' and is passed over
    write(writer_for(folder, "new", (1,), said, store, processes=2, index=1), 14, (1,))
    point = resume_point(str(folder), 2)
    assert point.step == 12 and point.run == "earlier", point
    assert "step 14: its ranks' checkpoints are of different runs (rank 0: earlier, rank 1: " \
           "new)" in point.skipped, point.skipped
    from pcompile.backends.checkpoint_merge import merge_checkpoints
    from pcompile.backends.merge_output import MergeError

    with pytest.raises(MergeError, match="the checkpoints of step 14 are of different runs "
                                         r"\(rank 0: earlier, rank 1: new\)"):
        merge_checkpoints(str(tmp_path), step=14)


# -- 16: a fresh --run keeps the earlier run's checkpoints until it has one -----------------


@pytest.fixture
def compiled(tmp_path):
    from pcompile.tools.compile import compile as compile_model

    out = tmp_path / "out"
    compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=2,
                  parallel_mode="data_parallel", out_dir=str(out))
    return out


def test_a_fresh_launch_that_fails_first_keeps_the_earlier_checkpoints(compiled,
                                                                       monkeypatch) -> None:
    """A plain --run (a forgotten --resume) into a folder with checkpoints, whose ranks fail
    before they write any: the earlier checkpoints are all still there, byte for byte, and
    the launcher says so before the start and after the end."""
    from pcompile.backends import launcher

    folder = compiled / "checkpoints"
    earlier_run(folder, steps=(2, 4))
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    monkeypatch.setattr(launcher, "_attempts",
                        lambda *args, **kwargs: launcher.LaunchResult(1, message="failed"))
    echoed: list[str] = []
    assert launcher.launch(str(compiled), steps=3, echo=echoed.append).code == 1
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert echoed[0] == (f"pcompile launcher: {folder} holds checkpoints of an earlier run "
                         "(step(s) 2, 4): they stay until this run has written a checkpoint "
                         "on every rank, then they are removed"), echoed
    assert echoed[-1] == ("pcompile launcher: this run wrote no checkpoint that every rank "
                          "holds, so the earlier run's checkpoints (step(s) 2, 4) are kept in "
                          f"{folder}: --resume continues from the newest of them"), echoed
    assert resume_point(str(folder), 2).step == 4


def test_a_fresh_launch_removes_the_earlier_checkpoints_once_it_has_one(compiled,
                                                                        monkeypatch) -> None:
    """The new run's ranks wrote step 3 on every rank (tagged with the run id the launcher
    gave them) and ended before they pruned: the launcher removes the earlier run's and says
    so; the new run's step 3 stays."""
    from pcompile.backends import launcher

    folder = compiled / "checkpoints"
    earlier_run(folder, steps=(2, 4))

    def ranks_write_step_3(programs, per, common, envs, *args, **kwargs):
        run = envs[0]["PCOMPILE_RUN_ID"]
        for r in (0, 1):
            write_checkpoint(str(folder), r, 3, values(r, 3),
                             dict(meta_of(r, 3), run=run, log_sha256=EMPTY_SHA256), keep=0)
        return launcher.LaunchResult(1, message="ended before pruning")

    monkeypatch.setattr(launcher, "_attempts", ranks_write_step_3)
    echoed: list[str] = []
    launcher.launch(str(compiled), steps=3, echo=echoed.append)
    assert echoed[-1] == ("pcompile launcher: removed the earlier run's checkpoints (step(s) "
                          "2, 4): step 3 of this run is on every rank"), echoed
    for r in (0, 1):
        assert steps_of(folder, r) == ["step_00000003.json", "step_00000003.safetensors"]
    assert resume_point(str(folder), 2).step == 3


# -- 17: one rank's failed write never removes the step every rank holds ---------------------


class FakeStore:
    """jax.distributed's key-value client, as two processes share it."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}

    def key_value_set(self, key: str, value: str) -> None:
        if key in self.keys:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.keys[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.keys.items() if k.startswith(prefix)]


def test_a_failed_write_on_one_rank_never_prunes_the_last_common_step(tmp_path) -> None:
    """--checkpoint-every 1, two processes (one rank each): process 1's background write of
    step 3 fails (a full disk); process 0 writes steps 3 and 4 before the run stops. Step 2,
    the newest that both ranks hold, must stay on rank 0 (pruning by count removed it, and
    --resume then started from 0)."""
    folder = tmp_path / "checkpoints"
    store, said = FakeStore(), []
    first = writer_for(folder, "run", (0,), said, store, processes=2, index=0)
    second = writer_for(folder, "run", (1,), said, store, processes=2, index=1,
                        fault=(3, "checkpoint-enospc"))
    for step in (1, 2):
        write(first, step, (0,))
        write(second, step, (1,))
    with pytest.raises(Exception, match="the checkpoint of step 3 could not be written"):
        write(second, 3, (1,))
    write(first, 3, (0,))
    write(first, 4, (0,))
    assert steps_of(folder, 0) == ["step_00000002.json", "step_00000002.safetensors",
                                   "step_00000003.json", "step_00000003.safetensors",
                                   "step_00000004.json", "step_00000004.safetensors"]
    assert resume_point(str(folder), 2).step == 2
    # once a newer step is on every rank, the run keeps only its last two again
    write(second, 4, (1,))
    write(first, 5, (0,))
    assert steps_of(folder, 0) == ["step_00000004.json", "step_00000004.safetensors",
                                   "step_00000005.json", "step_00000005.safetensors"]


def test_the_last_write_waits_briefly_for_the_other_processes_then_prunes(tmp_path) -> None:
    """The final checkpoint: its writer waits (a few seconds at most) until every process
    recorded it, then prunes, so that a finished run leaves its last two steps, not three."""
    folder = tmp_path / "checkpoints"
    store, said = FakeStore(), []
    first = writer_for(folder, "run", (0,), said, store, processes=2, index=0)
    second = writer_for(folder, "run", (1,), said, store, processes=2, index=1)
    for step in (2, 4):
        write(second, step, (1,))
        write(first, step, (0,))
    later = threading.Timer(0.5, lambda: write(second, 6, (1,)))  # the other process, later
    later.start()
    write(first, 6, (0,), final=True)
    later.join()
    assert steps_of(folder, 0) == ["step_00000004.json", "step_00000004.safetensors",
                                   "step_00000006.json", "step_00000006.safetensors"]


# -- 18: an index is the one its name and place say -------------------------------------------


@pytest.mark.parametrize("kind", ["index of step 2 as step 4", "rank 0's index as rank 1's",
                                  "index naming step 2's tensors", "tensors of step 2"])
def test_an_index_in_another_place_is_refused_and_resume_falls_back(tmp_path, kind) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder)
    path = checkpoint_path(str(folder), 1, 4)
    if kind == "index of step 2 as step 4":  # with its tensors: a consistent pair
        shutil.copy(checkpoint_path(str(folder), 1, 2), path)
        shutil.copy(tensors_path(checkpoint_path(str(folder), 1, 2)), tensors_path(path))
        why = "the index is of step 2, its file name says step 4"
    elif kind == "rank 0's index as rank 1's":
        shutil.copy(checkpoint_path(str(folder), 0, 4), path)
        shutil.copy(tensors_path(checkpoint_path(str(folder), 0, 4)), tensors_path(path))
        why = "the index is rank 0's, but it is in rank 1's place"
    elif kind == "index naming step 2's tensors":
        index = json.loads(open(path).read())
        index["file"] = "step_00000002.safetensors"
        open(path, "w").write(json.dumps(index))
        why = "the index names the tensor file step_00000002.safetensors, not its own"
    else:  # the tensors of step 2 under step 4's name, the index edited to match them
        shutil.copy(tensors_path(checkpoint_path(str(folder), 1, 2)), tensors_path(path))
        index = json.loads(open(path).read())
        index["arrays"] = json.loads(open(checkpoint_path(str(folder), 1, 2)).read())["arrays"]
        index["bytes"] = os.path.getsize(tensors_path(path))
        open(path, "w").write(json.dumps(index))
        why = "its tensor file holds the tensors of step 2, the index says step 4"
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path, 1)
    assert str(info.value).startswith(path) and why in str(info.value), str(info.value)
    point = resume_point(str(folder), 2)
    assert point.step == 2 and why in point.skipped[0], point


# -- 19: crafted, well-formed indexes and params.json entries ---------------------------------


CRAFTED = {
    "log not a list": (lambda i: i.update(log=5, log_lines=None) or i.pop("log_lines"),
                       "its train.log lines (log) are int, not a list of strings"),
    "log of numbers": (lambda i: i.update(log=[1, 2]) or i.pop("log_lines"),
                       "its train.log lines (log) are list, not a list of strings"),
    "log_lines a string": (lambda i: i.update(log_lines="4"),
                           "its metadata's log_lines is '4', not a non-negative integer"),
    "log_lines null": (lambda i: i.update(log_lines=None),
                       "its log_lines None is not a non-negative integer"),
    "no log digest": (lambda i: i.pop("log_sha256"), "its log_sha256 None is not a sha256"),
    "run id with a slash": (lambda i: i.update(run="../../x"), "its run id '../../x' is not"),
    "rank a string": (lambda i: i.update(rank="1"), "its metadata's rank is '1'"),
    "layout shape not a list": (lambda i: i["layouts"]["w"].update(shape="4x6"),
                                "the layout of w is malformed (shape '4x6' is not a list"),
    "layout tensor map short": (lambda i: i["layouts"]["w"].update(tensor_map=[0]),
                                "tensor map [0] does not have one entry per dim of [4, 6]"),
    "layout axis outside": (lambda i: i["layouts"]["w"].update(tensor_map=[3, -1]),
                            "names an axis outside the device matrix [2]"),
    "layout not an object": (lambda i: i["layouts"].update(w=[4, 6]),
                             "the layout of w is malformed (list, not an object)"),
    "stored shape disagrees with the layout": (
        lambda i: i["layouts"]["w"].update(shape=[6, 6]),
        "w has shape (2, 6), rank 1's slice is (3, 6)"),
    "layout dtype unknown": (lambda i: i["layouts"]["b"].update(dtype="float128x"),
                             "dtype 'float128x' is not a dtype"),
}


@pytest.mark.parametrize("kind", list(CRAFTED))
def test_a_crafted_index_is_one_message(tmp_path, kind) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder)
    change, why = CRAFTED[kind]
    path = checkpoint_path(str(folder), 1, 4)
    index = json.loads(open(path).read())
    change(index)
    open(path, "w").write(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path, 1)
    assert str(info.value).startswith(path) and why in str(info.value), str(info.value)
    point = resume_point(str(folder), 2)
    assert point.step == 2 and why in point.skipped[0], point


def test_a_checkpoint_is_checked_against_the_program() -> None:
    """An intact checkpoint whose layouts or slices are not the resuming program's."""
    from pcompile.backends.checkpoint_files import program_problem

    arrays = values(1, 4)
    meta = meta_of(1, 4)
    assert program_problem(meta, arrays, 1, LAYOUTS) == ""
    other = {**LAYOUTS, "w": {**LAYOUTS["w"], "shape": [32, 16]}}
    assert program_problem(meta, arrays, 1, other) == (
        "w has shape [4, 6] in the checkpoint, [32, 16] in this program")
    moved = {**LAYOUTS, "w": {**LAYOUTS["w"], "tensor_map": [-1, 0]}}
    assert program_problem(meta, arrays, 1, moved) == (
        "w has tensor map [0, -1] in the checkpoint, [-1, 0] in this program")
    assert program_problem(meta, {**arrays, "w": arrays["w"][:1]}, 1, LAYOUTS) == (
        "w is stored with shape (1, 6), rank 1's slice of its layout is (2, 6)")
    assert program_problem(meta, {**arrays, "b": arrays["b"].astype(np.float16)}, 1,
                           LAYOUTS) == "b is stored as float16, this program holds float32"
    assert program_problem(meta, arrays, 1, {**LAYOUTS, "c": LAYOUTS["b"]}) == "it holds no c"


def test_a_params_entry_of_another_shape_is_one_message(tmp_path) -> None:
    from pcompile.backends.params import ParamsError, check_program, read_manifest

    (tmp_path / "params.json").write_text(json.dumps({
        "format": "pcompile-params/1",
        "params": {"w": {"kind": "weight", "shape": [10**6, 10**6], "dtype": "float32",
                         "init": {"initializer": "Zero", "args": {"value": 0}}},
                   "b": {"kind": "weight", "shape": [16], "dtype": "float16",
                         "init": {"initializer": "Zero", "args": {"value": 0}}}}}))
    sources = read_manifest(str(tmp_path))
    with pytest.raises(ParamsError) as info:
        check_program(str(tmp_path), sources, {"w": ((32, 16), "float32")})
    assert str(info.value) == (f"{tmp_path / 'params.json'}: parameter 'w' has shape "
                               "[1000000, 1000000], the program's is [32, 16]; compile again")
    with pytest.raises(ParamsError, match="parameter 'b' is float16, the program's is float32"):
        check_program(str(tmp_path), sources, {"b": ((16,), "float32")})
    with pytest.raises(ParamsError, match="has no entry for c"):
        check_program(str(tmp_path), sources, {"c": ((16,), "float32")})


# -- 20: an index does not grow with the steps trained ----------------------------------------


def test_an_index_does_not_grow_with_the_steps_trained(tmp_path) -> None:
    """The train.log lines are appended once to the run's log beside the checkpoints (only
    the lines since the previous checkpoint); the index holds their count and sha256, so its
    size is the same at step 10 and at step 100,000; the lines read back exactly, and a run log
    that lost them is one message."""
    from pcompile.backends.checkpoint_files import checkpoint_log

    folder = tmp_path / "checkpoints"
    said: list[str] = []
    writer = writer_for(folder, "run", (0, 1), said)
    lines = {r: log_lines(100_000) for r in (0, 1)}
    sizes = {}
    for step in (10, 100_000):
        write(writer, step, (0, 1), {r: lines[r][:step] for r in (0, 1)})
        sizes[step] = os.path.getsize(checkpoint_path(str(folder), 0, step))
    assert abs(sizes[100_000] - sizes[10]) < 16, sizes  # the digits of the step and count
    run_log = folder / "rank_0" / "run_run.log"
    assert run_log.read_text().splitlines() == lines[0]  # each line once
    path = checkpoint_path(str(folder), 0, 100_000)
    _, meta = read_checkpoint(path, 0)
    assert "log" not in meta and meta["log_lines"] == 100_000
    assert checkpoint_log(path, meta) == lines[0]
    assert checkpoint_log(checkpoint_path(str(folder), 0, 10), read_checkpoint(
        checkpoint_path(str(folder), 0, 10), 0)[1]) == lines[0][:10]
    run_log.write_text("\n".join(lines[0][:50]) + "\n")
    with pytest.raises(CheckpointError, match="holds 50 train.log lines, the checkpoint of "
                                              "step 100000"):
        checkpoint_log(path, meta)
    point = resume_point(str(folder), 2)
    assert point.step == 10 and "holds 50 train.log lines" in point.skipped[0], point
    run_log.write_text("\n".join(["epoch: 1 step: 1, loss is 9"] + lines[0][1:]) + "\n")
    with pytest.raises(CheckpointError, match="are not the train.log of the checkpoint"):
        checkpoint_log(path, meta)


# -- the rank program, end to end --------------------------------------------------------------


def program(out, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(out / "rank_0" / "program.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env or clean_env())


def one_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.slow  # four runs of the rank program (~25 s of CPU)
def test_hand_started_runs_never_lose_or_mix_checkpoints(compiled) -> None:
    """The README's launch line, by hand, in a folder that holds an earlier run's newer
    checkpoints: (a) a fresh run that fails before its first checkpoint leaves them all; (b)
    --resume then continues the earlier run from its step 4 with its train.log (the failed
    run had rewritten it) to the same losses as a straight run; (c) a fresh 3-step run keeps
    its step 3 and removes the earlier run's, saying so; its indexes carry no train.log."""
    straight = program(compiled, "--steps", "6")
    assert straight.returncode == 0, straight.stderr
    want = (compiled / "rank_1" / "train.log").read_text()
    assert program(compiled, "--steps", "4", "--checkpoint-every", "2").returncode == 0
    folder = compiled / "checkpoints"
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    failing = program(compiled, "--steps", "6",
                      env=clean_env(PCOMPILE_FAULT_INJECT="0:2"))  # rank 0 raises at step 2
    assert failing.returncode != 0
    assert "holds checkpoints of an earlier run (step(s) 2, 4)" in failing.stdout
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    resumed = program(compiled, "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from step 4" in resumed.stdout
    assert (compiled / "rank_1" / "train.log").read_text() == want
    fresh = program(compiled, "--steps", "3")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert "holds checkpoints of an earlier run (step(s) 4, 6)" in fresh.stdout, fresh.stdout
    assert f"removed an earlier run's checkpoints (step(s) 4, 6) from {folder}: step 3 of " \
           "this run is on every rank" in fresh.stdout, fresh.stdout
    for r in (0, 1):
        assert steps_of(folder, r) == ["step_00000003.json", "step_00000003.safetensors"]
        index = json.loads((folder / f"rank_{r}" / "step_00000003.json").read_text())
        assert "log" not in index and index["log_lines"] == 3
    point = resume_point(str(folder), 2)
    assert point.step == 3 and point.skipped == []


@pytest.mark.slow  # three runs of the rank program (~15 s of CPU)
def test_a_resume_from_a_checkpoint_of_another_program_is_one_message(compiled) -> None:
    """An intact, self-consistent checkpoint whose layout is not this program's (w stored
    as the whole (16, 32) weight under a layout that says so, the program splits nothing
    either but holds w as (32, 16)), an index whose log is not a list, and a params.json
    entry whose shape is not the program's: each is one line, never a traceback."""
    assert program(compiled, "--steps", "2").returncode == 0
    folder = compiled / "checkpoints"
    for r in (0, 1):  # the log of an older index, crafted: a number
        path = checkpoint_path(str(folder), r, 2)
        index = json.loads(open(path).read())
        index.pop("log_lines")
        index["log"] = 5
        open(path, "w").write(json.dumps(index))
    error = one_error(program(compiled, "--steps", "3", "--resume"))
    assert "no step has an intact checkpoint of every rank" in error, error
    assert "its train.log lines (log) are int, not a list of strings" in error, error
    assert program(compiled, "--steps", "2").returncode == 0
    for r in (0, 1):  # a consistent checkpoint of a transposed w
        path = checkpoint_path(str(folder), r, 2)
        arrays, meta = read_checkpoint(path, r)
        name = sorted(n for n, a in arrays.items() if a.ndim == 2 and a.shape[0] != a.shape[1])[0]
        arrays[name] = np.ascontiguousarray(arrays[name].T)
        meta["layouts"][name]["shape"] = meta["layouts"][name]["shape"][::-1]
        for key in ("arrays", "file", "bytes", "format"):
            meta.pop(key)
        write_checkpoint(str(folder), r, 2, arrays, meta, keep=0)
    error = one_error(program(compiled, "--steps", "3", "--resume"))
    assert "cannot resume from step 2" in error and f"{name} has shape" in error, error
    assert "in the checkpoint" in error and "in this program" in error, error
    manifest = json.loads((compiled / "params.json").read_text())
    manifest["params"][name]["shape"] = [10**6, 10**6]
    (compiled / "params.json").write_text(json.dumps(manifest))
    error = one_error(program(compiled, "--steps", "1"))
    assert f"parameter {name!r} has shape [1000000, 1000000], the program's is" in error, error


@pytest.mark.slow  # a run of the rank program (~5 s of CPU)
def test_the_launcher_run_id_is_checked(compiled) -> None:
    """A run id that could not name a file (PCOMPILE_RUN_ID from the environment) is one
    message, before anything is written."""
    proc = program(compiled, "--steps", "1", env=clean_env(PCOMPILE_RUN_ID="../x"))
    error = one_error(proc)
    assert "PCOMPILE_RUN_ID='../x': a run id is 1 to 64 letters, digits" in error, error
    assert not (compiled / "checkpoints").exists()


# -- 6: --resume against another plan is refused before any rank starts -----------------------


def test_resume_refuses_another_plans_checkpoints_before_starting_a_rank(tmp_path) -> None:
    """The launcher reads the plan id of the compiled program and passes over checkpoints
    written by another plan (the ranks refused them only after starting and compiling XLA):
    `resume_step` says which plan wrote them, and no process is started."""
    from pcompile.backends.launcher import LaunchError, resume_step
    from pcompile.tools.compile import compile as compile_model

    out = tmp_path / "out"
    compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=2,
                  parallel_mode="data_parallel", out_dir=str(out))
    write_steps(out / "checkpoints", steps=(2, 4))  # written by plan "p1"
    with pytest.raises(LaunchError) as info:
        resume_step(str(out), 10)
    message = str(info.value)
    assert "no step has an intact checkpoint of every rank" in message
    assert "was written by plan p1, this program is plan " in message
