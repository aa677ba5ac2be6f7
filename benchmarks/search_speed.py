"""Search time of each algorithm on the GPT example by layer count and device count.

The search runs on the traced forward (+ loss) graph, as MindSpore's does (the cost model
accounts for the backward pass and the gradient communication). For each (layers, devices) the
global batch is max(8, devices) (`GPT_BATCH`) so that `dataset_strategy="data_parallel"`
divides it. Each measurement runs in its own process with a time cap; a run that exceeds the
cap is reported as such. Dynamic programming is only run where `--dp` allows it (by default 8
and 64 devices at every layer count, 512 devices at 2 layers). Candidates are enumerated with
`fully_use_devices=False` by default (every device count up to D: the largest search spaces);
`--fully-use-devices` measures the context default instead. `dp_rounds` is the number of
minimisations dynamic programming needed until its plan used exact edge costs only, and
`pair_costs` the number of redistributions planned. `search_s` is wall time, `search_cpu_s`
the process's CPU time (the search is single-threaded; on a shared host it is the steadier
number). Prints one JSON object.

    python benchmarks/search_speed.py [--layers 2 8 32 96] [--devices 8 64 512] [--cap 300]
                                      [--fully-use-devices] [--dataset full_batch]
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
from pcompile.compiler.frontend.model_file import load_model_file
from pcompile.compiler.driver.trace_model import trace_model
from pcompile.passes.search import SearchOptions, search
import pcompile.passes.search.dynamic_programming as dp
rounds = []
solve = dp.solve
def counting(cg, options):
    out = solve(cg, options)
    rounds.append(out.rounds)
    return out
dp.solve = counting
start = time.perf_counter()
graph = trace_model(load_model_file(os.path.join({root!r}, "examples", "gpt_block.py"))).graph
traced = time.perf_counter() - start
best = cpu = None
for _ in range({repeat}):
    c0 = time.process_time()
    result = search(graph, {devices}, {mode!r}, dataset_strategy={dataset!r},
                    options=SearchOptions(fully_use_devices={fully}))
    c1 = time.process_time() - c0
    best = result.seconds if best is None else min(best, result.seconds)
    cpu = c1 if cpu is None else min(cpu, c1)
cg = result.cost_graph
print(json.dumps({{
    "search_s": round(best, 4), "search_cpu_s": round(cpu, 4), "trace_s": round(traced, 4),
    "nodes": len(graph.nodes),
    "vertices": len(cg.vertices), "edges": len(cg.edges),
    "candidates": sum(len(v.candidates) for v in cg.vertices),
    "objective": round(result.objective, 1),
    "pair_costs": len(cg._pair), "searched_ops": len(result.strategies),
    "dp_rounds": rounds[-1] if rounds else None}}))
"""


def measure(layers: int, devices: int, mode: str, cap: float, repeat: int, fully: bool,
            dataset: str) -> dict:
    batch = max(8, devices) if dataset == "data_parallel" else 8
    env = dict(os.environ, GPT_LAYERS=str(layers), GPT_BATCH=str(batch))
    code = CHILD.format(root=ROOT, devices=devices, mode=mode, repeat=repeat, fully=fully,
                        dataset=dataset)
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
    parser.add_argument("--dp", nargs="*", default=["8:*", "64:*", "512:2"],
                        help="DEVICES:LAYERS pairs where dynamic programming runs (* = all)")
    parser.add_argument("--fully-use-devices", action="store_true",
                        help="candidates use all devices (the context default)")
    parser.add_argument("--dataset", default="data_parallel",
                        choices=["data_parallel", "full_batch"],
                        help="dataset_strategy (full_batch uses a batch of 8)")
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
                rows.append(measure(layers, devices, mode, args.cap, args.repeat,
                                    args.fully_use_devices, args.dataset))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "search_speed", "device": "cpu",
                      "python": sys.version.split()[0],
                      "fully_use_devices": args.fully_use_devices, "dataset": args.dataset,
                      "results": rows}, indent=1))


if __name__ == "__main__":
    main()
