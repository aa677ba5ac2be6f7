"""Subprocess half of tests/backends/test_pipeline_jax.py's 8-process check: one process of a
`jax.distributed` job that trains several compiled pipeline programs one after the other
(`rank_runtime.main` with a sequence of programs: one start-up for all of them), each
writing its own `<out>/rank_<r>/train.log` and final checkpoint.

    python -m tests.pipeline_processes OUT [OUT ...] -- --coordinator HOST:PORT \\
        --num-processes 8 --process-id I --steps 20
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def load(out_dir: str, index: int) -> ModuleType:
    """`<out_dir>/program.py` as a module of its own name (the programs share their names)."""
    return load_program(os.path.join(out_dir, "program.py"), f"pipeline_program_{index}")


def load_program(path: str, name: str) -> ModuleType:
    """The rank program at `path`, imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    split = sys.argv.index("--")
    outs, argv = sys.argv[1:split], sys.argv[split + 1:]
    from pcompile.backends.jax.rank_runtime import main as run

    return run([load(out, i) for i, out in enumerate(outs)], argv)


if __name__ == "__main__":
    sys.exit(main())
