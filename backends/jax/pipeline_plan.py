"""How a pipeline program runs as ONE SPMD program over the whole mesh (no JAX import).

The mesh gets a leading `stage` axis (stage s owns ranks [s*n, (s+1)*n): row-major, rank =
stage * n + position) and the prime axes of the n devices of a stage, ordered to align the
stages' collectives (`plan.choose_mesh`). Every device runs the same program: the step is a
sequence of ticks (passes/pipeline_schedule.py); at each tick, `lax.switch` on the device's
stage runs that stage's unit (its collectives run over stage-internal mesh axes only), and the
values that cross stages move by `ppermute` along the stage axis right after the tick.

What a stage keeps between ticks lives in `registers`: arrays of one dtype and shape, the same
set on every stage and at every tick. Each value a stage holds (one computed at one tick and
read at a later one, one received before a later tick reads it, the stage's results: new
weights and optimizer state, the loss) has ONE register for its whole lifetime (`held`), so a
tick reads what it holds as is and writes only the values it defines. Only the registers
some stage writes at a tick (`writes[t]`) come out of that tick's `lax.switch`: a register no
stage writes then stays outside it, unmoved, while a register one stage writes is passed
through by the others (XLA copies it there, as it copies every buffer a conditional's branch
may change). So the allocation (in tick order, per stage) puts a value in a register that
another stage writes at the same tick where it can (the devices' copies of one register then
serve several stages), else in the lowest free register of its dtype and shape, else a new
one. The values one tick sends are packed per dtype and stage distance into one flat buffer
each (`sends`, offsets from 0); a stage unpacks what arrives by the sender's layout
(`arrivals`).
Graph parameters (inputs, weights, states) are the union of the stages' parameters by name; a
device reads only its stage's.

Everything here is plain data (tuples, dicts, ints, strings), so the generated program.py
(backends/jax/codegen.py) writes it as literals and both runners share `backends/jax/pipeline.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING, Any

from pcompile.backends.jax.plan import (
    MeshSpec,
    NodePlan,
    SpmdLoweringError,
    _Refs,
    choose_mesh,
    plan_node,
)
from pcompile.ir.core import Graph, NodeResult
from pcompile.ir.rank import RankGroup
from pcompile.ir.registry import get_op
from pcompile.passes.pipeline_schedule import unit_name

if TYPE_CHECKING:
    from pcompile.passes.pipeline_split import PipelineProgram

#: (node index, dtype name, offset, shape): one value in a packed buffer.
Slot = tuple[int, str, int, tuple[int, ...]]
#: (node index, register, first, last): a value a stage holds in `registers[register]` entering
#: ticks first..last (last = ticks: at the end of the step); tick first - 1, which computed or
#: received it, writes it.
Held = tuple[int, int, int, int]


def _size(shape: tuple[int, ...]) -> int:
    return int(prod(shape))


@dataclass
class PipelineTables:
    """The schedule as data (see the module docstring). Per tick t (0..ticks-1) and stage s:
    `units[t][s]`: (label, node indices) or None; `registers[r]`: (dtype name, shape) of
    register r; `held[s]`: what stage s holds between ticks, each value in one register for
    its lifetime (`Held`); `writes[t]`: the registers some stage writes at tick t;
    `sends[t][d][s]`: what stage s sends to stage s + d after tick t; `arrivals[t][s]`: (d,
    slots keyed by the receiver's Receive nodes) unpacked at the start of tick t. Send sizes
    are per dtype, the largest stage's."""

    stages: int
    per_stage: int
    ticks: int
    units: list[list[tuple[str, tuple[int, ...]] | None]]
    registers: list[tuple[str, tuple[int, ...]]]
    held: list[list[Held]]
    writes: list[list[int]]
    sends: list[dict[int, list[list[Slot]]]]
    send_sizes: list[dict[int, dict[str, int]]]
    arrivals: list[list[list[tuple[int, list[Slot]]]]]
    params: list[list[int]]  # params[s][i]: union index of stage s's graph parameter i
    outputs: list[dict[str, tuple[str, int]]]  # per stage: output name -> ("node"|"param", i)
    union_params: list[tuple[str, str, tuple[int, ...], str]]  # (name, kind, shape, dtype)
    union_outputs: list[str]

    def literal(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def carry(self, s: int, t: int) -> list[Held]:
        """What stage s holds entering tick t (t = ticks: at the end)."""
        return [h for h in self.held[s] if h[2] <= t <= h[3]]

    def written(self, s: int, t: int) -> list[Held]:
        """What stage s writes at tick t: what it computed or received then and holds for a
        later tick."""
        return [h for h in self.held[s] if h[2] == t + 1]


@dataclass
class PipelinePlan:
    """A pipeline program's tables, mesh and per-stage node plans."""

    program: PipelineProgram
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
    def build(program: PipelineProgram) -> PipelinePlan:
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
            out.append(plan_node(k, node, ref, devices, mesh))
        except SpmdLoweringError:
            raise
    return out


def _dtype_name(value: Any) -> str:
    return str(value.tensor_type.dtype.name)


def _tables(program: PipelineProgram) -> PipelineTables:
    sched = program.schedule
    assert sched is not None  # PipelinePlan.build finished it
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
        when: dict[int, int] = {}
        for k, node in enumerate(g.nodes):
            when[k] = (send_tick[int(node.attrs["sr_tag"])] + 1 if node.op == "Receive"
                       else tick_of[s][k])
        defined.append(when)
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
    lives = [[(k, _dtype_name(g.nodes[k].result), tuple(g.nodes[k].result.shape),
               defined[s][k] + 1, last[s][k]) for k in range(len(g.nodes))
              if defined[s][k] < last[s].get(k, -1)] for s, g in enumerate(graphs)]
    registers, held, writes = _allocate(lives, ticks)
    sends: list[dict[int, list[list[Slot]]]] = []
    send_sizes: list[dict[int, dict[str, int]]] = []
    by_tag: dict[int, tuple[int, int, Slot]] = {}  # tag -> (src stage, distance, sender slot)
    for t in range(ticks):
        per_d: dict[int, list[list[int]]] = {}  # distance -> each stage's Send node indices
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
            for arrival in bucket:
                if arrival[0] == d:
                    arrival[1].append((k, slot[1], slot[2], slot[3]))
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
    return PipelineTables(stages, program.per_stage, ticks, units, registers, held, writes,
                          sends, send_sizes, arrivals, params, outputs, list(union.values()),
                          list(program.outputs))


def _allocate(lives: list[list[tuple[int, str, tuple[int, ...], int, int]]], ticks: int
              ) -> tuple[list[tuple[str, tuple[int, ...]]], list[list[Held]], list[list[int]]]:
    """Registers for the values (node, dtype, shape, first, last) each stage holds entering
    ticks first..last. In tick order, then stage and node order, a value takes a register of
    its dtype and shape that is free on its stage over its lifetime: first one another stage
    writes at the same tick, else the lowest, else a new one. Returns the registers, the
    placed values per stage and the registers written per tick."""
    registers: list[tuple[str, tuple[int, ...]]] = []
    by_kind: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    busy: list[dict[int, int]] = [{} for _ in lives]  # per stage: register -> last tick held
    held: list[list[Held]] = [[] for _ in lives]
    writes: list[list[int]] = [[] for _ in range(ticks)]
    starts: dict[int, list[tuple[int, tuple[int, str, tuple[int, ...], int, int]]]] = {}
    for s, values in enumerate(lives):
        for v in values:
            starts.setdefault(v[3], []).append((s, v))
    for first in sorted(starts):
        now: list[int] = []  # registers written at tick first - 1
        for s, (k, dtype, shape, _, last) in starts[first]:
            pool = by_kind.setdefault((dtype, shape), [])
            free = [r for r in pool if busy[s].get(r, -1) < first]
            shared = [r for r in free if r in now]
            if shared or free:
                r = (shared or free)[0]
            else:
                r = len(registers)
                registers.append((dtype, shape))
                pool.append(r)
            busy[s][r] = last
            held[s].append((k, r, first, last))
            if r not in now:
                now.append(r)
        writes[first - 1] = sorted(now)
    return registers, held, writes


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
