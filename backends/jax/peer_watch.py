"""Liveness between rank processes started by hand (`mpirun`, `srun`, `torchrun`, plain
flags: docs/running.md), through the key-value store of `jax.distributed`'s coordinator.

Under pcompile's launcher every process beats on a pipe and the launcher names the one that
failed or went silent (backends/launcher.py). Started by hand, nobody watches: a killed process
leaves the others inside a collective until `jax.distributed` gives up (about 100 s) and aborts
them with a C++ stack trace, or gloo fails them with a traceback. `PeerWatch` gives the rank
programs that liveness on their own:

* every process writes `pcompile/alive/<p>` (a counter) every `INTERVAL` seconds from a thread;
  `done` when its run is over, `failed <message>` when it fails;
* process 0 (which hosts the coordinator) reads them all in one call and judges: a process
  whose counter has not moved for `timeout` seconds (`--heartbeat-timeout`) is lost, and so is
  one that wrote `failed ...`; it publishes the verdict under `pcompile/lost`;
* every other process reads the verdict and process 0's own counter: a verdict, process 0
  silent for `timeout` seconds, or a coordinator that has not answered for `timeout` seconds
  (process 0 killed, or its host unreachable) is the end;
* each process then prints one line naming the lost process and what happened to it, and
  exits (status `EXIT_PEER_LOST`), instead of waiting in its collective; process 0 waits a few
  seconds for the others to read its verdict first (they acknowledge under `pcompile/ack/`).
  Process 0's own end (a failure, Ctrl-C, SIGTERM) is published the same way before its
  coordinator goes: the coordinator's end makes `jax.distributed` abort every other process.
  A process 0 that is killed outright cannot say anything: the other processes' coordination
  clients abort them (C++) within milliseconds, before this watch can notice; the helper of
  backends/jax/abort_guard.py prints the one line naming it there.

The traffic is O(processes) calls per interval (process 0 reads one list; every other
process reads two keys).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

EXIT_PEER_LOST = 4  # another process of the job was lost
INTERVAL = 1.0  # seconds between a process's heartbeats
BEATS = "pcompile/alive/"
VERDICT = "pcompile/lost"
ACKS = "pcompile/ack/"
ACK_WAIT = 5.0  # seconds process 0 waits for the others to read its verdict


def _missing(exc: Exception) -> bool:
    return "NOT_FOUND" in str(exc) or "not found" in str(exc).lower()


class PeerWatch:
    """Watches the other processes of a job started by hand (module docstring).

    `client`: jax.distributed's key-value client; `process`, `processes`: this process's index
    and their number; `ranks_per_process`: to name a process's ranks; `label`: this process's
    name in messages; `coordinator`: the coordinator's address (for the message when it is
    gone); `timeout`: seconds of silence after which a process counts as lost; `on_lost`:
    called with the message once a process is lost (default: print it and exit)."""

    def __init__(self, client: Any, process: int, processes: int, ranks_per_process: int,
                 label: str, coordinator: str | None, timeout: float,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.client = client
        self.process = process
        self.processes = processes
        self.per = ranks_per_process
        self.label = label
        self.coordinator = coordinator
        self.timeout = timeout
        self.on_lost = on_lost or self._exit
        self.before_exit: list[Callable[[], None]] = []  # run before the default exit
        self.verdict: str | None = None
        self._stopped = threading.Event()
        self._decided = threading.Event()
        self._lock = threading.Lock()
        self._count = 0
        now = time.monotonic()
        self._answered = now  # the coordinator's last answer
        self._seen: dict[int, tuple[str, float]] = {}  # process -> (its counter, when it moved)
        self._started = now

    # -- the life of the watch -----------------------------------------------------------------
    def start(self) -> PeerWatch:
        threading.Thread(target=self._beat, daemon=True, name="pcompile-peer-beat").start()
        threading.Thread(target=self._judge, daemon=True, name="pcompile-peer-judge").start()
        return self

    def finished(self) -> None:
        """This process's run is over: the others stop watching it, it stops watching them."""
        self._stopped.set()
        self._put("done", wait=2.0)

    def failed(self, message: str) -> None:
        """This process is about to exit with `message`: the others hear it at once. Process 0
        hosts the coordinator, whose end aborts the others (JAX's C++ abort): it publishes its
        own verdict and gives them `ACK_WAIT` seconds to read it first."""
        with self._lock:
            decided = self.verdict is not None
        self._stopped.set()
        said = message.removeprefix(f"{self.label}: ").removeprefix("error: ")
        if said.startswith("failed (") and said.endswith(")"):  # an unexpected exception
            said = said[len("failed ("):-1]
        self._put("failed " + said[-1500:], wait=2.0)
        if self.process == 0 and not decided:
            verdict = self._ended(0, said[-1500:])
            self._put(verdict, wait=2.0, key=VERDICT)
            self._await_acks(verdict)

    def wait_for_verdict(self, seconds: float) -> str | None:
        """Wait up to `seconds` for a lost process to be found (a collective that failed
        because a peer went away); the verdict's message, or None."""
        self._decided.wait(seconds)
        return self.verdict

    # -- naming --------------------------------------------------------------------------------
    def name(self, process: int) -> str:
        first = process * self.per
        ranks = f"rank {first}" if self.per == 1 else f"ranks {first}-{first + self.per - 1}"
        return f"process {process} ({ranks})"

    # -- threads -------------------------------------------------------------------------------
    def _ended(self, process: int, said: str) -> str:
        """The verdict on a process that said `said` as it ended."""
        if said == "interrupted" or said.startswith("stopped by "):
            return f"{self.name(process)} was {said}"
        return f"{self.name(process)} failed: {said}"

    def _put(self, value: str, wait: float = 0.0, key: str | None = None) -> None:
        """Write this process's beat (or `key`); with `wait`, from a thread given that long
        (the coordinator may be gone)."""
        key = key or f"{BEATS}{self.process}"

        def put() -> None:
            try:
                self.client.key_value_set(key, value, allow_overwrite=True)
            except Exception:  # the coordinator is gone: the others find out themselves
                pass

        if not wait:
            put()
            return
        thread = threading.Thread(target=put, daemon=True)
        thread.start()
        thread.join(wait)

    def _beat(self) -> None:
        while not self._stopped.is_set() and not self._decided.is_set():
            self._count += 1
            try:
                self.client.key_value_set(f"{BEATS}{self.process}", str(self._count),
                                          allow_overwrite=True)
                if self.process == 0:
                    self._judge_beats(self.client.key_value_dir_get(BEATS))
                else:
                    self._read_verdict()
                with self._lock:
                    self._answered = time.monotonic()
            except Exception:  # no answer: the judge counts the silence
                pass
            self._stopped.wait(INTERVAL)

    def _judge_beats(self, entries: list[tuple[str, str]]) -> None:
        """Process 0: the others' beats; a lost one is the verdict."""
        now = time.monotonic()
        for key, value in entries:
            tail = key.rsplit("/", 1)[-1]
            if not tail.isdigit() or int(tail) == self.process:
                continue
            self._see(int(tail), value, now)
        for q in range(self.processes):
            if q != self.process and q not in self._seen:  # never beat yet: since the start
                self._seen[q] = ("", self._started)
        self._check_silence(now, range(self.processes))

    def _read_verdict(self) -> None:
        """Another process: process 0's verdict, and process 0's own beat."""
        try:
            verdict = self.client.key_value_try_get(VERDICT)
        except Exception as exc:
            if not _missing(exc):
                raise
        else:
            self._decide(str(verdict), publish=False)
            return
        now = time.monotonic()
        try:
            value = self.client.key_value_try_get(f"{BEATS}0")
        except Exception as exc:
            if not _missing(exc):
                raise
            value = ""
        self._see(0, str(value), now)
        self._check_silence(now, [0])

    def _see(self, process: int, value: str, now: float) -> None:
        if value.startswith("failed "):
            said = value[len("failed "):].split(": error: ", 1)[-1]  # without its label
            self._decide(self._ended(process, said), publish=True)
            return
        last = self._seen.get(process)
        if last is None or last[0] != value:
            self._seen[process] = (value, now)

    def _check_silence(self, now: float, processes: Any) -> None:
        for q in processes:
            if q == self.process or q not in self._seen:
                continue
            value, since = self._seen[q]
            if value == "done":
                continue
            if now - since > self.timeout:
                what = (f"no heartbeat through the coordinator for {now - since:.0f} s"
                        + ("" if value else ", none since the start"))
                self._decide(f"{self.name(q)} is lost: {what} (--heartbeat-timeout "
                             f"{self.timeout:g}); it was killed, stopped, or its host is "
                             "unreachable", publish=True)
                return

    def _judge(self) -> None:
        """A coordinator that stopped answering: process 0 (or its host) is gone."""
        while not self._stopped.is_set() and not self._decided.is_set():
            time.sleep(INTERVAL / 2)
            with self._lock:
                silent = time.monotonic() - self._answered
            if silent > self.timeout and self.process != 0 and not self._stopped.is_set():
                where = f" at {self.coordinator}" if self.coordinator else ""
                self._decide(f"{self.name(0)} is lost: the coordinator{where} has not answered "
                             f"for {silent:.0f} s (--heartbeat-timeout {self.timeout:g}); "
                             "process 0 was killed, stopped, or its host is unreachable",
                             publish=False)

    def _decide(self, message: str, publish: bool) -> None:
        with self._lock:
            if self.verdict is not None or self._stopped.is_set():
                return
            self.verdict = message
        if publish and self.process == 0:
            try:
                self.client.key_value_set(VERDICT, message, allow_overwrite=True)
            except Exception:
                pass
            self._await_acks(message)
        elif self.process != 0:  # process 0 waits for this before its coordinator goes
            self._put("1", wait=1.0, key=f"{ACKS}{self.process}")
        self.on_lost(message)  # (by default the process ends here)
        self._decided.set()

    def _await_acks(self, message: str) -> None:
        """Process 0 hosts the coordinator: give the others time to read the verdict."""
        lost = {q for q in range(self.processes) if message.startswith(self.name(q) + " ")}
        live = {q for q, (value, _) in self._seen.items() if value != "done"} - lost
        deadline = time.monotonic() + ACK_WAIT
        while time.monotonic() < deadline:
            try:
                acked = {int(k.rsplit("/", 1)[-1]) for k, _ in self.client.key_value_dir_get(ACKS)}
            except Exception:
                return
            if live <= acked:
                return
            time.sleep(0.1)

    def _exit(self, message: str) -> None:
        from pcompile.backends.jax.rank_process import say_safely

        for hook in self.before_exit:
            try:
                hook()
            except Exception:  # leaving must not fail
                pass
        say_safely(f"{self.label}: error: {message}; stopped this process")
        os._exit(EXIT_PEER_LOST)


def peer_watch(process: int, processes: int, ranks_per_process: int, label: str,
               coordinator: str | None, timeout: float) -> PeerWatch | None:
    """A started PeerWatch for a multi-process job started by hand; None under pcompile's
    launcher (it watches the processes itself), with one process, or without a key-value
    client."""
    from pcompile.backends.jax.rank_process import HEARTBEAT_FD

    if processes < 2 or os.environ.get(HEARTBEAT_FD) or timeout <= 0:
        return None
    try:
        from jax._src import distributed
    except ImportError:
        return None
    client = getattr(distributed.global_state, "client", None)
    setter = getattr(client, "key_value_set", None)
    if (setter is None or "allow_overwrite" not in (setter.__doc__ or "")
            or not all(hasattr(client, name)
                       for name in ("key_value_try_get", "key_value_dir_get"))):
        return None  # a JAX whose store cannot carry the watch: nobody is judged
    return PeerWatch(client, process, processes, ranks_per_process, label, coordinator,
                     timeout).start()

