"""What a compile holds and what it returns: `CompileState` (what the passes read and write),
`InitialValues` (parameter and optimizer-state values, held abstractly), `ReferenceOptions` (how
a single-device program models a parallel one) and `CompiledProgram`, the typed result of
`compiler.driver.compile_program`: the per-rank graphs, initial values, plan and dump texts.
Writing it out, running it and checking it happen above the backends (`pcompile.tools`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.compiler.initializer import InitializedData
from pcompile.compiler.model_file import ModelFile
from pcompile.compiler.nn.optim_base import Optimizer
from pcompile.compiler.parameter_layout import parameter_layout_dict
from pcompile.compiler.pinned_plan import PinnedPlan
from pcompile.compiler.trace_model import TracedModel
from pcompile.ir.core import Graph
from pcompile.passes.unit import CompileUnit


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
    `loss_repeated_mean`)."""

    transform: Callable[[Graph], None] | None = None
    gradient_scales: dict[str, float] = field(default_factory=dict)


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
        opt_shard_group), for every parameter and input (compiler/parameter_layout.py)."""
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
