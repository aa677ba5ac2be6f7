"""DeepSeek-V3 of `examples/deepseek.py` with sequence parallelism on and recompute off: bytes
per rank per training step against the plan mindformers' strategies intend (issue 35's target:
activation and AlltoAll bytes, and the whole step, at most 1.02x). Prints one JSON object.

    python benchmarks/deepseek_bytes.py                       # every configuration
    python benchmarks/deepseek_bytes.py --config tiny_dp4_mp2_ep4 --top 20

Configurations (`CONFIGS`; the example's tiny sizes: 2 layers, the first dense, hidden 64, 8
heads, q_lora 32, kv_lora 16, nope / rope / v head dims 8, dense FFN 128, expert FFN 32, 8
experts, top 2, capacity factor 1.5, 8 routing groups, vocabulary 128, sequence 16, batch 8;
bfloat16 compute, flash attention, the fused router, no MTP):

* `tiny_dp4_mp2_ep4`: the example's default, dp 4 x mp 2 x ep 4 on 8 devices;
* `tiny_dp2_mp4_ep2`: dp 2 x mp 4 x ep 2 on 8 devices.

**pcompile**: `pcompile examples/deepseek.py --devices N --no-check` with DEEPSEEK_* set, in a
subprocess; rank 0's collectives of plan.json by phase and kind
(`collective_bytes.plan_collectives`: `_MirrorOperator`s out, their gradient AllReduces in
`gradient_reduction`). `--top N` lists rank 0's N largest collectives (ring bytes) with the
reason plan.json gives for each.

**mindformers' intended plan** (`intended`), per rank and step, from the example's `.shard()`
strategies (mindformers'), with b = batch / dp the local batch, s the sequence, T = b s the
tokens of a data-parallel rank, e the compute dtype's bytes, R = T / mp the rows a rank holds
under sequence parallelism, L layers of which M are MoE layers, X = G E C h e / dp the expert
slots a rank holds (G routing groups, C = ceil(k (b s dp / G) cf / E) slots per expert),
AG(S, n) an AllGather of a piece of S bytes, RS(S, n) a ReduceScatter of S bytes, AR, A2A:

    forward   per layer (MLA)  AG(R q_lora e, mp)    lq_norm's rows to l2q_nope / l2q_pe
                               AG(R kv_lora e, mp)   lkv_norm's rows to lkv2kv_k_nope / _v
                               AG(R rope e, mp)      k_pe's rows to the heads' Tile
                               RS(T h e, mp)         wo's output to the split tokens
              dense layers     AG(R h e, mp) + RS(T h e, mp)       w1 / w3 in, w2 out
              MoE layers       AG(R h e, mp)         the normalised tokens, once for the
                                                     router, the experts and the shared expert
                               2 A2A(X, ep)          dispatch and combine
                               AR(X, mp)             the experts' w2 (row-parallel)
                               RS(T h e, mp) + AG(R h e, mp)   the shared expert's w2 out,
                                                     back to dp for the add with the routed
                               AG(4 G E / dp, dp)    the routing probabilities' mean (1, 1)
                               AR(4, dp)             the balance loss's mean
              head and loss    AG(R h e, mp)         the LM head's input
                               3 AR(4 T, mp)         vocab-parallel cross-entropy
                               2 AG(4 T, dp)         the masked mean's (1,) strategies: the
                                                     loss and the mask, whole on every rank
    backward  the transposes of the forward's, except where no gradient flows (the routing
              probabilities' mean feeds only the expert load; the mask): an AG's is an RS of
              the same ring bytes and the reverse, an A2A's an A2A, an AR's an AR
    gradients AR(4 P_all, dp mp)       float32 gradients of the weights every rank holds
                                       (embedding, norms, q2l, kv2l, k_pe, routers)
              + AR(4 P_mp, dp)         of those split over mp (l2q, lkv2kv, wo, the dense
                                       and shared FFNs, the LM head)
              + AR(4 P_experts, dp / ep)   the experts' slices

One AllGather per tensor and layout: a tensor two ops read in the same layout (the MoE
layer's input, read by the router's reshape and by the shared expert's w1 / w3) is gathered
once. Bytes in the two conventions of `collective_bytes.py` (payload; ring: AllReduce
2 (n-1)/n S, AllGather (n-1) S, ReduceScatter and AlltoAll (n-1)/n S); the ratios compare ring
bytes: `ratio_activations` the forward and backward phases (activations and AlltoAlls),
`ratio_step` the whole step. Nothing is asserted: the numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, BENCHMARKS)
DEEPSEEK = os.path.join(ROOT, "examples", "deepseek.py")

from collective_bytes import Term, plan_collectives, plan_json_bytes, tally, terms_tally  # noqa: E402

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DeepSeekSizes:
    """One configuration of examples/deepseek.py and its mesh (devices = dp x mp)."""

    dp: int
    mp: int
    ep: int
    layers: int = 2
    dense: int = 1
    hidden: int = 64
    heads: int = 8
    q_lora: int = 32
    kv_lora: int = 16
    nope: int = 8
    rope: int = 8
    v_head: int = 8
    ffn: int = 128
    moe_ffn: int = 32
    experts: int = 8
    top_k: int = 2
    vocab: int = 128
    seq: int = 16
    batch: int = 8
    groups: int = 8
    capacity_factor: float = 1.5
    dtype: str = "bfloat16"

    @property
    def devices(self) -> int:
        return self.dp * self.mp

    @property
    def capacity(self) -> int:
        tokens = self.batch * self.seq // self.groups
        return min(math.ceil(self.top_k * tokens * self.capacity_factor / self.experts),
                   self.top_k * tokens)

    def env(self) -> dict[str, str]:
        sizes = {"LAYERS": self.layers, "DENSE": self.dense, "HIDDEN": self.hidden,
                 "HEADS": self.heads, "Q_LORA": self.q_lora, "KV_LORA": self.kv_lora,
                 "NOPE": self.nope, "ROPE": self.rope, "V_HEAD": self.v_head, "FFN": self.ffn,
                 "MOE_FFN": self.moe_ffn, "EXPERTS": self.experts, "TOP_K": self.top_k,
                 "VOCAB": self.vocab, "SEQ": self.seq, "BATCH": self.batch,
                 "GROUPS": self.groups, "CAPACITY": self.capacity_factor, "DTYPE": self.dtype,
                 "MP": self.mp, "EP": self.ep, "SEQ_PARALLEL": 1, "RECOMPUTE": 0, "MTP": 0,
                 "PARALLEL_OPTIMIZER": 0, "PRESET": "tiny"}
        return {f"DEEPSEEK_{k}": str(v) for k, v in sizes.items()}


CONFIGS = {
    "tiny_dp4_mp2_ep4": DeepSeekSizes(dp=4, mp=2, ep=4),
    "tiny_dp2_mp4_ep2": DeepSeekSizes(dp=2, mp=4, ep=2),
}


def parameters(c: DeepSeekSizes) -> dict[str, int]:
    """Each rank's parameter elements by the ranks that hold the same slice (module
    docstring): every rank, the dp ranks of an mp slice, the dp / ep ranks of an expert's."""
    h, moe = c.hidden, c.layers - c.dense
    norms = 2 * h + c.q_lora + c.kv_lora
    every = (c.layers * (norms + h * (c.q_lora + c.kv_lora + c.rope)) + moe * c.experts * h
             + c.vocab * h + h)
    attention = c.heads * (c.q_lora * (c.nope + c.rope) + c.kv_lora * (c.nope + c.v_head)
                           + c.v_head * h)
    split = (c.layers * attention + c.dense * 3 * h * c.ffn + moe * 3 * h * c.moe_ffn
             + c.vocab * h) // c.mp
    experts = moe * 3 * c.experts * h * c.moe_ffn // (c.ep * c.mp)
    return {"every_rank": every, "mp_split": split, "experts": experts}


def _gather(what: str, phase: str, piece: int, group: int, count: int) -> Term:
    """An AllGather of `piece` bytes a rank in the forward; in the backward its transpose, a
    ReduceScatter of the gathered whole (the same ring bytes)."""
    if phase == "forward":
        return Term(what, phase, piece, group, count, "AllGather")
    return Term(what, phase, piece * group, group, count, "ReduceScatter")


def _scatter(what: str, phase: str, whole: int, group: int, count: int) -> Term:
    """A ReduceScatter of `whole` bytes in the forward; in the backward an AllGather of a
    rank's piece of it."""
    if phase == "forward":
        return Term(what, phase, whole, group, count, "ReduceScatter")
    return Term(what, phase, whole // group, group, count, "AllGather")


def intended(c: DeepSeekSizes) -> list[Term]:
    """The collectives mindformers' strategies intend per rank and step (module docstring)."""
    e = DTYPE_BYTES[c.dtype]
    tokens = c.batch // c.dp * c.seq
    rows = tokens // c.mp
    slots = c.groups * c.experts * c.capacity * c.hidden * e // c.dp
    moe = c.layers - c.dense
    act, piece = tokens * c.hidden * e, rows * c.hidden * e
    terms: list[Term] = []
    for phase, note in (("forward", ""), ("backward", " (transposed)")):
        def ag(what: str, piece_bytes: int, group: int, count: int, phase: str = phase,
               note: str = note) -> None:
            terms.append(_gather(what + note, phase, piece_bytes, group, count))

        def rs(what: str, whole: int, group: int, count: int, phase: str = phase,
               note: str = note) -> None:
            terms.append(_scatter(what + note, phase, whole, group, count))

        ag("lq_norm's rows to l2q_nope_proj / l2q_pe_proj", rows * c.q_lora * e, c.mp,
           c.layers)
        ag("lkv_norm's rows to lkv2kv_k_nope / lkv2kv_v", rows * c.kv_lora * e, c.mp,
           c.layers)
        ag("k_pe's rows to the heads' Tile", rows * c.rope * e, c.mp, c.layers)
        rs("wo's output to the split tokens", act, c.mp, c.layers)
        ag("the dense FFN's w1 / w3 input", piece, c.mp, c.dense)
        rs("the dense FFN's w2 output", act, c.mp, c.dense)
        ag("the MoE layer's input (router, experts, shared expert)", piece, c.mp, moe)
        rs("the shared expert's w2 output", act, c.mp, moe)
        ag("the shared expert's output to the add with the routed (dp, 1, 1)", piece, c.mp,
           moe)
        terms.append(Term("dispatch and combine AlltoAlls" + note, phase, slots, c.ep,
                          2 * moe, "AlltoAll"))
        terms.append(Term("the experts' w2 output (row-parallel)" + note, phase, slots, c.mp,
                          moe))
        terms.append(Term("the balance loss's mean over the routing groups" + note, phase, 4,
                          c.dp, moe))
        ag("the LM head's input", piece, c.mp, 1)
        ag("the masked mean's loss, whole on every rank", 4 * tokens, c.dp, 1)
        if phase == "forward":
            terms.append(Term("cross-entropy over the split vocabulary", phase, 4 * tokens,
                              c.mp, 3))
            ag("the masked mean's mask, whole on every rank", 4 * tokens, c.dp, 1)
            ag("the routing probabilities' mean (1, 1), for the expert load",
               4 * c.groups * c.experts // c.dp, c.dp, moe)
    p = parameters(c)
    terms += [
        Term(f"float32 gradients of the {p['every_rank']} weights every rank holds",
             "gradient_reduction", 4 * p["every_rank"], c.devices, 1),
        Term(f"float32 gradients of the {p['mp_split']} weights split over mp",
             "gradient_reduction", 4 * p["mp_split"], c.dp, 1),
        Term(f"float32 gradients of the {p['experts']} expert weights a rank holds",
             "gradient_reduction", 4 * p["experts"], c.dp // c.ep, 1),
    ]
    return terms


def compile_worker(name: str, top: int) -> None:
    """In a subprocess: compile the configuration and print rank 0's collectives."""
    from pcompile.compiler.driver.plan import read_plan
    from pcompile.tools.compile import compile as compile_model

    c = CONFIGS[name]
    os.environ.update(c.env())
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        program = compile_model(DEEPSEEK, devices=c.devices, out_dir=tmp, dump_ranks=[0],
                                save_graphs=0)
        seconds = time.perf_counter() - start
        plan = read_plan(tmp)
        found = plan_collectives(program, plan, 0)
    rows = [r for r in plan.collectives["0"] if r.op != "_MirrorOperator"]
    rows.sort(key=lambda r: (-(r.ring_bytes or 0), r.node))
    largest = [{"op": r.op, "phase": r.phase, "ranks": len(r.rank_list),
                "ring_bytes": r.ring_bytes, "node": r.node, "reason": r.reason}
               for r in rows[:top]]
    print(json.dumps({"compile_s": round(seconds, 2), "tally": tally(found).as_json(),
                      "plan_json_rank0": plan_json_bytes(plan, 0), "largest": largest}))


def activation_ring(t: dict[str, Any]) -> int:
    return sum(t["by_phase"].get(p, {}).get("ring_bytes", 0) for p in ("forward", "backward"))


def measure(name: str, top: int) -> dict[str, Any]:
    c = CONFIGS[name]
    proc = subprocess.run([sys.executable, __file__, "--compile-worker", name, "--top",
                           str(top)], stdout=subprocess.PIPE, text=True, cwd=ROOT, check=False)
    if proc.returncode:
        raise SystemExit(f"{name}: the compile failed (exit {proc.returncode})")
    worker = json.loads(proc.stdout.strip().splitlines()[-1])
    found, minimum = worker["tally"], terms_tally(intended(c))
    row: dict[str, Any] = {
        "sizes": asdict(c), "devices": c.devices, "capacity": c.capacity,
        "compile_s": worker["compile_s"],
        "pcompile": {**found, "plan_json_rank0": worker["plan_json_rank0"]},
        "intended": minimum,
        "ratio_activations": round(activation_ring(found) / activation_ring(minimum), 3),
        "ratio_step": round(found["ring_bytes"] / minimum["ring_bytes"], 3)}
    if top:
        row["largest"] = worker["largest"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append",
                        help="measure this configuration (repeatable; default: all)")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="list rank 0's N largest collectives with their reasons")
    parser.add_argument("--compile-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_worker:
        compile_worker(args.compile_worker, args.top)
        return
    results = {}
    for name in args.config or list(CONFIGS):
        results[name] = measure(name, args.top)
        print(name, results[name]["ratio_activations"], results[name]["ratio_step"],
              file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "deepseek_bytes", "results": results}, indent=1))


if __name__ == "__main__":
    main()
