"""The single-device program is the truth: run a parallel program's ranks on the numpy
simulator and the same model on one device, from the same initial values, and compare the loss,
and every updated parameter and optimizer state (or the gathered outputs, for inference).

**Precision.** By default both programs are evaluated in float64 (every float value, and every
Cast to a float type, computed in float64; `ir.interpret`), so the check decides
whether the *plan* is right independently of the precision the model runs in (float32, bf16,
float16) and of the depth of the model. A correct plan differs from the single-device program
only in the order of floating-point additions (partial sums completed by an AllReduce, sliced
reductions). Reordering a sum of n terms changes it by at most n·u·Σ|terms| (u = 2^-53, the
float64 unit roundoff); with reductions of up to n = 2^20 terms and an amplification of at most
2^7 through the rest of the step (conditioning, an optimizer that normalises its update), a
correct plan stays within `FLOAT64_RTOL` = 2^-53 · 2^20 · 2^7 = 2^-26 ≈ 1.5e-8 of the scale
(largest magnitude) of every compared tensor. A wrong plan (a missing AllReduce, a wrong slice)
is off by whole terms: orders of magnitude more. Correct plans measure ~1e-15.

**Finite data.** NaN matches NaN and an infinity the same infinity (a step that overflows in
both programs agrees), so a reference whose loss, values or outputs are not finite cannot tell
a right plan from a wrong one there. `check` runs with numpy's floating-point warnings off and
records instead which inputs and which compared results are not finite
(`OracleReport.nonfinite_inputs`, `nonfinite_results`); `inconclusive_message` is the one
message a caller (the CLI) gives when nothing was verified."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import DTypeLike

from pcompile.compiler.driver.compiled import CompiledProgram, ReferenceOptions
from pcompile.compiler.driver.driver import compile_program
from pcompile.compiler.driver.runtime import RankLocal, batches, rank_local_reductions
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, NodeResult, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import TensorType, TupleType, ValueType
from pcompile.tools.runners import ParallelRunner, StandAloneRunner

#: Relative bound for a correct plan evaluated in float64 (derivation in the module docstring).
FLOAT64_RTOL = 2.0 ** -26

#: The CLI checks a plan when the check holds at most this much (`check_cost`).
CHECK_BUDGET_BYTES = 1 << 30


#: How much the rest of a training step may amplify a rounding difference (module docstring).
AMPLIFICATION = 2.0 ** 7


def longest_reduction(program: CompiledProgram) -> int:
    """The largest dim of any value of the step: it bounds the length of every contraction
    and reduction."""
    longest = 1
    for node in program.graph.nodes:
        types = getattr(node.result.type, "elements", None) or (node.result.type,)
        for value_type in (*types, *(v.type for v in node.operands)):
            if hasattr(value_type, "shape"):
                longest = max([longest, *value_type.shape])
    return longest


def rounding_rtol(program: CompiledProgram, dtype: DTypeLike = np.float32, steps: int = 1
                  ) -> float:
    """The relative difference two correct evaluations of `steps` training steps in `dtype`
    may show (a parallel run against one device, or two backends): the dtype's unit roundoff
    times the longest reduction times `AMPLIFICATION`, per step (the same derivation as
    `FLOAT64_RTOL`, with this model's own reduction length)."""
    unit = float(np.finfo(np.dtype(dtype)).eps) / 2
    return unit * longest_reduction(program) * AMPLIFICATION * steps


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


def _tensor_types(value_type: ValueType) -> tuple[TensorType, ...]:
    return value_type.elements if isinstance(value_type, TupleType) else (value_type,)


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
            elements += sum(t.size for t in _tensor_types(node.result.type))
        local += elements * copies
    single = sum(s.size for s in (state.initial_values.source(n)
                                  for n in state.initial_values))
    for node in program.graph.nodes:
        single += 3 * sum(t.size for t in _tensor_types(node.result.type))  # fwd, bwd, update
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
    #: Inputs of the batches that hold NaN or an infinity ("input x of step 1: 1 NaN of 64").
    nonfinite_inputs: list[str] = field(default_factory=list)
    #: Results of the single-device program (loss, values, outputs) that are not finite: the
    #: comparison verified nothing about them.
    nonfinite_results: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        """Every compared result of the single-device program is finite (else `ok()` holds
        trivially where both programs give NaN: `inconclusive_message`)."""
        return not self.nonfinite_results

    @property
    def bound(self) -> float:
        """The derived bound of this report's precision (float64: `FLOAT64_RTOL`)."""
        return FLOAT64_RTOL if self.float64 else 1e-5

    def ok(self, rtol: float | None = None, param_rtol: float | None = None) -> bool:
        """Loss and optimizer state (which carries the gradients) within `rtol` (default: the
        derived `bound`); updated parameters within `param_rtol` (default `rtol`)."""
        if rtol is None:
            rtol = self.bound
        loss_ok = all(_same_nonfinite(a, b) or abs(a - b) <= rtol * max(1.0, abs(b))
                      for a, b in self.losses)
        limit = rtol if param_rtol is None else param_rtol
        return loss_ok and all(
            err <= (limit if name in self.params else rtol) for name, err in self.errors.items()
        )


def _same_nonfinite(a: float, b: float) -> bool:
    """Both NaN, or the same infinity: a step that overflows in both programs (a loss-scale
    cell then skips its update in both)."""
    return (np.isnan(a) and np.isnan(b)) or (np.isinf(a) and a == b)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|; elements that are non-finite in the same way in both
    (NaN and NaN, or the same infinity) agree; one that is non-finite in one only is an
    infinite error."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not want.size:
        return 0.0
    same = (np.isnan(got) & np.isnan(want)) | (np.isinf(want) & (got == want))
    if same.any():
        got, want = np.where(same, 0.0, got), np.where(same, 0.0, want)
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return float("inf")
    scale = max(float(np.max(np.abs(want))), 1e-6)
    return float(np.max(np.abs(got - want))) / scale


def describe_nonfinite(what: str, array: object) -> str | None:
    """'`what`: 1 NaN, 2 +inf of 64 elements' when a float array holds non-finite elements,
    else None."""
    a = np.asarray(array)
    if a.dtype.kind in "iub":  # integers and booleans are always finite
        return None
    if a.dtype.kind == "c":
        a = np.concatenate([a.real.ravel(), a.imag.ravel()])
    elif a.dtype.kind != "f":
        try:  # bfloat16, float8 (ml_dtypes) are kind 'V'
            a = a.astype(np.float64)
        except (TypeError, ValueError):
            return None
    if np.isfinite(a).all():
        return None
    if a.size == 1:
        return f"{what} is {float(a.ravel()[0])!r}"
    counts = [(int(np.count_nonzero(np.isnan(a))), "NaN"),
              (int(np.count_nonzero(np.isposinf(a))), "+inf"),
              (int(np.count_nonzero(np.isneginf(a))), "-inf")]
    parts = ", ".join(f"{k} {name}" for k, name in counts if k)
    return f"{what}: {parts} of {a.size} elements"


def note_nonfinite(report: OracleReport, inputs: Sequence[tuple[str, object]] = (),
                   results: Sequence[tuple[str, object]] = ()) -> None:
    """Record in `report` the inputs and the single-device results that are not finite."""
    for what, array in inputs:
        found = describe_nonfinite(what, array)
        if found is not None:
            report.nonfinite_inputs.append(found)
    for what, array in results:
        found = describe_nonfinite(what, array)
        if found is not None:
            report.nonfinite_results.append(found)


def _listed(items: list[str], shown: int = 4) -> str:
    more = len(items) - shown
    return "; ".join(items[:shown]) + (f"; and {more} more" if more > 0 else "")


def inconclusive_message(report: OracleReport, reference: str = "the single-device program",
                         skip: str = "--no-check compiles without the check") -> str | None:
    """The one message for a check that verified nothing because `reference`'s results are not
    finite (None when they are): what is not finite, whether the data is the cause, what the
    verdict means and what to do."""
    if report.verified:
        return None
    if report.nonfinite_inputs:
        cause = (f"The data is not finite: {_listed(report.nonfinite_inputs)}. Give finite "
                 "inputs (inputs(), dataset()) to check the plan")
    else:
        cause = ("The inputs are finite, so the model or its initial parameter values produce "
                 "them (an overflow, a log or division of 0, a NaN initializer): make the first "
                 "step finite to check the plan")
    return (f"check inconclusive: the results of {reference} are not finite "
            f"({_listed(report.nonfinite_results)}). NaN matches NaN and an infinity the same "
            "infinity, so the comparison cannot tell a right plan from a wrong one: nothing was "
            f"verified. {cause}; {skip}")


def nonfinite_input_note(report: OracleReport) -> str | None:
    """A note for non-finite inputs (an additive -inf mask) whose results are all finite: the
    check holds; None otherwise."""
    if not report.nonfinite_inputs or not report.verified:
        return None
    return (f"note: the data is not finite ({_listed(report.nonfinite_inputs)}), but every "
            "compared result is, so the check holds")


def gradient_scales(program: CompiledProgram) -> dict[str, float]:
    """What the parallel program's options do to each trainable parameter's gradient, relative
    to the gradient of the single-device loss (MindSpore's semantics, reference §3.3):

    * `gradients_mean`: the mirror's vjp (and the parallel optimizer's AllGather's) divides
      the all-reduced gradient by its group size, i.e. by the number of ranks holding the
      parameter's slice (`grad_comm_ops.py`, `get_bprop_mirror_operator`). In semi/auto modes
      the loss's sensitivity is already divided by its copies (`_VirtualDiv`), so the update
      is 1/copies of the single-device one; in data/hybrid modes each rank's loss is its own
      and the mean gives the single-device update (of a loss that is a mean over the batch).
    * a loss held by k ranks without `_VirtualDiv` (`loss_repeated_mean=False`; data/hybrid
      modes, where every rank's loss counts): k times the gradient.
    """
    state = program.state
    if not program.training or not state.parallel:
        return {}
    assert state.assignment is not None
    options = state.options
    replicated_modes = state.parallel_mode in ("data_parallel", "hybrid_parallel")
    if replicated_modes:
        copies = state.devices
    elif options.loss_repeated_mean:
        copies = 1
    else:
        layout = state.output_layouts[0] if state.output_layouts else None
        copies = layout.repeat_count if layout is not None else 1
    traced = program.traced
    scales = {}
    for p in program.graph.weights:
        if not p.requires_grad:
            continue
        owner = traced.parameters.get(p.name)
        if replicated_modes and owner is not None and owner.layerwise_parallel:
            continue  # no mirror: each rank keeps its own gradient (the user's sharding)
        shard = state.opt_shard.get(p.name)
        use = shard.use if shard is not None else state.assignment.param_layouts[p.name]
        held = use.repeat_count
        mean = held if options.gradients_mean and held > 1 else 1
        if copies != mean:
            scales[p.name] = copies / mean
    return scales


def _restrict(graph: Graph, local: RankLocal, rank: int) -> None:
    """Feed the reduction `local` of `graph` with `rank`'s part of its input only."""
    (node,) = [n for n in graph.nodes if n.fullname == local.fullname]
    x = node.operands[0]
    bounds = local.bounds(rank)
    b = Builder(graph, scope=node.scope, source=node.source)
    node_before = graph.nodes[graph.index_of(node) - 1] if graph.index_of(node) else None
    b.cursor = node_before
    part = b.emit("StridedSlice", [x], {"begin": tuple(lo for lo, _ in bounds),
                                        "end": tuple(hi for _, hi in bounds),
                                        "strides": (1,) * len(bounds)},
                  name_hint="rank_part")
    assert isinstance(part, NodeResult)
    if node_before is None:
        graph.remove(part.node)
        graph.insert_before(node, part.node)
    node.set_operand(0, part)


def _mean_over_ranks(locals_: list[RankLocal], devices: int) -> Callable[[Graph], None]:
    """The training objective of a program with rank-local reductions: the mean over the
    ranks of each rank's loss (its reductions restricted to its part). The parallel program's
    gradient is that of the sum of the ranks' losses, each divided by the loss's copies
    (`_VirtualDiv`), i.e. of this mean for a loss every rank holds."""

    def transform(graph: Graph) -> None:
        if graph.outputs and graph.outputs[0].shape:
            raise PcompileError(
                "the check models cross_batch reductions for a scalar loss only; this loss has "
                f"shape {graph.outputs[0].shape}; --no-check skips the check"
            )
        old = list(graph.nodes)
        losses = []
        for rank in range(devices):
            env: dict[int, Value] = {}
            for node in old:
                operands = [env.get(id(v), v) for v in node.operands]
                local = next((lo for lo in locals_ if lo.fullname == node.fullname), None)
                b = Builder(graph, scope=node.scope, source=node.source)
                if local is not None:
                    bounds = local.bounds(rank)
                    operands[0] = b.emit(
                        "StridedSlice", [operands[0]],
                        {"begin": tuple(lo for lo, _ in bounds),
                         "end": tuple(hi for _, hi in bounds), "strides": (1,) * len(bounds)})
                env[id(node.result)] = b.emit(node.op, operands, None,
                                              instance_name=node.instance_name,
                                              user_attrs=dict(node.attrs))
            losses.append(env[id(graph.outputs[0])])
        b = Builder(graph)
        total = losses[0]
        for loss in losses[1:]:
            total = b("Add", total, loss)
        graph.outputs = [b("Mul", total, 1.0 / devices, name_hint="loss"), *graph.outputs[1:]]
        graph.dead_code_elimination()

    return transform


def reference_micro_batches(program: CompiledProgram) -> tuple[bool, int]:
    """(whether the reference runs nn.PipelineCell's micro-batches in turn, the blocks of the
    inputs' rows). A plan's ranks cut micro-batch k out of the rows each holds (its dim-0
    block of every input), so micro-batch k is the k-th part of every block: that is the
    reference's micro-batch, which matters where a micro-batch's own statistics do (BatchNorm).
    One device running MindSpore's PipelineCell reads the k-th rows of the whole batch: the same
    where dim 0 is not split (one block). Without per-micro-batch statistics the micro-batches'
    mean loss and accumulated gradients are the whole batch's, so both references agree
    (tests/passes/test_pipeline_batch_norm.py). The one exception: a random op's bits are drawn
    by a row's place in the whole batch, which a micro-batch gathered from several blocks does
    not have in one piece, so with random ops and a split dim 0 the reference runs the whole
    batch (what those ops draw then equals), and a program that also assigns a Parameter per
    micro-batch (BatchNorm) is refused by the check with one message."""
    state = program.state
    if not state.micro_batched or state.assignment is None:
        return False, 1
    layouts = state.assignment.param_layouts
    first = next((p for p in program.graph.inputs if p.shape), None)
    blocks = layouts[first.name].splits[0] if first is not None else 1
    from pcompile.passes.micro_batch import RANDOM_OPS

    random = next((n for n in program.graph.nodes if n.op in RANDOM_OPS), None)
    if blocks > 1 and random is not None:
        assign = next((n for n in program.graph.nodes if n.op == "Assign"), None)
        if assign is not None:
            raise PcompileError(
                f"the check cannot compare this plan: {random.op} '{random.instance_name}' at "
                f"{random.source or 'an unknown line'} draws its bits by a row's place in the "
                f"whole batch and {assign.op} '{assign.instance_name}' at "
                f"{assign.source or 'an unknown line'} runs once per micro-batch, but each "
                f"micro-batch gathers rows from the {blocks} blocks the ranks of a stage hold, "
                "which no single-device program draws in one piece; --no-check skips the "
                "check, dataset_strategy='full_batch' (or one device a stage) makes it possible")
        return False, 1
    return True, blocks


def single_device(program: CompiledProgram, rank: int | None = None) -> CompiledProgram:
    """The same model file compiled for one device (no dumps), modelling the parallel
    program's options: gradient scales (`gradient_scales`), and rank-local reductions
    (`cross_batch`): restricted to `rank`'s part when `rank` is given (rank `rank`'s own
    result), else, for training, the loss as the mean of the ranks' losses. A micro-batched
    plan (`nn.PipelineCell`) is checked against its micro-batches run in turn, as MindSpore's
    PipelineCell runs them on one device (`reference_micro_batches`)."""
    locals_ = rank_local_reductions(program)
    micro, blocks = reference_micro_batches(program) if not locals_ else (False, 1)
    reference = ReferenceOptions(gradient_scales=gradient_scales(program),
                                 micro_batches=micro, batch_blocks=blocks)
    if locals_ and rank is not None:
        def restrict_all(graph: Graph) -> None:
            for local in locals_:
                _restrict(graph, local, rank)
        reference.transform = restrict_all
    elif locals_ and program.training:
        reference.transform = _mean_over_ranks(locals_, program.state.devices)
    shrink = program.state.shrink
    if shrink is not None:  # the shrunk check: the same shrunk copy on one device
        from pcompile.compiler.driver.pinned_plan import PinnedPlan

        # micro-batches in turn trace one micro-batch, as the plan does: the plan's shrink
        shrink = PinnedPlan(shrink.shrink if micro else shrink.reference or shrink.shrink)
    return compile_program(program.state.model_file.path, devices=1, dump=False,
                           reference=reference, shrink=shrink)


def check(program: CompiledProgram, steps: int = 1,
          reference: CompiledProgram | None = None, float64: bool = True) -> OracleReport:
    """Run `steps` steps of the parallel program (all ranks, numpy simulator) and of the
    single-device program from the same initial values, under the parallel program's options
    (`single_device`); `float64`: evaluate both in float64 (the default; see the module
    docstring), else in the graphs' own dtypes."""
    with np.errstate(all="ignore"):  # non-finite values are reported, not warned about
        if not program.training and rank_local_reductions(program) and reference is None:
            return _check_rank_local(program, float64)
        return _check(program, steps, reference, float64)


def _input_names(program: CompiledProgram) -> list[str]:
    return [p.name for p in program.graph.inputs]


def _check(program: CompiledProgram, steps: int, reference: CompiledProgram | None,
           float64: bool) -> OracleReport:
    ref = reference or single_device(program)
    par = ParallelRunner(program, float64=float64)
    one = _reference_runner(program, ref, float64)
    report = OracleReport(float64=float64)
    names = _input_names(ref)
    # Values that start non-finite (a -inf mask held as a parameter): the user's data.
    initially = {name: part for name, value in one.values.items()
                 if (part := _nonfinite_part(value)) is not None}
    for step, (_, _, arrays) in enumerate(batches(ref, steps), start=1):
        note_nonfinite(report, [(f"input {n} of step {step}", a)
                                for n, a in zip(names, arrays)])
        if program.training:
            par_loss, one_loss = par.step(arrays), one.step(arrays)
            report.losses.append((par_loss, one_loss))
            note_nonfinite(report, results=[(f"the loss of step {step}", one_loss)])
        else:
            outs = par.run(arrays)
            want = one.run(arrays)
            layouts = program.state.output_layouts
            for i, (w, layout) in enumerate(zip(want, layouts)):
                got = gather(outs, i, layout, w)
                report.errors[f"output{i}"] = relative_error(got, w)
                note_nonfinite(report, results=[(f"output {i}", w)])
            return report
    report.params = {p.name for p in ref.graph.weights}
    for name, value in one.values.items():
        report.errors[name] = relative_error(par.global_value(name), value)
        if name in initially and _same_part(_nonfinite_part(value), initially[name]):
            # its non-finite elements are the initial ones, unchanged: data, like an input
            note_nonfinite(report, [(f"the initial value of {name}", value)])
        else:
            note_nonfinite(report, results=[(f"{name} after step {steps}", value)])
    return report


def _nonfinite_part(value: object) -> tuple[np.ndarray, np.ndarray] | None:
    """(mask, elements) of a float array's non-finite elements; None when it has none."""
    a = np.asarray(value)
    if a.dtype.kind not in "fc":
        return None
    mask = ~np.isfinite(a)
    return (mask, a[mask]) if mask.any() else None


def _same_part(a: tuple[np.ndarray, np.ndarray] | None,
               b: tuple[np.ndarray, np.ndarray] | None) -> bool:
    return (a is not None and b is not None and np.array_equal(a[0], b[0])
            and np.array_equal(a[1], b[1], equal_nan=True))


def _reference_runner(program: CompiledProgram, ref: CompiledProgram,
                      float64: bool) -> StandAloneRunner:
    one = StandAloneRunner(ref, "numpy", float64=float64)
    for name in one.values:
        if name in program.initial_values:
            value = np.array(program.initial_values[name], copy=True)
            one.values[name] = value.astype(one.values[name].dtype)
    return one


def _check_rank_local(program: CompiledProgram, float64: bool) -> OracleReport:
    """Inference with rank-local reductions: each rank's outputs against the single-device
    program whose reductions see that rank's part only (its slice of each output)."""
    par = ParallelRunner(program, float64=float64)
    report = OracleReport(float64=float64)
    layouts = program.state.output_layouts
    outs: list[list[np.ndarray]] | None = None
    for rank in range(program.state.devices):
        ref = single_device(program, rank)
        _, _, arrays = next(batches(ref, 1))
        if outs is None:
            outs = par.run(arrays)
            note_nonfinite(report, [(f"input {n}", a)
                                    for n, a in zip(_input_names(ref), arrays)])
        want = _reference_runner(program, ref, float64).run(arrays)
        for i, (w, layout) in enumerate(zip(want, layouts)):
            mine = w if layout is None or not w.shape else w[tuple(
                slice(lo, hi) for lo, hi in layout.slice_bounds(rank))]
            err = relative_error(outs[rank][i], mine)
            report.errors[f"output{i}"] = max(report.errors.get(f"output{i}", 0.0), err)
            note_nonfinite(report, results=[(f"output {i} of rank {rank}", mine)])
    return report


def gather(outs: list[list[np.ndarray]], index: int, layout, like: np.ndarray) -> np.ndarray:
    """Reassemble output `index` from every rank's slice."""
    if layout is None or not like.shape:
        return outs[0][index]
    full = np.zeros(layout.shape, like.dtype)
    for rank, rank_outs in enumerate(outs):
        full[tuple(slice(b, e) for b, e in layout.slice_bounds(rank))] = rank_outs[index]
    return full
