"""Compile time and peak host memory of `examples/deepseek.py` at real sizes: one JSON object.

Each row runs the command line as a user would, in a fresh process:

    DEEPSEEK_PRESET=v3_671b DEEPSEEK_MP=4 DEEPSEEK_EP=8 DEEPSEEK_GROUPS=<dp> [DEEPSEEK_MICRO=m] \\
        pcompile examples/deepseek.py --devices 2048 --no-check --dump-ranks 0 --out <tmp>

and reports its wall time, the CPU time and peak resident memory of the process (from wait4),
the size of what it wrote, the compile's own pass timings and the plan's prediction
(plan.json's `prediction`: per-device memory by kind, step time). Configurations (the yaml's
DeepSeek-V3: 61 layers, hidden 7168, 128 heads, MLA ranks 1536 / 512, 256 routed experts top 8,
1 shared, vocabulary 129280, sequence 4096, global batch 1024; mp 4, ep 8, one routing group
per data-parallel rank and micro-batch):

* `v3_671b`: the preset's defaults, mindformers' pretraining yaml: 16 pipeline stages (dp 32 on
  2048 devices), 32 micro-batches, the yaml's layer offset, the parallel optimizer. Its
  micro-batches are unrolled (32 copies of each stage's program, about 20 times the compile of
  the model without stages): by default only its prediction is taken (`predict`: the command
  stopped after step_parallel_begin, where every plan predicts itself);
* `v3_671b_micro2`: the same plan with 2 micro-batches (a full compile: rank 0's stage);
* `v3_671b_no_pp`: no pipeline stages and no parallel optimizer (dp 512: the preset before the
  yaml's stages);
* `v3_671b_4layers`: its first 4 layers (3 dense, 1 MoE), no stages;
* `tiny`: the default model on 8 devices.

    python benchmarks/deepseek_compile.py           # the rows above at 2048 devices, tiny @ 8
    python benchmarks/deepseek_compile.py --config v3_671b_no_pp --devices 2048
    python benchmarks/deepseek_compile.py --config v3_671b --full   # the yaml's plan compiled

The issue's target for v3_671b on 2048 devices is under 15 s and 2 GB on this machine. Nothing
is asserted: the numbers go to docs/deepseek.md and docs/benchmarks.md.
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
DEEPSEEK = os.path.join(ROOT, "examples", "deepseek.py")
CONFIGS = {
    "v3_671b": {"DEEPSEEK_PRESET": "v3_671b", "DEEPSEEK_MP": "4", "DEEPSEEK_EP": "8"},
    "v3_671b_micro2": {"DEEPSEEK_PRESET": "v3_671b", "DEEPSEEK_MP": "4", "DEEPSEEK_EP": "8",
                       "DEEPSEEK_MICRO": "2"},
    "v3_671b_no_pp": {"DEEPSEEK_PRESET": "v3_671b", "DEEPSEEK_MP": "4", "DEEPSEEK_EP": "8",
                      "DEEPSEEK_PP": "1", "DEEPSEEK_PARALLEL_OPTIMIZER": "0"},
    "v3_671b_4layers": {"DEEPSEEK_PRESET": "v3_671b", "DEEPSEEK_LAYERS": "4",
                        "DEEPSEEK_MP": "4", "DEEPSEEK_EP": "8", "DEEPSEEK_PP": "1"},
    "tiny": {},
}
#: (config, devices, prediction only)
DEFAULT_ROWS = [("v3_671b", 2048, True), ("v3_671b_micro2", 2048, False),
                ("v3_671b_no_pp", 2048, False), ("tiny", 8, False)]

#: Runs the driver up to step_parallel_begin and prints the plan's prediction (one JSON line).
PREDICT = """
import json, sys
import pcompile.passes.step_parallel_begin as spb
from pcompile.compiler.driver.driver import compile_program

record, stop = spb.record_prediction, type("Stop", (Exception,), {})
found = {}
def keep(unit):
    record(unit)
    found.update(unit.plan["prediction"])
def after(event, **info):
    if event == "pass" and info.get("name") == "step_parallel_begin":
        raise stop
spb.record_prediction = keep
try:
    compile_program(sys.argv[1], devices=int(sys.argv[2]), on_event=after, dump=False)
except stop:
    pass
print("PREDICTION " + json.dumps(found))
"""


def _env(config: str, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPSEEK_", "LLAMA_"))}
    env.update(CONFIGS[config], JAX_PLATFORMS="cpu")
    if config != "tiny":  # one routing group per data-parallel rank, as mindformers
        stages = int(env.get("DEEPSEEK_PP", "16"))
        env["DEEPSEEK_GROUPS"] = str(devices // (int(env["DEEPSEEK_MP"]) * stages))
    return env


def _memory(prediction: dict) -> dict:
    memory = prediction.get("memory", {})
    return {k: round(v / 1e9, 2) for k, v in memory.items()}


def run(config: str, devices: int, predict_only: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        if predict_only:
            cmd = [sys.executable, "-c", PREDICT, DEEPSEEK, str(devices)]
        else:
            cmd = [sys.executable, "-m", "pcompile", DEEPSEEK, "--devices", str(devices),
                   "--no-check", "--dump-ranks", "0", "--out", out]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=_env(config, devices), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=tmp)
        output = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if proc.stdout:
            proc.stdout.close()
        code = os.waitstatus_to_exitcode(status)
        written = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, files in os.walk(out) for f in files) if code == 0 else 0
        prediction: dict = {}
        plan = os.path.join(out, "plan.json")
        if code == 0 and os.path.exists(plan):
            with open(plan) as f:
                prediction = json.load(f).get("prediction", {})
    passes = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "pass" and parts[3] == "ms":
            passes[parts[1]] = float(parts[2])
        elif line.startswith("PREDICTION "):
            prediction = json.loads(line[len("PREDICTION "):])
    # ru_maxrss is in kilobytes on Linux.
    row = {"config": config, "devices": devices, "predict_only": predict_only,
           "seconds": round(wall, 2), "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
           "pass_seconds": round(sum(passes.values()) / 1000, 2),
           "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
           "written_mb": round(written / 2**20, 2), "pass_ms": passes,
           "predicted_gb_per_device": _memory(prediction),
           "predicted_step_s": prediction.get("step_time"), "exit": code}
    pipeline = prediction.get("stages")  # the per-stage prediction under pipeline stages
    if isinstance(pipeline, dict):
        row["pipeline"] = {k: v for k, v in pipeline.items() if k != "per_stage"}
        row["predicted_gb_per_stage"] = [round(s["memory"]["total"] / 1e9, 1)
                                         for s in pipeline.get("per_stage", [])]
    if code != 0:
        row["error"] = output[-800:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--devices", type=int, nargs="+")
    parser.add_argument("--full", action="store_true",
                        help="compile v3_671b in full instead of taking its prediction only")
    args = parser.parse_args()
    if args.config:
        rows = [(c, d, c == "v3_671b" and not args.full) for c in args.config
                for d in (args.devices or [2048])]
    else:
        rows = [(c, d, p and not args.full) for c, d, p in DEFAULT_ROWS]
    result: dict = {"benchmark": "deepseek_compile", "cpu_count": os.cpu_count(),
                    "loadavg_before": os.getloadavg(),
                    "rows": [run(c, d, p) for c, d, p in rows]}
    result["loadavg"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
