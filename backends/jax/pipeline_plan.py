"""How a pipeline program runs as ONE SPMD program over the whole mesh (no JAX import).

The mesh gets a leading `stage` axis (stage s owns ranks [s*n, (s+1)*n): row-major, rank =
stage * n + position) and the prime axes of the n devices of a stage, ordered to align the
stages' collectives (`plan.choose_mesh`). Every device runs the same program: the step is a
sequence of ticks (passes/pipeline_schedule.py); at each tick, `lax.switch` on the device's
stage runs that stage's unit (its collectives run over stage-internal mesh axes only), and the
values that cross stages move by `ppermute` along the stage axis right after the tick.

What a stage keeps between ticks is packed per dtype into one flat buffer per tick boundary
(`carry`): a value computed at one tick and read at a later one, a value received before the
tick that reads it, the stage's results (new weights and optimizer state, the loss). Buffers of
all stages have one size per dtype (the largest stage's); a switch branch unpacks its own
stage's layout. The values one tick sends are packed the same way, one buffer per dtype and
stage distance (`sends`); a stage unpacks what arrives by the sender's layout (`arrivals`).
Graph parameters (inputs, weights, states) are the union of the stages' parameters by name; a
device reads only its stage's.

Everything here is plain data (tuples, dicts, ints, strings), so the generated program.py
(backends/jax/codegen.py) writes it as literals and both runners share `backends/jax/pipeline.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any

from pcompile.backends.jax.plan import (
    MeshSpec,
    NodePlan,
    SpmdLoweringError,
    _plan_parametric,
    _Refs,
    choose_mesh,
)
from pcompile.ir.core import Graph, NodeResult
from pcompile.ir.rank import RankGroup
from pcompile.ir.registry import get_op
from pcompile.passes.pipeline_schedule import unit_name

#: (node index, dtype name, offset, shape): one value in a packed buffer.
Slot = tuple[int, str, int, tuple[int, ...]]


def _size(shape: tuple[int, ...]) -> int:
    return int(prod(shape))


@dataclass
class PipelineTables:
    """The schedule as data (see the module docstring). Per tick t (0..ticks-1) and stage s:
    `units[t][s]`: (label, node indices) or None; `carry[t][s]`: the slots of what stage s
    holds entering tick t (`carry[ticks]`: at the end); `sends[t][d][s]`: what stage s sends to
    stage s + d after tick t; `arrivals[t][s]`: (d, slots keyed by the receiver's Receive
    nodes) unpacked at the start of tick t. Sizes are per dtype, the largest stage's."""

    stages: int
    per_stage: int
    ticks: int
    units: list[list[tuple[str, tuple[int, ...]] | None]]
    carry: list[list[list[Slot]]]
    carry_sizes: list[dict[str, int]]
    sends: list[dict[int, list[list[Slot]]]]
    send_sizes: list[dict[int, dict[str, int]]]
    arrivals: list[list[list[tuple[int, list[Slot]]]]]
    params: list[list[int]]  # params[s][i]: union index of stage s's graph parameter i
    outputs: list[dict[str, tuple[str, int]]]  # per stage: output name -> ("node"|"param", i)
    union_params: list[tuple[str, str, tuple[int, ...], str]]  # (name, kind, shape, dtype)
    union_outputs: list[str]

    def literal(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PipelinePlan:
    """A pipeline program's tables, mesh and per-stage node plans."""

    program: Any  # passes.pipeline_split.PipelineProgram
    mesh: MeshSpec
    tables: PipelineTables
    nodes: list[list[NodePlan]] = field(default_factory=list)  # per stage, graph order

    @property
    def graphs(self) -> list[Graph]:
        return list(self.program.graphs)

    @property
    def num_ranks(self) -> int:
        return int(self.program.devices)

    @property
    def intra_axes(self) -> tuple[str, ...]:
        return self.mesh.names[1:]

    @staticmethod
    def build(program: Any) -> PipelinePlan:
        if program.schedule is None:
            program.finish()
        graphs = list(program.graphs)
        stages, n, devices = program.stages, program.per_stage, program.devices
        groups: list[Any] = []
        for g in graphs:
            for node in g.nodes:
                group = node.attrs.get("rank_list")
                if get_op(node.op).collective and isinstance(group, RankGroup):
                    groups.append(RankGroup(n, group.digits))
        inner = choose_mesh(n, groups)
        names = ("stage",) + tuple(f"r{i}" for i in range(len(inner.sizes))) if n > 1 \
            else ("stage",)
        sizes = (stages,) + (inner.sizes if n > 1 else ())
        mesh = MeshSpec(names, sizes)
        plans = [_stage_nodes(g, devices, mesh) for g in graphs]
        return PipelinePlan(program, mesh, _tables(program), plans)


def _stage_nodes(graph: Graph, devices: int, mesh: MeshSpec) -> list[NodePlan]:
    """NodePlans of a stage graph, tables over every rank of the world (a device indexes them
    by its global rank). Send and Receive move data outside the units: kinds "send"/"recv"."""
    ref = _Refs(graph)
    out = []
    for k, node in enumerate(graph.nodes):
        if node.op in ("Send", "Receive"):
            operands = [ref(v) for v in node.operands]
            out.append(NodePlan(k, node, "send" if node.op == "Send" else "recv", {},
                                operands))
            continue
        try:
            out.append(_plan_parametric(k, node, ref, devices, mesh))
        except SpmdLoweringError:
            raise
    return out


def _dtype_name(value: Any) -> str:
    return str(value.tensor_type.dtype.name)


def _tables(program: Any) -> PipelineTables:
    sched = program.schedule
    graphs: list[Graph] = list(program.graphs)
    stages, ticks = program.stages, sched.num_ticks
    units: list[list[tuple[str, tuple[int, ...]] | None]] = [[None] * stages
                                                             for _ in range(ticks)]
    tick_of: list[dict[int, int]] = [{} for _ in graphs]  # node index -> tick
    for u in sched.units:
        for label, tick, members in zip(u.sequence, u.ticks, u.nodes):
            units[tick][u.stage] = (unit_name(label, sched.chunks), tuple(members))
            for k in members:
                tick_of[u.stage][k] = tick
    # When each sent value arrives (the tick after it is sent).
    send_tick: dict[int, int] = {}
    for s, g in enumerate(graphs):
        for k, node in enumerate(g.nodes):
            if node.op == "Send":
                send_tick[int(node.attrs["sr_tag"])] = tick_of[s][k]
    defined: list[dict[int, int]] = []
    for s, g in enumerate(graphs):
        d = {}
        for k, node in enumerate(g.nodes):
            d[k] = (send_tick[int(node.attrs["sr_tag"])] + 1 if node.op == "Receive"
                    else tick_of[s][k])
        defined.append(d)
    last: list[dict[int, int]] = []
    for s, g in enumerate(graphs):
        index = {id(node.result): k for k, node in enumerate(g.nodes)}
        use: dict[int, int] = {}
        for k, node in enumerate(g.nodes):
            for v in node.operands:
                if isinstance(v, NodeResult):
                    j = index[id(v)]
                    use[j] = max(use.get(j, -1), tick_of[s][k])
        for v in g.outputs:
            if isinstance(v, NodeResult):
                use[index[id(v)]] = ticks
        last.append(use)
    carry: list[list[list[Slot]]] = []
    carry_sizes: list[dict[str, int]] = []
    for t in range(ticks + 1):
        row, sizes = [], {}
        for s, g in enumerate(graphs):
            keys = [k for k in range(len(g.nodes))
                    if defined[s][k] < t <= last[s].get(k, -1)]
            slots = _pack([(k, g.nodes[k].result) for k in keys])
            row.append(slots)
            _grow(sizes, slots)
        carry.append(row)
        carry_sizes.append(sizes)
    sends: list[dict[int, list[list[Slot]]]] = []
    send_sizes: list[dict[int, dict[str, int]]] = []
    by_tag: dict[int, tuple[int, int, Slot]] = {}  # tag -> (src stage, distance, sender slot)
    for t in range(ticks):
        per_d: dict[int, list[list[Slot]]] = {}
        for s, g in enumerate(graphs):
            entry = units[t][s]
            if entry is None:
                continue
            for k in entry[1]:
                node = g.nodes[k]
                if node.op != "Send":
                    continue
                d = int(node.attrs["dest_rank"].delta) // program.per_stage
                per_d.setdefault(d, [[] for _ in graphs])[s].append(k)
        packed: dict[int, list[list[Slot]]] = {}
        sizes_d: dict[int, dict[str, int]] = {}
        for d, lists in sorted(per_d.items()):
            packed[d] = []
            sizes_d[d] = {}
            for s, keys in enumerate(lists):
                g = graphs[s]
                slots = _pack([(k, g.nodes[k].result) for k in keys])
                packed[d].append(slots)
                _grow(sizes_d[d], slots)
                for slot in slots:
                    by_tag[int(g.nodes[slot[0]].attrs["sr_tag"])] = (s, d, slot)
        sends.append(packed)
        send_sizes.append(sizes_d)
    arrivals: list[list[list[tuple[int, list[Slot]]]]] = [[[] for _ in graphs]
                                                          for _ in range(ticks)]
    for s, g in enumerate(graphs):
        for k, node in enumerate(g.nodes):
            if node.op != "Receive":
                continue
            src, d, slot = by_tag[int(node.attrs["sr_tag"])]
            t = defined[s][k]
            bucket = arrivals[t][s]
            for entry in bucket:
                if entry[0] == d:
                    entry[1].append((k, slot[1], slot[2], slot[3]))
                    break
            else:
                bucket.append((d, [(k, slot[1], slot[2], slot[3])]))
    union: dict[str, tuple[str, str, tuple[int, ...], str]] = {}
    for g in graphs:
        for p in g.params:
            if p.kind == "input" and p.name not in union:
                union[p.name] = (p.name, p.kind, tuple(p.shape), p.dtype.name)
    for g in graphs:
        for p in g.params:
            if p.kind != "input" and p.name not in union:
                union[p.name] = (p.name, p.kind, tuple(p.shape), p.dtype.name)
    names = list(union)
    params = [[names.index(p.name) for p in g.params] for g in graphs]
    outputs = []
    for g in graphs:
        index = {id(node.result): k for k, node in enumerate(g.nodes)}
        pindex = {id(p): i for i, p in enumerate(g.params)}
        row = {}
        for name, v in zip(g.attrs["outputs"], g.outputs):
            row[name] = ("node", index[id(v)]) if id(v) in index else ("param", pindex[id(v)])
        outputs.append(row)
    return PipelineTables(stages, program.per_stage, ticks, units, carry, carry_sizes, sends,
                          send_sizes, arrivals, params, outputs, list(union.values()),
                          list(program.outputs))


def _pack(values: list[tuple[int, Any]]) -> list[Slot]:
    offsets: dict[str, int] = {}
    out: list[Slot] = []
    for k, value in values:
        dtype = _dtype_name(value)
        shape = tuple(value.shape)
        at = offsets.get(dtype, 0)
        out.append((k, dtype, at, shape))
        offsets[dtype] = at + _size(shape)
    return out


def _grow(sizes: dict[str, int], slots: list[Slot]) -> None:
    used: dict[str, int] = {}
    for _, dtype, offset, shape in slots:
        used[dtype] = max(used.get(dtype, 0), offset + _size(shape))
    for dtype, n in used.items():
        sizes[dtype] = max(sizes.get(dtype, 0), n)
