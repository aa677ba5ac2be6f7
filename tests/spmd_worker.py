"""Subprocess half of tests/backends/test_jax_backend.py: runs with N virtual CPU devices (the test
process may already have initialised JAX with one) and prints one JSON report.

    python -m tests.spmd_worker examples   # every example: JAX SPMD vs numpy vs one device
    python -m tests.spmd_worker synthetic  # fallback groups, attribute variants, rank constants
    python -m tests.spmd_worker adafactor  # nn.AdaFactor's factored states on a (2, 2) split
    python -m tests.spmd_worker llama      # examples/llama.py, dp 2 x mp 4, fused causal attention
    python -m tests.spmd_worker dropout    # nn.Dropout split (2, 4): the rank constants' offsets
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)
# The examples are compared in float64 (every float of the JAX program, the numpy simulator and
# the single-device program computed in float64), so the bound is the oracle's derived one.
jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = [
    ("quickstart.py", "semi_auto_parallel"),
    ("layout_mlp.py", "semi_auto_parallel"),
    ("dense_gelu_blocks.py", "semi_auto_parallel"),
    ("gpt_block.py", "semi_auto_parallel"),
    ("quickstart.py", "data_parallel"),
    ("manual_parallel.py", "hybrid_parallel"),
]
STEPS = 2


def rel(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not want.size:
        return 0.0
    scale = max(float(np.max(np.abs(want))), 1e-6)
    return float(np.max(np.abs(got - want))) / scale


def compile_for_8(example: str, mode: str) -> tuple[Any, str]:
    """Compile in `mode`; a model whose shard() calls need another mode (dense_gelu_blocks:
    Cell.shard needs sharding propagation) compiles with the model file's own mode."""
    from pcompile.ir.errors import PcompileError
    from pcompile.tools.compile import compile as compile_model

    path = os.path.join(ROOT, "examples", example)
    # data_parallel sums the ranks' gradients unless gradients_mean: ask for the mean, so that
    # the result is comparable with one device.
    overrides = {"gradients_mean": True} if mode == "data_parallel" else None
    try:
        return compile_model(path, devices=8, parallel_mode=mode, dump=False,
                             overrides=overrides), mode
    except PcompileError:
        program = compile_model(path, devices=8, dump=False)
        return program, program.state.parallel_mode


def check_example(example: str, mode: str) -> dict[str, Any]:
    from pcompile.ir.errors import PcompileError

    try:
        program, used = compile_for_8(example, mode)
    except PcompileError as exc:
        return {"skipped": str(exc).splitlines()[0]}
    return compare(program, used)


def compare(program: Any, used: str) -> dict[str, Any]:
    """`STEPS` steps of `program` by JAX SPMD, the numpy simulator and one device."""
    from pcompile.backends.jax.spmd import JaxSpmdRunner
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.oracle import single_device
    from pcompile.tools.runners import ParallelRunner, StandAloneRunner

    ref = single_device(program)
    jr = JaxSpmdRunner(program, float64=True)
    nr = ParallelRunner(program, float64=True)
    one = StandAloneRunner(ref, "numpy", float64=True)
    for name in one.values:
        if name in program.initial_values:
            one.values[name] = np.asarray(program.initial_values[name], np.float64)
    losses = []
    for _, _, arrays in batches(ref, STEPS):
        losses.append((jr.step(arrays), nr.step(arrays), one.step(arrays)))
    weights = {p.name for p in ref.graph.weights}
    vs_numpy = {"param": 0.0, "state": 0.0}
    for r in range(len(program.rank_graphs)):
        for name, want in nr.values[r].items():
            kind = "param" if name in weights else "state"
            vs_numpy[kind] = max(vs_numpy[kind], rel(jr.values[r][name], want))
    vs_one = {"param": 0.0, "state": 0.0}
    for name, want in one.values.items():
        kind = "param" if name in weights else "state"
        vs_one[kind] = max(vs_one[kind], rel(jr.global_value(name), want))
    kinds: dict[str, int] = {}
    for n in jr.plan.nodes:
        kinds[n.kind] = kinds.get(n.kind, 0) + 1
    dtypes = sorted({str(v.dtype) for v in jr.values[0].values()})
    return {"mode": used, "fusion": fused_lowering(program, jr, arrays), "losses": losses,
            "dtypes": dtypes, "vs_numpy": vs_numpy, "vs_single": vs_one,
            "kinds": kinds, "mesh": list(jr.plan.mesh.sizes),
            "fallback": sum(1 for n in jr.plan.nodes if n.kind == "collective"
                            and n.collective.axes is None),
            "optimizer": type(program.state.optimizer).__name__}


def fused_lowering(program: Any, jr: Any, arrays: list[np.ndarray]) -> dict[str, Any]:
    """Communication fusion's buckets (Concat -> AllReduce in rank 0's graph) and what the
    lowered training step holds: concatenations and the all-reduces' operand counts."""
    import re

    graph = program.rank_graphs[0]
    buckets = [n for n in graph.nodes if n.op == "AllReduce"
               and getattr(getattr(n.operands[0], "node", None), "op", None) == "Concat"]
    text = jr.lower(arrays).as_text()
    operands = [len(re.findall(r"%[\w#.]+", m.group(1)))
                for m in re.finditer(r'"stablehlo.all_reduce"\(([^)]*)\)', text)]
    return {"buckets": len(buckets), "concatenate": text.count("stablehlo.concatenate"),
            "all_reduce_operands": operands}


# -- synthetic rank graphs ----------------------------------------------------------------------


def synthetic_graphs(groups: list[tuple[int, ...]]) -> list[Any]:
    """4 ranks: x (4, 6) -> every collective over `groups[r]`, a rank-dependent StridedSlice
    whose strides differ (attribute variants), and a rank-dependent constant."""
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.types import DType, TensorType

    graphs = []
    for rank in range(4):
        g = Graph(f"rank{rank}")
        x = g.add_param(GraphParam(TensorType(DType.float32, (4, 6)), "x"))
        b = Builder(g)
        group = {"rank_list": groups[rank], "group": f"g{groups[rank]}"}
        outs = [
            b("AllReduce", x, op="sum", **group),
            b("AllReduce", x, op="max", **group),
            b("AllReduce", x, op="prod", **group),
            b("AllGather", x, **group),
            b("ReduceScatter", x, op="sum", **group),
            b("ReduceScatter", x, op="max", **group),
            b("AlltoAll", x, split_count=2, split_dim=1, concat_dim=0, **group),
            b("Broadcast", x, root_rank=1, **group),
        ]
        flat = b("Reshape", x, shape=(24,))
        if rank % 2:
            outs.append(b("StridedSlice", flat, begin=(1,), end=(9,), strides=(2,)))
        else:
            outs.append(b("StridedSlice", flat, begin=(rank,), end=(rank + 4,), strides=(1,)))
        outs.append(b("Add", x, b.const(np.full((4, 6), rank + 0.5, np.float32))))
        g.outputs = outs
        graphs.append(g)
    return graphs


def check_synthetic() -> dict[str, Any]:
    from pcompile.backends.jax.plan import SpmdPlan
    from pcompile.backends.jax.spmd import (
        local_pieces,
        lower_spmd,
        make_mesh,
        put_blocks,
        rank_devices,
        spmd_function,
    )
    from pcompile.backends.numpy.simulate import run_ranks

    report: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    cases = {
        "aligned_r1": [(0, 1), (0, 1), (2, 3), (2, 3)],
        "aligned_r0": [(0, 2), (1, 3), (0, 2), (1, 3)],
        "fallback_diagonal": [(0, 3), (1, 2), (1, 2), (0, 3)],
        "fallback_reversed": [(1, 0), (1, 0), (3, 2), (3, 2)],
    }
    for name, groups in cases.items():
        graphs = synthetic_graphs(groups)
        plan = SpmdPlan.build(graphs)
        mesh = make_mesh(plan.mesh, rank_devices(4))
        xs = {r: rng.standard_normal((4, 6)).astype(np.float32) for r in range(4)}
        fn = spmd_function(lower_spmd(plan), mesh, [p.shape for p in plan.params])
        outs = fn(put_blocks(mesh, xs, (4, 6), np.float32))
        got = [local_pieces(o, mesh, v.shape) for o, v in zip(outs, graphs[0].outputs)]
        want = run_ranks(graphs, [[xs[r]] for r in range(4)])
        # The simulator sums in every ReduceScatter; output 5 is ReduceScatter(op=max).
        for r in range(4):
            total = np.max(np.stack([xs[m] for m in groups[r]]), axis=0)
            want[r][5] = np.split(total, len(groups[r]), axis=0)[groups[r].index(r)]
        err = max(rel(got[i][r], want[r][i]) for r in range(4) for i in range(len(outs)))
        kinds = sorted({n.kind for n in plan.nodes})
        axes = [n.collective.axes for n in plan.nodes if n.kind == "collective"]
        report[name] = {"error": err, "kinds": kinds,
                        "aligned": [a is not None for a in axes]}
    return report


def check_adafactor() -> dict[str, Any]:
    """nn.AdaFactor on the quickstart network with w (32, 16) split (2, 2): its factored
    statistics and their partial-sum AllReduces, with and without the parallel optimizer."""
    import tempfile

    from pcompile.tools.compile import compile as compile_model

    source = open(os.path.join(ROOT, "examples", "quickstart.py")).read().replace(
        "((2, 4), (4, 1))", "((2, 2), (2, 2))").replace(
        "nn.Momentum(params, learning_rate=0.2, momentum=0.1)",
        "nn.AdaFactor(params, weight_decay=0.01)")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adafactor_quickstart.py")
        with open(path, "w") as f:
            f.write(source)
        for sharded in (False, True):
            program = compile_model(path, devices=8, parallel_mode="semi_auto_parallel",
                                    dump=False, overrides={
                                        "enable_parallel_optimizer": sharded,
                                        "parallel_optimizer_config": {
                                            "parallel_optimizer_threshold": 0}})
            report[f"parallel_optimizer={sharded}"] = compare(program, "semi_auto_parallel")
    return report


def check_llama() -> dict[str, Any]:
    """examples/llama.py on 8 devices (dp 2 x mp 4, flash attention with its constant causal
    mask): JAX SPMD vs numpy vs one device, and the attention nodes the JAX program runs as
    sparse_mode 2 (the fused causal kernel) out of all of them."""
    from pcompile.backends.jax.plan import SpmdPlan
    from pcompile.tools.compile import compile as compile_model

    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        del os.environ[name]
    program = compile_model(os.path.join(ROOT, "examples", "llama.py"), devices=8, dump=False)
    report = compare(program, "semi_auto_parallel")
    plan = SpmdPlan.build(program.rank_graphs)
    attention = [n for n in plan.nodes if n.op.startswith("FlashAttentionScore")]
    report["attention"] = len(attention)
    report["causal"] = sum(1 for n in attention if n.kind == "op"
                           and n.attrs["sparse_mode"] == 2)
    return report


DROPOUT_MODEL = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
set_seed(3)
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 32]), "w")
        self.w2 = Parameter(initializer("normal", [32, 8]), "w2")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
        self.relu = ops.ReLU().shard(((2, 4),))
        self.drop = nn.Dropout(p=0.5)
        self.drop.dropout.shard(((2, 4),))
        self.matmul2 = ops.MatMul().shard(((2, 4), (4, 1)))
    def construct(self, x):
        return self.matmul2(self.drop(self.relu(self.matmul(x, self.w))), self.w2)
def model():
    return Net()
def inputs():
    return [np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)]
def labels():
    return [np.zeros((8, 8), np.float32)]
def loss():
    return nn.MSELoss()
def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


DO_MASK_LINES = (
    "        self.drop = nn.Dropout(p=0.5)\n        self.drop.dropout.shard(((2, 4),))\n",
    "        self.gen = ops.DropoutGenMask(Seed0=2, Seed1=5)\n"
    "        self.drop = lambda h: ops.DropoutDoMask().shard(((2, 4),))(\n"
    "            h, self.gen(ops.Shape()(h), 0.5), 0.5)\n")


def check_dropout() -> dict[str, Any]:
    """nn.Dropout on a (2, 4) split: each rank draws its block's bits from its rank constant
    of offsets; DropoutGenMask / DropoutDoMask under the same split (the packed mask whole,
    each rank reading its block's bits); nn.BatchNorm1d then nn.Dropout in data_parallel mode
    (the statistics summed over the world, each rank's rows' offsets a rank constant); two
    steps of the JAX SPMD program, the numpy simulator and one device for each."""
    import tempfile

    from pcompile.tools.compile import compile as compile_model

    models = {"semi_auto_parallel": DROPOUT_MODEL,
              "do_mask": DROPOUT_MODEL.replace(*DO_MASK_LINES),
              "data_parallel": DROPOUT_MODEL.replace('parallel_mode="semi_auto_parallel", '
                                                     'dataset_strategy="full_batch"',
                                                     'parallel_mode="data_parallel"').replace(
                  "self.drop(self.relu(", "self.drop(self.bn(self.relu(").replace(
                  "self.w))), self.w2)", "self.w)))), self.w2)").replace(
                  "        self.drop = nn.Dropout(p=0.5)\n",
                  "        self.drop = nn.Dropout(p=0.5)\n        self.bn = nn.BatchNorm1d(32)\n")}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, text in models.items():
            path = os.path.join(tmp, f"dropout_{case}.py")
            with open(path, "w") as f:
                f.write(text)
            program = compile_model(path, devices=8, dump=False)
            # (the batches read the model file)
            report[case] = compare(program, program.state.parallel_mode)
    return report


def main() -> None:
    what = sys.argv[1]
    if what == "examples":
        names = sys.argv[2:] or None
        report = {f"{e}:{m}": check_example(e, m) for e, m in EXAMPLES
                  if names is None or e in names}
    elif what == "adafactor":
        report = check_adafactor()
    elif what == "llama":
        report = check_llama()
    elif what == "dropout":
        report = check_dropout()
    else:
        report = check_synthetic()
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
