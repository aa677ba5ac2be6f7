"""What a compile holds and what it returns: `CompileState` (what the passes read and write),
`InitialValues` (parameter and optimizer-state values, held abstractly), `ReferenceOptions` (how
a single-device program models a parallel one) and `CompiledProgram`, the typed result of
`compiler.driver.compile_program`: the per-rank graphs, initial values, plan and dump texts.
Writing it out, running it and checking it happen above the backends (`pcompile.tools`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from pcompile.compiler.driver.parameter_layout import parameter_layout_dict
from pcompile.compiler.driver.pinned_plan import PinnedPlan
from pcompile.compiler.driver.trace_model import TracedModel
from pcompile.compiler.frontend.initializer import InitializedData
from pcompile.compiler.frontend.model_file import ModelFile
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.ir.core import Graph
from pcompile.passes.unit import CompileUnit
from pcompile.program.rank_program import RankProgram, RunReport


class InitialValues(MutableMapping[str, np.ndarray]):
    """Initial parameter and optimizer-state values by name, held abstractly (each an
    `InitializedData`: initializer, seed, shape, dtype; or the user's array): `values[name]`
    generates the whole value, `source(name)` gives the abstract one, from which a rank makes
    only its block (`CompileState.rank_values`)."""

    def __init__(self) -> None:
        self._sources: dict[str, InitializedData] = {}

    def source(self, name: str) -> InitializedData:
        return self._sources[name]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._sources[name].to_numpy()

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(value, InitializedData):
            value = InitializedData.of_array(np.array(value, copy=True))
        self._sources[name] = value

    def setdefault(self, name: str, value: Any = None) -> Any:  # type: ignore[override]
        if name not in self._sources:
            self[name] = value
        return self._sources[name]

    def __delitem__(self, name: str) -> None:
        del self._sources[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources

    def sources(self) -> dict[str, InitializedData]:
        """Every value's abstract source by name (nothing materialised)."""
        return dict(self._sources)

    @property
    def nbytes(self) -> int:
        """Bytes of every value (what materialising them all would take)."""
        return sum(s.nbytes for s in self._sources.values())


@dataclass
class ReferenceOptions:
    """How a single-device program models a parallel program's options (the oracle's
    reference, `tools.oracle`): `transform` rewrites the traced forward graph (e.g. the loss
    as the mean of the ranks' losses when reductions are rank-local, `cross_batch`), and each
    trainable parameter's gradient is multiplied by `gradient_scales[name]` before the
    optimizer (the mirrors' division under `gradients_mean`, a loss held by k ranks without
    `loss_repeated_mean`). `micro_batches`: a model returning `nn.PipelineCell` runs its
    micro-batches on the one device as MindSpore's PipelineCell does (each micro-batch through
    the network, the gradients accumulated, the loss their mean, a forward assignment once per
    micro-batch in order: `passes.micro_batch.replicate`); else the whole batch at once.
    `batch_blocks`: how many blocks of the inputs' rows the plan's ranks hold (dim 0's split);
    micro-batch k is the k-th part of each, the rows the plan's micro-batch k reads."""

    transform: Callable[[Graph], None] | None = None
    gradient_scales: dict[str, float] = field(default_factory=dict)
    micro_batches: bool = False
    batch_blocks: int = 1


@dataclass(kw_only=True)
class CompileState(CompileUnit):
    """What the passes read and write (`passes.unit.CompileUnit`), and what only the front
    end reads: the model file, its trace, the optimizer, the initial values, the oracle's and
    the shrunk check's settings."""

    model_file: ModelFile
    traced: TracedModel | None = None
    initial_values: InitialValues = field(default_factory=lambda: InitialValues())
    optimizer: Optimizer | None = None
    reference: ReferenceOptions | None = None  # single-device reference of a parallel program
    traces: list[TracedModel] = field(default_factory=list)  # hybrid mode: each rank's trace
    # The shrunk check (tools/shrink.py): the shrink applied to the trace and the plan's
    # pinned strategies; and the overrides the compile was given (to compile it again).
    shrink: PinnedPlan | None = None
    trace_only: bool = False  # compile(trace_only=True): the trace pass alone
    dump_ranks: list[int] = field(default_factory=list)  # the ranks whose folders are written
    overrides: dict[str, Any] = field(default_factory=dict)

    def rank_values(self, rank: int) -> dict[str, np.ndarray]:
        """Rank `rank`'s initial parameter and optimizer-state values: its block of each
        global initial value, generated on its own (never the whole value)."""
        if not self.parallel:
            return dict(self.initial_values.items())
        assert self.assignment is not None
        layouts = self.assignment.param_layouts
        out = {}
        for name in self.initial_values:
            source = self.initial_values.source(name)
            layout = layouts.get(name)
            bounds = (layout.slice_bounds(rank) if layout is not None and source.shape
                      else tuple((0, d) for d in source.shape))
            out[name] = source.block(bounds)
        return out


@dataclass(frozen=True)
class PassDump:
    """One dumped pass: its file name (`<NN>_<pass>.ir`) and its text for each dumped rank."""

    filename: str
    texts: dict[int, str]


@dataclass
class CompiledProgram:
    """The result of `compile_program()`: per-rank graphs, initial values and how to feed them.
    `out_dir` is the folder its outputs are for (None: a compile without dumps); `dumps` the
    texts of the dumped passes, in pass order, until they are written
    (`pcompile.tools.compile.write_outputs`)."""

    state: CompileState
    timings: list[tuple[str, float]]
    out_dir: str | None
    dumps: list[PassDump] = field(default_factory=list)

    @property
    def graph(self) -> Graph:
        assert self.state.graph is not None
        return self.state.graph

    @cached_property
    def rank_program(self) -> RankProgram:
        """The typed, data-only program the backends and tools read (`build_rank_program`)."""
        return build_rank_program(self.state)

    @property
    def rank_graphs(self) -> list[Graph]:
        """The graph each rank runs: in SPMD modes the same rank-parametric graph for every
        rank (see `rank_graph` for one rank's concrete view)."""
        return self.state.rank_graphs

    def rank_graph(self, rank: int) -> Graph:
        """Rank `rank`'s own graph, every rank-dependent value evaluated (what its dump shows)."""
        return self.state.rank_graphs[rank].at_rank(rank)

    @property
    def traced(self) -> TracedModel:
        assert self.state.traced is not None
        return self.state.traced

    @property
    def training(self) -> bool:
        return self.state.training

    @property
    def initial_values(self) -> InitialValues:
        return self.state.initial_values

    @property
    def parameter_layout_dict(self) -> dict[str, Any]:
        """MindSpore's `Cell.parameter_layout_dict` for the compiling rank (`global_rank`):
        name -> (dev_matrix, tensor_map, slice_shape, field_size, uniform_split,
        opt_shard_group), for every parameter and input (compiler/driver/parameter_layout.py)."""
        return parameter_layout_dict(self.state, self.state.options.global_rank)

    def parameter_layout(self, rank: int) -> dict[str, Any]:
        """`parameter_layout_dict` as rank `rank` sees it (only the optimizer shard group
        differs between ranks)."""
        return parameter_layout_dict(self.state, rank)

    @property
    def output_names(self) -> list[str]:
        names = self.rank_graphs[0].attrs.get("outputs") if self.rank_graphs else None
        if names:
            return list(names)
        return [f"output{i}" for i in range(len(self.rank_graphs[0].outputs))]


def build_rank_program(state: CompileState) -> RankProgram:
    """The `RankProgram` of a finished compile: its graphs, layouts, abstract initial values
    and pipeline, and what the program says of its run (`run_report`)."""
    pipeline = state.pipeline.program if state.pipelined and state.pipeline else None
    return RankProgram(
        model_path=os.path.abspath(state.model_file.path),
        parallel_mode=state.parallel_mode,
        training=bool(state.training),
        rank_graphs=tuple(state.rank_graphs),
        graphs=tuple(state.graphs),
        dump_ranks=tuple(state.dump_ranks),
        param_layouts=(dict(state.assignment.param_layouts) if state.assignment is not None
                       else {}),
        initial_values=state.initial_values.sources(),
        pipeline=pipeline,
        run_report=run_report(state))


def run_report(state: CompileState) -> RunReport:
    """What the runtime needs to report a run (backends/run_report.py): the model FLOPs of one
    step counted on the traced forward graph (compiler/driver/flops.py; 0: none counted), the
    optimizer's learning rate when it is a constant (the model file's optimizer() or the one
    its training step cell holds), the token ids one step trains on (`tokens_per_step`) and
    the data set's spec."""
    from pcompile.compiler.driver.flops import (
        constant_learning_rate,
        model_flops,
        training_optimizer,
    )
    from pcompile.compiler.driver.runtime import dataset_spec

    traced = state.traced
    graph = traced.graph if traced is not None else None
    return RunReport(model_flops=model_flops(graph, bool(state.training)),
                     learning_rate=constant_learning_rate(training_optimizer(state)),
                     tokens_per_step=tokens_per_step(state),
                     dataset=dataset_spec(state).literal() if traced is not None else None)


def tokens_per_step(state: CompileState) -> int:
    """Token ids of the first input one step trains on, all ranks: those its embedding lookup
    reads (compiler/driver/data_checks.py, `looked_up_ids`), not the ids the input holds (a sample
    of S + 1 ids trains S tokens); 0 when they reach no lookup. The traced graph takes one
    micro-batch under nn.PipelineCell: scaled to the whole batch."""
    from pcompile.compiler.driver.data_checks import looked_up_ids

    traced = state.traced
    if traced is None or not traced.input_names:
        return 0
    name = traced.input_names[0]
    looked = looked_up_ids(traced.graph, name)
    if not looked:
        return 0
    held = int(np.prod(traced.graph.param(name).shape, dtype=np.int64))
    whole = held
    if state.micro_batched and state.assignment is not None:
        whole = int(np.prod(state.assignment.param_layouts[name].shape, dtype=np.int64))
    return looked * whole // max(1, held)
