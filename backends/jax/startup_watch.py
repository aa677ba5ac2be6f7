"""A peer lost during `jax.distributed` start-up, for rank programs started by hand.

`jax.distributed.initialize` returns only once every process has registered with the
coordinator (process 0's coordination service); until then no process can reach the key-value
store the peer watch uses (backends/jax/peer_watch.py), and a process that was never started
or exited during start-up leaves the others waiting for `--startup-timeout` (600 s). While a
process connects, `StartupWatch` looks at what it can see from outside JAX:

* a process other than 0 tries a TCP connection to the coordinator's address every second;
  when nothing has answered there for `--heartbeat-timeout` seconds since it began to connect
  (process 0 was not started, exited during its start-up, or its host is unreachable), it
  names process 0 in one line and exits (`EXIT_PEER_LOST`);
* process 0 counts the connections its coordinator holds (`/proc/net/tcp`, one per process
  that has connected, its own included); after `--heartbeat-timeout` seconds, and whenever the
  count changes after that, it says how many processes have not connected yet, and the
  watchdog's `--startup-timeout` message says the same. Which ones is not visible: the
  coordination service names no process before all have registered.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

EXIT_PEER_LOST = 4  # as backends/jax/peer_watch.py
INTERVAL = 1.0  # seconds between two looks


def split_address(address: str) -> tuple[str, int] | None:
    """HOST:PORT (`[v6]:PORT` too) as (host, port); None when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def connected_clients(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")
                      ) -> int | None:
    """The established TCP connections whose local port is `port` (this network namespace's
    tables); None where the tables cannot be read."""
    count, read = 0, False
    for table in tables:
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "01":  # ESTABLISHED
                local_port = fields[1].rpartition(":")[2]
                try:
                    if int(local_port, 16) == port:
                        count += 1
                except ValueError:
                    continue
    return count if read else None


class StartupWatch:
    """Watches this process's `jax.distributed` start-up (module docstring) from a thread,
    until `stop()`. `name0`: process 0's name in messages (`process 0 (rank 0)`); `say`: prints
    a progress line; `on_lost`: called with the message when process 0 is not there (default:
    print it and exit)."""

    def __init__(self, process: int, processes: int, coordinator: str, label: str, name0: str,
                 grace: float, say: Callable[[str], None],
                 on_lost: Callable[[str], None] | None = None,
                 explain: Callable[[str], None] | None = None) -> None:
        self.process = process
        self.processes = processes
        self.coordinator = coordinator
        self.address = split_address(coordinator)
        self.label = label
        self.name0 = name0
        self.grace = grace
        self.say = say
        self.on_lost = on_lost or self._exit
        self.explain = explain  # the watchdog's cause, kept up to date (`waiting_for`)
        self.missing: int | None = None  # process 0: the processes not connected, once known
        self._stopped = threading.Event()

    def start(self) -> StartupWatch:
        if self.explain is not None:
            self.explain(self.waiting_for())
        if self.address is not None and self.grace > 0:
            threading.Thread(target=self._watch, daemon=True, name="pcompile-startup").start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def waiting_for(self) -> str:
        """What the watchdog says when start-up runs out of time."""
        where = f"the coordinator at {self.coordinator}"
        if self.process == 0 and self.missing:
            return (f"{self.missing} of the {self.processes} processes did not connect to "
                    f"{where}: they were not started, exited during start-up, or cannot reach "
                    "it")
        return (f"not every process connected to {where}: a process was not started, exited "
                "during start-up, or cannot reach it")

    def _watch(self) -> None:
        assert self.address is not None
        host, port = self.address
        began = time.monotonic()
        answered = began if self.process == 0 else None
        said: int | None = None
        while not self._stopped.wait(INTERVAL):
            now = time.monotonic()
            if self.process != 0:
                if answers(host, port):
                    answered = now
                    continue
                silent = now - (answered if answered is not None else began)
                if silent > self.grace and not self._stopped.is_set():
                    ever = "" if answered is None else " any more"
                    self.on_lost(
                        f"{self.name0} is not there: nothing answers at the coordinator address "
                        f"{self.coordinator}{ever} ({silent:.0f} s, --heartbeat-timeout "
                        f"{self.grace:g}); process 0 was not started, exited during its start-up, "
                        "or its host is unreachable (or the address is wrong)")
                    return
                continue
            count = connected_clients(port)
            if count is None:
                return
            missing = max(0, self.processes - count)
            if missing != self.missing:
                self.missing = missing
                if self.explain is not None:
                    self.explain(self.waiting_for())
            if now - began > self.grace and self.missing and self.missing != said:
                said = self.missing
                self.say(f"{self.label}: waiting for {self.missing} of the {self.processes} "
                         f"processes to connect to the coordinator at {self.coordinator} "
                         f"({now - began:.0f} s so far; --startup-timeout ends the wait): were "
                         "they started, and do they reach this address?")

    def _exit(self, message: str) -> None:
        from pcompile.backends.jax.rank_process import say_safely

        say_safely(f"{self.label}: error: {message}; stopped this process")
        os._exit(EXIT_PEER_LOST)
