"""The parallel core's cost: time of step_parallel_begin + step_parallel_end (per-rank graphs)
for the GPT-style example at 8 and 32 layers on 8 and 64 devices (semi_auto_parallel with
default strategies; the global batch is max(8, devices)), and the bytes each rank communicates
per training step for every example.

    python benchmarks/parallel_compile.py [--layers 8 32] [--devices 8 64]

Prints one JSON object. Bytes count every collective of a rank's final (execute) graph — forward,
redistribution and gradient communication — as the size of its input on that rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pcompile.ir.registry import get_op  # noqa: E402
from pcompile.tools.compile import compile as compile_model  # noqa: E402

EXAMPLES = ["quickstart.py", "layout_mlp.py", "dense_gelu_blocks.py", "gpt_block.py"]


def comm_bytes(program) -> dict:
    per_rank = []
    for graph in program.rank_graphs:
        total = 0
        count = 0
        for node in graph.nodes:
            if get_op(node.op).collective:
                total += sum(v.tensor_type.nbytes for v in node.operands)
                count += 1
        per_rank.append((total, count))
    return {"max_bytes_per_rank": max(b for b, _ in per_rank),
            "collectives_per_rank": max(c for _, c in per_rank)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    timing = []
    for layers in args.layers:
        os.environ["GPT_LAYERS"] = str(layers)
        for devices in args.devices:
            os.environ["GPT_BATCH"] = str(max(8, devices))
            start = time.perf_counter()
            program = compile_model(os.path.join(ROOT, "examples", "gpt_block.py"),
                                    devices=devices, parallel_mode="semi_auto_parallel",
                                    dump=False)
            total = time.perf_counter() - start
            passes = dict(program.timings)
            timing.append({
                "layers": layers,
                "devices": devices,
                "step_parallel_begin_s": round(passes["step_parallel_begin"], 4),
                "step_parallel_end_s": round(passes["step_parallel_end"], 4),
                "autodiff_s": round(passes["autodiff"], 4),
                "optimizer_s": round(passes["optimizer"], 4),
                "compile_total_s": round(total, 3),
                "forward_nodes": len(program.graph.nodes),
                "rank_graph_nodes": len(program.rank_graphs[0].nodes),
            })
    os.environ["GPT_LAYERS"] = "2"
    os.environ["GPT_BATCH"] = "8"
    traffic = []
    for example in EXAMPLES:
        # layout_mlp keeps its own mode; dense_gelu_blocks uses Cell.shard, which needs
        # sharding propagation; the others are compiled in semi_auto_parallel.
        mode = ({} if example == "layout_mlp.py"
                else {"search_mode": "sharding_propagation"}
                if example == "dense_gelu_blocks.py" else {"parallel_mode": "semi_auto_parallel"})
        program = compile_model(os.path.join(ROOT, "examples", example), devices=8,
                                dump=False, **mode)
        traffic.append({"example": example, "devices": 8, **comm_bytes(program)})
    print(json.dumps({"benchmark": "parallel_compile", "timing": timing,
                      "communication_per_step": traffic}, indent=1))


if __name__ == "__main__":
    main()
