"""A one-rank program run in this process: `pcompile --run` on one device trains with the
generated `DIR/program.py` as the launcher's rank processes do (backends/jax/rank_loop.py), so
it writes the same outputs (`rank_0/train.log`, `metrics.jsonl`, the checkpoint at the end,
the start-up line and the summary), without starting a process and importing JAX again.

The program's lines (what a rank process prints) go, one by one, to `echo` (the command
line's one display of the steps). The run gets its own run id (`PCOMPILE_RUN_ID`, as the
launcher gives each run), and the watchdog is disarmed when it ends: this process goes on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from pcompile.backends.jax.rank_loop import RUN_ID_ENV, RankRunner
from pcompile.backends.jax.rank_process import (
    Heartbeat,
    NonFiniteLossError,
    RankError,
    Watchdog,
    parse_args,
)
from pcompile.backends.run_options import RunOptions
from pcompile.ir.errors import PcompileError
from pcompile.program.progress import log as progress_log


class RankRunError(PcompileError):
    """The in-process run stopped: the rank program's one-line message."""


class _Lines(io.TextIOBase):
    """A text stream that hands each complete line to `echo` (with stdout restored, so that
    `echo` may print)."""

    def __init__(self, echo: Callable[[str], None], real: Any) -> None:
        super().__init__()
        self.echo, self.real, self.pending = echo, real, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            with contextlib.redirect_stdout(self.real):
                self.echo(line)
        return len(text)

    def close_lines(self) -> None:
        if self.pending:
            line, self.pending = self.pending, ""
            with contextlib.redirect_stdout(self.real):
                self.echo(line)


def load_program(path: str) -> Any:
    """The generated program at `path`, imported as a module (its `__main__` block not run)."""
    name = f"pcompile_rank_program_{secrets.token_hex(4)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RankRunError(f"{path}: not a rank program")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _run_id() -> Iterator[str]:
    """A fresh run id in PCOMPILE_RUN_ID for the duration (the launcher names each run so)."""
    run, before = secrets.token_hex(8), os.environ.get(RUN_ID_ENV)
    os.environ[RUN_ID_ENV] = run
    try:
        yield run
    finally:
        if before is None:
            os.environ.pop(RUN_ID_ENV, None)
        else:
            os.environ[RUN_ID_ENV] = before


def run_in_process(path: str, argv: list[str], echo: Callable[[str], None]) -> int:
    """Run the one-rank program `path` (`DIR/program.py`) with the options `argv` (those of
    program.py) in this process; returns the number of steps trained in all. A failure (a
    non-finite loss, a data mistake, a checkpoint that cannot be written) raises RankRunError
    with the program's one-line message."""
    import jax

    from pcompile.backends.jax.plan import MeshSpec
    from pcompile.backends.jax.spmd import make_mesh, rank_devices

    started = time.time()
    module = load_program(path)
    if int(module.NUM_RANKS) != 1:
        raise RankRunError(f"{path} has {module.NUM_RANKS} ranks; only a one-rank program runs "
                           "in this process (pcompile --run launches the others)")
    args = parse_args(argv, 1)
    module.LABEL = "pcompile rank 0"
    out_dir = os.path.dirname(os.path.abspath(path))
    spec = MeshSpec(tuple(n for n, _ in module.MESH), tuple(s for _, s in module.MESH))
    mesh = make_mesh(spec, rank_devices(1))
    watchdog = Watchdog(module.LABEL)
    lines = _Lines(echo, sys.stdout)
    precision = (jax.default_matmul_precision(args.matmul_precision)
                 if args.matmul_precision != "default" else contextlib.nullcontext())
    # the rank's own monitor logs its step rate at INFO; the caller's display shows the steps
    level = progress_log.level
    progress_log.setLevel(max(level, logging.WARNING))
    try:
        with _run_id(), precision, contextlib.redirect_stdout(lines):
            watchdog.arm(args.startup_timeout, "start-up")
            runner = RankRunner(module, mesh, [0], out_dir, args, watchdog, Heartbeat(),
                                {"start": started})
            runner.run()
    except (RankError, NonFiniteLossError) as exc:
        raise RankRunError(str(exc)) from None
    finally:
        watchdog.disarm()
        progress_log.setLevel(level)
        lines.close_lines()
    log = os.path.join(out_dir, "rank_0", "train.log")
    with open(log, encoding="utf-8") as f:
        return sum(1 for _ in f)


def train_in_process(path: str, out_dir: str, options: RunOptions,
                     echo: Callable[..., None]) -> None:
    """`pcompile --run` on one device: the rank program `path` trains in this process, writing
    what a launched run writes: train.log, metrics.jsonl, the checkpoints (at the end, every
    --checkpoint-every), the time to first step and the summary; --resume, --tensorboard and
    --profile-steps as the rank program takes them. A failure is a RankRunError."""
    from pcompile.program.progress import run_monitor

    steps = options.steps
    # every loss line goes to `echo`, whose display keeps every --print-every-th
    argv = ["--steps", str(steps), "--platform", "cpu", *options.rank_flags(),
            "--fail-on-nan" if options.fail_on_nan else "--no-fail-on-nan", "--print-every", "1"]
    if options.checkpoint_every:
        argv += ["--checkpoint-every", str(options.checkpoint_every)]
    if options.resume:
        argv += ["--resume"]  # the program picks the newest intact step of its own plan
    monitor = run_monitor(steps, options.print_every or 1, echo, done=options.resume_step)
    start = time.perf_counter()
    try:
        trained = run_in_process(path, argv, monitor)
    finally:
        monitor.close()
    done = options.resume_step if options.resume else 0
    text = f"{trained - done} step{'s' if trained - done != 1 else ''}"
    if done:
        text += f" (steps {done + 1}..{trained}, resumed from step {done})"
    echo(f"{text} in "
         f"{time.perf_counter() - start:.2f} s on jax (1 device, in this process); log: "
         f"{os.path.join(out_dir, 'rank_0', 'train.log')}; checkpoints: "
         f"{os.path.join(out_dir, 'checkpoints')}")
