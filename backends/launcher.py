"""Launch the rank programs of a compiled plan as processes on this machine.

`launch(out_dir, steps=N)` starts one process per rank (`<out>/rank_<r>/program.py`, under
`jax.distributed` with gloo collectives on CPU), with the coordinator on a free local port, and
watches them:

* progress: rank 0's `train.log` lines are echoed as they appear;
* a rank that fails (exception, killed, watchdog timeout) stops the others (SIGTERM to each
  rank's process group, SIGKILL after `stop_grace` seconds) and the launch returns non-zero
  with a message naming the rank, its exit status and the tail of its log
  (`<out>/rank_<r>/run.log`, stdout and stderr);
* a coordinator port taken between choosing and binding it is retried on another port;
* Ctrl-C stops every rank and returns 130;
* at the end every rank's train.log must report the same losses.

`pcompile MODEL.py --devices N ... --run --steps S` calls this after compiling.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

TAIL_LINES = 25
EXIT_COORDINATOR_PORT = 75  # backends/jax/rank_runtime.py: process 0 could not listen
_PORT_ERRORS = ("address already in use", "failed to start rpc server", "failed to add port",
                "errno 98")


class LaunchError(Exception):
    """A problem found before any rank started (missing files, bad arguments)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tail(path: str, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)\n"


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 124:
        return "exit status 124 (watchdog: a step or collective timed out)"
    return f"exit status {code}"


@dataclass
class _Rank:
    process: int  # process index
    rank: int  # first rank it runs
    popen: subprocess.Popen[bytes]
    log: str
    code: int | None = None


@dataclass
class LaunchResult:
    code: int
    failed_rank: int | None = None
    message: str = ""
    losses: list[str] = field(default_factory=list)


def _num_ranks(out_dir: str) -> int:
    import json

    plan = os.path.join(out_dir, "plan.json")
    if not os.path.exists(plan):
        raise LaunchError(f"{out_dir} holds no plan.json; compile first (pcompile MODEL.py "
                          f"--out {out_dir} ...)")
    with open(plan, encoding="utf-8") as f:
        return int(json.load(f)["devices"])


def launch(
    out_dir: str,
    *,
    steps: int,
    processes: int | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    timeout: float = 300.0,
    startup_timeout: float = 900.0,
    echo: Callable[[str], None] = print,
    python: str | None = None,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    stop_grace: float = 3.0,
    port_attempts: int = 3,
    extra_args: list[str] | None = None,
) -> LaunchResult:
    """Run `steps` training steps of the plan in `out_dir` with one process per rank (or
    `processes` processes, each running N/processes ranks on virtual CPU devices)."""
    out_dir = os.path.abspath(out_dir)
    n = _num_ranks(out_dir)
    procs = processes or n
    if n % procs:
        raise LaunchError(f"{n} ranks cannot be spread evenly over {procs} processes")
    per = n // procs
    programs = [os.path.join(out_dir, f"rank_{p * per}", "program.py") for p in range(procs)]
    missing = [p for p in programs if not os.path.exists(p)]
    if missing:
        raise LaunchError(f"missing rank program(s): {', '.join(missing)}; compile again")
    ckpt = os.path.join(out_dir, "checkpoints")
    if not resume and os.path.isdir(ckpt):
        import shutil

        shutil.rmtree(ckpt)  # a fresh run: older checkpoints would confuse a later --resume
    base_env = dict(os.environ if env is None else env)
    base_env.setdefault("JAX_PLATFORMS", "cpu")
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env["PCOMPILE_LAUNCHER_PID"] = str(os.getpid())  # ranks exit when the launcher dies
    common = ["--steps", str(steps), "--timeout", str(timeout),
              "--startup-timeout", str(startup_timeout), *(extra_args or [])]
    if checkpoint_every:
        common += ["--checkpoint-every", str(checkpoint_every)]
    if resume:
        common.append("--resume")
    result = LaunchResult(1)
    restore = _sigterm_as_interrupt()
    try:
        result = _attempts(programs, per, common, base_env, python or sys.executable, echo,
                           stop_grace, out_dir, host, port_attempts)
    finally:
        restore()
    if result.code == 0:
        result = _check_logs(out_dir, n, result, echo)
    return result


def _sigterm_as_interrupt() -> Callable[[], None]:
    """While launching, SIGTERM stops the ranks like Ctrl-C does (main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)

    def restore() -> None:
        signal.signal(signal.SIGTERM, old)

    return restore


def _attempts(programs: list[str], per: int, common: list[str], base_env: dict[str, str],
              python: str, echo: Callable[[str], None], stop_grace: float, out_dir: str,
              host: str, port_attempts: int) -> LaunchResult:
    result = LaunchResult(1)
    for attempt in range(port_attempts):
        port = free_port(host)
        result = _run_once(programs, per, f"{host}:{port}", common, base_env, python, echo,
                           stop_grace, out_dir)
        if result.code != -1:
            break
        echo(f"pcompile launcher: coordinator port {port} was taken; retrying on another port "
             f"({attempt + 2}/{port_attempts})")
    if result.code == -1:
        result.code = 1
        result.message = f"no free coordinator port after {port_attempts} attempts"
        echo(f"pcompile launcher: {result.message}")
    return result


def _run_once(programs: list[str], per: int, coordinator: str, common: list[str],
              env: dict[str, str], python: str, echo: Callable[[str], None],
              stop_grace: float, out_dir: str) -> LaunchResult:
    """One attempt; code -1 means 'the coordinator port was taken, try another'."""
    ranks: list[_Rank] = []
    procs = len(programs)
    progress = os.path.join(out_dir, "rank_0", "train.log")
    try:
        os.unlink(progress)  # the rank rewrites it; do not echo an old one
    except OSError:
        pass
    try:
        for p, program in enumerate(programs):
            log = os.path.join(os.path.dirname(program), "run.log")
            args = [python, program, "--coordinator", coordinator, "--num-processes",
                    str(procs), "--process-id", str(p), *common]
            if p:
                args.append("--quiet")
            with open(log, "wb") as f:
                popen = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=out_dir)
            ranks.append(_Rank(p, p * per, popen, log))
        _write_launch_info(out_dir, coordinator, ranks, per)
        seen = [0, 0]
        while True:
            echoed = _echo_progress(progress, seen, echo)
            for r in ranks:
                if r.code is None:
                    r.code = r.popen.poll()
            # The first failure seen; a rank killed by a signal before one that exited with an
            # error (the others usually fail because of it).
            bad = [r for r in ranks if r.code not in (None, 0)]
            failed = min(bad, key=lambda r: (r.code >= 0, r.rank)) if bad else None  # type: ignore[operator]
            if failed is not None:
                _stop(ranks, stop_grace)
                text = tail(failed.log)
                if echoed == 0 and (failed.code == EXIT_COORDINATOR_PORT or any(
                        e in text.lower() for e in _PORT_ERRORS)):
                    return LaunchResult(-1)
                message = (f"rank {failed.rank} failed ({_describe(failed.code or 0)}); "
                           f"stopped the other ranks. Last lines of {failed.log}:\n{text}")
                echo(f"pcompile launcher: {message}")
                return LaunchResult(1, failed.rank, message)
            if all(r.code == 0 for r in ranks):
                _echo_progress(progress, seen, echo)
                return LaunchResult(0)
            time.sleep(0.1)
    except KeyboardInterrupt:
        _stop(ranks, stop_grace)
        echo("pcompile launcher: interrupted; stopped every rank")
        return LaunchResult(130, None, "interrupted")
    except BaseException:
        _stop(ranks, stop_grace)
        raise


def _write_launch_info(out_dir: str, coordinator: str, ranks: list[_Rank], per: int) -> None:
    """`<out>/launch.json`: which process runs which ranks (pid, log), for people and tests."""
    import json

    from pcompile.backends.checkpoint import atomic_write_text

    info = {"coordinator": coordinator, "launcher_pid": os.getpid(),
            "processes": [{"process": r.process, "ranks": list(range(r.rank, r.rank + per)),
                           "pid": r.popen.pid, "log": r.log} for r in ranks]}
    atomic_write_text(os.path.join(out_dir, "launch.json"), json.dumps(info, indent=1) + "\n")


def _echo_progress(path: str, state: list[int], echo: Callable[[str], None]) -> int:
    """Echo the complete lines added to `path` since the last call. `state` is
    [bytes consumed, lines echoed]; returns the number of lines echoed so far."""
    try:
        with open(path, "rb") as f:
            f.seek(state[0])
            data = f.read()
    except OSError:
        return state[1]
    end = data.rfind(b"\n") + 1  # only complete lines
    for line in data[:end].decode("utf-8", errors="replace").splitlines():
        echo(line)
        state[1] += 1
    state[0] += end
    return state[1]


def _stop(ranks: list[_Rank], grace: float) -> None:
    """SIGTERM every live rank's process group, SIGKILL what is left after `grace` s."""
    live = [r for r in ranks if r.popen.poll() is None]
    for r in live:
        _signal(r.popen, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(r.popen.poll() is None for r in live):
        time.sleep(0.05)
    for r in live:
        if r.popen.poll() is None:
            _signal(r.popen, signal.SIGKILL)
    for r in ranks:
        try:
            r.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if r.code is None:
            r.code = r.popen.returncode


def _signal(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            popen.send_signal(sig)
        except ProcessLookupError:
            pass


def _check_logs(out_dir: str, n: int, result: LaunchResult,
                echo: Callable[[str], None]) -> LaunchResult:
    """Every rank's train.log must report the same steps and losses (within 1e-5)."""
    logs: list[list[str] | None] = []
    for r in range(n):
        path = os.path.join(out_dir, f"rank_{r}", "train.log")
        try:
            with open(path, encoding="utf-8") as f:
                logs.append(f.read().splitlines())
        except OSError:
            logs.append(None)
    if not logs or logs[0] is None:
        return result
    first = logs[0]
    for r, lines in enumerate(logs[1:], start=1):
        if lines is None:
            continue
        if len(lines) != len(first) or not all(_same(a, b) for a, b in zip(first, lines)):
            message = f"rank {r}'s train.log differs from rank 0's"
            echo(f"pcompile launcher: {message}")
            return LaunchResult(1, r, message, first)
    return LaunchResult(0, None, "", first)


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    head_a, _, la = a.rpartition(" ")
    head_b, _, lb = b.rpartition(" ")
    try:
        x, y = float(la), float(lb)
    except ValueError:
        return False
    return head_a == head_b and abs(x - y) <= 1e-5 * max(1.0, abs(y))
