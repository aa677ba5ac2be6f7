"""The helper that turns jaxlib's C++ abort, when process 0 of a job started by hand is killed,
into one line naming it (backends/jax/abort_guard.py; the end-to-end test is
tests/backends/test_run_faults.py::test_process_0_killed_by_hand_is_one_line_in_the_others_not_jaxlibs_abort).
The helper runs here as the rank process starts it, fed the text jaxlib writes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from pcompile.backends.jax import abort_guard

# What a rank process's descriptor 2 received when process 0 was SIGKILLed (JAX 0.10.2).
ABORT = "".join(line + "\n" for line in (
    "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
    "W1207 07:03:43.983726   31894 preemption_sync_manager.cc:147] Failed to retrieve preemption "
    "notice from coordination service: UNAVAILABLE: Socket closed",
    "E1207 07:03:43.984073   31894 coordination_service_agent.cc:289] Polled an error from "
    "coordination service (this can be an error from this or another task).",
    "F1207 07:03:43.984079   31894 client.h:80] Terminating process because the JAX distributed "
    "service detected fatal errors. This most likely indicates that another task died; see the "
    "other task logs for more details. absl::Status: UNAVAILABLE: Failed to send RPC to "
    "coordination service. Either the leader task was preempted/died/restarted unexpectedly or "
    "this task is experiencing network issues.",
    "*** Check failure stack trace: ***",
    "    @     0x7f2bd2040634  absl::lts_20260107::log_internal::LogMessage::SendToLog()"))


def _helper(text: str, done: bool = False, verbose: bool = False) -> tuple[str, bytes]:
    ours, theirs = socket.socketpair()
    helper = subprocess.Popen(
        [sys.executable, "-I", "-S", abort_guard.__file__, "--label", "pcompile rank 1",
         "--lost", "process 0 (rank 0)", "--coordinator", "10.0.0.1:7777", "--per-process", "1",
         "--channel", str(theirs.fileno()), *(["--verbose"] if verbose else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(theirs.fileno(),))
    theirs.close()
    if done:
        ours.sendall(abort_guard.DONE)
    assert helper.stdin is not None
    helper.stdin.write(text.encode())
    helper.stdin.flush()
    ours.settimeout(10)
    told = b""
    if not done:
        told = ours.recv(64)  # before the rank process's end: the helper tells it to leave
    helper.stdin.close()
    helper.stdin = None
    output = helper.communicate(timeout=10)[0].decode()
    ours.close()
    return output, told


def test_the_abort_is_one_line_naming_process_0_and_the_process_is_told_to_leave() -> None:
    output, told = _helper(ABORT)
    assert output.splitlines() == [
        ABORT.splitlines()[0],
        "pcompile rank 1: error: process 0 (rank 0) is lost: the coordinator at 10.0.0.1:7777 "
        "closed its connection or stopped answering (process 0 was killed, or its host is down "
        "or unreachable); stopped this process"]
    assert told == abort_guard.LOST


def test_with_verbose_jaxlibs_text_follows_the_line() -> None:
    output, _ = _helper(ABORT, verbose=True)
    lines = output.splitlines()
    assert lines[1].startswith("pcompile rank 1: error: process 0 (rank 0) is lost")
    assert lines[2:] == ABORT.splitlines()[1:]


def test_once_the_run_is_over_the_coordinators_end_is_not_a_loss() -> None:
    output, told = _helper(ABORT, done=True)
    assert output == ABORT and told == b""


def test_what_jaxlibs_fatal_text_means() -> None:
    def said(text: str) -> str:
        return abort_guard.verdict(text, "process 0 (ranks 0-1)", "h:1", 2)

    assert said(ABORT).startswith("process 0 (ranks 0-1) is lost: the coordinator at h:1 ")
    assert said("DEADLINE_EXCEEDED: Deadline Exceeded\nRPC: /xla.coordination."
                "CoordinationService/RegisterTask").startswith(
        "not every process connected to the coordinator at h:1 in time (--startup-timeout)")
    assert said("ABORTED: The following tasks are unhealthy (stopped sending heartbeats): "
                "/job:jax_worker/replica:0/task:3").startswith("process 3 (ranks 6-7) is lost")


def test_a_rank_process_routes_only_descriptor_2_through_the_helper(tmp_path) -> None:
    """Python's sys.stderr keeps the real stderr (a terminal stays one); what the C++ runtime
    writes to descriptor 2 reaches it through the helper."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys\n"
        "from pcompile.backends.jax.abort_guard import start_abort_guard\n"
        "from pcompile.program.progress import log, setup_logging\n"
        "setup_logging(1)\n"
        "real = os.readlink('/proc/self/fd/2')\n"
        "guard = start_abort_guard('pcompile rank 1', 'process 0 (rank 0)', 'h:1', 1)\n"
        "assert guard is not None\n"
        "assert os.readlink(f'/proc/self/fd/{sys.stderr.fileno()}') == real\n"
        "assert os.readlink('/proc/self/fd/2') != real\n"
        "assert log.handlers[0].stream is sys.stderr\n"
        "print('python line', file=sys.stderr)\n"
        "os.write(2, b'c++ line\\n')\n")
    done = subprocess.run([sys.executable, str(script)], stderr=subprocess.PIPE, text=True,
                          timeout=30, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stderr.splitlines()) == ["c++ line", "python line"]
