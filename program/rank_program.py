"""`RankProgram`: what a compile hands to the backends and tools, as plain typed data (issue 37
move 1). The driver builds it from the compile state (`compiler.compiled.CompiledProgram
.rank_program`); the code generators (backends/jax/codegen.py, pipeline_codegen.py) and the
parameter manifest (backends/params.py) read it instead of probing the compile state.

It holds no front-end object: graphs, layouts and pipeline programs are the IR's and the
passes' types, initial values are abstract (`program.initializers.InitializedData`), and what a
program says of its run (FLOPs, learning rate, tokens, data set) was computed by the driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pcompile.ir.core import Graph
from pcompile.ir.layout import TensorLayout
from pcompile.passes.pipeline_split import PipelineProgram
from pcompile.program.initializers import InitializedData


@dataclass(frozen=True)
class RunReport:
    """What a rank program says of its run (backends/run_report.py): the model FLOPs of one
    step (0: none counted), the optimizer's learning rate when it is a constant, the token ids
    one step trains on (all ranks; 0: none reach an embedding lookup), and the data set's spec
    (`compiler.runtime.DatasetSpec.literal()`; None before a trace)."""

    model_flops: int = 0
    learning_rate: float | None = None
    tokens_per_step: int = 0
    dataset: Mapping[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        """The generated program's run-report fields, by the names program_writer reads."""
        return {"model_flops": self.model_flops, "learning_rate": self.learning_rate,
                "tokens_per_step": self.tokens_per_step,
                "dataset": dict(self.dataset) if self.dataset is not None else None}


@dataclass(frozen=True)
class RankProgram:
    """Every rank's program and what running it needs.

    `rank_graphs`: the graph each rank runs (in SPMD modes one rank-parametric graph for every
    rank); `graphs`: every graph whose parameters the program stores (a pipeline's stage
    graphs); `dump_ranks`: the ranks whose folders are written; `param_layouts`: each
    parameter's and input's global layout (empty without a plan); `initial_values`: each stored
    value's abstract initial value, from which a rank makes only its block; `pipeline`: the
    stages, transfers and schedule of a pipelined program (None otherwise)."""

    model_path: str  # absolute: the model file a rank program reads its data from
    parallel_mode: str
    training: bool
    rank_graphs: tuple[Graph, ...]
    graphs: tuple[Graph, ...]
    dump_ranks: tuple[int, ...]
    param_layouts: Mapping[str, TensorLayout]
    initial_values: Mapping[str, InitializedData]
    pipeline: PipelineProgram | None
    run_report: RunReport

    @property
    def output_names(self) -> list[str]:
        """The names of the step's outputs (the loss, then the updated values)."""
        names = self.rank_graphs[0].attrs.get("outputs") if self.rank_graphs else None
        if names:
            return list(names)
        return [f"output{i}" for i in range(len(self.rank_graphs[0].outputs))]

    def stored_values(self) -> list[tuple[str, str, InitializedData]]:
        """(name, kind, abstract initial value) of every parameter and optimizer state the
        program stores (what `params.json` describes), in the order the graphs hold them."""
        seen: dict[str, tuple[str, str, InitializedData]] = {}
        for graph in self.graphs:  # the stages' graphs of a pipeline hold different values
            for p in graph.params:
                if p.kind != "input" and p.name not in seen:
                    seen[p.name] = (p.name, p.kind, self.initial_values[p.name])
        return list(seen.values())
