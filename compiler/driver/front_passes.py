"""The front end's passes: the ones that run the user's code.

`trace` runs `model()` (and the loss) on `inputs()` into the forward graph; `UserOptimizer`
is the `optimizer` pass's update (`passes/optimizer.py`): the model file's `optimizer(params)`
traced after the gradients; `train_step` replays a training step cell's construct
on each local graph. They follow the pass contract (`passes.unit.Pass`) on the front end's
`CompileState`; every other pass lives in `passes/` and sees only the `CompileUnit`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pcompile.compiler.config.context import context_override
from pcompile.compiler.driver.compiled import CompileState
from pcompile.compiler.driver.trace_model import TracedModel, check_optimizer, trace_model
from pcompile.compiler.frontend.model_file import ModelFile, call_user, load_model_file
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.compiler.frontend.optimizer_update import tensor_sum, trace_update
from pcompile.compiler.frontend.train_step import ReplayEnv, replay_step
from pcompile.ir.core import Graph, Value
from pcompile.ir.dims import Shrink
from pcompile.ir.errors import PcompileError
from pcompile.passes.optimizer import RankSum, StateSlicer, state_slicer


@dataclass(frozen=True)
class TraceOptions:
    """What the tools ask of the trace: `shrink`, the shrunk check's shrink of the traced
    graph and parameters (tools/shrink.py); `transform`, the oracle's rewrite of a
    single-device reference's forward graph (`ReferenceOptions.transform`); `micro_batches`,
    a single-device `nn.PipelineCell` run one micro-batch after another
    (`ReferenceOptions.micro_batches`, `batch_blocks`)."""

    shrink: Shrink | None = None
    transform: Callable[[Graph], None] | None = None
    micro_batches: bool = False
    batch_blocks: int = 1


class TracePass:
    """Trace `model()` on `inputs()` (and the loss on the labels) into the forward graph."""

    name = "trace"
    appends_only = False

    def __init__(self, options: TraceOptions | None = None) -> None:
        self.options = options or TraceOptions()

    def apply(self, state: CompileState) -> None:
        split = state.devices if state.parallel_mode == "data_parallel" else 1
        if state.parallel_mode == "hybrid_parallel":
            # The model's own code reads get_rank(), at module level too (`cur_rank =
            # get_rank()` after `init()`, as every MindSpore process runs the script as its own
            # rank): run the model file and trace it once per rank. Rank 0's trace is the graph
            # of record; each rank's trace is dumped in its own folder.
            files = [_load_as_rank(state, rank) for rank in range(state.devices)]
            traces = [_trace_as_rank(mf, rank) for rank, mf in enumerate(files)]
            state.model_file, traced = files[0], traces[0]
            state.traces = traces
            state.rank_graphs = [t.graph for t in traces]
            state.split = True
        else:
            from pcompile.compiler.frontend.tracing import recording_cells

            with recording_cells() as cells:
                traced = trace_model(state.model_file, batch_split=split,
                                     micro_batches=state.parallel or self.options.micro_batches)
            _pipeline_trace(state, traced, cells)
        if self.options.shrink is not None:  # the shrunk check's copy (tools/shrink.py)
            from pcompile.compiler.driver.pinned_plan import apply_to_trace

            apply_to_trace(self.options.shrink, traced)
        state.traced = traced
        state.training = traced.mode == "train"
        state.backward = traced.differentiates
        state.graph = traced.graph
        _check_functional_shard(state)
        for name, param in traced.parameters.items():
            state.initial_values[name] = param.source  # abstract: nothing is allocated
        if not state.parallel:
            if self.options.transform is not None:
                self.options.transform(traced.graph)
            state.rank_graphs = [traced.graph]
            state.split = True
            if self.options.micro_batches:
                _micro_batches_in_turn(state, traced, self.options.batch_blocks)


def _micro_batches_in_turn(state: CompileState, traced: TracedModel, blocks: int) -> None:
    """One device runs `nn.PipelineCell`'s micro-batches as MindSpore's PipelineCell does:
    the traced micro-batch once per micro-batch of the whole batch (the graph of record then
    takes the whole batch), the loss their mean, the gradients accumulated over them, and a
    forward `Assign` (BatchNorm's moving statistics) once per micro-batch, in order
    (`passes.micro_batch.replicate`, the local program of every pipeline plan); micro-batch
    k is the k-th part of each of `blocks` blocks of the rows (`ReferenceOptions.batch_blocks`)."""
    from pcompile.compiler.frontend.nn.pipeline import PipelineCell
    from pcompile.passes.micro_batch import replicate

    network = traced.network
    if not isinstance(network, PipelineCell) or network.micro_size == 1:
        return
    graph = replicate(traced.graph, network.micro_size,
                      loss_scope="Default/network-PipelineCell", batch_terms=(),
                      blocks=blocks)
    state.graph = graph
    state.rank_graphs = [graph]


def _pipeline_trace(state: CompileState, traced: TracedModel, cells: dict[str, Any]) -> None:
    """nn.PipelineCell's micro size, and the stage of every op when there are stages."""
    from pcompile.compiler.driver.pipelining import check_interleave, check_micro_split, stage_map
    from pcompile.compiler.frontend.nn.pipeline import PipelineCell
    from pcompile.passes.pipeline_stages import PipelineSettings

    settings = state.pipeline
    if isinstance(traced.network, PipelineCell) and state.parallel:
        if settings is None:
            settings = state.pipeline = PipelineSettings(1, 1, "1f1b")
        settings.micro_size = traced.network.micro_size
    if settings is None:
        return
    check_micro_split(traced.graph, settings.micro_size, state.stage_devices,
                      state.options.dataset_strategy)
    if settings.stages <= 1:
        return
    if traced.step is not None:
        raise PcompileError(
            f"pipeline_stages={settings.stages}: this model file trains through a training "
            f"step cell ({type(traced.network).__name__}: model() returns one, or its network "
            "computes its own loss and the file defines optimizer() without loss()); pipeline "
            "parallelism in this version of pcompile trains nn.PipelineCell(nn.WithLossCell("
            "net, loss_fn), micro_size) returned from model() with optimizer(), or model() + "
            "loss() + optimizer()")
    if traced.mode != "train":
        raise PcompileError(
            f"pipeline_stages={settings.stages}: pipeline parallelism trains (a loss, "
            "gradients, an update per step); this model file compiles inference: return "
            "nn.PipelineCell(nn.WithLossCell(net, loss_fn), micro_size) from model() or define "
            "loss() and optimizer()")
    settings.stage_map = stage_map(traced.graph, cells, traced, settings.stages,
                                   settings.interleave)
    check_interleave(settings)


def _load_as_rank(state: CompileState, rank: int) -> ModelFile:
    """The model file run as rank `rank` (hybrid_parallel): `get_rank()` answers `rank` and
    `get_group_size()` the device count while its module level runs."""
    with context_override(global_rank=rank, device_num=state.devices):
        return load_model_file(state.model_file.path)


def _trace_as_rank(mf: ModelFile, rank: int) -> TracedModel:
    with context_override(global_rank=rank):
        return trace_model(mf)


def _check_functional_shard(state: CompileState) -> None:
    """Functional shard is valid only with auto_parallel + sharding_propagation (the seed)."""
    if not state.parallel or (state.parallel_mode == "auto_parallel"
                              and state.search_mode == "sharding_propagation"):
        return
    assert state.graph is not None
    for node in state.graph.nodes:
        if node.attrs.get("functional_shard"):
            raise PcompileError(
                f"shard() / Cell.shard() (at {node.source or node.scope}) is only supported "
                "with parallel_mode='auto_parallel' and search_mode='sharding_propagation'; "
                f"this compile uses {state.parallel_mode}"
                + (f" with {state.search_mode}" if state.parallel_mode == "auto_parallel"
                   else "")
            )


def bprop_vjps(state: CompileState, traced: TracedModel | None, graph: Graph) -> list[Any]:
    """The cells with their own bprop, on the rank graph `graph`
    (compiler/frontend/custom_bprop.py)."""
    if traced is None or not traced.custom_bprops:
        return []
    from pcompile.compiler.frontend.custom_bprop import custom_vjps

    locals_ = state.bprop_locals
    if locals_ is None:  # not split: the forward graph's own values, where still in it
        live = {id(n.result) for n in graph.nodes} | {id(p) for p in graph.params}
        return custom_vjps(traced.custom_bprops, lambda v: v if id(v) in live else None)
    if state.bprop_micro is not None:
        # nn.PipelineCell's micro-batches: each call's bprop runs once per micro-batch, on
        # that micro-batch's copies (a call whose outputs no micro-batch computes, once)
        out: list[Any] = []
        seen: set[tuple[int, ...]] = set()
        for copies in state.bprop_micro:
            for vjp in custom_vjps(traced.custom_bprops, _finder(copies)):
                key = tuple(id(v) for v in vjp.outputs)
                if key not in seen:
                    seen.add(key)
                    out.append(vjp)
        return out
    return custom_vjps(traced.custom_bprops, lambda v: locals_.get(id(v)))


def _finder(copies: dict[int, Any]) -> Callable[[Value], Value | None]:
    """The lookup of one micro-batch's copies (`CompileUnit.bprop_micro`)."""
    return lambda v: copies.get(id(v))


class UserOptimizer:
    """The front end's half of the `optimizer` pass (`passes.optimizer.UpdateTracer`): calls
    the model file's `optimizer(params)` once (at the first graph, so that its errors come in
    that pass) and traces its update into each graph."""

    def __init__(self, state: CompileState) -> None:
        self.state = state

    def optimizer(self) -> Optimizer:
        state = self.state
        if state.optimizer is None:
            traced, mf = state.traced, state.model_file
            assert traced is not None
            if mf.optimizer is None:
                raise PcompileError(
                    f"model file {mf.path} defines loss() but no optimizer(params); training "
                    "needs both")
            state.optimizer = check_optimizer(
                call_user(mf.optimizer, "optimizer(params)", mf.path,
                          traced.network.trainable_params()), mf.path)
        return state.optimizer

    def __call__(self, graph: Graph, grads: dict[str, Value], slicer: StateSlicer | None,
                 summer: RankSum | None) -> tuple[dict[str, Any], list[tuple[str, Value]]]:
        optimizer = self.optimizer()
        assert self.state.traced is not None
        return trace_update(graph, optimizer, self.state.traced.parameters, grads, slicer,
                            slice_sum=tensor_sum(summer) if summer is not None else None)


class TrainStepPass:
    """A training step cell (`nn.TrainOneStepCell`, ...): its construct replayed on each local
    graph (`compiler.train_step`): backward, gradient processing, optimizer, state updates.
    `custom_bprops`: the cells with their own bprop differentiate by it (False in the
    oracle's single-device reference, which differentiates their construct)."""

    name = "train_step"
    appends_only = False

    def __init__(self, custom_bprops: bool = True) -> None:
        self.custom_bprops = custom_bprops

    def apply(self, state: CompileState) -> None:
        traces: Sequence[TracedModel | None] = state.traces or [state.traced]
        done: set[int] = set()
        for rank, graph in enumerate(state.rank_graphs):
            if id(graph) in done:
                continue
            done.add(id(graph))
            traced = traces[rank] if len(traces) > rank else traces[0]
            assert traced is not None and traced.step is not None
            env = ReplayEnv(
                devices=state.devices,
                layouts=state.assignment.param_layouts if state.assignment is not None else {},
                initial_values=state.initial_values,
                slicer=state_slicer(state, state.initial_values) if state.parallel else None,
                network_params=dict(traced.parameters),
                custom=bprop_vjps(state, traced, graph) if self.custom_bprops else [],
            )
            result = replay_step(traced.step.top, traced.step.captured, graph, env,
                                 state.model_file.path)
            if result.trains != (traced.mode == "train"):
                what = type(traced.step.top).__name__
                raise PcompileError(
                    f"{what} holds an optimizer but its construct never calls it"
                    if traced.mode == "train" else
                    f"{what} updates stored values but holds no optimizer; give it the "
                    "optimizer it applies as an attribute")
            if rank == 0:
                state.output_layouts = list(result.layouts)
