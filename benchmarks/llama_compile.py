"""Compile time and peak host memory of `examples/llama.py` at real sizes: one JSON object.

Each row runs the command line as a user would, in a fresh process:

    LLAMA_PRESET=llama3_8b LLAMA_BATCH=64 pcompile examples/llama.py --devices 64 \\
        --no-check --dump-ranks 0 --out <tmp> -q

and reports its wall time, the peak resident memory of the process (from wait4), the size of
what it wrote, and the compile's own pass timings (`--profile` adds a cProfile of the slowest
functions, run in-process). Configurations:

* `llama3_8b`: the preset (32 layers, hidden 4096, 32 heads, 8 kv heads, FFN 14336, vocabulary
  128256, sequence 8192), bf16 compute, flash attention, global batch 64 (or one sample per
  data-parallel rank where there are more: 128 on 512 devices);
* `llama2_7b`: the preset (sequence 4096), global batch 64;
* `small`: 8 layers, hidden 512, 8 heads, FFN 1536, vocabulary 1024, sequence 256, batch 32
  (28M parameters).

    python benchmarks/llama_compile.py                                 # llama3_8b @ 64, small @ 32
    python benchmarks/llama_compile.py --config llama2_7b --devices 64
    python benchmarks/llama_compile.py --config llama3_8b --devices 64 --profile

Nothing is asserted: the numbers go to docs/benchmarks.md.
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
sys.path.insert(0, os.path.dirname(ROOT))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
CONFIGS = {
    "llama3_8b": {"LLAMA_PRESET": "llama3_8b", "LLAMA_BATCH": "64"},
    "llama2_7b": {"LLAMA_PRESET": "llama2_7b", "LLAMA_BATCH": "64"},
    "small": {"LLAMA_LAYERS": "8", "LLAMA_HIDDEN": "512", "LLAMA_HEADS": "8",
              "LLAMA_KV_HEADS": "8", "LLAMA_FFN": "1536", "LLAMA_VOCAB": "1024",
              "LLAMA_SEQ": "256", "LLAMA_BATCH": "32"},
}
DEFAULT_ROWS = [("llama3_8b", 64), ("small", 32)]


def run(config: str, devices: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        cmd = [sys.executable, "-m", "pcompile", LLAMA, "--devices", str(devices),
               "--no-check", "--dump-ranks", "0", "--out", out]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
        env.update(CONFIGS[config], JAX_PLATFORMS="cpu")
        # at least one sample per data-parallel rank (dp = devices / mp, mp 4)
        env["LLAMA_BATCH"] = str(max(int(env["LLAMA_BATCH"]), devices // 4))
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=tmp)
        output = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if proc.stdout:
            proc.stdout.close()
        code = os.waitstatus_to_exitcode(status)
        written = sum(os.path.getsize(os.path.join(d, f))
                      for d, _, files in os.walk(out) for f in files) if code == 0 else 0
    passes = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "pass" and parts[3] == "ms":
            passes[parts[1]] = float(parts[2])
    # ru_maxrss is in kilobytes on Linux.
    row = {"config": config, "devices": devices, "seconds": round(wall, 2),
           "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
           "written_mb": round(written / 2**20, 2), "pass_ms": passes, "exit": code}
    if code != 0:
        row["error"] = output[-800:]
    return row


def profile(config: str, devices: int, top: int) -> list[str]:
    """The `top` functions by cumulative time of one in-process compile."""
    import cProfile
    import io
    import pstats

    os.environ.update(CONFIGS[config])
    from pcompile.tools.compile import compile as compile_model

    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        prof.enable()
        compile_model(LLAMA, devices=devices, out_dir=os.path.join(tmp, "out"), dump_ranks="0")
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append")
    parser.add_argument("--devices", type=int, nargs="+")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if args.config:
        rows = [(c, d) for c in args.config for d in (args.devices or [64])]
    else:
        rows = DEFAULT_ROWS
    result: dict = {"benchmark": "llama_compile", "cpu_count": os.cpu_count(),
                    "rows": [run(c, d) for c, d in rows]}
    result["loadavg"] = os.getloadavg()
    if args.profile:
        config, devices = rows[0]
        result["profile"] = {"config": config, "devices": devices,
                             "cumulative": profile(config, devices, args.top)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
