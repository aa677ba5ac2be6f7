"""Pipeline step time against the ideal bubble, and activation memory of 1F1B vs GPipe.

    python benchmarks/pipeline.py                     # m = 1 2 4 8, both schedules
    python benchmarks/pipeline.py --micro 4 --repeat 3
    python benchmarks/pipeline.py --chunks 2          # interleaved: 2 chunks per stage

The model is examples/pipeline_mlp.py: 4 stages, each a 2-way model-parallel block, on 8
virtual CPU devices (one JAX program over the mesh with a stage axis, `JaxPipelineRunner`).
The global batch is fixed (`--batch`, default 64), so m micro-batches each hold batch / m rows.
For each micro size m and scheduler the script reports:

* `ideal_bubble`: (S-1)/(m+S-1), interleaved (`--chunks v`: the network has v x 4 blocks,
  v per stage) (S-1)/(m v+S-1); `schedule_bubble`: idle stage-ticks of the compiled
  schedule (equal to the ideal for GPipe and 1F1B, interleaved when m is a multiple of S);
* `ticks`: ticks of one step, 2 (m + S - 1), interleaved 2 (m v + S - 1);
* `step_seconds`: the median of `--repeat` steps after one warm-up;
  `seconds_per_tick`: step_seconds / ticks; `step_cpu_seconds`: the median CPU time of this
  process per step (all virtual devices together; less sensitive than wall time to other
  work on the machine);
* `carried_elements`: elements every device writes into what it holds between ticks per
  step: the sum over ticks of the registers some stage writes at that tick (a device whose
  stage does not write one passes it through the tick's `lax.switch`, which XLA copies;
  backends/jax/pipeline_plan.py), `carry_buffer_elements`: the size of all registers, and
  `carried_weight_sized`: per stage, the part of what the stage holds between ticks that is
  weight-sized (gradient accumulators, updated weights and optimizer state), summed over
  ticks (elements x ticks held);
* `activation_bytes` per stage and `micro_batches_in_flight` per stage, from the schedule
  (forward values held for a later unit at the stage's peak).

The virtual CPU devices share this machine's cores, so the measured times show the cost of
the ticks (a tick runs every stage's unit, busy or idle, through `lax.switch`), not a
parallel speed-up. One JSON object is printed. Nothing is asserted: numbers go to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(ROOT))
MODEL = os.path.join(ROOT, "examples", "pipeline_mlp.py")


def measure(micro: int, scheduler: str, batch: int, hidden: int, repeat: int,
            chunks: int = 1) -> dict[str, Any]:
    from pcompile.backends.jax.pipeline import JaxPipelineRunner
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.compile import compile as compile_model

    os.environ.update(PIPE_MICRO=str(micro), PIPE_SCHEDULER=scheduler, PIPE_BATCH=str(batch),
                      PIPE_HIDDEN=str(hidden), PIPE_CHUNKS=str(chunks))
    program = compile_model(MODEL, devices=8, dump=False)
    sched = program.state.pipeline.program.schedule
    runner = JaxPipelineRunner(program)
    data = [a for _, _, a in batches(program, repeat + 1)]
    runner.step(data[0])  # warm-up: compiles the step
    times, cpu = [], []
    for arrays in data[1:]:
        start, start_cpu = time.perf_counter(), time.process_time()
        runner.step(arrays)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    step = statistics.median(times)
    tables = runner.tables
    weight = min(math.prod(p[2]) for p in tables.union_params if p[1] == "weight")
    size = [math.prod(shape) for _, shape in tables.registers]
    weight_sized = [sum(size[r] * (last - first + 1) for _, r, first, last in tables.held[s]
                        if size[r] >= weight)
                    for s in range(tables.stages)]
    return {
        "micro": micro, "scheduler": scheduler, "stages": sched.stages, "chunks": chunks,
        "ideal_bubble": sched.ideal_bubble, "schedule_bubble": sched.bubble,
        "ticks": sched.num_ticks, "step_seconds": step,
        "seconds_per_tick": step / sched.num_ticks,
        "step_cpu_seconds": statistics.median(cpu),
        "carried_elements": sum(size[r] for row in tables.writes for r in row),
        "carry_buffer_elements": sum(size),
        "carried_weight_sized": weight_sized,
        "activation_bytes": sched.held_bytes[scheduler],
        "micro_batches_in_flight": sched.in_flight[scheduler],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedulers", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=1,
                        help="chunks per stage (pipeline_interleave when above 1)")
    args = parser.parse_args()
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    runs = [measure(m, s, args.batch, args.hidden, args.repeat, args.chunks)
            for m in args.micro for s in args.schedulers
            if not (args.chunks > 1 and s == "1f1b" and m > 4 and m % 4)]
    print(json.dumps({"model": "examples/pipeline_mlp.py", "devices": 8,
                      "batch": args.batch, "hidden": args.hidden, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
