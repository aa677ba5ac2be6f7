"""Activation memory of a training step with and without recompute, on a Llama-like stack.

    python benchmarks/recompute_memory.py                      # 1 device, layers 2 4 8
    python benchmarks/recompute_memory.py --devices 8 --layers 4   # dp 2 x mp 4, 8 CPU devices

Each layer is a Llama decoder block written with pcompile's primitives: RmsNorm, Q/K/V
projections, FlashAttentionScore (BSH, causal), the output projection, a residual, RmsNorm,
SwiGLU (w1, w3, SiLU, w2), a residual; the loss is the mean square of the last hidden state
against a target. AdamWeightDecay trains every weight. With `--devices 8` the projections take
mindformers' strategies (dp 2, mp 4). Three variants are compiled: no recompute;
`Cell.recompute()` on every block (MindSpore's full recompute: everything in the block except
its output); `Primitive.recompute()` on the SwiGLU's SiLU and Mul only (a selective
recompute).

For each variant the script reports, per rank:
* `xla_temp_bytes`: the compiled JAX step's temporary buffers (`memory_analysis()` of the
  jitted step: one device, or the SPMD program under shard_map), what the backend allocates
  besides arguments and outputs: the activations kept for the backward pass live there;
* `saved_activation_bytes`: bytes of forward values the backward pass reads (what a step must
  keep between its forward and backward computations), from the IR;
* `recomputed_nodes` and `step_seconds` (median of `--repeat` runs after one warm-up).

`--model llama` measures `examples/llama.py` instead (mindformers' Llama: embedding, GQA
with RoPE, the LM head and the cross-entropy in the network; `--dtype`, `--flash`), with its own
knob LLAMA_RECOMPUTE: `none`, `full` (`Cell.recompute()` on every decoder layer) and `select`
(mindformers' select_recompute: the SwiGLU's gate path and Mul, and without flash attention
the attention core's primitives):

    python benchmarks/recompute_memory.py --model llama --layers 2 4 --dtype float32
    python benchmarks/recompute_memory.py --model llama --devices 8 --layers 4
    python benchmarks/recompute_memory.py --model llama --devices 8 --layers 4 --modes none \
        --seq-parallel 1   # sequence parallelism (LLAMA_SEQ_PARALLEL=1)

One JSON object is printed. Nothing is asserted: numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(ROOT))

MODEL = '''
import os

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

DEVICES = {devices}
DP, MP = (2, 4) if DEVICES == 8 else (1, 1)
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=DEVICES,
                          dataset_strategy=((DP, 1, 1), (DP, 1, 1)))
B, S, H, HEADS, FFN, LAYERS = {batch}, {seq}, {hidden}, {heads}, {ffn}, {layers}
MODE = "{mode}"


def weight(shape):
    return Parameter(initializer("xavier_uniform" if len(shape) > 1 else "ones", shape))


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.norm1 = weight([H])
        self.norm2 = weight([H])
        self.wq, self.wk, self.wv, self.wo = (weight([H, H]) for _ in range(4))
        self.w1, self.w3, self.w2 = weight([H, FFN]), weight([H, FFN]), weight([FFN, H])
        self.rms1 = ops.RmsNorm(1e-6).shard(((DP, 1, 1), (1,)))
        self.rms2 = ops.RmsNorm(1e-6).shard(((DP, 1, 1), (1,)))
        self.q = ops.BatchMatMul().shard(((DP, 1, 1), (1, MP)))
        self.k = ops.BatchMatMul().shard(((DP, 1, 1), (1, MP)))
        self.v = ops.BatchMatMul().shard(((DP, 1, 1), (1, MP)))
        self.attention = ops.FlashAttentionScore(HEADS, scale_value=(H // HEADS) ** -0.5,
                                                 input_layout="BSH", sparse_mode=2
                                                 ).shard(((DP, 1, MP), (DP, 1, MP),
                                                          (DP, 1, MP)))
        self.o = ops.BatchMatMul().shard(((DP, 1, MP), (MP, 1)))
        self.up = ops.BatchMatMul().shard(((DP, 1, 1), (1, MP)))
        self.gate = ops.BatchMatMul().shard(((DP, 1, 1), (1, MP)))
        self.silu = ops.SiLU().shard(((DP, 1, MP),))
        self.mul = ops.Mul().shard(((DP, 1, MP), (DP, 1, MP)))
        self.down = ops.BatchMatMul().shard(((DP, 1, MP), (MP, 1)))
        self.add1 = ops.Add().shard(((DP, 1, 1), (DP, 1, 1)))
        self.add2 = ops.Add().shard(((DP, 1, 1), (DP, 1, 1)))
        if MODE == "selective":
            self.silu.recompute()
            self.mul.recompute()

    def construct(self, x):
        h = self.rms1(x, self.norm1)[0]
        q, k, v = self.q(h, self.wq), self.k(h, self.wk), self.v(h, self.wv)
        attn = self.attention(q, k, v)[3]
        x = self.add1(x, self.o(attn, self.wo))
        h = self.rms2(x, self.norm2)[0]
        ffn = self.mul(self.silu(self.gate(h, self.w1)), self.up(h, self.w3))
        return self.add2(x, self.down(ffn, self.w2))


class Llama(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(0)
        self.layers = nn.CellList([Block() for _ in range(LAYERS)])
        if MODE == "full":
            for block in self.layers:
                block.recompute()
        self.square = ops.Square().shard(((DP, 1, 1),))
        self.mean = ops.ReduceMean().shard(((DP, 1, 1),))
        self.sub = ops.Sub().shard(((DP, 1, 1), (DP, 1, 1)))

    def construct(self, x, target):
        for block in self.layers:
            x = block(x)
        return self.mean(self.square(self.sub(x, target)))


def model():
    return Llama()


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, S, H)).astype(np.float32),
            rng.standard_normal((B, S, H)).astype(np.float32))


def optimizer(params):
    return nn.AdamWeightDecay(params, learning_rate=1e-3)
'''


def saved_activation_bytes(graph: Any) -> int:
    """Bytes of forward values (node results) that backward nodes read."""
    from pcompile.passes.recompute import saved_forward_values

    total = 0
    for value in saved_forward_values(graph):
        types = getattr(value.type, "elements", None) or (value.type,)
        total += sum(t.nbytes for t in types)
    return total


def measure(path: str, devices: int, repeat: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.compile import compile as compile_model

    program = compile_model(path, devices=devices, dump=False)
    graph = program.rank_graphs[0]
    arrays = next(batches(program, 1))[2]
    if devices == 1:
        from pcompile.backends.jax import lower_graph

        fn = jax.jit(lower_graph(graph))
        feeds = list(arrays) + [np.asarray(program.initial_values[p.name])
                                for p in graph.params[len(graph.inputs):]]
        compiled = fn.lower(*feeds).compile()

        def run() -> Any:
            return compiled(*feeds)
    else:
        from pcompile.backends.jax.spmd import JaxSpmdRunner

        runner = JaxSpmdRunner(program)
        n = runner.plan.num_ranks
        feeds = [runner._put({r: runner._slice(a, p.name, r) for r in range(n)}, p)
                 for p, a in zip(graph.inputs, arrays)]
        feeds += [runner._state[p.name] for p in runner._stored]
        compiled = runner._fn.lower(*feeds).compile()

        def run() -> Any:
            return compiled(*feeds)
    stats = compiled.memory_analysis()
    jax.block_until_ready(run())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return {
        "xla_temp_bytes": int(stats.temp_size_in_bytes),
        "xla_argument_bytes": int(stats.argument_size_in_bytes),
        "saved_activation_bytes": saved_activation_bytes(graph),
        "recomputed_nodes": program.state.plan.get("recompute", {}).get("recomputed_nodes", 0),
        "nodes": len(graph.nodes),
        "step_seconds": round(statistics.median(times), 4),
    }


LLAMA = os.path.join(ROOT, "examples", "llama.py")
LLAMA_MODES = {"none": "none", "full": "full", "selective": "select"}


def measure_llama(args: Any, layers: int, mode: str) -> dict[str, Any]:
    """examples/llama.py at this size, its LLAMA_RECOMPUTE knob set to `mode`."""
    env = {"LLAMA_LAYERS": layers, "LLAMA_BATCH": args.batch, "LLAMA_SEQ": args.seq,
           "LLAMA_HIDDEN": args.hidden, "LLAMA_HEADS": args.heads,
           "LLAMA_KV_HEADS": args.kv_heads or args.heads, "LLAMA_FFN": args.ffn,
           "LLAMA_VOCAB": args.vocab, "LLAMA_DTYPE": args.dtype,
           "LLAMA_FLASH": "1" if args.flash else "0", "LLAMA_RECOMPUTE": LLAMA_MODES[mode],
           "LLAMA_SEQ_PARALLEL": "1" if args.seq_parallel else "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        return measure(LLAMA, args.devices, args.repeat)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--devices", type=int, default=1, choices=[1, 8])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", choices=("block", "llama"), default="block")
    parser.add_argument("--kv-heads", type=int, default=0, help="llama: default --heads")
    parser.add_argument("--vocab", type=int, default=1024, help="llama")
    parser.add_argument("--dtype", default="bfloat16", help="llama: compute dtype")
    parser.add_argument("--flash", type=int, default=1, help="llama: 1 flash attention, 0 not")
    parser.add_argument("--seq-parallel", type=int, default=0,
                        help="llama: 1 sequence parallelism (LLAMA_SEQ_PARALLEL)")
    parser.add_argument("--modes", nargs="+", choices=("none", "full", "selective"),
                        default=["none", "full", "selective"], help="the variants measured")
    args = parser.parse_args()
    if args.devices > 1:
        import jax

        jax.config.update("jax_num_cpu_devices", args.devices)
    import jax

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            row: dict[str, Any] = {"layers": layers}
            for mode in args.modes:
                if args.model == "llama":
                    row[mode] = measure_llama(args, layers, mode)
                    continue
                path = os.path.join(tmp, f"llama_{layers}_{mode}.py")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(MODEL.format(devices=args.devices, batch=args.batch, seq=args.seq,
                                         hidden=args.hidden, heads=args.heads, ffn=args.ffn,
                                         layers=layers, mode=mode))
                row[mode] = measure(path, args.devices, args.repeat)
            rows.append(row)
    print(json.dumps({
        "benchmark": "recompute_memory",
        "model": args.model,
        "backend": jax.default_backend(),
        "devices": args.devices,
        "shape": {"batch": args.batch, "seq": args.seq, "hidden": args.hidden,
                  "heads": args.heads, "ffn": args.ffn,
                  **({"kv_heads": args.kv_heads or args.heads, "vocab": args.vocab,
                      "dtype": args.dtype, "flash": bool(args.flash),
                      "seq_parallel": bool(args.seq_parallel)}
                     if args.model == "llama" else {})},
        "per_rank": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
