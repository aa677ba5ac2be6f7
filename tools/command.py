"""What `pcompile MODEL.py` does once the command line is parsed: compile and write
(tools/compile.py), say what was compiled (`summary`), check the plan (tools/checks.py) and,
with --run, run it (tools/run.py). The CLI builds the options and prints through `echo`."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pcompile.tools.run import Echo, RunOptions

if TYPE_CHECKING:
    from pcompile.compiler.driver.compiled import CompiledProgram, CompileState


@dataclass(frozen=True)
class CheckOptions:
    """--check / --no-check, --check-shrunk [FACTOR] (0: the smallest factor within the
    budget) and --force-check."""

    enabled: bool = True
    shrunk: int | None = None
    force: bool = False


def compile_check_run(model: str, compile_args: dict[str, Any], check: CheckOptions,
                      run: RunOptions | None, *, quiet: bool, echo: Echo) -> int:
    """Compile `model` (`compile_args`: those of `pcompile.compile`), print its summary, check
    it, and run it when `run` is given; the exit status. --out is usable and --run's options
    fit the program before anything is written; --out stays locked until the run ends."""
    from pcompile.backends.placement import pin_parent_to_cpu
    from pcompile.program.progress import CompileProgress
    from pcompile.tools.checks import check_plan
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.run import check_tensorboard, prepare_run, refuse_under_a_launcher, train

    # The rank processes own the accelerators: compiling and checking here use the CPU.
    pin_parent_to_cpu()
    with ExitStack() as held:
        if compile_args.get("out_dir") is not None:
            from pcompile.compiler.driver.outdir import resolve

            resolve(compile_args["out_dir"])  # an unusable --out fails before the compile
        if run is not None and run.tensorboard:
            check_tensorboard(run.tensorboard)
        if run is not None:
            refuse_under_a_launcher()
        resolved = [run]

        def before_write(state: CompileState, out: str | None) -> None:
            if run is not None:
                resolved[0] = prepare_run(state, out, run, held)

        start = time.perf_counter()
        program = compile_model(model, **compile_args, before_write=before_write,
                                on_event=CompileProgress(start))
        summary(program, time.perf_counter() - start, quiet, echo)
        if check.enabled:
            check_plan(program, echo, shrunk=check.shrunk, force=check.force)
        options = resolved[0]
        return train(program, options, echo) if options is not None else 0


def summary(program: CompiledProgram, elapsed: float, quiet: bool, echo: Echo) -> None:
    """What was compiled: the program, the search's warnings and the prediction's advice
    (on stderr), then unless `quiet` the prediction, the pipeline schedule, every pass's time
    and where the dumps and plan.json are."""
    state = program.state
    graph = program.graph
    echo(
        f"compiled {state.model_file.path}: {state.parallel_mode}, {state.devices} device(s), "
        f"{'training step' if program.training else 'inference'}; {len(graph.nodes)} nodes, "
        f"{len(graph.params)} parameters, {elapsed:.3f} s"
    )
    for line in (state.plan.search or {}).get("warnings", []):
        echo(f"warning: {line}", err=True)
    prediction = state.plan.prediction
    if prediction and not prediction["fits"]:
        echo(f"warning: {prediction['advice']}", err=True)
    if quiet:
        return
    if prediction:
        from pcompile.compiler.driver.plan import megatron_minimum
        from pcompile.tools.render import prediction_text

        # the advice was printed above, as a warning
        for text, _style in prediction_text({**prediction, "advice": None}, state.plan.search,
                                            megatron_minimum(state)):
            echo(text)
    if state.pipelined and state.pipeline is not None:
        echo(state.pipeline.program.schedule.text())
    for name, seconds in program.timings:
        echo(f"  pass {name:<24} {seconds * 1000:8.1f} ms")
    if program.out_dir:
        ranks = state.dump_ranks
        if ranks:
            which = ("every rank" if len(ranks) == state.devices and state.devices > 1
                     else "rank " + ", ".join(map(str, ranks)) if len(ranks) <= 8
                     else f"{len(ranks)} ranks")
            first = os.path.join(program.out_dir, f"rank_{ranks[0]}")
            echo(f"dumps ({which}): {first}/*.ir, plan: "
                 f"{os.path.join(program.out_dir, 'plan.json')}")
        else:
            echo(f"dumps: none (--dump-ranks none); plan: "
                 f"{os.path.join(program.out_dir, 'plan.json')}")
