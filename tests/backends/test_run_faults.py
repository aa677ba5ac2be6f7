"""Faults during a run, each one message and an exit (issue 38 items 22-24): a full disk under
train.log, metrics.jsonl or the process's output (run.log); a rank process that exits with
status 0 before the run is over; rank programs started by hand that lose a peer (their own
liveness through the coordinator's key-value store, backends/jax/peer_watch.py).

The full disk is real: `/dev/full` (every write fails with ENOSPC) for the fast tests, and a
small tmpfs that the slow test mounts and fills (skipped where mounting is refused)."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests import ROOT
from tests.multiprocess import clean_env, mlp_source

# -- a full disk: one message naming the file ---------------------------------------------------


def test_a_full_disk_under_train_log_or_metrics_is_one_message_naming_the_file() -> None:
    from pcompile.backends.jax.rank_process import RankError
    from pcompile.backends.jax.rank_report import TrainLog, _append

    log = TrainLog.__new__(TrainLog)  # an open train.log on a disk that is now full
    log.path, log.lines = "/dev/full", []
    with pytest.raises(RankError) as info:
        log.add("epoch: 1 step: 1, loss is 0.5")
    assert str(info.value).startswith("cannot write /dev/full: no space left on the device "
                                      "(the disk is full); stopped the run"), info.value
    with pytest.raises(RankError, match="cannot write /dev/full: no space left"):
        _append("/dev/full", ['{"step": 1}'])  # metrics.jsonl's writer


def test_a_full_disk_under_the_output_is_one_message() -> None:
    """The output (run.log under the launcher) on a full disk: _say's print fails."""
    code = textwrap.dedent("""
        from types import SimpleNamespace
        from pcompile.backends.jax.rank_loop import RankRunner
        from pcompile.backends.jax.rank_process import RankError
        runner = RankRunner.__new__(RankRunner)
        runner.args = SimpleNamespace(quiet=False, all_ranks=False)
        runner.local = [0]
        try:
            runner._say("epoch: 1 step: 1, loss is 0.5")
        except RankError as exc:
            raise SystemExit(f"RankError: {exc}")
        raise SystemExit("no error")
    """)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-c", code], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=clean_env(), timeout=60)
    assert proc.stderr.strip() == ("RankError: cannot write its output (stdout): no space left "
                                   "on the device (the disk is full); stopped the run (the "
                                   "checkpoints written so far are intact: free some space, "
                                   "then --resume)"), proc.stderr


def _mount_tmpfs(path, size: str) -> None:
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills) needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _fill(folder) -> None:
    """Fill the file system of `folder` to the last byte."""
    with open(folder / "filler", "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1 << 8, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    os.sync()


MODEL4 = mlp_source("((2, 2), (2, 1))", relu_matmul=True)


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "mlp4.py"
    path.write_text(textwrap.dedent(MODEL4))
    return str(path)


def _launch(model: str, out, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pcompile", model, "--devices", "4", "--parallel-mode",
         "semi_auto_parallel", "--out", str(out), "--no-check", "--run", "--processes", "2",
         *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
        cwd=ROOT)


def _wait_for_lines(log, proc: subprocess.Popen[str], n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and log.read_text().count("\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early:\n{proc.stdout.read()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} lines in {log}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(out) -> list[int]:
    return [p["pid"] for p in json.loads((out / "launch.json").read_text())["processes"]]


@pytest.mark.slow
def test_a_disk_that_fills_during_a_run_is_one_message_at_once(model4, tmp_path) -> None:
    """A real full disk (a 4 MB tmpfs filled to the last byte mid-run) under train.log,
    metrics.jsonl and run.log: the rank that meets it says so in one line naming the file and
    exits; the launcher names it at once, not after --timeout (300 s)."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "4m")
    proc = None
    try:
        out = disk / "out"
        proc = _launch(model4, out, "--steps", "1000000")
        _wait_for_lines(out / "rank_0" / "train.log", proc, 3)
        _fill(disk)
        filled = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - filled
        assert proc.returncode == 1, output
        assert elapsed < 20, (elapsed, output)
        failure = [line for line in output.splitlines() if "failed first" in line]
        assert len(failure) == 1, output
        assert "no space left on the device (the disk is full)" in failure[0], output
        assert any(f"cannot write {out}/rank_{r}/{name}" in failure[0] or
                   f"cannot write its output {out}/rank_{r}/run.log" in failure[0]
                   for r in (0, 2) for name in ("train.log", "metrics.jsonl")) \
            or f"cannot write {out}/metrics.jsonl" in failure[0], output
        assert "Traceback" not in output, output
        assert not any(_alive(p) for p in _pids(out))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# -- a rank process that exits with status 0 before the run is over ----------------------------


def _proc(tmp_path, process: int, code: int | None, phase: str, exited_ago: float = 0.0):
    from pcompile.backends.launcher import _Proc

    path = tmp_path / f"run_{process}.log"
    path.write_text("")
    proc = _Proc(process, [process], None, str(path), -1, time.monotonic(), time.monotonic(),
                 last_beat=time.monotonic(), code=code, phase=phase)
    proc.exited_at = None if code is None else time.time() - exited_ago
    return proc


def test_a_process_that_exits_0_before_its_run_is_over_is_a_failure(tmp_path) -> None:
    from pcompile.backends.launcher import _first_failure

    # exited 0 while computing a step: named at once
    ranks = [_proc(tmp_path, 0, None, "compute"), _proc(tmp_path, 1, 0, "compute")]
    assert _first_failure(ranks) is ranks[1]
    # exited 0 after saying it had finished: the end of its run, not a failure
    ranks = [_proc(tmp_path, 0, None, "compute"), _proc(tmp_path, 1, 0, "finish")]
    assert _first_failure(ranks) is None
    # exited 0 before its first heartbeat while the others connect (jax.distributed's start-up
    # would wait --startup-timeout for it): named at once; programs that never beat: no judgement
    ranks = [_proc(tmp_path, 0, None, "connect"), _proc(tmp_path, 1, 0, "start")]
    ranks[1].last_beat = None
    assert _first_failure(ranks) is ranks[1]
    ranks[0].last_beat = None
    assert _first_failure(ranks) is None


EXITS_EARLY = mlp_source("((2, 2), (2, 1))", relu_matmul=True, data='''
def dataset():
    import itertools
    import os

    import jax

    rng = np.random.default_rng(7)
    for i in itertools.count():
        if i == 4 and jax.process_count() > 1 and jax.process_index() == 1:
            os._exit(0)  # a library that ends the process, with status 0
        yield (rng.standard_normal((8, 16)).astype(np.float32),
               rng.standard_normal((8, 8)).astype(np.float32))
''')


@pytest.mark.slow
def test_a_rank_process_that_exits_0_early_is_named_at_once(tmp_path) -> None:
    model = tmp_path / "exits_early.py"
    model.write_text(textwrap.dedent(EXITS_EARLY))
    out = tmp_path / "out"
    proc = _launch(str(model), out, "--steps", "50")
    begin = time.monotonic()
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, output
    said = [line for line in output.splitlines() if "before the run was over" in line]
    assert len(said) == 1, output
    assert said[0].startswith("pcompile launcher: ranks 2-3 (process 1) exited with status 0 "
                              "before the run was over (last seen reading its next batch"), said
    assert "Check failure" not in output and "*** " not in output, output
    assert time.monotonic() - begin < 90, output  # not jax.distributed's 100 s
    assert not any(_alive(p) for p in _pids(out))


# -- rank programs started by hand: a lost peer ---------------------------------------------------


class _Store:
    """An in-memory stand-in for jax.distributed's key-value client."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.down = False
        self.lock = threading.Lock()

    def _check(self) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: the coordination service is gone")

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._check()
        with self.lock:
            self.data[key] = value

    def key_value_try_get(self, key: str) -> str:
        self._check()
        with self.lock:
            if key not in self.data:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.data[key]

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        self._check()
        with self.lock:
            return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


def _watches(monkeypatch, store: _Store, processes: int, timeout: float = 1.5):
    from pcompile.backends.jax import peer_watch

    monkeypatch.setattr(peer_watch, "INTERVAL", 0.05)
    monkeypatch.setattr(peer_watch, "ACK_WAIT", 0.5)
    said: dict[int, str] = {}
    watches = [peer_watch.PeerWatch(store, p, processes, 2, f"pcompile ranks {2 * p}-{2 * p + 1}",
                                    "10.0.0.1:7777", timeout,
                                    on_lost=lambda message, p=p: said.setdefault(p, message))
               for p in range(processes)]
    return watches, said


def _until(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_silent_process_is_named_by_every_other(monkeypatch) -> None:
    store = _Store()
    watches, said = _watches(monkeypatch, store, 3)
    for w in watches:
        w.start()
    time.sleep(0.3)
    watches[2]._stopped.set()  # process 2 stops beating (killed), without a word
    _until(lambda: len(said) == 2)
    assert sorted(said) == [0, 1] and said[0] == said[1], said
    assert re.fullmatch(r"process 2 \(ranks 4-5\) is lost: no heartbeat through the coordinator "
                        r"for \d+ s \(--heartbeat-timeout 1.5\); it was killed, stopped, or its "
                        r"host is unreachable", said[0]), said


def test_a_failed_process_is_named_with_its_message_at_once(monkeypatch) -> None:
    store = _Store()
    watches, said = _watches(monkeypatch, store, 3, timeout=60)
    for w in watches:
        w.start()
    time.sleep(0.2)
    watches[1].failed("pcompile ranks 2-3: error: the loss is nan at step 4")
    _until(lambda: len(said) == 2)
    want = "process 1 (ranks 2-3) failed: the loss is nan at step 4"
    assert said == {0: want, 2: want}


def test_process_0_that_fails_tells_the_others_before_its_coordinator_goes(monkeypatch) -> None:
    store = _Store()
    watches, said = _watches(monkeypatch, store, 3, timeout=60)
    for w in watches:
        w.start()
    from pcompile.backends.jax import peer_watch

    monkeypatch.setattr(peer_watch, "ACK_WAIT", 10.0)
    time.sleep(0.2)
    begin = time.monotonic()
    watches[0].failed("pcompile ranks 0-1: stopped by SIGTERM")
    assert time.monotonic() - begin < 5  # it waited for both to read it, not all of ACK_WAIT
    assert {k.rsplit("/", 1)[1] for k, _ in store.key_value_dir_get("pcompile/ack/")} == {"1", "2"}
    _until(lambda: len(said) == 2)
    want = "process 0 (ranks 0-1) was stopped by SIGTERM"
    assert said == {1: want, 2: want}


def test_processes_that_finished_are_not_lost(monkeypatch) -> None:
    store = _Store()
    watches, said = _watches(monkeypatch, store, 2, timeout=1.0)
    for w in watches:
        w.start()
    time.sleep(0.2)
    watches[1].finished()
    time.sleep(1.4)  # past the timeout
    watches[0].finished()
    assert said == {}


def test_a_coordinator_that_stops_answering_is_process_0_lost(monkeypatch) -> None:
    store = _Store()
    watches, said = _watches(monkeypatch, store, 2)
    for w in watches:
        w.start()
    time.sleep(0.2)
    store.down = True  # process 0, which hosts the coordinator, is gone
    watches[0]._stopped.set()
    _until(lambda: 1 in said)
    assert re.fullmatch(r"process 0 \(ranks 0-1\) is lost: the coordinator at 10.0.0.1:7777 has "
                        r"not answered for \d+ s \(--heartbeat-timeout 1.5\); process 0 was "
                        r"killed, stopped, or its host is unreachable", said[1]), said


def _start_by_hand(out, processes: int, *flags: str, **env: str) -> list[subprocess.Popen[str]]:
    from pcompile.backends.launcher import free_port

    port = free_port()
    return [subprocess.Popen(
        [sys.executable, str(out / "program.py"), "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", str(processes), "--process-id", str(p), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=clean_env(**env)) for p in range(processes)]


def _outputs(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        finally:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="module")
def compiled4(model4, tmp_path_factory):
    from pcompile.tools.compile import compile as compile_model

    out = tmp_path_factory.mktemp("hand") / "out"
    compile_model(model4, devices=4, out_dir=str(out))
    return out


@pytest.mark.slow
def test_a_killed_process_started_by_hand_is_named_by_the_others(compiled4) -> None:
    """Four processes started by hand (plain flags, as under mpirun): process 2 is killed
    mid-run; the three others each print one line naming it and exit within the deadline,
    instead of waiting in their collective for jax.distributed's 100 s and its C++ abort."""
    out = compiled4
    procs = _start_by_hand(out, 4, "--steps", "1000000", "--heartbeat-timeout", "8",
                           "--no-checkpoint")
    _wait_for_lines(out / "rank_0" / "train.log", procs[0], 3)
    procs[2].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    outputs = _outputs([procs[p] for p in (0, 1, 3)], timeout=60)
    assert time.monotonic() - killed < 8 + 10, outputs
    for p, output in zip((0, 1, 3), outputs):
        assert procs[p].returncode == 4, output
        errors = [line for line in output.splitlines() if ": error: " in line]
        assert errors == [f"pcompile rank {p}: error: process 2 (rank 2) is lost: no heartbeat "
                          f"through the coordinator for {errors[0].split(' for ')[1].split()[0]}"
                          " s (--heartbeat-timeout 8); it was killed, stopped, or its host is "
                          "unreachable; stopped this process"], output
        assert "Traceback" not in output and "Check failure" not in output, output


@pytest.mark.slow
def test_a_process_started_by_hand_that_fails_is_named_by_the_others_at_once(compiled4) -> None:
    out = compiled4
    procs = _start_by_hand(out, 4, "--steps", "1000000", "--heartbeat-timeout", "60",
                           "--no-checkpoint", PCOMPILE_FAULT_INJECT="1:6")
    outputs = _outputs(procs, timeout=120)
    assert "PCOMPILE_FAULT_INJECT: failing at step 6" in outputs[1], outputs[1]
    for p in (0, 2, 3):
        errors = [line for line in outputs[p].splitlines() if ": error: " in line]
        assert errors == [f"pcompile rank {p}: error: process 1 (rank 1) failed: "
                          "RuntimeError: PCOMPILE_FAULT_INJECT: failing at step 6; stopped "
                          "this process"], outputs[p]
        assert "Traceback" not in outputs[p], outputs[p]


@pytest.mark.slow
def test_process_0_stopped_by_hand_is_named_by_the_others(compiled4) -> None:
    """Process 0 hosts the coordinator: stopped (SIGTERM, Ctrl-C), it tells the others before
    the coordinator goes, instead of JAX aborting them with a C++ stack trace."""
    out = compiled4
    (out / "rank_0" / "train.log").unlink(missing_ok=True)
    procs = _start_by_hand(out, 4, "--steps", "1000000", "--no-checkpoint")
    _wait_for_lines(out / "rank_0" / "train.log", procs[0], 3)
    procs[0].send_signal(signal.SIGTERM)
    outputs = _outputs(procs, timeout=60)
    assert "pcompile rank 0: stopped by SIGTERM" in outputs[0], outputs[0]
    for p in (1, 2, 3):
        assert procs[p].returncode == 4, outputs[p]
        errors = [line for line in outputs[p].splitlines() if ": error: " in line]
        assert errors == [f"pcompile rank {p}: error: process 0 (rank 0) was stopped by SIGTERM; "
                          "stopped this process"], outputs[p]
        assert "Check failure" not in outputs[p] and "Traceback" not in outputs[p], outputs[p]


@pytest.mark.slow
def test_process_0_killed_by_hand_is_one_line_in_the_others_not_jaxlibs_abort(compiled4) -> None:
    """Process 0 SIGKILLed mid-run: its coordinator's connection closes and jaxlib aborts every
    other process within milliseconds (C++, before any Python watch can act); the helper of
    backends/jax/abort_guard.py names process 0 in one line first, and the process leaves with
    status 4 before jaxlib's abort (which printed 'Check failure' and a stack trace before)."""
    out = compiled4
    (out / "rank_0" / "train.log").unlink(missing_ok=True)
    procs = _start_by_hand(out, 4, "--steps", "1000000", "--no-checkpoint")
    _wait_for_lines(out / "rank_0" / "train.log", procs[0], 3)
    procs[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    outputs = _outputs(procs[1:], timeout=60)
    assert time.monotonic() - killed < 10, outputs
    for p, output in zip((1, 2, 3), outputs):
        errors = [line for line in output.splitlines() if ": error: " in line]
        assert len(errors) == 1 and re.fullmatch(
            rf"pcompile rank {p}: error: process 0 \(rank 0\) is lost: the coordinator at "
            r"127\.0\.0\.1:\d+ closed its connection or stopped answering \(process 0 was "
            r"killed, or its host is down or unreachable\); stopped this process",
            errors[0]), output
        assert "Check failure" not in output and "Terminating process" not in output, output
        assert "Traceback" not in output and "bad_cast" not in output, output
        assert procs[p].returncode == 4, output


# -- two hosts: two network namespaces joined by a veth pair ------------------------------------


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def two_hosts(model4, tmp_path_factory):
    """Two "hosts": network namespaces A (10.213.N.1) and B (10.213.N.2) joined by a veth pair,
    made here and removed after the tests; the rank program compiled for 4 ranks. Each host's
    name still resolves to the loopback (/etc/hosts is shared), as on many machines."""
    import shutil

    from pcompile.tools.compile import compile as compile_model

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces (ip netns) need root and iproute2")
    tag = os.getpid() % 100000
    hosts = (f"pc{tag}a", f"pc{tag}b")
    made = _ip("netns", "add", hosts[0])
    if made.returncode:
        pytest.skip(f"the kernel refuses network namespaces here: {made.stderr.strip()}")
    net = f"10.213.{tag % 250}"
    try:
        steps = [("netns", "add", hosts[1]),
                 ("link", "add", f"pcv{tag}a", "type", "veth", "peer", "name", f"pcv{tag}b"),
                 ("link", "set", f"pcv{tag}a", "netns", hosts[0]),
                 ("link", "set", f"pcv{tag}b", "netns", hosts[1])]
        for host, end, address in ((hosts[0], "a", f"{net}.1"), (hosts[1], "b", f"{net}.2")):
            steps += [("-n", host, "addr", "add", f"{address}/24", "dev", f"pcv{tag}{end}"),
                      ("-n", host, "link", "set", f"pcv{tag}{end}", "up"),
                      ("-n", host, "link", "set", "lo", "up")]
        for step in steps:
            done = _ip(*step)
            if done.returncode:
                pytest.skip(f"ip {' '.join(step)}: {done.stderr.strip()}")
        out = tmp_path_factory.mktemp("hosts") / "out"
        compile_model(model4, devices=4, out_dir=str(out))
        yield hosts, f"{net}.1", out
    finally:
        for host in hosts:
            _ip("netns", "del", host)  # its end of the veth pair goes with it


def _on_host(host: str | None, out, coordinator: str, process: int, *flags: str,
             **env: str) -> subprocess.Popen[str]:
    """Process `process` of 2 on `host` (a namespace; None: this one)."""
    where = ["ip", "netns", "exec", host] if host else []
    return subprocess.Popen(
        [*where, sys.executable, str(out / "program.py"), "--coordinator", coordinator,
         "--num-processes", "2", "--process-id", str(process), "--no-checkpoint", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=clean_env(**env))


def _listening(host: str, port: int) -> list[str]:
    """The addresses a socket of namespace `host` listens on at `port` (/proc/net/tcp*)."""
    import ipaddress

    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        done = subprocess.run(["ip", "netns", "exec", host, "cat", table], capture_output=True,
                              text=True)
        for line in done.stdout.splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1]
                           for i in range(0, len(address), 8))
            ip = ipaddress.ip_address(raw)
            found.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def _run_pair(hosts, out, coordinator: str, *flags: str, **env: str) -> list[str]:
    procs = [_on_host(hosts[p] if hosts else None, out, coordinator, p, *flags, **env)
             for p in (0, 1)]
    outputs = _outputs(procs, timeout=120)
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output
    return outputs


def _logs(out) -> list[str]:
    return [(out / f"rank_{r}" / "train.log").read_text() for r in range(4)]


@pytest.mark.slow
def test_two_hosts_train_like_the_loopback_and_share_the_executable_only_with_the_key(
        two_hosts) -> None:
    from pcompile.backends.launcher import free_port

    hosts, address, out = two_hosts
    _run_pair(None, out, f"127.0.0.1:{free_port()}", "--steps", "3")
    loopback = _logs(out)
    # the coordinator on host A at its own address; process 1 on host B reaches it there
    coordinator = f"{address}:7777"
    first = _on_host(hosts[0], out, coordinator, 0, "--steps", "3", PCOMPILE_SHARE_KEY="k" * 32)
    deadline = time.monotonic() + 60
    while not (listening := _listening(hosts[0], 7777)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert listening and all(a in (address, "0.0.0.0", "::") for a in listening), listening
    assert not _listening(hosts[1], 7777)
    second = _on_host(hosts[1], out, coordinator, 1, "--steps", "3", PCOMPILE_SHARE_KEY="k" * 32)
    outputs = _outputs([first, second], timeout=120)
    assert first.returncode == 0 and second.returncode == 0, outputs
    assert _logs(out) == loopback  # bit for bit: the same program, the same data
    assert "(the executable compiled by process 0)" in outputs[1], outputs[1]
    # without the key, a coordinator other hosts reach shares nothing: each compiles its own
    outputs = _run_pair(hosts, out, f"{address}:7778", "--steps", "3")
    assert _logs(out) == loopback
    assert "rank(s) 2..3: steps 1..3" in outputs[1], outputs[1]
    assert "(the executable compiled by process 0)" not in outputs[1], outputs[1]


@pytest.mark.slow
def test_a_killed_process_on_one_host_is_named_on_the_other(two_hosts) -> None:
    hosts, address, out = two_hosts
    (out / "rank_0" / "train.log").unlink(missing_ok=True)
    procs = [_on_host(hosts[p], out, f"{address}:7779", p, "--steps", "1000000",
                      "--heartbeat-timeout", "8") for p in (0, 1)]
    _wait_for_lines(out / "rank_0" / "train.log", procs[0], 3)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    output = _outputs([procs[0]], timeout=60)[0]
    assert time.monotonic() - killed < 8 + 10, output
    assert procs[0].returncode == 4, output
    errors = [line for line in output.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(
        "pcompile ranks 0-1: error: process 1 (ranks 2-3) is lost: no heartbeat through the "
        "coordinator for"), output
    assert "Traceback" not in output and "Check failure" not in output, output


def test_gloo_uses_the_address_that_reaches_a_routable_coordinator() -> None:
    from pcompile.backends.cluster import collectives_address

    # one machine (loopback), no coordinator, or a name that does not resolve: gloo's default
    for coordinator in ("127.0.0.1:7777", "localhost:7777", "[::1]:7777", None,
                        "no-such-host.invalid:7777", "10.0.0.1"):
        assert collectives_address(coordinator) is None, coordinator


def test_only_a_collective_that_lost_its_peer_waits_for_the_watch() -> None:
    """A failed collective waits (up to --heartbeat-timeout) for the watch to name the lost
    process; the program's own runtime errors are reported at once."""
    from pcompile.backends.jax.rank_runtime import _collective_failure

    class JaxRuntimeError(Exception):
        pass

    assert _collective_failure(JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer"))
    assert not _collective_failure(JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert not _collective_failure(ValueError("connection refused by the model's own code"))
