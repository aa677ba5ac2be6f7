"""The pass contract: a `Pass` has a `name` and one `apply(unit)` on a `CompileUnit`.

A pass's options are typed data the driver builds when it assembles a compile
(`compiler/driver/driver.py::pipeline`) and hands to the pass's constructor; a pass reads nothing
else: no global context, no environment, no front-end object (the model file, the traced
cells). What the passes read and write between them is the `CompileUnit`: the forward graph,
the graph each rank runs, the strategy assignment, the search's decision, the pipeline program
and the plan record. The front end's state (`compiler.compiled.CompileState`) extends it with
what only the front end reads (the model file, the traced model, the optimizer).

The driver runs the passes in order; after each it verifies the graphs (every node when the
pass may change any, only the appended ones when the pass says `appends_only`), times it and
dumps it as `<NN>_<name>.ir`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pcompile.ir.core import Graph, Node

if TYPE_CHECKING:
    from pcompile.passes.layouts import OptShard, ParallelAssignment
    from pcompile.passes.pipeline_stages import PipelineSettings
    from pcompile.passes.search import SearchResult
    from pcompile.passes.search.time_model import DeviceProfile

U_contra = TypeVar("U_contra", contravariant=True)


class Pass(Protocol[U_contra]):
    """One pass: `name` names its dump (`<NN>_<name>.ir`); `apply` changes the unit in place.
    A pass that only appends nodes sets `appends_only = True` (the driver then verifies and
    prints only what it appended); every other pass says False."""

    name: str
    appends_only: bool

    def apply(self, unit: U_contra) -> None: ...


@dataclass(frozen=True)
class StrategyFiles:
    """`strategy_ckpt_config`: where the search loads strategies from and where the driver
    saves them; `loaded` is the load file's contents, read by the driver before the passes
    (passes/search/strategy_checkpoint.py); `aggregated_save` is
    `optimizer_weight_shard_aggregated_save` (the file then records no optimizer shard groups)."""

    load_file: str = ""
    save_file: str = ""
    only_trainable_params: bool = True
    aggregated_save: bool = False
    loaded: Mapping[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class OptimizerShardOptions:
    """`enable_parallel_optimizer` and `parallel_optimizer_config`."""

    enabled: bool = False
    threshold_kb: int = 64
    shard_size: int = -1
    gradient_accumulation_shard: bool = False
    # the shrunk check: the weights the full-size plan stored sharded (its choice by sizes)
    pinned: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ParameterFacts:
    """What the passes need to know of a user's Parameter: its gradient's fusion bucket
    (`comm_fusion`), whether each rank keeps its own copy (`layerwise_parallel`: no gradient
    mirror) and whether the parallel optimizer may shard it (`parallel_optimizer`)."""

    comm_fusion: int = 1
    layerwise_parallel: bool = False
    parallel_optimizer: bool = True


@dataclass(frozen=True)
class CompileOptions:
    """The compile's options the passes read, as the driver took them from the contexts and
    the command line (MindSpore's names)."""

    dataset_strategy: Any = None  # a tuple of per-input strategies or Layouts; None: default
    gradients_mean: bool = False
    loss_repeated_mean: bool = True
    enable_alltoall: bool = False
    gradient_fp32_sync: bool = True
    parameter_broadcast: bool = False
    optimizer_shard: OptimizerShardOptions = OptimizerShardOptions()
    strategy_files: StrategyFiles = StrategyFiles()
    global_rank: int = 0
    # MS_DEV_DUMP_IR_PARALLEL_DETAIL=1: tensor maps / layouts in step_parallel_begin's dump
    parallel_detail: bool = False
    save_graphs: int = 2  # MindSpore's level: which passes are dumped
    verify_each: bool = False  # verify the graphs after every pass (the test suite sets it)
    # the cost model in seconds (passes/search/time_model.py): the device profile, read by the
    # driver (a built-in one or a JSON file's; None: the built-in h100), and the memory per
    # device (None: the profile's)
    device_profile: DeviceProfile | None = None
    device_memory: float | None = None


@dataclass
class PlanRecord(MutableMapping[str, Any]):
    """The plan record's sections the passes write, one field each (None until its pass
    writes it): plan.json's sections of the same names (`compiler/driver/plan.py::Plan` gives their
    schema). Seen as a mapping, it holds the sections written, by name; a name that is no
    field is refused (a new section is a new field here and in the schema)."""

    search: dict[str, Any] | None = None  # step_auto_parallel_begin: the search's summary
    prediction: dict[str, Any] | None = None  # step_parallel_begin: step time and memory
    parallel_optimizer: dict[str, Any] | None = None  # the parallel optimizer's shards
    recompute: dict[str, Any] | None = None  # recompute: the nodes it copied
    comm_fusion: dict[str, Any] | None = None  # comm_fusion: buckets and counts
    pipeline: dict[str, Any] | None = None  # execute: the pipeline's schedule

    def _section(self, name: str) -> str:
        if name not in _PLAN_SECTIONS:
            raise KeyError(f"plan section {name!r} is not one of {', '.join(_PLAN_SECTIONS)} "
                           "(passes.unit.PlanRecord)")
        return name

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, self._section(name))
        if value is None:
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self, self._section(name), value)

    def __delitem__(self, name: str) -> None:
        self[name]  # noqa: B018  (KeyError when not written)
        setattr(self, name, None)

    def __iter__(self) -> Iterator[str]:
        return (name for name in _PLAN_SECTIONS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_PLAN_SECTIONS = tuple(f.name for f in fields(PlanRecord))


@dataclass(kw_only=True)
class CompileUnit:
    """What the passes read and write."""

    devices: int
    parallel_mode: str
    search_mode: str
    options: CompileOptions = field(default_factory=CompileOptions)
    # the program is a training step: it returns the loss and updates stored values
    training: bool = False
    # the program differentiates (a training step, or a cell returning gradients): the split
    # inserts gradient communication
    backward: bool = False
    graph: Graph | None = None  # the forward graph of record
    # After the split, rank r runs rank_graphs[r]. In SPMD modes every entry is the same
    # rank-parametric graph (what differs between ranks is an `ir.rank` value); hybrid mode
    # traces the model per rank and has one graph per rank.
    rank_graphs: list[Graph] = field(default_factory=list)
    split: bool = False  # True once every rank has its own graph
    plan: PlanRecord = field(default_factory=PlanRecord)  # the plan record (plan.json)
    assignment: ParallelAssignment | None = None
    output_layouts: list[Any] = field(default_factory=list)
    search: SearchResult | None = None  # auto_parallel's decision
    # Pipeline parallelism: stages, micro-batches, the stage of every op; None when neither
    # pipeline_stages > 1 nor nn.PipelineCell is used.
    pipeline: PipelineSettings | None = None
    opt_shard: dict[str, OptShard] = field(default_factory=dict)  # the parallel optimizer's plan
    # parameters whose gradient is reduced over part of their copies after their user's output
    # cotangent is summed (passes/cotangents.py; a byte-size decision the shrunk check pins)
    reduced_parameters: tuple[str, ...] = ()
    # the rank graph's value for each value of the forward graph that a custom bprop reads,
    # by id; None when the graphs are not split
    bprop_locals: dict[int, Any] | None = None
    # after micro_batch (passes/micro_batch.py): the same, once per micro-batch (index k)
    bprop_micro: list[dict[int, Any]] | None = None
    # Each distinct rank graph's nodes before communication fusion (whose buckets depend on
    # byte sizes), kept by comm_fusion: the shrunk check compares a plan's communication by
    # them.
    unfused: list[list[Node]] = field(default_factory=list)
    state_owners: dict[str, str] = field(default_factory=dict)  # optimizer state -> parameter

    @property
    def parallel(self) -> bool:
        return self.parallel_mode != "stand_alone"

    @property
    def stage_devices(self) -> int:
        """Devices of one pipeline stage (all devices without pipeline stages): operator
        strategies, layouts and collectives live inside a stage."""
        stages = self.pipeline.stages if self.pipeline is not None else 1
        return self.devices // stages

    @property
    def pipelined(self) -> bool:
        """Whether the step is cut into pipeline stages (pipeline_stages > 1)."""
        return self.pipeline is not None and self.pipeline.stages > 1

    @property
    def micro_batched(self) -> bool:
        """Whether the local program is repeated per micro-batch (passes/micro_batch.py)."""
        return self.pipeline is not None and self.parallel and (
            self.pipeline.stages > 1 or self.pipeline.micro_size > 1)

    @property
    def graphs(self) -> list[Graph]:
        """The distinct graphs the ranks run (one in SPMD modes), in rank order."""
        out: list[Graph] = []
        seen: set[int] = set()
        for g in self.rank_graphs:
            if id(g) not in seen:
                seen.add(id(g))
                out.append(g)
        return out
