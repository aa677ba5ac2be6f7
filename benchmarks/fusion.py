"""Communication fusion on the GPT-style example: collectives per rank and simulated step
time without and with the `comm_fusion` pass (default config: AllReduce "auto", 64 MB).

    python benchmarks/fusion.py [--layers 2 8] [--devices 8] [--steps 5]

For each layer count the example (examples/gpt_block.py, GPT_LAYERS) is compiled for
`--devices` ranks in semi_auto_parallel (default strategies: data parallel), once as is and
once followed by `passes.comm_fusion.CommFusionPass`. Reported per program: collectives per
rank (all, and by op), bytes they move per rank, and the median wall time of one training
step of all ranks on the numpy lockstep simulator (`ParallelRunner.step`, after one warm-up
step). Both programs then train `--steps` steps on the same batches; `max_param_diff` is the
largest difference between their parameters (the fused buffer sums element by element in the
same order, so it is expected to be 0).

The numpy simulator does not model the network (a simulated collective costs about as much as
a numpy sum), so `modeled_comm_us` adds an alpha-beta ring model per rank: with n ranks in the
group and S bytes, AllReduce costs 2(n-1) alpha + 2 (n-1)/n S / beta, AllGather (S = output)
and ReduceScatter (S = input) (n-1) alpha + (n-1)/n S / beta, others (n-1) alpha + S / beta,
with alpha = 10 us per message step and beta = 20 GB/s (assumptions, not measurements).

With `backends/jax/spmd.py` (the JAX SPMD runner), each program also runs as one `shard_map`
program on `--devices` virtual CPU devices (`jax_num_cpu_devices`): `jax.step_s` is the median
`JaxSpmdRunner.step` time after one warm-up (compile) step, and the collectives are counted in
the lowered StableHLO (what the IR asks for) and in XLA's compiled HLO (after XLA's own
passes, which on CPU already combine independent all-reduces into tuple all-reduces), and
`loss_diff_by_step` compares the two programs' losses step by step (XLA may fuse the
element-wise work around a concatenated buffer differently, so the last bits can differ, and
this small GPT's training at lr 1e-2 amplifies such differences after a few steps, as it does
between the numpy simulator and JAX). When the runner does not exist the output says so.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pcompile.compiler.config.pass_options import fusion_config_from_dict  # noqa: E402
from pcompile.compiler.driver.compiled import CompiledProgram  # noqa: E402
from pcompile.compiler.driver.runtime import batches  # noqa: E402
from pcompile.ir.registry import get_op  # noqa: E402
from pcompile.passes.comm_fusion import CommFusionPass  # noqa: E402
from pcompile.tools.compile import compile as compile_model  # noqa: E402
from pcompile.tools.runners import ParallelRunner  # noqa: E402

GPT = os.path.join(ROOT, "examples", "gpt_block.py")
ALPHA_US = 10.0  # latency per ring step (assumed)
BETA_BYTES_PER_US = 20e9 / 1e6  # 20 GB/s (assumed)


def modeled_us(graph: Any) -> float:
    """Alpha-beta ring-model time of every collective of one rank's graph, in microseconds."""
    total = 0.0
    for node in graph.nodes:
        if not get_op(node.op).collective:
            continue
        n = len(node.attrs.get("rank_list", (0,)))
        if n <= 1:
            continue
        size_in = node.operands[0].tensor_type.nbytes
        if node.op == "AllReduce":
            total += 2 * (n - 1) * ALPHA_US + 2 * (n - 1) / n * size_in / BETA_BYTES_PER_US
        elif node.op == "AllGather":
            size_out = node.result.tensor_type.nbytes
            total += (n - 1) * ALPHA_US + (n - 1) / n * size_out / BETA_BYTES_PER_US
        elif node.op == "ReduceScatter":
            total += (n - 1) * ALPHA_US + (n - 1) / n * size_in / BETA_BYTES_PER_US
        else:
            total += (n - 1) * ALPHA_US + size_in / BETA_BYTES_PER_US
    return total


def collectives(program: CompiledProgram) -> dict[str, Any]:
    """Collectives per rank (the maximum over ranks), by op, and the bytes they move."""
    counts, by_op, moved = [], Counter(), []
    for rank, graph in enumerate(program.rank_graphs):
        nodes = [n for n in graph.nodes if get_op(n.op).collective]
        counts.append(len(nodes))
        moved.append(sum(v.tensor_type.nbytes for n in nodes for v in n.operands))
        if rank == 0:
            by_op.update(n.op for n in nodes)
    return {"per_rank": max(counts), "by_op_rank0": dict(sorted(by_op.items())),
            "bytes_per_rank": max(moved),
            "modeled_comm_us": round(max(modeled_us(g) for g in program.rank_graphs), 1)}


def time_steps(program: CompiledProgram, steps: int) -> tuple[list[float], ParallelRunner]:
    """Median step time on the simulator; returns the losses and the runner after `steps`."""
    runner = ParallelRunner(program)
    times, losses = [], []
    for _, _, arrays in batches(program, steps + 1):
        start = time.perf_counter()
        losses.append(runner.step(arrays))
        times.append(time.perf_counter() - start)
    return [statistics.median(times[1:]), *losses], runner


HLO_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def jax_available() -> bool:
    return importlib.util.find_spec("pcompile.backends.jax.spmd") is not None


def hlo_collectives(program: CompiledProgram) -> dict[str, dict[str, int]]:
    """Collective ops in the lowered StableHLO and in the compiled HLO of the SPMD program."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pcompile.backends.jax.plan import SpmdPlan
    from pcompile.backends.jax.spmd import blocked_shape, lower_spmd, make_mesh, spmd_function

    plan = SpmdPlan.build(program.rank_graphs)
    mesh = make_mesh(plan.mesh)
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    args = [jax.ShapeDtypeStruct(blocked_shape(plan.num_ranks, p.shape), p.dtype.np,
                                 sharding=sharding) for p in plan.params]
    lowered = spmd_function(lower_spmd(plan), mesh, [p.shape for p in plan.params]).lower(*args)
    stablehlo, compiled = lowered.as_text(), lowered.compile().as_text()
    return {
        "stablehlo": {k: len(re.findall(rf"stablehlo\.{k.replace('-', '_')}\b", stablehlo))
                      for k in HLO_OPS},
        "compiled_hlo": {k: len(re.findall(rf"\s{k}(?:-start)?\(", compiled))
                         for k in HLO_OPS},
    }


def jax_steps(program: CompiledProgram, steps: int) -> tuple[float, list[float]]:
    from pcompile.backends.jax.spmd import JaxSpmdRunner

    runner = JaxSpmdRunner(program)
    times, losses = [], []
    for _, _, arrays in batches(program, steps + 1):
        start = time.perf_counter()
        losses.append(runner.step(arrays))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), losses


def jax_compare(base: CompiledProgram, fused: CompiledProgram, steps: int) -> dict[str, Any]:
    try:
        base_t, base_losses = jax_steps(base, steps)
        fused_t, fused_losses = jax_steps(fused, steps)
        return {
            "step_s": {"unfused": round(base_t, 4), "fused": round(fused_t, 4)},
            "loss_diff_by_step": [abs(a - b) for a, b in zip(base_losses, fused_losses)],
            "hlo_collectives": {"unfused": hlo_collectives(base),
                                "fused": hlo_collectives(fused)},
        }
    except Exception as exc:  # the SPMD runner is young: report, do not fail the benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(layers: int, devices: int, steps: int, use_jax: bool) -> dict[str, Any]:
    os.environ["GPT_LAYERS"] = str(layers)
    os.environ["GPT_BATCH"] = str(max(8, devices))
    base = compile_model(GPT, devices=devices, parallel_mode="semi_auto_parallel", dump=False)
    fused = compile_model(GPT, devices=devices, parallel_mode="semi_auto_parallel", dump=False)
    fusion = CommFusionPass(fusion_config_from_dict(world_size=devices))
    start = time.perf_counter()
    fusion.apply(fused.state)
    pass_s = time.perf_counter() - start
    report = fusion.reports[0]
    base_stats, fused_stats = collectives(base), collectives(fused)
    (base_t, *base_losses), base_run = time_steps(base, steps)
    (fused_t, *fused_losses), fused_run = time_steps(fused, steps)
    diff = max(float(np.max(np.abs(base_run.global_value(n) - fused_run.global_value(n))))
               for n in base_run.values[0])
    return {
        "layers": layers,
        "devices": devices,
        "rank_graph_nodes": {"unfused": len(base.rank_graphs[0].nodes),
                             "fused": len(fused.rank_graphs[0].nodes)},
        "collectives": {"unfused": base_stats, "fused": fused_stats},
        "buckets": [{"kind": b.kind, "fusion": b.fusion, "members": len(b.members),
                     "bytes": b.nbytes, "fused": bool(b.fused)} for b in report.buckets],
        "comm_fusion_pass_s": round(pass_s, 4),
        "numpy_step_s": {"unfused": round(base_t, 4), "fused": round(fused_t, 4)},
        "losses_equal": base_losses == fused_losses,
        "max_param_diff": diff,
        **({"jax": jax_compare(base, fused, steps)} if use_jax else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX SPMD runs")
    args = parser.parse_args()
    use_jax = jax_available() and not args.no_jax
    if use_jax:
        import jax

        jax.config.update("jax_num_cpu_devices", args.devices)
    results = [run(layers, args.devices, args.steps, use_jax) for layers in args.layers]
    note = ("JAX SPMD runner: backends/jax/spmd.py on virtual CPU devices" if use_jax else
            "no JAX runs: backends/jax/spmd.py does not exist (or --no-jax)")
    print(json.dumps({"benchmark": "comm_fusion", "config": "comm_fusion allreduce auto (64 MB)",
                      "jax": note, "results": results}, indent=1))


if __name__ == "__main__":
    main()
