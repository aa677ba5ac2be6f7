"""The staged driver: model file -> ordered passes -> a `CompiledProgram`.

Each pass has a name and one `apply(state)`. The driver runs them in order, verifies the graph
after each, times it, and prints the dump of each as the text of `<out>/rank_<r>/<NN>_<pass>.ir`.
A failure names the failing pass and the passes before it. The driver writes nothing and runs
nothing: `pcompile.tools.compile` writes the dumps, `plan.json` and the rank programs (into a
temporary folder moved into place only when every pass succeeded, so a failed compile leaves
`--out` as it was), and `pcompile.tools` runs and checks programs on the backends.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from pcompile.compiler.compiled import (
    CompiledProgram,
    CompileState,
    PassDump,
    ReferenceOptions,
)
from pcompile.compiler.context import (
    context_override,
    current_context,
    get_context,
    reset_auto_parallel_context,
    reset_context,
    save_graphs_level,
)
from pcompile.compiler.model_file import ModelFile, call_user, load_model_file
from pcompile.compiler.optimizer_update import StateSlicer, append_optimizer, rank_sum
from pcompile.compiler.pass_options import cost_constants, fusion_config, search_options
from pcompile.compiler.trace_model import TracedModel, check_optimizer, trace_model
from pcompile.compiler.train_step import ReplayEnv, replay_step
from pcompile.ir.core import Graph, Node, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout, group_name
from pcompile.ir.printer import GraphText
from pcompile.ir.verifier import verify
from pcompile.passes.autodiff import append_gradients
from pcompile.passes.comm_fusion import CommFusionPass
from pcompile.passes.cotangents import plan_cotangent_reductions
from pcompile.passes.optimizer_shard import plan_optimizer_sharding
from pcompile.passes.recompute import apply_recompute, marked
from pcompile.passes.replicated import (
    build_replicated_graphs,
    data_parallel_feed_layouts,
    replicated_assignment,
)

# --- search: auto_parallel strategy search ----------------------------------------------------
from pcompile.passes.search.auto_parallel_pass import (
    StepAutoParallelPass,
    finish_assignment,
    searched_strategies,
)
from pcompile.passes.step_parallel import SplitOptions, build_spmd_graph
from pcompile.passes.step_parallel_begin import (
    annotate_parallel_detail,
    assign,
)

# --- end search ----------------------------------------------------------------------------------




class Pass(Protocol):
    name: str

    def apply(self, state: CompileState) -> None: ...


class TracePass:
    """Trace `model()` on `inputs()` (and the loss on the labels) into the forward graph."""

    name = "trace"

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
            from pcompile.compiler.tracing import recording_cells

            with recording_cells() as cells:
                traced = trace_model(state.model_file, batch_split=split,
                                     micro_batches=state.parallel)
            _pipeline_trace(state, traced, cells)
        if state.shrink is not None:  # the shrunk check's copy (tools/shrink.py)
            from pcompile.compiler.pinned_plan import apply_to_trace

            apply_to_trace(state.shrink.shrink, traced)
        state.traced = traced
        state.graph = traced.graph
        _check_functional_shard(state)
        for name, param in traced.parameters.items():
            state.initial_values[name] = param.source  # abstract: nothing is allocated
        if not state.parallel:
            if state.reference is not None and state.reference.transform is not None:
                state.reference.transform(traced.graph)
            state.rank_graphs = [traced.graph]
            state.split = True


def _pipeline_trace(state: CompileState, traced: TracedModel, cells: dict[str, Any]) -> None:
    """nn.PipelineCell's micro size, and the stage of every op when there are stages."""
    from pcompile.compiler.nn.pipeline import PipelineCell
    from pcompile.compiler.pipelining import (
        PipelineSettings,
        check_interleave,
        check_micro_split,
        stage_map,
    )

    settings = state.pipeline
    if isinstance(traced.network, PipelineCell) and state.parallel:
        if settings is None:
            settings = state.pipeline = PipelineSettings(1, 1, "1f1b")
        settings.micro_size = traced.network.micro_size
    if settings is None:
        return
    check_micro_split(traced.graph, settings.micro_size, state.stage_devices,
                      state.options.get("dataset_strategy"))
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
    recomputed = next((n for n in traced.graph.nodes if n.attrs.get("recompute")), None)
    if recomputed is not None:
        raise PcompileError(
            f"pipeline_stages={settings.stages}: {recomputed.op} "
            f"({recomputed.source or recomputed.scope}) is marked for recomputation; "
            "recompute is not implemented together with pipeline stages in this version of "
            "pcompile; remove recompute() or use pipeline_stages=1")
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


def _custom_vjps(state: CompileState, traced: TracedModel | None, graph: Graph) -> list[Any]:
    """The cells with their own bprop, on the rank graph `graph` (compiler/custom_bprop.py);
    none in the single-device reference of the check, which differentiates their construct."""
    if traced is None or not traced.custom_bprops or state.reference is not None:
        return []
    from pcompile.compiler.custom_bprop import custom_vjps

    locals_ = state.bprop_locals
    if locals_ is None:  # not split: the forward graph's own values, where still in it
        live = {id(n.result) for n in graph.nodes} | {id(p) for p in graph.params}
        return custom_vjps(traced.custom_bprops, lambda v: v if id(v) in live else None)
    return custom_vjps(traced.custom_bprops, lambda v: locals_.get(id(v)))


class AutodiffPass:
    """Reverse-mode autodiff on the IR: append d loss / d w for every trainable weight."""

    name = "autodiff"
    appends_only = True  # existing nodes are left as they are (their dump text is reused)

    def apply(self, state: CompileState) -> None:
        for graph in state.graphs:
            # The objective, seeded with ones (MindSpore's sens); a non-scalar objective comes
            # with its mean, the loss the step reports.
            objective, loss = graph.outputs[0], graph.outputs[-1]
            wrt = [p for p in graph.weights if p.requires_grad]
            if not wrt:
                raise PcompileError("the network has no trainable parameters to train")
            origins: dict[int, Node] | None = {} if state.micro_batched else None
            grads = append_gradients(graph, objective, wrt, origins=origins,
                                     custom=_custom_vjps(state, state.traced, graph))
            if origins is not None:  # backward nodes run in their forward node's stage
                from pcompile.passes.pipeline_split import inherit

                inherit(origins, state.pipeline.local_stage, state.pipeline.labels)
            scales = state.reference.gradient_scales if state.reference else {}
            if scales:
                grads = [_scaled(graph, g, scales.get(p.name, 1.0)) for p, g in zip(wrt, grads)]
            graph.outputs = [loss, *grads]
            graph.attrs["outputs"] = ("loss", *(f"grad.{p.name}" for p in wrt))


def _scaled(graph: Graph, grad: Value, scale: float) -> Value:
    """`grad * scale` appended to `graph` (the reference program's model of a parallel
    program's gradient scaling)."""
    if scale == 1.0:
        return grad
    from pcompile.ir.builder import Builder

    return Builder(graph)("Mul", grad, scale, name_hint="scaled_grad")


class OptimizerPass:
    """Trace `optimizer(params)` after the gradients: the graph becomes one training step."""

    name = "optimizer"
    appends_only = True

    def apply(self, state: CompileState) -> None:
        traced, mf = state.traced, state.model_file
        assert traced is not None
        if mf.optimizer is None:
            raise PcompileError(
                f"model file {mf.path} defines loss() but no optimizer(params); training needs "
                "both"
            )
        opt = check_optimizer(call_user(mf.optimizer, "optimizer(params)", mf.path,
                                        traced.network.trainable_params()), mf.path)
        state.optimizer = opt
        for graph in state.graphs:
            names = graph.attrs["outputs"]
            loss: Value = graph.outputs[0]
            grads = {n[len("grad."):]: v for n, v in zip(names[1:], graph.outputs[1:])}
            slicer = _state_slicer(state) if state.parallel else None
            summer = (rank_sum(graph, state.devices, state.assignment.param_layouts)
                      if state.parallel and state.assignment is not None else None)
            init = append_optimizer(graph, opt, traced.parameters, grads, loss, slicer, summer)
            if not state.parallel:
                state.initial_values.update(init)


def _state_slicer(state: CompileState) -> StateSlicer:
    """Optimizer state in a local graph: a per-parameter state takes its parameter's layout
    (its local shape is the parameter's slice shape); the global value is kept, abstract, and
    each rank's slice is made from it when needed."""
    assert state.assignment is not None
    layouts = state.assignment.param_layouts

    def cut(name: str, owner: str, value: Any,
            dims: tuple[int | None, ...] | None = None) -> tuple[int, ...]:
        state.initial_values.setdefault(name, value)
        if not owner:
            return tuple(value.shape)
        state.state_owners[name] = owner
        if dims is None:
            layouts.setdefault(name, layouts[owner])
            return layouts[owner].slice_shape
        # a factored state (AdaFactor's row / column statistics): each of its dims is split as
        # the parameter dim it follows (None: not split)
        owner_layout = layouts[owner]
        layout = TensorLayout(owner_layout.dev_matrix,
                              tuple(-1 if d is None else owner_layout.tensor_map[d]
                                    for d in dims), tuple(value.shape))
        layouts.setdefault(name, layout)
        return layouts[name].slice_shape

    return cut


class TrainStepPass:
    """A training step cell (`nn.TrainOneStepCell`, ...): its construct replayed on each local
    graph (`compiler.train_step`): backward, gradient processing, optimizer, state updates."""

    name = "train_step"

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
                slicer=_state_slicer(state) if state.parallel else None,
                network_params=dict(traced.parameters),
                custom=_custom_vjps(state, traced, graph),
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


class RecomputePass:
    """Recomputed forward values (`recompute: true`) computed again for the backward pass
    (`passes.recompute`)."""

    name = "recompute"

    def apply(self, state: CompileState) -> None:
        copied = sum(apply_recompute(graph) for graph in state.graphs)
        state.plan["recompute"] = {"recomputed_nodes": copied}


class StepParallelBeginPass:
    """Strategies (user, searched, default) and layouts for every forward op."""

    name = "step_parallel_begin"

    def apply(self, state: CompileState) -> None:
        assert state.graph is not None
        opts = state.options
        state.assignment = assign(state.graph, state.stage_devices,
                                  opts.get("dataset_strategy"),
                                  searched=searched_strategies(state))  # search
        finish_assignment(state)  # search: annotations, plan, checkpoint
        if opts.get("parallel_detail"):
            # MindSpore's MS_DEV_DUMP_IR_PARALLEL_DETAIL=1: tensor maps in semi_auto_parallel,
            # layouts under sharding propagation, nothing for the other searches
            if state.parallel_mode == "semi_auto_parallel":
                annotate_parallel_detail(state.graph, state.assignment, "tensor_map")
            elif state.search_mode == "sharding_propagation":
                annotate_parallel_detail(state.graph, state.assignment, "layout")


class PinnedSearchPass:
    """The shrunk check's compile (tools/shrink.py): the plan's searched strategies and
    Reshape layouts, pinned by position, in place of a search."""

    name = "step_auto_parallel_begin"

    def apply(self, state: CompileState) -> None:
        from pcompile.compiler.pinned_plan import pinned_search

        state.search = pinned_search(state)


class StepParallelEndPass:
    """One local forward graph per rank: slices, redistributions, forward communication,
    mirrors (split_ranks)."""

    name = "step_parallel_end"

    def apply(self, state: CompileState) -> None:
        assert state.graph is not None and state.assignment is not None
        traced = state.traced
        assert traced is not None
        opts = state.options
        options = SplitOptions(
            devices=state.stage_devices,
            training=state.backward,
            gradients_mean=bool(opts.get("gradients_mean", False)),
            loss_repeated_mean=bool(opts.get("loss_repeated_mean", True)),
            enable_alltoall=bool(opts.get("enable_alltoall", False)),
            gradient_fp32_sync=bool(opts.get("gradient_fp32_sync", True)),
            seeded_loss=state.training and traced.step is None,  # AutodiffPass seeds output 0
        )
        fusion = {name: p.comm_fusion for name, p in traced.parameters.items()}
        options.opt_shard = _optimizer_sharding(state, state.assignment.param_layouts)
        state.opt_shard = dict(options.opt_shard)
        if options.training:
            pinned = state.shrink.reduced_parameters if state.shrink is not None else None
            options.reductions = plan_cotangent_reductions(
                state.graph, state.assignment, options.opt_shard, forced=pinned)
            state.reduced_parameters = tuple(sorted(options.reductions.param_axes))
        for name, shard in options.opt_shard.items():
            state.assignment.param_layouts[name] = shard.stored
        watch: dict[int, Any] = {id(v): None for call in traced.custom_bprops
                                 for v in (*call.inputs, *call.outputs) if v is not None}
        if state.pipelined:  # the stage of every local node (compiler/pipelining.py)
            from pcompile.passes.pipeline_split import build_staged_spmd_graph

            graph, layouts, state.pipeline.local_stage = build_staged_spmd_graph(
                state.graph, state.assignment, options, fusion,
                state.pipeline.stage_map.node_stage, watch)
        else:
            graph, layouts = build_spmd_graph(state.graph, state.assignment, options, fusion,
                                              watch)
        state.bprop_locals = watch
        state.rank_graphs = [graph] * state.devices
        state.output_layouts = layouts
        state.split = True


class ExecutePass:
    """The graph every rank executes (stand-alone: the one global graph), dumped under
    MindSpore's name `execute`. It runs nothing (running is above the backends: tools/ and the
    rank programs); it fixes what the program executes: a pipeline's schedule of its final
    stage graphs."""

    name = "execute"
    appends_only = True  # changes nothing

    def apply(self, state: CompileState) -> None:
        assert state.rank_graphs, "execute needs the per-rank graphs"
        if state.pipelined:  # the schedule of the final stage graphs
            state.pipeline.program.finish()
            state.plan["pipeline"] = state.pipeline.program.describe()




class ReplicatePass:
    """data_parallel / hybrid_parallel: every rank runs the whole graph (hybrid: traced once
    per rank, so `get_rank()` in the model sees each rank), with gradient mirrors over all
    ranks for parameters not marked `layerwise_parallel`."""

    name = "split_ranks"

    def apply(self, state: CompileState) -> None:
        assert state.graph is not None and state.traced is not None
        traced = state.traced
        if state.parallel_mode == "hybrid_parallel":
            graphs = list(state.rank_graphs)  # traced per rank by TracePass
        else:
            graphs = [state.graph] * state.devices
        opts = state.options
        options = SplitOptions(state.devices, state.backward,
                               gradients_mean=bool(opts.get("gradients_mean", False)))
        fusion = {name: p.comm_fusion for name, p in traced.parameters.items()}
        layerwise = {name for name, p in traced.parameters.items() if p.layerwise_parallel}
        assignment = replicated_assignment(state.graph, state.devices)
        options.opt_shard = _optimizer_sharding(state, assignment.param_layouts)
        state.opt_shard = dict(options.opt_shard)
        state.rank_graphs = build_replicated_graphs(graphs, options, fusion, layerwise)
        for name, shard in options.opt_shard.items():
            assignment.param_layouts[name] = shard.stored
        if state.parallel_mode == "data_parallel":
            assignment.param_layouts.update(
                data_parallel_feed_layouts(state.graph, state.devices))
        state.assignment = assignment
        state.output_layouts = [None] * len(state.graph.outputs)
        state.split = True


def _optimizer_sharding(state: CompileState, layouts: dict[str, Any]) -> dict[str, Any]:
    """The parallel optimizer's plan, when `enable_parallel_optimizer` is set for training."""
    opts = state.options
    if not (state.training and opts.get("enable_parallel_optimizer")):
        return {}
    assert state.graph is not None and state.traced is not None
    config = opts.get("parallel_optimizer_config")
    threshold = int(getattr(config, "parallel_optimizer_threshold", 64))
    size = int(getattr(config, "optimizer_weight_shard_size", -1))
    plan = plan_optimizer_sharding(state.graph, layouts, dict(state.traced.parameters),
                                   threshold, size)
    state.plan["parallel_optimizer"] = {
        name: {"stored_dev_matrix": list(s.stored.dev_matrix),
               "stored_tensor_map": [list(e) if isinstance(e, tuple) else e
                                     for e in s.stored.tensor_map],
               "stored_slice_shape": list(s.stored.slice_shape),
               "opt_shard_group": group_name(s.shard_group(0), state.devices)}
        for name, s in plan.items()
    }
    return plan


def pipeline(state: CompileState) -> list[Pass]:
    """The passes after the trace (which decides whether the program trains, and how)."""
    passes: list[Pass] = []
    if state.parallel_mode in ("data_parallel", "hybrid_parallel"):
        passes.append(ReplicatePass())
    elif state.parallel:
        if state.parallel_mode == "auto_parallel" and state.shrink is not None:
            passes.append(PinnedSearchPass())  # the shrunk check: the plan's strategies
        elif state.parallel_mode == "auto_parallel":  # search
            passes.append(StepAutoParallelPass(search_options(), cost_constants()))
        passes += [StepParallelBeginPass(), StepParallelEndPass()]
        if state.micro_batched:
            from pcompile.compiler.pipelining import MicroBatchPass

            passes.append(MicroBatchPass())
    traced = state.traced
    recompute = [RecomputePass()] if state.backward and state.graph is not None and \
        marked(state.graph) else []
    if traced is not None and traced.step is not None:
        passes += [TrainStepPass(), *recompute]
    elif state.training:
        passes += [AutodiffPass(), *recompute, OptimizerPass()]
        if state.pipelined:
            from pcompile.compiler.pipelining import PipelineSplitPass

            passes.append(PipelineSplitPass())
    if state.backward and state.parallel:
        passes.append(CommFusionPass(fusion_config()))
    passes.append(ExecutePass())
    return passes


IMPLEMENTED_MODES = ("stand_alone", "semi_auto_parallel", "data_parallel", "hybrid_parallel",
                     "auto_parallel")  # auto_parallel: the three searches


def _check_mode(devices: int, parallel_mode: str, search_mode: str) -> None:
    if parallel_mode == "stand_alone" and devices > 1:
        raise PcompileError(
            f"parallel_mode 'stand_alone' runs on one device, but {devices} devices were asked "
            "for; choose a parallel mode (--parallel-mode or --search) or --devices 1"
        )
    if parallel_mode not in IMPLEMENTED_MODES:
        what = f"{parallel_mode!r}" + (f" with search {search_mode!r}"
                                       if parallel_mode == "auto_parallel" else "")
        raise PcompileError(
            f"parallel_mode {what} on {devices} devices is not implemented yet in this version "
            f"of pcompile; available: {', '.join(IMPLEMENTED_MODES)} "
            "(e.g. --parallel-mode semi_auto_parallel)"
        )


def compile(  # noqa: A001  (the public name DESIGN.md gives it)
    model_path: str,
    *,
    devices: int | None = None,
    parallel_mode: str | None = None,
    search_mode: str | None = None,
    out_dir: str | None = None,
    dump: bool = True,
    overrides: dict[str, Any] | None = None,
    dump_ranks: Any = None,
    on_event: Callable[..., None] | None = None,
    save_graphs: int | None = None,
    reference: ReferenceOptions | None = None,
    shrink: Any = None,
    trace_only: bool = False,
) -> CompiledProgram:
    """Compile a model file. Flags given here override what the model file sets.
    `reference`: for a single-device compile, how it models a parallel program's options (the
    oracle's reference program; see `ReferenceOptions`).

    `dump_ranks`: the ranks whose folders are written ("all", "none", "0,5", a list of ints;
    default: every rank up to `DUMP_ALL_UP_TO` devices, else rank 0). `out_dir`: the folder the
    outputs are for (default: the model file's `save_graphs_path`, else ./saved_graph), kept in
    the program as `out_dir` (None without `dump`); nothing is written here
    (`pcompile.tools.compile.compile` compiles and writes). `on_event(event, **info)` hears of
    the compile's progress: "pass" (name, index, total, seconds) after each pass.
    `save_graphs` (0-3, MindSpore's levels, DUMP_LEVELS: which passes are dumped) overrides the
    model file's `set_context(save_graphs=...)`; neither given: every pass. `shrink`: the
    shrunk check's copy (`compiler.pinned_plan.PinnedPlan`: the trace shrunk, strategies pinned).
    `trace_only`: stop after the trace (the program's graph is the forward graph; no dumps)."""
    reset_auto_parallel_context()
    reset_context()  # a model file's set_context does not leak into the next compile
    mf = load_model_file(model_path)
    flags: dict[str, Any] = dict(overrides or {})
    if devices is not None:
        flags["device_num"] = devices
    if search_mode is not None:
        flags["search_mode"] = search_mode
        if parallel_mode is None:
            parallel_mode = "auto_parallel"
        elif parallel_mode != "auto_parallel":
            raise PcompileError(
                f"--search {search_mode} chooses strategies in auto_parallel mode, but "
                f"--parallel-mode {parallel_mode} was given; drop one of them"
            )
    if parallel_mode is not None:
        flags["parallel_mode"] = parallel_mode
    with context_override(**flags):
        ctx = current_context()
        devices = int(ctx.device_num)
        mode = str(ctx.parallel_mode)
        if devices == 1 and mode != "stand_alone":
            mode = "stand_alone"  # one device: every mode is stand-alone
        _check_mode(devices, mode, str(ctx.search_mode))
        from pcompile.compiler.pipelining import settings_from_context

        settings = settings_from_context(ctx, devices, mode)
        state = CompileState(mf, devices, mode, str(ctx.search_mode))
        if settings.stages > 1:
            state.pipeline = settings
        state.reference = reference
        state.shrink = shrink
        state.trace_only = trace_only
        state.overrides = dict(overrides or {})
        state.options = {
            "dataset_strategy": ctx.dataset_strategy,
            "gradients_mean": ctx.gradients_mean,
            "loss_repeated_mean": ctx.loss_repeated_mean,
            "enable_alltoall": ctx.enable_alltoall,
            "strategy_ckpt_config": ctx.strategy_ckpt_config,  # search
            "gradient_fp32_sync": ctx.gradient_fp32_sync,
            "parameter_broadcast": ctx.parameter_broadcast,
            "enable_parallel_optimizer": ctx.enable_parallel_optimizer,
            "parallel_optimizer_config": ctx.parallel_optimizer_config,
            "global_rank": ctx.global_rank,
            # MindSpore's switch for the parallel detail in dumps (reference §5.2)
            "parallel_detail": os.environ.get("MS_DEV_DUMP_IR_PARALLEL_DETAIL") == "1",
        }
        state.options["save_graphs"] = save_graphs_level(save_graphs)
        if out_dir is None:
            out_dir = str(get_context("save_graphs_path") or "") or "./saved_graph"
        return _run_pipeline(state, out_dir if dump else None, dump_ranks, on_event)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration. A compile allocates millions of
    small objects that all stay alive until it ends (the graphs, their texts); each automatic
    collection scans them again, which cost 40% of a 96-layer compile. The IR makes almost no
    cyclic garbage (measured: the peak RSS is the same without the collector)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _run_pipeline(state: CompileState, out_dir: str | None, dump_ranks: Any = None,
                  on_event: Callable[..., None] | None = None) -> CompiledProgram:
    with gc_paused():
        return _run_passes(state, out_dir, dump_ranks, on_event)


def _run_passes(state: CompileState, out_dir: str | None, dump_ranks: Any,
                on_event: Callable[..., None] | None) -> CompiledProgram:
    notify = on_event or (lambda event, **info: None)
    passes: list[Pass] = [TracePass()]
    timings: list[tuple[str, float]] = []
    dumps: list[PassDump] = []
    ranks = resolve_dump_ranks(dump_ranks, state.devices)
    state.dump_ranks = ranks
    templates: dict[int, GraphText] = {}  # the last text of each graph, by id
    # The traced graph and the final one are always verified; between passes only where asked
    # (the test suite sets it), since verifying every pass costs as much as a pass.
    verify_each = bool(os.environ.get("PCOMPILE_VERIFY_EACH"))
    verified = False
    index = -1
    while index + 1 < len(passes):
        index += 1
        p = passes[index]
        start = time.perf_counter()
        try:
            before = {id(g): list(g.nodes) for g in (state.graphs if state.split
                                                      else [state.graph]) if g is not None}
            if p.name == CommFusionPass.name:
                state.unfused = [list(g.nodes) for g in state.graphs]
            p.apply(state)
            graphs = state.graphs if state.split else [state.graph]
            if index == 0 or index + 1 == len(passes) or verify_each:
                for g in graphs:  # one rank-parametric graph, or hybrid mode's per-rank graphs
                    assert g is not None
                    verify(g, allow_extra_attrs=True,
                           start=_unchanged_prefix(before.get(id(g)), g)
                           if getattr(p, "appends_only", False) and verified else 0)
                verified = True
            else:
                verified = False
        except PcompileError as exc:
            if index == 0:
                raise
            done = ", ".join(q.name for q in passes[:index])
            exc.args = (f"{exc}\n(in pass '{p.name}', after: {done})",)
            raise
        timings.append((p.name, time.perf_counter() - start))
        notify("pass", name=p.name, index=index, total=len(passes), seconds=timings[-1][1])
        if out_dir is not None and p.name in DUMP_LEVELS[state.options.get("save_graphs", 2)]:
            texts = _rank_texts(state, ranks, templates,
                                reuse=getattr(p, "appends_only", False))
            dumps.append(PassDump(f"{index:02d}_{p.name}.ir", texts))
        else:
            templates.clear()  # a pass not dumped may change nodes: print afresh next time
        if index == 0 and not state.trace_only:
            passes += pipeline(state)
    return CompiledProgram(state, timings, out_dir, dumps)


def _unchanged_prefix(before: list[Node] | None, graph: Graph) -> int:
    """How many of `graph`'s first nodes are the nodes it had before a pass that only appends
    (those were verified after the previous pass)."""
    if before is None:
        return 0
    count = 0
    for old, new in zip(before, graph.nodes):
        if old is not new:
            break
        count += 1
    return count


def resolve_dump_ranks(value: Any, devices: int) -> list[int]:
    """`--dump-ranks`: "all", "none", a list like "0,5" (or a sequence of ints); None: every
    rank up to DUMP_ALL_UP_TO devices, else rank 0."""
    if value is None:
        return list(range(devices)) if devices <= DUMP_ALL_UP_TO else [0]
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return list(range(devices))
        if text == "none":
            return []
        try:
            value = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise PcompileError(
                f"--dump-ranks {value!r}: expected 'all', 'none' or ranks like '0,5'"
            ) from None
    ranks = sorted({int(r) for r in value})
    bad = [r for r in ranks if not 0 <= r < devices]
    if bad:
        raise PcompileError(
            f"--dump-ranks names rank(s) {bad}, but the program has ranks 0..{devices - 1}"
        )
    return ranks


#: `save_graphs` level -> the passes whose `.ir` files are written (MindSpore: 1 introductory,
#: 2 more passes, 3 also `.dot` files; 0 none). plan.json and the rank programs are always written.
_INTRODUCTORY = frozenset({"trace", "step_parallel_begin", "step_parallel_end", "split_ranks",
                           "execute"})


class _Every(frozenset):  # type: ignore[type-arg]
    def __contains__(self, name: object) -> bool:
        return True


DUMP_LEVELS: dict[int, frozenset[str]] = {0: frozenset(), 1: _INTRODUCTORY, 2: _Every(),
                                          3: _Every()}

#: Up to this many devices every rank's folder is dumped by default (the seeds' experience).
DUMP_ALL_UP_TO = 8


def _rank_texts(state: CompileState, ranks: list[int], templates: dict[int, GraphText],
                reuse: bool = False) -> dict[int, str]:
    """This pass's dump for each dumped rank, printed now (later passes change the graph).
    A rank-parametric graph is printed once; only its rank-dependent nodes per rank.
    `templates` holds the previous pass's text of each graph; with `reuse` (this pass only
    appended to the graph) its unchanged nodes are not printed again. It is updated with this
    pass's texts."""
    texts: dict[int, str] = {}
    fresh: dict[int, GraphText] = {}
    for r in ranks:
        graph = state.rank_graphs[r] if state.split else state.graph
        assert graph is not None
        template = fresh.get(id(graph))
        if template is None:
            previous = templates.get(id(graph)) if reuse else None
            template = fresh[id(graph)] = GraphText(graph, previous)
        texts[r] = template.render(r)
    templates.clear()
    templates.update(fresh)
    return texts

