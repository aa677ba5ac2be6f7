"""Pipeline stages and micro-batches in the cost model in seconds: what `--search ilp` and
every plan's prediction count per stage when the step runs micro-batches (`nn.PipelineCell`),
through pipeline stages (`pipeline_stages` > 1) or not (gradient accumulation).

The program is traced for ONE micro-batch (compiler/driver/pipelining.py), so the search and the
prediction see one micro-batch's forward graph, laid out inside one stage's devices. Per stage:

* **time**: an op's compute and activation collectives, an edge's redistribution and the
  point-to-point transfer of every value that crosses into another stage (each rank sends its
  slice, charged to the producer's stage, and for a value with a gradient the consumer's stage
  sends the cotangent back, at the link between the stages' ranks; once per value and receiving
  stage, however many ops there read it) run once per micro-batch when they read the batch; an
  op that reads no input (a mask built from constants) runs once per step and is shared by the
  micro-batches, and so are the weights' gradient collectives (the mirror's AllReduce, the
  parallel optimizer's ReduceScatter and AllGather) and the optimizer's update, on the
  accumulated gradient (passes/micro_batch.py). A pipelined step takes m v + S - 1 ticks of one
  unit (a micro-batch on one chunk) of the slowest stage, so a stage's seconds are (m + (S - 1)
  / v) times its per-micro-batch seconds plus its once-per-step seconds, and the step is the
  slowest stage's (m micro-batches, v chunks per stage, S stages; the ideal of both schedulers;
  without stages, m times the micro-batch plus the step's). Bytes count m per micro-batch's.
* **memory**: each stage's parameters (weights, gradients, optimizer states) in full, and the
  activations of the units it holds at its peak: the most forward units whose backward has not
  run, from the scheduler's own unit order (1F1B: min(S - s, m) on stage s; GPipe: all m;
  gradient accumulation: 1), each one micro-batch's activations of one chunk. A rank's memory is
  its stage's; the plan's is the largest stage's.

Not modelled: with `gradient_accumulation_shard` the parallel optimizer reduce-scatters each
micro-batch's gradient (counted here once per step); an embedding's gradient summed on its
output is counted once per step too.
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
    def repeat(self) -> float:
        """A stage's busy time per step over its per-micro-batch time: m + (S - 1) / v (the
        m v + S - 1 ticks of the step, each 1 / v of a micro-batch's work)."""
        return self.micro + (self.stages - 1) / self.chunks

    @property
    def bubble(self) -> float:
        """The idle share of the ticks: (S - 1) / (m v + S - 1)."""
        return (self.stages - 1) / (self.micro * self.chunks + self.stages - 1)

    def held(self, stage: int) -> float:
        """The micro-batches' activations `stage` holds at its peak (forward units whose
        backward has not run, each one chunk's)."""
        open_ = peak = 0
        for label in unit_sequence(self.scheduler, self.stages, stage, self.micro,
                                   self.chunks):
            open_ += 1 if label[0] == "F" else -1
            peak = max(peak, open_)
        return peak / self.chunks

    def stage_of(self, node: Node) -> int | None:
        virtual = self.node_stage.get(node)
        return None if virtual is None else virtual % self.stages


def pipeline_shape(settings: Any, graph: Any, micro_batched: bool
                   ) -> PipelineShape | None:
    """The shape of `settings` (passes.pipeline_stages.PipelineSettings) over the forward
    `graph`, traced for one micro-batch when `micro_batched`; None otherwise."""
    if settings is None or not micro_batched:
        return None
    stage_map = settings.stage_map
    node_stage = {} if stage_map is None else dict(stage_map.node_stage)
    return PipelineShape(max(1, settings.stages), settings.micro_size, settings.chunks,
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
