"""What a rank process writes about its run: `<rank dir>/train.log` (`TrainLog`) and, from
the process that runs rank 0, `<out>/metrics.jsonl`, TensorBoard event files, the start-up
line and the summary (`RankReport`; the numbers and their text come from
backends/run_report.py).
"""

from __future__ import annotations

import json
import os
from types import ModuleType
from typing import Any

import numpy as np

from pcompile.backends.jax.rank_process import RankError, write_error


def _rewrite(path: str, lines: list[str]) -> None:
    """`path` holding `lines`, written atomically; a full disk is one RankError naming it."""
    from pcompile.backends.atomic_files import atomic_write_text

    try:
        atomic_write_text(path, "".join(line + "\n" for line in lines))
    except OSError as exc:
        raise write_error(path, exc) from None


def _append(path: str, lines: list[str]) -> None:
    """Append `lines` to `path`; a full disk (or any failed write) is one RankError naming
    the file, not a traceback."""
    data = "".join(line + "\n" for line in lines).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while data:  # a write cut short by a filling disk: the rest fails with ENOSPC
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
    except OSError as exc:
        raise write_error(path, exc) from None


class TrainLog:
    """`<rank dir>/train.log`: rewritten atomically on (re)start, then one append per line."""

    def __init__(self, path: str, lines: list[str]) -> None:
        self.path = path
        self.lines = list(lines)
        _rewrite(path, self.lines)

    def add(self, line: str) -> None:
        self.lines.append(line)
        _append(self.path, [line])

class RankReport:
    """What this run reports (backends/run_report.py): the start-up line, `metrics.jsonl`
    (`<out>/metrics.jsonl`, written by the process that runs rank 0: one line for the first
    step, every `--log-every`-th and the last; a resumed run keeps the lines up to its step)
    and the summary."""

    def __init__(self, module: ModuleType, mesh: Any, out_dir: str, done: int, log_every: int,
                 writes: bool, tensorboard: str | None = None, run: str | None = None) -> None:
        from pcompile.backends import run_report

        self.rr = run_report
        self.done = done
        self.run = run  # each line's "run": readers tell two runs' lines apart
        self.log_every = max(1, log_every)
        self.ranks = int(module.NUM_RANKS)
        inputs = [(tuple(module.LAYOUTS[name][0]), dtype)
                  for name, kind, _, dtype in module.PARAMS if kind == "input"]
        self.unit, self.per_step = run_report.throughput_unit(
            inputs, getattr(module, "TOKENS_PER_STEP", None))
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
            except OSError as exc:  # a rank program started by hand: nobody checked it before
                raise RankError(f"--tensorboard {tensorboard}: cannot write there: "
                                f"{exc.strerror or exc}") from None
        if self.path is not None:
            _rewrite(self.path, self._kept(done))

    def _kept(self, done: int) -> list[str]:
        """A resumed run's earlier lines: those of the run it continues (the same run id),
        up to the step it resumes from."""
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
                record = json.loads(line)
                step, run = record.get("step"), record.get("run")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int) and step <= done and (self.run is None or run == self.run):
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
                                            self.unit, self.per_step, known, run=self.run)
            out.append(self.rr.metrics_line(record))
            if self.board is not None:
                for tag, value in self.rr.tensorboard_scalars(record).items():
                    self.board.add_scalar(tag, value, step)
        if self.board is not None:
            self.board.flush()
        if out:
            _append(self.path, out)

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
