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
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from pcompile.compiler.config.context import (
    AutoParallelContext,
    context_override,
    current_context,
    get_context,
    reset_auto_parallel_context,
    reset_context,
    save_graphs_level,
)
from pcompile.compiler.config.pass_options import cost_constants, fusion_config, search_options
from pcompile.compiler.config.search_context import cost_model_override
from pcompile.compiler.driver.compiled import (
    CompiledProgram,
    CompileState,
    PassDump,
    ReferenceOptions,
)
from pcompile.compiler.driver.front_passes import (
    TraceOptions,
    TracePass,
    TrainStepPass,
    UserOptimizer,
    bprop_vjps,
)
from pcompile.compiler.driver.pinned_plan import PinnedPlan, PinnedSearchPass
from pcompile.compiler.driver.strategy_files import read_checkpoint
from pcompile.compiler.frontend.model_file import load_model_file
from pcompile.compiler.frontend.nn.pipeline import PipelineCell
from pcompile.ir.core import Graph, Node
from pcompile.ir.errors import PcompileError
from pcompile.ir.printer import GraphText
from pcompile.ir.verifier import verify
from pcompile.passes.autodiff import AutodiffOptions, AutodiffPass
from pcompile.passes.comm_fusion import CommFusionPass
from pcompile.passes.execute import ExecutePass
from pcompile.passes.micro_batch import MicroBatchOptions, MicroBatchPass
from pcompile.passes.optimizer import OptimizerOptions, OptimizerPass
from pcompile.passes.pipeline_split import PipelineSplitPass
from pcompile.passes.recompute import RecomputePass, marked
from pcompile.passes.replicated import ReplicatePass
from pcompile.passes.search.auto_parallel_pass import AutoParallelOptions, StepAutoParallelPass
from pcompile.passes.search.time_model import load_profile
from pcompile.passes.step_parallel import SplitPassOptions, StepParallelEndPass
from pcompile.passes.step_parallel_begin import StepParallelBeginPass
from pcompile.passes.unit import (
    CompileOptions,
    OptimizerShardOptions,
    ParameterFacts,
    Pass,
    StrategyFiles,
)


def pipeline(state: CompileState) -> list[Pass[CompileState]]:
    """The passes after the trace (which decides whether the program trains, and how), each
    given its options as typed data read here from the front end's state."""
    passes: list[Pass[CompileState]] = []
    traced = state.traced
    assert traced is not None
    parameters = {name: ParameterFacts(p.comm_fusion, p.layerwise_parallel,
                                       p.parallel_optimizer)
                  for name, p in traced.parameters.items()}
    if state.parallel_mode in ("data_parallel", "hybrid_parallel"):
        passes.append(ReplicatePass(parameters))
    elif state.parallel:
        if state.parallel_mode == "auto_parallel" and state.shrink is not None:
            passes.append(PinnedSearchPass(state.shrink))  # the shrunk check's plan
        elif state.parallel_mode == "auto_parallel":  # search
            passes.append(StepAutoParallelPass(AutoParallelOptions(search_options(),
                                                                   cost_constants())))
        passes += [StepParallelBeginPass(), StepParallelEndPass(SplitPassOptions(
            parameters,
            seeded_loss=state.training and traced.step is None,  # autodiff seeds output 0
            bprop_values=tuple(v for call in traced.custom_bprops
                               for v in (*call.inputs, *call.outputs) if v is not None),
            pinned_reductions=(state.shrink.reduced_parameters if state.shrink is not None
                               else None)))]
        if state.micro_batched:
            passes.append(MicroBatchPass(MicroBatchOptions(
                loss_scope=("Default/network-PipelineCell"
                            if isinstance(traced.network, PipelineCell) else "Default"),
                shard_accumulation=state.options.optimizer_shard.enabled
                and state.options.optimizer_shard.gradient_accumulation_shard)))
    # the ilp search may choose recompute after this list is made: its pass then runs too
    ilp = state.parallel_mode == "auto_parallel" and state.search_mode == "ilp"
    recompute = [RecomputePass()] if state.backward and state.graph is not None and \
        (marked(state.graph) or ilp) else []
    if traced.step is not None:
        passes += [TrainStepPass(custom_bprops=state.reference is None), *recompute]
    elif state.training:
        custom = None
        if traced.custom_bprops and state.reference is None:
            def custom(graph: Graph) -> list[Any]:
                return bprop_vjps(state, traced, graph)
        scales = state.reference.gradient_scales if state.reference is not None else {}
        passes += [AutodiffPass(AutodiffOptions(custom, scales)), *recompute,
                   OptimizerPass(OptimizerOptions(UserOptimizer(state), state.initial_values))]
        if state.pipelined:
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


def compile_program(
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
    shrink: PinnedPlan | None = None,
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
    # the command line's --device-profile / --device-memory win over the model file's, for
    # this compile only
    cost_model = {k: flags.pop(k) for k in ("device_profile", "device_memory_capacity")
                  if k in flags}
    with cost_model_override(**cost_model):
        return _compile(mf, flags, devices, parallel_mode, search_mode, out_dir, dump,
                        overrides, dump_ranks, on_event, save_graphs, reference, shrink,
                        trace_only)


def _compile(mf: Any, flags: dict[str, Any], devices: int | None, parallel_mode: str | None,
             search_mode: str | None, out_dir: str | None, dump: bool,
             overrides: dict[str, Any] | None, dump_ranks: Any,
             on_event: Callable[..., None] | None, save_graphs: int | None,
             reference: ReferenceOptions | None, shrink: PinnedPlan | None,
             trace_only: bool
             ) -> CompiledProgram:
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
        from pcompile.compiler.driver.pipelining import settings_from_context

        settings = settings_from_context(ctx, devices, mode)
        state = CompileState(model_file=mf, devices=devices, parallel_mode=mode,
                             search_mode=str(ctx.search_mode), training=mf.training,
                             options=compile_options(ctx, save_graphs_level(save_graphs)))
        if settings.stages > 1:
            state.pipeline = settings
        state.reference = reference
        state.shrink = shrink
        opt_sharded = shrink.opt_sharded if shrink is not None else None
        if opt_sharded is not None:  # the parallel optimizer shards what the plan sharded
            state.options = replace(state.options, optimizer_shard=replace(
                state.options.optimizer_shard, pinned=opt_sharded))
        state.trace_only = trace_only
        state.overrides = dict(overrides or {})
        if out_dir is None:
            out_dir = str(get_context("save_graphs_path") or "") or "./saved_graph"
        return _run_pipeline(state, out_dir if dump else None, dump_ranks, on_event)


def compile_options(ctx: AutoParallelContext, save_graphs: int) -> CompileOptions:
    """The options the passes read, from the auto-parallel context, the dump level and the
    environment switches MindSpore and the test suite use."""
    ckpt = ctx.strategy_ckpt_config
    opt = ctx.parallel_optimizer_config
    search = search_options()
    return CompileOptions(
        dataset_strategy=ctx.dataset_strategy,
        gradients_mean=bool(ctx.gradients_mean),
        loss_repeated_mean=bool(ctx.loss_repeated_mean),
        enable_alltoall=bool(ctx.enable_alltoall),
        gradient_fp32_sync=bool(ctx.gradient_fp32_sync),
        parameter_broadcast=bool(ctx.parameter_broadcast),
        optimizer_shard=OptimizerShardOptions(
            enabled=bool(ctx.enable_parallel_optimizer),
            threshold_kb=int(opt.parallel_optimizer_threshold),
            shard_size=int(opt.optimizer_weight_shard_size),
            gradient_accumulation_shard=bool(opt.gradient_accumulation_shard)),
        strategy_files=StrategyFiles(
            str(ckpt.load_file or ""), str(ckpt.save_file or ""),
            bool(ckpt.only_trainable_params),
            aggregated_save=bool(ctx.optimizer_weight_shard_aggregated_save),
            loaded=read_checkpoint(ckpt.load_file) if ckpt.load_file else None),
        global_rank=int(ctx.global_rank),
        # MindSpore's switch for the parallel detail in dumps (reference §5.2)
        parallel_detail=os.environ.get("MS_DEV_DUMP_IR_PARALLEL_DETAIL") == "1",
        save_graphs=save_graphs,
        verify_each=bool(os.environ.get("PCOMPILE_VERIFY_EACH")),
        device_profile=load_profile(search.device_profile),  # the passes read no file
        device_memory=search.device_memory,
    )


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
    shrink, reference = state.shrink, state.reference  # the tools' shrunk check and oracle
    passes: list[Pass[CompileState]] = [TracePass(TraceOptions(
        shrink.shrink if shrink is not None else None,
        reference.transform if reference is not None else None,
        reference is not None and reference.micro_batches,
        reference.batch_blocks if reference is not None else 1))]
    timings: list[tuple[str, float]] = []
    dumps: list[PassDump] = []
    ranks = resolve_dump_ranks(dump_ranks, state.devices)
    state.dump_ranks = ranks
    templates: dict[int, GraphText] = {}  # the last text of each graph, by id
    # The traced graph and the final one are always verified; between passes only where asked
    # (the test suite sets it), since verifying every pass costs as much as a pass.
    verify_each = state.options.verify_each
    verified = False
    index = -1
    while index + 1 < len(passes):
        index += 1
        p = passes[index]
        start = time.perf_counter()
        try:
            before = {id(g): list(g.nodes) for g in (state.graphs if state.split
                                                      else [state.graph]) if g is not None}
            p.apply(state)
            graphs = state.graphs if state.split else [state.graph]
            if index == 0 or index + 1 == len(passes) or verify_each:
                for g in graphs:  # one rank-parametric graph, or hybrid mode's per-rank graphs
                    assert g is not None
                    verify(g, allow_extra_attrs=True,
                           start=_unchanged_prefix(before.get(id(g)), g)
                           if p.appends_only and verified else 0)
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
        if out_dir is not None and p.name in DUMP_LEVELS[state.options.save_graphs]:
            texts = _rank_texts(state, ranks, templates,
                                reuse=p.appends_only)
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

