"""The coordinator of a local job listens on the loopback only, and the
executable process 0 shares through the coordinator's key-value store is verified before any
other process deserialises it (backends/cluster.py, backends/jax/shared_compile.py)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pcompile.backends.cluster import bind_kwargs, coordinator_bind_address, is_loopback
from pcompile.backends.jax import shared_compile
from pcompile.backends.jax.rank_process import RankError
from pcompile.backends.jax.shared_compile import SharedExecutableError, SharedStep
from pcompile.backends.launcher import free_port
from tests import ROOT

# -- where the coordinator listens -------------------------------------------------------------


@pytest.mark.parametrize("address, local", [
    ("127.0.0.1:7777", True), ("localhost:7777", True), ("[::1]:7777", True),
    ("127.0.0.2:1", True), ("node0:7777", False), ("10.0.0.1:7777", False),
    ("[fe80::1]:7777", False), ("0.0.0.0:7777", False), ("127.0.0.1.example.com:1", False),
    (None, False),
])
def test_a_loopback_coordinator_binds_there_and_any_other_binds_everywhere(address, local):
    assert is_loopback(address) is local
    assert coordinator_bind_address(address) == (address if local else None)
    assert bind_kwargs(address) == ({"coordinator_bind_address": address} if local else {})


def _address(hex_host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} write it (32-bit words in host order, little-endian
    here); an IPv4-mapped IPv6 address as its IPv4 address."""
    words = b"".join(bytes.fromhex(hex_host[i:i + 8])[::-1] for i in range(0, len(hex_host), 8))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _listening(port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Local addresses listening on TCP `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            host, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(_address(host))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_process_0_of_a_local_job_listens_on_the_loopback_only(tmp_path) -> None:
    """Process 0 started alone (its peer never comes) for a loopback coordinator and for a
    routable one: the first listens on 127.0.0.1 only, the second, for a job over several
    hosts, on every interface as before."""
    from pcompile.tools.compile import compile as compile_model

    out = tmp_path / "out"
    compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=8,
                  parallel_mode="semi_auto_parallel", out_dir=str(out))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PCOMPILE_", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    seen = {}
    for host in ("127.0.0.1", "10.255.255.1"):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, str(out / "program.py"), "--coordinator", f"{host}:{port}",
             "--num-processes", "2", "--process-id", "0", "--startup-timeout", "60"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not _listening(port) and time.monotonic() < deadline:
                assert proc.poll() is None, "process 0 ended before listening"
                time.sleep(0.05)
            seen[host] = _listening(port)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert seen["127.0.0.1"] and all(a.is_loopback for a in seen["127.0.0.1"])
    assert seen["10.255.255.1"] and all(a.is_unspecified for a in seen["10.255.255.1"])


# -- the shared executable ---------------------------------------------------------------------


class Store:
    """A stand-in for the coordinator's key-value store (as `jax.distributed` exposes it)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def key_value_set(self, key: str, value: str) -> None:
        self.data[key] = value

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        return self.data[key]

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        return self.data[key]


class Lowered:
    in_tree = out_tree = None

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def compile(self) -> str:
        self.log.append("compiled")
        return "own executable"


class Jitted:
    def __init__(self) -> None:
        self.log: list[str] = []

    def lower(self, *args: Any) -> Lowered:
        return Lowered(self.log)


@pytest.fixture
def job(monkeypatch):
    """A two-process job in this process: `job.be(p)` makes it process p; deserialising is
    recorded in `job.loaded` (it never unpickles anything here)."""
    import jax
    from jax.experimental import serialize_executable

    store = Store()
    state = SimpleNamespace(client=store, coordinator_address="127.0.0.1:4567")
    me = {"process": 0}
    loaded: list[bytes] = []
    monkeypatch.setattr(shared_compile, "_global_state", lambda: state)
    monkeypatch.setattr(jax, "process_index", lambda: me["process"])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(serialize_executable, "serialize",
                        lambda compiled: (b"executable bytes", None, None))

    def load(payload: bytes, in_tree: Any, out_tree: Any) -> str:
        loaded.append(payload)
        return "loaded executable"

    monkeypatch.setattr(serialize_executable, "deserialize_and_load", load)
    monkeypatch.delenv(shared_compile.SHARE_KEY_ENV, raising=False)

    def be(process: int) -> None:
        me["process"] = process

    return SimpleNamespace(store=store, state=state, loaded=loaded, be=be)


def step_pair(name: str = "plan-1/train") -> tuple[SharedStep, SharedStep]:
    """The same step as made in process 0 and in process 1 (same key)."""
    shared_compile._made = 0
    first = SharedStep(Jitted(), name)
    shared_compile._made = 0
    return first, SharedStep(Jitted(), name)


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_an_intact_executable_is_loaded(job, monkeypatch, secret) -> None:
    if secret:
        monkeypatch.setenv(shared_compile.SHARE_KEY_ENV, secret)
    zero, one = step_pair()
    assert zero._compile(()) == "own executable"
    assert set(job.store.data) == {"pcompile/executable/1/plan-1/train",
                                   "pcompile/executable/1/plan-1/train/digest"}
    job.be(1)
    assert one._compile(()) == "loaded executable" and one.shared
    assert job.loaded == [b"executable bytes"] and one.jitted.log == []


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_a_replaced_executable_is_refused_before_it_is_deserialised(job, monkeypatch,
                                                                    secret) -> None:
    if secret:
        monkeypatch.setenv(shared_compile.SHARE_KEY_ENV, secret)
    zero, one = step_pair()
    zero._compile(())
    key = "pcompile/executable/1/plan-1/train"
    job.store.data[key] = b"a pickle that runs code"  # someone else wrote into the store
    job.be(1)
    with pytest.raises(SharedExecutableError, match="does not match the digest") as caught:
        one._compile(())
    assert isinstance(caught.value, RankError)  # the rank prints it as one message
    assert job.loaded == []


def test_a_forger_without_the_secret_is_refused(job, monkeypatch) -> None:
    """With the launcher's secret, writing a new executable with its plain SHA-256 (or a digest
    under another key) does not pass."""
    monkeypatch.setenv(shared_compile.SHARE_KEY_ENV, "the launcher's secret")
    zero, one = step_pair()
    zero._compile(())
    key = "pcompile/executable/1/plan-1/train"
    evil = b"a pickle that runs code"
    run = shared_compile._run_id()
    for forged in (shared_compile.digest(evil, key, b"", run),
                   shared_compile.digest(evil, key, b"a guess", run)):
        job.store.data[key], job.store.data[f"{key}/digest"] = evil, forged
        job.be(1)
        with pytest.raises(SharedExecutableError):
            one._compile(())
    assert job.loaded == []


def test_processes_with_different_secrets_are_refused(job, monkeypatch) -> None:
    monkeypatch.setenv(shared_compile.SHARE_KEY_ENV, "one")
    zero, one = step_pair()
    zero._compile(())
    monkeypatch.setenv(shared_compile.SHARE_KEY_ENV, "another")
    job.be(1)
    with pytest.raises(SharedExecutableError, match="PCOMPILE_SHARE_KEY"):
        one._compile(())


def test_a_digest_is_bound_to_its_step(job) -> None:
    """Process 0's executable of another step, with that step's digest, is refused."""
    zero, one = step_pair("plan-1/train")
    zero._compile(())
    data = job.store.data
    _, other = step_pair("plan-1/infer")
    job.be(1)
    data["pcompile/executable/1/plan-1/infer"] = data["pcompile/executable/1/plan-1/train"]
    data["pcompile/executable/1/plan-1/infer/digest"] = data[
        "pcompile/executable/1/plan-1/train/digest"]
    with pytest.raises(SharedExecutableError):
        other._compile(())


def test_a_reachable_store_without_a_secret_shares_nothing(job) -> None:
    """No secret and a coordinator other hosts can reach: every process compiles its own and
    reads nothing from the store."""
    job.state.coordinator_address = "10.0.0.1:4567"
    zero, one = step_pair()
    zero._compile(())
    assert job.store.data["pcompile/executable/1/plan-1/train"] == b""
    job.store.data["pcompile/executable/1/plan-1/train"] = b"a pickle that runs code"
    job.be(1)
    assert one._compile(()) == "own executable" and not one.shared
    assert job.loaded == []
