"""Bytes per rank per training step of the Llama of `examples/llama.py` under Megatron tensor
parallelism (dp x mp): pcompile's plan, XLA GSPMD's plan of the same model with the same
shardings, and the analytic minimum of the scheme. Prints one JSON object.

    python benchmarks/plan_bytes.py                        # every configuration
    python benchmarks/plan_bytes.py --quick                # the smallest one
    python benchmarks/plan_bytes.py --config mid_dp4_mp4   # one of them
    python benchmarks/plan_bytes.py --model-file PATH --env-prefix MF_ --vocab-split none

`--model-file` measures another model file with the configuration's sizes as environment
variables (`LlamaSizes.env`, under `--env-prefix`); `--vocab-split` picks how the vocabulary
is split (the minimum's scheme, the JAX model's shardings and PREFIX_VOCAB_EMB_DP: `head`,
`none`, `both`; `megatron_minimum`); `--top N` adds rank 0's N largest collectives.

Configurations (`CONFIGS`; heads 8, kv heads 4, flash attention, AdamWeightDecay):

* `tiny_dp2_mp4`: 2 layers, hidden 64, FFN 128, vocab 128, seq 16, batch 4, float32, 8 devices;
* `mid_dp2_mp4_bf16`: 4 layers, hidden 512, FFN 1408, vocab 4096, seq 128, batch 16, bfloat16
  compute, 8 devices;
* `mid_dp4_mp4`: the same in float32 on 16 devices;
* `mid_dp2_mp4_bf16_sp`: `mid_dp2_mp4_bf16` with sequence parallelism (LLAMA_SEQ_PARALLEL=1;
  pcompile and the minimum only: each activation AllReduce of the minimum is then a
  ReduceScatter and an AllGather of the same ring bytes, plus the AllGather of the embedding
  output's gradient over the sequence).

**pcompile**: `pcompile examples/llama.py --devices N --no-check` with LLAMA_* set to the
configuration (mindformers' strategies: wq/wk/wv/w1/w3 column-split, wo/w2 row-split over
mp, the LM head column-split, the embedding replicated, the batch split over dp), every rank
in plan.json; rank 0's collectives by phase and kind, and the largest total over the ranks.
`_MirrorOperator`s are left out (their gradient AllReduce is counted where it runs).

**XLA GSPMD**: the same model written in JAX (`jax_llama`: same shapes, dtypes and casts,
plain softmax attention, SGD update) under `jax.jit` with `NamedSharding`s on the weights and
the tokens only (Megatron's column / row splits, LM head column-split, embedding and norms
replicated, tokens split over dp), lowered and compiled on N virtual CPU devices
(`jax_num_cpu_devices`, one subprocess per configuration). Counted twice
(`collective_bytes.hlo_collectives`): every collective of `.compile().as_text()`
(`xla_gspmd`), and of the HLO right after the `spmd-partitioning` pass (`xla_gspmd_partitioner`,
dumped with XLA_FLAGS). They agree in float32; in bfloat16 the CPU backend promotes bfloat16
all-reduces to float32 after partitioning, so the partitioner's count is what a GPU moves.

**Megatron-LM minimum** (`megatron_minimum`), per rank and step, with b = batch / dp the local
batch, s the sequence, h the hidden size, e the compute dtype's bytes, A = b s h e the
activation, L the layers, AR(S, n) one AllReduce of S bytes over n ranks:

    forward   2 L AR(A, mp)                the outputs of wo and w2 (row-parallel)
              + 3 AR(4 b s, mp)            vocab-parallel cross-entropy: max, sum of exp,
                                           target logit (float32 per token)
              + 2 AR(4, dp)                the masked mean: loss sum and token count
    backward  2 L AR(A, mp)                the input gradients of q/k/v and of w1/w3
                                           (column-parallel, summed before the reduction)
              + AR(A, mp)                  the input gradient of the LM head
    gradients AR(4 P, dp)                  each rank's float32 parameter slices, P =
              L (2 h^2 + 2 h kv + 3 h f) / mp + 2 L h   (wq, wo; wk, wv; w1, w2, w3; norms)
              + h + V h + V h / mp                      (final norm, embedding, LM head)

with kv = kv_heads x head_dim, f the FFN size, V the vocabulary. Not counted: the optimizer
(element-wise on the slices) and anything of the data pipeline. Bytes in two conventions
(`collective_bytes.py`): `payload`, the operand on one rank (AR(S, n) = S), and `ring`, what
one rank sends with ring algorithms (AR(S, n) = 2 (n - 1) / n S; AllGather (n - 1) S_in,
ReduceScatter and AlltoAll (n - 1) / n S_in). Phases: forward, backward (activation
gradients), gradient_reduction (pcompile: the gradient AllReduces of `_MirrorOperator`s and
their fused buckets; XLA: backward collectives whose group spans data-parallel replicas) and
optimizer. `ratio_to_minimum` compares ring bytes. Nothing is asserted: the numbers go to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, BENCHMARKS)
LLAMA = os.path.join(ROOT, "examples", "llama.py")

from collective_bytes import (  # noqa: E402
    Collective,
    Term,
    hlo_collectives,
    plan_collectives,
    plan_json_bytes,
    tally,
    terms_tally,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LlamaSizes:
    """One configuration of examples/llama.py and its mesh (devices = dp x mp)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    dtype: str
    dp: int
    mp: int
    seq_parallel: bool = False
    #: the vocabulary's split (`--vocab-split`): "head" the LM head column-split over mp and
    #: the embedding replicated (examples/llama.py); "none" both replicated (mindformers'
    #: `vocab_emb_dp: True`); "both" the embedding split by vocabulary rows and the LM head by
    #: columns (mindformers' `vocab_emb_dp: False`, Megatron's vocab-parallel embedding)
    vocab_split: str = "head"

    @property
    def embedding_split(self) -> bool:
        return self.vocab_split == "both"

    @property
    def head_split(self) -> bool:
        return self.vocab_split in ("head", "both")

    @property
    def devices(self) -> int:
        return self.dp * self.mp

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def env(self, prefix: str = "LLAMA_") -> dict[str, str]:
        """The sizes as environment variables for the model file: LLAMA_* for
        examples/llama.py; another `prefix` (`--env-prefix`) for a model file that reads the
        same names under it (PREFIX_LAYERS, PREFIX_HIDDEN, ..., PREFIX_DTYPE, PREFIX_MP)."""
        values = {"LAYERS": self.layers, "HIDDEN": self.hidden, "HEADS": self.heads,
                  "KV_HEADS": self.kv_heads, "FFN": self.ffn, "VOCAB": self.vocab,
                  "SEQ": self.seq, "BATCH": self.batch, "DTYPE": self.dtype, "MP": self.mp,
                  "SEQ_PARALLEL": "1" if self.seq_parallel else "0",
                  "VOCAB_EMB_DP": "0" if self.embedding_split else "1"}
        return {prefix + key: str(value) for key, value in values.items()}


CONFIGS = {
    "tiny_dp2_mp4": LlamaSizes(2, 64, 8, 4, 128, 128, 16, 4, "float32", 2, 4),
    "mid_dp2_mp4_bf16": LlamaSizes(4, 512, 8, 4, 1408, 4096, 128, 16, "bfloat16", 2, 4),
    "mid_dp4_mp4": LlamaSizes(4, 512, 8, 4, 1408, 4096, 128, 16, "float32", 4, 4),
    "mid_dp2_mp4_bf16_sp": LlamaSizes(4, 512, 8, 4, 1408, 4096, 128, 16, "bfloat16", 2, 4,
                                      seq_parallel=True),
}
QUICK = "tiny_dp2_mp4"


# -- the analytic minimum -------------------------------------------------------------------------


def scheme(c: LlamaSizes) -> Any:
    """The configuration as the package's Megatron scheme (passes/search/megatron.py, which
    plan.json's `megatron_minimum` uses too)."""
    from pcompile.passes.search.megatron import TransformerSizes

    return TransformerSizes(
        layers=c.layers, hidden=c.hidden, kv=c.kv_heads * c.head_dim, ffn=c.ffn,
        vocab=c.vocab, tokens=c.batch // c.dp * c.seq, act_bytes=DTYPE_BYTES[c.dtype],
        dp=c.dp, mp=c.mp, embedding_split=c.embedding_split, head_split=c.head_split,
        seq_parallel=c.seq_parallel)


def megatron_minimum(c: LlamaSizes) -> list[Term]:
    """The scheme's collectives per rank and step (module docstring), as the package lists
    them."""
    from pcompile.passes.search.megatron import minimum_terms

    return [Term(t.what, t.phase, t.operand_bytes, t.group_size, t.count, t.kind)
            for t in minimum_terms(scheme(c))]


def minimum_tally(c: LlamaSizes) -> dict[str, Any]:
    return terms_tally(megatron_minimum(c))


# -- pcompile -------------------------------------------------------------------------------------


@contextlib.contextmanager
def llama_environment(c: LlamaSizes, prefix: str = "LLAMA_") -> Iterator[None]:
    """The configuration's variables under `prefix`, and no other variable of that prefix
    (restored afterwards)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(prefix)}
    for k in saved:
        del os.environ[k]
    os.environ.update(c.env(prefix))
    try:
        yield
    finally:
        for k in c.env(prefix):
            os.environ.pop(k, None)
        os.environ.update(saved)


def pcompile_bytes(c: LlamaSizes, model_file: str = LLAMA, prefix: str = "LLAMA_",
                   top: int = 0) -> dict[str, Any]:
    """Bytes of pcompile's plan of `model_file` compiled with the configuration's sizes under
    `prefix`; with `top`, rank 0's `top` largest collectives (ring bytes) with their node,
    phase and reason."""
    from pcompile.compiler.driver.plan import read_plan
    from pcompile.tools.compile import compile as compile_model

    start = time.perf_counter()
    with llama_environment(c, prefix), tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        program = compile_model(model_file, devices=c.devices, out_dir=out, dump_ranks="all",
                                save_graphs=0)
        plan = read_plan(out)
    seconds = time.perf_counter() - start
    ranks = {rank: tally(plan_collectives(program, plan, rank)) for rank in range(c.devices)}
    plan_json = plan_json_bytes(plan, 0)
    worst = max(ranks, key=lambda r: (ranks[r].ring, -r))
    found = {**ranks[0].as_json(), "rank": 0,
             "plan_json_rank0": plan_json,
             # plan.json's own ratio (the same scheme, recognised from the compiled graph)
             "plan_json_megatron_minimum": plan.megatron_minimum.model_dump()
             if plan.megatron_minimum else None,
             "max_over_ranks": {"rank": worst, "payload_bytes": ranks[worst].payload,
                                "ring_bytes": ranks[worst].ring},
             "compile_s": round(seconds, 2)}
    if top:
        rows = [r for r in plan.collectives["0"] if r.op != "_MirrorOperator"]
        rows.sort(key=lambda r: -(r.ring_bytes or 0))
        found["top_collectives_rank0"] = [
            {"op": r.op, "node": r.node, "phase": r.phase, "group_size": len(r.rank_list),
             "ring_bytes": r.ring_bytes, "reason": r.reason} for r in rows[:top]]
    return found


# -- XLA GSPMD ------------------------------------------------------------------------------------


def jax_llama(c: LlamaSizes) -> tuple[Any, Any, Any]:
    """The Llama in JAX: (train step, parameter ShapeDtypeStructs, their NamedShardings, the
    tokens' ShapeDtypeStruct and NamedSharding) on a (dp, mp) mesh of jax.devices()."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    f32, cd = jnp.float32, jnp.dtype(c.dtype)
    hd, kv = c.head_dim, c.kv_heads * c.head_dim
    mesh = Mesh(np.array(jax.devices()[:c.devices]).reshape(c.dp, c.mp), ("dp", "mp"))
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    angles = np.outer(np.arange(c.seq), inv_freq)
    angles = np.concatenate([angles, angles], -1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    causal = np.triu(np.ones((c.seq, c.seq), bool), 1)

    def rms_norm(x: Any, w: Any) -> Any:
        xf = x.astype(f32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-5) * w
                ).astype(x.dtype)

    def linear(x: Any, w: Any) -> Any:  # weight [out, in], computed in the compute dtype
        return (x.astype(cd) @ w.astype(cd).T).astype(x.dtype)

    def rotary(x: Any) -> Any:
        xf = x.astype(f32)
        half = hd // 2
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], -1)
        return (xf * cos + rotated * sin).astype(x.dtype)

    def attention(p: dict, x: Any) -> Any:
        b, s, _ = x.shape

        def heads(t: Any, n: int) -> Any:
            return t.reshape(b, s, n, hd).transpose(0, 2, 1, 3)

        q = rotary(heads(linear(x, p["wq"]), c.heads))
        k = rotary(heads(linear(x, p["wk"]), c.kv_heads))
        v = heads(linear(x, p["wv"]), c.kv_heads)
        k, v = (jnp.repeat(t, c.heads // c.kv_heads, axis=1) for t in (k, v))
        scores = (q @ k.transpose(0, 1, 3, 2)).astype(f32) / np.sqrt(hd)
        probs = jax.nn.softmax(jnp.where(causal, -1e4, scores), -1).astype(cd)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, c.hidden)
        return linear(context, p["wo"])

    def feed_forward(p: dict, x: Any) -> Any:
        return linear(jax.nn.silu(linear(x, p["w1"])) * linear(x, p["w3"]), p["w2"])

    def loss(p: dict, ids: Any) -> Any:
        tokens, labels = ids[:, :-1], ids[:, 1:]
        h = jnp.take(p["embedding"], tokens, axis=0).astype(cd)
        for layer in p["layers"]:
            h = h + attention(layer, rms_norm(h, layer["attention_norm"]))
            h = h + feed_forward(layer, rms_norm(h, layer["ffn_norm"]))
        logits = linear(rms_norm(h, p["norm_out"]), p["lm_head"]).astype(f32)
        logits = logits.reshape(-1, c.vocab)
        labels = labels.reshape(-1)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[:, None], -1)[:, 0]
        mask = ((tokens.reshape(-1) != 0) & (labels != -100)).astype(f32)
        return jnp.sum(nll * mask) / (jnp.sum(mask) + 1e-8)

    def step(p: dict, ids: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(p, ids)
        return value, jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads)

    column, row, replicated = P("mp", None), P(None, "mp"), P()
    layer = {"attention_norm": ((c.hidden,), replicated),
             "wq": ((c.hidden, c.hidden), column), "wk": ((kv, c.hidden), column),
             "wv": ((kv, c.hidden), column), "wo": ((c.hidden, c.hidden), row),
             "ffn_norm": ((c.hidden,), replicated), "w1": ((c.ffn, c.hidden), column),
             "w3": ((c.ffn, c.hidden), column), "w2": ((c.hidden, c.ffn), row)}
    tree = {"embedding": ((c.vocab, c.hidden), column if c.embedding_split else replicated),
            "layers": [layer] * c.layers, "norm_out": ((c.hidden,), replicated),
            "lm_head": ((c.vocab, c.hidden), column if c.head_split else replicated)}

    def leaf(t: Any) -> bool:
        return isinstance(t, tuple) and len(t) == 2 and isinstance(t[1], P)

    specs = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t[0], f32), tree, is_leaf=leaf)
    shardings = jax.tree.map(lambda t: NamedSharding(mesh, t[1]), tree, is_leaf=leaf)
    tokens = (jax.ShapeDtypeStruct((c.batch, c.seq + 1), jnp.int32),
              NamedSharding(mesh, P("dp", None)))
    return step, (specs, shardings), tokens


def xla_worker(name: str, dump_dir: str, vocab_split: str = "head") -> None:
    """In a fresh process (the device count is fixed at JAX's start; XLA_FLAGS dump the HLO
    after SPMD partitioning into `dump_dir`): compile the JAX step and print, for the
    compiled HLO and for the partitioner's output, the collectives as rank 0 runs them and
    every rank's ring total."""
    import glob

    c = replace(CONFIGS[name], vocab_split=vocab_split)
    import jax

    jax.config.update("jax_num_cpu_devices", c.devices)
    step, (specs, shardings), (tokens, token_sharding) = jax_llama(c)
    replicated = jax.sharding.NamedSharding(token_sharding.mesh, jax.sharding.PartitionSpec())
    jitted = jax.jit(step, in_shardings=(shardings, token_sharding),
                     out_shardings=(replicated, shardings))
    texts = {"compiled": jitted.lower(specs, tokens).compile().as_text()}
    found = sorted(glob.glob(os.path.join(dump_dir, "*jit_step*after_spmd-partitioning*.txt")))
    if found:
        with open(found[-1], encoding="utf-8") as f:
            texts["partitioned"] = f.read()
    out = {}
    for key, text in texts.items():
        out[key] = {"collectives": [(x.kind, x.operand_bytes, list(x.group), x.phase)
                                    for x in hlo_collectives(text, c.devices)],
                    "ring_per_rank": [tally(hlo_collectives(text, c.devices, r)).ring
                                      for r in range(c.devices)]}
    print(json.dumps(out))


def xla_bytes(name: str, vocab_split: str = "head") -> dict[str, dict[str, Any]]:
    """{"xla_gspmd": the compiled HLO's collectives, "xla_gspmd_partitioner": those of the
    HLO right after SPMD partitioning}. The two carry the same bytes in float32; on CPU, XLA
    then promotes bfloat16 all-reduces to float32 (`all-reduce-promotion`,
    `float-normalization-bf16`: the CPU runtime does not reduce bfloat16), so in bfloat16 the
    partitioner's count is what a GPU build moves."""
    c = replace(CONFIGS[name], vocab_split=vocab_split)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_pass_re=spmd-partitioning"
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--xla-worker", name,
                               dump, vocab_split], capture_output=True, text=True,
                              timeout=900, env=env)
    seconds = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        failed = {"status": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
        return {"xla_gspmd": failed}
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    sides = {}
    for key, side in (("compiled", "xla_gspmd"), ("partitioned", "xla_gspmd_partitioner")):
        if key not in raw:
            continue
        items = []
        for kind, size, group, phase in raw[key]["collectives"]:
            if phase == "backward" and len({r // c.mp for r in group}) > 1:
                phase = "gradient_reduction"  # crosses data-parallel replicas
            items.append(Collective(kind, size, tuple(group), phase))
        per_rank = raw[key]["ring_per_rank"]
        worst = max(range(len(per_rank)), key=lambda r: (per_rank[r], -r))
        sides[side] = {**tally(items).as_json(), "rank": 0,
                       "max_over_ranks": {"rank": worst, "ring_bytes": per_rank[worst]},
                       "compile_s": seconds}
    return sides


# -- driver ---------------------------------------------------------------------------------------


def measure(name: str, xla: bool = True, model_file: str = LLAMA, prefix: str = "LLAMA_",
            top: int = 0, vocab_split: str = "head") -> dict[str, Any]:
    c = replace(CONFIGS[name], vocab_split=vocab_split)
    minimum = minimum_tally(c)
    row: dict[str, Any] = {"sizes": asdict(c), "devices": c.devices,
                           "model_file": os.path.relpath(model_file, ROOT)
                           if model_file == LLAMA else model_file,
                           "pcompile": pcompile_bytes(c, model_file, prefix, top)}
    if xla and not c.seq_parallel:  # the JAX model has no sequence-parallel shardings
        row.update(xla_bytes(name, vocab_split))
    row["megatron_minimum"] = minimum
    row["ratio_to_minimum"] = {
        side: round(row[side]["ring_bytes"] / minimum["ring_bytes"], 3)
        for side in ("pcompile", "xla_gspmd", "xla_gspmd_partitioner")
        if "ring_bytes" in row.get(side, {})}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append",
                        help="measure this configuration (repeatable; default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA GSPMD side")
    parser.add_argument("--model-file", default=LLAMA, metavar="PATH",
                        help="measure this model file instead of examples/llama.py; it reads "
                        "the configuration's sizes from PREFIX_LAYERS, PREFIX_HIDDEN, "
                        "PREFIX_HEADS, PREFIX_KV_HEADS, PREFIX_FFN, PREFIX_VOCAB, PREFIX_SEQ, "
                        "PREFIX_BATCH, PREFIX_DTYPE, PREFIX_MP (and PREFIX_SEQ_PARALLEL)")
    parser.add_argument("--env-prefix", default="LLAMA_", metavar="PREFIX",
                        help="the prefix of those variables (default LLAMA_)")
    parser.add_argument("--vocab-split", choices=("head", "none", "both"), default="head",
                        help="how the vocabulary is split (the minimum's scheme, and "
                        "PREFIX_VOCAB_EMB_DP for the model file): head = the LM head "
                        "column-split, the embedding replicated (examples/llama.py); none = "
                        "both replicated (mindformers' vocab_emb_dp: True); both = the "
                        "embedding split by rows, the head by columns (vocab_emb_dp: False)")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list rank 0's N largest collectives (node, phase, reason)")
    parser.add_argument("--xla-worker", nargs=3, metavar=("CONFIG", "DUMP", "VOCAB_SPLIT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.xla_worker:
        xla_worker(*args.xla_worker)
        return
    names = [QUICK] if args.quick else args.config or list(CONFIGS)
    results = {}
    for name in names:
        results[name] = measure(name, xla=not args.no_xla,
                                model_file=os.path.abspath(args.model_file),
                                prefix=args.env_prefix, top=args.top,
                                vocab_split=args.vocab_split)
        print(name, json.dumps(results[name]["ratio_to_minimum"]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "plan_bytes", "convention": {
        "payload": "bytes of each collective's operand on one rank",
        "ring": "bytes one rank sends with ring algorithms"}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
