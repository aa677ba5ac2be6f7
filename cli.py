"""`pcompile MODEL.py --devices N --search MODE`: the command line. Thin: parse options, call
`compiler`, print.

Commands: `pcompile [compile] MODEL.py ...` (compile is the default: `pcompile MODEL.py` works
as it always did), `pcompile show DIR`, `pcompile diff DIR --ranks A,B`; `pcompile --version`.
Progress goes through the `logging` module (logger `pcompile`) to stderr: shown when stderr is
a terminal, or with `-v`; `-q` keeps only warnings, errors and results.
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import sys
import time
from typing import Any

import click

from pcompile.backends.progress import CompileProgress, log, run_monitor, setup_logging

# At exit the interpreter runs one last full garbage collection over everything still alive: a
# compile's graphs (their use lists are cycles) and memo tables, about a second for a 96-layer
# model, to free memory the process is about to give back anyway. Freezing moves every object
# out of the collector's sight first; the other exit handlers and file flushes run as usual.
atexit.register(gc.freeze)

SEARCH_MODES = (
    "sharding_propagation", "dynamic_programming", "recursive_programming", "ilp")
PARALLEL_MODES = (
    "stand_alone",
    "data_parallel",
    "hybrid_parallel",
    "semi_auto_parallel",
    "auto_parallel",
)


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"pcompile: error: {message}", err=True)
    sys.exit(code)


def _parse_dataset_strategy(text: str | None) -> Any:
    if text is None:
        return None
    if text in ("data_parallel", "full_batch"):
        return text
    import ast

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise click.BadParameter(
            "expected data_parallel, full_batch or a tuple such as '((8, 1), (8, 1))'"
        ) from None
    return value


CONTEXT = {"help_option_names": ["-h", "--help"]}


class _DefaultGroup(click.Group):
    """A group whose first argument, when it names no command, is the model file of the
    default command `compile` (`pcompile MODEL.py ...` = `pcompile compile MODEL.py ...`)."""

    default_command = "compile"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        group_only = ("--version", *CONTEXT["help_option_names"])
        if args and args[0] not in self.commands and args[0] not in group_only:
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: Any) -> None:
        formatter.write_usage(ctx.command_path, "[compile] MODEL.py [OPTIONS] | show DIR | diff "
                                                "DIR --ranks A,B")


def _version() -> str:
    from pcompile import __version__

    return __version__


@click.group(cls=_DefaultGroup, context_settings=CONTEXT, invoke_without_command=False,
             no_args_is_help=True)
@click.version_option(_version(), "--version", prog_name="pcompile",
                      message="%(prog)s %(version)s")
def main() -> None:
    """pcompile: compile a MindSpore-style model into per-rank programs, and look at them.

    `pcompile MODEL.py [OPTIONS]` compiles (the `compile` command; `pcompile compile -h` lists
    its options); `pcompile show DIR` prints the plan of a compile, `pcompile diff DIR --ranks
    0,5` how two ranks' programs differ."""


def _verbosity(function: Any) -> Any:
    function = click.option("-q", "--quiet", is_flag=True,
                            help="Only warnings, errors and results.")(function)
    return click.option("-v", "--verbose", count=True,
                        help="Progress even when stderr is not a terminal (-vv: more).")(function)


@main.command("compile", context_settings=CONTEXT)
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--devices", type=click.IntRange(1, 4096), default=None,
              help="Number of devices (ranks). Overrides device_num set in the model file.")
@click.option("--search", "search", type=click.Choice(SEARCH_MODES), default=None,
              help="Strategy search algorithm; implies --parallel-mode auto_parallel.")
@click.option("--parallel-mode", type=click.Choice(PARALLEL_MODES), default=None,
              help="Parallel mode. Overrides the model file.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where dumps and plan.json go (default: save_graphs_path or ./saved_graph).")
@click.option("--dataset-strategy", default=None,
              help="data_parallel, full_batch, or per-input strategies like '((8, 1), (8, 1))'.")
@click.option("--pipeline-stages", type=click.IntRange(1), default=None, metavar="S",
              help="Pipeline stages (stage s owns ranks [s*n, (s+1)*n), n = devices / S). "
                   "Overrides pipeline_stages set in the model file.")
@click.option("--dump-ranks", default=None, metavar="RANKS",
              help="Ranks whose folders are written: all, none, or a list like 0,5 "
                   "(default: all up to 8 devices, else 0).")
@click.option("--save-graphs", type=click.IntRange(0, 3), default=None, metavar="LEVEL",
              help="Which passes are dumped (MindSpore's levels): 0 none, 1 trace, "
                   "step_parallel_begin/end and execute, 2 every pass, 3 also .dot files. "
                   "Overrides set_context(save_graphs=...) in the model file (default: 2).")
@click.option("--run", "do_run", is_flag=True, help="Train (or run inference) after compiling.")
@click.option("--steps", type=click.IntRange(1), default=1, show_default=True,
              help="Training steps with --run.")
@click.option("--backend", type=click.Choice(("jax", "numpy")), default="jax",
              show_default=True, help="Backend for --run.")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Run one step on the numpy interpreter and on JAX and compare (parallel "
                   "plans: against the single-device program), when it holds at most 1 GB.")
@click.option("--force-check", is_flag=True,
              help="Run the check even when it would hold more than 1 GB.")
@click.option("--check-shrunk", "check_shrunk", type=click.IntRange(0), default=None,
              is_flag=False, flag_value=0, metavar="[FACTOR]",
              help="Check the plan on a shrunk copy of the model: the same graph and "
                   "strategies, dims divided by up to FACTOR (every split kept valid; no "
                   "FACTOR: the smallest that fits the budget). Done by default when the "
                   "full-size check is over budget.")
@click.option("--checkpoint-every", type=click.IntRange(0), default=0, metavar="K",
              help="With --run: checkpoint every rank every K steps (always at the end).")
@click.option("--resume", is_flag=True,
              help="With --run: continue from the last step every rank checkpointed.")
@click.option("--processes", type=click.IntRange(1), default=None,
              help="With --run: rank processes to start (default: one per device).")
@click.option("--startup-timeout", type=click.FloatRange(1), default=600.0, show_default=True,
              help="With --run: seconds for start-up (processes connecting, the first step "
                   "compiling) before the launcher names the rank the others wait for.")
@click.option("--timeout", type=click.FloatRange(1), default=300.0, show_default=True,
              help="With --run: seconds each later step may take before the launcher names "
                   "the rank the others wait for.")
@click.option("--heartbeat-timeout", type=click.FloatRange(1), default=30.0, show_default=True,
              help="With --run: seconds without a heartbeat after which a rank process counts "
                   "as stopped (at most the current deadline).")
@click.option("--fail-on-nan/--no-fail-on-nan", default=True, show_default=True,
              help="With --run: stop when the loss is not finite, naming the step.")
@click.option("--print-every", type=click.IntRange(1), default=1, show_default=True,
              metavar="K", help="With --run: print every K-th loss line (and the last), like "
                                "MindSpore's LossMonitor(per_print_times).")
@click.option("--platform", type=click.Choice(("auto", "cpu", "gpu")), default="auto",
              show_default=True,
              help="With --run: gpu runs one GPU per rank (a process with several ranks owns "
                   "their GPUs), cpu virtual CPU devices, auto GPUs when JAX sees them. This "
                   "process (compile, check) uses only the CPU.")
@click.option("--matmul-precision", type=click.Choice(("default", "high", "highest")),
              default="default", show_default=True,
              help="With --run: JAX's float32 matmul precision for training (default lets a "
                   "GPU use TF32; highest is full float32). The check always uses highest.")
@click.option("--log-every", type=click.IntRange(1), default=1, show_default=True,
              metavar="N", help="With --run: read the loss back from the device every N steps "
                                "(the step then never waits for the host; every step is still "
                                "logged).")
@click.option("--tensorboard", "tensorboard", type=click.Path(file_okay=False), default=None,
              metavar="DIR", help="With --run on JAX: also write the metrics (DIR/metrics.jsonl "
                                  "of --out) as TensorBoard event files into DIR (needs "
                                  "pcompile[tensorboard]).")
@click.option("--keep-checkpoint-max", type=click.IntRange(1), default=None, metavar="K",
              help="With --run: checkpoints kept per rank, the newest K steps (MindSpore's "
                   "CheckpointConfig(keep_checkpoint_max); default 2), and always the newest "
                   "step every rank holds.")
@click.option("--profile-steps", default=None, metavar="N..M",
              callback=lambda ctx, param, value: _step_range(value, param),
              help="With --run on JAX: a jax.profiler trace of steps N to M (one step: N), "
                   "into --profile-dir.")
@click.option("--profile-dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="With --run: where --profile-steps writes (default DIR/profile of --out; "
                   "each rank process in rank_<r>).")
@click.option("--device-profile", default=None, metavar="NAME|FILE",
              help="The device the cost model in seconds describes (the ilp search and every "
                   "plan's prediction): h100 (default), h200, cpu, or a JSON profile "
                   "(docs/search.md).")
@click.option("--device-memory", type=click.FloatRange(min=1, min_open=False), default=None,
              metavar="BYTES",
              help="Memory per device in bytes (default: the profile's); the ilp search fits "
                   "its plan in it. Same as set_cost_model_context(device_memory_capacity=).")
@_verbosity
def compile_command(
    model: str,
    devices: int | None,
    search: str | None,
    parallel_mode: str | None,
    out_dir: str | None,
    dataset_strategy: str | None,
    pipeline_stages: int | None,
    dump_ranks: str | None,
    save_graphs: int | None,
    do_run: bool,
    steps: int,
    backend: str,
    check: bool,
    force_check: bool,
    check_shrunk: int | None,
    checkpoint_every: int,
    resume: bool,
    processes: int | None,
    startup_timeout: float,
    timeout: float,
    heartbeat_timeout: float,
    fail_on_nan: bool,
    print_every: int,
    platform: str,
    matmul_precision: str,
    log_every: int,
    tensorboard: str | None,
    keep_checkpoint_max: int | None,
    profile_steps: str | None,
    profile_dir: str | None,
    device_profile: str | None,
    device_memory: float | None,
    verbose: int,
    quiet: bool,
) -> None:
    """Compile MODEL.py into per-rank execution plans and dump the IR of every pass."""
    setup_logging(verbose, quiet)
    from contextlib import ExitStack

    from pcompile.backends.placement import pin_parent_to_cpu
    from pcompile.ir.errors import PcompileError
    from pcompile.tools.compile import compile as compile_model

    _check_run_flags(do_run)
    overrides: dict[str, Any] = {}
    strategy = _parse_dataset_strategy(dataset_strategy)
    if strategy is not None:
        overrides["dataset_strategy"] = strategy
    if pipeline_stages is not None:
        overrides["pipeline_stages"] = pipeline_stages
    if device_profile is not None:
        overrides["device_profile"] = device_profile
    if device_memory is not None:
        overrides["device_memory_capacity"] = device_memory
    run_options = {"checkpoint_every": checkpoint_every, "resume": resume,
                   "processes": processes, "timeout": timeout,
                   "startup_timeout": startup_timeout, "heartbeat_timeout": heartbeat_timeout,
                   "fail_on_nan": fail_on_nan, "steps": steps, "backend": backend,
                   "print_every": print_every, "quiet": quiet, "platform": platform,
                   "matmul_precision": matmul_precision, "log_every": log_every,
                   "tensorboard": os.path.abspath(tensorboard) if tensorboard else None,
                   "keep_checkpoint_max": keep_checkpoint_max, "profile_steps": profile_steps,
                   "profile_dir": os.path.abspath(profile_dir) if profile_dir else None}
    try:
        # The rank processes own the accelerators: compiling and checking here use the CPU.
        pin_parent_to_cpu()
        with ExitStack() as held:
            if out_dir is not None:
                from pcompile.compiler.outdir import resolve

                resolve(out_dir)  # an unusable --out fails before the compile
            if do_run and tensorboard:
                _check_tensorboard(os.path.abspath(tensorboard))
            if do_run:
                _refuse_under_a_launcher()

            def before_write(state: Any, out: str | None) -> None:
                if do_run:
                    _check_run(state, out, run_options, held)

            start = time.perf_counter()
            program = compile_model(
                model,
                devices=devices,
                parallel_mode=parallel_mode,
                search_mode=search,
                out_dir=out_dir,
                overrides=overrides,
                dump_ranks=dump_ranks,
                before_write=before_write,
                on_event=CompileProgress(start),
                save_graphs=save_graphs,
            )
            elapsed = time.perf_counter() - start
            _summary(program, elapsed, quiet)
            if check and check_shrunk is not None:
                _check_shrunk(program, check_shrunk or None)
            elif check and _check_affordable(program, force_check):
                log.info("checking one step against the single-device program ...")
                _check_backends(program)
            elif check:
                _check_shrunk(program, None, automatic=True)
            if do_run:
                _train(program, steps, backend, run_options)
    except PcompileError as exc:
        _fail(str(exc))
    except OSError as exc:  # the file system refused: say which file and why
        where = f" {exc.filename}" if exc.filename else ""
        _fail(f"cannot access{where}: {exc.strerror or exc}")
    except (ValueError, TypeError, KeyError) as exc:
        # Option validation (set_auto_parallel_context and friends) raises these by contract.
        if _from_options(exc):
            _fail(f"invalid option: {exc}")
        raise


RUN_ONLY = ("steps", "checkpoint_every", "resume", "processes", "startup_timeout", "timeout",
            "heartbeat_timeout", "fail_on_nan", "print_every", "platform", "matmul_precision",
            "log_every", "tensorboard", "keep_checkpoint_max", "profile_steps",
            "profile_dir")


def _step_range(value: str | None, param: Any) -> str | None:
    """--profile-steps N..M, checked (backends/jax/rank_process.py reads it again)."""
    if value is None:
        return None
    from pcompile.backends.jax.rank_process import step_range

    try:
        start, stop = step_range(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None
    return f"{start}..{stop}"


def _rank_flags(options: dict[str, Any]) -> list[str]:
    """The rank programs' options that --run passes through (backends/jax/rank_process.py)."""
    flags = ["--matmul-precision", str(options.get("matmul_precision") or "default"),
             "--log-every", str(int(options.get("log_every") or 1))]
    if options.get("tensorboard"):
        flags += ["--tensorboard", str(options["tensorboard"])]
    if options.get("keep_checkpoint_max"):
        flags += ["--keep-checkpoint-max", str(int(options["keep_checkpoint_max"]))]
    if options.get("profile_steps"):
        flags += ["--profile-steps", str(options["profile_steps"])]
    if options.get("profile_dir"):
        flags += ["--profile-dir", str(options["profile_dir"])]
    return flags


def _check_run_flags(do_run: bool) -> None:
    """Flags that only mean something with --run are refused without it (exit status 2)."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    spelling = {p.name: "/".join([*p.opts, *p.secondary_opts]) for p in ctx.command.params}
    given = [spelling[name] for name in RUN_ONLY
             if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
    if given and not do_run:
        raise click.UsageError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'}"
                               " with --run; add --run (or drop them)")


def _refuse_under_a_launcher() -> None:
    """`pcompile --run` starts every rank itself: inside a job of several processes (torchrun,
    msrun, mpirun, srun, ...) each process would run all of them."""
    from pcompile.backends.cluster import IdentityError, resolve_identity

    try:
        identity = resolve_identity(None, None, None, dict(os.environ))
    except IdentityError as exc:
        _fail(f"pcompile --run starts its own rank processes, and this environment describes "
              f"a multi-process job it cannot use: {exc}")
        return
    if identity.num_processes > 1 or identity.scheduler:
        n = identity.num_processes
        _fail(f"pcompile --run starts its own rank processes, but this process is one of "
              f"{n} started by {identity.source}: together they would run {n} times every "
              "rank. Compile once (pcompile MODEL.py --out DIR ...), then start the rank "
              "programs with your launcher, e.g. `torchrun --nproc-per-node "
              f"{n} DIR/rank_0/program.py --steps N` (docs/running.md, 'Without the "
              "launcher')")


def _launched(program_state: Any, options: dict[str, Any]) -> bool:
    """Whether --run starts rank processes (else it runs in this process, on CPU)."""
    return bool(program_state.parallel or options.get("checkpoint_every")
                or options.get("resume") or options.get("resolved_platform") == "gpu"
                or options.get("tensorboard") or options.get("profile_steps"))


def _check_run(state: Any, out_dir: str | None, options: dict[str, Any], held: Any) -> None:
    """--run's options against the compiled program, before anything is written; takes the
    lock of --out for the rest of the command."""
    from pcompile.backends.checkpoint import resume_point
    from pcompile.backends.placement import assign_devices, resolve_platform
    from pcompile.compiler.outdir import out_lock
    from pcompile.ir.errors import PcompileError

    if options["backend"] == "jax":
        platform, gpus = resolve_platform(options.get("platform") or "auto")
        options["resolved_platform"], options["gpus"] = platform, gpus
        if platform == "gpu":  # too few GPUs: refused before anything is written or started
            assign_devices(options.get("processes") or state.devices, state.devices, gpus)
    launched = _launched(state, options) and options["backend"] == "jax"
    if (options.get("resume") or options.get("checkpoint_every")
            or options.get("tensorboard") or options.get("profile_steps")) and not launched:
        raise PcompileError("--resume, --checkpoint-every, --tensorboard and --profile-steps "
                            "need the JAX rank programs; drop --backend numpy")
    n = state.devices
    procs = options.get("processes")
    if procs and launched and n % procs:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise PcompileError(f"--processes {procs} cannot share {n} ranks evenly; choose one of "
                            f"{', '.join(map(str, divisors))}")
    if out_dir is None:
        if launched:
            raise PcompileError("--run on JAX needs the rank programs: do not disable dumps")
        return
    held.enter_context(out_lock(out_dir))
    if options.get("resume"):
        folder = os.path.join(out_dir, "checkpoints")
        point = resume_point(folder, n)
        if point.step is None:
            why = "".join(f"\n  {line}" for line in point.skipped)
            raise PcompileError(f"--resume: no step has an intact checkpoint of every rank in "
                                f"{folder}{why or ' (there is none)'}; run without --resume to "
                                "start afresh")
        if point.step > options["steps"]:
            raise PcompileError(f"--resume: the checkpoint is at step {point.step}, beyond "
                                f"--steps {options['steps']}; ask for at least {point.step} "
                                "steps")
        options["resume_step"] = point.step


def _check_tensorboard(folder: str) -> None:
    """--tensorboard DIR, before the compile: tensorboardX installed, DIR a folder rank 0 can
    create or write in (else one message now, not a rank's traceback after start-up)."""
    import importlib.util

    from pcompile.backends.run_report import TENSORBOARD_MISSING
    from pcompile.compiler.outdir import check_writable_folder
    from pcompile.ir.errors import PcompileError

    check_writable_folder(folder, "--tensorboard")
    if importlib.util.find_spec("tensorboardX") is None:
        raise PcompileError(TENSORBOARD_MISSING)


def _from_options(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith((os.path.join("compiler", "context.py"),
                                                    os.path.join("compiler",
                                                                 "search_context.py"))):
            return True
        tb = tb.tb_next
    return False


def _summary(program: Any, elapsed: float, quiet: bool = False) -> None:
    state = program.state
    graph = program.graph
    click.echo(
        f"compiled {state.model_file.path}: {state.parallel_mode}, {state.devices} device(s), "
        f"{'training step' if program.training else 'inference'}; {len(graph.nodes)} nodes, "
        f"{len(graph.params)} parameters, {elapsed:.3f} s"
    )
    for line in (state.plan.get("search") or {}).get("warnings", []):
        click.echo(f"warning: {line}", err=True)
    prediction = state.plan.get("prediction")
    if prediction and not prediction["fits"]:
        click.echo(f"warning: {prediction['advice']}", err=True)
    if quiet:
        return
    if prediction:
        from pcompile.compiler.plan import megatron_minimum
        from pcompile.compiler.render import prediction_text

        # the advice was printed above, as a warning
        for text, _style in prediction_text({**prediction, "advice": None}, state.plan.get(
                "search"), megatron_minimum(state)):
            click.echo(text)
    if state.pipelined:
        click.echo(state.pipeline.program.schedule.text())
    for name, seconds in program.timings:
        click.echo(f"  pass {name:<24} {seconds * 1000:8.1f} ms")
    if program.out_dir:
        ranks = state.dump_ranks
        if ranks:
            which = ("every rank" if len(ranks) == state.devices and state.devices > 1
                     else "rank " + ", ".join(map(str, ranks)) if len(ranks) <= 8
                     else f"{len(ranks)} ranks")
            first = os.path.join(program.out_dir, f"rank_{ranks[0]}")
            click.echo(f"dumps ({which}): {first}/*.ir, plan: "
                       f"{os.path.join(program.out_dir, 'plan.json')}")
        else:
            click.echo(f"dumps: none (--dump-ranks none); plan: "
                       f"{os.path.join(program.out_dir, 'plan.json')}")


def _check_affordable(program: Any, force: bool) -> bool:
    """The check's rule: it runs when it holds at most CHECK_BUDGET_BYTES (or when forced)."""
    from pcompile.tools.oracle import CHECK_BUDGET_BYTES, check_cost

    cost = check_cost(program)
    if force or cost <= CHECK_BUDGET_BYTES:
        return True
    click.echo(
        f"note: check skipped: simulating the {program.state.devices} rank(s) and the "
        f"single-device program in float64 would hold about {cost / 2**30:.1f} GB (pcompile "
        f"checks plans that take at most {CHECK_BUDGET_BYTES / 2**30:.0f} GB); --force-check "
        "runs it anyway; the same plan is checked on a shrunk copy of the model instead "
        "(--check-shrunk FACTOR chooses how much it shrinks)")
    return False


def _check_shrunk(program: Any, factor: int | None, automatic: bool = False) -> None:
    """The plan checked on a shrunk copy of the model (tools/shrink.py): same graph and
    strategies, dims divided by up to `factor` (None: the smallest factor within the budget).
    `automatic` (the full-size check was over budget): a model the copy cannot be made of is
    a note, not an error."""
    from pcompile.ir.errors import PcompileError
    from pcompile.tools.shrink import choose_shrink, compile_shrunk, describe

    if not program.state.parallel:
        message = ("the shrunk check checks parallel plans; this program runs on one device "
                   "(--force-check runs the full-size check)")
        if automatic:
            click.echo(f"note: {message}")
            return
        raise PcompileError(f"--check-shrunk: {message}")
    try:
        shrink = choose_shrink(program, factor)
    except PcompileError as exc:
        if automatic:
            click.echo(f"warning: this plan was NOT checked against the single-device program:"
                       f" the full-size check is over budget and no shrunk copy can be made "
                       f"({exc}); --force-check runs the full-size check", err=True)
            return
        raise
    click.echo(f"shrunk check: {describe(shrink)}")
    log.info("checking one step of the shrunk copy against its single-device program ...")
    _check_oracle(compile_shrunk(program, shrink))


def _check_backends(program: Any) -> None:
    """One device: the numpy interpreter against the JAX lowering, both in float64 and JAX at
    matmul precision `highest` (so the check does not depend on the float32 matmul precision
    of a device, e.g. TF32; this process computes on the CPU anyway)."""
    import numpy as np

    from pcompile.compiler.runtime import batches
    from pcompile.ir.errors import PcompileError
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
        _check_oracle(program)
        return

    _, _, arrays = next(batches(program, 1))
    results = {}
    with np.errstate(all="ignore"):  # non-finite results are reported below, not warned about
        for backend in ("numpy", "jax"):
            runner = StandAloneRunner(program, backend, float64=True)
            results[backend] = runner.run(arrays)
    if program.training:
        ln, lj = float(results["numpy"][0]), float(results["jax"][0])
        click.echo(f"first step loss (float64): numpy {ln!r}, jax {lj!r}")
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
        click.echo(f"inference outputs {shapes}: numpy and jax agree (float64)")
    note = nonfinite_input_note(finite)
    if note is not None:
        click.echo(note)


def _check_oracle(program: Any) -> None:
    """Parallel programs: all ranks on the numpy simulator against the single-device model,
    both evaluated in float64 (tools/oracle.py derives the bound)."""
    from pcompile.ir.errors import PcompileError
    from pcompile.tools.oracle import check, inconclusive_message, nonfinite_input_note

    report = check(program, steps=1)
    state = program.state
    bound = report.bound
    if program.training:
        (par, one), = report.losses
        click.echo(f"first step loss (float64): {state.devices} ranks (numpy simulator) {par!r}, "
                   f"single device {one!r}")
    inconclusive = inconclusive_message(report)
    if inconclusive is not None:  # NaN matched NaN: no verdict either way
        raise PcompileError(inconclusive)
        if abs(par - one) > bound * max(1.0, abs(one)):
            raise PcompileError(
                f"check failed: the first-step loss of the {state.devices}-rank plan is {par!r}, "
                f"the single-device program's {one!r} (both in float64; a correct plan agrees "
                f"within {bound:.2g} relative). The plan does not compute what the model "
                "computes: please report it with the model file; --no-check skips this check"
            )
    name, err = report.worst
    click.echo(f"parallel plan vs single device (float64): worst relative error {err:.2e} "
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
        click.echo(note)
    if program.training:
        _low_precision_report(program)


def _low_precision_report(program: Any) -> None:
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
    click.echo(f"{dtype} compute: first-step loss {program.state.devices} ranks {par!r}, single "
               f"device {one!r}: relative difference {diff:.2e}, {verdict} the worst case "
               f"{dtype} rounding explains ({bound:.2g})")


def _train(program: Any, steps: int, backend: str,
           options: dict[str, Any] | None = None) -> None:
    options = options or {}
    rank_program = _one_rank_program(program, backend, options)
    if rank_program is not None:
        _train_rank_here(program, rank_program, steps, options)
        return
    if _launched(program.state, options) and backend == "jax":
        _launch(program, steps, options)
        return
    monitor = run_monitor(steps, int(options.get("print_every") or 1), click.echo)
    try:
        _train_here(program, steps, backend, options, monitor)
    finally:
        monitor.close()


def _one_rank_program(program: Any, backend: str, options: dict[str, Any]) -> str | None:
    """The generated `DIR/program.py` that trains a one-device plan on JAX's CPU in this
    process (None: inference, the numpy backend, a parallel plan, a GPU, or no rank program
    written)."""
    if backend != "jax" or not program.training or program.state.parallel:
        return None
    if options.get("resolved_platform") == "gpu":  # the GPU belongs to a rank process
        return None
    if not program.out_dir or getattr(program.state, "pipelined", False):
        return None
    path = os.path.join(program.out_dir, "program.py")
    return path if os.path.isfile(path) else None


def _train_rank_here(program: Any, path: str, steps: int, options: dict[str, Any]) -> None:
    """--run on one device: the rank program trains in this process (backends/jax/
    in_process.py), writing what a launched run writes: train.log, metrics.jsonl, the
    checkpoints (at the end, every --checkpoint-every), the time to first step and the
    summary; --resume, --tensorboard and --profile-steps as the rank program takes them."""
    from pcompile.backends.jax.in_process import RankRunError, run_in_process

    argv = ["--steps", str(steps), "--platform", "cpu", *_rank_flags(options),
            "--fail-on-nan" if options.get("fail_on_nan", True) else "--no-fail-on-nan"]
    if options.get("checkpoint_every"):
        argv += ["--checkpoint-every", str(int(options["checkpoint_every"]))]
    if options.get("resume"):
        argv += ["--resume"]  # the program picks the newest intact step of its own plan
    monitor = run_monitor(steps, int(options.get("print_every") or 1), click.echo,
                          done=int(options.get("resume_step") or 0))
    start = time.perf_counter()
    try:
        trained = run_in_process(path, argv, monitor)
    except RankRunError as exc:
        monitor.close()
        _fail(str(exc))
        return
    finally:
        monitor.close()
    done = int(options.get("resume_step") or 0) if options.get("resume") else 0
    text = f"{trained - done} step{'s' if trained - done != 1 else ''}"
    if done:
        text += f" (steps {done + 1}..{trained}, resumed from step {done})"
    click.echo(f"{text} in "
               f"{time.perf_counter() - start:.2f} s on jax (1 device, in this process); log: "
               f"{os.path.join(program.out_dir, 'rank_0', 'train.log')}; checkpoints: "
               f"{os.path.join(program.out_dir, 'checkpoints')}")


def _train_here(program: Any, steps: int, backend: str, options: dict[str, Any],
                monitor: Any) -> None:
    """--run in this process: the numpy simulator, or one device on JAX."""
    from pcompile.backends.progress import ReadBack, format_loss_line
    from pcompile.compiler.runtime import batches
    from pcompile.tools.runners import StandAloneRunner

    fail_on_nan = bool(options.get("fail_on_nan", True))
    if program.state.parallel:
        _train_simulated(program, steps, fail_on_nan, monitor)
        return
    runner = StandAloneRunner(program, backend,
                              matmul_precision=options.get("matmul_precision") or None)
    if not program.training:
        _, _, arrays = next(batches(program, 1))
        outs = runner.run(arrays)
        click.echo("inference: " + ", ".join(f"{n} {tuple(o.shape)}" for n, o in
                                               zip(program.output_names, outs)))
        return
    lines: list[str] = []
    start = time.perf_counter()

    class NonFiniteLossError(Exception):
        """A non-finite loss (its message) ends the loop."""

    def read(ready: list[tuple[int, int, int, Any]], last: bool) -> None:
        for k, epoch, step, loss in ready:
            value = float(loss)
            line = format_loss_line(epoch, step, value)
            lines.append(line)
            monitor(line)
            if fail_on_nan and not math.isfinite(value):
                raise NonFiniteLossError(_nonfinite(value, k + 1, epoch, step))

    # losses still on the device: each --log-every group is read back (one wait) once the step
    # after it is on its way, and the rest at the end
    pending = ReadBack(int(options.get("log_every") or 1), read)
    bad = None
    try:
        for k, (epoch, step, arrays) in enumerate(batches(program, steps)):
            pending.dispatched((k, epoch, step, runner.step_async(arrays)), k + 1)
        pending.flush(last=True)
    except NonFiniteLossError as exc:
        bad = str(exc)
    elapsed = time.perf_counter() - start
    monitor.close()  # the bar's last state, then the summary under it
    log = _write_logs(program, lines, 1)
    if bad:
        _fail(bad)
    if log:
        click.echo(f"{steps} steps in {elapsed:.2f} s on {backend}; log: {log}")


def _launch(program: Any, steps: int, options: dict[str, Any]) -> None:
    """Train with the generated rank programs, one process per rank (backends/launcher.py)."""
    from pcompile.backends.launcher import LaunchError, launch

    if not program.out_dir:
        _fail("--run on JAX needs the rank programs: do not disable dumps")
    n = program.state.devices
    procs = options.get("processes") or n
    where = ("one GPU per rank" if options.get("resolved_platform") == "gpu"
             else "CPU devices")
    click.echo(f"launching {procs} process(es) for {n} rank(s) on {where}: {program.out_dir}/"
               "rank_*/program.py (logs: rank_*/run.log)")
    start = time.perf_counter()
    monitor = run_monitor(steps, int(options.get("print_every") or 1), click.echo,
                          done=int(options.get("resume_step") or 0))
    try:
        result = launch(program.out_dir, steps=steps, processes=procs,
                        checkpoint_every=int(options.get("checkpoint_every") or 0),
                        resume=bool(options.get("resume")),
                        timeout=float(options.get("timeout") or 300.0),
                        startup_timeout=float(options.get("startup_timeout") or 600.0),
                        heartbeat_timeout=float(options.get("heartbeat_timeout") or 30.0),
                        fail_on_nan=bool(options.get("fail_on_nan", True)),
                        echo=monitor,
                        platform=str(options.get("resolved_platform") or "cpu"),
                        gpus=int(options.get("gpus") or 0),
                        extra_args=_rank_flags(options))
    except LaunchError as exc:
        monitor.close()
        _fail(str(exc))
        return
    finally:
        monitor.close()
    if result.code != 0:
        sys.exit(result.code)
    if not program.training:
        click.echo(f"inference on {n} rank(s) in {time.perf_counter() - start:.2f} s (JAX, "
                   f"{procs} process(es)); outputs: {program.out_dir}/rank_*/outputs.npz")
        return
    log = os.path.join(program.out_dir, "rank_0", "train.log")
    trained = result.trained
    steps_text = f"{trained} step{'s' if trained != 1 else ''}"
    if result.resumed_from:
        steps_text += (f" (steps {result.resumed_from + 1}..{len(result.losses)}, resumed "
                       f"from step {result.resumed_from})")
    click.echo(f"{steps_text} on {n} rank(s) in {time.perf_counter() - start:.2f} "
               f"s (JAX, {procs} process(es)); every rank reports the same loss; log: {log}; "
               f"checkpoints: {os.path.join(program.out_dir, 'checkpoints')}")


def _nonfinite(loss: float, step_no: int, epoch: int, in_epoch: int) -> str:
    return (f"the loss is {loss} at step {step_no} (epoch {epoch}, step {in_epoch}); stopped "
            "(--no-fail-on-nan trains on)")


def _write_logs(program: Any, lines: list[str], ranks: int) -> str | None:
    """Every rank's train.log (run outputs: kept across recompiles); rank 0's path."""
    if not program.out_dir:
        return None
    from pcompile.backends.checkpoint import atomic_write_text

    for r in range(ranks):
        atomic_write_text(os.path.join(program.out_dir, f"rank_{r}", "train.log"),
                          "\n".join(lines) + "\n" if lines else "")
    return os.path.join(program.out_dir, "rank_0", "train.log")


def _train_simulated(program: Any, steps: int, fail_on_nan: bool = True,
                     monitor: Any = None) -> None:
    """--backend numpy for a parallel plan: every rank on the numpy simulator, one process."""
    from pcompile.backends.progress import format_loss_line
    from pcompile.compiler.runtime import batches
    from pcompile.tools.oracle import single_device
    from pcompile.tools.runners import ParallelRunner

    runner = ParallelRunner(program)
    data = program if program.state.parallel_mode != "data_parallel" else single_device(program)
    if not program.training:
        _, _, arrays = next(batches(data, 1))
        outs = runner.run(arrays)
        click.echo("inference (rank 0): " + ", ".join(
            f"{n} {tuple(o.shape)}" for n, o in zip(program.output_names, outs[0])))
        return
    lines: list[str] = []
    bad = None
    for k, (epoch, step, arrays) in enumerate(batches(data, steps)):
        loss = runner.step(arrays)
        lines.append(format_loss_line(epoch, step, loss))
        (monitor or click.echo)(lines[-1])
        if fail_on_nan and not math.isfinite(float(loss)):
            bad = _nonfinite(float(loss), k + 1, epoch, step)
            break
    if monitor is not None:
        monitor.close()
    if _write_logs(program, lines, program.state.devices):
        click.echo(f"{len(lines)} steps on the numpy simulator; logs: "
                   f"{program.out_dir}/rank_*/train.log")
    if bad:
        _fail(bad)


# -- show and diff --------------------------------------------------------------------------------


def _guard(function: Any) -> Any:
    """PcompileError (plan.json refused, rank not dumped, ...) -> one message, exit 1."""
    import functools

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        from pcompile.ir.errors import PcompileError

        try:
            return function(*args, **kwargs)
        except PcompileError as exc:
            _fail(str(exc))
        except OSError as exc:
            where = f" {exc.filename}" if exc.filename else ""
            _fail(f"cannot access{where}: {exc.strerror or exc}")
    return run


@main.command("show", context_settings=CONTEXT)
@click.argument("out_dir", metavar="DIR", type=click.Path(file_okay=False, exists=True))
@click.option("--rank", type=click.IntRange(0), default=None,
              help="Whose communication to sum up (default: the first dumped rank); its "
                   "blocks are underlined in the layout grids.")
@click.option("--op", "op", default=None, metavar="NAME",
              help="Only this op (instance name like matmul2, or full name), with a layout "
                   "grid of each of its inputs.")
@click.option("--tensor", "tensors", multiple=True, metavar="NAME",
              help="Draw the layout of this parameter (repeatable; default: the weights).")
@click.option("--all-weights", is_flag=True,
              help="Draw the layout grid of every weight (default: the first 8; every "
                   "weight is listed either way).")
@click.option("--svg/--no-svg", default=True, show_default=True,
              help="Write each layout grid drawn as DIR/show/<tensor>.svg (an op's inputs "
                   "as DIR/show/<scope>.<instance>_input_<i>.svg).")
@click.option("--width", type=click.IntRange(40), default=None, metavar="COLUMNS",
              help="Lay the tables out for this many columns (default: the terminal's; "
                   "piped, COLUMNS, else the width of the terminal on stderr or stdin, else "
                   "160).")
@_verbosity
@_guard
def show_command(out_dir: str, rank: int | None, op: str | None, tensors: tuple[str, ...],
                 all_weights: bool, svg: bool, width: int | None, verbose: int,
                 quiet: bool) -> None:
    """Print the plan of the compile in DIR: a strategy table per op (strategy, scope, device
    matrix, tensor maps, slice shapes, search cost and runner-up), every weight's layout with
    grids of how they are split over the ranks, and the communication of one rank per step.
    Columns that do not fit the width are left out (and named); op and instance names never
    are."""
    from pcompile.compiler.render import console, show

    setup_logging(verbose, quiet)
    show(out_dir, rank=rank, op=op, tensors=tensors, svg=svg, all_weights=all_weights,
         out=console(width=width))


@main.command("diff", context_settings=CONTEXT)
@click.argument("out_dir", metavar="DIR", type=click.Path(file_okay=False, exists=True))
@click.option("--ranks", required=True, metavar="A,B", help="The two ranks to compare.")
@click.option("--pass", "pass_name", default="execute", show_default=True, metavar="NAME",
              help="Which pass's dumps to compare.")
@_verbosity
@_guard
def diff_command(out_dir: str, ranks: str, pass_name: str, verbose: int, quiet: bool) -> None:
    """Show where two ranks' programs differ (their dumps of one pass, as a unified diff)."""
    from pcompile.compiler.render import diff

    setup_logging(verbose, quiet)
    try:
        a, b = (int(x) for x in ranks.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two ranks like 0,5, got {ranks!r}",
                                 param_hint="--ranks") from None
    diff(out_dir, (a, b), pass_name)


if __name__ == "__main__":
    main()
