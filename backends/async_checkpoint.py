"""Checkpoints written off the training thread.

A rank program's training thread copies its ranks' state to host memory (the step that follows
donates the device buffers, so the copy is taken before it runs) and hands the copy to
`AsyncCheckpointWriter.submit`; a background thread writes it (backends/checkpoint_files.py:
safetensors and a JSON index per rank, atomic) while the next steps run. The next checkpoint,
and the end of the run, wait for the write in flight: at most one is pending, so host memory
holds one copy of the state at most.

A write that fails (a full disk, a folder that went away) leaves no partial checkpoint under the
final names and the previous checkpoints untouched (they are pruned only after a newer one is
complete). The failure is reported once, as `CheckpointWriteError`, naming the step, the rank
and its folder, the reason, and which earlier checkpoint is intact: by `failure()` at the next
step, or by `submit` / `wait`.

`HostState` takes the host copies: on CPU devices (whose buffers numpy may share, and which the
next step reuses) into host buffers allocated once and reused by every checkpoint (first-touch
page faults cost more than the copy: 2.6 s against 0.14 s for 805 MB on the 2-core test
machine), faulted in by a background thread when periodic checkpoints are asked for; on other
devices the transfer itself makes the copy. The final checkpoint takes no copy at all: no step
follows it, so the writer reads the device buffers directly (every device-to-host transfer
is started at once, before the writer asks for the first).

Every completed checkpoint is reported through `say`: its step, megabytes, the seconds of the
background write, and the seconds the training thread spent on it (the host copy).

Runs and pruning: every checkpoint names the run that wrote it (`run`, an id: the launcher's
`PCOMPILE_RUN_ID`, else one that process 0 makes and shares through jax.distributed's
key-value store; a resumed run keeps the id of the run it continues). After each write the
writer prunes its ranks' folders (`prune_checkpoints`) knowing the newest step of this run
that every rank holds (`StepAgreement`: each process records the steps it wrote in the
key-value store; one process holding every rank knows it alone), so that one rank's failed
write never removes the last step the ranks have in common, and an earlier run's checkpoints
are removed only once this run has one on every rank (and said so). Each rank's train.log lines
are appended to the run's log beside the checkpoints (`append_run_log`), only the lines since
the previous checkpoint: the index holds their count and sha256, not the lines.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.backends.checkpoint_files import (
    add_log_lines,
    append_run_log,
    log_digest,
    prune_checkpoints,
    restart_run_log,
    write_checkpoint_report,
)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _full_disk() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


_FAULTS = {"checkpoint-kill": _kill, "checkpoint-enospc": _full_disk}


def background_priority() -> None:
    """Lower this thread's scheduling priority (Linux: a nice of its own), so that a write
    yields the cores to the training step's threads (on CPU devices they compete)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class _DeviceView:
    """One rank's piece of a state array (its block), read (D2H on a GPU) by the writer thread."""

    def __init__(self, data: Any, shape: tuple[int, ...]) -> None:
        self.data = data
        self.shape = shape

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = np.asarray(self.data).reshape(self.shape)  # a scalar's block has 1 element
        return array if dtype is None else array.astype(dtype, copy=False)


class HostState:
    """Host copies of this process's ranks' pieces of the state arrays, for the writer.
    At most one checkpoint is pending, so one set of host buffers serves them all."""

    def __init__(self, mesh: Any, shapes: Mapping[str, tuple[int, ...]]) -> None:
        from pcompile.backends.jax.spmd import rank_of_devices

        self.ranks = rank_of_devices(mesh)
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self._buffers: dict[tuple[str, int], np.ndarray] = {}
        self._prefault: threading.Thread | None = None

    def prefault(self, state: Mapping[str, Any]) -> None:
        """Allocate and touch the host buffers of CPU-device pieces in a background thread
        (periodic checkpoints will need them; the first one then copies at memory speed)."""
        wanted = [((name, self.ranks[s.device]), self.shapes[name], s.data.dtype)
                  for name, array in state.items() for s in array.addressable_shards
                  if s.device.platform == "cpu"]

        def touch() -> None:
            for key, shape, dtype in wanted:
                buffer = np.empty(shape, dtype)
                buffer.reshape(-1).view(np.uint8)[::4096] = 0  # one write per page
                self._buffers[key] = buffer

        self._prefault = threading.Thread(target=touch, name="pcompile-prefault", daemon=True)
        self._prefault.start()

    def take(self, state: Mapping[str, Any], final: bool = False
             ) -> dict[str, dict[int, Any]]:
        """name -> rank -> that rank's value: copies that the next steps cannot change, or,
        for the `final` checkpoint (no step follows), views the writer reads itself."""
        if self._prefault is not None:
            self._prefault.join()
            self._prefault = None
        for array in state.values():  # start every transfer (all at once), then collect
            try:
                array.copy_to_host_async()
            except (AttributeError, RuntimeError):
                pass
        if final:  # the writer reads the transfers started above
            return {name: {self.ranks[s.device]: _DeviceView(s.data, self.shapes[name])
                           for s in array.addressable_shards} for name, array in state.items()}
        out: dict[str, dict[int, Any]] = {}
        for name, array in state.items():
            out[name] = {}
            for s in array.addressable_shards:
                rank = self.ranks[s.device]
                piece = np.asarray(s.data).reshape(self.shapes[name])
                if s.device.platform == "cpu":  # may share the device buffer: copy it
                    buffer = self._buffers.get((name, rank))
                    if buffer is None or buffer.shape != piece.shape or \
                            buffer.dtype != piece.dtype:
                        buffer = self._buffers[(name, rank)] = np.empty_like(piece)
                    np.copyto(buffer, piece)
                    piece = buffer
                out[name][rank] = piece
        return out


class StepAgreement:
    """Which checkpoints of run `run` every rank holds. `client`: jax.distributed's key-value
    client, with `processes` processes of which this is `index` (None: this process holds every
    rank, and what it wrote is everywhere)."""

    def __init__(self, run: str, client: Any = None, processes: int = 1, index: int = 0
                 ) -> None:
        self.run, self.client, self.processes, self.index = run, client, processes, index
        self.written: set[int] = set()  # by this process, for all of its ranks

    def _key(self, step: int) -> str:
        return f"pcompile/checkpoint/{self.run}/{step}/"

    def record(self, step: int) -> None:
        """This process wrote `step` for all of its ranks."""
        self.written.add(step)
        if self.client is not None:
            try:
                self.client.key_value_set(self._key(step) + str(self.index), "written")
            except Exception:  # noqa: BLE001  (written twice, or the coordinator is gone)
                pass

    def everywhere(self, step: int, wait: float = 0.0) -> bool:
        """Whether every process wrote `step` (waiting up to `wait` seconds for them)."""
        if step not in self.written:
            return False
        if self.client is None:
            return True
        deadline = time.monotonic() + wait
        while True:
            try:
                if len(self.client.key_value_dir_get(self._key(step))) >= self.processes:
                    return True
            except Exception:  # noqa: BLE001  (the coordinator is gone: not known)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


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
    a later write fails. `start_run` names the run (module docstring) before the first write."""

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
        self.agreement: StepAgreement | None = None
        self.complete: int | None = None  # the newest step of the run every rank holds
        self._logs: dict[int, tuple[int, Any]] = {}  # rank -> lines in the run's log, sha256
        self._pending: _Pending | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def start_run(self, agreement: StepAgreement, logs: Mapping[int, Sequence[str]],
                  complete: int | None = None) -> None:
        """Write checkpoints as run `agreement.run`: `logs` holds each of this process's ranks'
        train.log lines so far (a resumed run's; its run log is made to hold exactly them);
        `complete`: a step every rank already holds (the one resumed from)."""
        self.agreement, self.complete = agreement, complete
        if complete is not None:
            agreement.written.add(complete)
        for rank, lines in logs.items():
            restart_run_log(self.folder, rank, agreement.run, lines)
            self._logs[rank] = (len(lines), log_digest(lines))

    def submit(self, step: int, per_rank: Mapping[int, tuple[Mapping[str, np.ndarray],
                                                              dict[str, Any]]],
               copy_seconds: float, logs: Mapping[int, Sequence[str]] | None = None,
               final: bool = False) -> float:
        """Start writing `per_rank` (rank -> (host values, metadata)) as the checkpoint of
        `step`, after the write in flight (if any) is done; returns the seconds waited for it.
        `logs`: each rank's train.log lines (a list that only grows; the first
        `meta["log_lines"]` are the step's). Raises `CheckpointWriteError` if an earlier write
        failed."""
        waited = self.wait()
        thread = threading.Thread(target=self._write,
                                  args=(step, dict(per_rank), copy_seconds, logs or {}, final),
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

    def _with_log(self, rank: int, meta: dict[str, Any], logs: Mapping[int, Sequence[str]]
                  ) -> dict[str, Any]:
        """`meta` with the run and the step's train.log lines (appended to the run's log)."""
        if self.agreement is None:
            return meta
        meta = dict(meta, run=self.agreement.run, written=time.time())
        if rank in logs and rank in self._logs:
            count = int(meta["log_lines"])
            done, digest = self._logs[rank]
            new = list(logs[rank][done:count])
            append_run_log(self.folder, rank, self.agreement.run, new)
            add_log_lines(digest, new)
            self._logs[rank] = (count, digest)
            meta["log_sha256"] = digest.hexdigest()
        return meta

    def _write(self, step: int, per_rank: dict[int, tuple[Mapping[str, np.ndarray],
                                                          dict[str, Any]]],
               copy_seconds: float, logs: Mapping[int, Sequence[str]], final: bool) -> None:
        background_priority()
        start = time.perf_counter()
        nbytes = 0
        pruned = self.agreement is not None
        for rank, (values, meta) in sorted(per_rank.items()):
            try:
                report = write_checkpoint_report(
                    self.folder, rank, step, values, self._with_log(rank, meta, logs),
                    None if pruned else self.keep,
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
                 f"({copy_seconds:.2f} s on the training thread) -> {self.folder}")
        if pruned:
            self._prune(step, ranks, max(5.0, 2 * seconds) if final else 0.0)

    def _prune(self, step: int, ranks: list[int], wait: float) -> None:
        """Record `step` as written here, learn the newest step every rank holds, prune."""
        agreement = self.agreement
        assert agreement is not None
        agreement.record(step)
        for candidate in sorted(agreement.written, reverse=True):
            if self.complete is not None and candidate <= self.complete:
                break
            if agreement.everywhere(candidate, wait if candidate == step else 0.0):
                self.complete = candidate
                break
        removed: set[int] = set()
        for rank in ranks:
            try:
                removed.update(prune_checkpoints(self.folder, rank, step, self.keep,
                                                 agreement.run, self.complete))
            except OSError as exc:  # the checkpoint is written: a failed removal is a note
                self.say(f"note: could not prune the checkpoints of rank {rank} in "
                         f"{self.folder} ({_reason(exc)})")
        if removed:
            self.say(f"removed an earlier run's checkpoints (step(s) "
                     f"{', '.join(map(str, sorted(removed)))}) from {self.folder}: step "
                     f"{self.complete} of this run is on every rank")
