"""Per-rank bytes of parameters + optimizer state with and without the parallel optimizer.

    python benchmarks/parallel_optimizer_memory.py

The 784-512-512-10 MLP of examples/layout_mlp.py without its Layout strategies (every weight
data parallel on 8 ranks), Momentum (one state tensor per parameter), threshold 64 KB. Prints
one JSON object: bytes per rank for each parameter and its state, and the totals.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pcompile.tools.compile import compile as compile_model  # noqa: E402


def per_rank_bytes(program) -> dict[str, int]:
    return {p.name: p.tensor_type.nbytes for p in program.rank_graphs[0].params
            if p.kind != "input"}


def main() -> None:
    source = open(os.path.join(ROOT, "examples", "layout_mlp.py")).read()
    for name in ("matmul1", "relu1", "matmul2", "relu2"):
        source = source.replace(f"    net.{name}.shard", f"    # net.{name}.shard")
    source = source.replace("nn.SGD(params, 1e-2)", "nn.Momentum(params, 1e-2, 0.9)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mlp.py")
        with open(path, "w") as f:
            f.write(source)
        rows = {}
        for enabled in (False, True):
            program = compile_model(path, devices=8, parallel_mode="semi_auto_parallel",
                                    dump=False,
                                    overrides={"enable_parallel_optimizer": enabled})
            rows[enabled] = per_rank_bytes(program)
    off, on = rows[False], rows[True]
    print(json.dumps({
        "benchmark": "parallel_optimizer_memory",
        "devices": 8,
        "per_tensor_bytes_per_rank": {k: {"off": off[k], "on": on[k],
                                          "ratio": round(off[k] / on[k], 2)} for k in off},
        "total_bytes_per_rank": {"off": sum(off.values()), "on": sum(on.values()),
                                 "ratio": round(sum(off.values()) / sum(on.values()), 2)},
    }, indent=1))


if __name__ == "__main__":
    main()
