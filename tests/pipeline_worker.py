"""Subprocess half of tests/backends/test_pipeline_jax.py: pipeline programs as ONE JAX program
over a mesh with a stage axis on 8 virtual CPU devices (float64), against the numpy pipeline
simulator and the single-device program. Prints one JSON report.

    python -m tests.pipeline_worker           # two cases, also against the simulator
    python -m tests.pipeline_worker matrix    # both models x stages 2, 4 x micro sizes 1, 2,
                                              # 4 x GPipe, 1F1B: 20 steps against one device;
                                              # and interleaved stages (2 chunks per stage)
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (model file, environment, compile overrides, steps)
CASES: dict[str, tuple[str, dict[str, str], dict[str, Any], int]] = {
    # 4 stages x 2-way model parallel, 1F1B, 2 micro-batches
    "mlp_1f1b": (os.path.join(ROOT, "examples", "pipeline_mlp.py"),
                 {"PIPE_MICRO": "2", "PIPE_SCHEDULER": "1f1b"}, {}, 3),
    # the GPT example on 2 stages x 4 devices, GPipe, 4 micro-batches
    "gpt_gpipe": (os.path.join(ROOT, "examples", "gpt_block.py"),
                  {"GPT_MICRO": "4", "GPT_BATCH": "16"},
                  {"pipeline_stages": 2, "pipeline_config": {"pipeline_scheduler": "gpipe"}},
                  2),
    # interleaved: 4 stages x 2 chunks (8 blocks), 1F1B, 4 micro-batches
    "mlp_interleaved_1f1b": (os.path.join(ROOT, "examples", "pipeline_mlp.py"),
                             {"PIPE_MICRO": "4", "PIPE_SCHEDULER": "1f1b", "PIPE_CHUNKS": "2"},
                             {}, 3),
    # a statistic each stage accumulates with AssignAdd, summed over 4 micro-batches
    "state_1f1b": (os.path.join(ROOT, "tests", "models", "pipeline_state.py"),
                   {"PIPE_STATE_MICRO": "4"}, {}, 3),
    # two Dropouts, each micro-batch drawing its rows' bits of the whole batch, 4 micro-batches
    "dropout_1f1b": (os.path.join(ROOT, "tests", "models", "pipeline_dropout.py"),
                     {"PIPE_DROPOUT_MICRO": "4"}, {}, 2),
    # BatchNorm: each micro-batch by its own statistics, the moving ones once per micro-batch
    "batch_norm_1f1b": (os.path.join(ROOT, "tests", "models", "pipeline_batch_norm.py"),
                        {"PIPE_BN_MICRO": "4"}, {}, 2),
    # recompute: every block's ops computed again in its stage's backward unit, 4 micro-batches
    "recompute_1f1b": (os.path.join(ROOT, "tests", "models", "pipeline_recompute.py"),
                       {"PIPE_RC_MICRO": "4", "PIPE_RC_SCHEDULER": "1f1b"}, {}, 2),
}


def rel(got: Any, want: Any) -> float:
    from pcompile.tools.oracle import relative_error

    return relative_error(np.asarray(got), np.asarray(want))


def run_case(path: str, env: dict[str, str], overrides: dict[str, Any],
             steps: int) -> dict[str, Any]:
    from pcompile.backends.jax.pipeline import JaxPipelineRunner
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.oracle import single_device
    from pcompile.tools.runners import ParallelRunner, StandAloneRunner

    os.environ.pop("PIPE_CHUNKS", None)  # left by an earlier case
    os.environ.update(env)
    program = compile_model(path, devices=8, dump=False, parallel_mode="semi_auto_parallel",
                            overrides=overrides)
    assert program.state.pipelined
    ref = single_device(program)
    jr = JaxPipelineRunner(program, float64=True)
    nr = ParallelRunner(program, float64=True)
    one = StandAloneRunner(ref, "numpy", float64=True)
    losses = [[jr.step(a), nr.step(a), one.step(a)] for _, _, a in batches(ref, steps)]
    worst = {"jax_vs_numpy": 0.0, "jax_vs_single": 0.0}
    compared = 0
    for r in range(8):
        for name, want in nr.values[r].items():
            worst["jax_vs_numpy"] = max(worst["jax_vs_numpy"], rel(jr.values[r][name], want))
            compared += 1
    for name, want in one.values.items():
        worst["jax_vs_single"] = max(worst["jax_vs_single"], rel(jr.global_value(name), want))
    return {"losses": losses, "worst": worst, "compared": compared,
            "stored": len(one.values)}


#: Steps of each matrix case (the issue's check trains 20).
MATRIX_STEPS = 20


def matrix() -> dict[str, tuple[str, dict[str, str], dict[str, Any]]]:
    """The issue's matrix: the MLP example (2-way model parallel inside each stage) and the
    GPT example, 2 and 4 stages, micro sizes 1, 2, 4, GPipe and 1F1B."""
    cases = {}
    for stages in (2, 4):
        for micro in (1, 2, 4):
            for scheduler in ("gpipe", "1f1b"):
                cases[f"mlp_s{stages}_m{micro}_{scheduler}"] = (
                    os.path.join(ROOT, "examples", "pipeline_mlp.py"),
                    {"PIPE_STAGES": str(stages), "PIPE_MICRO": str(micro),
                     "PIPE_SCHEDULER": scheduler}, {})
                cases[f"gpt_s{stages}_m{micro}_{scheduler}"] = (
                    os.path.join(ROOT, "examples", "gpt_block.py"),
                    {"GPT_MICRO": str(micro), "GPT_BATCH": "16"},
                    {"pipeline_stages": stages,
                     "pipeline_config": {"pipeline_scheduler": scheduler}})
    for scheduler in ("gpipe", "1f1b"):  # interleaved: 2 chunks per stage
        for stages, micro in ((4, 4), (2, 2)):
            cases[f"mlp_s{stages}_v2_m{micro}_{scheduler}"] = (
                os.path.join(ROOT, "examples", "pipeline_mlp.py"),
                {"PIPE_STAGES": str(stages), "PIPE_MICRO": str(micro),
                 "PIPE_SCHEDULER": scheduler, "PIPE_CHUNKS": "2"}, {})
        cases[f"gpt_s2_v2_m4_{scheduler}"] = (
            os.path.join(ROOT, "examples", "gpt_block.py"),
            {"GPT_MICRO": "4", "GPT_BATCH": "16", "GPT_LAYERS": "2", "GPT_CHUNKS": "2"},
            {"pipeline_stages": 2, "pipeline_config": {"pipeline_scheduler": scheduler,
                                                       "pipeline_interleave": True}})
    return cases


def run_matrix_case(path: str, env: dict[str, str], overrides: dict[str, Any],
                    steps: int) -> dict[str, Any]:
    """`steps` steps of the JAX pipeline program against the single-device program, both in
    float64: losses, and every weight and optimizer state (which carries the gradients) of
    every stage that holds it; the bound is `rounding_rtol(program, float64, steps)`."""
    from pcompile.backends.jax.pipeline import JaxPipelineRunner
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.oracle import rounding_rtol, single_device
    from pcompile.tools.runners import StandAloneRunner

    for key in ("PIPE_CHUNKS", "GPT_CHUNKS", "GPT_LAYERS"):  # left by an earlier case
        os.environ.pop(key, None)
    os.environ.update(env)
    program = compile_model(path, devices=8, dump=False, parallel_mode="semi_auto_parallel",
                            overrides=overrides)
    pipe = program.state.pipeline.program
    ref = single_device(program)
    jr = JaxPipelineRunner(program, float64=True)
    one = StandAloneRunner(ref, "numpy", float64=True)
    losses = [[jr.step(a), one.step(a)] for _, _, a in batches(ref, steps)]
    layouts = program.state.assignment.param_layouts
    worst, compared = 0.0, 0
    for name, want in one.values.items():
        for stage in pipe.param_stages[name]:  # every stage's copy
            got = np.zeros(want.shape)
            for r in pipe.ranks(stage):
                bounds = layouts[name].slice_bounds(r) if want.shape else ()
                got[tuple(slice(b, e) for b, e in bounds)] = jr.values[r][name]
            worst = max(worst, rel(got, want))
            compared += 1
    return {"stages": pipe.stages, "micro": pipe.micro, "scheduler": pipe.scheduler,
            "chunks": pipe.chunks, "losses": losses, "worst": worst, "compared": compared,
            "stored": len(one.values), "bound": rounding_rtol(program, np.float64, steps)}


def main() -> None:
    if sys.argv[1:] == ["matrix"]:
        report = {}
        for name, case in matrix().items():
            start = time.perf_counter()
            report[name] = run_matrix_case(*case, MATRIX_STEPS)
            report[name]["seconds"] = time.perf_counter() - start
            print(name, f"{report[name]['seconds']:.1f} s", flush=True)
    else:
        report = {name: run_case(*case) for name, case in CASES.items()}
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
