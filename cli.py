"""`pcompile MODEL.py --devices N --search MODE`: the command line. Thin: parse the options
(the run's into a typed `backends.run_options.RunOptions`), call `tools` (`tools.command`
compiles, checks and runs), print.

Commands: `pcompile [compile] MODEL.py ...` (compile is the default: `pcompile MODEL.py` works
as it always did), `pcompile show DIR`, `pcompile diff DIR --ranks A,B`; `pcompile --version`.
Progress goes through the `logging` module (logger `pcompile`) to stderr: shown when stderr is
a terminal, or with `-v`; `-q` keeps only warnings, errors and results.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from typing import Any

import click

from pcompile import __version__
from pcompile.program.progress import setup_logging

# At exit the interpreter runs one last full garbage collection over everything still alive: a
# compile's graphs (their use lists are cycles) and memo tables, about a second for a 96-layer
# model, to free memory the process is about to give back anyway. Freezing moves every object
# out of the collector's sight first; the other exit handlers and file flushes run as usual.
atexit.register(gc.freeze)

SEARCH_MODES = (
    "sharding_propagation", "dynamic_programming", "recursive_programming", "ilp")
PARALLEL_MODES = ("stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel",
                  "auto_parallel")


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"pcompile: error: {message}", err=True)
    sys.exit(code)


def _guard(function: Any) -> Any:
    """PcompileError (plan.json refused, rank not dumped, a check failed, ...), a file the system
    refused, an invalid option in the model file -> one message, exit 1."""
    import functools

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        from pcompile.ir.errors import PcompileError

        try:
            return function(*args, **kwargs)
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
    return run


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


@click.group(cls=_DefaultGroup, context_settings=CONTEXT, invoke_without_command=False,
             no_args_is_help=True)
@click.version_option(__version__, "--version", prog_name="pcompile",
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
@_guard
def compile_command(model: str, do_run: bool, verbose: int, quiet: bool, **flags: Any) -> None:
    """Compile MODEL.py into per-rank execution plans and dump the IR of every pass."""
    setup_logging(verbose, quiet)
    from dataclasses import fields

    from pcompile.backends.run_options import RunOptions
    from pcompile.tools.command import CheckOptions, compile_check_run

    _check_run_flags(do_run)
    overrides = {key: value for key, value in (
        ("dataset_strategy", _parse_dataset_strategy(flags["dataset_strategy"])),
        ("pipeline_stages", flags["pipeline_stages"]), ("device_profile", flags["device_profile"]),
        ("device_memory_capacity", flags["device_memory"])) if value is not None}
    paths = {key: os.path.abspath(flags[key]) if flags[key] else None
             for key in ("tensorboard", "profile_dir")}
    run = RunOptions(**{**{f.name: flags[f.name] for f in fields(RunOptions) if f.name in flags},
                        **paths})
    compile_args = {"devices": flags["devices"], "parallel_mode": flags["parallel_mode"],
                    "search_mode": flags["search"], "out_dir": flags["out_dir"],
                    "overrides": overrides, "dump_ranks": flags["dump_ranks"],
                    "save_graphs": flags["save_graphs"]}
    check = CheckOptions(flags["check"], flags["check_shrunk"], flags["force_check"])
    code = compile_check_run(model, compile_args, check, run if do_run else None, quiet=quiet,
                             echo=click.echo)
    if code:
        sys.exit(code)


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


def _from_options(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith((os.path.join("compiler", "context.py"),
                                                    os.path.join("compiler",
                                                                 "search_context.py"))):
            return True
        tb = tb.tb_next
    return False


# -- show and diff --------------------------------------------------------------------------------


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
    from pcompile.tools.render import console, show

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
    from pcompile.tools.render import diff

    setup_logging(verbose, quiet)
    try:
        a, b = (int(x) for x in ranks.split(","))
    except ValueError:
        raise click.BadParameter(f"expected two ranks like 0,5, got {ranks!r}",
                                 param_hint="--ranks") from None
    diff(out_dir, (a, b), pass_name)


if __name__ == "__main__":
    main()
