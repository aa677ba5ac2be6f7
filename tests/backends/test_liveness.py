"""The launcher's liveness check on 8 rank processes: a rank stopped (SIGSTOP) mid-run or during
start-up, a rank alive but stuck, a rank that fails while the others fail after it. Each time
the launcher must end the run within the deadline + 10 s and name that rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests import ROOT
from tests.multiprocess import clean_env, mlp_source

MODEL8 = mlp_source("((2, 4), (4, 1))", relu_matmul=True)


@pytest.fixture(scope="module")
def model8(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "mlp8.py"
    path.write_text(textwrap.dedent(MODEL8))
    return str(path)


def start(model: str, out, *flags: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pcompile", model, "--devices", "8", "--parallel-mode",
         "semi_auto_parallel", "--out", str(out), "--no-check", "--run", "--steps", "1000000",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=clean_env(**extra), cwd=ROOT)


def wait_for(predicate, proc: subprocess.Popen[str], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the launch ended early:\n{proc.stdout.read()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out waiting")


def losses_logged(out, n: int):
    log = out / "rank_0" / "train.log"
    return lambda: log.exists() and log.read_text().count("\n") >= n


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, float]:
    begin = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return output, time.monotonic() - begin


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pids(out) -> list[int]:
    return [p["pid"] for p in json.loads((out / "launch.json").read_text())["processes"]]


@pytest.mark.slow
def test_a_rank_stopped_mid_run_is_named_within_the_deadline(model8, tmp_path) -> None:
    out = tmp_path / "out"
    proc = start(model8, out, "--timeout", "10")
    wait_for(losses_logged(out, 3), proc)
    os.kill(pids(out)[5], signal.SIGSTOP)
    output, elapsed = finish(proc, 60)
    assert proc.returncode == 1, output
    assert elapsed < 10 + 10, elapsed
    assert "rank 5 stopped responding (no heartbeat for" in output, output
    assert not any(alive(p) for p in pids(out))


@pytest.mark.slow
def test_a_rank_stopped_during_start_up_is_named_within_the_deadline(model8, tmp_path) -> None:
    out = tmp_path / "out"
    proc = start(model8, out, "--startup-timeout", "20")
    wait_for(lambda: (out / "launch.json").exists(), proc)
    os.kill(pids(out)[3], signal.SIGSTOP)
    output, elapsed = finish(proc, 60)
    assert proc.returncode == 1, output
    assert elapsed < 20 + 10, elapsed
    assert "rank 3 stopped responding (no heartbeat" in output, output
    assert not (out / "rank_0" / "train.log").exists() or \
        not (out / "rank_0" / "train.log").read_text()
    assert not any(alive(p) for p in pids(out))


@pytest.mark.slow
def test_a_rank_alive_but_stuck_is_named_at_the_step_deadline(model8, tmp_path) -> None:
    out = tmp_path / "out"
    proc = start(model8, out, "--timeout", "8", PCOMPILE_FAULT_INJECT="6:4:hang")
    wait_for(losses_logged(out, 3), proc)
    output, elapsed = finish(proc, 60)
    assert proc.returncode == 1, output
    assert elapsed < 8 + 10, elapsed
    assert "rank 6 did not finish within 8 s (--timeout)" in output, output
    assert "reading its next batch" in output


@pytest.mark.slow
def test_the_rank_that_failed_first_is_named_not_a_follow_on_error(model8, tmp_path) -> None:
    out = tmp_path / "out"
    proc = start(model8, out, PCOMPILE_FAULT_INJECT="6:3")
    output, _ = finish(proc, 180)
    assert proc.returncode == 1, output
    assert "rank 6 failed first (exit status 1)" in output, output
    assert "PCOMPILE_FAULT_INJECT: failing at step 3" in output


def _proc(tmp_path, process: int, code: int | None, log: str, exited_ago: float = 0.0,
          failed_ago: float | None = None):
    from pcompile.backends.launcher import _Proc

    path = tmp_path / f"run_{process}.log"
    path.write_text(log)
    now = time.time()
    proc = _Proc(process, [process], None, str(path), -1, time.monotonic(), time.monotonic(),
                 last_beat=time.monotonic(), code=code)
    proc.exited_at = None if code is None else now - exited_ago
    proc.failed_at = None if failed_ago is None else now - failed_ago
    return proc


ABORTED = ("F1128 client.h:80] Terminating process because the JAX distributed service detected "
           "fatal errors. This most likely indicates that another task died\n")


def test_a_process_aborted_by_jax_distributed_after_another_left_is_not_named_first(
        tmp_path) -> None:
    from pcompile.backends.launcher import FOLLOW_ON_GRACE, _first_failure

    nan = "rank 0: error: the loss is nan at step 5\n"
    # Rank 3 aborted (SIGABRT) after rank 0 left with its own error: rank 0 is named.
    ranks = [_proc(tmp_path, 0, 3, nan, 0.2, 0.3), _proc(tmp_path, 1, None, ""),
             _proc(tmp_path, 3, -signal.SIGABRT, ABORTED, 0.1)]
    assert _first_failure(ranks) is ranks[0]
    # Only the follow-on has been seen so far: wait for the one it points at...
    ranks = [_proc(tmp_path, 0, None, ""), _proc(tmp_path, 3, -signal.SIGABRT, ABORTED, 0.1)]
    assert _first_failure(ranks) is None
    # ... but not for ever.
    ranks = [_proc(tmp_path, 0, None, ""),
             _proc(tmp_path, 3, -signal.SIGABRT, ABORTED, FOLLOW_ON_GRACE + 1)]
    assert _first_failure(ranks) is ranks[1]
    # A SIGABRT of its own (no follow-on message) still counts as a signal death, first.
    ranks = [_proc(tmp_path, 0, 3, nan, 0.2, 0.3),
             _proc(tmp_path, 3, -signal.SIGABRT, "double free or corruption\n", 0.1)]
    assert _first_failure(ranks) is ranks[1]
