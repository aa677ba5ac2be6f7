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
    python benchmarks/search_ilp.py --config llama2_70b_1024_pp8 --modes hand ilp --predict

`llama2_70b_1024_pp8`: Llama-2-70B on 1024 devices with 8 pipeline stages (LLAMA_PP=8, 16
micro-batches, one sequence per data-parallel rank and micro-batch: global batch 256); the
hand plan is dp 16 x mp 8 in every stage. (mindformers' pretrain_llama2_70b.yaml, for 32
devices: dp 2 x mp 4 x pipeline_stage 8, micro_batch_num 128, use_seq_parallel, batch_size 1,
the parallel optimizer.) `--predict` stops each compile after step_parallel_begin, where every
plan (the search's included) has predicted itself: the micro-batches' unrolled programs are
not built; the row's compile_seconds is then the time to the prediction, and `stages` the
per-stage prediction (memory per stage, bytes).
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
    # Llama-2-70B, 8 pipeline stages of 128 devices, 16 micro-batches of 16 sequences (the
    # hand plan: dp 16 x mp 8 x pp 8), 80 GB
    "llama2_70b_1024_pp8": ({"LLAMA_PRESET": "llama2_70b", "LLAMA_MP": "8", "LLAMA_PP": "8",
                             "LLAMA_MICRO": "16", "LLAMA_BATCH": "256"}, 1024, []),
}
MODES = ["hand", "ilp", "sharding_propagation", "recursive_programming", "dynamic_programming"]


#: Runs the driver up to step_parallel_begin and prints plan.json's sections as they are then
#: (one JSON line): the prediction of every plan, the search's section.
PREDICT = """
import json, sys
import pcompile.passes.step_parallel_begin as spb
from pcompile.compiler.driver.driver import compile_program

record, stop = spb.record_prediction, type("Stop", (Exception,), {})
found = {}
def keep(unit):
    record(unit)
    found.update(unit.plan)
def after(event, **info):
    if event == "pass" and info.get("name") == "step_parallel_begin":
        raise stop
spb.record_prediction = keep
try:
    compile_program(sys.argv[1], devices=int(sys.argv[2]), search_mode=sys.argv[3] or None,
                    overrides=json.loads(sys.argv[4]), on_event=after, dump=False)
except stop:
    pass
print("PLAN " + json.dumps(found, default=str))
"""


def _predict(env: dict, devices: int, mode: str, flags: list[str]) -> tuple[dict | None, str]:
    """plan.json's sections at step_parallel_begin (`PREDICT`), or None and the error."""
    overrides = {}
    for flag, value in zip(flags[::2], flags[1::2]):  # --device-memory 1e8, ...
        overrides[flag.lstrip("-").replace("-", "_").replace("device_memory",
                                                             "device_memory_capacity")] = \
            float(value)
    cmd = [sys.executable, "-c", PREDICT, LLAMA, str(devices),
           "" if mode == "hand" else mode, json.dumps(overrides)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith("PLAN "):
            return json.loads(line[len("PLAN "):]), ""
    return None, (done.stderr.strip().splitlines() or ["?"])[-1][:300]


def run(config: str, mode: str, predict: bool = False) -> dict:
    env_extra, devices, flags = CONFIGS[config]
    env = {**os.environ, **env_extra,
           "LLAMA_STRATEGIES": "hand" if mode == "hand" else "none"}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pcompile", LLAMA, "--devices", str(devices), "--out", out,
               "--dump-ranks", "0", "--no-check", "-q", *flags]
        if mode != "hand":
            cmd += ["--search", mode]
        start = time.perf_counter()
        if predict:
            plan, error = _predict(env, devices, mode, flags)
        else:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            error = (done.stderr.strip().splitlines() or ["?"])[-1][:300] \
                if done.returncode != 0 else ""
        seconds = time.perf_counter() - start
        row: dict = {"config": config, "plan": mode, "devices": devices,
                     "compile_seconds": round(seconds, 2)}
        if predict:
            row["predict_only"] = True
        if error:
            row["status"] = "error: " + error
            return row
        if not predict:
            with open(os.path.join(out, "plan.json"), encoding="utf-8") as f:
                plan = json.load(f)
    assert plan is not None
    pred = plan.get("prediction") or {}
    row.update({"status": "ok", "step_time": pred.get("step_time"),
                "compute": pred.get("compute"), "communication": pred.get("communication"),
                "bytes": pred.get("communication_bytes"), "memory": pred.get("memory"),
                "fits": pred.get("fits"),
                # what the plan itself moves: rank 0's collectives (ring bytes sent), and its
                # ratio to Megatron-LM's minimum (plan.json megatron_minimum)
                "plan_ring_bytes": None if predict else sum(
                    r["ring_bytes"] or 0 for r in plan["collectives"]["0"]
                    if r["op"] != "_MirrorOperator")})
    stages = pred.get("stages")  # under pipeline stages: the prediction of each stage
    if isinstance(stages, dict):
        row["stages"] = {k: v for k, v in stages.items() if k != "per_stage"}
        row["per_stage"] = [{"memory_gb": round(st["memory"]["total"] / 1e9, 2),
                             **{k: st[k] for k in ("compute", "communication") if k in st}}
                            for st in stages.get("per_stage", [])]
    mm = plan.get("megatron_minimum")
    if mm:
        row["megatron"] = {k: mm[k] for k in ("ratio", "ratio_to_best")}
        if mm.get("best_scheme"):
            row["megatron"]["best"] = {k: mm["best_scheme"][k] for k in ("dp", "mp")}
    search = plan.get("search") or {}
    if search.get("mode") == "ilp":
        row["mesh"] = search["mesh"]
        row["search_choices"] = {k: search.get(k) for k in ("parallel_optimizer", "recompute")}
        row["ilp"] = search["ilp"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="mid_8")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--predict", action="store_true",
                        help="stop each compile after step_parallel_begin (its prediction)")
    args = parser.parse_args()
    rows = {}
    for mode in args.modes:
        rows[mode] = run(args.config, mode, args.predict)
        print(json.dumps(rows[mode]), flush=True)
    hand, ilp = rows.get("hand"), rows.get("ilp")
    if hand and ilp and hand.get("status") == ilp.get("status") == "ok":
        print(json.dumps({
            "config": args.config,
            "ilp_over_hand": {
                "step_time": round(ilp["step_time"] / hand["step_time"], 3),
                "bytes": round(ilp["bytes"] / hand["bytes"], 3),
                "plan_ring_bytes": (round(ilp["plan_ring_bytes"] / hand["plan_ring_bytes"], 3)
                                    if hand["plan_ring_bytes"] and ilp["plan_ring_bytes"]
                                    else None),
                "weights": round(ilp["memory"]["weights"] / hand["memory"]["weights"], 3),
                "compile_seconds": round(ilp["compile_seconds"] / hand["compile_seconds"], 2)},
        }))


if __name__ == "__main__":
    main()
