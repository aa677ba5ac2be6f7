"""Training step of examples/llama.py against the same Llama written by hand in JAX, on ONE CPU
device and on 8 virtual CPU devices (dp 2 x mp 4), in float32 and bfloat16. Prints one JSON
object.

    python benchmarks/llama_step.py                       # 2 layers, hidden 256 (a few minutes)
    python benchmarks/llama_step.py --size 64m            # the issue's ~64M-parameter Llama
    python benchmarks/llama_step.py --devices 1 --dtypes float32 --steps 3 --rounds 2

The model (`--size small`, the default: 2 layers, hidden 256, 8 heads, 4 kv heads, FFN 704,
vocabulary 2048, sequence 128, batch 4; `--size 64m`: 4 layers, hidden 1024, 8 heads, 4 kv heads,
FFN 2816, vocabulary 8192, sequence 128, batch 4; any size flag overrides) is examples/llama.py
with flash attention, float32 master weights, the compute dtype through its casts, and
AdamWeightDecay. The hand-written side (`llama_loss`) is that network written directly with
`jax.numpy`: `jax.nn.dot_product_attention(is_causal=True)`, rotate-half by slicing, the loss
by `take_along_axis`, `jax.jit` of `value_and_grad` plus the update, buffers donated. On 8
devices it runs under `jax.jit` with mindformers' Megatron shardings as `NamedSharding`s of a
(dp, mp) mesh (the batch over dp); the benchmark checks that they equal pcompile's parameter
layouts. pcompile runs in process: `StandAloneRunner` on one device, `JaxSpmdRunner` (its SPMD
program under `shard_map`) on 8.

Per (devices, dtype), each in its own processes (so that JAX starts cold and sees its devices):

* `ms_per_step`: both sides from pcompile's initial values, on the same batches (the model's
  `dataset()`), reading the loss back every step; `--warmup` untimed steps, then `--rounds`
  interleaved rounds of `--steps` steps; the median round. `ratio` = hand-written / pcompile
  (>= 0.95: the issue's target). `losses` shows both sides' first losses and the largest
  relative difference over all steps (the same model: rounding only).
* `first_step_s`: seconds from a fresh process's start (before `import jax`) until the first
  loss is on the host: pcompile compiles the model file, makes its parameters and runs the
  step (XLA compile included); the hand-written side initialises its parameters on the device
  (`jax.random`, the same distributions) and runs its step. `first_step_ratio` = pcompile /
  hand-written (<= 1.3: the target).

`--platform gpu` runs every child on JAX's CUDA backend (`--size 0.9b`: issue 23's GPU
configuration); `--hlo` adds both compiled steps' HLO instruction counts; `--program STEPS`
also compiles with the CLI and runs `rank_0/program.py` as a user does, keeping its report and
its final checkpoint against the disk's speed. `benchmarks/gpu_llama.sh` runs them all on a GPU.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # the process's start, for the time to first step

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
LLAMA = os.path.join(ROOT, "examples", "llama.py")
sys.path.insert(0, BENCHMARKS)

from plan_bytes import LlamaSizes  # noqa: E402  (benchmarks/ on the path)
from step_bench import (  # noqa: E402
    adamw_update,
    median,
    plan_sharding,
    split_adamw_state,
    time_steps,
)

SIZES = {  # layers, hidden, heads, kv_heads, ffn, vocab, seq, batch
    "small": (2, 256, 8, 4, 704, 2048, 128, 4),
    "64m": (4, 1024, 8, 4, 2816, 8192, 128, 4),
    "0.9b": (16, 2048, 16, 8, 5632, 32000, 2048, 4),  # issue 23's GPU configuration
}
HLO_OPS = ("fusion", "dot", "custom-call", "copy", "transpose", "convert", "all-reduce",
           "all-gather", "reduce-scatter")
FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "batch")
NORM_EPS, ROPE_THETA, PAD_TOKEN_ID = 1e-5, 10000.0, 0  # examples/llama.py
DP, MP = 2, 4  # on 8 devices


def sizes(devices: int, dtype: str, **fields: int) -> LlamaSizes:
    """The model on `devices` (1, or 8 as dp 2 x mp 4) in compute dtype `dtype`."""
    dp, mp = (DP, MP) if devices > 1 else (1, 1)
    return LlamaSizes(**fields, dtype=dtype, dp=dp, mp=mp)


def parameters(cfg: LlamaSizes) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, initializer) of examples/llama.py's parameters."""
    h, kv = cfg.hidden, cfg.kv_heads * cfg.head_dim
    out = {"model.embedding_weight": ((cfg.vocab, h), "normal")}
    for i in range(cfg.layers):
        layer = f"model.layers.{i}."
        out[layer + "attention_norm.weight"] = ((h,), "ones")
        out[layer + "ffn_norm.weight"] = ((h,), "ones")
        for name, shape in (("wq", (h, h)), ("wk", (kv, h)), ("wv", (kv, h)), ("wo", (h, h))):
            out[f"{layer}attention.{name}.weight"] = (shape, "normal")
        for name, shape in (("w1", (cfg.ffn, h)), ("w2", (h, cfg.ffn)), ("w3", (cfg.ffn, h))):
            out[f"{layer}feed_forward.{name}.weight"] = (shape, "normal")
    out["model.norm_out.weight"] = ((h,), "ones")
    out["lm_head.weight"] = ((cfg.vocab, h), "normal")
    return out


def megatron_spec(name: str) -> tuple[str | None, ...]:
    """mindformers' strategies for dp x mp: the column-parallel weights (wq, wk, wv, w1, w3,
    lm_head: [out, in]) split their rows over mp, the row-parallel ones (wo, w2) their
    columns; the embedding table (vocab_emb_dp) and the norms are replicated."""
    if name.endswith(("wo.weight", "w2.weight")):
        return (None, "mp")
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight")) or \
            name == "lm_head.weight":
        return ("mp", None)
    return ()


# -- the hand-written model --------------------------------------------------------------------


def llama_loss(params: dict[str, Any], input_ids: Any, cfg: LlamaSizes, low: Any,
               constrain: Any = None) -> Any:
    """examples/llama.py's LlamaForCausalLM written directly in JAX: the compute dtype `low`
    through the same casts (norms, rotary embedding, softmax and loss in float32)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    f32 = jnp.float32
    tokens, labels = input_ids[:, :-1], input_ids[:, 1:]
    weight = ((tokens != PAD_TOKEN_ID) & (labels != -100)).astype(f32).reshape(-1)
    batch, seq = tokens.shape
    hd, half = cfg.head_dim, cfg.head_dim // 2
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.outer(np.arange(seq, dtype=np.float64), inv_freq)
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]  # [seq, 1, head_dim]
    cos, sin = (jnp.asarray(f(emb).astype(np.float32)) for f in (np.cos, np.sin))
    keep = constrain or (lambda x: x)

    def linear(x: Any, w: Any) -> Any:
        return x @ w.astype(low).T

    def rms(x: Any, gamma: Any) -> Any:
        xf = x.astype(f32)
        return (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + NORM_EPS)
                * gamma).astype(x.dtype)

    def rope(x: Any) -> Any:
        xf = x.astype(f32)
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos + rotated * sin).astype(x.dtype)

    h = keep(params["model.embedding_weight"][tokens].astype(low))
    for i in range(cfg.layers):
        p = {k.split(".", 3)[3]: v for k, v in params.items()
             if k.startswith(f"model.layers.{i}.")}
        x = rms(h, p["attention_norm.weight"])
        q = rope(linear(x, p["attention.wq.weight"]).reshape(batch, seq, cfg.heads, hd))
        k = rope(linear(x, p["attention.wk.weight"]).reshape(batch, seq, cfg.kv_heads, hd))
        v = linear(x, p["attention.wv.weight"]).reshape(batch, seq, cfg.kv_heads, hd)
        ctx = jax.nn.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(hd), is_causal=True)
        h = keep(h + linear(ctx.reshape(batch, seq, cfg.hidden), p["attention.wo.weight"]))
        x = rms(h, p["ffn_norm.weight"])
        gate = jax.nn.silu(linear(x, p["feed_forward.w1.weight"]))
        up = linear(x, p["feed_forward.w3.weight"])
        h = keep(h + linear(up * gate, p["feed_forward.w2.weight"]))
    x = rms(h, params["model.norm_out.weight"])
    logits = linear(x, params["lm_head.weight"]).astype(f32).reshape(-1, cfg.vocab)
    logp = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logp, jnp.maximum(labels.reshape(-1, 1), 0), 1)[:, 0]
    return -jnp.sum(picked * weight) / (jnp.sum(weight) + 1e-8)


class Handwritten:
    """`jax.jit` of value_and_grad(llama_loss) and AdamWeightDecay, parameters and moments
    donated; on a mesh, with the Megatron NamedShardings (`megatron_spec`) and the batch over
    dp."""

    def __init__(self, cfg: LlamaSizes, values: dict[str, Any], mesh: Any = None) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        low = jnp.dtype(cfg.dtype)
        _, params, m1, m2 = split_adamw_state(values)
        self.batch_sharding = None
        constrain = None
        if mesh is None:
            self.state = tuple({k: jnp.asarray(v) for k, v in d.items()}
                               for d in (params, m1, m2))
            jit_args: dict[str, Any] = {}
        else:
            shardings = {k: NamedSharding(mesh, P(*megatron_spec(k))) for k in params}
            self.shardings = shardings
            self.state = tuple({k: jax.device_put(v, shardings[k]) for k, v in d.items()}
                               for d in (params, m1, m2))
            self.batch_sharding = NamedSharding(mesh, P("dp", None))
            residual = NamedSharding(mesh, P("dp", None, None))

            def constrain(x: Any) -> Any:
                return jax.lax.with_sharding_constraint(x, residual)

            jit_args = {"in_shardings": (shardings, shardings, shardings, self.batch_sharding),
                        "out_shardings": (NamedSharding(mesh, P()), shardings, shardings,
                                          shardings)}

        def step(p: Any, mom1: Any, mom2: Any, ids: Any) -> Any:
            loss, grads = jax.value_and_grad(llama_loss)(p, ids, cfg, low, constrain)
            return (loss, *adamw_update(p, mom1, mom2, grads))

        self.fn = jax.jit(step, donate_argnums=(0, 1, 2), **jit_args)

    def _ids(self, arrays: list[np.ndarray]) -> Any:
        import jax

        return arrays[0] if self.batch_sharding is None else jax.device_put(
            arrays[0], self.batch_sharding)

    def lower(self, arrays: list[np.ndarray]) -> Any:
        """The step lowered for these arrays (`.compile().as_text()`), nothing run."""
        return self.fn.lower(*self.state, self._ids(arrays))

    def step(self, arrays: list[np.ndarray]) -> float:
        loss, *state = self.fn(*self.state, self._ids(arrays))
        self.state = tuple(state)
        return float(loss)


def initial_values(cfg: LlamaSizes, mesh: Any = None) -> dict[str, Any]:
    """Parameters (normal(0, 0.01), norms ones) and zero moments made on the device(s), as a
    hand-written program starts (pcompile's generator is not reproduced: the values differ,
    the distributions do not)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    shapes = parameters(cfg)

    def make(key: Any) -> dict[str, Any]:
        keys = jax.random.split(key, len(shapes))
        out = {}
        for k, (name, (shape, init)) in zip(keys, shapes.items()):
            out[name] = (jnp.ones(shape, jnp.float32) if init == "ones"
                         else 0.01 * jax.random.normal(k, shape, jnp.float32))
            out["moment1." + name] = jnp.zeros(shape, jnp.float32)
            out["moment2." + name] = jnp.zeros(shape, jnp.float32)
        return out

    shardings = None
    if mesh is not None:
        shardings = {n: NamedSharding(mesh, P(*megatron_spec(n.split(".", 1)[1]
                                                             if n.startswith("moment") else n)))
                     for n in jax.eval_shape(make, jax.random.key(0))}
    values = jax.jit(make, out_shardings=shardings)(jax.random.key(0))
    return jax.block_until_ready(values)


def dp_mp_mesh() -> Any:
    """The (dp, mp) mesh of 8 devices: rank r at (r // mp, r % mp), as pcompile numbers them."""
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:DP * MP]).reshape(DP, MP), ("dp", "mp"))


# -- the measurements (each in its own process) ------------------------------------------------


def pcompile_side(devices: int) -> tuple[Any, Any]:
    """(program, runner) of examples/llama.py, as the environment sizes it."""
    from pcompile.tools.compile import compile as compile_model

    program = compile_model(LLAMA, devices=devices, dump=False)
    if devices == 1:
        from pcompile.tools.runners import StandAloneRunner

        return program, StandAloneRunner(program, "jax")
    from pcompile.backends.jax.spmd import JaxSpmdRunner

    return program, JaxSpmdRunner(program)


def check_shardings(program: Any, runner: Any, hand: Handwritten) -> None:
    """The hand-written NamedShardings are pcompile's parameter layouts."""
    layouts = program.state.assignment.param_layouts
    for name, sharding in hand.shardings.items():
        ours = plan_sharding(layouts, name, runner)
        ndim = len(program.initial_values[name].shape)
        if not sharding.is_equivalent_to(ours, ndim):
            raise SystemExit(f"{name}: hand-written {sharding.spec} is not pcompile's layout "
                             f"{layouts.get(name)}")


def steady(cfg: LlamaSizes, args: argparse.Namespace) -> dict[str, Any]:
    from pcompile.compiler.driver.runtime import batches

    devices = cfg.devices
    program, runner = pcompile_side(devices)
    expected = parameters(cfg)
    got = {k: tuple(v.shape) for k, v in split_adamw_state(program.initial_values)[1].items()}
    if got != {k: shape for k, (shape, _) in expected.items()}:
        raise SystemExit(f"examples/llama.py's parameters differ from the hand-written ones: "
                         f"{sorted(set(got) ^ set(expected))}")
    mesh = dp_mp_mesh() if devices > 1 else None
    hand = Handwritten(cfg, dict(program.initial_values.items()), mesh)
    if mesh is not None:
        check_shardings(program, runner, hand)
    data = [arrays for _, _, arrays in batches(program, args.warmup + args.steps)]
    losses: dict[str, list[float]] = {"pcompile": [], "handwritten": []}

    def recorded(name: str, step: Any) -> Any:
        def run(arrays: list[np.ndarray]) -> float:
            loss = float(np.asarray(step(arrays)).reshape(-1)[0])
            losses[name].append(loss)
            return loss
        return run

    hlo = {}
    if args.hlo:  # the compiled steps' instructions (fused computations included)
        hlo = {"pcompile": hlo_counts(runner.lower(data[0]).compile().as_text()),
               "handwritten": hlo_counts(hand.lower(data[0]).compile().as_text())}
    seconds = time_steps({"pcompile": recorded("pcompile", runner.step),
                          "handwritten": recorded("handwritten", hand.step)},
                         data, args.steps, args.rounds, args.warmup)
    ms = {k: median(v) * 1000 for k, v in seconds.items()}
    ours, theirs = np.asarray(losses["pcompile"]), np.asarray(losses["handwritten"])
    rel = np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-12)
    tokens = cfg.batch * cfg.seq
    return {
        "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
        "ms_per_step_rounds": {k: [round(s * 1000, 2) for s in v] for k, v in seconds.items()},
        "ratio": round(ms["handwritten"] / ms["pcompile"], 3),
        "tokens_per_s": {k: round(tokens / v * 1000) for k, v in ms.items()},
        "losses": {"pcompile": [round(x, 6) for x in ours[:3]],
                   "handwritten": [round(x, 6) for x in theirs[:3]],
                   "first_step_relative_difference": float(f"{rel[0]:.3g}"),
                   "max_relative_difference": float(f"{rel.max():.3g}"),
                   "steps_compared": int(rel.size)},
        **({"hlo_instructions": hlo} if hlo else {}),
    }


def hlo_counts(text: str) -> dict[str, int]:
    """How many of each of `HLO_OPS` a compiled module's text holds."""
    found = re.findall(r"= \S+ ([\w-]+)\(", text)
    return {op: found.count(op) for op in HLO_OPS}


def first_step(cfg: LlamaSizes, side: str) -> dict[str, Any]:
    """Seconds from this process's start to the first loss (and the phases)."""
    import jax

    devices = cfg.devices
    phases = {"imports": time.perf_counter() - T0}
    if side == "pcompile":
        from pcompile.compiler.driver.runtime import batches
        from pcompile.tools.compile import compile as compile_model

        phases["imports"] = time.perf_counter() - T0
        start = time.perf_counter()
        program = compile_model(LLAMA, devices=devices, dump=False)
        phases["compile"] = time.perf_counter() - start
        start = time.perf_counter()
        if devices == 1:
            from pcompile.tools.runners import StandAloneRunner

            runner: Any = StandAloneRunner(program, "jax")
        else:
            from pcompile.backends.jax.spmd import JaxSpmdRunner

            runner = JaxSpmdRunner(program)
        phases["parameters"] = time.perf_counter() - start
        _, _, arrays = next(batches(program, 1))
        start = time.perf_counter()
        loss = runner.step(arrays)
        phases["first_step"] = time.perf_counter() - start
    else:
        mesh = dp_mp_mesh() if devices > 1 else None
        start = time.perf_counter()
        values = initial_values(cfg, mesh)
        phases["parameters"] = time.perf_counter() - start
        hand = Handwritten(cfg, values, mesh)
        ids = np.random.default_rng(0).integers(1, cfg.vocab, (cfg.batch, cfg.seq + 1))
        start = time.perf_counter()
        loss = hand.step([ids.astype(np.int32)])
        phases["first_step"] = time.perf_counter() - start
    total = time.perf_counter() - T0
    return {"total": round(total, 3), "loss": float(loss), "jax_devices": len(jax.devices()),
            **{k: round(v, 3) for k, v in phases.items()}}


# -- driver ----------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    for name in FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--devices", default="1,8", help="1, 8 or 1,8 (8: dp 2 x mp 4)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed (compiling) steps")
    parser.add_argument("--no-first-step", action="store_true",
                        help="skip the time-to-first-step processes")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: JAX's CUDA backend (one device per GPU; --devices 8 needs 8)")
    parser.add_argument("--hlo", action="store_true",
                        help="count the compiled steps' HLO instructions (compiles once more)")
    parser.add_argument("--program", type=int, default=0, metavar="STEPS",
                        help="also compile with the CLI and run rank_0/program.py for STEPS "
                             "steps (one device), as a user does: its report of time to first "
                             "step, ms/step, tokens/s, MFU and its final checkpoint against "
                             "the disk's speed")
    parser.add_argument("--workdir", default=None,
                        help="where --program writes (default: the system's temporary folder)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def fields(args: argparse.Namespace) -> dict[str, int]:
    """The model's sizes: `--size`, then the size flags given."""
    out = dict(zip(FIELDS, SIZES[args.size]))
    out.update({k: getattr(args, k) for k in FIELDS if getattr(args, k) is not None})
    return out


def child(what: str, cfg: LlamaSizes, args: argparse.Namespace) -> dict[str, Any]:
    """Runs `what` (steady, first:pcompile, first:handwritten) in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--devices",
           str(cfg.devices), "--dtypes", cfg.dtype, "--steps", str(args.steps), "--rounds",
           str(args.rounds), "--warmup", str(args.warmup), "--platform", args.platform]
    cmd += ["--hlo"] if args.hlo else []
    cmd += [x for f in FIELDS for x in (f"--{f.replace('_', '-')}", str(getattr(cfg, f)))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=model_env(cfg, args))
    if done.returncode != 0:
        raise SystemExit(f"{what} ({cfg.devices} device(s), {cfg.dtype}) failed:\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def model_env(cfg: LlamaSizes, args: argparse.Namespace) -> dict[str, str]:
    """The environment of a child: the platform, and examples/llama.py sized as `cfg`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    env.update(JAX_PLATFORMS="cpu" if args.platform == "cpu" else "cuda", LLAMA_FLASH="1",
               **cfg.env())
    return env


def run_child(args: argparse.Namespace) -> None:
    import jax

    cfg = sizes(int(args.devices), args.dtypes, **fields(args))
    if args.platform == "cpu":
        jax.config.update("jax_num_cpu_devices", cfg.devices)
    elif len(jax.devices()) < cfg.devices:
        raise SystemExit(f"{cfg.devices} devices asked for, JAX sees {len(jax.devices())}")
    if args.child == "steady":
        out = steady(cfg, args)
    else:
        out = first_step(cfg, args.child.split(":")[1])
    print(json.dumps(out))


def device_name(args: argparse.Namespace) -> str:
    if args.platform == "cpu":
        return "CPU (JAX_PLATFORMS=cpu; 8 devices are virtual CPU devices)"
    probe = subprocess.run([sys.executable, "-c", "import jax; d = jax.devices(); "
                            "print(len(d), d[0].device_kind)"], capture_output=True, text=True,
                           env={**os.environ, "JAX_PLATFORMS": "cuda"})
    return f"GPU: {probe.stdout.strip() or probe.stderr.strip()[-300:]}"


_REPORT = {  # what rank_0/program.py prints (backends/run_report.py), as numbers
    "first_step": re.compile(r"time to first step ([\d.]+) s: Python imports ([\d.]+) s, "
                             r"parameter init ([\d.]+) s, XLA compile ([\d.]+) s"),
    "steady": re.compile(r"([\d.]+) ms/step \(median after the first\), ([\d,.e+]+) "
                         r"tokens/s, ([\d.e+-]+) model TFLOP/s \([^)]*\)(?:, MFU ([\d.]+)%)?"),
    "checkpoint": re.compile(r"checkpoint of step (\d+) .*?: ([\d.]+) MB in ([\d.]+) s"),
    "waited": re.compile(r"the end of the run waited ([\d.]+) s"),
}


def disk_seconds(folder: str, nbytes: int) -> float:
    """Seconds to write `nbytes` (fsynced) into `folder`: what the disk needs for them."""
    chunk = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    path = os.path.join(folder, "disk_speed.bin")
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def program_run(cfg: LlamaSizes, args: argparse.Namespace) -> dict[str, Any]:
    """`pcompile examples/llama.py --devices 1 --no-check --out D`, then
    `python D/rank_0/program.py --steps N` (final checkpoint written), as a user runs them:
    the seconds of each, when the first loss line appeared (from the program's start), what
    the program reports, and its final checkpoint against writing as many bytes to the
    same disk."""
    import tempfile

    env = model_env(cfg, args)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        out = os.path.join(tmp, "out")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pcompile", LLAMA, "--devices", "1",
                               "--no-check", "--out", out], capture_output=True, text=True,
                              env=env)
        compile_s = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"pcompile failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        cmd = [sys.executable, os.path.join(out, "rank_0", "program.py"), "--steps",
               str(args.program), "--platform", args.platform, "--print-every", "10"]
        start = time.perf_counter()
        first_loss = None
        lines = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line.rstrip())
                if first_loss is None and "loss is" in line:
                    first_loss = time.perf_counter() - start
        total_s = time.perf_counter() - start
        text = "\n".join(lines)
        if proc.returncode != 0:
            raise SystemExit(f"program.py failed:\n{text[-4000:]}")
        found = {k: pattern.search(text) for k, pattern in _REPORT.items()}
        result: dict[str, Any] = {"compile_s": round(compile_s, 2), "steps": args.program,
                                  "process_s": round(total_s, 2),
                                  "first_loss_line_s": round(first_loss or 0.0, 2),
                                  "report": [line for line in lines if "loss is" not in line]}
        if found["first_step"]:
            result["first_step_s"] = dict(zip(
                ("total", "imports", "parameter_init", "xla_compile"),
                (float(x) for x in found["first_step"].groups())))
        if found["steady"]:
            ms, tokens, tflops, mfu = found["steady"].groups()
            result.update(ms_per_step=float(ms), tokens_per_s=float(tokens.replace(",", "")),
                          model_tflops=float(tflops), mfu_percent=mfu and float(mfu))
        if found["checkpoint"]:
            step, mb, seconds = found["checkpoint"].groups()
            disk = disk_seconds(tmp, int(float(mb) * 1e6))
            result["final_checkpoint"] = {
                "MB": float(mb), "seconds": float(seconds), "disk_seconds": round(disk, 2),
                "over_disk": round(float(seconds) / disk, 2),
                "exit_waited_s": float(found["waited"].group(1)) if found["waited"] else None}
        return result


def main() -> None:
    args = parse()
    if args.child:
        run_child(args)
        return
    import jax

    model = fields(args)
    results: dict[str, Any] = {}
    for devices in (int(d) for d in args.devices.split(",")):
        where = "1 device" if devices == 1 else f"{devices} devices (dp {DP} x mp {MP})"
        for dtype in args.dtypes.split(","):
            cfg = sizes(devices, dtype, **model)
            entry = child("steady", cfg, args)
            if not args.no_first_step:
                firsts = {side: child(f"first:{side}", cfg, args)
                          for side in ("pcompile", "handwritten")}
                entry["first_step_s"] = firsts
                entry["first_step_ratio"] = round(
                    firsts["pcompile"]["total"] / firsts["handwritten"]["total"], 3)
            if args.program and devices == 1:
                entry["program"] = program_run(cfg, args)
            results.setdefault(where, {})[dtype] = entry
    print(json.dumps({
        "benchmark": "llama_step",
        "device": device_name(args),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "model": {**model, "parameters": sum(int(np.prod(s)) for s, _ in
                                             parameters(sizes(1, "float32", **model)).values())},
        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
