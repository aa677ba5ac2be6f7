"""A peer lost during `jax.distributed` start-up, for rank programs started by hand
(backends/jax/startup_watch.py): a process other than 0 names a coordinator that nothing
answers at within --heartbeat-timeout; process 0 counts the processes that have not connected
(and its --startup-timeout message says so). Before, every process waited out
--startup-timeout (600 s) and ended with a message about a hung collective, or jaxlib's C++
abort."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from pcompile.backends.jax import startup_watch
from pcompile.backends.jax.startup_watch import StartupWatch, connected_clients, split_address
from tests import ROOT
from tests.multiprocess import clean_env, mlp_source


def test_addresses_and_the_coordinators_connections() -> None:
    assert split_address("10.0.0.1:7777") == ("10.0.0.1", 7777)
    assert split_address("[::1]:80") == ("::1", 80) and split_address("host") is None
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    accepted = [server.accept()[0] for _ in clients]
    try:
        assert connected_clients(port) == 2
    finally:
        for s in clients + accepted + [server]:
            s.close()


def _until(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_process_whose_coordinator_never_answers_names_process_0(monkeypatch) -> None:
    monkeypatch.setattr(startup_watch, "INTERVAL", 0.05)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    lost: list[str] = []
    explained: list[str] = []
    watch = StartupWatch(1, 2, f"127.0.0.1:{port}", "pcompile rank 1", "process 0 (rank 0)",
                         0.3, print, on_lost=lost.append, explain=explained.append).start()
    _until(lambda: bool(lost))
    watch.stop()
    assert re.fullmatch(rf"process 0 \(rank 0\) is not there: nothing answers at the coordinator "
                        rf"address 127\.0\.0\.1:{port} \(\d s, --heartbeat-timeout 0\.3\); "
                        r"process 0 was not started, exited during its start-up, or its host "
                        r"is unreachable \(or the address is wrong\)", lost[0]), lost
    assert explained[0].startswith("not every process connected to the coordinator")


def test_process_0_counts_the_processes_not_connected(monkeypatch) -> None:
    monkeypatch.setattr(startup_watch, "INTERVAL", 0.05)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))  # process 0's own client
    accepted = server.accept()[0]
    said: list[str] = []
    explained: list[str] = []
    watch = StartupWatch(0, 3, f"127.0.0.1:{port}", "pcompile rank 0", "process 0 (rank 0)",
                         0.2, said.append, explain=explained.append).start()
    try:
        _until(lambda: bool(said))
    finally:
        watch.stop()
        for s in (client, accepted, server):
            s.close()
    assert said[0].startswith("pcompile rank 0: waiting for 2 of the 3 processes to connect to "
                              f"the coordinator at 127.0.0.1:{port} (")
    assert explained[-1] == (f"2 of the 3 processes did not connect to the coordinator at "
                             f"127.0.0.1:{port}: they were not started, exited during start-up, "
                             "or cannot reach it")


@pytest.fixture(scope="module")
def compiled2(tmp_path_factory):
    from pcompile.tools.compile import compile as compile_model

    folder = tmp_path_factory.mktemp("startup")
    model = folder / "mlp.py"
    model.write_text(mlp_source("((2, 1), (1, 1))"))
    out = folder / "out"
    compile_model(str(model), devices=2, out_dir=str(out))
    return out


def _alone(out, process: int, *flags: str) -> tuple[subprocess.CompletedProcess[str], float]:
    from pcompile.backends.launcher import free_port

    begin = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(out / "program.py"), "--coordinator", f"127.0.0.1:{free_port()}",
         "--num-processes", "2", "--process-id", str(process), "--no-checkpoint", *flags],
        capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=120)
    return done, time.monotonic() - begin


@pytest.mark.slow
def test_a_hand_started_process_without_process_0_stops_at_its_heartbeat_timeout(
        compiled2) -> None:
    done, took = _alone(compiled2, 1, "--heartbeat-timeout", "3")
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert done.returncode == 4 and len(errors) == 1, done.stderr
    assert errors[0].startswith("pcompile rank 1: error: process 0 (rank 0) is not there: "
                                "nothing answers at the coordinator address 127.0.0.1:")
    assert took < 60 and "Check failure" not in done.stderr, done.stderr


@pytest.mark.slow
def test_process_0_alone_says_who_is_missing_and_stops_at_its_startup_timeout(
        compiled2) -> None:
    done, took = _alone(compiled2, 0, "--heartbeat-timeout", "2", "--startup-timeout", "12")
    assert done.returncode == 124, done.stderr
    assert re.search(r"pcompile rank 0: waiting for 1 of the 2 processes to connect to the "
                     r"coordinator at 127\.0\.0\.1:\d+ \(\d+ s so far", done.stderr), done.stderr
    assert re.search(r"pcompile rank 0: distributed start-up did not finish in time; 1 of the 2 "
                     r"processes did not connect to the coordinator at 127\.0\.0\.1:\d+: they "
                     r"were not started, exited during start-up, or cannot reach it\. Exiting\.",
                     done.stderr), done.stderr
    assert "Check failure" not in done.stderr and took < 60, done.stderr
