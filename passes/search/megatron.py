"""The analytic Megatron-LM minimum of bytes per rank and step, for a decoder-only transformer
the project knows (mindformers' Llama naming), and a plan's ratio to it.

A plan of such a model is compared with what Megatron-LM's tensor parallelism must move at the
same model-parallel width: `recognise(graph, devices, layout_of)` finds the transformer's sizes
and the plan's scheme in a compiled forward graph; `minimum_terms(sizes)` lists the scheme's
collectives (benchmarks/plan_bytes.py prints them, docs/benchmarks.md explains them);
`MegatronMinimum` goes into plan.json (`megatron_minimum`) and `pcompile show`.

With b s the tokens one data-parallel replica trains per step, h the hidden size, e the
activation's bytes, A = b s h e, L the layers, AR(S, n) one AllReduce of S bytes over n ranks:

    forward   2 L AR(A, mp)                the outputs of wo and w2 (row-parallel)
              + 3 AR(4 b s, mp)            vocab-parallel cross-entropy
              + 2 AR(4, dp)                the masked mean: loss sum and token count
    backward  2 L AR(A, mp)                the input gradients of q/k/v and of w1/w3
              + AR(A, mp)                  the input gradient of the LM head
    gradients AR(4 P, dp)                  the rank's float32 parameter slices, P elements

plus, by scheme: the embedding's partial sums AR(A, mp) when the embedding is split by
vocabulary rows; the replicated LM head's float32 gradient over all ranks when the head is not
split (each rank computes its vocabulary slice of the logits, the loss stays vocab-parallel);
the embedding output's gradient gathered over the sequence under sequence parallelism.
Bytes are ring bytes (`comm_info.ring_bytes`: what one rank sends). The parallel optimizer
moves the same ring bytes (ReduceScatter + AllGather for the AllReduce); recompute and
pipeline stages are outside the scheme (pipelined plans get no minimum).

Recognised: parameters named `...layers.<i>.attention.{wq,wk,wv,wo}.weight`,
`...layers.<i>.feed_forward.{w1,w2,w3}.weight` (2-D, `[out, in]`), one `...embedding_weight`
`[V, h]` and `lm_head.weight` `[V, h]`. Anything else (mixture of experts, fused qkv) is not
recognised, and the plan gets no minimum.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pcompile.ir.core import Graph, Value
from pcompile.ir.types import TensorType
from pcompile.passes.comm_info import ring_bytes
from pcompile.passes.search.time_model import stored_param

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight$")


@dataclass(frozen=True)
class TransformerSizes:
    """A decoder-only transformer under Megatron's scheme at (dp, mp)."""

    layers: int
    hidden: int
    kv: int  #: kv heads x head dim (the rows of wk and wv)
    ffn: int
    vocab: int
    tokens: int  #: tokens one data-parallel replica trains per step (b s)
    act_bytes: int  #: bytes per activation element (the compute dtype)
    dp: int
    mp: int
    embedding_split: bool = False  #: embedding split by vocabulary rows over mp
    head_split: bool = True  #: LM head split by vocabulary rows (its output's columns) over mp
    seq_parallel: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.mp

    def as_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "hidden": self.hidden, "kv": self.kv, "ffn": self.ffn,
                "vocab": self.vocab, "tokens": self.tokens, "act_bytes": self.act_bytes,
                "dp": self.dp, "mp": self.mp, "embedding_split": self.embedding_split,
                "head_split": self.head_split, "seq_parallel": self.seq_parallel}


@dataclass(frozen=True)
class Term:
    """`count` collectives `kind` of `operand_bytes` over `group_size` ranks."""

    what: str
    phase: str
    operand_bytes: int
    group_size: int
    count: int
    kind: str = "AllReduce"

    @property
    def ring(self) -> int:
        return self.count * ring_bytes(self.kind, self.operand_bytes, self.group_size)


def parameters_per_rank(c: TransformerSizes) -> int:
    """Elements of the parameters one rank holds (and reduces the gradients of) under the
    scheme: the layer matrices split over mp, norms whole, the vocabulary tables by scheme."""
    per_layer = (2 * c.hidden * c.hidden + 2 * c.hidden * c.kv + 3 * c.hidden * c.ffn) // c.mp
    table = c.vocab * c.hidden
    return (c.layers * (per_layer + 2 * c.hidden) + c.hidden
            + (table // c.mp if c.embedding_split else table)
            + (table // c.mp if c.head_split else 0))


def minimum_terms(c: TransformerSizes) -> list[Term]:
    """The scheme's collectives per rank and step (module docstring)."""
    act = c.tokens * c.hidden * c.act_bytes
    params = parameters_per_rank(c)
    terms = [
        Term("wo and w2 outputs (row-parallel)", "forward", act, c.mp, 2 * c.layers),
        Term("cross-entropy over the split vocabulary: max, sum of exp, target logit",
             "forward", 4 * c.tokens, c.mp, 3),
        Term("masked mean of the loss: sum and token count", "forward", 4, c.dp, 2),
        Term("input gradients of q/k/v and of w1/w3 (column-parallel)", "backward", act,
             c.mp, 2 * c.layers),
        Term("input gradient of the LM head (column-parallel)", "backward", act, c.mp, 1),
        Term(f"float32 gradients of the rank's {params} parameters", "gradient_reduction",
             4 * params, c.dp, 1),
    ]
    if c.embedding_split:
        terms.append(Term("embedding output (vocab-parallel lookup: partial sums)", "forward",
                          act, c.mp, 1))
    if not c.head_split:
        # each rank's rows of the replicated head's gradient come from its vocabulary slice of
        # the logits' cotangent, summed over mp and dp at once
        terms.append(Term("float32 gradient of the replicated LM head (rows from each mp "
                          "rank's vocabulary slice)", "gradient_reduction",
                          4 * c.vocab * c.hidden, c.devices, 1))
    if c.seq_parallel:
        # each activation AllReduce is a ReduceScatter and an AllGather of the same ring bytes;
        # the embedding's output is scattered over the sequence, so its gradient is gathered
        terms.append(Term("sequence parallel: the embedding output's gradient, gathered over "
                          "the sequence", "backward", act // c.mp, c.mp, 1, "AllGather"))
    return terms


def minimum_ring_bytes(c: TransformerSizes) -> int:
    return sum(t.ring for t in minimum_terms(c))


@dataclass(frozen=True)
class Transformer:
    """A recognised transformer and the scheme its plan follows: `scheme` at the plan's own
    model-parallel width (None when that width gives no valid Megatron mesh), `schemes()` every
    valid one on the same devices."""

    base: TransformerSizes  #: tokens: the global tokens per step; dp 1, mp 1
    devices: int
    batch: int | None  #: the global batch (the activation's first dim), when it has one
    plan_mp: int

    def at(self, dp: int, mp: int, **flags: bool) -> TransformerSizes | None:
        """The scheme at (dp, mp), or None where the sizes do not divide."""
        b = self.base
        if dp * mp != self.devices or b.tokens % dp or (self.batch and self.batch % dp):
            return None
        if b.kv % mp or b.ffn % mp or b.hidden % mp:
            return None
        sizes = replace(b, dp=dp, mp=mp, tokens=b.tokens // dp, **flags)
        if (sizes.head_split or sizes.embedding_split) and b.vocab % mp:
            return None
        return sizes

    @property
    def scheme(self) -> TransformerSizes | None:
        return self.at(self.devices // self.plan_mp, self.plan_mp)

    def schemes(self) -> list[TransformerSizes]:
        """Every valid (dp, mp) and vocabulary split, without sequence parallelism (which
        moves more, never less)."""
        found = []
        for mp in range(1, self.devices + 1):
            if self.devices % mp:
                continue
            for head in (True, False):
                for emb in (False, True):
                    s = self.at(self.devices // mp, mp, head_split=head, embedding_split=emb,
                                seq_parallel=False)
                    if s is not None:
                        found.append(s)
        return found


@dataclass(frozen=True)
class MegatronMinimum:
    """A plan's ring bytes on one rank next to the scheme's minimum at its own (dp, mp) and
    the least over every valid Megatron scheme on the same devices."""

    model: Transformer
    rank: int
    ring_bytes: int

    def as_dict(self) -> dict[str, Any]:
        own = self.model.scheme
        best = min(self.model.schemes(), key=lambda s: (minimum_ring_bytes(s), -s.dp),
                   default=None)
        out: dict[str, Any] = {"rank": self.rank, "ring_bytes": self.ring_bytes,
                               "scheme": None, "minimum_ring_bytes": None, "ratio": None,
                               "best_scheme": None, "best_minimum_ring_bytes": None,
                               "ratio_to_best": None}
        for key, sizes in (("", own), ("best_", best)):
            if sizes is None:
                continue
            minimum = minimum_ring_bytes(sizes)
            out[key + "scheme"] = sizes.as_dict()
            out[key + "minimum_ring_bytes"] = minimum
            ratio = self.ring_bytes / minimum if minimum else None
            out["ratio" if not key else "ratio_to_best"] = (
                float(f"{ratio:.6g}") if ratio is not None else None)
        return out


def _parameter_of(value: Value) -> str | None:
    """The stored parameter a value reads, through Casts (a weight cast to the compute
    dtype)."""
    param = stored_param(value)
    return param.name if param is not None else None


def recognise(graph: Graph, devices: int,
              split_of: Callable[[str], tuple[int, ...] | None]) -> Transformer | None:
    """The transformer and the plan's Megatron scheme, or None when the graph is not one the
    module knows.
    `split_of(name)` gives a parameter's split per dimension (its use layout; None: unknown)."""
    shapes = {p.name: tuple(p.shape) for p in graph.params}
    layers: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        m = _LAYER.search(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2).split(".")[1]] = shape
    tables = [n for n in shapes if n.endswith("embedding_weight") and len(shapes[n]) == 2]
    heads = [n for n in shapes if n.endswith("lm_head.weight") and len(shapes[n]) == 2]
    if not layers or len(tables) != 1 or len(heads) != 1:
        return None
    if any(sorted(w) != ["w1", "w2", "w3", "wk", "wo", "wq", "wv"] for w in layers.values()):
        return None
    first = layers[min(layers)]
    if any(w != first for w in layers.values()) or any(len(s) != 2 for s in first.values()):
        return None
    hidden, ffn, kv = first["wq"][1], first["w1"][0], first["wk"][0]
    vocab = shapes[tables[0]][0]
    if shapes[tables[0]] != (vocab, hidden) or shapes[heads[0]] != (vocab, hidden):
        return None
    # mp: the column split of wq (its rows), which every layer matrix must share
    wq = next(n for n in shapes if n.endswith(".attention.wq.weight"))
    split = split_of(wq)
    if split is None:
        return None
    mp = split[0]
    if mp < 1 or devices % mp:
        return None
    # the activation: the output of the MatMul that reads wo
    tokens = act_bytes = 0
    batch: int | None = None
    for node in graph.nodes:
        if node.op in ("MatMul", "BatchMatMul") and any(
                (_parameter_of(v) or "").endswith(".attention.wo.weight") for v in node.operands):
            t = node.result.type
            if isinstance(t, TensorType) and t.shape and t.shape[-1] == hidden:
                tokens = t.size // hidden
                act_bytes = t.dtype.itemsize
                batch = t.shape[0] if len(t.shape) == 3 else None
                break
    if not tokens:
        return None
    emb, head = split_of(tables[0]), split_of(heads[0])
    norm = next((n for n in shapes if n.endswith("attention_norm.weight")), None)
    base = TransformerSizes(
        layers=len(layers), hidden=hidden, kv=kv, ffn=ffn, vocab=vocab, tokens=tokens,
        act_bytes=act_bytes, dp=1, mp=1,
        embedding_split=bool(emb and emb[0] > 1), head_split=bool(head and head[0] > 1),
        seq_parallel=_sequence_split(graph, norm, devices // mp) if norm else False)
    return Transformer(base, devices, batch, mp)


def _sequence_split(graph: Graph, norm: str, dp: int) -> bool:
    """Whether the norm reading `norm` has its tokens split beyond the data-parallel width
    (sequence parallelism)."""
    for node in graph.nodes:
        if any(_parameter_of(v) == norm for v in node.operands) and node.parallel is not None:
            strategy = node.parallel.in_strategy
            if strategy:
                first = strategy[0]
                tokens_split = 1
                for s in first[:-1]:
                    tokens_split *= s
                return tokens_split > dp
    return False
