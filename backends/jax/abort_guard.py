"""One line, not JAX's C++ abort, when process 0 of a job started by hand is killed.

Process 0 hosts `jax.distributed`'s coordination service. When it is killed outright (SIGKILL,
its host down), every other process's coordination client sees the connection close within
milliseconds (its `PollForError` call fails) and jaxlib ends the process from a C++ thread:
`client.h] Terminating process because the JAX distributed service detected fatal errors`, a
C++ stack trace and `abort()`. Nothing in Python runs first, and Python cannot stop it:

* `jax.distributed.initialize` (JAX 0.10.2) offers the heartbeat, initialisation and shutdown
  timeouts but no way to handle that error; its client's default handler is the fatal log;
* jaxlib's `get_distributed_runtime_client(..., missed_heartbeat_callback=f)` takes a Python
  `f`, but calling it needs the error (an `absl::Status`) as a Python object, which jaxlib has
  no conversion for: the call throws `std::bad_cast` on the C++ thread, and that is
  `std::terminate`, an abort all the same;
* the peer watch (backends/jax/peer_watch.py) polls once a second; the abort comes first.

What can be done is outside the process: `start_abort_guard` runs a small helper process
(this file as a script, standard library only) that receives everything the rank process
writes to its file descriptor 2 (the C++ runtime's logs: gloo, XLA, the coordination client),
while Python's own `sys.stderr` keeps writing to the real stderr directly (a terminal stays a
terminal). The helper passes the lines on unchanged until jaxlib's fatal coordination error
appears; then it prints one line naming the lost process (`pcompile rank 1: error: process 0
(rank 0) is lost: the coordinator at HOST:PORT closed its connection ...`) before any of
jaxlib's text, and tells the rank process, whose thread exits at once with status
`EXIT_PEER_LOST` (4) when it is quicker than jaxlib's abort (else the status is the abort's,
134). jaxlib's own text follows only with `-v`. After the run is over (`done`) the helper
judges nothing: a coordinator that goes away then is the normal end.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

EXIT_PEER_LOST = 4  # as backends/jax/peer_watch.py
#: jaxlib's lines that say the coordination service is gone or failed this task
TRIGGERS = (
    "Terminating process because the JAX distributed service detected fatal errors",
    "Polled an error from coordination service",
    "Failed to retrieve preemption notice from coordination service",
)
FATAL = TRIGGERS[0]
SETTLE = 1.0  # seconds the helper holds a warning of the coordination client back, waiting
# for jaxlib's fatal line (it comes within a millisecond when the coordinator is gone)
LOST = b"lost"
DONE = b"done"


# -- the rank process's side ---------------------------------------------------------------------


class AbortGuard:
    """The rank process's end of the helper (module docstring)."""

    def __init__(self, helper: subprocess.Popen[bytes], channel: socket.socket) -> None:
        self.helper = helper
        self.channel = channel
        threading.Thread(target=self._listen, daemon=True, name="pcompile-abort-guard").start()

    def done(self) -> None:
        """The run is over: the coordinator's end is no longer a loss."""
        try:
            self.channel.sendall(DONE)
        except OSError:
            pass

    def _listen(self) -> None:
        while True:
            try:
                data = self.channel.recv(64)
            except OSError:
                return
            if not data:  # the helper is gone: nothing to do
                return
            if LOST in data:  # the helper has said it: leave before jaxlib's abort does
                try:
                    sys.stdout.flush()
                except (OSError, ValueError):
                    pass
                os._exit(EXIT_PEER_LOST)


def start_abort_guard(label: str, lost: str, coordinator: str | None, ranks_per_process: int,
                      verbose: bool = False) -> AbortGuard | None:
    """Route this process's file descriptor 2 through the helper and keep `sys.stderr` on the
    real stderr; None where the helper cannot start (nothing changes then). `label`: this
    process's name in messages; `lost`: process 0's (`process 0 (rank 0)`); `coordinator`: its
    address, for the message."""
    try:
        real = os.dup(2)
    except OSError:
        return None
    read_end = write_end = -1
    ours = theirs = None
    try:
        read_end, write_end = os.pipe()
        ours, theirs = socket.socketpair()
        helper = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), "--label", label,
             "--lost", lost, "--coordinator", coordinator or "", "--per-process",
             str(ranks_per_process), "--channel", str(theirs.fileno()),
             *(["--verbose"] if verbose else [])],
            stdin=read_end, stdout=real, stderr=real, pass_fds=(theirs.fileno(),),
            close_fds=True)
    except (OSError, ValueError):
        for fd in (real, read_end, write_end):
            if fd >= 0:
                os.close(fd)
        for sock in (ours, theirs):
            if sock is not None:
                sock.close()
        return None
    os.close(read_end)
    theirs.close()
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    # Python writes to the real stderr (a terminal stays one: the progress display); what the
    # C++ runtime writes to descriptor 2 goes through the helper.
    stream = os.fdopen(real, "w", buffering=1, encoding=getattr(sys.stderr, "encoding", None)
                       or "utf-8", errors="backslashreplace")
    os.dup2(write_end, 2)
    os.close(write_end)
    old, sys.stderr = sys.stderr, stream
    import logging

    for name in ("pcompile", "py.warnings"):  # the rank program's log lines follow sys.stderr
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(stream)
    return AbortGuard(helper, ours)


# -- the helper ----------------------------------------------------------------------------------


def verdict(text: str, lost: str, coordinator: str, per_process: int) -> str:
    """What jaxlib's fatal coordination text `text` means, in one line."""
    if "RegisterTask" in text:
        return ("not every process connected to the coordinator"
                + (f" at {coordinator}" if coordinator else "")
                + " in time (--startup-timeout): a process was not started, exited, or cannot "
                "reach it")
    tasks = sorted({int(n) for n in re.findall(r"/task:(\d+)", text)} - {0})
    if tasks and ("heartbeat" in text.lower() or "unhealthy" in text.lower()):
        names = ", ".join(_name(q, per_process) for q in tasks)
        return (f"{names} {'is' if len(tasks) == 1 else 'are'} lost: jax.distributed's "
                "coordination service stopped hearing from it; it was killed, stopped, or its "
                "host is unreachable")
    where = f" at {coordinator}" if coordinator else ""
    return (f"{lost} is lost: the coordinator{where} closed its connection or stopped "
            "answering (process 0 was killed, or its host is down or unreachable)")


def _name(process: int, per: int) -> str:
    first = process * per
    ranks = f"rank {first}" if per == 1 else f"ranks {first}-{first + per - 1}"
    return f"process {process} ({ranks})"


def _arguments(argv: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {"label": "pcompile rank program", "lost": "process 0",
                            "coordinator": "", "per_process": 1, "channel": -1,
                            "verbose": False}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if flag == "--verbose":
            args["verbose"] = True
            i += 1
            continue
        key = flag.lstrip("-").replace("-", "_")
        value = argv[i + 1] if i + 1 < len(argv) else ""
        args[key] = int(value) if key in ("per_process", "channel") else value
        i += 2
    return args


def serve(argv: list[str]) -> int:
    """The helper: copy descriptor 0 to 1 line by line, and name the lost process once
    jaxlib's fatal coordination error appears (module docstring)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # it ends when the rank process's output does
    args = _arguments(argv)
    channel = socket.socket(fileno=args["channel"]) if args["channel"] >= 0 else None
    out = sys.stdout.buffer
    done = False
    held: list[bytes] | None = None  # lines since the first trigger
    held_at = 0.0
    decided = False
    buffer = b""
    eof = False

    def write(data: bytes) -> None:
        try:
            out.write(data)
            out.flush()
        except (OSError, ValueError):
            pass

    def decide() -> None:
        nonlocal decided
        decided = True
        text = b"".join(held or []).decode("utf-8", "replace")
        said = verdict(text, args["lost"], args["coordinator"], args["per_process"])
        write(f"{args['label']}: error: {said}; stopped this process\n".encode())
        if args["verbose"]:
            write(b"".join(held or []))
        if channel is not None:
            try:
                channel.sendall(LOST)
            except OSError:
                pass

    while not eof:
        watched: list[Any] = [0] + ([channel] if channel is not None else [])
        ready, _, _ = select.select(watched, [], [], 0.05)
        if channel is not None and channel in ready:
            try:
                message = channel.recv(64)
            except OSError:
                message = b""
            if DONE in message:
                done = True
            if not message:
                channel.close()
                channel = None
        if 0 in ready:
            try:
                chunk = os.read(0, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                eof = True
            buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        if eof and buffer:
            lines.append(buffer)
            buffer = b""
        for raw in lines:
            line = raw + b"\n"
            if decided:
                if args["verbose"]:
                    write(line)
                continue
            if held is not None:
                held.append(line)
                if FATAL.encode() in line:
                    decide()
                continue
            text = line.decode("utf-8", "replace")
            if not done and any(t in text for t in TRIGGERS):
                held, held_at = [line], time.monotonic()
                if FATAL in text:
                    decide()
                continue
            write(line)
        if held is not None and not decided:
            if eof:  # the process ended right after them: jaxlib's abort
                decide()
            elif time.monotonic() - held_at > SETTLE:  # a passing error: not the end
                write(b"".join(held))
                held = None
        if buffer and held is None and not ready:  # a partial line, quiet since: pass it on
            write(buffer)
            buffer = b""
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
