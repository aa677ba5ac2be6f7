"""The check `pcompile MODEL.py` runs after compiling (`--check`, on by default): one step of
the plan against the single-device program (tools/oracle.py), or of one device's JAX lowering
against the numpy interpreter, both in float64; over the budget, the same plan on a shrunk copy
of the model (tools/shrink.py).

Everything said goes through `echo(text, err=False)` (the CLI passes `click.echo`); a failed
check is a `PcompileError` (one message)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pcompile.ir.errors import PcompileError
from pcompile.program.progress import log

if TYPE_CHECKING:
    from pcompile.compiler.driver.compiled import CompiledProgram

Echo = Callable[..., None]


def check_plan(program: CompiledProgram, echo: Echo, *, shrunk: int | None = None,
               force: bool = False) -> None:
    """The check of a compiled program: on a shrunk copy when `shrunk` is given (0: the
    smallest factor within the budget), else at full size when it fits the budget (or
    `force`), else on a shrunk copy chosen automatically."""
    if shrunk is not None:
        check_shrunk(program, shrunk or None, echo)
    elif check_affordable(program, force, echo):
        log.info("checking one step against the single-device program ...")
        check_backends(program, echo)
    else:
        check_shrunk(program, None, echo, automatic=True)


def check_affordable(program: CompiledProgram, force: bool, echo: Echo) -> bool:
    """The check's rule: it runs when it holds at most CHECK_BUDGET_BYTES (or when forced)."""
    from pcompile.tools.oracle import CHECK_BUDGET_BYTES, check_cost

    cost = check_cost(program)
    if force or cost <= CHECK_BUDGET_BYTES:
        return True
    echo(
        f"note: check skipped: simulating the {program.state.devices} rank(s) and the "
        f"single-device program in float64 would hold about {cost / 2**30:.1f} GB (pcompile "
        f"checks plans that take at most {CHECK_BUDGET_BYTES / 2**30:.0f} GB); --force-check "
        "runs it anyway; the same plan is checked on a shrunk copy of the model instead "
        "(--check-shrunk FACTOR chooses how much it shrinks)")
    return False


def check_shrunk(program: CompiledProgram, factor: int | None, echo: Echo,
                 automatic: bool = False) -> None:
    """The plan checked on a shrunk copy of the model (tools/shrink.py): same graph and
    strategies, dims divided by up to `factor` (None: the smallest factor within the budget).
    `automatic` (the full-size check was over budget): a model the copy cannot be made of is
    a note, not an error."""
    from pcompile.tools.shrink import choose_shrink, compile_shrunk, describe

    if not program.state.parallel:
        message = ("the shrunk check checks parallel plans; this program runs on one device "
                   "(--force-check runs the full-size check)")
        if automatic:
            echo(f"note: {message}")
            return
        raise PcompileError(f"--check-shrunk: {message}")
    try:
        shrink = choose_shrink(program, factor)
    except PcompileError as exc:
        if automatic:
            echo(f"warning: this plan was NOT checked against the single-device program:"
                 f" the full-size check is over budget and no shrunk copy can be made "
                 f"({exc}); --force-check runs the full-size check", err=True)
            return
        raise
    echo(f"shrunk check: {describe(shrink)}")
    log.info("checking one step of the shrunk copy against its single-device program ...")
    check_oracle(compile_shrunk(program, shrink), echo)


def check_backends(program: CompiledProgram, echo: Echo) -> None:
    """One device: the numpy interpreter against the JAX lowering, both in float64 and JAX at
    matmul precision `highest` (so the check does not depend on the float32 matmul precision
    of a device, e.g. TF32; this process computes on the CPU anyway). Parallel programs:
    `check_oracle`."""
    import numpy as np

    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.oracle import (
        FLOAT64_RTOL,
        OracleReport,
        inconclusive_message,
        nonfinite_input_note,
        note_nonfinite,
        relative_error,
    )
    from pcompile.tools.runners import StandAloneRunner

    if program.state.parallel:
        check_oracle(program, echo)
        return

    _, _, arrays = next(batches(program, 1))
    results = {}
    with np.errstate(all="ignore"):  # non-finite results are reported below, not warned about
        for backend in ("numpy", "jax"):
            runner = StandAloneRunner(program, backend, float64=True)
            results[backend] = runner.run(arrays)
    if program.training:
        ln, lj = float(results["numpy"][0]), float(results["jax"][0])
        echo(f"first step loss (float64): numpy {ln!r}, jax {lj!r}")
    finite = OracleReport(float64=True)
    note_nonfinite(finite, [(f"input {p.name}", a) for p, a in zip(program.graph.inputs, arrays)],
                   [(name, a) for name, a in zip(program.output_names, results["numpy"])])
    inconclusive = inconclusive_message(finite, "the numpy interpreter")
    if inconclusive is not None:
        raise PcompileError(inconclusive)
    for i, (a, b) in enumerate(zip(results["numpy"], results["jax"])):
        err = relative_error(b, a)
        if err > FLOAT64_RTOL:
            raise PcompileError(
                f"check failed: the JAX lowering and the numpy interpreter disagree on output "
                f"{program.output_names[i]} by {err:.3g} relative to its scale (both in "
                f"float64; they agree within {FLOAT64_RTOL:.2g} when the lowering is right); "
                "please report it with the model file; --no-check skips this check"
            )
    if not program.training:
        shapes = ", ".join(str(tuple(o.shape)) for o in results["numpy"])
        echo(f"inference outputs {shapes}: numpy and jax agree (float64)")
    note = nonfinite_input_note(finite)
    if note is not None:
        echo(note)


def check_oracle(program: CompiledProgram, echo: Echo) -> None:
    """Parallel programs: all ranks on the numpy simulator against the single-device model,
    both evaluated in float64 (tools/oracle.py derives the bound)."""
    from pcompile.tools.oracle import check, inconclusive_message, nonfinite_input_note

    report = check(program, steps=1)
    state = program.state
    bound = report.bound
    if program.training:
        (par, one), = report.losses
        echo(f"first step loss (float64): {state.devices} ranks (numpy simulator) {par!r}, "
             f"single device {one!r}")
    inconclusive = inconclusive_message(report)
    if inconclusive is not None:  # NaN matched NaN: no verdict either way
        raise PcompileError(inconclusive)
    name, err = report.worst
    echo(f"parallel plan vs single device (float64): worst relative error {err:.2e} "
         f"({name or 'none'}; bound {bound:.2g})")
    if not report.ok():
        raise PcompileError(
            f"check failed: {name} of the {state.devices}-rank plan differs from the "
            f"single-device program by {err:.3g} relative to its scale (both evaluated in "
            f"float64; a correct plan agrees within {bound:.2g}). The plan does not compute "
            "what the model computes: please report it with the model file; --no-check skips "
            "this check"
        )
    note = nonfinite_input_note(report)
    if note is not None:
        echo(note)
    if program.training:
        low_precision_report(program, echo)


def low_precision_report(program: CompiledProgram, echo: Echo) -> None:
    """A model that computes in float16/bfloat16: the plan was checked in float64 above; here
    the first-step loss of the plan and of the single-device program, both in the model's own
    dtypes, against what the dtype's rounding explains (eps x the longest reduction)."""
    from pcompile.tools.oracle import check, low_precision_bound

    dtype, bound = low_precision_bound(program)
    if dtype is None:
        return
    report = check(program, steps=1, float64=False)
    (par, one), = report.losses
    diff = abs(par - one) / max(1.0, abs(one))
    verdict = "within" if diff <= bound else "beyond (accumulated rounding; the plan is right)"
    echo(f"{dtype} compute: first-step loss {program.state.devices} ranks {par!r}, single "
         f"device {one!r}: relative difference {diff:.2e}, {verdict} the worst case "
         f"{dtype} rounding explains ({bound:.2g})")
