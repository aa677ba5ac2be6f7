"""The single-device program is the truth: run a parallel program's ranks on the numpy
simulator and the same model on one device, from the same initial values, and compare the loss,
and every updated parameter and optimizer state (or the gathered outputs, for inference)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pcompile.compiler.driver import CompiledProgram, compile
from pcompile.compiler.runtime import ParallelRunner, StandAloneRunner, batches


@dataclass
class OracleReport:
    """Per-step losses of both programs and the worst relative error of each value."""

    losses: list[tuple[float, float]] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> tuple[str, float]:
        if not self.errors:
            return ("", 0.0)
        name = max(self.errors, key=lambda k: self.errors[k])
        return name, self.errors[name]

    params: set[str] = field(default_factory=set)

    def ok(self, rtol: float = 1e-5, param_rtol: float | None = None) -> bool:
        """Loss and optimizer state (which carries the gradients) within `rtol`; updated
        parameters within `param_rtol` (default `rtol`). Adam-type updates divide by
        sqrt(v) + eps and so magnify last-bit differences of near-zero gradients: give them
        a looser `param_rtol`."""
        loss_ok = all(abs(a - b) <= rtol * max(1.0, abs(b)) for a, b in self.losses)
        limit = rtol if param_rtol is None else param_rtol
        return loss_ok and all(
            err <= (limit if name in self.params else rtol) for name, err in self.errors.items()
        )


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
    return float(np.max(np.abs(got - want))) / scale if want.size else 0.0


def single_device(program: CompiledProgram) -> CompiledProgram:
    """The same model file compiled for one device (no dumps)."""
    return compile(program.state.model_file.path, devices=1, dump=False)


def check(program: CompiledProgram, steps: int = 1,
          reference: CompiledProgram | None = None) -> OracleReport:
    ref = reference or single_device(program)
    par = ParallelRunner(program)
    one = StandAloneRunner(ref, "numpy")
    for name in one.values:
        if name in program.initial_values:
            one.values[name] = np.array(program.initial_values[name], copy=True)
    report = OracleReport()
    for _, _, arrays in batches(ref, steps):
        if program.training:
            report.losses.append((par.step(arrays), one.step(arrays)))
        else:
            outs = par.run(arrays)
            want = one.run(arrays)
            layouts = program.state.output_layouts
            for i, (w, layout) in enumerate(zip(want, layouts)):
                got = gather(outs, i, layout, w)
                report.errors[f"output{i}"] = relative_error(got, w)
            return report
    report.params = {p.name for p in ref.graph.weights}
    for name, value in one.values.items():
        report.errors[name] = relative_error(par.global_value(name), value)
    return report


def gather(outs: list[list[np.ndarray]], index: int, layout, like: np.ndarray) -> np.ndarray:
    """Reassemble output `index` from every rank's slice."""
    if layout is None or not like.shape:
        return outs[0][index]
    full = np.zeros(layout.shape, like.dtype)
    for rank, rank_outs in enumerate(outs):
        full[tuple(slice(b, e) for b, e in layout.slice_bounds(rank))] = rank_outs[index]
    return full
