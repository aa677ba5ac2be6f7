"""`pcompile --run`: what is checked before the compile writes anything (`prepare_run`, which
resolves the `RunOptions` the CLI built from its flags: backends/run_options.py), and where the
steps run (`train`): the generated rank programs launched one process per rank
(backends/launcher.py `run_launched`), a one-device rank program in this process
(backends/jax/in_process.py `train_in_process`), or this process's runners (the numpy
simulator, one device on JAX: tools/runners.py).

Everything said goes through `echo(text, err=False)` (the CLI passes `click.echo`); a refusal
is a `PcompileError` (one message); `train` returns the exit status of the run."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pcompile.backends.run_options import RunOptions
from pcompile.ir.errors import PcompileError
from pcompile.program.progress import run_monitor

__all__ = ["RunOptions", "check_tensorboard", "prepare_run", "refuse_under_a_launcher", "train",
           "train_here"]

if TYPE_CHECKING:
    from pcompile.compiler.driver.compiled import CompiledProgram, CompileState

Echo = Callable[..., None]


def refuse_under_a_launcher() -> None:
    """`pcompile --run` starts every rank itself: inside a job of several processes (torchrun,
    msrun, mpirun, srun, ...) each process would run all of them."""
    from pcompile.backends.cluster import IdentityError, resolve_identity

    try:
        identity = resolve_identity(None, None, None, dict(os.environ))
    except IdentityError as exc:
        raise PcompileError(f"pcompile --run starts its own rank processes, and this environment"
                            f" describes a multi-process job it cannot use: {exc}") from None
    if identity.num_processes > 1 or identity.scheduler:
        n = identity.num_processes
        raise PcompileError(
            f"pcompile --run starts its own rank processes, but this process is one of "
            f"{n} started by {identity.source}: together they would run {n} times every "
            "rank. Compile once (pcompile MODEL.py --out DIR ...), then start the rank "
            "programs with your launcher, e.g. `torchrun --nproc-per-node "
            f"{n} DIR/rank_0/program.py --steps N` (docs/running.md, 'Without the "
            "launcher')")


def check_tensorboard(folder: str) -> None:
    """--tensorboard DIR, before the compile: tensorboardX installed, DIR a folder rank 0 can
    create or write in (else one message now, not a rank's traceback after start-up)."""
    import importlib.util

    from pcompile.backends.run_report import TENSORBOARD_MISSING
    from pcompile.compiler.driver.outdir import check_writable_folder

    check_writable_folder(folder, "--tensorboard")
    if importlib.util.find_spec("tensorboardX") is None:
        raise PcompileError(TENSORBOARD_MISSING)


def prepare_run(state: CompileState, out_dir: str | None, options: RunOptions,
                held: ExitStack) -> RunOptions:
    """--run's options against the compiled program, before anything is written; takes the
    lock of --out for the rest of the command (`held`). Returns the options resolved."""
    from pcompile.backends.checkpoint import resume_point
    from pcompile.backends.placement import assign_devices, resolve_platform
    from pcompile.compiler.driver.outdir import out_lock

    if options.backend == "jax":
        platform, gpus = resolve_platform(options.platform or "auto")
        options = replace(options, resolved_platform=platform, gpus=gpus)
        if platform == "gpu":  # too few GPUs: refused before anything is written or started
            assign_devices(options.processes or state.devices, state.devices, gpus)
    launched = options.launched(state.parallel) and options.backend == "jax"
    if (options.resume or options.checkpoint_every
            or options.tensorboard or options.profile_steps) and not launched:
        raise PcompileError("--resume, --checkpoint-every, --tensorboard and --profile-steps "
                            "need the JAX rank programs; drop --backend numpy")
    options = _with_callbacks(state, options, launched)
    n = state.devices
    procs = options.processes
    if procs and launched and n % procs:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise PcompileError(f"--processes {procs} cannot share {n} ranks evenly; choose one of "
                            f"{', '.join(map(str, divisors))}")
    if out_dir is None:
        if launched:
            raise PcompileError("--run on JAX needs the rank programs: do not disable dumps")
        return options
    held.enter_context(out_lock(out_dir))
    if options.resume:
        folder = os.path.join(out_dir, "checkpoints")
        point = resume_point(folder, n)
        if point.step is None:
            why = "".join(f"\n  {line}" for line in point.skipped)
            raise PcompileError(f"--resume: no step has an intact checkpoint of every rank in "
                                f"{folder}{why or ' (there is none)'}; run without --resume to "
                                "start afresh")
        if point.step > options.steps:
            raise PcompileError(f"--resume: the checkpoint is at step {point.step}, beyond "
                                f"--steps {options.steps}; ask for at least {point.step} "
                                "steps")
        options = replace(options, resume_step=point.step)
    return options


def _with_callbacks(state: CompileState, options: RunOptions, launched: bool) -> RunOptions:
    """The options the model file's built-in callbacks set (`callbacks()`: LossMonitor's
    per_print_times, and for the JAX rank programs ModelCheckpoint's save_checkpoint_steps and
    keep_checkpoint_max; compiler/frontend/callbacks.py `run_settings`), where the command line left
    them at their defaults. The rank programs call the callbacks themselves."""
    from pcompile.compiler.frontend.callbacks import checked_callbacks, run_settings
    from pcompile.compiler.frontend.model_file import call_user

    model_file = state.model_file
    make = model_file.callbacks
    if make is None:
        return options
    settings = run_settings(checked_callbacks(call_user(make, "callbacks()", model_file.path),
                                              model_file.path))
    changes: dict[str, Any] = {}
    if settings.get("print_every") and options.print_every == RunOptions.print_every:
        changes["print_every"] = settings["print_every"]
    if options.backend == "jax" and (launched or state.devices == 1):
        if settings.get("checkpoint_every") and not options.checkpoint_every:
            changes["checkpoint_every"] = settings["checkpoint_every"]
        if settings.get("keep_checkpoint_max") and options.keep_checkpoint_max is None:
            changes["keep_checkpoint_max"] = settings["keep_checkpoint_max"]
    return replace(options, **changes) if changes else options


def train(program: CompiledProgram, options: RunOptions, echo: Echo) -> int:
    """Run `options.steps` steps of the compiled program (inference: one), where the options
    say; the run's exit status (a launched run's)."""
    rank_program = _one_rank_program(program, options)
    if rank_program is not None and program.out_dir is not None:
        from pcompile.backends.jax.in_process import train_in_process

        train_in_process(rank_program, program.out_dir, options, echo)
        return 0
    if options.launched(program.state.parallel) and options.backend == "jax":
        return _launch(program, options, echo)
    monitor = run_monitor(options.steps, options.print_every or 1, echo)
    try:
        train_here(program, options, monitor, echo)
    finally:
        monitor.close()
    return 0


def _one_rank_program(program: CompiledProgram, options: RunOptions) -> str | None:
    """The generated `DIR/program.py` that trains a one-device plan on JAX's CPU in this
    process (None: inference, the numpy backend, a parallel plan, a GPU, or no rank program
    written)."""
    if options.backend != "jax" or not program.training or program.state.parallel:
        return None
    if options.resolved_platform == "gpu":  # the GPU belongs to a rank process
        return None
    if not program.out_dir or program.state.pipelined:
        return None
    path = os.path.join(program.out_dir, "program.py")
    return path if os.path.isfile(path) else None


class _NonFiniteLossError(Exception):
    """A non-finite loss (its message) ends the loop."""


def train_here(program: CompiledProgram, options: RunOptions, monitor: Any, echo: Echo) -> None:
    """--run in this process: the numpy simulator, or one device on JAX. `monitor(line)` shows
    each loss line; `monitor.close()` ends the display before the summary."""
    from pcompile.compiler.driver.runtime import batches
    from pcompile.program.progress import ReadBack, format_loss_line
    from pcompile.tools.runners import StandAloneRunner

    steps, backend = options.steps, options.backend
    if program.state.parallel:
        _train_simulated(program, steps, options.fail_on_nan, monitor, echo)
        return
    runner = StandAloneRunner(program, backend,
                              matmul_precision=options.matmul_precision or None)
    if not program.training:
        _, _, arrays = next(batches(program, 1))
        outs = runner.run(arrays)
        echo("inference: " + ", ".join(f"{n} {tuple(o.shape)}" for n, o in
                                       zip(program.output_names, outs)))
        return
    lines: list[str] = []
    start = time.perf_counter()

    def read(ready: list[tuple[int, int, int, Any]], last: bool) -> None:
        for k, epoch, step, loss in ready:
            value = float(loss)
            line = format_loss_line(epoch, step, value)
            lines.append(line)
            monitor(line)
            if options.fail_on_nan and not math.isfinite(value):
                raise _NonFiniteLossError(_nonfinite(value, k + 1, epoch, step))

    # losses still on the device: each --log-every group is read back (one wait) once the step
    # after it is on its way, and the rest at the end
    pending = ReadBack(options.log_every or 1, read)
    bad = None
    try:
        for k, (epoch, step, arrays) in enumerate(batches(program, steps)):
            pending.dispatched((k, epoch, step, runner.step_async(arrays)), k + 1)
        pending.flush(last=True)
    except _NonFiniteLossError as exc:
        bad = str(exc)
    elapsed = time.perf_counter() - start
    monitor.close()  # the bar's last state, then the summary under it
    log = _write_logs(program, lines, 1)
    if bad:
        raise PcompileError(bad)
    if log:
        echo(f"{steps} steps in {elapsed:.2f} s on {backend}; log: {log}")


def _launch(program: CompiledProgram, options: RunOptions, echo: Echo) -> int:
    """Train with the generated rank programs, one process per rank (backends/launcher.py)."""
    from pcompile.backends.launcher import LaunchError, run_launched

    if not program.out_dir:
        raise PcompileError("--run on JAX needs the rank programs: do not disable dumps")
    try:
        return run_launched(program.out_dir, program.state.devices, program.training, options,
                            echo)
    except LaunchError as exc:
        raise PcompileError(str(exc)) from None


def _nonfinite(loss: float, step_no: int, epoch: int, in_epoch: int) -> str:
    return (f"the loss is {loss} at step {step_no} (epoch {epoch}, step {in_epoch}); stopped "
            "(--no-fail-on-nan trains on)")


def _write_logs(program: CompiledProgram, lines: list[str], ranks: int) -> str | None:
    """Every rank's train.log (run outputs: kept across recompiles); rank 0's path."""
    if not program.out_dir:
        return None
    from pcompile.backends.checkpoint import atomic_write_text

    for r in range(ranks):
        atomic_write_text(os.path.join(program.out_dir, f"rank_{r}", "train.log"),
                          "\n".join(lines) + "\n" if lines else "")
    return os.path.join(program.out_dir, "rank_0", "train.log")


def _train_simulated(program: CompiledProgram, steps: int, fail_on_nan: bool, monitor: Any,
                     echo: Echo) -> None:
    """--backend numpy for a parallel plan: every rank on the numpy simulator, one process."""
    from pcompile.compiler.driver.runtime import batches
    from pcompile.program.progress import format_loss_line
    from pcompile.tools.oracle import single_device
    from pcompile.tools.runners import ParallelRunner

    runner = ParallelRunner(program)
    data = program if program.state.parallel_mode != "data_parallel" else single_device(program)
    if not program.training:
        _, _, arrays = next(batches(data, 1))
        outs = runner.run(arrays)
        echo("inference (rank 0): " + ", ".join(
            f"{n} {tuple(o.shape)}" for n, o in zip(program.output_names, outs[0])))
        return
    lines: list[str] = []
    bad = None
    for k, (epoch, step, arrays) in enumerate(batches(data, steps)):
        loss = runner.step(arrays)
        lines.append(format_loss_line(epoch, step, loss))
        monitor(lines[-1])
        if fail_on_nan and not math.isfinite(float(loss)):
            bad = _nonfinite(float(loss), k + 1, epoch, step)
            break
    monitor.close()
    if _write_logs(program, lines, program.state.devices):
        echo(f"{len(lines)} steps on the numpy simulator; logs: "
             f"{program.out_dir}/rank_*/train.log")
    if bad:
        raise PcompileError(bad)
