"""End-to-end compile cost by model depth, device count and search mode: one JSON object.

Each row runs the command line as a user would, in a fresh process:

    GPT_LAYERS=L GPT_BATCH=512 pcompile examples/gpt_block.py --devices D --search MODE \
        --no-check --dump-ranks 0 --out <tmp>

and reports its wall time and peak resident memory (the process's own, from wait4), plus the
size of what it wrote. A `--model 7b` row compiles a 7B-class GPT (32 layers, hidden 4096,
32 heads, vocabulary 32000, sequence 2048) the same way.

    python benchmarks/compile_scale.py                       # layers 8 32 96 x devices 8 64 512
    python benchmarks/compile_scale.py --layers 96 --devices 64 512 --modes sharding_propagation
    python benchmarks/compile_scale.py --model 7b --devices 64 512
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
GPT = os.path.join(ROOT, "examples", "gpt_block.py")
SEVEN_B = {"GPT_LAYERS": "32", "GPT_HIDDEN": "4096", "GPT_HEADS": "32", "GPT_SEQ": "2048",
           "GPT_VOCAB": "32000"}


def run(env_extra: dict[str, str], devices: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        cmd = [sys.executable, "-m", "pcompile", GPT, "--devices", str(devices), "--search",
               mode, "--no-check", "--dump-ranks", "0", "--out", out, "-q"]
        env = dict(os.environ, **env_extra, JAX_PLATFORMS="cpu")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        output = proc.stdout.read() if proc.stdout else ""
        if proc.stdout:
            proc.stdout.close()
        code = os.waitstatus_to_exitcode(status)
        written = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, files in os.walk(out) for f in files) if code == 0 else 0
    # ru_maxrss is in kilobytes on Linux.
    row = {"devices": devices, "mode": mode, "seconds": round(wall, 2),
           "peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "written_mb": round(written / 2**20, 2),
           "exit": code}
    if code != 0:
        row["error"] = output[-500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 96])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--modes", nargs="+",
                        default=["sharding_propagation", "recursive_programming"])
    parser.add_argument("--model", choices=("gpt", "7b"), default="gpt")
    args = parser.parse_args()
    rows = []
    if args.model == "7b":
        for devices in args.devices:
            for mode in args.modes:
                row = run(dict(SEVEN_B, GPT_BATCH=str(max(64, devices))), devices, mode)
                rows.append({"model": "gpt-7b", "layers": 32, **row})
    else:
        for layers in args.layers:
            for devices in args.devices:
                for mode in args.modes:
                    row = run({"GPT_LAYERS": str(layers), "GPT_BATCH": "512"}, devices, mode)
                    rows.append({"model": "gpt_block", "layers": layers, **row})
    print(json.dumps({"benchmark": "compile_scale", "cpu_count": os.cpu_count(),
                      "loadavg": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
