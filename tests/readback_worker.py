"""Subprocess half of tests/backends/test_device_resident.py's rank-program read-back test: runs
a one-rank `program.py` in this process (`rank_runtime.main`) with every step call and every
loss read-back recorded, and prints the events as JSON on its last line.

    python -m tests.readback_worker OUT/program.py --steps 5 --log-every 3 --no-checkpoint
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pcompile.backends.jax import rank_loop, spmd
from tests.pipeline_processes import load_program


def main() -> int:
    events: list[str] = []
    step_of: dict[int, int] = {}  # id(a step's output) -> its call number
    keep: list[Any] = []  # the outputs, alive so that their ids stay theirs
    real_function = rank_loop.RankRunner._function
    real_pieces = spmd.local_pieces

    class Recorded:
        """The jitted step, its calls recorded (its attributes are the step's)."""

        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fn, name)

        def __call__(self, *arrays: Any) -> Any:
            k = sum(e.startswith("call") for e in events) + 1
            events.append(f"call {k}")
            outs = self.fn(*arrays)
            keep.append(outs)
            step_of.update((id(o), k) for o in outs)
            return outs

    def function(self: Any, donate: bool = False) -> Any:
        return Recorded(real_function(self, donate))

    def local_pieces(value: Any, mesh: Any, shape: Any) -> Any:
        read = f"read {step_of.get(id(value))}"
        if id(value) in step_of and read not in events:  # the first read of that step's
            events.append(read)
        return real_pieces(value, mesh, shape)

    rank_loop.RankRunner._function = function  # type: ignore[method-assign]
    spmd.local_pieces = local_pieces  # type: ignore[assignment]
    from pcompile.backends.jax.rank_runtime import main as run

    code = run(load_program(sys.argv[1], "readback_program"), sys.argv[2:])
    print(json.dumps(events))
    return code


if __name__ == "__main__":
    sys.exit(main())
