"""How fast a rank makes its parameter slices: the numpy reference against the jitted device
generator (backends/jax/param_init.py), and time to first step of a compiled Llama with the
slices made on the host or on the device. Prints one JSON object.

    python benchmarks/param_init.py [--rows 2048] [--cols 4096] [--llama] [--rounds 3]

`rates`: values per second making one (rows, cols) block of each init, float32 and bfloat16;
`device_compile_s` is the first device call (XLA compile of the maker, paid once per init,
shape and block), not counted in the rate. The values are compared bit for bit.

`--llama`: compiles examples/llama.py at the issue-23 CPU size (4 layers, hidden 1024, 8 heads,
4 kv heads, FFN 2816, vocabulary 8192, sequence 128, batch 4: ~64M parameters) for one device,
then runs `rank_0/program.py --steps 1` with PCOMPILE_PARAM_INIT=host and =auto (median of
`--rounds` runs each): seconds from process start to the first loss line, and the init line the
program prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA_64M = {"LLAMA_LAYERS": "4", "LLAMA_HIDDEN": "1024", "LLAMA_HEADS": "8",
             "LLAMA_KV_HEADS": "4", "LLAMA_FFN": "2816", "LLAMA_VOCAB": "8192",
             "LLAMA_SEQ": "128", "LLAMA_BATCH": "4", "LLAMA_MP": "1"}


def rates(rows: int, cols: int) -> list[dict[str, object]]:
    import jax

    from pcompile.backends.jax.param_init import device_block
    from pcompile.compiler.frontend.initializer import initializer
    from pcompile.ir.types import DType

    device = jax.devices()[0]
    out = []
    for init in ("normal", "uniform", "truncatednormal", "zeros"):
        for dtype in (DType.float32, DType.bfloat16):
            data = initializer(init, [rows, cols], dtype)
            bounds = ((0, rows), (0, cols))
            start = time.perf_counter()
            host = data.block(bounds)
            host_s = time.perf_counter() - start
            start = time.perf_counter()
            first = device_block(data, bounds, device)
            assert first is not None
            first.block_until_ready()
            compile_s = time.perf_counter() - start
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                block = device_block(data, bounds, device)
                assert block is not None
                block.block_until_ready()
                best = min(best, time.perf_counter() - start)
            same = np.array_equal(np.asarray(block)[0].view(np.uint8), host.view(np.uint8))
            out.append({"init": init, "dtype": dtype.name, "values": rows * cols,
                        "numpy_values_per_s": round(rows * cols / host_s),
                        "device_values_per_s": round(rows * cols / best),
                        "speedup": round(host_s / best, 1),
                        "device_compile_s": round(compile_s - best, 3),
                        "bit_identical": bool(same)})
    return out


def first_step(rounds: int) -> dict[str, object]:
    env = dict(os.environ, **LLAMA_64M, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        subprocess.run([sys.executable, "-m", "pcompile", os.path.join(ROOT, "examples",
                                                                       "llama.py"),
                        "--devices", "1", "--no-check", "--out", out],
                       check=True, env=env, capture_output=True)
        results: dict[str, object] = {}
        for where in ("host", "auto"):
            times, lines = [], []
            for _ in range(rounds):
                start = time.perf_counter()
                proc = subprocess.Popen(
                    [sys.executable, os.path.join(out, "rank_0", "program.py"), "--steps", "1",
                     "--no-checkpoint", "--platform", "cpu"],
                    env=dict(env, PCOMPILE_PARAM_INIT=where), stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT, text=True)
                seen = None
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith("parameters and optimizer state"):
                        lines.append(line.strip())
                    if seen is None and "loss is" in line:
                        seen = time.perf_counter() - start
                proc.wait()
                if proc.returncode or seen is None:
                    raise SystemExit(f"the rank program failed ({where})")
                times.append(seen)
            results[where] = {"first_step_s": round(float(np.median(times)), 2),
                              "runs_s": [round(t, 2) for t in times],
                              "init_line": lines[-1] if lines else None}
        init_s = {k: float(m.group(1)) for k, v in results.items()
                  if isinstance(v, dict) and v["init_line"]
                  and (m := re.search(r"in ([0-9.]+) s", str(v["init_line"])))}
        results["init_s"] = init_s
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--llama", action="store_true",
                        help="also time to first step of the 64M-parameter Llama")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import jax

    report: dict[str, object] = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)},
        "rates": rates(args.rows, args.cols)}
    if args.llama:
        report["llama_64m_first_step"] = first_step(args.rounds)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
