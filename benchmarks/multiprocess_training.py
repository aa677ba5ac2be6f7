"""End-to-end check at scale: train each configuration as 8 real rank processes (the launcher,
gloo collectives) and on one device for the same steps, and report the worst relative
difference of the per-step losses over all ranks' train.log files.

    python benchmarks/multiprocess_training.py [--steps 20]

Prints one JSON object. Takes a few minutes on 2 cores (16 JAX processes per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [
    ("quickstart, sharding_propagation", "quickstart.py", ["--search", "sharding_propagation"]),
    ("layout_mlp, semi_auto (seed Layouts)", "layout_mlp.py", []),
    ("gpt_block, sharding_propagation", "gpt_block.py", ["--search", "sharding_propagation"]),
    ("gpt_block, dynamic_programming", "gpt_block.py", ["--search", "dynamic_programming"]),
    ("gpt_block, recursive_programming", "gpt_block.py", ["--search", "recursive_programming"]),
    ("manual_parallel, hybrid", "manual_parallel.py", []),
]


def losses(path: str) -> list[float]:
    with open(path) as f:
        return [float(line.rsplit(" ", 1)[1]) for line in f if line.strip()]


def run(model: str, devices: int, flags: list[str], out: str, steps: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), model, "--devices",
                    str(devices), *flags, "--out", out, "--run", "--steps", str(steps),
                    "--no-check"], check=True, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, example, flags in CONFIGS:
            model = os.path.join(ROOT, "examples", example)
            par, one = os.path.join(tmp, "par"), os.path.join(tmp, "one")
            seconds = run(model, 8, flags, par, args.steps)
            run(model, 1, [], one, args.steps)
            ref = losses(os.path.join(one, "rank_0", "train.log"))
            worst = 0.0
            for rank in range(8):
                got = losses(os.path.join(par, f"rank_{rank}", "train.log"))
                assert len(got) == len(ref) == args.steps
                worst = max(worst, max(abs(a - b) / max(abs(b), 1e-12)
                                       for a, b in zip(got, ref)))
            rows.append({"config": name, "ranks": 8, "steps": args.steps,
                         "worst_relative_loss_difference": worst,
                         "first_loss": ref[0], "last_loss": ref[-1],
                         "parallel_run_s": round(seconds, 1)})
    print(json.dumps({"benchmark": "multiprocess_training", "results": rows}, indent=1))


if __name__ == "__main__":
    main()
