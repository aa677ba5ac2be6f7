"""Checkpoints written off the training thread.

A rank program's training thread copies its ranks' state to host memory (the step that follows
donates the device buffers, so the copy is taken before it runs) and hands the copy to
`AsyncCheckpointWriter.submit`; a background thread writes it (backends/checkpoint.py:
safetensors and a JSON index per rank, atomic) while the next steps run. The next checkpoint,
and the end of the run, wait for the write in flight: at most one is pending, so host memory
holds at most one copy of the state.

A write that fails (a full disk, a folder that went away) leaves no partial checkpoint under the
final names and the previous checkpoints untouched (they are pruned only after a newer one is
complete). The failure is reported once, as `CheckpointWriteError`, naming the step, the rank,
the file and the reason, and which earlier checkpoint is intact: by `failure()` at the next
step, or by `submit` / `wait`.

Every completed checkpoint is reported through `say`: its step, megabytes, the seconds of the
background write, and the seconds the training thread spent on the host copy (and, at the end,
waiting).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.backends.checkpoint import write_checkpoint_report


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _full_disk() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


_FAULTS = {"checkpoint-kill": _kill, "checkpoint-enospc": _full_disk}


class CheckpointWriteError(Exception):
    """A checkpoint could not be written; the message says which, why, and what is intact."""


@dataclass
class _Pending:
    step: int
    thread: threading.Thread
    copy_seconds: float


def _reason(exc: BaseException) -> str:
    """Why a write failed, in words (safetensors reports I/O errors as text with the errno)."""
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)
    if code == errno.ENOSPC or "os error 28" in text or "No space left" in text:
        return "no space left on the device (the disk is full)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return f"{type(exc).__name__}: {text}"


class AsyncCheckpointWriter:
    """Writes one process's checkpoints in a background thread, one at a time.

    `folder`: the checkpoint folder; `say`: prints a line (to run.log); `keep`: steps kept per
    rank; `intact`: the newest step already on disk for every rank (a resumed run's), named when
    a later write fails."""

    def __init__(self, folder: str, say: Callable[[str], None], keep: int = 2,
                 intact: int | None = None, fault: tuple[int | None, str] = (None, "")
                 ) -> None:
        self.folder = folder
        # testing (PCOMPILE_FAULT_INJECT): in the write of step fault[0], "checkpoint-kill"
        # SIGKILLs this process, "checkpoint-enospc" fails as a full disk does
        self.fault = fault
        self.say = say
        self.keep = keep
        self.intact = intact
        self._pending: _Pending | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def submit(self, step: int, per_rank: Mapping[int, tuple[Mapping[str, np.ndarray],
                                                              dict[str, Any]]],
               copy_seconds: float) -> float:
        """Start writing `per_rank` (rank -> (host values, metadata)) as the checkpoint of
        `step`, after the write in flight (if any) is done; returns the seconds waited for it.
        Raises `CheckpointWriteError` if an earlier write failed."""
        waited = self.wait()
        thread = threading.Thread(target=self._write, args=(step, dict(per_rank), copy_seconds),
                                  name=f"pcompile-checkpoint-{step}")
        self._pending = _Pending(step, thread, copy_seconds)
        thread.start()
        return waited

    def failure(self) -> CheckpointWriteError | None:
        """The error of a write that failed, without waiting (None: none so far, or already
        reported: each failure is reported once)."""
        with self._lock:
            error, self._error = self._error, None
        return CheckpointWriteError(error) if error else None

    def wait(self) -> float:
        """Wait for the write in flight; returns the seconds waited. Raises
        `CheckpointWriteError` if it (or an earlier one) failed and was not reported yet."""
        start = time.perf_counter()
        if self._pending is not None:
            self._pending.thread.join()
            self._pending = None
        error = self.failure()
        if error is not None:
            raise error
        return time.perf_counter() - start

    @property
    def busy(self) -> bool:
        return self._pending is not None and self._pending.thread.is_alive()

    def _write(self, step: int, per_rank: dict[int, tuple[Mapping[str, np.ndarray],
                                                          dict[str, Any]]],
               copy_seconds: float) -> None:
        start = time.perf_counter()
        nbytes = 0
        for rank, (values, meta) in sorted(per_rank.items()):
            try:
                report = write_checkpoint_report(
                    self.folder, rank, step, values, meta, self.keep,
                    before_rename=_FAULTS.get(self.fault[1]) if step == self.fault[0] else None)
            except Exception as exc:  # noqa: BLE001  (any failure: reported, not a traceback)
                where = os.path.join(self.folder, f"rank_{rank}")
                before = (f"the checkpoint of step {self.intact} is intact" if self.intact
                          is not None else "no earlier checkpoint of this run exists")
                with self._lock:
                    self._error = (f"the checkpoint of step {step} could not be written (rank "
                                   f"{rank}, in {where}: {_reason(exc)}); nothing of it was "
                                   f"kept, and {before}")
                return
            nbytes += report.nbytes
        self.intact = step
        seconds = time.perf_counter() - start
        ranks = sorted(per_rank)
        self.say(f"checkpoint of step {step} (rank(s) {ranks[0]}..{ranks[-1]}): "
                 f"{nbytes / 1e6:.1f} MB in {seconds:.2f} s, written in the background "
                 f"(host copy {copy_seconds:.2f} s on the training thread) -> {self.folder}")
