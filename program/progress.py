"""Progress and logging of the command line and the rank programs, through the `logging`
module (logger `pcompile`), and the loss lines of a run (`format_loss_line`, `ReadBack`).

Standard library only (rich on a terminal): the rank programs print their losses without
loading the front end (`pcompile.compiler`) or pydantic.

* Where: stderr, so that stdout keeps the results (summary, losses) for pipes and scripts.
* When: progress (INFO) is shown when stderr is a terminal, or with `-v`; `-q` keeps only
  warnings and errors; `-vv` adds DEBUG.
* Warnings once: a message logged again (e.g. by each rank's graph of a hybrid compile) is
  dropped (`OnceFilter`); Python warnings go through the same handler.
* Compiles: `CompileProgress` is the driver's `on_event` hook (pass by pass, the outputs
  written, elapsed time). Runs: one display of the steps, chosen by `run_monitor`. On a
  terminal (stderr, where progress goes, and progress not silenced by `-q`) a
  `RichLossMonitor`: one rich progress bar (steps done, last loss, step rate, elapsed time,
  time left) with the printed loss lines and log messages scrolling above it, and no other
  line per step. Elsewhere a `LossMonitor`: every K-th loss line (MindSpore's
  `LossMonitor(per_print_times)`) and, at INFO (`-v`), a line with the step rate and the time
  left.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger("pcompile")

T = TypeVar("T")

LOSS_LINE = re.compile(r"^epoch: \d+ step: \d+, loss is ")


class OnceFilter(logging.Filter):
    """Drops a record whose (level, text) was already emitted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def setup_logging(verbose: int = 0, quiet: bool = False, stream: Any = None,
                  prefix: str = "") -> int:
    """Configure logger `pcompile` for this command; returns the level chosen. `prefix` goes
    before every message (a rank program's `[rank r] ` when it is not process 0)."""
    stream = stream or sys.stderr
    if quiet:
        level = logging.WARNING
    elif verbose >= 2:
        level = logging.DEBUG
    elif verbose == 1 or _isatty(stream):
        level = logging.INFO
    else:
        level = logging.WARNING  # not a terminal: quiet unless asked
    for handler in list(log.handlers):
        if getattr(handler, "_pcompile", False):
            log.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler._pcompile = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "pcompile: %(message)s"))
    handler.addFilter(OnceFilter())
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    logging.captureWarnings(True)
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.handlers = [handler]
    warnings_log.propagate = False
    return level


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class CompileProgress:
    """The driver's `on_event` hook: one line per pass, and around the writing of `--out`."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self.writing = 0.0

    def elapsed(self) -> str:
        return f"[{time.perf_counter() - self.start:7.2f} s]"

    def __call__(self, event: str, **info: Any) -> None:
        if event == "pass":
            log.info("%s pass %d/%d %s done in %.3f s", self.elapsed(), info["index"] + 1,
                     info["total"], info["name"], info["seconds"])
        elif event == "write":
            self.writing = time.perf_counter()
            log.info("%s writing %s: dumps of %d rank(s), plan.json, rank programs",
                     self.elapsed(), info["out_dir"], info["ranks"])
        elif event == "written":
            log.info("%s wrote %s in %.2f s", self.elapsed(), info["out_dir"],
                     time.perf_counter() - self.writing)


class LossMonitor:
    """Prints loss lines every `per_print` steps (and always the last one, and every line that
    is not a loss line), and logs the step rate and the time left at INFO."""

    def __init__(self, steps: int, per_print: int = 1,
                 echo: Callable[[str], None] = print, done: int = 0) -> None:
        self.steps = steps
        self.per_print = max(1, per_print)
        self.echo = echo
        self.seen = done
        self.start = time.perf_counter()
        self.first: int | None = None

    def __call__(self, line: str) -> None:
        if not LOSS_LINE.match(line):
            self.echo(line)
            return
        self.seen += 1
        now = time.perf_counter()
        if self.first is None:  # the first step compiles: measure the rate from the next
            self.first = self.seen
            self.start = now
        rate = (self.seen - self.first) / (now - self.start) if now > self.start else 0.0
        printed = self.seen % self.per_print == 0 or self.seen >= self.steps
        if printed:
            self.echo(line)
        self.progress(line, rate, printed)

    def progress(self, line: str, rate: float, printed: bool) -> None:
        """The step rate and the time left, logged (INFO) with each printed loss line."""
        if not printed:
            return
        if rate > 0:
            left = max(0, self.steps - self.seen) / rate
            log.info("step %d/%d, %.2f steps/s, about %s left", self.seen, self.steps, rate,
                     _duration(left))
        else:
            log.info("step %d/%d", self.seen, self.steps)

    def close(self) -> None:
        """Nothing to undo (a RichLossMonitor stops its bar)."""


class RichLossMonitor(LossMonitor):
    """A LossMonitor for a terminal, and the only display of the steps there: one rich progress
    bar on `console` (default stderr: steps done of all, the last loss, the step rate, elapsed
    time and time left), redrawn at every step, no log line per step. The loss lines it prints
    (through `echo`, default the console) and the messages logged meanwhile scroll above the
    bar, which starts with the first loss line and stays on the screen when the run ends."""

    def __init__(self, steps: int, per_print: int = 1, done: int = 0,
                 console: Any = None, echo: Callable[[str], None] | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True, highlight=False)
        super().__init__(steps, per_print, echo or self._print, done)
        self.bar: Any = None
        self.task: Any = None
        self.streams: list[tuple[logging.StreamHandler[Any], Any]] = []

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def progress(self, line: str, rate: float, printed: bool) -> None:
        if self.bar is None:
            self._start()
        self.bar.update(self.task, completed=min(self.seen, self.steps),
                        loss=line.rpartition(" ")[2],
                        rate=f"{rate:.2f} steps/s" if rate > 0 else "", refresh=True)

    def _start(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
            console=self.console, redirect_stdout=self.echo == self._print)
        self.bar.start()
        self.task = self.bar.add_task("train", total=self.steps, completed=self.seen - 1,
                                      loss="", rate="")
        # Messages logged while the bar is up go through rich's proxy of stderr (set by
        # start()), which prints them above the bar instead of into it.
        for handler in log.handlers + logging.getLogger("py.warnings").handlers:
            if (isinstance(handler, logging.StreamHandler) and _isatty(handler.stream)
                    and handler.stream is not sys.stderr
                    and all(handler is not h for h, _ in self.streams)):
                self.streams.append((handler, handler.stream))
                handler.setStream(sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        for handler, stream in self.streams:
            handler.setStream(stream)
        self.streams = []


def run_monitor(steps: int, per_print: int = 1, echo: Callable[[str], None] = print,
                done: int = 0, stream: Any = None, err: Any = None) -> LossMonitor:
    """The one display of a run's steps. A terminal on stderr `err`, with progress shown (not
    `-q`): a RichLossMonitor, its bar on stderr, the loss lines above it (through `echo` when
    stdout `stream` is not a terminal: a file or a pipe gets plain lines). Else plain lines
    through `echo` (LossMonitor), the step rate logged at INFO (`-v`)."""
    if _isatty(err or sys.stderr) and log.isEnabledFor(logging.INFO):
        return RichLossMonitor(steps, per_print, done,
                               echo=None if _isatty(stream or sys.stdout) else echo)
    return LossMonitor(steps, per_print, echo, done)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def format_loss_line(epoch: int, step: int, loss: float) -> str:
    return f"epoch: {epoch} step: {step}, loss is {loss!r}"


IN_FLIGHT = 8  # the most steps a training loop leaves unfinished on a device (ReadBack)


class ReadBack(Generic[T]):
    """The steps handed to a device whose results (losses) the host has not read yet.

    A training loop calls `dispatched(item, step_no)` right after each step's call returns
    (the step runs asynchronously). Every `every` steps the group so far is read back (one
    wait for all of them), but only once the step after the group has been dispatched: the
    device then never waits while the host reads back, cuts the next batch and dispatches.
    `first_at_once` reads the first step at once (the time to first step is measured on it).
    `flush()` reads everything (before a checkpoint, at the end of the run). `read(items,
    last)` gets each group in step order; `last` is True for the final flush; an exception it
    raises (a non-finite loss) leaves the loop.

    `wait(item)`, when given, blocks until that step has run (without reading it back): no
    more than `depth` steps are ever left unfinished on the device, however long the groups.
    XLA's CPU client lets a device queue only 32 computations; past that, a process that
    drives several devices blocks its dispatch threads while the queued steps' collectives
    wait for them (a deadlock with `--log-every` 40 and two ranks per process)."""

    def __init__(self, every: int, read: Callable[[list[T], bool], None],
                 first_at_once: bool = False, wait: Callable[[T], None] | None = None,
                 depth: int = IN_FLIGHT) -> None:
        self.every = max(1, int(every))
        self.read = read
        self.first_at_once = first_at_once
        self.wait = wait
        self.depth = max(1, int(depth))
        self.pending: list[T] = []
        self._finished = 0  # how many of `pending`, from the oldest, have run (waited for)
        self._due = False  # a --log-every mark passed: read once the next step is dispatched
        self._started = False

    def dispatched(self, item: T, step_no: int) -> None:
        """Step `step_no` (1-based, counted over the whole run) was just dispatched."""
        self.pending.append(item)
        if not self._started:
            self._started = True
            if self.first_at_once:
                self.flush()
                return
        elif self._due:
            self.flush(keep=1)
        self._due = step_no % self.every == 0
        if self.wait is not None:
            while len(self.pending) - self._finished > self.depth:
                self.wait(self.pending[self._finished])
                self._finished += 1

    def flush(self, keep: int = 0, last: bool = False) -> None:
        """Read the pending steps back but the newest `keep`."""
        ready = self.pending[:len(self.pending) - keep]
        if not ready:
            return
        del self.pending[:len(ready)]
        self._finished = max(0, self._finished - len(ready))
        self.read(ready, last)
