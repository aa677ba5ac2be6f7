"""The compiler's driver room: `compile_program()` (driver.py: orders the passes, gives each its
options, verifies, times and dumps), the front end's passes that run user code
(front_passes.py, trace_model.py, pipelining.py), the compile state and `CompiledProgram`
(compiled.py) with what it hands on (parameter_layout.py, pinned_plan.py, runtime.py,
data_checks.py, flops.py), plan.json (plan.py), strategy files and the output folder
(strategy_files.py, outdir.py). It imports the front end and the configuration; neither imports
it.

`pcompile.compiler.driver.compile_program` (the documented entry point under
`pcompile.compile`) is loaded on first use, so importing one module of this room (say
`runtime`) does not load the driver."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "compile_program":
        from pcompile.compiler.driver.driver import compile_program

        return compile_program
    raise AttributeError(f"module 'pcompile.compiler.driver' has no attribute {name!r}")
