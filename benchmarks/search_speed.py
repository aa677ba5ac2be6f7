"""Search time of each algorithm on the GPT example by layer count and device count.

The search runs on the traced forward (+ loss) graph, as MindSpore's does (the cost model
accounts for the backward pass and the gradient communication). For each (layers, devices) the
global batch is max(8, devices) (`GPT_BATCH`) so that `dataset_strategy="data_parallel"`
divides it. Each measurement runs in its own process with a time cap; a run that exceeds the
cap is reported as such. Dynamic programming is only run where `--dp` allows it (by default 8
devices at every layer count and 64 devices at 2 layers). Prints one JSON object.

    python benchmarks/search_speed.py [--layers 2 8 32 96] [--devices 8 64 512] [--cap 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming")

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
from pcompile.compiler.model_file import load_model_file
from pcompile.compiler.trace_model import trace_model
from pcompile.passes.search import search
start = time.perf_counter()
graph = trace_model(load_model_file(os.path.join({root!r}, "examples", "gpt_block.py"))).graph
traced = time.perf_counter() - start
best = None
for _ in range({repeat}):
    result = search(graph, {devices}, {mode!r}, dataset_strategy="data_parallel")
    best = result.seconds if best is None else min(best, result.seconds)
cg = result.cost_graph
print(json.dumps({{
    "search_s": round(best, 4), "trace_s": round(traced, 4), "nodes": len(graph.nodes),
    "vertices": len(cg.vertices), "edges": len(cg.edges),
    "candidates": sum(len(v.candidates) for v in cg.vertices),
    "objective": round(result.objective, 1),
    "pair_costs": len(cg._pair), "searched_ops": len(result.strategies)}}))
"""


def measure(layers: int, devices: int, mode: str, cap: float, repeat: int) -> dict:
    env = dict(os.environ, GPT_LAYERS=str(layers), GPT_BATCH=str(max(8, devices)))
    code = CHILD.format(root=ROOT, devices=devices, mode=mode, repeat=repeat)
    row: dict = {"layers": layers, "devices": devices, "mode": mode}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=cap)
    except subprocess.TimeoutExpired:
        row["status"] = f"over the {cap:.0f} s cap"
        return row
    if done.returncode != 0:
        row["status"] = "error: " + done.stderr.strip().splitlines()[-1][:300]
        return row
    row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    row["status"] = "ok"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 96])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--cap", type=float, default=300.0, help="seconds per measurement")
    parser.add_argument("--repeat", type=int, default=1, help="searches per process (best)")
    parser.add_argument("--dp", nargs="*", default=["8:*", "64:2"],
                        help="DEVICES:LAYERS pairs where dynamic programming runs (* = all)")
    args = parser.parse_args()
    allowed = [tuple(x.split(":")) for x in args.dp]

    def dp_runs(layers: int, devices: int) -> bool:
        return any(d == str(devices) and (n == "*" or n == str(layers)) for d, n in allowed)

    rows = []
    for devices in args.devices:
        for layers in args.layers:
            for mode in MODES:
                if mode == "dynamic_programming" and not dp_runs(layers, devices):
                    rows.append({"layers": layers, "devices": devices, "mode": mode,
                                 "status": "not run (see --dp)"})
                    continue
                rows.append(measure(layers, devices, mode, args.cap, args.repeat))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "search_speed", "device": "cpu",
                      "python": sys.version.split()[0], "results": rows}, indent=1))


if __name__ == "__main__":
    main()
