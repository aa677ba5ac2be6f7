"""Training-step time of the GPT example on ONE device: each pcompile runner against the same
model written by hand in JAX (`jax.jit` of value_and_grad + AdamWeightDecay, buffers donated).
Prints one JSON object.

    python benchmarks/gpu_step.py                       # ~67M parameters (a GPU-sized run)
    python benchmarks/gpu_step.py --hidden 256 --layers 4 --heads 4 --seq 64 --vocab 2048

Runners (`--runners`):
* `in_process`: `tools.runners.StandAloneRunner` (what `pcompile MODEL.py --devices 1 --run`
  runs in its process on CPU);
* `spmd`: `backends.jax.spmd.JaxSpmdRunner` on a 1-device mesh (the in-process SPMD runner);
* `program`: the generated `DIR/program.py` in its own process (what `--run` launches), run for
  warmup+steps steps: its own report of ms/step after the first (compiling) step.

Every side starts from the same initial values (pcompile's, by parameter name), takes the same
batches (the model's `dataset()`) and reads the loss back every step; `first_loss` shows that
they compute the same model. `ratio` = hand-written ms/step / runner ms/step (1.0: as fast;
the target is >= 0.95). Each timing is the best of `--rounds` rounds, runners interleaved.
The device is JAX's default backend (JAX_PLATFORMS picks it).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
EXAMPLE = os.path.join(ROOT, "examples", "gpt_block.py")

from step_bench import adamw_update, split_adamw_state  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compiling)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runners", default="in_process,spmd,program")
    parser.add_argument("--matmul-precision", default="default",
                        choices=("default", "high", "highest"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="bfloat16: the network under amp O2 (pcompile: "
                             "amp.auto_mixed_precision(net, 'O2', bfloat16); by hand: the same "
                             "casts), float32 master weights")
    return parser.parse_args()


def handwritten(values: dict, cfg: argparse.Namespace):
    """The GPT example (examples/gpt_block.py) and its optimizer written directly in JAX:
    (step, params, moment1, moment2); step(params, m1, m2, tokens, labels) -> (loss, ...)."""
    import jax
    import jax.numpy as jnp

    layers, heads, hidden, seq, vocab = cfg.layers, cfg.heads, cfg.hidden, cfg.seq, cfg.vocab
    # amp O2: everything in `low` but LayerNorm (float32, result back to `low`) and the loss
    low = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    head_dim = hidden // heads
    mask = jnp.asarray(__import__("numpy").triu(
        __import__("numpy").full((seq, seq), -1e4, "float32"), k=1))
    params, m1, m2 = (jax.tree.map(jnp.asarray, d) for d in split_adamw_state(values)[1:])

    def ln(x, p):
        x = x.astype(jnp.float32)
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return ((x - mean) / jnp.sqrt(var + 1e-7) * p[".gamma"] + p[".beta"]).astype(low)

    def dense(x, p, prefix, bias=True):
        y = x @ p[prefix + ".weight"].astype(low).T
        return y + p[prefix + ".bias"].astype(low) if bias else y

    def gelu(x):
        return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))

    def forward(p, tokens, labels):
        batch = tokens.shape[0]
        x = (p["embedding.embedding_table"].astype(low)[tokens]
             + p["position_embedding"].astype(low))
        for i in range(layers):
            b = f"blocks.{i}."
            h = ln(x, {".gamma": p[b + "ln1.gamma"], ".beta": p[b + "ln1.beta"]})

            def split(t):
                return t.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

            q = split(dense(h, p, b + "attn.query"))
            k = split(dense(h, p, b + "attn.key", bias=False))
            v = split(dense(h, p, b + "attn.value"))
            scores = ((q @ k.transpose(0, 1, 3, 2)) * (1.0 / float(head_dim) ** 0.5)
                      + mask.astype(low))
            ctx = jax.nn.softmax(scores, -1) @ v
            ctx = ctx.transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
            x = x + dense(ctx, p, b + "attn.proj")
            h = ln(x, {".gamma": p[b + "ln2.gamma"], ".beta": p[b + "ln2.beta"]})
            x = x + dense(gelu(dense(h, p, b + "fc1")), p, b + "fc2")
        x = ln(x, {".gamma": p["ln_f.gamma"], ".beta": p["ln_f.beta"]})
        logits = (x @ p["head.weight"].astype(low).T).reshape(-1, vocab).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))

    def step(p, mom1, mom2, tokens, labels):
        loss, grads = jax.value_and_grad(forward)(p, tokens, labels)
        return (loss, *adamw_update(p, mom1, mom2, grads))

    return jax.jit(step, donate_argnums=(0, 1, 2)), params, m1, m2


def program_seconds(out_dir: str, steps: int, precision: str) -> float:
    """Seconds per step of the rank program's training loop after its first (compiling) step,
    as it reports them."""
    env = dict(os.environ)
    done = subprocess.run([sys.executable, os.path.join(out_dir, "program.py"), "--steps",
                           str(steps), "--no-checkpoint", "--quiet", "--matmul-precision",
                           precision], capture_output=True, text=True, env=env, check=True)
    found = re.search(r"\(([0-9.]+) ms/step after the first\)", done.stdout)
    if not found:
        raise RuntimeError(f"program.py did not report its time:\n{done.stdout}{done.stderr}")
    return float(found.group(1)) / 1000


def main() -> None:
    cfg = parse()
    os.environ.update(GPT_LAYERS=str(cfg.layers), GPT_HIDDEN=str(cfg.hidden),
                      GPT_HEADS=str(cfg.heads), GPT_SEQ=str(cfg.seq), GPT_VOCAB=str(cfg.vocab),
                      GPT_BATCH=str(cfg.batch))
    import jax
    import numpy as np

    from pcompile.backends.jax.spmd import JaxSpmdRunner, matmul_precision
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.runners import StandAloneRunner

    runners = [r for r in cfg.runners.split(",") if r]
    out_dir = tempfile.mkdtemp(prefix="gpu_step_")
    model_file = EXAMPLE
    if cfg.dtype == "bfloat16":  # the example under amp O2
        model_file = os.path.join(out_dir, "gpt_bf16.py")
        with open(EXAMPLE, encoding="utf-8") as f, open(model_file, "w") as g:
            g.write(f.read() + "\n\nfrom pcompile import amp, bfloat16\n_base_model = model\n\n\n"
                    "def model():\n    return amp.auto_mixed_precision(_base_model(), 'O2', "
                    "bfloat16)\n")
    program = compile_model(model_file, devices=1, out_dir=os.path.join(out_dir, "out"),
                            save_graphs=0)
    total = cfg.warmup + cfg.steps
    data = [arrays for _, _, arrays in batches(program, total)]
    n_params = sum(int(np.prod(p.shape)) for p in program.graph.weights)
    precision = None if cfg.matmul_precision == "default" else cfg.matmul_precision

    step, p, m1, m2 = handwritten(program.initial_values, cfg)
    hand = {"p": p, "m1": m1, "m2": m2}

    def hand_step(arrays):
        with matmul_precision(precision):
            loss, hand["p"], hand["m1"], hand["m2"] = step(hand["p"], hand["m1"], hand["m2"],
                                                           *arrays)
        return float(loss)

    makers = {
        "in_process": lambda: StandAloneRunner(program, "jax",
                                               matmul_precision=precision).step,
        "spmd": lambda: JaxSpmdRunner(program, matmul_precision=precision).step,
    }
    steppers = {"handwritten": hand_step}
    first: dict[str, float] = {}
    for name in runners:
        if name in makers:
            steppers[name] = makers[name]()
    for name, fn in steppers.items():
        for k in range(cfg.warmup):
            loss = fn(data[k])
            if k == 0:
                first[name] = loss
    best: dict[str, float] = {name: float("inf") for name in steppers}
    if "program" in runners:
        best["program"] = float("inf")
    for _ in range(cfg.rounds):
        for name, fn in steppers.items():
            start = time.perf_counter()
            for k in range(cfg.warmup, total):
                fn(data[k])
            best[name] = min(best[name], (time.perf_counter() - start) / cfg.steps)
        if "program" in runners:
            out = os.path.join(out_dir, "out")
            best["program"] = min(best["program"],
                                  program_seconds(out, total, cfg.matmul_precision))
    if "program" in runners:
        log = open(os.path.join(out_dir, "out", "rank_0", "train.log")).read().splitlines()
        first["program"] = float(log[0].rsplit(" ", 1)[1])
    base = best["handwritten"]
    device = jax.devices()[0]
    print(json.dumps({
        "benchmark": "gpu_step",
        "device": f"{device.platform}: {device.device_kind}",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "model": {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
                  "seq": cfg.seq, "vocab": cfg.vocab, "batch": cfg.batch,
                  "parameters": n_params},
        "dtype": cfg.dtype if cfg.dtype == "float32" else "bfloat16 (amp O2)",
        "matmul_precision": cfg.matmul_precision,
        "steps": cfg.steps, "warmup": cfg.warmup, "rounds": cfg.rounds,
        "ms_per_step": {k: round(v * 1000, 3) for k, v in best.items()},
        "ratio_vs_handwritten": {k: round(base / v, 3) for k, v in best.items()
                                 if k != "handwritten"},
        "first_loss": first,
    }, indent=1))


if __name__ == "__main__":
    main()
