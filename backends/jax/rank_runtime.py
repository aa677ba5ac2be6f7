"""What a generated `<out>/rank_<r>/program.py` runs: process identity, `jax.distributed`, the
rank mesh, this process's slices of each batch, the training loop, `train.log`, checkpoints, a
heartbeat for the launcher and a watchdog.

Identity: backends/cluster.py (flags, `PCOMPILE_*`, torchrun, msrun, MindSpore's
`RANK_ID`/`RANK_SIZE`, PMI, then JAX's own cluster detection for Open MPI and SLURM; nothing:
one process runs every rank on N virtual CPU devices). With P processes, process p runs ranks
p*N/P ... (p+1)*N/P - 1 (one each when P = N); started as another rank's program it
re-executes its own rank's program (so `mpirun -n 8 python out/rank_0/program.py` works).

Data: each process imports the model file (`MODEL_FILE`) and iterates `dataset()` like
`compiler.runtime.batches` (epochs restart it; without one, inputs()/labels() or a synthetic
batch repeats), then cuts each rank's part of every global batch by the input's layout
(`LAYOUTS`, from dataset_strategy). A `pcompile.dataset` object is read only for the rows of
this process's ranks' share of each batch (`compiler.runtime.batch_rows`; the whole batch
under full_batch), and the steps a resumed run skips are not read. The model file and
pcompile must be importable on every host, and `dataset()` must give the same batches in every
process (seed its random numbers).

Parameters: each rank makes its blocks of every parameter and optimizer state on its own device
(backends/jax/param_init.py; small blocks and the model's arrays on the host, the same values),
from `<out>/params.json` (backends/params.py).

Checkpoints: `<out>/checkpoints/rank_<r>/step_<S>.safetensors` and its index `step_<S>.json` at
the end and every `--checkpoint-every` steps (backends/checkpoint.py), written from a host copy by
a background thread while the loop goes on (backends/async_checkpoint.py); `--resume` continues
from the newest step that every rank holds intact (verified against each index's manifest;
damaged newer steps are reported and passed over), restores train.log, skips the batches
already seen, and so gives bit-identical losses.
`--fail-on-nan` (on by default) stops at the first step whose loss is not finite.

Liveness: under the launcher (`PCOMPILE_HEARTBEAT_FD`), a thread sends a heartbeat twice a
second with the phase and the steps done; the launcher names the rank that stops beating or
falls behind. A watchdog ends the process (exit status 124) when a step takes longer than
`--timeout` seconds (the first step, which compiles, and `jax.distributed` start-up:
`--startup-timeout`), e.g. because a collective waits for a rank that died; under the launcher
it fires `LAUNCHER_GRACE` seconds later, so that the launcher's diagnosis comes first.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

EXIT_TIMEOUT = 124
EXIT_LAUNCHER_GONE = 125
EXIT_COORDINATOR_PORT = 75  # EX_TEMPFAIL: the launcher retries on another port
EXIT_NONFINITE = 3  # --fail-on-nan: the loss is not finite
HEARTBEAT_FD = "PCOMPILE_HEARTBEAT_FD"
HEARTBEAT_INTERVAL = 0.5  # seconds between heartbeats
LAUNCHER_GRACE = 60.0  # under the launcher, the rank's own watchdog fires this much later
PARAM_INIT_ENV = "PCOMPILE_PARAM_INIT"  # where blocks are made: auto (default), device, host
# auto: a block is made on the device when the host would take longer than compiling the
# device's maker (~0.1-0.8 s on a CPU, once per distinct init, shape and block)
DEVICE_MIN_RANDOM = 1 << 18
DEVICE_MIN_CONSTANT = 1 << 12


_IMPORTED = time.time()  # this module's import: the start when /proc does not say


class RankError(Exception):
    """A user-facing error of the rank program (printed without a traceback)."""


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
        click.Option(["-v", "--verbose"], count=True,
                     help="progress (step rate, time left) on stderr even when it is not a "
                          "terminal"),
    ]
    return click.Command("program.py", params=params,
                         help=f"pcompile rank program ({num_ranks} ranks); see docs/running.md")


def parse_args(argv: list[str] | None, num_ranks: int) -> SimpleNamespace:
    """The options of `argv` (default: sys.argv[1:]); --help and a bad option print and exit
    (status 0 and 2), as a click command does."""
    import click

    command = rank_command(num_ranks)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with command.make_context("program.py", args) as ctx:
            return SimpleNamespace(**ctx.params)
    except click.exceptions.Exit as exc:  # --help
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None


def _platform(args: SimpleNamespace) -> str:
    """cpu, gpu or auto (JAX's default backend; CPU settings apply only to CPU devices):
    --platform, else PCOMPILE_PLATFORM (the launcher sets it), else auto."""
    from pcompile.backends.placement import PLATFORM_ENV, PLATFORMS

    platform = args.platform or os.environ.get(PLATFORM_ENV) or "auto"
    if platform not in PLATFORMS:
        raise RankError(f"platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
    return platform


def _local_device_ids() -> list[int] | None:
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
        self.grace = LAUNCHER_GRACE if os.environ.get(HEARTBEAT_FD) else 0.0
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._watch, daemon=True, name="pcompile-watchdog")
        thread.start()

    def arm(self, seconds: float, what: str) -> None:
        with self._lock:
            self.deadline = time.monotonic() + seconds + self.grace
            self.what = what

    def disarm(self) -> None:
        with self._lock:
            self.deadline = float("inf")

    def _watch(self) -> None:
        launcher = os.environ.get("PCOMPILE_LAUNCHER_PID")
        while True:
            time.sleep(0.5)
            if launcher and str(os.getppid()) != launcher:
                sys.stderr.write(f"{self.label}: the launcher (pid {launcher}) is gone. "
                                 "Exiting.\n")
                sys.stderr.flush()
                os._exit(EXIT_LAUNCHER_GONE)
            with self._lock:
                late = time.monotonic() > self.deadline
                what = self.what
            if late:
                sys.stderr.write(
                    f"{self.label}: {what} did not finish in time; a collective is probably "
                    "waiting for a rank that stopped. Exiting.\n")
                sys.stderr.flush()
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

    def set(self, **state: Any) -> None:
        with self._lock:
            self.state.update(state)
        self._send()

    def failed(self, why: str) -> None:
        """The process is about to exit with an error: when, so the launcher can tell the
        first failure from the ones it caused."""
        self.set(phase="failed", error=why[-300:], at=time.time())

    def _send(self) -> None:
        if self.fd is None:
            return
        with self._lock:
            line = json.dumps(self.state) + "\n"
        try:
            os.write(self.fd, line.encode())
        except OSError:  # a full pipe (the launcher reads it soon) or a gone launcher
            pass

    def _beat(self) -> None:
        while True:
            self._send()
            time.sleep(HEARTBEAT_INTERVAL)


def _fault_injection(local: list[int]) -> tuple[int | None, str]:
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


def _exit_on_sigterm(label: str) -> None:
    """jax.distributed installs a SIGTERM (preemption) handler that keeps the process alive;
    a rank asked to stop must stop."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        sys.stderr.write(f"{label}: stopped by {signal.Signals(signum).name}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


# -- logs --------------------------------------------------------------------------------------


class TrainLog:
    """`<rank dir>/train.log`: rewritten atomically on (re)start, then one append per line."""

    def __init__(self, path: str, lines: list[str]) -> None:
        from pcompile.backends.checkpoint import atomic_write_text

        self.path = path
        self.lines = list(lines)
        atomic_write_text(path, "".join(line + "\n" for line in lines))

    def add(self, line: str) -> None:
        self.lines.append(line)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)


# -- main --------------------------------------------------------------------------------------


class NonFiniteLossError(Exception):
    """--fail-on-nan: the loss of a step is not finite."""


def main(module: ModuleType | Sequence[ModuleType], argv: list[str] | None = None) -> int:
    """Run the rank program `module` (a generated program.py); returns the exit status.
    Several programs of the same number of ranks (a sequence): trained one after the other
    with the same arguments, after one `jax.distributed` start-up (each in its own output
    folder); the first failure ends the process."""
    modules = [module] if isinstance(module, ModuleType) else list(module)
    heartbeat = Heartbeat()

    def label() -> str:  # the ranks this process runs, once it knows them
        return getattr(modules[0], "LABEL", None) or "pcompile rank program"

    try:
        return _main(modules, argv, heartbeat)
    except RankError as exc:
        message, code = f"{label()}: error: {exc}", 2
    except NonFiniteLossError as exc:
        message, code = f"{label()}: error: {exc}", EXIT_NONFINITE
    except KeyboardInterrupt:
        message, code = f"{label()}: interrupted", 130
    except Exception as exc:  # any failure of a rank: report it and leave at once
        import traceback

        traceback.print_exc()
        message, code = f"{label()}: failed ({type(exc).__name__}: {exc})", 1
    heartbeat.failed(message)
    print(message, file=sys.stderr)
    # Exit without the interpreter's shutdown: jax.distributed's atexit hook waits for the
    # other processes, which may be stuck in a collective with this one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(modules: list[ModuleType], argv: list[str] | None, heartbeat: Heartbeat) -> int:
    num_ranks = int(modules[0].NUM_RANKS)
    if any(int(m.NUM_RANKS) != num_ranks for m in modules):
        raise RankError("the programs run by one process must have the same number of ranks: "
                        + ", ".join(f"{m.__file__} has {m.NUM_RANKS}" for m in modules))
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv, num_ranks)
    identity = resolve_identity(args, dict(os.environ))
    if identity.scheduler:
        print(f"pcompile rank program: {identity.source} runs no ranks (pcompile's process 0 "
              "is the coordinator); exiting", file=sys.stderr)
        return 0
    nproc, pid, coordinator = identity.num_processes, identity.process_id, identity.coordinator
    if num_ranks % nproc:
        raise RankError(f"{num_ranks} ranks cannot be spread evenly over {nproc} processes "
                        f"({identity.source})")
    per_process = num_ranks // nproc
    my_ranks = list(range(pid * per_process, (pid + 1) * per_process))
    label = (f"pcompile rank {my_ranks[0]}" if per_process == 1
             else f"pcompile ranks {my_ranks[0]}-{my_ranks[-1]}")
    for module in modules:
        module.LABEL = label  # type: ignore[attr-defined]  # a module takes any attribute
    from pcompile.compiler.progress import setup_logging

    setup_logging(args.verbose, prefix="" if pid == 0 else f"[rank {my_ranks[0]}] ")

    watchdog = Watchdog(label)
    watchdog.arm(args.startup_timeout, "distributed start-up")
    import jax

    platform = _platform(args)
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    if platform != "gpu" and per_process > 1:  # only CPU devices are virtual
        try:
            jax.config.update("jax_num_cpu_devices", per_process)
        except RuntimeError as exc:  # JAX already initialised in this process
            raise RankError(str(exc)) from exc
    if args.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    started = process_start()
    timings = {"start": started, "imports": time.time() - started}
    if nproc > 1:
        if platform != "gpu":  # GPUs talk over NCCL, CPU devices over gloo
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs: dict[str, Any] = {"initialization_timeout": int(args.startup_timeout)}
        if coordinator is not None:
            from pcompile.backends.cluster import bind_kwargs

            kwargs.update(coordinator_address=coordinator, num_processes=nproc, process_id=pid)
            kwargs.update(bind_kwargs(coordinator))  # all local: listen on the loopback only
        local_ids = _local_device_ids()
        if local_ids is not None:  # the launcher's placement (else JAX's: by local rank)
            kwargs["local_device_ids"] = local_ids
        # else: JAX's own cluster detection (SLURM, Open MPI) finds everything
        heartbeat.set(phase="connect")
        connecting = time.perf_counter()
        try:
            jax.distributed.initialize(**kwargs)
        except Exception as exc:
            if pid == 0 and "Failed to start RPC server" in str(exc):
                print(f"{label}: error: the coordinator cannot listen on "
                      f"{coordinator} (address in use?): {exc}", file=sys.stderr)
                return EXIT_COORDINATOR_PORT
            raise
        timings["distributed"] = time.perf_counter() - connecting
        _exit_on_sigterm(label)
        if jax.process_index() != pid:
            raise RankError(f"JAX numbers this process {jax.process_index()}, expected {pid} "
                            f"({identity.source})")
    return _train(modules, args, num_ranks, my_ranks, watchdog, heartbeat, timings)


def _train(modules: list[ModuleType], args: SimpleNamespace, num_ranks: int,
           my_ranks: list[int], watchdog: Watchdog, heartbeat: Heartbeat,
           timings: dict[str, float] | None = None) -> int:
    import jax

    from pcompile.backends.jax.plan import MeshSpec
    from pcompile.backends.jax.spmd import make_mesh, rank_devices

    code = 0
    for module in modules:
        # `<out>/program.py` runs any rank (RANK is None); `<out>/rank_<r>/program.py` is the
        # same program commented with rank r's values.
        out_dir = os.path.dirname(os.path.abspath(str(module.__file__)))
        if module.RANK is not None:
            out_dir = os.path.dirname(out_dir)
        spec = MeshSpec(tuple(n for n, _ in module.MESH), tuple(s for _, s in module.MESH))
        mesh = make_mesh(spec, rank_devices(num_ranks))
        local = [r for r, d in enumerate(mesh.devices.flat)
                 if d.process_index == jax.process_index()]
        if local != my_ranks:
            raise RankError(f"this process owns devices of ranks {local}, expected {my_ranks}")
        watchdog.arm(args.startup_timeout, "start-up")
        code = _Runner(module, mesh, local, out_dir, args, watchdog, heartbeat,
                       dict(timings or {})).run()
        if code:
            break
        timings = None  # the next program's start-up is its own: no imports, no start-up
    # jax.distributed's exit waits for every process; do not wait for ever.
    watchdog.arm(args.timeout, "shutdown")
    return code


class _Report:
    """What this run reports (backends/run_report.py): the start-up line, `metrics.jsonl`
    (`<out>/metrics.jsonl`, written by the process that runs rank 0: one line for the first
    step, every `--log-every`-th and the last; a resumed run keeps the lines up to its step)
    and the summary."""

    def __init__(self, module: ModuleType, mesh: Any, out_dir: str, done: int, log_every: int,
                 writes: bool, tensorboard: str | None = None) -> None:
        from pcompile.backends import run_report

        self.rr = run_report
        self.done = done
        self.log_every = max(1, log_every)
        self.ranks = int(module.NUM_RANKS)
        inputs = [(tuple(module.LAYOUTS[name][0]), dtype)
                  for name, kind, _, dtype in module.PARAMS if kind == "input"]
        self.unit, self.per_step = run_report.throughput_unit(inputs)
        weights = sum(int(np.prod(module.LAYOUTS[name][0], dtype=np.int64))
                      for name, kind, _, _ in module.PARAMS if kind == "weight")
        self.flops, self.flops_how = run_report.step_flops(
            int(getattr(module, "MODEL_FLOPS", 0) or 0), weights, self.unit, self.per_step)
        device = mesh.devices.flat[0]
        self.peak = run_report.peak_tflops(str(getattr(device, "device_kind", "")),
                                           str(getattr(device, "platform", "cpu")))
        self.lr = getattr(module, "LEARNING_RATE", None)
        self.times: list[float] = []  # seconds of each step after the first
        self.path = os.path.join(out_dir, "metrics.jsonl") if writes else None
        self.mesh = mesh
        self.board: Any = None
        if self.path is not None and tensorboard:
            try:
                self.board = run_report.tensorboard_writer(tensorboard)
            except RuntimeError as exc:
                raise RankError(str(exc)) from None
        if self.path is not None:
            from pcompile.backends.checkpoint import atomic_write_text

            kept = self._kept(done)
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def _kept(self, done: int) -> list[str]:
        """A resumed run's earlier lines (steps up to the one resumed from)."""
        if not done or self.path is None:
            return []
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            return []
        kept = []
        for line in lines:
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int) and step <= done:
                kept.append(line)
        return kept

    def steps(self, pending: list[tuple[int, int, int, Any, list[Any]]], seconds: float,
              last: bool, first: bool) -> None:
        """Steps just read back, each of which took `seconds` (their share of the time)."""
        if not first:
            self.times += [seconds] * len(pending)
        if self.path is None:
            return
        from pcompile.backends.jax.spmd import local_pieces

        out = []
        for i, (k, epoch, in_epoch, loss_out, extras) in enumerate(pending):
            step = k + 1
            if not (step == self.done + 1 or step % self.log_every == 0
                    or (last and i == len(pending) - 1)):
                continue
            loss = float(local_pieces(loss_out, self.mesh, ())[0])
            known: dict[str, Any] = {"lr": self.lr}
            known.update(self._extras([local_pieces(v, self.mesh)[0] for _, v in extras]))
            record = self.rr.metrics_record(step, epoch, in_epoch, loss, seconds * 1000,
                                            self.unit, self.per_step, known)
            out.append(self.rr.metrics_line(record))
            if self.board is not None:
                for tag, value in self.rr.tensorboard_scalars(record).items():
                    self.board.add_scalar(tag, value, step)
        if self.board is not None:
            self.board.flush()
        if out:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, "".join(line + "\n" for line in out).encode())
            finally:
                os.close(fd)

    @staticmethod
    def _extras(values: list[Any]) -> dict[str, Any]:
        """The step's other scalar outputs, in MindSpore's order (TrainOneStepWithLossScaleCell:
        loss, overflow, loss scale; mindformers adds the global gradient norm)."""
        out: dict[str, Any] = {}
        names = iter(("loss_scale", "grad_norm"))
        for value in values:
            array = np.asarray(value)
            if array.size != 1:
                continue
            if array.dtype == np.bool_:
                if "overflow" not in out:
                    out["overflow"] = bool(array.reshape(()))
                continue
            if "overflow" not in out:
                continue  # not the loss-scale convention: unnamed outputs stay out
            name = next(names, None)
            if name is not None and np.issubdtype(array.dtype, np.floating):
                out[name] = float(array.reshape(()))
        return out

    def steady_ms(self) -> float | None:
        value = self.rr.median(self.times)
        return None if value is None else value * 1000

    def startup(self, timings: dict[str, float]) -> str:
        phases = {key: value for key, value in timings.items() if key != "start"}
        known = sum(v for k, v in phases.items() if k != "total")
        phases["other"] = max(0.0, phases["total"] - known)
        return self.rr.startup_line(phases)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None

    def summary(self, trained: int, first: int, last: int, seconds: float) -> str:
        line = self.rr.summary_line(trained, first, last, seconds, self.steady_ms(), self.unit,
                                    self.per_step, self.flops, self.flops_how, self.peak,
                                    self.ranks)
        if self.path is not None:
            line += f"; metrics: {self.path}"
        return line


class _Runner:
    """The training (or inference) loop of one process."""

    def __init__(self, module: ModuleType, mesh: Any, local: list[int], out_dir: str,
                 args: SimpleNamespace, watchdog: Watchdog, heartbeat: Heartbeat,
                 timings: dict[str, float] | None = None) -> None:
        self.m = module
        # start-up phases so far (seconds; "start": the process's start, time.time())
        self.timings = timings or {"start": time.time()}
        self.heartbeat = heartbeat
        self.mesh = mesh
        self.local = local
        self.out_dir = out_dir
        self.args = args
        self.watchdog = watchdog
        self.ckpt_dir = os.path.abspath(args.checkpoint_dir or os.path.join(out_dir,
                                                                            "checkpoints"))
        self.params = list(module.PARAMS)
        self.inputs = [p for p in self.params if p[1] == "input"]
        self._out_shapes: list[tuple[int, ...]] = []  # the step's, once traced
        self.stored = [p for p in self.params if p[1] != "input"]
        from pcompile.ir.types import DType

        self.dtypes = {p[0]: DType[p[3]].np for p in self.params}
        consts = os.path.join(out_dir, "consts.npz")
        if os.path.exists(consts):
            from pcompile.backends.checkpoint import load_npz

            module.DATA.update(load_npz(consts))

    # -- pieces --------------------------------------------------------------------------------
    def _rank_dir(self, rank: int) -> str:
        return os.path.join(self.out_dir, f"rank_{rank}")

    def _owns(self, name: str, rank: int) -> bool:
        """Whether `rank` holds stored value `name` (a pipeline stage holds its own; the
        program passes the others' through unchanged)."""
        stages = getattr(self.m, "PARAM_STAGES", None)
        if stages is None:
            return True
        return rank // int(self.m.RANKS_PER_STAGE) in stages[name]

    def _initial_state(self) -> dict[str, Any]:
        """Every stored value's global array, each local rank's block made on its own device
        (backends/jax/param_init.py) or, for small blocks and user arrays, on the host
        (backends/params.py); equal, bit for bit, to the single-device initialisation's block
        (another pipeline stage's values: zeros, never read)."""
        from concurrent.futures import Future, ThreadPoolExecutor

        import jax

        from pcompile.backends.jax.param_init import device_block, supports
        from pcompile.backends.jax.spmd import as_block
        from pcompile.backends.params import ParamsError, read_manifest

        try:
            sources = read_manifest(self.out_dir)
        except ParamsError as exc:
            raise RankError(str(exc)) from None
        where = self.args.param_init or os.environ.get(PARAM_INIT_ENV) or "auto"
        if where not in ("auto", "device", "host"):
            raise RankError(f"{PARAM_INIT_ENV}={where!r}: expected auto, device or host")
        wide_ok = bool(jax.config.read("jax_enable_x64"))
        start = time.perf_counter()
        counts = {"device": 0, "host": 0}

        def make(source: Any, bounds: Any, device: Any, on_device: bool) -> Any:
            block = device_block(source, bounds, device) if on_device else None
            if block is None:
                block = jax.device_put(as_block(source.block(bounds)), device)
            return block

        # Blocks are made from a few threads: the device generator compiles once per distinct
        # init, shape and block (XLA compiles in parallel), host blocks use numpy's loops.
        pieces: dict[str, list[Any]] = {}
        workers = max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pcompile-init") as pool:
            for name, _, shape, _ in self.stored:
                source = sources.get(name)
                if source is None:
                    raise RankError(f"params.json has no entry for {name}; compile again")
                pieces[name] = []
                for r in self.local:
                    device = self.mesh.devices.flat[r]
                    if not self._owns(name, r):
                        pieces[name].append(jax.device_put(
                            as_block(np.zeros(shape, self.dtypes[name])), device))
                        continue
                    bounds = self._layout(name).slice_bounds(r) if source.shape else ()
                    size = int(np.prod([hi - lo for lo, hi in bounds], dtype=np.int64))
                    on_device = (where == "device" or (where == "auto" and size >= (
                        DEVICE_MIN_CONSTANT if source.init is not None and not source.init.random
                        else DEVICE_MIN_RANDOM)))
                    # 8-byte values stay on the host without x64: the device would hold them
                    # as 4-byte ones, as a device_put of the host's values gives them
                    on_device = (on_device and supports(source)
                                 and (source.dtype.itemsize < 8 or wide_ok))
                    counts["device" if on_device else "host"] += size
                    pieces[name].append(pool.submit(make, source, bounds, device, on_device))
        state = {name: self._stack([p.result() if isinstance(p, Future) else p for p in arrays],
                                   shape)
                 for (name, _, shape, _), arrays in zip(self.stored, pieces.values())}
        for array in state.values():
            array.block_until_ready()
        seconds = time.perf_counter() - start
        total = counts["device"] + counts["host"]
        self._say(f"parameters and optimizer state of rank(s) {self.local[0]}..{self.local[-1]}: "
                  f"{total / 1e6:.2f} M values in {seconds:.2f} s "
                  f"({counts['device'] / 1e6:.2f} M made on the device, "
                  f"{counts['host'] / 1e6:.2f} M on the host)", force=True)
        return state

    def _stack(self, arrays: list[Any], shape: tuple[int, ...]) -> Any:
        """The global array (`spmd.blocked_shape`) of this process's ranks' blocks."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from pcompile.backends.jax.spmd import blocked_shape

        sharding = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
        return jax.make_array_from_single_device_arrays(blocked_shape(self.mesh.size, shape),
                                                        sharding, arrays)

    def _layout(self, name: str) -> Any:
        from pcompile.ir.layout import TensorLayout

        shape, dev, tmap = self.m.LAYOUTS[name]
        return TensorLayout(tuple(dev), tuple(tmap), tuple(shape))

    def _slice(self, name: str, array: np.ndarray, rank: int, first_row: int = 0) -> np.ndarray:
        """`rank`'s part of an input from `array`, rows first_row.. of the global batch."""
        from pcompile.compiler.runtime import slice_rows

        return slice_rows(array, self._layout(name), rank, first_row)

    def _put(self, name: str, pieces: dict[int, np.ndarray], shape: tuple[int, ...]) -> Any:
        from pcompile.backends.jax.spmd import put_blocks

        return put_blocks(self.mesh, pieces, tuple(shape), self.dtypes[name])

    def _batches(self, steps: int, skip: int = 0) -> Any:
        """(epoch, step, arrays, first_row) per step (compiler.runtime.iter_rank_batches): a
        pcompile.dataset object is read only for the rows of this process's ranks' share of
        each global batch, and its first `skip` steps not at all."""
        from pcompile.compiler.model_file import as_input_list, call_user, load_model_file
        from pcompile.compiler.runtime import batch_rows, iter_rank_batches

        path = self.m.MODEL_FILE
        if not os.path.exists(path):
            raise RankError(f"model file {path} (for the data) does not exist on this host")
        mf = load_model_file(path)
        examples = as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path)
        n_inputs = len(examples)
        if mf.loss is not None or len(self.inputs) > n_inputs:  # labels (nn.PipelineCell)
            from pcompile.compiler.trace_model import _first_batch_labels

            examples = examples + _first_batch_labels(mf)
        expected = [(name, tuple(self.m.LAYOUTS[name][0]), self.dtypes[name])
                    for name, *_ in self.inputs]
        if len(examples) != len(expected):
            raise RankError(f"the model file gives {len(examples)} inputs and labels, the "
                            f"program takes {len(expected)}")
        rows = batch_rows([self._layout(name) for name, *_ in self.inputs], self.local)
        return iter_rank_batches(mf, n_inputs, len(expected) - n_inputs, examples, expected,
                                 steps, rows=rows, skip=skip)

    def _function(self, donate: bool = False) -> Any:
        """The jitted SPMD step; `donate`: it reuses the buffers of the stored values it
        returns updated (training)."""
        import jax.numpy as jnp
        from jax import lax

        from pcompile.backends.jax.shared_compile import SharedStep
        from pcompile.backends.jax.spmd import spmd_function

        step = self.m.step
        mean_loss = self.m.PARALLEL_MODE == "data_parallel" and self.m.TRAINING
        axes = tuple(self.m.AXES)

        def body(*arrays: Any) -> Any:
            outs = list(step(*arrays))
            if mean_loss:  # each rank's loss is its own batch's; report their mean
                outs.append(lax.pmean(jnp.asarray(outs[0], jnp.float32), axes))
            return outs

        n = len(self.inputs)
        updated = set(self.m.OUTPUTS[1:])
        pipeline = hasattr(self.m, "PIPELINE")
        # a pipeline program's step is assembled per tick (pipeline.run_step): no donation there
        donated = tuple(n + i for i, (name, *_) in enumerate(self.stored)
                        if donate and not pipeline and name in updated)
        shapes = [shape for _, _, shape, _ in self.inputs + self.stored]
        jitted = spmd_function(body, self.mesh, shapes, donated, check_vma=not pipeline,
                               out_shapes=self._out_shapes)
        # compiled by process 0 only, when the processes run the same program on one host
        return SharedStep(jitted, f"{self.m.PLAN_ID}/{'train' if donate else 'infer'}")

    def _load_values(self, resume_step: int) -> tuple[dict[int, dict[str, np.ndarray]],
                                                      dict[str, Any]]:
        """This process's ranks' values read from their checkpoints of `resume_step`."""
        from pcompile.backends.checkpoint import (
            CheckpointError,
            checkpoint_path,
            read_checkpoint,
        )

        values: dict[int, dict[str, np.ndarray]] = {}
        meta: dict[str, Any] = {}
        for r in self.local:
            try:
                arrays, meta_r = read_checkpoint(checkpoint_path(self.ckpt_dir, r, resume_step),
                                                 r)
            except CheckpointError as exc:
                raise RankError(f"cannot resume from step {resume_step}: {exc}") from None
            if meta_r.get("plan_id") != self.m.PLAN_ID:
                raise RankError(
                    f"checkpoint of step {resume_step} was written by plan "
                    f"{meta_r.get('plan_id')}, this program is plan {self.m.PLAN_ID}; "
                    "resume with the same model and options, or start afresh without --resume")
            values[r], meta = arrays, meta_r
            for name, _, shape, _ in self.stored:  # another pipeline stage's: never read
                if not self._owns(name, r):
                    values[r].setdefault(name, np.zeros(shape, self.dtypes[name]))
        for r, vals in values.items():
            missing = [name for name, *_ in self.stored if name not in vals]
            if missing:
                raise RankError(f"rank {r}: no value for {', '.join(missing)}")
        return values, meta

    def _resume_step(self) -> int | None:
        """--resume: the launcher's choice (--resume-step), else the newest step that every
        rank holds intact; newer damaged ones are reported and passed over."""
        from pcompile.backends.checkpoint import resume_point

        if self.args.resume_step is not None:
            return int(self.args.resume_step)
        point = resume_point(self.ckpt_dir, int(self.m.NUM_RANKS), self.m.PLAN_ID)
        for line in point.skipped:
            self._say(f"passed over checkpoint {line}", force=True)
        if point.step is None:
            raise RankError(f"--resume: no step has an intact checkpoint of every rank in "
                            f"{self.ckpt_dir}; start without --resume")
        return point.step

    def _checkpoint(self, step: int, epoch: int, in_epoch: int, state: dict[str, Any],
                    logs: dict[int, TrainLog], final: bool = False) -> None:
        """Hand this process's ranks' state to the background writer
        (backends/async_checkpoint.py), after the write in flight is done: host copies (the
        next step reuses the device buffers), or for the `final` one the buffers themselves."""
        from pcompile.backends.async_checkpoint import CheckpointWriteError

        try:
            self.saver.wait()
        except CheckpointWriteError as exc:
            raise RankError(str(exc)) from None
        start = time.perf_counter()
        pieces = self.host.take(state, final)
        layouts = {name: {"shape": list(self.m.LAYOUTS[name][0]), "dtype": dt,
                          "dev_matrix": list(self.m.LAYOUTS[name][1]),
                          "tensor_map": [list(e) if isinstance(e, tuple) else e
                                         for e in self.m.LAYOUTS[name][2]]}
                   for name, _, _, dt in self.stored}
        per_rank = {}
        for r in self.local:
            mine = [name for name in pieces if self._owns(name, r)]
            meta = {"step": step, "epoch": epoch, "step_in_epoch": in_epoch, "rank": r,
                    "num_ranks": int(self.m.NUM_RANKS), "plan_id": self.m.PLAN_ID,
                    "log": list(logs[r].lines),
                    "layouts": {name: layouts[name] for name in mine}}
            per_rank[r] = ({name: pieces[name][r] for name in mine}, meta)
        self.saver.submit(step, per_rank, time.perf_counter() - start)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        from pcompile.backends.async_checkpoint import AsyncCheckpointWriter, CheckpointWriteError

        if not self.m.TRAINING:
            return self._infer()
        fault, mode = _fault_injection(self.local)
        self.saver = AsyncCheckpointWriter(self.ckpt_dir, lambda line: self._say(line, force=True),
                                           fault=(fault, mode))
        try:
            return self._train()
        finally:
            # the exit waits for a write in flight (its failure is reported unless another
            # error already ends the run)
            failing = sys.exc_info()[0] is not None
            try:
                self.saver.wait()
            except CheckpointWriteError as exc:
                if not failing:
                    raise RankError(str(exc)) from None
                print(f"{self.m.LABEL}: error: {exc}", file=sys.stderr, flush=True)

    def _train(self) -> int:
        from pcompile.backends.async_checkpoint import CheckpointWriteError, HostState
        from pcompile.backends.checkpoint import clean_temp_files
        from pcompile.backends.jax.spmd import local_pieces
        from pcompile.compiler.progress import LossMonitor
        from pcompile.compiler.runtime import format_loss_line

        m, args = self.m, self.args
        for r in self.local:  # temporary files of a killed checkpoint write
            clean_temp_files(os.path.join(self.ckpt_dir, f"rank_{r}"))
        resume_step = self._resume_step() if args.resume else None
        making = time.perf_counter()
        self.heartbeat.set(phase="init" if resume_step is None else "restore")
        meta: dict[str, Any]
        if resume_step is None:
            state, meta = self._initial_state(), {}
            self.timings["init"] = time.perf_counter() - making
        else:
            self._say(f"resuming from step {resume_step} (checkpoints in {self.ckpt_dir})",
                      force=True, first_only=True)
            values, meta = self._load_values(resume_step)
            state = {name: self._put(name, {r: values[r][name] for r in self.local}, shape)
                     for name, _, shape, _ in self.stored}
            self.timings["restore"] = time.perf_counter() - making
        self.saver.intact = resume_step
        self.host = HostState(self.mesh, {name: shape for name, _, shape, _ in self.stored})
        if args.checkpoint_every and args.checkpoint_every < args.steps:
            self.host.prefault(state)
        done = resume_step or 0
        if done > args.steps:
            raise RankError(f"--steps {args.steps} is below the step {done} of the checkpoint "
                            "resumed from; ask for more steps")
        logs = {r: TrainLog(os.path.join(self._rank_dir(r), "train.log"),
                            list(meta.get("log", []))[:done]) for r in self.local}
        report = _Report(m, self.mesh, self.out_dir, done, args.log_every,
                         writes=self.local[0] == 0, tensorboard=args.tensorboard)
        fn = self._function(donate=True)
        out_names = list(m.OUTPUTS)
        extra_outputs = [i for i, name in enumerate(out_names) if i and name not in state]
        fault, fault_mode = _fault_injection(self.local)
        first = True
        epoch, in_epoch = int(meta.get("epoch", 1)), int(meta.get("step_in_epoch", 0))
        start = time.perf_counter()
        monitor = LossMonitor(args.steps, args.print_every,
                              lambda line: self._say(line, loss=True), done=done)
        self.heartbeat.set(phase="data", done=done)
        # Losses still on the device: read back (one wait) every --log-every steps, before a
        # checkpoint and at the end; the steps in between never wait for the host.
        pending: list[tuple[int, int, int, Any, list[Any]]] = []
        marks = {"since": 0.0, "called": 0.0}  # the last read-back; the first step's call

        def flush(last: bool = False) -> None:
            if not pending:
                return
            self.watchdog.arm(args.timeout * len(pending), f"steps {pending[0][0] + 1}.."
                                                           f"{pending[-1][0] + 1}")
            for k_done, ep, step_in, loss_out, _ in pending:
                losses = local_pieces(loss_out, self.mesh, ())
                for r in self.local:
                    logs[r].add(format_loss_line(ep, step_in, float(losses[r])))
                monitor(logs[self.local[0]].lines[-1])
                bad = [r for r in self.local if not np.isfinite(float(losses[r]))]
                if bad and args.fail_on_nan:
                    raise NonFiniteLossError(
                        f"the loss is {float(losses[bad[0]])} at step {k_done + 1} (epoch "
                        f"{ep}, step {step_in}); stopped (--no-fail-on-nan trains on)")
            now = time.perf_counter()
            if marks["since"]:  # steps after the first: their share of the time since
                per = (now - marks["since"]) / len(pending)
            else:  # the first step of this run: its call and read-back, less the compile
                per = now - marks["called"] - getattr(fn, "compile_seconds", 0.0)
            report.steps(pending, per, last or pending[-1][0] + 1 >= args.steps,
                         first=not marks["since"])
            marks["since"] = now
            self.watchdog.disarm()
            self.heartbeat.set(phase="data", done=pending[-1][0] + 1)
            pending.clear()

        for k, (epoch, in_epoch, arrays, first_row) in enumerate(self._batches(args.steps,
                                                                               skip=done)):
            if k < done:
                continue
            self.watchdog.arm(args.startup_timeout if first else args.timeout,
                              f"step {k + 1}")
            failed = self.saver.failure()
            if failed is not None:  # a background checkpoint write failed: stop now
                raise RankError(str(failed))
            if fault == k + 1 and not fault_mode.startswith("checkpoint"):
                while fault_mode == "hang":
                    time.sleep(1)
                raise RuntimeError(f"PCOMPILE_FAULT_INJECT: failing at step {k + 1}")
            feeds = [self._put(name, {r: self._slice(name, a, r, first_row) for r in self.local},
                               shape)
                     for (name, _, shape, _), a in zip(self.inputs, arrays)]
            feeds += [state[name] for name, *_ in self.stored]
            self.heartbeat.set(phase="compile" if first else "compute")
            if first:
                marks["called"] = time.perf_counter()
            outs = fn(*feeds)
            for name, value in zip(out_names[1:], outs[1:]):
                if name in state:
                    state[name] = value
            loss_out = outs[-1] if len(outs) > len(out_names) else outs[0]
            pending.append((k, epoch, in_epoch, loss_out,
                            [(out_names[i], outs[i]) for i in extra_outputs]))
            step_no = k + 1
            if first or step_no % args.log_every == 0:  # the first step: compiled, on time
                flush()
            if first:
                self.timings["compile"] = getattr(fn, "compile_seconds", 0.0)
                self.timings["first_step"] = (time.perf_counter() - marks["called"]
                                              - self.timings["compile"])
                self.timings["total"] = time.time() - self.timings["start"]
                self._say(report.startup(self.timings), force=True, first_only=True)
            first = False
            every = args.checkpoint_every
            if every and step_no % every == 0 and step_no < args.steps:
                flush()
                self.heartbeat.set(phase="checkpoint")
                self._checkpoint(step_no, epoch, in_epoch, state, logs)
                self.heartbeat.set(phase="data", done=step_no)
        flush(last=True)
        loop_end = time.perf_counter()
        total = len(logs[self.local[0]].lines)
        if total > done and not args.no_checkpoint:
            self.heartbeat.set(phase="checkpoint", done=total)
            self._checkpoint(total, epoch, in_epoch, state, logs, final=True)
        waited = time.perf_counter()
        try:
            self.saver.wait()  # the exit waits for the last write
        except CheckpointWriteError as exc:
            raise RankError(str(exc)) from None
        waited = time.perf_counter() - waited
        self.heartbeat.set(phase="finish", done=total)
        if total > done and not args.no_checkpoint:
            self._say(f"the end of the run waited {waited:.2f} s for its last checkpoint",
                      force=True)
        elapsed = time.perf_counter() - start
        rate = ""
        steady = report.steady_ms()
        if steady is not None:  # the steady rate: without compiling
            rate = f" ({steady:.3f} ms/step after the first, median)"
        shared = " (the executable compiled by process 0)" if getattr(fn, "shared", False) else ""
        report.close()
        self._say(report.summary(total - done, done + 1, total, loop_end - start),
                  force=True, first_only=True)
        self._say(f"rank(s) {self.local[0]}..{self.local[-1]}: steps {done + 1}..{total} in "
                  f"{elapsed:.2f} s{rate}{shared}", force=True)
        return 0

    def _infer(self) -> int:
        from pcompile.backends.checkpoint import save_npz
        from pcompile.backends.jax.spmd import local_pieces

        state = self._initial_state()
        self.watchdog.arm(self.args.startup_timeout, "inference")
        self.heartbeat.set(phase="compute", done=0)
        _, _, arrays, first_row = next(iter(self._batches(1)))
        feeds = [self._put(name, {r: self._slice(name, a, r, first_row) for r in self.local},
                           shape)
                 for (name, _, shape, _), a in zip(self.inputs, arrays)]
        feeds += [state[name] for name, *_ in self.stored]
        outs = self._function()(*feeds)
        self.watchdog.disarm()
        # the step was traced in this process: _out_shapes holds its results' local shapes
        pieces = [local_pieces(o, self.mesh, shape) for o, shape in zip(outs, self._out_shapes)]
        for r in self.local:
            save_npz(os.path.join(self._rank_dir(r), "outputs.npz"),
                     {name: p[r] for name, p in zip(self.m.OUTPUTS, pieces)})
        self.heartbeat.set(phase="finish", done=1)
        self._say("inference outputs: " + ", ".join(
            f"{name} {tuple(p[self.local[0]].shape)}" for name, p in zip(self.m.OUTPUTS, pieces)),
            force=True)
        return 0

    def _say(self, text: str, force: bool = False, loss: bool = False,
             first_only: bool = False) -> None:
        """Print a line: loss lines (and `first_only` ones) only from process 0 (unless
        --all-ranks); other processes' lines carry `[rank r]` (r: their first rank)."""
        if self.args.quiet and not force:
            return
        first = self.local[0] == 0
        if first_only and not first and not self.args.all_ranks:
            return
        if loss and not first and not self.args.all_ranks:
            return
        print(("" if first else f"[rank {self.local[0]}] ") + text, flush=True)
