"""The single-device program is the truth: run a parallel program's ranks on the numpy
simulator and the same model on one device, from the same initial values, and compare the loss,
and every updated parameter and optimizer state (or the gathered outputs, for inference).

**Precision.** By default both programs are evaluated in float64 (every float value, and every
Cast to a float type, computed in float64; `backends.numpy.interpreter`), so the check decides
whether the *plan* is right independently of the precision the model runs in (float32, bf16,
float16) and of the depth of the model. A correct plan differs from the single-device program
only in the order of floating-point additions (partial sums completed by an AllReduce, sliced
reductions). Reordering a sum of n terms changes it by at most n·u·Σ|terms| (u = 2^-53, the
float64 unit roundoff); with reductions of up to n = 2^20 terms and an amplification of at most
2^7 through the rest of the step (conditioning, an optimizer that normalises its update), a
correct plan stays within `FLOAT64_RTOL` = 2^-53 · 2^20 · 2^7 = 2^-26 ≈ 1.5e-8 of the scale
(largest magnitude) of every compared tensor. A wrong plan (a missing AllReduce, a wrong slice)
is off by whole terms: orders of magnitude more. Correct plans measure ~1e-15."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pcompile.compiler.driver import CompiledProgram, compile
from pcompile.compiler.runtime import ParallelRunner, StandAloneRunner, batches

#: Relative bound for a correct plan evaluated in float64 (derivation in the module docstring).
FLOAT64_RTOL = 2.0 ** -26

#: The CLI checks a plan when the check holds at most this much (`check_cost`).
CHECK_BUDGET_BYTES = 1 << 30


def low_precision_bound(program: CompiledProgram) -> tuple[str | None, float]:
    """The lowest float precision the step computes in, when below float32, and the relative
    difference its rounding explains between two orders of evaluation: eps of the dtype times
    the longest reduction (the largest dim of any value, which bounds every contraction)."""
    import ml_dtypes

    from pcompile.ir.types import DType

    lowest: DType | None = None
    longest = 1
    for node in program.graph.nodes:
        types = getattr(node.result.type, "elements", None) or (node.result.type,)
        for value_type in (*types, *(v.type for v in node.operands)):
            if not hasattr(value_type, "dtype"):
                continue
            longest = max([longest, *value_type.shape])
            if value_type.dtype in (DType.float16, DType.bfloat16) and (
                    lowest is None or value_type.dtype.itemsize <= lowest.itemsize):
                lowest = value_type.dtype
    if lowest is None:
        return None, 0.0
    return lowest.value, float(ml_dtypes.finfo(lowest.np).eps) * longest


def check_cost(program: CompiledProgram) -> int:
    """Bytes the float64 check holds at most: the simulator keeps every value of every rank's
    step (parameters, optimizer state, every node's result) and the single-device program's,
    8 bytes per element. The CLI runs the check by default when this is at most
    `CHECK_BUDGET_BYTES` (a toy GPT on 8 devices: a few MB; a 7B model: terabytes)."""
    state = program.state
    local = 0
    for graph in state.graphs or [program.graph]:
        copies = sum(1 for g in state.rank_graphs if g is graph) or 1  # ranks running it
        elements = sum(p.tensor_type.size for p in graph.params)
        for node in graph.nodes:
            types = getattr(node.result.type, "elements", None) or (node.result.type,)
            elements += sum(t.size for t in types)
        local += elements * copies
    single = sum(s.size for s in (state.initial_values.source(n)
                                  for n in state.initial_values))
    for node in program.graph.nodes:
        types = getattr(node.result.type, "elements", None) or (node.result.type,)
        single += 3 * sum(t.size for t in types)  # forward, backward and the update
    return 8 * (local + single)


@dataclass
class OracleReport:
    """Per-step losses of both programs and the worst relative error of each value."""

    losses: list[tuple[float, float]] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)
    float64: bool = False

    @property
    def worst(self) -> tuple[str, float]:
        if not self.errors:
            return ("", 0.0)
        name = max(self.errors, key=lambda k: self.errors[k])
        return name, self.errors[name]

    params: set[str] = field(default_factory=set)

    @property
    def bound(self) -> float:
        """The derived bound of this report's precision (float64: `FLOAT64_RTOL`)."""
        return FLOAT64_RTOL if self.float64 else 1e-5

    def ok(self, rtol: float | None = None, param_rtol: float | None = None) -> bool:
        """Loss and optimizer state (which carries the gradients) within `rtol` (default: the
        derived `bound`); updated parameters within `param_rtol` (default `rtol`)."""
        if rtol is None:
            rtol = self.bound
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
          reference: CompiledProgram | None = None, float64: bool = True) -> OracleReport:
    """Run `steps` steps of the parallel program (all ranks, numpy simulator) and of the
    single-device program from the same initial values; `float64`: evaluate both in float64
    (the default; see the module docstring), else in the graphs' own dtypes."""
    ref = reference or single_device(program)
    par = ParallelRunner(program, float64=float64)
    one = StandAloneRunner(ref, "numpy", float64=float64)
    for name in one.values:
        if name in program.initial_values:
            value = np.array(program.initial_values[name], copy=True)
            one.values[name] = value.astype(one.values[name].dtype)
    report = OracleReport(float64=float64)
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
