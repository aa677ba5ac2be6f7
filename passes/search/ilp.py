"""`--search ilp`: an exact plan under the seconds cost model, within the device's memory.

**Variables.** For every vertex v of the cost graph and each of its candidates k allowed on the
mesh, a binary x[v, k] (sum over k = 1). For every edge e = (u, v) and each pair (r, q) of a
producer-output layout class r and a consumer-input layout class q with a finite cost, a
continuous y[e, r, q] >= 0 tied to the choices by its marginals:
sum_q y[e, r, q] = sum_{k in r} x[u, k] and sum_r y[e, r, q] = sum_{l in q} x[v, l]. With the
x integral the marginals are unit vectors, so y is the indicator of the chosen pair: the
linearisation is exact (`_build`).

**Objective.** sum_v m_v t_v(k) x[v, k] + sum_e w_e t_e(r, q) y[e, r, q], in seconds
(`time_model.py`: an op's compute and its forward and backward collectives, an edge's
redistribution both ways), where m_v and w_e count the layers a folded vertex or edge stands
for. **Memory.** sum_v m_v mem_v(k) x[v, k] <= the device's memory (`Costs.memory`:
weights, gradients, optimizer states, activations).

**Repeated layers are solved once** (`fold`): the vertices under `<...>-CellList/<i>-<Cell>/`
form one group per i; when every group of a list has the same vertex signatures in order and
the same edges among them, the first group stands for all (its costs times the number of
groups), and every edge maps to its representatives (an edge from layer i to layer i + 1
becomes an edge from the representative to itself, costed on the diagonal).

**The mesh and the global choices** (`solve`): for every factorisation of the devices into
data x model axes (d, m) (ranks m-fastest: the model axis stays inside a node), and, where the
model has expert weights, data x expert x model (d / e, e, m) (`meshes`), only candidates whose
every split device axis is a mesh axis or a run of neighbouring ones are allowed; for each mesh,
the programs without and with the parallel optimizer, each first without the memory row; only
when that optimum does not fit, with the memory row, and with per-layer recompute
(`_Program` builds the structure once; a configuration changes the op costs and the memory
row). The fastest fitting plan over all meshes and configurations wins (ties: the earlier
mesh, fewer devices on the model axis, then no recompute). User strategies stay fixed (their
vertices have one candidate).

**Pipeline stages** (`IlpOptions.pipeline`, stages.py): layers fold per stage, the memory row
is one per stage, and the objective is the bubble times a column z above every stage's seconds
(plus TIE times their sum).

The solver is HiGHS (`highspy`), single-threaded with a fixed seed, so the same graph gives the
same plan.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cache
from math import inf, isfinite
from typing import Any

import numpy as np

from pcompile.ir.core import GraphParam
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.passes.search.candidates import Candidate
from pcompile.passes.search.cost_graph import CostGraph, Edge, Vertex
from pcompile.passes.search.stages import PipelineShape, vertex_stages
from pcompile.passes.search.time_model import (
    DeviceProfile,
    Memory,
    MemoryOptions,
    OpTime,
    differentiable,
    layout_axes,
    op_time,
    param_memory,
    redistribution_time,
    stored_param,
)


class IlpError(PcompileError):
    """No plan fits (the message says how much memory the smallest plan needs; `needed`: those
    bytes, inf when no plan has them)."""

    needed: float = inf


def _gb(nbytes: float) -> str:
    """Bytes in the largest of GB, MB, kB that is at least one."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass(frozen=True)
class IlpOptions:
    profile: DeviceProfile
    memory: float  # bytes per device
    training: bool = True
    optimizer_states: int = 2
    enable_alltoall: bool = False
    time_limit: float = 60.0
    pipeline: PipelineShape | None = None  # pipeline stages (stages.py); None: one stage


@dataclass
class IlpPlan:
    """The solution: a candidate per vertex, the global choices and the predictions."""

    choice: list[int]
    mesh: tuple[int, ...]
    parallel_optimizer: bool
    recompute: bool
    step_time: float
    compute: float
    communication: float
    memory: Memory
    variables: int = 0
    constraints: int = 0
    solves: int = 0
    folded: dict[str, int] = field(default_factory=dict)  # CellList -> layers solved as one
    seconds: float = 0.0
    tried: list[dict[str, Any]] = field(default_factory=list)
    costs: Costs | None = None
    stages: list[StageTotals] = field(default_factory=list)  # pipeline stages only

    def explain(self, cg: CostGraph, v: Vertex) -> dict[str, Any]:
        """One searched op's record (plan.json `search.ops`, the dump's annotation): its
        seconds (compute, communication) and those of the redistributions into it."""
        assert self.costs is not None
        k = self.choice[v.index]
        t = self.costs.op_times(v, self.parallel_optimizer)[k]
        edges = 0.0
        for ei in v.in_edges:
            e = cg.edges[ei]
            a = cg.vertices[e.src].candidates[self.choice[e.src]]
            b = v.candidates[k]
            edges += self.costs.pair(e, a.out_keys[e.src_out], a.out_layouts[e.src_out],
                                     b.in_keys[e.dst_in], b.in_layouts[e.dst_in])
        return {"strategy": v.candidates[k].strategy,
                "cost": {"compute": _round(t.compute), "communication": _round(t.comm),
                         "objective": _round(t.total)},
                "redistribution": {"objective": _round(edges)},
                "candidates": len(v.candidates), "decided_by": "ilp"}

    def summary(self) -> dict[str, Any]:
        """plan.json's record of the search (no timings: plans stay byte-identical)."""
        return {"mesh": mesh_record(self.mesh),
                "parallel_optimizer": self.parallel_optimizer, "recompute": self.recompute,
                "predicted_step_time": _round(self.step_time),
                "predicted_compute": _round(self.compute),
                "predicted_communication": _round(self.communication),
                "predicted_memory": self.memory.as_dict(),
                "ilp": {"variables": self.variables, "constraints": self.constraints,
                        "solves": self.solves, "folded_layers": dict(self.folded)},
                **({"stages": stages_summary(self.stages, self.costs)} if self.stages else {}),
                "tried": self.tried}


def stages_summary(stages: list[StageTotals], costs: Any) -> dict[str, Any]:
    """plan.json's record of the pipeline stages: the bubble and every stage's seconds (its
    busy time over the whole step) and memory."""
    shape = costs.pipeline if costs is not None else None
    return {"micro_batches": shape.micro if shape is not None else None,
            "bubble": _round(shape.bubble) if shape is not None else None,
            "per_stage": [{"compute": _round(st.compute),
                           "communication": _round(st.communication),
                           "held_micro_batches": (_round(shape.held(i))
                                                  if shape is not None else None),
                           "memory": st.memory.as_dict()} for i, st in enumerate(stages)]}


TIE = 1e-6  # pipeline stages: the weight of the stages that do not bound the step (solve)


def _round(seconds: float) -> float:
    return float(f"{seconds:.6g}")


# -- folding of repeated layers -------------------------------------------------------------------

_LAYER = re.compile(r"^(.*?-CellList)/(\d+)-[^/]+/")


@dataclass
class Folding:
    rep: list[int]  # vertex -> its representative
    mult: list[int]  # representative -> how many vertices it stands for (0: not a representative)
    last: dict[int, int]  # representative group's last vertex -> layers (for recompute)
    layer_of: list[bool]  # representative lies in a folded layer
    folded: dict[str, int]


def layer_groups(graph: Any) -> dict[int, tuple[str, int]]:
    """id(node) -> (CellList, layer index) for the nodes of repeated layers (the scopes
    `fold` groups by)."""
    out = {}
    for node in graph.nodes:
        m = _LAYER.match(node.fullname)
        if m:
            out[id(node)] = (m.group(1), int(m.group(2)))
    return out


def grad_flags(v: Vertex, grad: Collection[int] | None) -> Any:
    """Which of the op's operands and result get a gradient (what its backward moves depends
    on, besides its signature)."""
    if grad is None or v.node is None:
        return None
    return (id(v.node.result) in grad, tuple(id(o) in grad for o in v.node.operands))


def _fold_signature(v: Vertex) -> Any:
    return v.signature  # a configured op's names its strategy (cost_graph.py)


def _internal(cg: CostGraph, groups: dict[int, list[int]], pos: dict[int, tuple[int, int]],
              g: int) -> list[tuple[int, int, int, int]]:
    """The edges inside group `g`, by position: (src, src_out, dst, dst_in)."""
    out = []
    for vi in groups[g]:
        for ei in cg.vertices[vi].out_edges:
            e = cg.edges[ei]
            if pos.get(e.dst, (-1, 0))[0] == g:
                out.append((pos[vi][1], e.src_out, pos[e.dst][1], e.dst_in))
    return sorted(out)


def fold(cg: CostGraph, stages: list[int] | None = None,
         grad: Collection[int] | None = None) -> Folding:
    """Representatives for the vertices of repeated layers (module docstring); with pipeline
    stages (`stages`: every vertex's), the layers of one stage fold together; `grad`: the
    values that get a gradient (`Costs.grad`): a layer folds with those whose ops' values get
    gradients alike (a first layer reading data does not stand for the next ones)."""
    n = len(cg.vertices)
    group_of: dict[int, tuple[str, int]] = {}
    staged = stages is not None and any(stages)  # stages, not one stage of micro-batches
    for v in cg.vertices:
        if v.node is not None:
            m = _LAYER.match(v.node.fullname)
            if m:
                name = (f"{m.group(1)} (stage {stages[v.index]})" if staged and stages
                        else m.group(1))
                group_of[v.index] = (name, int(m.group(2)))
    for v in cg.vertices:  # a shared parameter's TmpIdentity joins its lead user's group
        if v.kind == "param" and v.out_edges:
            user = min(cg.edges[e].dst for e in v.out_edges)
            if user in group_of:
                group_of[v.index] = group_of[user]
    families: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for vi in sorted(group_of, key=lambda i: (cg.vertices[i].topo, i)):
        name, index = group_of[vi]
        families[name][index].append(vi)
    rep = list(range(n))
    mult = [1] * n
    last: dict[int, int] = {}
    layer_of = [False] * n
    folded: dict[str, int] = {}
    for name, groups in families.items():
        order = sorted(groups)
        pos = {vi: (g, k) for g in order for k, vi in enumerate(groups[g])}

        # maximal runs of consecutive alike layers (a model's first dense layers before its
        # mixture-of-experts ones fold apart); one run: the whole list, as named
        runs: list[list[int]] = []
        previous: Any = None
        for g in order:
            current = ([(_fold_signature(cg.vertices[i]), stages[i] if stages else 0,
                         grad_flags(cg.vertices[i], grad))
                        for i in groups[g]], _internal(cg, groups, pos, g))
            if runs and current == previous:
                runs[-1].append(g)
            else:
                runs.append([g])
            previous = current
        for run in runs:
            if len(run) < 2:
                continue
            lead = groups[run[0]]
            for g in run[1:]:
                for k, vi in enumerate(groups[g]):
                    rep[vi] = lead[k]
                    mult[vi] = 0
            for vi in lead:
                mult[vi] = len(run)
                layer_of[vi] = True
            last[lead[-1]] = len(run)
            folded[name if len(runs) == 1 else f"{name} [{run[0]}-{run[-1]}]"] = len(run)
    return Folding(rep, mult, last, layer_of, folded)


# -- costs ----------------------------------------------------------------------------------------


def axes_of(cand: Candidate) -> frozenset[tuple[int, int]]:
    """The device axes (rank stride, size) any layout of the candidate splits over."""
    out: set[tuple[int, int]] = set()
    for lay in (*cand.in_layouts, *cand.out_layouts):
        out |= layout_axes(lay)
    return frozenset(out)


@cache
def mesh_groups(mesh: tuple[int, ...]) -> frozenset[tuple[int, int]]:
    """The device axes (rank stride, size) a mesh offers: each run of consecutive mesh axes
    (ranks fastest along the last). (data, model): data (stride m, size d), model (1, m), both
    (1, d m); (data, expert, model) also the expert axis (m, e), the data axis's outer part
    (e m, d / e) and expert x model (1, e m)."""
    out = set()
    for i in range(len(mesh)):
        for j in range(i, len(mesh)):
            size = 1
            for a in mesh[i:j + 1]:
                size *= a
            stride = 1
            for a in mesh[j + 1:]:
                stride *= a
            if size > 1:
                out.add((stride, size))
    return frozenset(out)


def mesh_allows(axes: frozenset[tuple[int, int]], mesh: tuple[int, ...]) -> bool:
    """Every axis is a mesh axis or a run of them (`mesh_groups`)."""
    return axes <= mesh_groups(mesh)


def mesh_aligned(cand: Candidate, mesh: tuple[int, ...]) -> bool:
    """Every split device axis of the candidate is a mesh axis or a run of them."""
    return mesh_allows(axes_of(cand), mesh)


def meshes(devices: int, experts: Collection[int] = ()) -> list[tuple[int, ...]]:
    """(data, model) factorisations ((1, n) is left out: it allows what (n, 1) allows); with
    expert weights of E experts (`experts`), after each (d, m) the (d / e, e, m) whose expert
    axis e (1 < e < d) divides some E: mindformers' expert parallelism, a minor factor of the
    data axis."""
    out: list[tuple[int, ...]] = []
    for m in range(1, devices):
        if devices % m:
            continue
        d = devices // m
        out.append((d, m))
        for e in range(2, d):
            if d % e == 0 and any(n % e == 0 for n in experts):
                out.append((d // e, e, m))
    return out or [(1, 1)]


def expert_counts(cg: CostGraph) -> set[int]:
    """The expert counts E of the model's expert weights: stored trainable [E, in, out]
    weights a BatchMatMul reads (mixture-of-experts layers)."""
    out: set[int] = set()
    for v in cg.vertices:
        if v.node is None or v.node.op != "BatchMatMul":
            continue
        for value in v.node.operands:
            param = stored_param(value)
            if param is not None and param.kind == "weight" and len(param.shape) == 3:
                out.add(int(param.shape[0]))
    return out


def mesh_record(mesh: tuple[int, ...]) -> dict[str, int]:
    """plan.json's `mesh`: data and model (the data axis whole: outer x expert), and the expert
    axis where there is one."""
    if len(mesh) == 3:
        return {"data": mesh[0] * mesh[1], "model": mesh[2], "expert": mesh[1]}
    return {"data": mesh[0], "model": mesh[1]}


class Costs:
    """Per-candidate seconds and memory, per-edge tables, cached."""

    def __init__(self, cg: CostGraph, options: IlpOptions, *,
                 parameters_agree: bool = True) -> None:
        """`parameters_agree`: a parameter's users must read it in one layout (the search's
        constraint, MindSpore's); False (costing a given plan, predict.py): users that read it
        otherwise pay the redistribution the program makes."""
        self.cg = cg
        self.options = options
        self.parameters_agree = parameters_agree
        self._op: dict[Any, list[OpTime]] = {}
        self._pair: dict[Any, OpTime] = {}
        self._axes: dict[Any, list[frozenset[tuple[int, int]]]] = {}
        self.owner = self._param_owners()
        self.grad = differentiable(cg.graph) if options.training else set()
        # pipeline stages: every vertex's stage, and the fraction of a stage's whole-batch
        # activations it holds at its peak (stages.py); one stage holding all without
        self.pipeline = options.pipeline
        self.stages = vertex_stages(cg, options.pipeline) if options.pipeline else None
        self.held = ([options.pipeline.held(s) for s in range(options.pipeline.stages)]
                     if options.pipeline else [1.0])
        # a stage's busy time over a micro-batch's (None: no micro-batches)
        self.repeat = options.pipeline.repeat if options.pipeline else None
        # the ops that read the batch (run once per micro-batch; the others once per step,
        # shared by the micro-batches: passes/micro_batch.py)
        self.batched = _batched(cg) if options.pipeline else None

    def times(self, vi: int) -> float:
        """How many times per step vertex `vi`'s op (and what it sends) runs: once, or once
        per micro-batch (`repeat`, the stage's busy time over a micro-batch's)."""
        if self.repeat is None or self.batched is None or vi not in self.batched:
            return 1
        return self.repeat

    def runs(self, vi: int) -> int:
        """How many times per step vertex `vi`'s op runs (what it moves, in bytes): once per
        micro-batch for an op that reads the batch, else once."""
        if self.pipeline is None or self.batched is None or vi not in self.batched:
            return 1
        return self.pipeline.micro

    def held_for(self, vi: int) -> float:
        """How many copies of vertex `vi`'s output activations its stage holds at its peak:
        one per micro-batch in flight, one for a value computed once per step."""
        if self.batched is not None and vi not in self.batched:
            return 1.0
        return self.held[self.stage(vi)]

    def crossings(self, folding: Folding) -> list[tuple[Edge, float]]:
        """The values that cross into another pipeline stage, each once per (value, receiving
        stage) however many ops there read it, on a representative edge between the folded
        layers' representatives, with how many such values it stands for."""
        if self.stages is None:
            return []
        seen: set[tuple[int, int, int]] = set()
        out: dict[tuple[int, int, int], list[Any]] = {}
        for e in self.cg.edges:
            st = self.stages[e.dst]
            if self.stages[e.src] == st or (e.src, e.src_out, st) in seen:
                continue
            seen.add((e.src, e.src_out, st))
            key = (folding.rep[e.src], e.src_out, st)
            hit = out.get(key)
            if hit is None:
                out[key] = [Edge(-1, key[0], e.src_out, folding.rep[e.dst], e.dst_in,
                                 e.itemsize, e.is_bool, e.parameter, e.reshapes), 1.0]
            else:
                hit[1] += 1.0
        return [(edge, count) for edge, count in (out[k] for k in sorted(out))]

    def stage(self, vi: int) -> int:
        return self.stages[vi] if self.stages is not None else 0

    def transfer(self, e: Edge, layout: TensorLayout) -> tuple[OpTime, OpTime]:
        """The point-to-point transfer of an edge that crosses into another pipeline stage,
        each as its sender's seconds and bytes: each rank sends its slice to the next stage's
        rank (the producer's stage), and the cotangent comes back (the consumer's stage);
        nothing inside a stage (stages.py)."""
        if self.stages is None or self.stages[e.src] == self.stages[e.dst]:
            return OpTime(), OpTime()
        nbytes = float(np.prod(layout.slice_shape)) * e.itemsize
        hops = abs(self.stages[e.dst] - self.stages[e.src])
        link = self.options.profile.link(hops * self.cg.devices + 1)
        one = OpTime(comm=link.latency + nbytes / link.bandwidth, comm_bytes=nbytes)
        return one, (one if self.has_grad(e) else OpTime())

    def _param_owners(self) -> dict[int, list[tuple[int, GraphParam]]]:
        """Vertex -> (operand index, parameter) for the parameters it is the first user of."""
        seen: set[int] = set()
        out: dict[int, list[tuple[int, GraphParam]]] = defaultdict(list)
        for v in sorted(self.cg.vertices, key=lambda v: (v.topo, v.index)):
            if v.kind != "op" or v.node is None:
                continue
            for i, value in enumerate(v.node.operands):
                param = stored_param(value)
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    out[v.index].append((i, param))
        return out

    def op_times(self, v: Vertex, popt: bool = False) -> list[OpTime]:
        if v.kind != "op" or v.node is None:
            return [OpTime()] * len(v.candidates)
        owned = frozenset(i for i, _ in self.owner.get(v.index, ()))
        # a configured op's signature names its strategy; the gradients' flags are the op's
        key = (v.signature, popt, owned, grad_flags(v, self.grad))
        hit = self._op.get(key)
        if hit is None:
            hit = [op_time(v.node, c.sharding, self.cg.devices, self.options.profile,
                           self.options.training, self.grad, popt, owned)
                   for c in v.candidates]
            self._op[key] = hit
        return hit

    def memory(self, v: Vertex, k: int, popt: bool) -> Memory:
        mem = Memory()
        if v.kind != "op" or v.node is None:
            return mem
        opts = MemoryOptions(self.options.optimizer_states, popt, self.options.training)
        cand = v.candidates[k]
        tensor_index = _tensor_positions(v)
        for i, param in self.owner.get(v.index, []):
            j = tensor_index.get(i)
            if j is not None and j < len(cand.in_layouts):
                mem.add(param_memory(param, cand.in_layouts[j], opts))
        if self.options.training and cand.out_layouts:
            out = v.node.result.type
            from pcompile.ir.types import TensorType

            t = out if isinstance(out, TensorType) else next(
                (e for e in getattr(out, "elements", ()) if isinstance(e, TensorType)), None)
            if t is not None:
                lay = cand.out_layouts[0]
                mem.activations += float(np.prod(lay.slice_shape)) * t.dtype.itemsize
        return mem

    def has_grad(self, e: Edge) -> bool:
        """Whether the value an edge carries gets a gradient (its redistribution then runs
        backward too)."""
        node = self.cg.vertices[e.dst].node
        if node is None or e.dst_in >= len(node.operands):
            return self.options.training
        return id(node.operands[e.dst_in]) in self.grad

    def candidate_axes(self, v: Vertex) -> list[frozenset[tuple[int, int]]]:
        key = v.signature
        hit = self._axes.get(key)
        if hit is None:
            hit = self._axes[key] = [axes_of(c) for c in v.candidates]
        return hit

    def update_time(self, mem: Memory) -> float:
        """The optimizer step on this rank's parameter slices: read and write the weights,
        gradients and states once (memory bound)."""
        if not self.options.training:
            return 0.0
        moved = 2 * (mem.weights + mem.gradients + mem.optimizer)
        return moved / self.options.profile.memory_bandwidth

    def pair(self, e: Edge, ka: Any, la: TensorLayout, kb: Any, lb: TensorLayout) -> float:
        if ka == kb:
            return 0.0
        return self.pair_time(e, ka, la, kb, lb).total

    def pair_time(self, e: Edge, ka: Any, la: TensorLayout, kb: Any, lb: TensorLayout
                  ) -> OpTime:
        """The redistribution on an edge between two layouts (cached; seconds and bytes);
        infinite seconds for a communicating bool tensor, and between a parameter's users
        that read it in other layouts (`parameters_agree`)."""
        if ka == kb:
            return OpTime()
        if e.parameter and self.parameters_agree:
            return OpTime(comm=inf)
        backward = self.has_grad(e)
        key = (ka, kb, e.itemsize, e.is_bool, backward)
        hit = self._pair.get(key)
        if hit is None:
            from pcompile.passes.redistribution import plan_redistribution

            if e.is_bool and plan_redistribution(la, lb, self.options.enable_alltoall
                                                  ).communicates:
                hit = OpTime(comm=inf)
            else:
                hit = redistribution_time(la, lb, e.itemsize, self.options.profile,
                                          backward, self.options.enable_alltoall)
            self._pair[key] = hit
        return hit


def _batched(cg: CostGraph) -> set[int]:
    """The vertices whose op reads a graph input (directly or through other ops); the dataset
    vertex too."""
    from pcompile.ir.core import NodeResult

    nodes: set[int] = set()
    for node in cg.graph.nodes:
        if any((isinstance(v, GraphParam) and v.kind == "input")
               or (isinstance(v, NodeResult) and id(v.node) in nodes) for v in node.operands):
            nodes.add(id(node))
    return {v.index for v in cg.vertices
            if v.kind == "dataset" or (v.node is not None and id(v.node) in nodes)}


def _tensor_positions(v: Vertex) -> dict[int, int]:
    """Operand index -> index among the op's tensor operands (what in_layouts follow)."""
    from pcompile.ir.types import TensorType

    assert v.node is not None
    out, j = {}, 0
    for i, value in enumerate(v.node.operands):
        if isinstance(value.type, TensorType):
            out[i] = j
            j += 1
    return out


# -- the program ----------------------------------------------------------------------------------


@dataclass
class _Mapped:
    edge: Edge  # an edge between representatives
    weight: float


def mapped_edges(cg: CostGraph, folding: Folding) -> list[_Mapped]:
    acc: dict[tuple[int, int, int, int, bool], _Mapped] = {}
    for e in cg.edges:
        a, b = folding.rep[e.src], folding.rep[e.dst]
        key = (a, e.src_out, b, e.dst_in, e.parameter)
        hit = acc.get(key)
        if hit is None:
            acc[key] = _Mapped(Edge(-1, a, e.src_out, b, e.dst_in, e.itemsize, e.is_bool,
                                    e.parameter, e.reshapes), 1.0)
        else:
            hit.weight += 1.0
    return [acc[k] for k in sorted(acc)]


@dataclass
class _Solved:
    choice: dict[int, int]
    objective: float
    variables: int
    constraints: int


class _Program:
    """The integer program of one mesh (its allowed candidates): the structure (variables,
    one-per-op rows, edge marginals) is built once; each (parallel optimizer, recompute)
    configuration only changes the op costs and the memory row (`solve`)."""

    def __init__(self, cg: CostGraph, costs: Costs, folding: Folding, edges: list[_Mapped],
                 allowed: dict[int, list[int]]) -> None:
        self.cg, self.costs, self.folding = cg, costs, folding
        self.feasible = True
        unary: dict[tuple[int, int], float] = defaultdict(float)
        banned: set[tuple[int, int]] = set()
        # a value sent into another pipeline stage: its transfer on the producer's choice, the
        # forward one in the producer's stage, the cotangent's in the consumer's (`cross`)
        cross: dict[int, dict[tuple[int, int], float]] = defaultdict(lambda: defaultdict(float))
        for e, count in costs.crossings(folding):
            v = cg.vertices[e.src]
            times = count * costs.times(e.src)
            for k in allowed[v.index]:
                lay = v.candidates[k].out_layouts[e.src_out]
                forward, backward = costs.transfer(e, lay)
                unary[(v.index, k)] += times * forward.total
                if backward.total:
                    cross[costs.stage(e.dst)][(v.index, k)] += times * backward.total
        # self edges (layer i -> layer i + 1 folded onto one representative): on the diagonal
        # (every cost here per step: an edge from an op run per micro-batch, times `repeat`)
        for me in edges:
            e = me.edge
            if e.src != e.dst:
                continue
            v = cg.vertices[e.src]
            for k in allowed[v.index]:
                c = v.candidates[k]
                t = costs.pair(e, c.out_keys[e.src_out], c.out_layouts[e.src_out],
                               c.in_keys[e.dst_in], c.in_layouts[e.dst_in])
                if isfinite(t):
                    unary[(v.index, k)] += me.weight * costs.times(e.src) * t
                else:
                    banned.add((v.index, k))
        self.xs: list[tuple[int, int]] = []  # x columns: (vertex, candidate)
        self.unary: list[float] = []
        xcol: dict[tuple[int, int], int] = {}
        self.rows: list[tuple[list[int], list[float], float, float]] = []
        for v in cg.vertices:
            if folding.mult[v.index] == 0:
                continue
            cols = []
            for k in allowed[v.index]:
                if (v.index, k) in banned:
                    continue
                xcol[(v.index, k)] = len(self.xs)
                cols.append(len(self.xs))
                self.xs.append((v.index, k))
                self.unary.append(unary.get((v.index, k), 0.0))
            if not cols:
                self.feasible = False
            self.rows.append((cols, [1.0] * len(cols), 1.0, 1.0))
        # stage -> (x column, seconds per step) of the cotangents sent back into it
        self.cross: dict[int, list[tuple[int, float]]] = {
            st: sorted((xcol[key], t) for key, t in entries.items() if key in xcol)
            for st, entries in cross.items()}
        self.y_cost: list[float] = []
        self.y_stage: list[int] = []  # the consumer's stage
        nx = len(self.xs)
        for me in edges:
            e = me.edge
            if e.src == e.dst:
                continue
            cls = cg.edge_classes(e)
            rs: dict[int, list[int]] = defaultdict(list)
            qs: dict[int, list[int]] = defaultdict(list)
            for k in allowed[e.src]:
                if (e.src, k) in xcol:
                    rs[int(cls.src_rows[k])].append(xcol[(e.src, k)])
            for k in allowed[e.dst]:
                if (e.dst, k) in xcol:
                    qs[int(cls.dst_cols[k])].append(xcol[(e.dst, k)])
            yr: dict[int, list[int]] = defaultdict(list)
            yq: dict[int, list[int]] = defaultdict(list)
            for r in sorted(rs):
                ka, la = cls.src_reps[r]
                for q in sorted(qs):
                    kb, lb = cls.dst_reps[q]
                    t = costs.pair(e, ka, la, kb, lb)
                    if not isfinite(t):
                        continue
                    col = nx + len(self.y_cost)
                    self.y_cost.append(me.weight * costs.times(e.src) * t)
                    self.y_stage.append(costs.stage(e.dst))
                    yr[r].append(col)
                    yq[q].append(col)
            for r, xcols in rs.items():
                ys = yr.get(r, [])
                self.rows.append((ys + xcols, [1.0] * len(ys) + [-1.0] * len(xcols), 0.0, 0.0))
            for q, xcols in qs.items():
                ys = yq.get(q, [])
                self.rows.append((ys + xcols, [1.0] * len(ys) + [-1.0] * len(xcols), 0.0, 0.0))
        starts, index, value = [0], [], []
        for cols, vals, _, _ in self.rows:
            index.extend(cols)
            value.extend(vals)
            starts.append(len(index))
        self.starts, self.index, self.value = starts, index, value

    def coefficients(self, popt: bool, recompute: bool) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, memory) of every x column under one configuration."""
        f = self.folding
        seconds = np.empty(len(self.xs))
        memory = np.empty(len(self.xs))
        for col, (vi, k) in enumerate(self.xs):
            v = self.cg.vertices[vi]
            mult = f.mult[vi]
            op = self.costs.op_times(v, popt)[k]
            layer = recompute and f.layer_of[vi]
            mem = self.costs.memory(v, k, popt)
            # a recomputed layer's activations once (the layer being recomputed, one
            # micro-batch at a time), the outputs it keeps per micro-batch held
            held = self.costs.held_for(vi)
            total = (mem.weights + mem.gradients + mem.optimizer) * mult \
                + mem.activations * (1 if layer else mult * held)
            if recompute and vi in f.last:
                total += mem.activations * (f.last[vi] - 1) * held
            memory[col] = total
            if self.costs.repeat is None:
                seconds[col] = mult * (op.compute * (4 / 3 if layer else 1) + op.comm
                                       + self.costs.update_time(mem)) + self.unary[col]
            else:  # micro-batches (stages.py): the weights' collectives once per step
                rep = self.costs.times(vi)
                seconds[col] = mult * (
                    rep * (op.compute * (4 / 3 if layer else 1) + op.comm - op.weight_comm)
                    + op.weight_comm + self.costs.update_time(mem)) + self.unary[col]
        return seconds, memory

    def solve(self, popt: bool, recompute: bool, budget: float | None,
              minimise_memory: bool = False) -> _Solved | None:
        import highspy

        if not self.feasible:
            return None
        seconds, memory = self.coefficients(popt, recompute)
        nx, n = len(self.xs), len(self.xs) + len(self.y_cost)
        starts, index, value = list(self.starts), list(self.index), list(self.value)
        lower = [r[2] for r in self.rows]
        upper = [r[3] for r in self.rows]

        def row(cols: list[int], vals: list[float], hi: float) -> None:
            index.extend(cols)
            value.extend(vals)
            starts.append(len(index))
            lower.append(-inf)
            upper.append(hi)

        pipeline = self.costs.pipeline
        if pipeline is None:
            if minimise_memory:
                cost = np.concatenate([memory, np.zeros(len(self.y_cost))]) * 1e-6  # MB
                scale = 1e-6
            else:
                cost = np.concatenate([seconds, np.array(self.y_cost)]) * 1e6  # microseconds
                scale = 1e6
            if budget is not None:
                row(list(range(nx)), memory.tolist(), budget)
        else:
            # micro-batches and stages (stages.py): one more column z, above every stage's
            # seconds (or memory); the objective is z, plus the sum over the stages weighted
            # by TIE (so that the stages that do not bound the step are not left
            # anywhere: at most TIE relative away from the exact optimum)
            z = n
            n += 1
            by_stage: dict[int, list[int]] = defaultdict(list)
            for col, (vi, _) in enumerate(self.xs):
                by_stage[self.costs.stage(vi)].append(col)
            y_by_stage: dict[int, list[int]] = defaultdict(list)
            for j, st in enumerate(self.y_stage):
                y_by_stage[st].append(nx + j)
            every = np.concatenate([seconds, np.array(self.y_cost)])
            for st in range(pipeline.stages):
                cols = by_stage.get(st, [])
                if minimise_memory:
                    row(cols + [z], [float(memory[c]) for c in cols] + [-1.0], 0.0)
                else:
                    ys = y_by_stage.get(st, [])
                    back = self.cross.get(st, [])
                    row(cols + ys + [c for c, _ in back] + [z],
                        [float(every[c]) for c in cols + ys]
                        + [t for _, t in back] + [-1.0], 0.0)
                if budget is not None:
                    row(cols, [float(memory[c]) for c in cols], budget)
            if minimise_memory:
                cost = np.concatenate([memory * TIE, np.zeros(len(self.y_cost)), [1.0]]) * 1e-6
                scale = 1e-6
            else:
                cost = np.concatenate([every * TIE, [1.0]]) * 1e6
                scale = 1e6
        # the plain solver class: `highspy.Highs` adds Python callbacks and prints a banner
        # to stdout, which would land in the middle of the compile's output
        h = highspy._Highs()  # type: ignore[attr-defined]
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("time_limit", 60.0)
        h.setOptionValue("mip_rel_gap", 1e-9)
        lp = highspy.HighsLp()
        lp.num_col_ = n
        lp.num_row_ = len(lower)
        lp.col_cost_ = cost
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = np.ones(n) if n == nx + len(self.y_cost) else np.concatenate(
            [np.ones(n - 1), [inf]])
        lp.row_lower_ = np.array(lower, dtype=np.float64)
        lp.row_upper_ = np.array(upper, dtype=np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=np.float64)
        lp.integrality_ = [highspy.HighsVarType.kInteger] * nx \
            + [highspy.HighsVarType.kContinuous] * (n - nx)
        h.passModel(lp)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        x = h.getSolution().col_value
        choice = {vi: k for col, (vi, k) in enumerate(self.xs) if x[col] > 0.5}
        objective = h.getInfo().objective_function_value / scale
        if pipeline is not None:  # the bound is the step (or memory) alone
            objective = x[n - 1]
        return _Solved(choice, objective, n, len(lower))


def _memory(program: _Program, solved: _Solved, popt: bool, recompute: bool) -> float:
    """The plan's memory per rank: its largest stage's."""
    _, memory = program.coefficients(popt, recompute)
    per: dict[int, float] = defaultdict(float)
    for col, (vi, k) in enumerate(program.xs):
        if solved.choice.get(vi) == k:
            per[program.costs.stage(vi)] += float(memory[col])
    return max(per.values(), default=0.0)


@dataclass
class StageTotals:
    """One pipeline stage's seconds, memory and the bytes a rank of it sends or receives per
    step (the whole step's without stages)."""

    compute: float = 0.0
    communication: float = 0.0
    memory: Memory = field(default_factory=Memory)
    comm_bytes: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute + self.communication


def stage_totals(cg: CostGraph, costs: Costs, folding: Folding, edges: list[_Mapped],
                 choice: dict[int, int], popt: bool, recompute: bool) -> list[StageTotals]:
    """Seconds, memory and bytes of a representative choice, per pipeline stage (one entry
    without stages). With micro-batches, bytes count each micro-batch's (`Costs.runs`) where
    seconds count a stage's busy time (`Costs.times`); the weights' collectives once."""
    count = costs.pipeline.stages if costs.pipeline is not None else 1
    out = [StageTotals() for _ in range(count)]
    for v in cg.vertices:
        mult = folding.mult[v.index]
        if mult == 0:
            continue
        st = out[costs.stage(v.index)]
        k = choice[v.index]
        t = costs.op_times(v, popt)[k]
        layer = recompute and folding.layer_of[v.index]
        mem = costs.memory(v, k, popt)
        if costs.repeat is None:
            st.compute += mult * (t.compute * (4 / 3 if layer else 1) + costs.update_time(mem))
            st.communication += mult * t.comm
        else:  # micro-batches: the weights' collectives and the update once per step
            rep = costs.times(v.index)
            st.compute += mult * (rep * t.compute * (4 / 3 if layer else 1)
                                  + costs.update_time(mem))
            st.communication += mult * (rep * (t.comm - t.weight_comm) + t.weight_comm)
        runs = costs.runs(v.index)
        st.comm_bytes += mult * (t.comm_bytes if runs == 1 else
                                 runs * (t.comm_bytes - t.weight_bytes) + t.weight_bytes)
        held = costs.held_for(v.index)  # as _Program.coefficients counts them
        act = mem.activations * (1 if layer else mult * held)
        if recompute and v.index in folding.last:
            act += mem.activations * (folding.last[v.index] - 1) * held
        st.memory.add(Memory(mem.weights, mem.gradients, mem.optimizer, 0.0), mult)
        st.memory.activations += act
    for me in edges:
        e = me.edge
        a, b = cg.vertices[e.src].candidates[choice[e.src]], \
            cg.vertices[e.dst].candidates[choice[e.dst]]
        pair = costs.pair_time(e, a.out_keys[e.src_out], a.out_layouts[e.src_out],
                               b.in_keys[e.dst_in], b.in_layouts[e.dst_in])
        dst = out[costs.stage(e.dst)]
        dst.communication += me.weight * costs.times(e.src) * pair.total
        dst.comm_bytes += me.weight * costs.runs(e.src) * pair.comm_bytes
    for e, values in costs.crossings(folding):  # each side pays what it sends
        a = cg.vertices[e.src].candidates[choice[e.src]]
        forward, backward = costs.transfer(e, a.out_layouts[e.src_out])
        for st, sent in ((out[costs.stage(e.src)], forward), (out[costs.stage(e.dst)], backward)):
            st.communication += values * costs.times(e.src) * sent.total
            st.comm_bytes += values * costs.runs(e.src) * sent.comm_bytes
    return out


def summarise(stages: list[StageTotals]) -> tuple[float, float, Memory]:
    """(compute, communication, memory) of a plan: the slowest stage's seconds and the
    largest stage's memory (the one entry's without stages)."""
    slowest = max(stages, key=lambda st: st.seconds)
    largest = max(stages, key=lambda st: st.memory.total)
    return slowest.compute, slowest.communication, largest.memory


def evaluate(cg: CostGraph, costs: Costs, folding: Folding, edges: list[_Mapped],
             choice: dict[int, int], popt: bool, recompute: bool
             ) -> tuple[float, float, Memory]:
    """(compute, communication, memory) of a representative choice; with pipeline stages,
    the slowest stage's seconds and the largest stage's memory."""
    return summarise(stage_totals(cg, costs, folding, edges, choice, popt, recompute))


def solve(cg: CostGraph, options: IlpOptions) -> IlpPlan:
    """The fastest plan that fits (module docstring)."""
    start = time.perf_counter()
    costs = Costs(cg, options)
    folding = fold(cg, costs.stages, costs.grad)
    edges = mapped_edges(cg, folding)
    best: IlpPlan | None = None
    tried: list[dict[str, Any]] = []
    solves = 0
    # Recompute only adds compute: it is solved only where the plan without it is held back by
    # the memory (its unconstrained optimum does not fit). An unconstrained optimum bounds
    # every constrained plan of its mesh and parallel optimizer from below, so those are not
    # solved once a plan at least as fast is known (exact: the bound never prunes a faster one).
    popts = (False, True) if options.training else (False,)
    recomputes = (False, True) if options.training else (False,)

    def consider(mesh: tuple[int, ...], popt: bool, recompute: bool, solved: _Solved) -> None:
        nonlocal best
        stages = stage_totals(cg, costs, folding, edges, solved.choice, popt, recompute)
        compute, comm, memory = summarise(stages)
        tried.append({"mesh": list(mesh), "parallel_optimizer": popt,
                      "recompute": recompute, "predicted_step_time": _round(compute + comm)})
        plan = IlpPlan(_unfold(cg, folding, solved.choice), mesh, popt, recompute,
                       compute + comm, compute, comm, memory, solved.variables,
                       solved.constraints)
        if options.pipeline is not None:
            plan.stages = stages
        if best is None or plan.step_time < best.step_time * (1 - 1e-9):
            best = plan

    # first every mesh's unconstrained optima; then, in the order of those bounds, the
    # constrained solves of the ones that did not fit, until a bound is no faster than the
    # best plan found
    held: list[tuple[float, int, tuple[int, ...], bool, _Program]] = []
    for mesh in meshes(cg.devices, expert_counts(cg)):
        allowed: dict[int, list[int]] = {}
        for v in cg.vertices:
            if folding.mult[v.index] == 0:
                continue
            ks = list(range(len(v.candidates)))
            if not v.configured and v.kind == "op":
                axes = costs.candidate_axes(v)
                aligned = [k for k in ks if mesh_allows(axes[k], mesh)]
                ks = aligned or ks
            allowed[v.index] = ks
        program = _Program(cg, costs, folding, edges, allowed)
        for popt in popts:
            solves += 1
            free = program.solve(popt, False, None)
            if free is None:
                continue
            if _memory(program, free, popt, False) <= options.memory:
                consider(mesh, popt, False, free)
            else:
                held.append((free.objective, len(held), mesh, popt, program))
    for bound, _, mesh, popt, program in sorted(held, key=lambda h: h[:2]):
        for recompute in recomputes:
            if best is not None and bound >= best.step_time * (1 - 1e-9):
                break
            solves += 1
            solved = program.solve(popt, recompute, options.memory)
            if solved is not None:
                consider(mesh, popt, recompute, solved)
    if best is None:
        raise _no_fit(cg, costs, folding, edges, options)
    best.solves = solves
    best.costs = costs
    best.folded = folding.folded
    best.tried = tried
    best.seconds = time.perf_counter() - start
    return best


def _unfold(cg: CostGraph, folding: Folding, choice: dict[int, int]) -> list[int]:
    return [choice[folding.rep[v.index]] for v in cg.vertices]


def _no_fit(cg: CostGraph, costs: Costs, folding: Folding, edges: list[_Mapped],
            options: IlpOptions) -> IlpError:
    smallest = inf
    # every candidate allowed (any mesh): the least memory any plan needs
    allowed = {v.index: list(range(len(v.candidates))) for v in cg.vertices
               if folding.mult[v.index] > 0}
    staged = options.pipeline is not None and options.pipeline.stages > 1
    recompute = options.training
    solved = _Program(cg, costs, folding, edges, allowed).solve(
        True, recompute, None, minimise_memory=True)
    if solved is not None:
        smallest = solved.objective
    need = _gb(smallest) if isfinite(smallest) else "more than any plan has"
    where = (f"{cg.devices} devices per stage ({options.pipeline.stages} pipeline stages)"
             if staged and options.pipeline is not None else f"{cg.devices} devices")
    how = "the parallel optimizer and recompute" if recompute else "the parallel optimizer"
    more = ", more pipeline stages" if staged else ""
    error = IlpError(
        f"ilp search: no plan of {where} fits {_gb(options.memory)} per device "
        f"(the smallest plan, with {how}, needs {need}); use more devices{more}, a smaller "
        "batch or model, or a larger --device-memory")
    error.needed = smallest
    return error
