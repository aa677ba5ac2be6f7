"""Training steps per second of the 8-rank SPMD program (JaxSpmdRunner: our per-rank plan as
one shard_map program) against `jax.jit` of the single-device model with the same layouts as
in_shardings (XLA's GSPMD partitions it), on 8 virtual CPU devices; and parameter bytes per rank
against one device. Prints one JSON object.

    python benchmarks/jax_step_speed.py [--steps 20] [--rounds 7] [--models layout_mlp,gpt_block]

Both sides take the global numpy batch every step (our side slices it per rank on the host,
the baseline lets `device_put` shard it) and keep parameters and optimizer state on the devices.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pcompile.backends.jax import lower_graph  # noqa: E402
from pcompile.backends.jax.spmd import JaxSpmdRunner  # noqa: E402
from pcompile.compiler.driver.runtime import batches  # noqa: E402
from pcompile.tools.compile import compile as compile_model  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from step_bench import median, plan_sharding, time_steps  # noqa: E402


class Baseline:
    """jax.jit of the single-device training step, in/out shardings from the plan's layouts."""

    def __init__(self, program, single, runner: JaxSpmdRunner) -> None:
        graph = single.rank_graphs[0]
        layouts = program.state.assignment.param_layouts

        def sharding(name: str) -> NamedSharding:
            return plan_sharding(layouts, name, runner)

        self.params = graph.params
        self.n_inputs = len(graph.inputs)
        in_shardings = [sharding(p.name) for p in graph.params]
        names = single.output_names
        out_shardings = [NamedSharding(runner.mesh, P())] + [sharding(n) for n in names[1:]]
        fn = lower_graph(graph)
        self.fn = jax.jit(lambda *a: tuple(fn(*a)), in_shardings=tuple(in_shardings),
                          out_shardings=tuple(out_shardings))
        self.in_shardings = in_shardings
        self.names = names
        self.state = {p.name: jax.device_put(program.initial_values[p.name], s)
                      for p, s in zip(graph.params[self.n_inputs:],
                                      in_shardings[self.n_inputs:])}

    def step(self, arrays: list[np.ndarray]) -> float:
        feeds = [jax.device_put(a, s) for a, s in zip(arrays, self.in_shardings)]
        feeds += [self.state[p.name] for p in self.params[self.n_inputs:]]
        outs = self.fn(*feeds)
        for name, value in zip(self.names[1:], outs[1:]):
            self.state[name] = value
        return float(outs[0])


def param_bytes(program) -> list[int]:
    """Bytes of parameters and optimizer state held by each rank."""
    stored = [p for p in program.rank_graphs[0].params if p.kind != "input"]
    state = program.state
    return [sum(int(np.asarray(state.rank_values(r)[p.name]).nbytes) for p in stored)
            for r in range(state.devices)]


def measure(model: str, steps: int, rounds: int) -> dict:
    path = os.path.join(ROOT, "examples", f"{model}.py")
    program = compile_model(path, devices=8, parallel_mode="semi_auto_parallel", dump=False)
    single = compile_model(path, devices=1, dump=False)
    _, _, arrays = next(batches(single, 1))
    ours = JaxSpmdRunner(program)
    base = Baseline(program, single, ours)
    seconds = time_steps({"ours": ours.step, "base": base.step}, [arrays], steps, rounds)
    ours_sps, base_sps = 1 / median(seconds["ours"]), 1 / median(seconds["base"])
    stored = [p for p in single.rank_graphs[0].params if p.kind != "input"]
    single_bytes = sum(int(np.asarray(single.initial_values[p.name]).nbytes) for p in stored)
    per_rank = param_bytes(program)
    return {
        "spmd_steps_per_s": round(ours_sps, 2),
        "jit_gspmd_steps_per_s": round(base_sps, 2),
        "ratio_spmd_over_jit": round(ours_sps / base_sps, 3),
        "param_and_state_bytes_single_device": single_bytes,
        "param_and_state_bytes_per_rank": per_rank,
        "per_rank_fraction_of_single": round(max(per_rank) / single_bytes, 3),
        "nodes_per_rank": len(program.rank_graphs[0].nodes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    parser.add_argument("--models", default="layout_mlp,gpt_block")
    args = parser.parse_args()
    results = {m: measure(m, args.steps, args.rounds) for m in args.models.split(",")}
    print(json.dumps({
        "benchmark": "jax_step_speed",
        "devices": "8 virtual CPU devices",
        "cpu_cores": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
