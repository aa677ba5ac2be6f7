"""Subprocess half of tests/backends/test_training_forms_jax.py: the training forms as ONE JAX SPMD
program on 8 virtual CPU devices (float64), against the numpy simulator and the single-device
program. Prints one JSON report.

    python -m tests.train_forms_worker
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    # the loss-scaled, clipped, scheduled step; step 3 overflows
    "train_step": (os.path.join(ROOT, "examples", "train_step.py"), 6),
    # gradients as outputs (GradOperation(get_all=True, get_by_list=True))
    "grad_wrap": (os.path.join(ROOT, "tests", "models", "grad_wrap.py"), 1),
    # the expert load and bias assigned in the forward, split over the ranks (issue 35)
    "forward_state": (os.path.join(ROOT, "tests", "models", "forward_state.py"), 3),
}


def rel(got: Any, want: Any) -> float:
    from pcompile.tools.oracle import relative_error

    return relative_error(np.asarray(got), np.asarray(want))


def run_case(path: str, steps: int) -> dict[str, Any]:
    from pcompile.backends.jax.spmd import JaxSpmdRunner
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.oracle import single_device
    from pcompile.tools.runners import ParallelRunner, StandAloneRunner

    program = compile_model(path, devices=8, dump=False)
    ref = single_device(program)
    jr = JaxSpmdRunner(program, float64=True)
    nr = ParallelRunner(program, float64=True)
    one = StandAloneRunner(ref, "numpy", float64=True)
    worst = {"jax_vs_numpy": 0.0, "jax_vs_single": 0.0}
    losses = []
    with np.errstate(all="ignore"):
        for _, _, arrays in batches(ref, steps):
            if not program.training:
                got, want, single = jr.run(arrays), nr.run(arrays), one.run(arrays)
                for r in range(8):
                    for g, w in zip(got[r], want[r]):
                        worst["jax_vs_numpy"] = max(worst["jax_vs_numpy"], rel(g, w))
                from pcompile.tools.oracle import gather

                for i, (w, layout) in enumerate(zip(single, program.state.output_layouts)):
                    g = gather(got, i, layout, w)
                    worst["jax_vs_single"] = max(worst["jax_vs_single"], rel(g, w))
                continue
            losses.append([jr.step(arrays), nr.step(arrays), one.step(arrays)])
    if program.training:
        for r in range(8):
            for name, want in nr.values[r].items():
                if name not in jr.values[r]:
                    continue  # a returned value that is not stored (the overflow flag)
                worst["jax_vs_numpy"] = max(worst["jax_vs_numpy"], rel(jr.values[r][name], want))
        for name, want in one.values.items():
            if name in jr.values[0]:
                worst["jax_vs_single"] = max(worst["jax_vs_single"],
                                             rel(jr.global_value(name), want))
    return {"losses": losses, "worst": worst, "outputs": program.output_names}


def main() -> None:
    os.environ["TRAIN_STEP_INF_AT"] = "3"
    report = {name: run_case(path, steps) for name, (path, steps) in CASES.items()}
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
