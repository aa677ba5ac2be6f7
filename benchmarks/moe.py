"""The mixture of experts of `examples/mixtral.py` under expert parallelism: bytes per rank
per training step against the plan mindformers intends, and compile time and memory up to
Mixtral-8x7B on 64 devices. Prints one JSON object.

    python benchmarks/moe.py                          # every configuration
    python benchmarks/moe.py --config tiny_dp8_ep8    # one of them

Configurations (`CONFIGS`; bfloat16 compute, flash attention, AdamWeightDecay, top 2 of 8
experts, capacity factor 1.1, 8 routing groups):

* `tiny_dp8_ep8`: 2 layers, hidden 64, 8 heads, 4 kv heads, expert FFN 128, vocabulary 128,
  sequence 16, batch 8; dp 8 x mp 1 x ep 8 on 8 devices (mindformers' Mixtral layout);
* `tiny_dp4_mp2_ep4`: the same model, dp 4 x mp 2 x ep 4 on 8 devices;
* `mixtral_8x7b_64`: 32 layers, hidden 4096, 32 heads, 8 kv heads, expert FFN 14336,
  vocabulary 32000, sequence 4096, batch 8; dp 8 x mp 8 x ep 8 on 64 devices (rank 0's dumps
  only, no check: the compile time and peak memory of a real size).

**pcompile**: `pcompile examples/mixtral.py --devices N --no-check` with MIXTRAL_* set, in a
subprocess (its peak RSS is the compile's memory); rank 0's collectives of plan.json by
phase and kind (`collective_bytes.plan_collectives`: `_MirrorOperator`s out, their gradient
AllReduces in `gradient_reduction`), the AlltoAlls per direction, and any AllGather or
ReduceScatter inside the MoE layers (`moe_gathers`: the expert activations gathered instead
of exchanged; mindformers' plan has none).

**mindformers' intended plan** (`intended`), per rank and step, with G routing groups of
T = batch x seq / G tokens, C = ceil(2 T 1.1 / E) slots per expert, e the compute dtype's
bytes, X = G E C h e / dp the expert slots a rank holds (before and after the exchange, and
the row-parallel output of its experts), A = (batch / dp) seq h e the local activation, L
layers, AR(S, n) / A2A(S, n) one AllReduce / AlltoAll of S bytes over n ranks:

    forward   2 L A2A(X, ep)                dispatch and combine of every MoE layer
              + L AR(A, mp) + L AR(X, mp)   attention's wo and the experts' w2 (row-parallel)
              + 3 AR(4 b s, mp)             vocab-parallel cross-entropy (as Llama's)
              + 2 AR(4, dp) + L AR(4, dp)   the masked mean and each layer's balance loss
    backward  2 L A2A(X, ep)                their transposes
              + L AR(A, mp) + L AR(X, mp)   q/k/v's and w1/w3's input gradients, summed
              + AR(A, mp)                   the LM head's input gradient
    gradients AR(4 P_dense, dp)             float32 gradients of the weights every
                                            data-parallel rank holds (embedding, norms,
                                            attention / mp, router, LM head / mp)
              + AR(4 P_expert, dp / ep)     the experts' slices, held by dp / ep ranks

Bytes in the two conventions of `collective_bytes.py` (payload; ring: AllReduce 2 (n-1)/n S,
AlltoAll (n-1)/n S, AllGather (n-1) S); `ratio_to_intended` compares ring bytes. Nothing is
asserted: the numbers go to docs/benchmarks.md.
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
MIXTRAL = os.path.join(ROOT, "examples", "mixtral.py")

from collective_bytes import (  # noqa: E402
    Term,
    plan_collectives,
    plan_json_bytes,
    tally,
    terms_tally,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MoESizes:
    """One configuration of examples/mixtral.py and its mesh (devices = dp x mp)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    dp: int
    mp: int
    ep: int
    experts: int = 8
    top_k: int = 2
    groups: int = 8
    dtype: str = "bfloat16"
    capacity_factor: float = 1.1

    @property
    def devices(self) -> int:
        return self.dp * self.mp

    @property
    def capacity(self) -> int:
        tokens = self.batch * self.seq // self.groups
        return min(math.ceil(self.top_k * tokens * self.capacity_factor / self.experts),
                   self.top_k * tokens)

    def env(self) -> dict[str, str]:
        return {"MIXTRAL_LAYERS": str(self.layers), "MIXTRAL_HIDDEN": str(self.hidden),
                "MIXTRAL_HEADS": str(self.heads), "MIXTRAL_KV_HEADS": str(self.kv_heads),
                "MIXTRAL_FFN": str(self.ffn), "MIXTRAL_VOCAB": str(self.vocab),
                "MIXTRAL_SEQ": str(self.seq), "MIXTRAL_BATCH": str(self.batch),
                "MIXTRAL_EXPERTS": str(self.experts), "MIXTRAL_TOP_K": str(self.top_k),
                "MIXTRAL_GROUPS": str(self.groups), "MIXTRAL_DTYPE": self.dtype,
                "MIXTRAL_CAPACITY": str(self.capacity_factor), "MIXTRAL_MP": str(self.mp),
                "MIXTRAL_EP": str(self.ep)}


TINY = dict(layers=2, hidden=64, heads=8, kv_heads=4, ffn=128, vocab=128, seq=16, batch=8)
CONFIGS = {
    "tiny_dp8_ep8": MoESizes(**TINY, dp=8, mp=1, ep=8),
    "tiny_dp4_mp2_ep4": MoESizes(**TINY, dp=4, mp=2, ep=4),
    "mixtral_8x7b_64": MoESizes(32, 4096, 32, 8, 14336, 32000, 4096, 8, dp=8, mp=8, ep=8),
}


def intended(c: MoESizes) -> list[Term]:
    """mindformers' plan's collectives per rank and step (module docstring)."""
    e = DTYPE_BYTES[c.dtype]
    b = c.batch // c.dp
    act = b * c.seq * c.hidden * e
    slots = c.groups * c.experts * c.capacity * c.hidden * e // c.dp
    head_dim = c.hidden // c.heads
    kv = c.kv_heads * head_dim
    dense = (c.layers * ((2 * c.hidden * c.hidden + 2 * c.hidden * kv) // c.mp
                         + 2 * c.hidden + c.hidden * c.experts)
             + c.hidden + c.vocab * c.hidden + c.vocab * c.hidden // c.mp)
    expert = c.layers * 3 * c.experts * c.hidden * c.ffn // (c.ep * c.mp)
    layers = c.layers
    return [
        Term("dispatch and combine AlltoAlls", "forward", slots, c.ep, 2 * layers, "AlltoAll"),
        Term("attention's wo output (row-parallel)", "forward", act, c.mp, layers),
        Term("the experts' w2 output (row-parallel)", "forward", slots, c.mp, layers),
        Term("cross-entropy over the split vocabulary", "forward", 4 * b * c.seq, c.mp, 3),
        Term("masked mean of the loss and each layer's balance loss", "forward", 4, c.dp,
             2 + layers),
        Term("dispatch and combine AlltoAlls (transposed)", "backward", slots, c.ep, 2 * layers,
             "AlltoAll"),
        Term("q/k/v's input gradient (column-parallel)", "backward", act, c.mp, layers),
        Term("w1/w3's input gradient (column-parallel)", "backward", slots, c.mp, layers),
        Term("the LM head's input gradient", "backward", act, c.mp, 1),
        Term(f"float32 gradients of the {dense} dense weights a rank holds",
             "gradient_reduction", 4 * dense, c.dp, 1),
        Term(f"float32 gradients of the {expert} expert weights a rank holds",
             "gradient_reduction", 4 * expert, c.dp // c.ep, 1),
    ]


def intended_tally(c: MoESizes) -> dict[str, Any]:
    return terms_tally(intended(c))


def compile_worker(name: str) -> None:
    """In a subprocess: compile the configuration and print rank 0's collectives."""
    from pcompile.compiler.driver.plan import read_plan
    from pcompile.tools.compile import compile as compile_model

    c = CONFIGS[name]
    os.environ.update(c.env())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        start = time.perf_counter()
        program = compile_model(MIXTRAL, devices=c.devices, out_dir=out, dump_ranks=[0],
                                save_graphs=0)
        seconds = time.perf_counter() - start
        plan = read_plan(out)
        rows = [r for r in plan.collectives["0"] if r.op != "_MirrorOperator"]
        found = plan_collectives(program, plan, 0)
    moe_gathers = [r.node for r in rows if r.op in ("AllGather", "ReduceScatter")
                   and "/moe-MoE/" in r.node]
    alltoall = {phase: sum(1 for r in rows if r.op == "AlltoAll" and r.phase == phase)
                for phase in ("forward", "backward")}
    print(json.dumps({"compile_s": round(seconds, 2), "tally": tally(found).as_json(),
                      "plan_json_rank0": plan_json_bytes(plan, 0),
                      "alltoall_per_direction": alltoall, "moe_gathers": moe_gathers}))


def measure(name: str) -> dict[str, Any]:
    c = CONFIGS[name]
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--compile-worker", name],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{name}: the compile failed (exit {os.waitstatus_to_exitcode(status)})")
    worker = json.loads(stdout.strip().splitlines()[-1])
    row: dict[str, Any] = {
        "sizes": asdict(c), "devices": c.devices, "capacity": c.capacity,
        "pcompile": {**worker["tally"], "plan_json_rank0": worker["plan_json_rank0"],
                     "alltoall_per_direction": worker["alltoall_per_direction"],
                     "moe_gathers": worker["moe_gathers"]},
        "compile_s": worker["compile_s"],
        "process_s": round(time.perf_counter() - start, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}
    minimum = intended_tally(c)
    row["intended"] = minimum
    row["ratio_to_intended"] = round(row["pcompile"]["ring_bytes"] / minimum["ring_bytes"], 3)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append",
                        help="measure this configuration (repeatable; default: all)")
    parser.add_argument("--compile-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_worker:
        compile_worker(args.compile_worker)
        return
    results = {}
    for name in args.config or list(CONFIGS):
        results[name] = measure(name)
        print(name, results[name]["ratio_to_intended"], results[name]["compile_s"],
              results[name]["peak_rss_mb"], file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "moe", "results": results}, indent=1))


if __name__ == "__main__":
    main()
