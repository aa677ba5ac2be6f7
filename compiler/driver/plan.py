"""`plan.json`: the compile's decisions as a validated contract (pydantic models).

The driver builds a `Plan` from the compile state (`build_plan`) and writes it with
`write_plan`, which validates it first; readers (`pcompile show`, the launcher, `pcompile-merge`)
load it with `read_plan`, which refuses a file that does not match the schema with ONE message
naming each wrong field. `SCHEMA_VERSION` changes whenever a field changes meaning or is
removed; a reader refuses other versions. The JSON Schema is exported to
`docs/plan.schema.json` by `python -m pcompile.compiler.driver.plan --schema` (a test checks that
the file in docs/ equals the generated one); docs/plan-json.md explains the fields.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pcompile.ir.errors import PcompileError

#: Version of the plan.json format written by this pcompile.
SCHEMA_VERSION: Final = 1

PARALLEL_MODES = ("stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel",
                  "auto_parallel")
SEARCH_MODES = (
    "sharding_propagation", "dynamic_programming", "recursive_programming", "ilp")

Dim = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]
Rank = Annotated[int, Field(ge=0)]
#: One tensor-map entry: a device-matrix axis (counted from the right, -1: not split), or
#: several axes for a dimension split over more than one (Layout's ("dp", "mp")).
MapEntry = int | list[int]


class PlanError(PcompileError):
    """plan.json is missing, unreadable or does not match the schema."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class PlanInput(_Strict):
    """One graph input (global shape)."""

    name: str = Field(description="the input's name (from construct()'s argument, or `label`)")
    shape: list[Dim] = Field(description="global shape (the whole batch)")
    dtype: str = Field(description="element type as the dumps print it (`Float32`, `Int32`)")


class PlanLayout(_Strict):
    """How one tensor of an op is laid out (MindSpore's TensorLayout)."""

    shape: list[Dim] = Field(description="global shape")
    dev_matrix: list[Positive] = Field(description="device matrix")
    tensor_map: list[MapEntry] = Field(
        description="per dimension, the device-matrix axis it is split along (counted from the "
                    "right, MindSpore's convention), -1 when not split, a list for several")
    slice_shape: list[Dim] = Field(description="the shape each rank holds")


class PlanOp(_Strict):
    """One op of the forward graph, keyed by its full name `<scope>/<Op>-op<k>`."""

    op: str = Field(description="primitive name (`MatMul`)")
    instance_name: str = Field(description="the Cell attribute holding it (`matmul2`), or ''")
    in_strategy: list[list[Positive]] | None = Field(
        None, description="the effective strategy: per input, the split of each dimension "
                          "(null: the op is not sharded, e.g. stand-alone)")
    dev_matrix: list[Positive] | None = Field(
        None, description="the op's device matrix (null when in_strategy is)")
    in_layouts: list[PlanLayout] | None = Field(
        None, description="each input's layout under the strategy (null when not sharded)")
    out_layouts: list[PlanLayout] | None = Field(
        None, description="each output's layout (null when not sharded)")


class PlanParameter(_Strict):
    """A graph parameter (input, weight or optimizer state) and how it is laid out."""

    kind: Literal["input", "weight", "state"] = Field(
        description="input (fed each step), weight (trained) or state (optimizer state)")
    shape: list[Dim] = Field(description="global shape")
    dtype: str = Field(description="element type (`Float32`)")
    dev_matrix: list[Positive] = Field(description="device matrix of its layout")
    tensor_map: list[MapEntry] = Field(
        description="per dimension, the device-matrix axis it is split along (counted from the "
                    "right, MindSpore's convention), -1 when not split, a list for several")
    slice_shape: list[Dim] = Field(description="the shape each rank holds")

    @model_validator(mode="after")
    def _ranks_agree(self) -> PlanParameter:
        if len(self.tensor_map) != len(self.shape) or len(self.slice_shape) != len(self.shape):
            raise ValueError(f"tensor_map {self.tensor_map} and slice_shape {self.slice_shape} "
                             f"need one entry per dimension of shape {self.shape}")
        return self


class PlanCollective(_Strict):
    """One communication node of a dumped rank's program (its execute dump)."""

    node: str = Field(description="full name of the node (`<scope>/<Op>-op<k>`)")
    op: str = Field(description="AllReduce, AllGather, ReduceScatter, AlltoAll, Broadcast or "
                                "_MirrorOperator (identity when run: its bytes are those of "
                                "the gradient AllReduce its vjp emits, counted there)")
    rank_list: list[Rank] = Field(description="the ranks of its group")
    group: str = Field(description="group name (`4-6301172352641561019`, `nccl_world_group`)")
    bytes: Annotated[int, Field(ge=0)] = Field(
        description="bytes this rank receives per step (passes/comm_info.py; the `bytes` "
                    "annotation of the dump)")
    ring_bytes: Annotated[int, Field(ge=0)] | None = Field(
        None, description="bytes this rank sends per step when the collective runs with ring "
                          "algorithms (AllReduce 2(n-1)/n S, AllGather (n-1) S, ReduceScatter "
                          "and AlltoAll (n-1)/n S, S its operand on one rank; "
                          "passes/comm_info.py); null in a plan.json written before the field "
                          "existed")
    phase: Literal["forward", "backward", "optimizer"] = Field(
        description="which part of the step runs it")
    reason: str = Field(description="why it exists (the `reason` annotation of the dump)")


class RunnerUp(BaseModel):
    """The best other candidate, under the comparison the search made: dynamic programming's
    `local_objective`, or sharding propagation's `communication`, `computation` and
    `forward` (MindSpore's CompareSwcCost terms)."""

    model_config = ConfigDict(extra="allow")

    strategy: list[list[Positive]] = Field(description="the second-best strategy")
    local_objective: float | None = Field(
        None, description="its objective with neighbours fixed (dynamic programming)")
    communication: float | None = Field(
        None, description="redistribution communication to the deciding neighbours (sharding "
                          "propagation)")
    computation: float | None = Field(
        None, description="redistribution computation to the deciding neighbours")
    forward: float | None = Field(None, description="the op's own forward communication")


class Decision(BaseModel):
    """Sharding propagation: the edges that decided the op and the chosen strategy's terms."""

    model_config = ConfigDict(extra="allow")

    edges: str = Field(description="the neighbours decided before the op")
    communication: float | None = Field(None, description="redistribution communication")
    computation: float | None = Field(None, description="redistribution computation")
    forward: float | None = Field(None, description="the op's own forward communication")


class SearchedOp(BaseModel):
    """What the search chose for one op and why (further cost terms may follow)."""

    model_config = ConfigDict(extra="allow")

    instance_name: str = Field(description="the op's instance name")
    strategy: list[list[Positive]] = Field(description="the chosen strategy")
    cost: dict[str, float | None] = Field(default_factory=dict,
                                          description="the op's own cost terms")
    redistribution: dict[str, float | None] = Field(
        default_factory=dict, description="cost terms of the redistributions on its edges")
    local_objective: float | None = Field(None, description="objective with neighbours fixed")
    candidates: int | None = Field(None, description="how many strategies were considered")
    runner_up: RunnerUp | None = Field(None, description="the best other candidate")
    decision: Decision | None = Field(None, description="what decided it (propagation)")
    decided_by: str | None = Field(None, description="which search (or checkpoint) decided it")
    via: str | None = Field(None, description="how propagation reached it")


class SearchInfo(BaseModel):
    """The strategy search (auto_parallel only)."""

    model_config = ConfigDict(extra="allow")

    mode: str = Field(description="the search algorithm")
    objective: float | None = Field(None, description="total objective of the plan")
    searched_ops: int = Field(0, description="ops whose strategy the search chose")
    ops: dict[str, SearchedOp] = Field(default_factory=dict,
                                       description="per searched op (full name)")


class PredictedMemory(_Strict):
    weights: int = Field(description="bytes of parameter slices per rank")
    gradients: int = Field(description="bytes of gradients per rank")
    optimizer: int = Field(description="bytes of optimizer states per rank")
    activations: int = Field(description="bytes of activations the backward reads, per rank")
    total: int = Field(description="the sum")


class PredictedStage(_Strict):
    compute: float = Field(description="seconds of computation of the stage's ops per step")
    communication: float = Field(description="seconds of its collectives, redistributions "
                                 "and transfers to other stages per step")
    held_micro_batches: float | None = Field(
        description="micro-batches whose activations it holds at its peak (one chunk's each)")
    memory: PredictedMemory = Field(description="memory per rank of the stage by kind")


class PredictedStages(_Strict):
    """Micro-batches (and pipeline stages): each stage's seconds per step; the step is the
    slowest stage's."""

    micro_batches: int | None = Field(description="micro-batches per step (m)")
    bubble: float | None = Field(description="the idle share of the ticks, (S - 1) / (m v + S - 1)")
    per_stage: list[PredictedStage] = Field(description="each stage's seconds and memory")


class Prediction(_Strict):
    """The plan's predictions under the cost model in seconds (docs/search.md)."""

    device_profile: str = Field(description="the device profile the model describes")
    device_memory: int = Field(description="bytes of memory per device")
    step_time: float = Field(description="predicted seconds of one step (compute + comm.)")
    compute: float = Field(description="predicted seconds of computation per step")
    communication: float = Field(description="predicted seconds of communication per step")
    communication_bytes: int = Field(description="bytes a rank moves per step")
    memory: PredictedMemory = Field(description="predicted memory per rank by kind")
    fits: bool = Field(description="whether the memory fits the device's")
    parallel_optimizer: bool = Field(description="the parallel optimizer was assumed on")
    recompute: bool = Field(description="per-layer recompute was assumed")
    advice: str | None = Field(None, description="what would fit, when it does not")
    stages: PredictedStages | None = Field(
        None, description="micro-batches (nn.PipelineCell): each stage's seconds and memory "
        "(the step is the slowest's, the memory the largest's)")


class MegatronScheme(_Strict):
    """The transformer's sizes and Megatron-LM's scheme at the plan's (dp, mp)."""

    layers: int = Field(description="decoder layers")
    hidden: int = Field(description="hidden size")
    kv: int = Field(description="key/value heads x head dim")
    ffn: int = Field(description="feed-forward size")
    vocab: int = Field(description="vocabulary size")
    tokens: int = Field(description="tokens one data-parallel replica trains per step")
    act_bytes: int = Field(description="bytes per activation element")
    dp: int = Field(description="data-parallel width (devices / mp)")
    mp: int = Field(description="model-parallel width (the split of wq's rows)")
    embedding_split: bool = Field(description="embedding split by vocabulary rows")
    head_split: bool = Field(description="LM head split by vocabulary rows")
    seq_parallel: bool = Field(description="sequence parallelism (norms split over tokens)")


class MegatronMinimumInfo(_Strict):
    """A plan's bytes next to the analytic Megatron-LM minimum (passes/search/megatron.py)."""

    rank: int = Field(description="the rank whose collectives are counted")
    ring_bytes: int = Field(description="ring bytes the rank sends per step in this plan")
    scheme: MegatronScheme | None = Field(
        description="Megatron's scheme at the plan's model-parallel width (the split of wq's "
                    "rows) and vocabulary splits; null where that width gives no valid mesh")
    minimum_ring_bytes: int | None = Field(description="ring bytes of `scheme`'s minimum")
    ratio: float | None = Field(description="ring_bytes / minimum_ring_bytes")
    best_scheme: MegatronScheme | None = Field(
        description="the valid (dp, mp) and vocabulary split with the least bytes")
    best_minimum_ring_bytes: int | None = Field(description="ring bytes of `best_scheme`")
    ratio_to_best: float | None = Field(description="ring_bytes / best_minimum_ring_bytes")


class FusionBucketInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: str = Field(description="AllReduce, AllGather or ReduceScatter")
    fusion: int = Field(description="the bucket's fusion id")
    members: list[str] = Field(description="member parameters (or collectives)")
    nbytes: int = Field(description="bytes of the fused buffer")
    fused: str = Field(description="full name of the fused collective ('' when alone)")


class FusionCount(_Strict):
    before: int = Field(description="collectives before fusion")
    after: int = Field(description="collectives after fusion")


class CommFusionInfo(_Strict):
    """Communication fusion (training, parallel modes)."""

    config: dict[str, Any] = Field(description="the fusion configuration used")
    parameter_fusion: dict[str, int] = Field(description="parameter -> fusion id")
    buckets: list[FusionBucketInfo] = Field(description="rank 0's buckets")
    collectives_per_rank: list[FusionCount] = Field(description="per rank, before and after")


class RecomputeInfo(_Strict):
    """Recomputation (`Cell.recompute()`, `Primitive.recompute()`)."""

    recomputed_nodes: int = Field(
        ge=0, description="forward nodes computed again for the backward pass")


class OptimizerShard(_Strict):
    """How the parallel optimizer stores one parameter."""

    stored_dev_matrix: list[Positive]
    stored_tensor_map: list[MapEntry]
    stored_slice_shape: list[Dim]
    opt_shard_group: str


class PipelineUnit(_Strict):
    """One unit of a stage's schedule."""

    tick: Annotated[int, Field(ge=0)] = Field(description="when it runs (units take one tick)")
    unit: str = Field(description="`F<k>`: the forward of micro-batch k, `B<k>`: its backward; "
                                  "interleaved (chunks > 1): `F<k>c<g>`, `B<k>c<g>` on chunk g")


class PipelineStage(_Strict):
    """One pipeline stage: its ranks, parameters, schedule and activation memory."""

    stage: Annotated[int, Field(ge=0)]
    ranks: list[Rank] = Field(description="the ranks that run it: [s*n, (s+1)*n)")
    parameters: list[str] = Field(description="the weights and optimizer states it holds")
    units: list[PipelineUnit] = Field(description="its units in the order it runs them")
    activation_bytes: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="per scheduler (1f1b, gpipe): peak bytes of values one unit computes and "
                    "a later unit reads (activations, gradient sums), per rank")
    micro_batches_in_flight: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="per scheduler: most micro-batches whose forward ran and backward did not "
                    "(interleaved: most chunk-units)")


class PipelineTransfer(_Strict):
    """One Send/Receive pair (between the ranks at the same position of two stages)."""

    sr_tag: Annotated[int, Field(ge=0)] = Field(description="the tag both sides carry")
    src_stage: Annotated[int, Field(ge=0)]
    dst_stage: Annotated[int, Field(ge=0)]
    value: str = Field(description="what crosses: the producing op")
    shape: list[Dim] = Field(description="the local shape one rank sends")
    dtype: str
    bytes: Annotated[int, Field(ge=0)] = Field(description="bytes one rank sends")


class PipelineInfo(_Strict):
    """Pipeline parallelism (pipeline_stages > 1): stages, micro-batches and the schedule."""

    stages: Positive = Field(description="pipeline_stages")
    devices_per_stage: Positive
    micro_size: Positive = Field(description="micro-batches per step (nn.PipelineCell)")
    chunks: Positive = Field(default=1, description="chunks (pipeline segments) each stage "
                             "runs: 1, or more with pipeline_interleave")
    scheduler: Literal["1f1b", "gpipe"] = Field(description="pipeline_config's scheduler")
    ticks: Annotated[int, Field(ge=0)] = Field(description="ticks of one step")
    bubble: float = Field(description="idle stage-ticks over all stage-ticks")
    ideal_bubble: float = Field(description="(S-1)/(m*v+S-1), v = chunks")
    per_stage: list[PipelineStage]
    transfers: list[PipelineTransfer]


class Plan(_Strict):
    """plan.json (schema version `SCHEMA_VERSION`)."""

    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="version of this format")
    devices: Positive = Field(description="number of ranks")
    parallel_mode: Literal[PARALLEL_MODES] = Field(  # type: ignore[valid-type]
        description="the parallel mode compiled")
    search_mode: Literal[SEARCH_MODES] | None = Field(  # type: ignore[valid-type]
        description="the search algorithm (auto_parallel), else null")
    training: bool = Field(description="true for a training step (loss, gradients, update)")
    inputs: list[PlanInput] = Field(description="graph inputs, in feed order")
    outputs: list[str] = Field(description="names of the step's outputs (`loss`, parameters)")
    ops: dict[str, PlanOp] = Field(description="every forward op by full name")
    parameters: dict[str, PlanParameter] = Field(
        description="every graph parameter (inputs, weights, states) and its layout")
    dump_ranks: list[Rank] = Field(description="the ranks whose folders were written")
    parameter_layout_dict: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="MindSpore's Cell.parameter_layout_dict for the compiling rank "
                    "(global_rank): every parameter, input and optimizer state -> [dev_matrix, "
                    "tensor_map, slice_shape, field_size, uniform_split, opt_shard_group]")
    collectives: dict[str, list[PlanCollective]] = Field(
        description="per dumped rank (key: the rank as a string), its communication nodes")
    search: SearchInfo | None = Field(None, description="the strategy search (auto_parallel)")
    comm_fusion: CommFusionInfo | None = Field(None, description="communication fusion")
    parallel_optimizer: dict[str, OptimizerShard] | None = Field(
        None, description="the parallel optimizer's stored layouts, per parameter")
    pipeline: PipelineInfo | None = Field(
        None, description="pipeline stages, micro-batches and schedule (pipeline_stages > 1)")
    recompute: RecomputeInfo | None = Field(
        None, description="recomputation, when a cell or primitive asked for it")
    prediction: Prediction | None = Field(
        None, description="predicted step time, memory and bytes (parallel plans)")
    megatron_minimum: MegatronMinimumInfo | None = Field(
        None, description="rank's ring bytes against the analytic Megatron-LM minimum, for a "
                          "decoder-only transformer of mindformers' Llama naming (training, "
                          "no pipeline stages)")

    @model_validator(mode="after")
    def _ranks_in_range(self) -> Plan:
        n = self.devices
        for r in self.dump_ranks:
            if r >= n:
                raise ValueError(f"dump_ranks names rank {r}, but devices is {n}")
        for key, rows in self.collectives.items():
            if not key.isdigit() or int(key) >= n:
                raise ValueError(f"collectives key {key!r} is not a rank below devices {n}")
            for row in rows:
                bad = [r for r in row.rank_list if r >= n]
                if bad:
                    raise ValueError(f"collectives[{key!r}] {row.node}: rank_list names "
                                     f"{bad}, beyond devices {n}")
        return self


# -- building (the driver) ------------------------------------------------------------------------


def _tensor_map(layout: Any) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in layout.tensor_map]


def _layout(layout: Any) -> dict[str, Any]:
    """A `PlanLayout` as data (the plan is validated once, as a whole)."""
    return {"shape": list(layout.shape), "dev_matrix": list(layout.dev_matrix),
            "tensor_map": _tensor_map(layout), "slice_shape": list(layout.slice_shape)}


def build_plan(state: Any) -> Plan:
    """The plan of a finished compile (`compiler.compiled.CompileState`)."""
    from pcompile.compiler.driver.parameter_layout import as_json, parameter_layout_dict, use_layout
    from pcompile.ir.rank import resolve
    from pcompile.passes.comm_info import (
        is_communication,
        node_bytes,
        node_reason,
        node_ring_bytes,
        phase_of,
    )

    graph = state.graph
    assert graph is not None
    assignment = state.assignment
    # Built as data and validated once as a whole (`Plan.model_validate`): constructing a
    # model per op costs more than the rest of the plan for a 96-layer graph.
    ops: dict[str, dict[str, Any]] = {}
    for node in graph.nodes:
        sharding = assignment.sharding(node) if assignment else None
        ops[node.fullname] = {
            "op": node.op, "instance_name": node.instance_name,
            "in_strategy": [list(s) for s in sharding.strategy] if sharding is not None
            else None,
            "dev_matrix": list(sharding.dev_matrix) if sharding is not None else None,
            "in_layouts": [_layout(x) for x in sharding.in_layouts] if sharding is not None
            else None,
            "out_layouts": [_layout(x) for x in sharding.out_layouts] if sharding is not None
            else None}
    params: dict[str, dict[str, Any]] = {}
    for p in graph.params:
        # MindSpore's normalised form (size-1 device axes removed), as its
        # parameter_layout_dict; an optimizer-sharded weight shows its use layout (its stored
        # split is under "parallel_optimizer")
        layout = use_layout(state, p.name) if assignment else None
        norm = layout.normalized() if layout else None
        params[p.name] = {
            "kind": p.kind, "dtype": p.dtype.value,
            # an input's global shape is its layout's (nn.PipelineCell traces one micro-batch)
            "shape": list(layout.shape) if layout else list(p.shape),
            "dev_matrix": list(norm.dev_matrix) if norm else [1],
            "tensor_map": _tensor_map(norm) if norm else [-1] * len(p.shape),
            "slice_shape": list(layout.slice_shape) if layout else list(p.shape)}
    collectives: dict[str, list[dict[str, Any]]] = {}
    for rank in state.dump_ranks:
        rows = []
        for node in state.rank_graphs[rank].nodes:
            if not is_communication(node):
                continue
            peer = node.attrs.get("dest_rank", node.attrs.get("src_rank"))
            rows.append({
                "node": node.fullname, "op": node.op,
                "rank_list": sorted([rank, resolve(peer, rank)]) if peer is not None
                else list(resolve(node.attrs.get("rank_list", ()), rank)),
                "group": str(resolve(node.attrs.get("group", ""), rank)),
                "bytes": node_bytes(node), "ring_bytes": node_ring_bytes(node),
                "phase": phase_of(node.scope),
                "reason": node_reason(node)})
        collectives[str(rank)] = rows
    extra = dict(state.plan)
    return Plan.model_validate({
        "devices": state.devices,
        "parallel_mode": state.parallel_mode,
        "search_mode": state.search_mode if state.parallel_mode == "auto_parallel" else None,
        "training": state.training,
        "inputs": [{"name": p.name, "shape": params[p.name]["shape"], "dtype": p.dtype.value}
                   for p in graph.inputs],
        "outputs": list(state.pipeline.program.outputs) if getattr(state, "pipelined", False)
        else list(state.rank_graphs[0].attrs.get("outputs", ())) if state.rank_graphs
        else [],
        "ops": ops,
        "parameters": params,
        "dump_ranks": list(state.dump_ranks),
        # MindSpore's Cell.parameter_layout_dict for the compiling rank (global_rank):
        # name -> [dev_matrix, tensor_map, slice_shape, field_size, uniform_split,
        # opt_shard_group]
        "parameter_layout_dict": as_json(parameter_layout_dict(
            state, state.options.global_rank)),
        "collectives": collectives,
        "search": extra.pop("search", None),
        "comm_fusion": extra.pop("comm_fusion", None),
        "parallel_optimizer": extra.pop("parallel_optimizer", None),
        "pipeline": extra.pop("pipeline", None),
        "megatron_minimum": megatron_minimum(state),
        **extra,  # a pass's new section is refused here until the schema names it
    })


def megatron_minimum(state: Any) -> dict[str, Any] | None:
    """plan.json's `megatron_minimum` (passes/search/megatron.py), or None where the model is
    not a transformer the module knows, or the plan is not a parallel training step without
    pipeline stages."""
    from pcompile.compiler.driver.parameter_layout import use_layout
    from pcompile.passes.comm_info import is_communication, node_ring_bytes
    from pcompile.passes.search.megatron import MegatronMinimum, recognise

    if (not state.training or state.devices < 2 or state.assignment is None
            or getattr(state, "pipelined", False) or not state.rank_graphs):
        return None

    def split_of(name: str) -> tuple[int, ...] | None:
        layout = use_layout(state, name)
        if layout is None:
            return None
        return tuple(g // s if s else 1 for g, s in zip(layout.shape, layout.slice_shape))

    model = recognise(state.graph, state.devices, split_of)
    if model is None:
        return None
    rank = 0
    ring = sum(node_ring_bytes(n) for n in state.rank_graphs[rank].nodes
               if is_communication(n) and n.op != "_MirrorOperator")
    return MegatronMinimum(model, rank, ring).as_dict()


# -- writing and reading --------------------------------------------------------------------------


def plan_text(plan: Plan) -> str:
    """plan.json's text: fields in schema order, one-space indent. The model was validated
    when it was built (`build_plan`); under the test suite (PCOMPILE_VERIFY_EACH) the text is
    validated again, which catches a serialiser that writes what the schema refuses."""
    text = plan.model_dump_json(indent=1)  # pydantic's serialiser: fast for big plans
    if os.environ.get("PCOMPILE_VERIFY_EACH"):
        Plan.model_validate_json(text)
    return text + "\n"


def write_plan(path: str, plan: Plan) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(plan_text(plan))


def _describe(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
        parts.append(f"{where}: {err['msg']}{shown}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def parse_plan(data: Any, where: str = "plan.json") -> Plan:
    """Validate plan.json's data; PlanError (one message) when it does not match."""
    if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise PlanError(f"{where} has schema_version {data.get('schema_version')!r}; this "
                        f"pcompile reads version {SCHEMA_VERSION}: recompile the model with it")
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanError(f"{where} does not match the plan schema (version {SCHEMA_VERSION}, "
                        f"docs/plan-json.md): {_describe(exc)}. Recompile (pcompile MODEL.py "
                        "--out DIR) instead of editing it") from None


def read_plan(out_dir: str) -> Plan:
    """`out_dir/plan.json`, validated; PlanError (one message) when missing or wrong."""
    path = os.path.join(out_dir, "plan.json")
    if not os.path.isfile(path):
        raise PlanError(f"{out_dir} holds no plan.json; compile first (pcompile MODEL.py "
                        f"--out {out_dir} ...)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise PlanError(f"{path} is unreadable ({type(exc).__name__}: {exc}); compile "
                        "again") from None
    return parse_plan(data, path)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of plan.json (exported to docs/plan.schema.json)."""
    schema = Plan.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "pcompile plan.json"
    return schema


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m pcompile.compiler.driver.plan --schema [FILE]`: print (or write) the JSON
    Schema."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pcompile.compiler.driver.plan",
                                     description="Export plan.json's JSON Schema.")
    parser.add_argument("--schema", action="store_true", required=True)
    parser.add_argument("output", nargs="?", help="write here (default: print)")
    args = parser.parse_args(argv)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(schema_text())
    else:
        print(schema_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
