"""The cost model in seconds against this machine: measure a device profile, then put each
plan's predicted step time next to its measured one (issue 34's calibration check, on the CPU
machine the project has; on a GPU the same script measures that device).

Part 1, the profile: N rank processes (JAX, `jax.distributed` with gloo on CPU, NCCL on GPU)
measure at once, each on its own device, what `passes/search/time_model.py`'s `DeviceProfile`
holds: the matrix product's FLOP/s per dtype (the best of a few [n, n] products), the memory
bandwidth (an element-wise pass over 2 x 64 MB), and the AllReduce's per-hop latency and
bandwidth, fitted by least squares to the ring model's t = 2 (g - 1) lat + 2 (g - 1) / g * B / bw
over sizes from 4 kB to 8 MB. Written as a profile file (`--write`), the form `--device-profile`
reads.

Part 2, the check: examples/llama.py at a CPU-sized width on N devices, for each plan (the
hand plans at model-parallel widths 1 and N, and `--search ilp`), compiled with the measured
profile: plan.json's predicted step time against the median ms/step of `pcompile --run`
(metrics.jsonl, after the first step), and their ratio.

    python benchmarks/calibrate.py                      # both parts, 2 processes
    python benchmarks/calibrate.py --profile-only --write /tmp/cpu2.json

One JSON object per line: the profile, then one row per plan, then a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
SIZES = [1 << 12, 1 << 16, 1 << 20, 1 << 23]  # AllReduce bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _best(fn, *args, rounds: int = 10) -> float:
    fn(*args).block_until_ready()  # compile
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def worker(rank: int, processes: int, coordinator: str, platform: str) -> None:
    """One rank process: measure and (rank 0) print the raw numbers as JSON."""
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, processes, rank)
    import numpy as np
    from jax import numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    out: dict = {"flops": {}, "platform": jax.devices()[0].platform}
    n = 1024 if platform == "cpu" else 8192
    for dtype in ("float32", "bfloat16"):
        a = jnp.ones((n, n), dtype)
        mm = jax.jit(lambda x, y: x @ y)
        out["flops"][dtype] = 2 * n ** 3 / _best(mm, a, a)
    x = jnp.ones((16 << 20,), jnp.float32)  # 64 MB
    out["memory_bandwidth"] = 2 * x.nbytes / _best(jax.jit(lambda v: v * 1.0001 + 1.0), x)
    mesh = Mesh(np.array(jax.devices()), ("i",))
    reduce = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "i"), mesh=mesh,
                                   in_specs=P("i"), out_specs=P("i")))
    times = {}
    for size in SIZES:
        local = np.ones((size // 4,), np.float32)
        arrays = [jax.device_put(local, d) for d in jax.local_devices()]
        glob = jax.make_array_from_single_device_arrays(
            (size // 4 * processes,), NamedSharding(mesh, P("i")), arrays)
        reps = []
        for _ in range(3):  # compile, and gloo's first exchanges of this size
            reduce(glob).block_until_ready()
        for _ in range(9):
            start = time.perf_counter()
            reduce(glob).block_until_ready()
            reps.append(time.perf_counter() - start)
        times[size] = statistics.median(reps)
    out["all_reduce_seconds"] = {str(k): v for k, v in times.items()}
    if rank == 0:
        print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


def measure(processes: int, platform: str) -> dict:
    """Run the workers; the profile from rank 0's numbers."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": platform}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--processes",
                               str(processes), "--coordinator", coordinator,
                               "--platform", platform],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(processes)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"a measuring process failed:\n{err[-2000:]}")
    raw = json.loads(outs[0][0].strip().splitlines()[-1])
    g = processes
    # least squares of t = a * 2 (g - 1) + b * 2 (g - 1) / g * B (a = latency, b = 1 /
    # bandwidth) in relative terms: each size's equation divided by its time, so that the
    # small sizes (latency) weigh as much as the large ones (bandwidth)
    rows = [(2 * (g - 1) / t, 2 * (g - 1) / g * int(s) / t, 1.0)
            for s, t in raw["all_reduce_seconds"].items()]
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    latency = max((sxt * syy - syt * sxy) / det, 1e-7)
    inverse = max((sxx * syt - sxy * sxt) / det, 1e-13)
    link = {"bandwidth": 1.0 / inverse, "latency": latency}
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes
    return {"name": f"measured-{raw['platform']}-{processes}",
            "flops": {"float32": raw["flops"]["float32"], "bfloat16": raw["flops"]["bfloat16"],
                      "float16": raw["flops"]["bfloat16"]},
            "memory_bandwidth": raw["memory_bandwidth"], "memory": float(memory),
            "node_size": 1 << 30, "intra_node": link, "inter_node": link,
            "measured_all_reduce_seconds": raw["all_reduce_seconds"]}


PLANS = {  # name -> (environment, search)
    "hand_mp1": ({"LLAMA_MP": "1"}, None),
    "hand_mpN": ({"LLAMA_MP": "{n}"}, None),
    "ilp": ({"LLAMA_STRATEGIES": "none"}, "ilp"),
}
MODEL = {"LLAMA_LAYERS": "2", "LLAMA_HIDDEN": "512", "LLAMA_HEADS": "8", "LLAMA_KV_HEADS": "8",
         "LLAMA_FFN": "1376", "LLAMA_VOCAB": "4096", "LLAMA_SEQ": "256", "LLAMA_BATCH": "4",
         "LLAMA_DTYPE": "float32"}


def check(plan: str, processes: int, profile_path: str, steps: int) -> dict:
    extra, search = PLANS[plan]
    env = {**os.environ, **MODEL,
           **{k: v.format(n=processes) for k, v in extra.items()}}
    row: dict = {"plan": plan, "devices": processes}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "pcompile", LLAMA, "--devices", str(processes), "--out", out,
               "--device-profile", profile_path, "--no-check", "--run", "--steps", str(steps),
               "--dump-ranks", "0"]
        if search:
            cmd += ["--search", search]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            row["status"] = "error: " + (done.stderr.strip().splitlines() or ["?"])[-1][:300]
            return row
        with open(os.path.join(out, "plan.json"), encoding="utf-8") as f:
            pred = json.load(f)["prediction"]
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            ms = [json.loads(line)["step_time_ms"] for line in f if line.strip()][1:]
    measured = statistics.median(ms) / 1e3
    row.update({"status": "ok", "predicted_step": pred["step_time"],
                "predicted_compute": pred["compute"],
                "predicted_communication": pred["communication"],
                "measured_step": round(measured, 6),
                "measured_over_predicted": round(measured / pred["step_time"], 3)})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--profile-only", action="store_true")
    parser.add_argument("--write", default=None, help="write the measured profile here")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--plans", nargs="*", default=list(PLANS))
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.processes, args.coordinator, args.platform)
        return
    profile = measure(args.processes, args.platform)
    print(json.dumps({"profile": profile}), flush=True)
    path = args.write
    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            path = os.path.join(tmp, "profile.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in profile.items()
                       if k != "measured_all_reduce_seconds"}, f, indent=1)
        if args.profile_only:
            return
        rows = [check(plan, args.processes, path, args.steps) for plan in args.plans]
    for row in rows:
        print(json.dumps(row), flush=True)
    ratios = [r["measured_over_predicted"] for r in rows if r.get("status") == "ok"]
    print(json.dumps({"summary": {"plans": len(rows), "measured_over_predicted": ratios,
                                  "load_average": os.getloadavg()[0]}}), flush=True)


if __name__ == "__main__":
    main()
