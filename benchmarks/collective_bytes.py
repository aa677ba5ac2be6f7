"""Bytes of collectives, shared by the benchmarks that compare plans (`plan_quality.py`,
`plan_bytes.py`): the collectives of XLA's partitioned HLO, and tallies of collectives in two
conventions.

* `payload`: bytes of the collective's operand on one rank (an AllGather's piece, a
  ReduceScatter's whole input);
* `ring`: bytes one rank sends with ring algorithms, `pcompile.passes.comm_info.ring_bytes`
  (AllReduce 2(n-1)/n S, AllGather (n-1) S, ReduceScatter and AlltoAll (n-1)/n S, S the
  operand), the convention of plan.json's `ring_bytes`; an XLA collective-permute sends S.

A collective is a `Collective(kind, operand_bytes, group, phase)`, `kind` in pcompile's names
(AllReduce, AllGather, ReduceScatter, AlltoAll, Broadcast, Send, Receive, CollectivePermute)
and `group` its ranks. XLA prints result shapes; `hlo_collectives` turns them into operands
(AllGather: result / n; ReduceScatter: result x n). Imported by file path from the benchmarks
and from their JAX subprocesses, so it imports nothing of JAX at module level.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

#: XLA HLO opcode -> pcompile collective name.
HLO_KINDS = {"all-reduce": "AllReduce", "all-gather": "AllGather",
             "reduce-scatter": "ReduceScatter", "all-to-all": "AlltoAll",
             "collective-permute": "CollectivePermute"}
HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                   "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HLO_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(HLO_KINDS) + r")(-start)?\(")
_HLO_TYPE = re.compile(r"\b(" + "|".join(HLO_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass(frozen=True)
class Collective:
    """One collective as one rank runs it."""

    kind: str  # pcompile's name (AllReduce, ...)
    operand_bytes: int  # its operand on one rank
    group: tuple[int, ...]  # the ranks of this rank's group
    phase: str = "forward"


def payload_and_ring(kind: str, operand_bytes: int, group_size: int) -> tuple[int, int]:
    """(payload, ring) bytes of one collective on one rank (module docstring)."""
    from pcompile.passes.comm_info import ring_bytes

    if group_size < 2:
        return 0, 0
    if kind == "CollectivePermute":
        return operand_bytes, operand_bytes
    return operand_bytes, ring_bytes(kind, operand_bytes, group_size)


@dataclass
class Tally:
    """Collectives added up: in all, by phase and by kind (groups of one are skipped)."""

    count: int = 0
    payload: int = 0
    ring: int = 0
    by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, c: Collective, times: int = 1) -> None:
        payload, ring = payload_and_ring(c.kind, c.operand_bytes, len(c.group))
        if not ring and not payload:
            return
        for table, key in ((self.by_phase, c.phase), (self.by_kind, c.kind)):
            row = table.setdefault(key, {"count": 0, "payload_bytes": 0, "ring_bytes": 0})
            row["count"] += times
            row["payload_bytes"] += times * payload
            row["ring_bytes"] += times * ring
        self.count += times
        self.payload += times * payload
        self.ring += times * ring

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "payload_bytes": self.payload, "ring_bytes": self.ring,
                "by_phase": self.by_phase, "by_collective": self.by_kind}


def tally(collectives: list[Collective]) -> Tally:
    out = Tally()
    for c in collectives:
        out.add(c)
    return out


# -- analytic plans -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """`count` collectives `kind` of `operand_bytes` over groups of `group_size` ranks: one
    line of an analytic plan (plan_bytes.py's Megatron minimum, moe.py's intended MoE plan)."""

    what: str
    phase: str
    operand_bytes: int
    group_size: int
    count: int
    kind: str = "AllReduce"


def terms_tally(terms: list[Term]) -> dict[str, Any]:
    """An analytic plan's bytes as a tally, with its terms."""
    found = Tally()
    for t in terms:
        found.add(Collective(t.kind, t.operand_bytes, tuple(range(t.group_size)), t.phase),
                  t.count)
    return {**found.as_json(), "terms": [asdict(t) for t in terms]}


# -- pcompile -------------------------------------------------------------------------------------


def is_gradient_reduction(reason: str) -> bool:
    """A `_MirrorOperator`'s gradient AllReduce, alone or fused (passes/comm_fusion.py)."""
    return reason.startswith(("vjp of _MirrorOperator", "comm_fusion:"))


def plan_collectives(program: Any, plan: Any, rank: int) -> list[Collective]:
    """Rank `rank`'s collectives in plan.json (`plan`, compiler.plan.read_plan) of a compiled
    `program`, with their operands' bytes from its rank graph; `_MirrorOperator`s are left
    out (their gradient AllReduce is counted where it runs, in the phase
    `gradient_reduction`)."""
    from pcompile.ir.types import TensorType

    operand = {}  # the graph is rank-parametric: the same local shapes on every rank
    for node in program.state.rank_graphs[rank].nodes:
        types = [v.type for v in node.operands] or [node.result.type]
        operand[node.fullname] = sum(t.nbytes for t in types if isinstance(t, TensorType))
    items = []
    for row in plan.collectives[str(rank)]:
        if row.op == "_MirrorOperator":
            continue
        phase = ("gradient_reduction" if row.phase == "backward"
                 and is_gradient_reduction(row.reason) else row.phase)
        items.append(Collective(row.op, operand[row.node], tuple(row.rank_list), phase))
    return items


def plan_json_bytes(plan: Any, rank: int) -> dict[str, int]:
    """plan.json's own totals for `rank` (bytes received; ring bytes sent)."""
    rows = [r for r in plan.collectives[str(rank)] if r.op != "_MirrorOperator"]
    return {"received_bytes": sum(r.bytes for r in rows),
            "ring_bytes": sum(r.ring_bytes or 0 for r in rows)}


# -- XLA ------------------------------------------------------------------------------------------


def hlo_collectives(text: str, world: int, rank: int = 0) -> list[Collective]:
    """Every collective of XLA's partitioned HLO text (`jax.jit(f).lower(...).compile()
    .as_text()`) as rank `rank` of `world` runs it; the phase from the op's metadata: a name
    with `transpose(` is backward (autodiff's transpose), one with `jvp(` forward, the rest
    `optimizer` (the update outside `value_and_grad`)."""
    out = []
    for line in text.splitlines():
        m = _HLO_OP.search(line)
        if not m:
            continue
        kind = HLO_KINDS[m.group(2)]
        sizes = [_type_bytes(dtype, dims) for dtype, dims in _HLO_TYPE.findall(m.group(1))]
        if m.group(3) and kind in ("AllGather", "CollectivePermute"):
            sizes = sizes[len(sizes) // 2:]  # an async start's result is (operands, results)
        groups = replica_groups(line, world)
        group = next((g for g in groups if rank in g), tuple(range(world)))
        result = sum(sizes)
        n = len(group)
        operand = (result // n if kind == "AllGather" else result * n
                   if kind == "ReduceScatter" else result)
        name = _OP_NAME.search(line)
        op_name = name.group(1) if name else ""
        phase = ("backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name
                 else "optimizer")
        out.append(Collective(kind, operand, group, phase))
    return out


def _type_bytes(dtype: str, dims: str) -> int:
    n = 1
    for d in dims.split(","):
        n *= int(d) if d else 1
    return n * HLO_DTYPE_BYTES[dtype]


def replica_groups(line: str, world: int) -> list[tuple[int, ...]]:
    """The groups of an HLO collective: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` or
    `[4,2]<=[2,4]T(1,0)`, `mesh['a'=2,'b'=4] {'a'}` (groups along the named axes), or
    `source_target_pairs` (a permute: its pairs); none given: all ranks."""
    import numpy as np

    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m and m.group(1):
        return [tuple(int(x) for x in g.split(",") if x)
                for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod(shape))).reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return [tuple(int(x) for x in g) for g in ids.reshape(-1, shape[-1])]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        axes = [(k.strip().strip("'"), int(v)) for k, v in
                (x.split("=") for x in m.group(1).split(","))]
        names = [a for a, _ in axes]
        along = [names.index(a.strip().strip("'")) for a in m.group(2).split(",") if a.strip()]
        ids = np.arange(world).reshape([s for _, s in axes])
        rest = [i for i in range(len(axes)) if i not in along]
        size = int(np.prod([axes[i][1] for i in along])) if along else 1
        return [tuple(int(x) for x in g) for g in
                ids.transpose(rest + along).reshape(-1, size)]
    m = re.search(r"source_target_pairs=\{([0-9,{}]*)\}", line)
    if m:
        return [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{([0-9,]+)\}",
                                                                       m.group(1))]
    return [tuple(range(world))]
