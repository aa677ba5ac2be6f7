"""`--search ilp` next to MindSpore's three searches and the hand (mindformers) plan, on
`examples/llama.py` with every shard() removed (LLAMA_STRATEGIES=none, full_batch).

For each config and plan: the prediction every plan records (plan.json `prediction`, the cost
model in seconds of passes/search/time_model.py on the config's device profile): step time,
bytes a rank moves per step, memory per rank by kind, whether it fits; the compile time and
the search pass's time; what the plan moves (rank 0's collectives, ring bytes sent:
`plan_ring_bytes`) and its ratio to Megatron-LM's minimum (`megatron`). One JSON object per
line, then a summary line with the ilp plan's ratios to the hand plan.

    python benchmarks/search_ilp.py                       # the 4-layer config (seconds)
    python benchmarks/search_ilp.py --config llama2_7b_64  # Llama-2-7B widths, 64 devices
    python benchmarks/search_ilp.py --modes ilp hand      # only these plans
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
LLAMA = os.path.join(ROOT, "examples", "llama.py")

CONFIGS = {
    # 4 layers, hidden 512, global batch 2 on 8 devices; 100 MB per device (the ilp plan is
    # the same with 80 GB; the hand plan's 101 MB does not fit)
    "mid_8": ({"LLAMA_LAYERS": "4", "LLAMA_HIDDEN": "512", "LLAMA_FFN": "1408",
               "LLAMA_VOCAB": "4096", "LLAMA_SEQ": "128", "LLAMA_BATCH": "2",
               "LLAMA_MP": "4"}, 8, ["--device-memory", "1e8"]),
    # Llama-2-7B widths, global batch 8, 64 devices, 80 GB (the hand plan: dp 8 x mp 8)
    "llama2_7b_64": ({"LLAMA_PRESET": "llama2_7b", "LLAMA_MP": "8"}, 64, []),
}
MODES = ["hand", "ilp", "sharding_propagation", "recursive_programming", "dynamic_programming"]


def run(config: str, mode: str) -> dict:
    env_extra, devices, flags = CONFIGS[config]
    env = {**os.environ, **env_extra,
           "LLAMA_STRATEGIES": "hand" if mode == "hand" else "none"}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pcompile", LLAMA, "--devices", str(devices), "--out", out,
               "--dump-ranks", "0", "--no-check", "-q", *flags]
        if mode != "hand":
            cmd += ["--search", mode]
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        seconds = time.perf_counter() - start
        row: dict = {"config": config, "plan": mode, "devices": devices,
                     "compile_seconds": round(seconds, 2)}
        if done.returncode != 0:
            row["status"] = "error: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]
            return row
        with open(os.path.join(out, "plan.json"), encoding="utf-8") as f:
            plan = json.load(f)
    pred = plan.get("prediction") or {}
    row.update({"status": "ok", "step_time": pred.get("step_time"),
                "compute": pred.get("compute"), "communication": pred.get("communication"),
                "bytes": pred.get("communication_bytes"), "memory": pred.get("memory"),
                "fits": pred.get("fits"),
                # what the plan itself moves: rank 0's collectives (ring bytes sent), and its
                # ratio to Megatron-LM's minimum (plan.json megatron_minimum)
                "plan_ring_bytes": sum(r["ring_bytes"] or 0 for r in plan["collectives"]["0"]
                                       if r["op"] != "_MirrorOperator")})
    mm = plan.get("megatron_minimum")
    if mm:
        row["megatron"] = {k: mm[k] for k in ("ratio", "ratio_to_best")}
        if mm.get("best_scheme"):
            row["megatron"]["best"] = {k: mm["best_scheme"][k] for k in ("dp", "mp")}
    search = plan.get("search") or {}
    if search.get("mode") == "ilp":
        row["mesh"] = search["mesh"]
        row["ilp"] = search["ilp"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="mid_8")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    args = parser.parse_args()
    rows = {}
    for mode in args.modes:
        rows[mode] = run(args.config, mode)
        print(json.dumps(rows[mode]), flush=True)
    hand, ilp = rows.get("hand"), rows.get("ilp")
    if hand and ilp and hand.get("status") == ilp.get("status") == "ok":
        print(json.dumps({
            "config": args.config,
            "ilp_over_hand": {
                "step_time": round(ilp["step_time"] / hand["step_time"], 3),
                "bytes": round(ilp["bytes"] / hand["bytes"], 3),
                "plan_ring_bytes": round(ilp["plan_ring_bytes"] / hand["plan_ring_bytes"], 3),
                "weights": round(ilp["memory"]["weights"] / hand["memory"]["weights"], 3),
                "compile_seconds": round(ilp["compile_seconds"] / hand["compile_seconds"], 2)},
        }))


if __name__ == "__main__":
    main()
