"""`pipeline_split`: one training step cut into one program per pipeline stage.

Input: the local training step every rank runs (forward of all micro-batches, backward,
gradient communication, optimizer update), built for the n devices of ONE stage: operator
strategies, redistribution and collectives are stage-local (a device-matrix axis never spans
stages), and `ir.rank` values evaluated at a global rank give its position in its stage.

Every node gets a stage (`assign`): a forward op the stage of its cell (passes/
pipeline_stages.py, carried to what step_parallel and micro_batch made of it), a backward node
its forward op's, a node that reads a weight the weight's (the optimizer update), others
follow their data (the latest stage among their operands; reading only inputs, the earliest
stage that uses them). Computations on the optimizer's global state alone (`beta1_power`, a
step counter) are *pure*: every stage that needs them computes them on its own copy of that
state, so the copies stay equal.

Each stage s gets a graph (`split`) with its inputs, its weights and optimizer states, its
nodes in order, and for every value it reads from another stage t a `Receive` (and a `Send`
after the producer in t) with one `sr_tag`, `dest_rank` / `src_rank` = the rank at the same
position of the other stage (`ir.rank.RankShift`), the value's local shape and dtype. A
stage's graph returns its weights' and states' new values, the last stage also the loss.
Groups are renamed for the whole world (a stage's group of n ranks is not the world group).
The nodes are put in the order of the stage's schedule units (passes/pipeline_schedule.py).

Interleaved (v chunks per stage): `assign` works on virtual stages (segment * S + stage,
passes/pipeline_stages.py), `split` puts virtual stage u on stage u mod S and marks its
labelled nodes with `chunk: u div S` next to `micro`. A value that crosses chunks of one
stage is read in place; one that crosses stages gets a Send/Receive as above (from the last
stage of a segment to stage 0 of the next: `dest_rank` = rank - (S-1)n).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pcompile.ir.core import (
    Constant,
    Graph,
    GraphParam,
    Node,
    NodeResult,
    ParallelInfo,
    Value,
)
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import WORLD_GROUP
from pcompile.ir.rank import GroupName, RankGroup, RankShift
from pcompile.ir.registry import Trait, has_trait
from pcompile.passes.micro_batch import copy_constant
from pcompile.passes.pipeline_schedule import (
    Schedule,
    order_by_units,
    schedule,
    unit_name,
    unit_sequence,
)
from pcompile.passes.unit import CompileUnit

#: ("F" | "B", micro-batch) of a local node (its chunk follows from its virtual stage).
MicroLabel = tuple[str, int]


def inherit(created: dict[Node, Node], stages: dict[Node, int],
            labels: dict[Node, MicroLabel]) -> None:
    """Autodiff made the nodes `created` (node -> the forward node it differentiates): they
    run in its stage, in the backward unit of its micro-batch."""
    for node, forward in created.items():
        if forward in stages:
            stages[node] = stages[forward]
        label = labels.get(forward)
        if label is not None:
            labels[node] = ("B", label[1])


# -- stage assignment ---------------------------------------------------------------------------


@dataclass
class Assignment:
    """The stage of every node (`stage`), the stages that compute each pure node and hold
    each stored parameter (`copies`), and where every graph input is read (`reads`)."""

    stage: dict[Node, int] = field(default_factory=dict)
    copies: dict[Node, set[int]] = field(default_factory=dict)
    param_stages: dict[str, set[int]] = field(default_factory=dict)


def assign(graph: Graph, stages: int, node_stage: dict[Node, int],
           weight_stage: dict[str, int]) -> Assignment:
    """Stages of every node and parameter of the local training step (module docstring)."""
    out = Assignment()
    stage = out.stage
    for node in graph.nodes:
        if node in node_stage:
            stage[node] = node_stage[node]
            continue
        for v in node.operands:  # the optimizer update runs where its weight lives
            if isinstance(v, GraphParam) and v.kind == "weight" and v.name in weight_stage:
                stage[node] = weight_stage[v.name]
                break
    pure: set[Node] = set()
    for node in graph.nodes:
        if node in stage:
            continue
        seen = []
        impure = False
        for v in node.operands:
            if isinstance(v, NodeResult):
                if v.node in stage:
                    seen.append(stage[v.node])
                elif v.node not in pure:
                    impure = True
            elif isinstance(v, GraphParam):
                if v.kind == "weight" and v.name in weight_stage:
                    seen.append(weight_stage[v.name])
                elif v.kind != "state":
                    impure = True
        if seen:
            stage[node] = max(seen)
        elif not impure:
            pure.add(node)
    for node in reversed(graph.nodes):
        if node in stage or node in pure:
            continue
        users = [stage[u] for u in node.result.users if u in stage]
        stage[node] = min(users) if users else stages - 1
    # Pure nodes and states: computed / held in every stage that needs them.
    names = list(graph.attrs.get("outputs") or ())
    out_stage: dict[Node, set[int]] = {}
    for name, value in zip(names, graph.outputs):
        if isinstance(value, NodeResult):
            where = weight_stage.get(name)
            out_stage.setdefault(value.node, set())
            if where is not None:
                out_stage[value.node].add(where)
    for node in reversed(graph.nodes):
        if node not in pure:
            continue
        need = set(out_stage.get(node, ()))
        for user in node.result.users:
            need |= out.copies.get(user, {stage[user]} if user in stage else set())
        out.copies[node] = need
    for p in graph.params:
        if p.kind == "input":
            continue
        if p.kind == "weight" and p.name in weight_stage:
            out.param_stages[p.name] = {weight_stage[p.name]}
            continue
        need = set()
        for user in p.users:
            need |= out.copies.get(user, {stage[user]} if user in stage else set())
        out.param_stages[p.name] = need or {stages - 1}
    # A state's update must be computable wherever the state is held.
    for name, value in zip(names, graph.outputs):
        held = out.param_stages.get(name)
        if not held or not isinstance(value, NodeResult):
            continue
        node = value.node
        updated = out.copies.get(node, {stage[node]} if node in stage else set())
        if node in pure:
            out.copies[node] = updated | held
        elif len(held) > 1 or held != updated:
            raise PcompileError(
                f"pipeline: optimizer state {name!r} is used in stages "
                f"{sorted(held)} but updated in stage {sorted(updated)}; report the optimizer")
    return out


# -- the cut -------------------------------------------------------------------------------------


@dataclass
class Transfer:
    """One Send/Receive pair."""

    tag: int
    src: int  # stage
    dst: int
    value: str  # what crosses: the producer's op and instance name
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass
class PipelineProgram:
    """The stages' graphs and how they fit together."""

    stages: int
    devices: int
    micro: int
    scheduler: str
    graphs: list[Graph]
    transfers: list[Transfer]
    param_stages: dict[str, list[int]]
    outputs: tuple[str, ...] = ()  # every output name of the step (loss, then stored values)
    schedule: Schedule | None = None
    chunks: int = 1

    @property
    def per_stage(self) -> int:
        return self.devices // self.stages

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.per_stage

    def ranks(self, stage: int) -> range:
        return range(stage * self.per_stage, (stage + 1) * self.per_stage)

    def finish(self) -> Schedule:
        """The schedule of the final graphs (after comm_fusion)."""
        self.schedule = schedule(self.graphs, self.scheduler, self.micro, self.per_stage,
                                 self.chunks)
        return self.schedule

    def describe(self) -> dict[str, Any]:
        """plan.json's `pipeline` section (compiler/driver/plan.py: PipelineInfo)."""
        sched = self.schedule
        assert sched is not None
        return {
            "stages": self.stages, "devices_per_stage": self.per_stage,
            "micro_size": self.micro, "chunks": self.chunks, "scheduler": self.scheduler,
            "ticks": sched.num_ticks,
            "bubble": sched.bubble, "ideal_bubble": sched.ideal_bubble,
            "per_stage": [{
                "stage": s, "ranks": list(self.ranks(s)),
                "parameters": [p.name for p in self.graphs[s].params if p.kind != "input"],
                "units": [{"tick": t, "unit": unit_name(lab, self.chunks)}
                          for lab, t in zip(sched.units[s].sequence, sched.units[s].ticks)],
                "activation_bytes": {k: v[s] for k, v in sched.held_bytes.items()},
                "micro_batches_in_flight": {k: v[s] for k, v in sched.in_flight.items()},
            } for s in range(self.stages)],
            "transfers": [{"sr_tag": t.tag, "src_stage": t.src, "dst_stage": t.dst,
                           "value": t.value, "shape": list(t.shape), "dtype": t.dtype,
                           "bytes": t.nbytes} for t in self.transfers],
        }


def _world(value: Any, devices: int) -> Any:
    """Groups named for the whole world (a stage's group of n ranks is not the world)."""
    if isinstance(value, RankGroup):
        return RankGroup(devices, value.digits)
    if isinstance(value, GroupName):
        return GroupName(RankGroup(devices, value.group.digits))
    return value


def _describe(node: Node) -> str:
    return f"{node.op} '{node.instance_name}'" if node.instance_name else node.op


def split(graph: Graph, stages: int, devices: int, micro: int, scheduler: str,
          placed: Assignment, labels: dict[Node, MicroLabel], chunks: int = 1
          ) -> PipelineProgram:
    """One graph per stage (see the module docstring); `placed` in virtual stages."""
    n = devices // stages

    def mark(info: ParallelInfo | None, node: Node, label: MicroLabel | None,
             s: int) -> ParallelInfo:
        """A copy of `info` with the unit annotation of the copy of `node` (labelled `label`)
        in stage s."""
        out = ParallelInfo() if info is None else info.copy()
        if label is None:
            return out
        out.micro = label[1]
        if chunks == 1:
            return out
        if node in placed.stage:
            out.chunk = placed.stage[node] // stages
            return out
        # A pure node (computed where needed): the chunk of its copies on stage s whose unit
        # comes first (forward: the lowest chunk, backward: the highest).
        mine = [u // stages for u in placed.copies.get(node, ()) if u % stages == s]
        out.chunk = (max(mine) if label[0] == "B" else min(mine)) if mine else 0
        return out

    def physical(sites: Any) -> set[int]:
        return {u % stages for u in sites}

    # the stages that hold each stored parameter (its virtual stages' stages)
    holders = {name: physical(sites) for name, sites in placed.param_stages.items()}
    names = list(graph.attrs.get("outputs") or ())
    outs: list[Graph] = []
    for s in range(stages):
        g = Graph(graph.name)
        g.attrs = {k: _world(v, devices) for k, v in graph.attrs.items() if k != "outputs"}
        g.attrs.update({"pipeline_stage": s, "pipeline_stages": stages, "micro_size": micro,
                        "pipeline_scheduler": scheduler})
        if chunks > 1:
            g.attrs["pipeline_chunks"] = chunks
        outs.append(g)
    where: dict[int, set[int]] = {}
    for p in graph.params:
        if p.kind == "input":
            where[id(p)] = set()
        else:
            where[id(p)] = set(holders[p.name])
    for node in graph.nodes:
        sites = physical(placed.copies.get(node, {placed.stage.get(node, -1)}))
        for v in node.operands:
            if isinstance(v, GraphParam) and v.kind == "input":
                where[id(v)] |= sites
    mapped: list[dict[int, Value]] = [{} for _ in range(stages)]
    for p in graph.params:
        for s in sorted(where[id(p)]):
            mapped[s][id(p)] = outs[s].add_param(GraphParam(p.tensor_type, p.name, p.kind,
                                                            p.requires_grad))
    transfers: list[Transfer] = []
    received: dict[tuple[int, int], Value] = {}
    home: dict[int, int] = {}  # id(node result) -> the stage that computes it (non-pure)

    def operand(v: Value, s: int, user: Node) -> Value:
        if isinstance(v, Constant):
            return copy_constant(v)
        if id(v) in mapped[s]:
            return mapped[s][id(v)]
        assert isinstance(v, NodeResult), f"{v!r} is not available in stage {s}"
        key = (id(v), s)
        if key in received:
            return received[key]
        src = home[id(v)]
        producer = mapped[src][id(v)]
        assert isinstance(producer, NodeResult)
        tag = len(transfers)
        ttype = v.tensor_type
        what = _describe(v.node)
        transfers.append(Transfer(tag, src, s, what, ttype.shape, ttype.dtype.value,
                                  ttype.nbytes))
        label = labels.get(v.node)
        info = mark(None, v.node, label, src)
        info.reason = f"pipeline: stage {src} sends {what} to stage {s}"
        info.bytes = 0
        send = Node("Send", [producer],
                    {"sr_tag": tag, "dest_rank": RankShift((s - src) * n), "group": WORLD_GROUP,
                     "shape": ttype.shape, "dtype": ttype.dtype},
                    ttype, instance_name=f"pipeline_send_{tag}", scope=v.node.scope,
                    source=v.node.source, name_hint=v.name_hint,
                    parallel=info)
        outs[src].append(send)
        # a value no micro-batch computes (a constant mask) is received once, unlabelled like
        # its Send, in the unit of its first reader; the others' in their reader's unit
        user_label = labels.get(user) if label is not None else None
        info = mark(None, user, user_label, s)
        info.reason = f"pipeline: stage {s} receives {what} from stage {src}"
        info.bytes = ttype.nbytes
        recv = Node("Receive", [],
                    {"sr_tag": tag, "src_rank": RankShift((src - s) * n), "group": WORLD_GROUP,
                     "shape": ttype.shape, "dtype": ttype.dtype},
                    ttype, instance_name=f"pipeline_receive_{tag}", scope=user.scope,
                    source=v.node.source, name_hint=v.name_hint,
                    parallel=info)
        outs[s].append(recv)
        received[key] = recv.result
        return recv.result

    for node in graph.nodes:
        copies = placed.copies.get(node)
        pure = copies is not None
        for s in sorted(physical(copies)) if pure else [placed.stage[node] % stages]:
            label = labels.get(node)
            parallel = node.parallel
            if label is not None:
                parallel = mark(parallel, node, label, s)
            copy = Node(node.op, [operand(v, s, node) for v in node.operands],
                        {k: _world(v, devices) for k, v in node.attrs.items()},
                        node.result.type, instance_name=node.instance_name, scope=node.scope,
                        source=node.source, name_hint=node.result.name_hint, parallel=parallel)
            copy.fullname = node.fullname
            outs[s].nodes.append(copy)
            mapped[s][id(node.result)] = copy.result
            if not pure:
                home[id(node.result)] = s
    for s, g in enumerate(outs):
        values: list[Value] = []
        kept: list[str] = []
        for name, value in zip(names, graph.outputs):
            if name == "loss":
                if id(value) not in mapped[s]:
                    continue
            elif s not in holders.get(name, ()):
                continue
            values.append(operand(value, s, value.node) if isinstance(value, NodeResult)
                          else mapped[s][id(value)])
            kept.append(name)
        g.outputs = values
        g.attrs["outputs"] = tuple(kept)
    for s, g in enumerate(outs):
        order_by_units(g, unit_sequence(scheduler, stages, s, micro, chunks))
    transfers = _renumber(outs, transfers)
    params = {name: sorted(sites) for name, sites in holders.items()}
    return PipelineProgram(stages, devices, micro, scheduler, outs, transfers, params,
                           tuple(names), chunks=chunks)


def _renumber(graphs: list[Graph], transfers: list[Transfer]) -> list[Transfer]:
    """sr_tags in the order the stages send (stage by stage, in schedule order)."""
    order = [int(n.attrs["sr_tag"]) for g in graphs for n in g.nodes if n.op == "Send"]
    new = {old: k for k, old in enumerate(order)}
    for g in graphs:
        for node in g.nodes:
            if has_trait(node.op, Trait.POINT_TO_POINT):
                tag = new[int(node.attrs["sr_tag"])]
                node.attrs["sr_tag"] = tag
                node.instance_name = f"pipeline_{node.op.lower()}_{tag}"
    out = [transfers[old] for old in order]
    for k, t in enumerate(out):
        t.tag = k
    return out


def empty_stages(program: PipelineProgram) -> list[int]:
    return [s for s, g in enumerate(program.graphs) if not g.nodes]


def check_loss(program: PipelineProgram) -> None:
    if "loss" not in program.graphs[-1].attrs["outputs"]:
        where = "stage" if program.chunks == 1 else "stage and its last segment"
        raise PcompileError(f"pipeline: the loss is not computed in the last stage; put the "
                            f"loss function's cells (or the cells it follows) in the last "
                            f"{where}")



class PipelineSplitPass:
    """`pipeline_split` (after the optimizer): one program per stage, joined by Send/Receive;
    rank r runs its stage's program."""

    name = "pipeline_split"
    appends_only = False

    def apply(self, unit: CompileUnit) -> None:
        settings = unit.pipeline
        assert settings is not None and settings.stage_map is not None
        graph = unit.rank_graphs[0]
        placed = assign(graph, settings.stage_map.virtual, settings.local_stage,
                        settings.stage_map.param_stage)
        program = split(graph, settings.stages, unit.devices, settings.micro_size,
                        settings.scheduler, placed, settings.labels, settings.chunks)
        check_loss(program)
        settings.program = program
        n = program.per_stage
        unit.rank_graphs = [program.graphs[r // n] for r in range(unit.devices)]
