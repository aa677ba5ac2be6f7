"""Which pipeline stage every op of the traced forward graph runs in.

`set_auto_parallel_context(pipeline_stages=S)` splits the devices into S stages; the user puts
cells into stages with `cell.pipeline_stage = s`. An op runs in the stage of the innermost cell
around it that has one (`ScopeCell.stage`). The rules, and the error each breach gives:

* every sub-cell of the network that runs ops must have a stage, its own or an enclosing
  cell's (else: "... has no pipeline stage");
* ops outside every staged cell that the compiler owns or the user did not put in a sub-cell
  (the network's own construct, the loss function of `nn.WithLossCell`, the wrappers
  `nn.PipelineCell` and `nn.MicroBatchInterleaved`) follow their data: the latest stage among
  their inputs, or, reading only parameters and graph inputs, the earliest stage that reads
  them;
* stages are 0..S-1 (else: "... has pipeline_stage 5, but ..."), each of them runs some op
  (else: "stage 2 has no op"), and data flows from a stage to itself or a later one only
  (else: "stages out of order");
* a weight belongs to one stage: the ops that use it are all in one stage (else: "parameter
  ... is used in stages 0 and 3"; pcompile does not share weights between stages).

Interleaved pipelines (`pipeline_config={"pipeline_interleave": True}`): a cell also has a
`pipeline_segment` g (MindSpore's name; default 0), taken from the same cell as its stage. The
network is then cut into S x v *chunks* (v = the largest segment + 1) that data flows through
in the order (segment, stage): stage 0..S-1 of segment 0, then stage 0..S-1 of segment 1, ...
Every stage runs v chunks. Inside this module the *virtual stage* g * S + s stands for (stage
s, segment g): the order rule above holds for virtual stages, a weight belongs to one of them,
and every physical stage must run some op. A segment above 0 without `pipeline_interleave` is
refused.

`assign_stages(graph, cells, stages, interleave)` returns the virtual stage of every node and
weight, or raises `PcompileError` with one of the messages above, naming the op, its scope and
source line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pcompile.ir.core import Graph, GraphParam, Node, NodeResult
from pcompile.ir.errors import PcompileError


@dataclass(frozen=True)
class ScopeCell:
    """The cell a scope belongs to, as the stage rules see it: `stage` (None: not set),
    `kind` ("cell": a sub-cell of the network, which must be staged; "root": the network
    itself or a wrapper or loss function, whose own ops follow their data), and for messages
    its attribute path and class."""

    stage: int | None
    kind: str
    path: str
    cls: str
    segment: int = 0


@dataclass
class StageMap:
    """The result: virtual stage (segment * stages + stage) of every forward node and
    of every weight (by name); `chunks`: the segments (1 without interleaving)."""

    stages: int
    node_stage: dict[Node, int] = field(default_factory=dict)
    param_stage: dict[str, int] = field(default_factory=dict)
    chunks: int = 1

    def of(self, node: Node) -> int:
        return self.node_stage[node]

    @property
    def virtual(self) -> int:
        """The number of virtual stages (stages x chunks)."""
        return self.stages * self.chunks

    def text(self, virtual: int) -> str:
        """'stage s' (or 'stage s segment g' when interleaved) of a virtual stage."""
        if self.chunks == 1:
            return f"stage {virtual}"
        return f"stage {virtual % self.stages} segment {virtual // self.stages}"


def _scopes(scope: str) -> list[str]:
    """`scope` and its enclosing scopes, innermost first."""
    out = []
    while scope:
        out.append(scope)
        if "/" not in scope:
            break
        scope = scope.rsplit("/", 1)[0]
    return out


def _cell_text(info: ScopeCell) -> str:
    return f"cell `{info.path}` ({info.cls})" if info.path else f"the network ({info.cls})"


def declared_stage(node: Node, cells: dict[str, ScopeCell], stages: int) -> int | None:
    """The virtual stage of the innermost staged cell around `node` (segment * stages +
    stage); None when the node follows its data; PcompileError for an unstaged sub-cell or a
    stage out of range."""
    first: tuple[str, ScopeCell] | None = None
    for scope in _scopes(node.scope):
        info = cells.get(scope)
        if info is None:
            continue
        if info.stage is not None:
            if not 0 <= info.stage < stages:
                raise PcompileError(
                    f"pipeline_stages={stages}: {_cell_text(info)} has pipeline_stage "
                    f"{info.stage}, but the stages are 0..{stages - 1} ({node.where()} runs "
                    "in it); use a stage below pipeline_stages or raise pipeline_stages")
            return info.segment * stages + info.stage
        if info.kind == "root":
            if first is None or first[1].kind == "root":
                return None
            break
        if first is None:
            first = (scope, info)
    if first is None:
        return None
    info = first[1]
    hint = f"net.{info.path}.pipeline_stage = s" if info.path else "cell.pipeline_stage = s"
    raise PcompileError(
        f"pipeline_stages={stages}: {node.where()} runs in {_cell_text(info)}, which has no "
        f"pipeline stage, nor has any cell around it; set `{hint}` (0 <= s < {stages}) on it "
        "or on a cell that contains it: every sub-cell of the network runs in a stage")


def assign_stages(graph: Graph, cells: dict[str, ScopeCell], stages: int,
                  interleave: bool = False) -> StageMap:
    """The virtual stage of every node and weight of the forward graph (see the module
    docstring)."""
    _check_segments(cells, interleave)
    result = StageMap(stages)
    result.chunks = 1 + max((c.segment for c in cells.values() if c.stage is not None),
                            default=0)
    stage = result.node_stage
    declared: set[Node] = set()
    for node in graph.nodes:
        s = declared_stage(node, cells, stages)
        if s is not None:
            stage[node] = s
            declared.add(node)
    # Ops that follow their data: the latest stage of their inputs ...
    for node in graph.nodes:
        if node in stage:
            continue
        seen = [stage[v.node] for v in node.operands
                if isinstance(v, NodeResult) and v.node in stage]
        if seen:
            stage[node] = max(seen)
    # ... or, reading only parameters and inputs, the earliest stage that reads them.
    for node in reversed(graph.nodes):
        if node in stage:
            continue
        users = [stage[u] for u in node.result.users if u in stage]
        stage[node] = min(users) if users else result.virtual - 1
    _check_order(graph, result, declared)
    _check_weights(graph, result)
    used = {v % stages for v in stage.values()}
    empty = [s for s in range(stages) if s not in used]
    if empty:
        raise PcompileError(
            f"pipeline_stages={stages}: stage {empty[0]} has no op (stages used: "
            f"{', '.join(map(str, sorted(used)))}); give cells the stages 0..{stages - 1}, "
            f"every stage at least one (`cell.pipeline_stage = s`), or use fewer stages")
    return result


def _check_order(graph: Graph, result: StageMap, declared: set[Node]) -> None:
    stage = result.node_stage
    for node in graph.nodes:
        for value in node.operands:
            if not isinstance(value, NodeResult):
                continue
            producer = value.node
            a, b = stage[producer], stage[node]
            if a > b:
                order = ("a stage to itself or a later one only: give the cells stages that grow "
                         "along the network") if result.chunks == 1 else (
                    "a chunk to itself or a later one only, in the order (segment, stage): "
                    "give the cells stages that grow along each segment and segments that grow "
                    "along the network")
                raise PcompileError(
                    f"pipeline stages out of order: {node.where()} in {result.text(b)} reads "
                    f"the output of {producer.where()} in {result.text(a)}; data flows from "
                    f"{order}")


def _check_weights(graph: Graph, result: StageMap) -> None:
    for param in graph.params:
        if param.kind == "input":
            continue
        users = {result.node_stage[u]: u for u in param.users}
        if len(users) > 1:
            (a, ua), (b, ub) = sorted(users.items())[:2]
            where = (f"stages {a} ({ua.where()}) and {b} ({ub.where()})" if result.chunks == 1
                     else f"{result.text(a)} ({ua.where()}) and {result.text(b)} "
                          f"({ub.where()})")
            raise PcompileError(
                f"parameter {param.name!r} is used in {where}; a weight belongs to one "
                "pipeline stage: put the cells that share it into one stage (and segment); "
                "pcompile does not share weights between stages")
        if users:
            result.param_stage[param.name] = next(iter(users))


def _check_segments(cells: dict[str, ScopeCell], interleave: bool) -> None:
    for info in cells.values():  # (Cell's setter refuses a negative segment)
        if info.segment and not interleave:
            raise PcompileError(
                f"{_cell_text(info)} has pipeline_segment {info.segment}, but pipeline_config "
                "pipeline_interleave is False: segments (interleaved virtual stages) need "
                "set_auto_parallel_context(pipeline_config={'pipeline_interleave': True, ...}); "
                "set it, or leave every pipeline_segment at 0")
        if info.segment and info.stage is None:
            raise PcompileError(
                f"{_cell_text(info)} has pipeline_segment {info.segment} but no "
                "pipeline_stage; set both on the same cell")


def weight_stage(param: GraphParam, result: StageMap) -> int | None:
    return result.param_stage.get(param.name)


@dataclass
class PipelineSettings:
    """Pipeline options of one compile and what the passes derived from the trace."""

    stages: int
    micro_size: int
    scheduler: str
    interleave: bool = False
    stage_map: StageMap | None = None
    loss_scope: str = "Default"
    # Filled by the passes for the nodes of the current local graph: the virtual stage of each
    # (step_parallel_end, micro_batch, autodiff) and its label ("F" | "B", micro-batch).
    local_stage: dict[Node, int] = field(default_factory=dict)
    labels: dict[Node, tuple[str, int]] = field(default_factory=dict)
    program: Any = None  # passes.pipeline_split.PipelineProgram once split

    @property
    def pipelined(self) -> bool:
        return self.stages > 1

    @property
    def chunks(self) -> int:
        """Chunks (segments) per stage: 1 unless interleaved."""
        return self.stage_map.chunks if self.stage_map is not None else 1
