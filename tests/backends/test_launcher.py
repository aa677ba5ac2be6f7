"""Multi-process runs of the generated rank programs through the launcher (gloo on CPU):
end to end against single-device training, a killed rank, Ctrl-C, resume (and its fall-back past
damaged checkpoints), merge, port retry, the --out lock, --fail-on-nan on a resumed run, and two
processes started with torchrun's variables forming one job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from pcompile.backends.checkpoint_merge import merge_checkpoints
from pcompile.backends.launcher import launch
from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import rounding_rtol
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT
from tests.multiprocess import clean_env, mlp_source

CLI = os.path.join(ROOT, "cli.py")

MODEL = mlp_source("((2, 2), (2, 1))", relu_matmul=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "mlp4.py"
    path.write_text(textwrap.dedent(MODEL))
    return str(path)


def cli(model: str, out: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CLI, model, "--devices", "4", "--parallel-mode", "semi_auto_parallel",
         "--out", out, "--no-check", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(), cwd=ROOT)


def losses(out, rank: int = 0) -> list[float]:
    lines = (out / f"rank_{rank}" / "train.log").read_text().splitlines()
    return [float(line.rsplit(" ", 1)[1]) for line in lines]


def single_device(model: str, parallel, steps: int) -> tuple[list[float], dict]:
    """Single-device training from the parallel program's initial values (the oracle)."""
    ref = compile_model(model, devices=1, dump=False)
    runner = StandAloneRunner(ref, "numpy")
    for name in runner.values:
        if name in parallel.initial_values:
            runner.values[name] = np.array(parallel.initial_values[name], copy=True)
    return [runner.step(a) for _, _, a in batches(ref, steps)], runner.values


def wait_for_progress(out, proc: subprocess.Popen[str], timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    log = out / "rank_0" / "train.log"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the launch ended early:\n{proc.stdout.read()}")
        if (out / "launch.json").exists() and log.exists() and log.read_text().count("\n") >= 2:
            return json.loads((out / "launch.json").read_text())
        time.sleep(0.1)
    raise AssertionError("no progress")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_four_processes_train_like_one_device_and_merge(model_path, tmp_path) -> None:
    out = tmp_path / "out"
    proc = cli(model_path, str(out), "--run", "--steps", "5")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "every rank reports the same loss" in output
    # process 0 compiled the step; the three others loaded its executable
    for r in (1, 2, 3):
        log = (out / f"rank_{r}" / "run.log").read_text()
        assert "(the executable compiled by process 0)" in log, log
    info = json.loads((out / "launch.json").read_text())
    assert [p["ranks"] for p in info["processes"]] == [[0], [1], [2], [3]]
    parallel = compile_model(model_path, devices=4, dump=False)
    want, values = single_device(model_path, parallel, 5)
    bound = rounding_rtol(parallel, np.float32, steps=5)
    for r in range(4):
        np.testing.assert_allclose(losses(out, r), want, rtol=bound)
    assert (out / "rank_0" / "train.log").read_text().splitlines()[3].startswith(
        "epoch: 2 step: 1, loss is ")
    merge = subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint_merge", str(out)],
                           cwd=ROOT, capture_output=True, text=True, env=clean_env())
    assert merge.returncode == 0, merge.stderr
    # the merge is safetensors, read by safetensors itself
    merged = load_file(str(out / "merged_step_00000005.safetensors"))
    for name in ("w", "w2", "moments.w", "moments.w2"):
        scale = float(np.abs(values[name]).max())
        np.testing.assert_allclose(merged[name], values[name], rtol=bound, atol=bound * scale)
    full, info = merge_checkpoints(str(out))
    assert info["step"] == 5 and full["w"].shape == (16, 8)


# slow: a multi-process launch, as the other launcher runs
@pytest.mark.slow
def test_a_killed_rank_stops_the_launch_within_10_s(model_path, tmp_path) -> None:
    out = tmp_path / "out"
    proc = cli(model_path, str(out), "--run", "--steps", "1000000")
    try:
        info = wait_for_progress(out, proc)
        victim = info["processes"][2]["pid"]
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 10, elapsed
    assert "rank 2 failed first (killed by SIGKILL)" in output, output
    assert "Last lines of" in output
    assert not any(alive(p["pid"]) for p in info["processes"])


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(model_path, tmp_path) -> None:
    out = tmp_path / "out"
    proc = cli(model_path, str(out), "--run", "--steps", "1000000")
    try:
        info = wait_for_progress(out, proc)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "interrupted" in output
    assert not any(alive(p["pid"]) for p in info["processes"])


def same_checkpoints(a, b, step: int, ranks: int = 4) -> None:
    """Rank checkpoints of `step` in output folders a and b hold the same tensors, bit for bit."""
    from pcompile.backends.checkpoint_files import checkpoint_path, read_checkpoint

    for r in range(ranks):
        x, _ = read_checkpoint(checkpoint_path(str(a / "checkpoints"), r, step), r)
        y, _ = read_checkpoint(checkpoint_path(str(b / "checkpoints"), r, step), r)
        assert sorted(x) == sorted(y) == ["moments.w", "moments.w2", "w", "w2"]
        for name in x:
            assert x[name].tobytes() == y[name].tobytes(), (r, name)


@pytest.mark.slow
def test_resume_after_a_failure_is_bit_identical(model_path, tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        compile_model(model_path, devices=4, out_dir=str(out))
    quiet = lambda line: None  # noqa: E731
    assert launch(str(straight), steps=7, processes=2, echo=quiet).code == 0
    failing = dict(clean_env(), PCOMPILE_FAULT_INJECT="3:6")  # rank 3 raises at step 6
    result = launch(str(resumed), steps=7, processes=2, checkpoint_every=2, env=failing,
                    echo=quiet)
    assert result.code == 1 and result.failed_rank == 2  # process 1 runs ranks 2 and 3
    assert "PCOMPILE_FAULT_INJECT" in result.message
    steps = sorted(n for n in os.listdir(resumed / "checkpoints" / "rank_3")
                   if n.startswith("step_"))  # and the run's train.log lines (run_<id>.log)
    assert steps == ["step_00000002.json", "step_00000002.safetensors", "step_00000004.json",
                     "step_00000004.safetensors"]
    # A recompile keeps the checkpoints; --resume continues from step 4.
    compile_model(model_path, devices=4, out_dir=str(resumed))
    echoed: list[str] = []
    result = launch(str(resumed), steps=7, processes=2, resume=True, echo=echoed.append)
    assert result.code == 0
    # it says where it resumes, echoes only the steps it trains, and counts only those
    assert echoed[0] == "pcompile launcher: resuming from step 4", echoed
    assert [line for line in echoed if line.startswith("epoch")] == result.losses[4:]
    assert result.resumed_from == 4 and result.trained == 3
    assert any(line.startswith("this run: 3 steps (5..7)") for line in echoed), echoed
    assert any(line.startswith("time to first step") for line in echoed), echoed
    for r in range(4):
        a = (straight / f"rank_{r}" / "train.log").read_bytes()
        assert (resumed / f"rank_{r}" / "train.log").read_bytes() == a
    same_checkpoints(straight, resumed, 7)


@pytest.mark.slow
def test_a_kill_during_a_background_checkpoint_write_keeps_the_previous_one(model_path,
                                                                           tmp_path) -> None:
    """Checkpoints are written by a background thread while training goes on. A process
    killed (SIGKILL) in the middle of the write of step 4 leaves step 2 intact and no step 4
    under the final names; --resume continues from step 2, bit for bit."""
    from pcompile.backends.checkpoint_files import resume_point

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        compile_model(model_path, devices=4, out_dir=str(out))
    said: list[str] = []
    assert launch(str(straight), steps=7, processes=2, echo=said.append).code == 0
    failing = dict(clean_env(), PCOMPILE_FAULT_INJECT="3:4:checkpoint-kill")
    result = launch(str(resumed), steps=7, processes=2, checkpoint_every=2, env=failing,
                    echo=said.append)
    assert result.code == 1 and result.failed_rank == 2, result.message
    assert "killed by SIGKILL" in result.message, result.message
    folder = resumed / "checkpoints" / "rank_2"
    names = sorted(os.listdir(folder))
    assert "step_00000004.json" not in names and "step_00000004.safetensors" not in names
    assert any(n.startswith(".step_00000004.safetensors.tmp-") for n in names), names
    assert resume_point(str(resumed / "checkpoints"), 4).step == 2
    log = (resumed / "rank_0" / "run.log").read_text()
    assert "checkpoint of step 2 (rank(s) 0..1): " in log and " MB in " in log, log
    compile_model(model_path, devices=4, out_dir=str(resumed))
    said.clear()
    assert launch(str(resumed), steps=7, processes=2, resume=True, echo=said.append).code == 0
    for r in range(4):
        a = (straight / f"rank_{r}" / "train.log").read_bytes()
        assert (resumed / f"rank_{r}" / "train.log").read_bytes() == a
    same_checkpoints(straight, resumed, 7)
    assert not any(n.startswith(".") for n in os.listdir(folder))  # the leftover is gone


@pytest.mark.slow
def test_a_taken_coordinator_port_is_retried(model_path, tmp_path, monkeypatch) -> None:
    import socket

    import pcompile.backends.launcher as launcher

    out = tmp_path / "out"
    compile_model(model_path, devices=4, out_dir=str(out))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = [busy.getsockname()[1]]
        real = launcher.free_port
        monkeypatch.setattr(launcher, "free_port",
                            lambda host="127.0.0.1": ports.pop() if ports else real(host))
        said: list[str] = []
        result = launch(str(out), steps=2, processes=2, echo=said.append)
    assert result.code == 0, said
    assert any("was taken; retrying" in line for line in said)


@pytest.mark.slow
def test_a_second_run_into_the_same_folder_is_refused(model_path, tmp_path) -> None:
    out = tmp_path / "out"
    first = cli(model_path, str(out), "--run", "--steps", "1000000")
    try:
        info = wait_for_progress(out, first)
        second = cli(model_path, str(out), "--run", "--steps", "3")
        output, _ = second.communicate(timeout=120)
        assert second.returncode == 1, output
        assert f"is in use by another pcompile (pid {first.pid}" in output, output
        assert first.poll() is None and all(alive(p["pid"]) for p in info["processes"])
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130


def damage(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.slow
def test_resume_falls_back_past_a_damaged_checkpoint(model_path, tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        compile_model(model_path, devices=4, out_dir=str(out))
    said: list[str] = []
    assert launch(str(straight), steps=7, processes=2, echo=said.append).code == 0
    failing = dict(clean_env(), PCOMPILE_FAULT_INJECT="3:6")
    assert launch(str(resumed), steps=7, processes=2, checkpoint_every=2, env=failing,
                  echo=said.append).code == 1
    ckpt = resumed / "checkpoints"
    damage(ckpt / "rank_1" / "step_00000004.safetensors")  # every rank holds step 2 intact
    leftover = ckpt / "rank_0" / ".step_00000006.safetensors.tmp-0123abcd"  # a killed write
    leftover.write_bytes(b"half")
    said.clear()
    result = launch(str(resumed), steps=7, processes=2, resume=True, echo=said.append)
    assert result.code == 0, said
    assert any("passed over damaged checkpoint step 4: rank 1:" in line for line in said), said
    for r in range(4):
        a = (straight / f"rank_{r}" / "train.log").read_bytes()
        assert (resumed / f"rank_{r}" / "train.log").read_bytes() == a
    assert not leftover.exists()


@pytest.mark.slow
def test_resume_problems_are_one_message(model_path, tmp_path) -> None:
    out = tmp_path / "out"
    proc = cli(model_path, str(out), "--run", "--steps", "4", "--checkpoint-every", "2")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    proc = cli(model_path, str(out), "--run", "--resume", "--steps", "3")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "the checkpoint is at step 4, beyond --steps 3; ask for at least 4 steps" in output
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    # Every rank's step 4 and step 2 damaged: nothing to resume from, and it says why.
    for r in range(4):
        damage(out / "checkpoints" / f"rank_{r}" / "step_00000004.safetensors")
    (out / "checkpoints" / "rank_2" / "step_00000002.safetensors").write_bytes(b"")
    proc = cli(model_path, str(out), "--run", "--resume", "--steps", "6")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "--resume: no step has an intact checkpoint of every rank" in output
    assert "step 2: rank 2: " in output and "is empty (0 bytes)" in output
    assert "Traceback" not in output


@pytest.mark.slow
def test_a_checkpoint_full_of_nan_stops_the_resumed_run_at_its_first_step(model_path,
                                                                          tmp_path) -> None:
    from pcompile.backends.checkpoint_files import read_checkpoint, write_checkpoint

    out = tmp_path / "out"
    compile_model(model_path, devices=4, out_dir=str(out))
    assert launch(str(out), steps=4, processes=4, echo=lambda line: None).code == 0
    for r in range(4):
        path = out / "checkpoints" / f"rank_{r}" / "step_00000004.json"
        arrays, meta = read_checkpoint(str(path), r)
        path.unlink()
        nan = {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v
               for k, v in arrays.items()}
        meta.pop("arrays")
        write_checkpoint(str(out / "checkpoints"), r, 4, nan, meta)
    said: list[str] = []
    result = launch(str(out), steps=8, processes=4, resume=True, echo=said.append)
    assert result.code == 1
    assert "exit status 3: the loss is not finite" in result.message, result.message
    assert "the loss is nan at step 5 (epoch 2, step 2)" in result.message


@pytest.mark.slow
def test_two_processes_started_by_torchrun_conventions_are_one_job(model_path,
                                                                   tmp_path) -> None:
    from pcompile.backends.launcher import free_port

    out = tmp_path / "out"
    compile_model(model_path, devices=4, out_dir=str(out))
    port = str(free_port())
    procs = [subprocess.Popen(
        [sys.executable, str(out / "rank_0" / "program.py"), "--steps", "3"],
        env=dict(clean_env(), RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for r in range(2)]
    outputs = []
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output
        outputs.append(output)
    assert "rank(s) 0..1: steps 1..3" in outputs[0], outputs[0]
    assert "rank(s) 2..3: steps 1..3" in outputs[1], outputs[1]
    parallel = compile_model(model_path, devices=4, dump=False)
    want, _ = single_device(model_path, parallel, 3)
    for r in range(4):
        np.testing.assert_allclose(losses(out, r), want,
                                   rtol=rounding_rtol(parallel, np.float32, steps=3))


@pytest.mark.slow
def test_hybrid_parallel_seed_trains_on_eight_processes_like_one_device(tmp_path) -> None:
    """The literal manual-parallel seed (the model file runs as each rank: `get_rank()` picks
    each rank's rows) is one SPMD program whose ranks differ only in slice offsets: its
    generated program runs on 8 processes under jax.distributed and every rank's loss follows
    single-device training (float32 on both sides: `rounding_rtol`)."""
    model = os.path.join(ROOT, "tests", "models", "manual_parallel_literal.py")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, CLI, model, "--devices", "8", "--out", str(out), "--no-check",
         "--run", "--steps", "3"],
        capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parallel = compile_model(model, devices=8, dump=False)
    assert parallel.state.parallel_mode == "hybrid_parallel"
    ref = compile_model(model, devices=1, dump=False)
    runner = StandAloneRunner(ref, "numpy")
    for name in runner.values:
        runner.values[name] = np.array(parallel.initial_values[name], copy=True)
    want = [runner.step(a) for _, _, a in batches(ref, 3)]
    bound = rounding_rtol(parallel, np.float32, steps=3)
    for r in range(8):
        np.testing.assert_allclose(losses(out, r), want, rtol=bound)


def test_a_symlinked_run_log_is_replaced_not_written_through(model_path, tmp_path) -> None:
    """A `rank_r/run.log` that links to a file outside --out is not carried
    by a recompile, and the launcher replaces such a link by a fresh log instead of truncating
    its target. (The ranks are `true`: only the launcher's own writes matter here.)"""
    import shutil

    from pcompile.backends.launcher import LaunchError

    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    compile_model(model_path, devices=4, out_dir=str(out))
    (out / "rank_0" / "run.log").symlink_to(victim)
    compile_model(model_path, devices=4, out_dir=str(out))  # a recompile drops the link
    assert not (out / "rank_0" / "run.log").is_symlink()
    for rank in range(4):  # made after the compile: the launcher replaces them
        (out / f"rank_{rank}" / "run.log").unlink(missing_ok=True)
        (out / f"rank_{rank}" / "run.log").symlink_to(victim)
    result = launch(str(out), steps=1, python=shutil.which("true"), echo=lambda _: None,
                    env=clean_env())
    assert result.code == 0, result.message
    assert victim.read_text() == "precious\n"
    for rank in range(4):
        log = out / f"rank_{rank}" / "run.log"
        assert log.is_file() and not log.is_symlink()
    # A rank folder that is a link elsewhere is refused: logs stay inside --out.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(out / "rank_1")
    (out / "rank_1").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(LaunchError, match="symbolic link"):
        launch(str(out), steps=1, python=shutil.which("true"), echo=lambda _: None, env=clean_env())
    assert os.listdir(elsewhere) == []


def test_start_up_phases_of_the_first_process_are_echoed_once_until_its_first_step() -> None:
    """A large model's start-up is not silent: each start-up phase rank 0's heartbeat reports
    is said once, in order, and nothing once its first step is done."""
    from pcompile.backends.launcher import _echo_startup, _Proc

    now = time.monotonic()
    proc = _Proc(0, [0], None, "run.log", -1, now, now)  # type: ignore[arg-type]
    said: list[str] = []
    told: set[str] = set()
    for phase, done in [("start", None), ("connect", None), ("connect", None), ("init", None),
                        ("data", 0), ("compile", 0), ("compile", 0), ("compute", 1),
                        ("compile", 1)]:
        proc.phase, proc.done = phase, done
        if proc.first_done is None and done is not None:
            proc.first_done = done
        _echo_startup(proc, told, said.append)
    assert [line.split(" is ", 1)[1].split(" (")[0] for line in said] == [
        "connecting to the other processes", "making its parameter slices and optimizer state",
        "compiling the step"], said
    assert all(line.startswith("pcompile launcher: rank 0 is ") for line in said)
