"""The shrunk check's compile (`pcompile.tools.shrink`): what the driver takes from the plan it
checks. `PinnedPlan` holds the shrink of the traced graph (`ir.dims.Shrink`) and the plan's
searched strategies and Reshape layouts by node position; `apply_to_trace` shrinks a fresh trace
(its graph, its parameters' shapes and data) and `pinned_search` gives the pinned strategies in
place of a search."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pcompile.compiler.frontend.initializer import InitializedData
from pcompile.ir.core import Graph
from pcompile.ir.dims import Shrink
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.passes.unit import CompileUnit

if TYPE_CHECKING:
    from pcompile.passes.search import SearchResult


@dataclass
class PinnedPlan:
    """What a shrunk compile takes from the plan: the shrink, and the searched strategy and
    Reshape layout of every op by its position in the traced graph."""

    shrink: Shrink
    strategies: dict[int, Any] = field(default_factory=dict)
    reshape_layouts: dict[int, TensorLayout] = field(default_factory=dict)
    mode: str = ""
    #: data_parallel: the shrink of the whole-batch trace (the single-device program's), where
    #: `shrink` is that of the one-rank trace the plan compiles
    reference: Shrink | None = None
    #: the parameters whose cotangents the plan sums on their user's output (a choice by byte
    #: sizes, which the shrunk sizes could change: passes/cotangents.py)
    reduced_parameters: tuple[str, ...] = ()
    #: the ilp search's global choices (parallel optimizer, recompute), applied again
    ilp: dict[str, Any] | None = None
    #: the weights the parallel optimizer stored sharded (None: it was off)
    opt_sharded: tuple[str, ...] | None = None


def apply_to_trace(shrink: Shrink, traced: Any) -> None:
    """Shrink a fresh trace of the model file: its graph, its parameters' shapes and data."""
    from pcompile.ir.verifier import verify

    shrink.apply(traced.graph)
    try:
        verify(traced.graph, allow_extra_attrs=True)
    except PcompileError as exc:  # a dimension rule (ir/dims.py) that does not hold
        raise PcompileError(
            f"the shrunk copy (factor {shrink.factor}) breaks an op's shape rule, so its "
            f"dimension rule in ir/ops is wrong; please report it with the model file "
            f"(--check-shrunk FACTOR with another factor, or --force-check, may avoid it): "
            f"{exc}") from exc
    for name, param in traced.parameters.items():
        shape = shrink.params.get(name)
        if shape is None or tuple(param.shape) == shape:
            continue
        param._init = shrunk_source(param.source, shape)  # noqa: SLF001  (abstract data)
        param._data = None  # noqa: SLF001


def shrunk_source(source: InitializedData, shape: tuple[int, ...]) -> InitializedData:
    """The same initializer at `shape`, or the leading block of the user's array."""
    array = source.array
    if array is not None:
        array = array[tuple(slice(0, n) for n in shape)]
    rows = tuple(r for r in source.zero_rows if shape and r < shape[0])
    return InitializedData(source.init, shape, source.dtype, source.ticket, array, rows)


def pinned_search(pinned: PinnedPlan, graph: Graph) -> SearchResult:
    """The plan's search result for the shrunk trace `graph`, in place of a search."""
    from pcompile.passes.search import SearchResult

    nodes = graph.nodes
    return SearchResult(
        mode=pinned.mode,
        strategies={nodes[i]: s for i, s in pinned.strategies.items()},
        reshape_layouts={nodes[i]: lay for i, lay in pinned.reshape_layouts.items()},
        ilp=pinned.ilp)


class PinnedSearchPass:
    """The shrunk check's compile (tools/shrink.py): the plan's searched strategies and
    Reshape layouts, pinned by position, in place of a search; the driver gives it the plan
    (its option) when the tool asks for the shrunk compile."""

    name = "step_auto_parallel_begin"
    appends_only = False

    def __init__(self, pinned: PinnedPlan) -> None:
        self.pinned = pinned

    def apply(self, unit: CompileUnit) -> None:
        from pcompile.passes.search.auto_parallel_pass import apply_plan_choices

        assert unit.graph is not None
        unit.search = pinned_search(self.pinned, unit.graph)
        apply_plan_choices(unit)  # the plan's parallel optimizer and recompute
