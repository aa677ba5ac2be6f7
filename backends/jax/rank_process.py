"""The rank program's process: its command line (`rank_command`, `parse_args`), its identity
in the job (backends/cluster.py), its platform and devices, its errors and exit statuses, and
its liveness: a heartbeat for the launcher, a watchdog against hung collectives, SIGTERM, and
the fault injection the tests use. backends/jax/rank_runtime.py starts the process with them.

Liveness: under the launcher (`PCOMPILE_HEARTBEAT_FD`), a thread sends a heartbeat twice a
second with the phase and the steps done; the launcher names the rank that stops beating or
falls behind. A watchdog ends the process (exit status 124) when a step takes longer than
`--timeout` seconds (the first step, which compiles, and `jax.distributed` start-up:
`--startup-timeout`), e.g. because a collective waits for a rank that died; under the launcher
it fires `LAUNCHER_GRACE` seconds later, so that the launcher's diagnosis comes first.
Started by hand, the processes watch each other through the coordinator
(backends/jax/peer_watch.py, `--heartbeat-timeout`).

A file of the run that cannot be written (train.log, metrics.jsonl, the process's output: a
full disk) is one RankError naming it (`write_error`), and the process exits.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

EXIT_TIMEOUT = 124
EXIT_LAUNCHER_GONE = 125
EXIT_COORDINATOR_PORT = 75  # EX_TEMPFAIL: the launcher retries on another port
EXIT_NONFINITE = 3  # --fail-on-nan: the loss is not finite
HEARTBEAT_FD = "PCOMPILE_HEARTBEAT_FD"
HEARTBEAT_INTERVAL = 0.5  # seconds between heartbeats
LAUNCHER_GRACE = 60.0  # under the launcher, the rank's own watchdog fires this much later
PARAM_INIT_ENV = "PCOMPILE_PARAM_INIT"  # where blocks are made: auto (default), device, host


_IMPORTED = time.time()  # this module's import: the start when /proc does not say


class RankError(Exception):
    """A user-facing error of the rank program (printed without a traceback)."""


class NonFiniteLossError(Exception):
    """--fail-on-nan: the loss of a step is not finite."""


# -- files the run writes (train.log, metrics.jsonl, the process's output) --------------------

#: errors of a file system that cannot take more (a full disk, a quota, a read-only or failing
#: device): the run cannot go on, and says so in one line
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def disk_reason(exc: OSError) -> str:
    """Why a write failed, in words."""
    if exc.errno == errno.ENOSPC:
        return "no space left on the device (the disk is full)"
    if exc.errno == errno.EDQUOT:
        return "the disk quota is exceeded"
    return exc.strerror or str(exc)


def output_path() -> str:
    """Where this process's output goes (its run.log under the launcher), in words."""
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and os.path.isfile(target):
            return f"its output {target}"
    return "its output (stdout)"


def write_error(what: str, exc: OSError) -> RankError:
    """A file of the run could not be written: one message naming it and why; the
    checkpoints already written are intact (each is written whole or not at all)."""
    return RankError(f"cannot write {what}: {disk_reason(exc)}; stopped the run (the "
                     "checkpoints written so far are intact: free some space, then --resume)")


def say_safely(text: str) -> None:
    """Print a line to stderr, ignoring a stderr that cannot take it (a full disk): the
    process is about to exit, and the launcher hears of it through the heartbeat."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def process_start() -> float:
    """When this process started (time.time() scale): from /proc on Linux (the kernel's
    start time, 10 ms resolution), else when this module was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        start = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED
    # btime is whole seconds: never report a start after the import, nor long before it
    return start if _IMPORTED - 3600 < start <= _IMPORTED else _IMPORTED


# -- identity ----------------------------------------------------------------------------------


def resolve_identity(args: SimpleNamespace, env: dict[str, str]) -> Any:
    """This process's place in the job (backends/cluster.py: flags, PCOMPILE_*, torchrun,
    msrun, MindSpore, PMI, then JAX's cluster detection)."""
    from pcompile.backends.cluster import IdentityError
    from pcompile.backends.cluster import resolve_identity as resolve

    try:
        return resolve(args.num_processes, args.process_id, args.coordinator, env)
    except IdentityError as exc:
        raise RankError(str(exc)) from None


def rank_command(num_ranks: int) -> Any:
    """The rank program's command line (click, as `pcompile`'s own)."""
    import click

    def positive(name: str, least: int) -> Callable[[Any, Any, int], int]:
        def check(ctx: Any, param: Any, value: int) -> int:
            if value < least:
                raise click.BadParameter(f"must be >= {least}, got {value}", ctx, param)
            return value
        return check

    params: list[click.Parameter] = [
        click.Option(["--coordinator"], default=None, help="HOST:PORT of process 0"),
        click.Option(["--num-processes"], type=int, default=None),
        click.Option(["--process-id"], type=int, default=None),
        click.Option(["--steps"], type=int, default=1, callback=positive("--steps", 0),
                     help="train until this many steps are done in all (default 1)"),
        click.Option(["--checkpoint-every"], type=int, default=0, metavar="K",
                     callback=positive("--checkpoint-every", 0),
                     help="also checkpoint every K steps (always at the end)"),
        click.Option(["--checkpoint-dir"], default=None, help="default: <out>/checkpoints"),
        click.Option(["--no-checkpoint"], is_flag=True, help="write no checkpoint at the end"),
        click.Option(["--resume"], is_flag=True,
                     help="continue from the newest step that every rank holds intact"),
        click.Option(["--resume-step"], type=int, default=None, metavar="S",
                     help="with --resume: continue from step S (the launcher chose it)"),
        click.Option(["--param-init"], type=click.Choice(["auto", "device", "host"]),
                     default=None,
                     help="where each rank makes its parameter and optimizer-state slices: "
                          "device (jitted generator), host (numpy) or auto (default, or "
                          f"{PARAM_INIT_ENV}: the device for all but small blocks); the values "
                          "are the same bit for bit"),
        click.Option(["--timeout"], type=float, default=300.0,
                     help="seconds a step (and its collectives) may take (default 300)"),
        click.Option(["--startup-timeout"], type=float, default=600.0,
                     help="seconds for distributed start-up and the first, compiling step "
                          "(default 600)"),
        click.Option(["--heartbeat-timeout"], type=float, default=30.0,
                     help="processes started by hand (mpirun, srun, torchrun, flags) beat "
                          "through the coordinator: one silent this many seconds is lost, and "
                          "every process stops, naming it (default 30; 0: no watch; under "
                          "pcompile's launcher the launcher watches)"),
        click.Option(["--fail-on-nan/--no-fail-on-nan"], default=True,
                     help="stop when the loss is not finite (default: on)"),
        click.Option(["--quiet"], is_flag=True, help="do not print loss lines"),
        click.Option(["--print-every"], type=int, default=1, metavar="K",
                     callback=positive("--print-every", 1),
                     help="print every K-th loss line and the last (MindSpore's "
                          "LossMonitor(per_print_times); default 1)"),
        click.Option(["--all-ranks"], is_flag=True,
                     help="every process prints its loss lines, as '[rank r] ...' (default: "
                          "only process 0; other processes print only their messages)"),
        click.Option(["--platform"], type=click.Choice(["auto", "cpu", "gpu"]), default=None,
                     help="cpu: virtual CPU devices; gpu: one GPU per rank; auto (default, or "
                          "PCOMPILE_PLATFORM): JAX's default backend"),
        click.Option(["--matmul-precision"], type=click.Choice(["default", "high", "highest"]),
                     default="default",
                     help="JAX's float32 matmul precision (jax_default_matmul_precision): "
                          "default lets a GPU use TF32, highest computes in full float32"),
        click.Option(["--log-every"], type=int, default=1, metavar="N",
                     callback=positive("--log-every", 1),
                     help="read the loss back from the device every N steps (all N lines are "
                          "then written; default 1)"),
        click.Option(["--tensorboard"], default=None, metavar="DIR",
                     help="also write the metrics.jsonl scalars as TensorBoard event files "
                          "into DIR (needs tensorboardX: pip install 'pcompile[tensorboard]')"),
        click.Option(["--keep-checkpoint-max"], type=int, default=2, metavar="K",
                     callback=positive("--keep-checkpoint-max", 1),
                     help="checkpoints kept per rank: the newest K steps (MindSpore's "
                          "CheckpointConfig(keep_checkpoint_max); default 2), and always the "
                          "newest step every rank holds"),
        click.Option(["--profile-steps"], default=None, metavar="N..M",
                     callback=lambda ctx, param, value: (
                         None if value is None else _step_range(value, ctx, param)),
                     help="write a jax.profiler trace of steps N to M (one step: N) into "
                          "--profile-dir"),
        click.Option(["--profile-dir"], default=None, metavar="DIR",
                     help="where --profile-steps writes (default <out>/profile; each process "
                          "in its subfolder rank_<r>, r its first rank)"),
        click.Option(["-v", "--verbose"], count=True,
                     help="progress (step rate, time left) on stderr even when it is not a "
                          "terminal"),
    ]
    return click.Command("program.py", params=params,
                         help=f"pcompile rank program ({num_ranks} ranks); see docs/running.md")


def step_range(text: str) -> tuple[int, int]:
    """`N..M` (or `N`) as (N, M), steps counted from 1 over the whole run; ValueError saying
    what is valid."""
    first, sep, last = str(text).strip().partition("..")
    try:
        start, stop = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ValueError(f"expected N..M (steps, e.g. 3..5) or N, got {text!r}") from None
    if not 1 <= start <= stop:
        raise ValueError(f"expected 1 <= N <= M, got {text!r}")
    return start, stop


def _step_range(text: str, ctx: Any, param: Any) -> tuple[int, int]:
    import click

    try:
        return step_range(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def parse_args(argv: list[str] | None, num_ranks: int) -> SimpleNamespace:
    """The options of `argv` (default: sys.argv[1:]); --help and a bad option print and exit
    (status 0 and 2), as a click command does."""
    import click

    command = rank_command(num_ranks)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with command.make_context("program.py", args) as ctx:
            # the options left at their defaults: a model file's callbacks() may set them
            defaults = {name for name in ctx.params
                        if ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT}
            return SimpleNamespace(**ctx.params, defaulted=defaults)
    except click.exceptions.Exit as exc:  # --help
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None


def chosen_platform(args: SimpleNamespace) -> str:
    """cpu, gpu or auto (JAX's default backend; CPU settings apply only to CPU devices):
    --platform, else PCOMPILE_PLATFORM (the launcher sets it), else auto."""
    from pcompile.backends.placement import PLATFORM_ENV, PLATFORMS

    platform = args.platform or os.environ.get(PLATFORM_ENV) or "auto"
    if platform not in PLATFORMS:
        raise RankError(f"platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
    return platform


def placed_device_ids() -> list[int] | None:
    from pcompile.backends.placement import local_device_ids
    from pcompile.ir.errors import PcompileError

    try:
        return local_device_ids(os.environ)
    except PcompileError as exc:
        raise RankError(str(exc)) from None


# -- watchdog and heartbeat --------------------------------------------------------------------


class Watchdog:
    """Ends the process when the current phase passes its deadline (a hung collective), or when
    the launcher that started it is gone. Under the launcher, which watches every rank's
    heartbeat and names the rank that stopped first, this is only a backstop: it fires
    `LAUNCHER_GRACE` seconds after the deadline, so the launcher decides first."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.deadline = float("inf")
        self.what = "start-up"
        self.why = ""
        self.grace = LAUNCHER_GRACE if os.environ.get(HEARTBEAT_FD) else 0.0
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._watch, daemon=True, name="pcompile-watchdog")
        thread.start()

    def arm(self, seconds: float, what: str, why: str = "") -> None:
        """End the process unless `what` is over within `seconds`; `why`: the likely cause
        it names (default: a collective waiting for a rank that stopped)."""
        with self._lock:
            self.deadline = time.monotonic() + seconds + self.grace
            self.what = what
            self.why = why

    def disarm(self) -> None:
        with self._lock:
            self.deadline = float("inf")

    def explain(self, why: str) -> None:
        """The likely cause to name if the current deadline passes (the deadline unchanged)."""
        with self._lock:
            self.why = why

    def _watch(self) -> None:
        launcher = os.environ.get("PCOMPILE_LAUNCHER_PID")
        while True:
            time.sleep(0.5)
            if launcher and str(os.getppid()) != launcher:
                say_safely(f"{self.label}: the launcher (pid {launcher}) is gone. Exiting.")
                os._exit(EXIT_LAUNCHER_GONE)
            with self._lock:
                late = time.monotonic() > self.deadline
                what = self.what
                why = self.why or "a collective is probably waiting for a rank that stopped"
            if late:
                say_safely(f"{self.label}: {what} did not finish in time; {why}. Exiting.")
                os._exit(EXIT_TIMEOUT)


class Heartbeat:
    """Tells the launcher this process is alive and where it is: one JSON line per
    `HEARTBEAT_INTERVAL` from a thread (a stopped or frozen process falls silent) and one on
    every change of phase, on the pipe the launcher passed as `PCOMPILE_HEARTBEAT_FD`.
    Without a launcher it does nothing."""

    def __init__(self) -> None:
        fd = os.environ.get(HEARTBEAT_FD, "")
        self.fd = int(fd) if fd.isdigit() else None
        self.state: dict[str, Any] = {"phase": "start", "done": None}
        self._lock = threading.Lock()
        if self.fd is not None:
            os.set_blocking(self.fd, False)
            threading.Thread(target=self._beat, daemon=True, name="pcompile-heartbeat").start()

    def set(self, **fields: Any) -> None:
        with self._lock:
            self.state.update(fields)
        # the last words (finished, failed) must reach the launcher: it tells a process that
        # exits with status 0 before the run is over by their absence
        self._send(wait=fields.get("phase") in ("finish", "failed"))

    def failed(self, why: str) -> None:
        """The process is about to exit with an error: when, so the launcher can tell the
        first failure from the ones it caused."""
        self.set(phase="failed", error=why[-2000:], at=time.time())

    def _send(self, wait: bool = False) -> None:
        if self.fd is None:
            return
        with self._lock:
            line = json.dumps(self.state) + "\n"
        give_up = time.monotonic() + (2.0 if wait else 0.0)
        while True:
            try:
                os.write(self.fd, line.encode())
                return
            except BlockingIOError:  # a full pipe: the launcher reads it soon
                if time.monotonic() >= give_up:
                    return
                time.sleep(0.05)
            except OSError:  # a gone launcher
                return

    def _beat(self) -> None:
        while True:
            self._send()
            time.sleep(HEARTBEAT_INTERVAL)


def fault_injection(local: list[int]) -> tuple[int | None, str]:
    """Testing aid: PCOMPILE_FAULT_INJECT="RANK:STEP" makes the process running RANK raise at
    the start of STEP; "RANK:STEP:hang" makes it hang there instead (alive, heartbeat going);
    "RANK:STEP:checkpoint-kill" kills it (SIGKILL) in the middle of the background write of
    the checkpoint of STEP (its tensors written, not yet renamed); "RANK:STEP:checkpoint-enospc"
    makes that write fail as on a full disk."""
    spec = os.environ.get("PCOMPILE_FAULT_INJECT", "")
    if not spec:
        return None, ""
    rank, step, *mode = spec.split(":")
    return (int(step) if int(rank) in local else None), (mode[0] if mode else "raise")


#: called with the reason before a rank process stops on a signal (the peer watch tells the
#: other processes of a job started by hand: backends/jax/peer_watch.py)
ON_STOP: list[Callable[[str], None]] = []


def exit_on_sigterm(label: str) -> None:
    """jax.distributed installs a SIGTERM (preemption) handler that keeps the process alive;
    a rank asked to stop must stop."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        reason = f"stopped by {signal.Signals(signum).name}"
        say_safely(f"{label}: {reason}")
        for hook in ON_STOP:
            try:
                hook(reason)
            except Exception:  # stopping must not fail
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)

