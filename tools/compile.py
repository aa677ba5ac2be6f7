"""Compile and write: `compile` runs the driver (`compiler.driver.compile_program`) and writes what
it returns; `write_outputs` writes a compiled program's dumps, `plan.json` and rank programs.
The strategy checkpoint `strategy_ckpt_config` names is written by `compile` too, with or
without dumps (compiler/driver/strategy_files.py).

Everything is written through `compiler.outdir`: beside the output folder first and swapped in when
complete, so a failed compile or write leaves `--out` as it was; only what an earlier compile wrote
is replaced, run outputs survive, a folder holding anything else is refused."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pcompile.compiler.driver.compiled import CompiledProgram, CompileState, ReferenceOptions
from pcompile.compiler.driver.driver import compile_program
from pcompile.compiler.driver.plan import build_plan, write_plan
from pcompile.compiler.driver.strategy_files import save_checkpoint
from pcompile.ir.dot import graph_to_dot
from pcompile.ir.parser import parse_graph
from pcompile.ir.printer import print_graph


def compile(  # noqa: A001  (the public name DESIGN.md gives it: `pcompile.compile`)
    model_path: str,
    *,
    devices: int | None = None,
    parallel_mode: str | None = None,
    search_mode: str | None = None,
    out_dir: str | None = None,
    dump: bool = True,
    overrides: dict[str, Any] | None = None,
    dump_ranks: Any = None,
    save_graphs: int | None = None,
    reference: ReferenceOptions | None = None,
    shrink: Any = None,
    trace_only: bool = False,
    before_write: Callable[[CompileState, str | None], None] | None = None,
    on_event: Callable[..., None] | None = None,
) -> CompiledProgram:
    """Compile a model file and write its outputs into the program's `out_dir`; none with
    `dump=False`. The options up to `trace_only` are those of `compiler.driver.compile_program`:
    `devices`, `parallel_mode`, `search_mode` (flags over what the model file sets),
    `out_dir` (default: the model file's `save_graphs_path`, else ./saved_graph), `overrides`
    (auto-parallel context keys), `dump_ranks` ("all", "none", "0,5"), `save_graphs` (0-3),
    `reference` and `shrink` (the oracle's and the shrunk check's compiles), `trace_only`.

    `before_write(state, out_dir)` runs after the passes and before anything is written (the
    CLI checks its run options there, so a bad one leaves `--out` untouched).
    `on_event(event, **info)` hears of the compile's progress: the driver's "pass" events,
    then "write" (out_dir, ranks) before the outputs are written and "written" (out_dir)
    after."""
    program = compile_program(
        model_path, devices=devices, parallel_mode=parallel_mode, search_mode=search_mode,
        out_dir=out_dir, dump=dump, overrides=overrides, dump_ranks=dump_ranks,
        on_event=on_event, save_graphs=save_graphs, reference=reference, shrink=shrink,
        trace_only=trace_only)
    if before_write is not None:
        before_write(program.state, program.out_dir)
    if not trace_only:  # strategy_ckpt_config's save_file, written whether or not dumped
        save_checkpoint(program.state)
    out_dir = program.out_dir
    if out_dir is not None:
        notify = on_event or (lambda event, **info: None)
        notify("write", out_dir=out_dir, ranks=len(program.state.dump_ranks))
        write_outputs(program, out_dir)
        notify("written", out_dir=out_dir)
    program.dumps = []  # written: the texts are not kept with the program
    return program


def write_outputs(program: CompiledProgram, out_dir: str) -> None:
    """The program's dumps, plan.json and rank programs, written into `out_dir` through
    compiler/driver/outdir.py."""
    from pcompile.backends.jax.codegen import write_rank_artifacts
    from pcompile.compiler.driver.outdir import write_output_folder

    state = program.state
    with write_output_folder(out_dir) as tmp:
        for r in state.dump_ranks:
            os.makedirs(os.path.join(tmp, f"rank_{r}"))
        check = bool(os.environ.get("PCOMPILE_CHECK_ROUNDTRIP"))
        for dump in program.dumps:
            filename = dump.filename
            for r, text in dump.texts.items():
                # the test suite sets this: every dump it produces must re-parse exactly
                if check and print_graph(parse_graph(text, filename)) != text:
                    raise AssertionError(f"{filename} does not round-trip")
                with open(os.path.join(tmp, f"rank_{r}", filename), "w", encoding="utf-8") as f:
                    f.write(text)
                if state.options.save_graphs == 3:  # MindSpore's level 3: .dot files
                    with open(os.path.join(tmp, f"rank_{r}", filename[:-3] + ".dot"), "w",
                              encoding="utf-8") as f:
                        f.write(graph_to_dot(parse_graph(text, filename)))
        write_plan(os.path.join(tmp, "plan.json"), build_plan(state))
        write_rank_artifacts(tmp, program.rank_program)  # program.py, consts.npz, params.json
