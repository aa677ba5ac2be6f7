"""Pipeline stages in the cost model in seconds: what `--search ilp` and every plan's prediction
count per stage when the step is cut into pipeline stages (`pipeline_stages` > 1).

A pipelined step runs each stage's ops on that stage's devices, `micro` micro-batches through
the `stages` stages in the scheduler's order (passes/pipeline_schedule.py). The search and the
prediction see the forward graph of the whole batch, laid out inside one stage's devices, and
count per stage:

* **time**: a stage's seconds T_s are its ops' and edges' (the whole batch's compute and
  collectives), plus the point-to-point transfer of every value that crosses into another
  stage (each rank sends its slice, forward and, for a value with a gradient, its cotangent
  back, at the link between the stages' ranks). The step is the slowest stage stretched by the
  bubble: (m v + S - 1) / (m v) * max_s T_s (m micro-batches, v chunks per stage, S stages;
  the ideal of both schedulers). The weights' gradient collectives, which run once per step,
  are stretched too: the model errs towards fewer of them.
* **memory**: each stage's parameters (weights, gradients, optimizer states) in full, and the
  activations of the micro-batches it holds at its peak: the most forward units whose backward
  has not run, from the scheduler's own unit order (1F1B: min(S - s, m) on stage s; GPipe: all
  m), each 1 / (m v) of the stage's whole-batch activations. A rank's memory is its stage's;
  the plan's is the largest stage's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pcompile.ir.core import Node
from pcompile.passes.pipeline_schedule import unit_sequence


@dataclass(frozen=True)
class PipelineShape:
    """The pipeline of one compile as the cost model sees it."""

    stages: int
    micro: int
    chunks: int = 1
    scheduler: str = "1f1b"
    node_stage: Mapping[Node, int] = field(default_factory=dict)  # forward node -> stage

    @property
    def bubble(self) -> float:
        """The step over the slowest stage's busy time: (m v + S - 1) / (m v)."""
        units = self.micro * self.chunks
        return (units + self.stages - 1) / units

    def held(self, stage: int) -> float:
        """The fraction of `stage`'s whole-batch activations it holds at its peak."""
        open_ = peak = 0
        for label in unit_sequence(self.scheduler, self.stages, stage, self.micro,
                                   self.chunks):
            open_ += 1 if label[0] == "F" else -1
            peak = max(peak, open_)
        return peak / (self.micro * self.chunks)

    def stage_of(self, node: Node) -> int | None:
        virtual = self.node_stage.get(node)
        return None if virtual is None else virtual % self.stages


def pipeline_shape(settings: Any, graph: Any) -> PipelineShape | None:
    """The shape of `settings` (passes.pipeline_stages.PipelineSettings) over the forward
    `graph`; None without pipeline stages."""
    if settings is None or settings.stages <= 1 or settings.stage_map is None:
        return None
    stage_map = settings.stage_map
    node_stage = {node: stage_map.node_stage[id(node)] for node in graph.nodes
                  if id(node) in stage_map.node_stage}
    return PipelineShape(settings.stages, settings.micro_size, settings.chunks,
                         settings.scheduler, node_stage)


def vertex_stages(cg: Any, shape: PipelineShape) -> list[int]:
    """The stage of every vertex of the cost graph `cg`: an op's from the stage map; a
    parameter's or the dataset's from the vertex it feeds (its first user), otherwise from the
    vertex that feeds it; stage 0 when nothing says."""
    out: list[int | None] = []
    for v in cg.vertices:
        out.append(shape.stage_of(v.node) if v.node is not None else None)
    for _ in range(2):
        for v in cg.vertices:
            if out[v.index] is not None:
                continue
            near = [cg.edges[e].dst for e in sorted(v.out_edges)] \
                + [cg.edges[e].src for e in sorted(v.in_edges)]
            out[v.index] = next((out[u] for u in near if out[u] is not None), None)
    return [0 if s is None else s for s in out]
