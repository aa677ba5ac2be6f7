"""`step_parallel_begin`: give every forward op a strategy and derive its layouts.

Sources of strategies, in order: the user's `shard()` (tuples or `Layout`s), a strategy found
by the search (auto_parallel, filled in beforehand by `passes.search`), and otherwise
MindSpore's semi-auto default (data parallel on dim 0 when it divides, else replicated). Graph
inputs get their layout from `dataset_strategy`. Reshape has no strategy: its output layout is
what its first consumer wants (reference §2.3). Depend has none either: its output is its first
operand, in that operand's layout (its trait `FIRST_OPERAND`), as in MindSpore, which gives
Depend no operator info.

A parameter whose users want different layouts is an error (reference §3.4): parameters are
stored sliced and never redistributed.
"""

from __future__ import annotations

from typing import Any

from pcompile.ir.core import Constant, Graph, GraphParam, Node, ParallelInfo
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.parallel_info import LayoutDetail
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.sharding import (
    OpContext,
    OpSharding,
    StrategyError,
    rule_for,
)
from pcompile.ir.types import TensorType
from pcompile.passes.layouts import (
    ParallelAssignment,
    dataset_layouts,
    default_strategy,
    is_transparent_cast,
    layout_sharding,
    replicated,
    shard_node,
    tensor_inputs,
)
from pcompile.passes.reshape_layout import map_layout, map_layout_partly
from pcompile.passes.unit import CompileUnit


def assign(
    graph: Graph,
    devices: int,
    dataset_strategy: Any,
    searched: dict[Node, Any] | None = None,
    loaded: dict[Node, Any] | None = None,
) -> ParallelAssignment:
    """step_parallel_begin: strategies, layouts and checks for every forward op. `loaded`:
    node -> the strategy a strategy checkpoint gives it, which wins over the user's as in
    MindSpore (`load_strategy_from_ckpt`)."""
    result = ParallelAssignment(devices)
    result.param_layouts.update(dataset_layouts(graph, dataset_strategy, devices))
    users: dict[str, list[tuple[Node, TensorLayout]]] = {}
    follow = _followers(graph, searched)
    transparent = _transparent(graph, searched, follow)
    for node in graph.nodes:
        if (has_trait(node.op, Trait.NO_STRATEGY) or has_trait(node.op, Trait.FIRST_OPERAND)
                or node in follow or node in transparent):
            continue
        if rule_for(node.op) is None:
            raise OpError(
                node.op,
                "this op has no sharding rule, so it cannot be used in a parallel program",
                instance_name=node.instance_name, scope=node.scope, source=node.source,
                hint="use stand_alone or hybrid_parallel mode for hand-written communication",
            )
        user = (loaded[node] if loaded and node in loaded
                else node.attrs.get("in_strategy"))
        strategy: Any
        if user is not None:
            if any(s is None for s in user):
                raise OpError(node.op, "in_strategy entries of None must be filled by the "
                              "search (auto_parallel with sharding_propagation)",
                              instance_name=node.instance_name, scope=node.scope,
                              source=node.source, strategy=user)
            strategy = user
        elif searched and node in searched:
            strategy = searched[node]
        else:
            strategy = default_strategy(node, devices)
        sharding = shard_node(node, devices, strategy, node.attrs.get("out_strategy"))
        result.shardings[node] = sharding
        node.parallel = ParallelInfo(
            in_strategy=sharding.strategy,
            out_strategy=node.attrs.get("out_strategy"),
        )
        for operand, layout in zip(node.operands, sharding.in_layouts):
            if isinstance(operand, GraphParam) and operand.kind != "input":
                users.setdefault(operand.name, []).append((node, layout))
    for node in reversed([n for n in graph.nodes if n in follow]):
        sharding = _follow_consumer(node, result, devices)
        result.shardings[node] = sharding
        node.parallel = ParallelInfo(in_strategy=sharding.strategy)
        operand = node.operands[0]
        if isinstance(operand, GraphParam) and operand.kind != "input":
            users.setdefault(operand.name, []).append((node, sharding.in_layouts[0]))
    for name, entries in users.items():
        first_node, first = entries[0]
        for other_node, layout in entries[1:]:
            if layout != first or layout.slice_shape != first.slice_shape:
                raise PcompileError(
                    f"The parameter: {name} has multiple users, but the TensorInfo are "
                    f"different: {first_node.where()} wants {first} (strategy "
                    f"{first_node.parallel.in_strategy if first_node.parallel else None}) and "
                    f"{other_node.where()} wants {layout} (strategy "
                    f"{other_node.parallel.in_strategy if other_node.parallel else None}). "
                    "Parameters are stored sliced and never redistributed: give every user "
                    "of the parameter the same split of it"
                )
        result.param_layouts[name] = first
    for p in graph.params:
        if p.name not in result.param_layouts:
            result.param_layouts[p.name] = replicated(p.shape, devices)
    _assign_layout_flow(graph, result, transparent)
    return result


def _followers(graph: Graph, searched: dict[Node, Any] | None) -> set[Node]:
    """The strategy-less pass-through ops (trait `VALUE_COPY`) on a stored parameter (directly
    or through other such ops): their strategy follows their consumer's instead of the
    default, so the parameter is stored split the way its real user wants it (MindSpore looks
    through the Cast a mixed-precision model puts between a weight and its MatMul)."""
    out: set[Node] = set()
    for node in graph.nodes:
        if (not has_trait(node.op, Trait.VALUE_COPY) or len(node.operands) != 1
                or node.attrs.get("in_strategy") is not None
                or (searched and node in searched)):
            continue
        source = node.operands[0]
        if isinstance(source, GraphParam) and source.kind != "input":
            out.add(node)
        elif hasattr(source, "node") and source.node in out:
            out.add(node)
    return out


def _follow_consumer(node: Node, result: ParallelAssignment, devices: int) -> OpSharding:
    """`node` laid out as its first consumer with a strategy wants its output (replicated
    when none has one): the same layout in and out, so no redistribution sits between."""
    for user, index in node.result.uses:
        sharding = result.sharding(user)
        if sharding is not None and index < len(sharding.in_layouts):
            laid = _in_layout(node, sharding.in_layouts[index], devices)
            if laid is not None:
                return laid
            break
    ctx = OpContext(node.op, tensor_inputs(node), node.result.type, node.attrs, devices)
    rule = rule_for(node.op)
    assert rule is not None
    return rule.apply(ctx, tuple(tuple(1 for _ in t.shape) for t in ctx.in_types), None)


def _in_layout(node: Node, layout: TensorLayout, devices: int) -> OpSharding | None:
    """A one-operand op laid out as `layout` in and out (None where its rule refuses it)."""
    ctx = OpContext(node.op, tensor_inputs(node), node.result.type, node.attrs, devices)
    rule = rule_for(node.op)
    assert rule is not None
    try:
        return layout_sharding(ctx, rule.labels(ctx), [layout], None)
    except StrategyError:
        return None


def _transparent(graph: Graph, searched: dict[Node, Any] | None, follow: set[Node]
                 ) -> set[Node]:
    """The transparent Casts the search gave no strategy (the searches look through them):
    laid out as their input, in `_assign_layout_flow`."""
    return {node for node in graph.nodes
            if is_transparent_cast(node)
            and not (searched and node in searched) and node not in follow}


def value_layout(value: Any, result: ParallelAssignment) -> TensorLayout | None:
    """The layout `value` is produced in, where already decided (None for constants)."""
    if isinstance(value, GraphParam):
        return result.param_layouts.get(value.name)
    node = getattr(value, "node", None)
    if node is None:
        return None
    if node.op == "Reshape":
        return result.reshape_layouts.get(node)
    if has_trait(node.op, Trait.FIRST_OPERAND):
        return value_layout(node.operands[0], result)
    if node.op == "TupleGetItem":
        producer = getattr(node.operands[0], "node", None)
        sharding = result.sharding(producer) if producer is not None else None
        index = int(node.attrs["index"])
        if sharding is None or index >= len(sharding.out_layouts):
            return None
        return sharding.out_layouts[index]
    sharding = result.sharding(node)
    if sharding is None or len(sharding.out_layouts) != 1:
        return None
    return sharding.out_layouts[0]


def _consumer_layout(node: Node, result: ParallelAssignment,
                     transparent: set[Node]) -> TensorLayout | None:
    """The layout the first user with a strategy wants `node`'s output in, looking through
    transparent Casts (which keep the shape)."""
    for user, index in node.result.uses:
        if user in transparent:
            wanted = _consumer_layout(user, result, transparent)
            if wanted is not None:
                return wanted
            continue
        sharding = result.sharding(user)
        if sharding is not None and index < len(sharding.in_layouts):
            return sharding.in_layouts[index]
    return None


def _assign_layout_flow(graph: Graph, result: ParallelAssignment,
                        transparent: set[Node]) -> None:
    """Layouts of the strategy-less ops, in graph order. A Reshape's output takes the layout
    its first user with a strategy wants (reference §2.3); a Reshape feeding only Reshapes
    keeps its input's layout carried through the shape change (`map_layout`: split dims
    that map to one group of dims stay split; where a group cannot keep its split, only that
    group is gathered), so a chain redistributes once, where the shapes force it. A
    transparent Cast takes its input's layout (a constant's: whole on every rank)."""
    for node in graph.nodes:
        if node.op == "Reshape":
            out_type = node.result.type
            assert isinstance(out_type, TensorType)
            wanted = _consumer_layout(node, result, transparent)
            if wanted is None:
                source = value_layout(node.operands[0], result)
                if source is not None:
                    wanted = (map_layout(source, out_type.shape)
                              or map_layout_partly(source, out_type.shape))
            if wanted is None:
                wanted = replicated(out_type.shape, result.devices)
            result.reshape_layouts[node] = wanted
        elif node in transparent:
            operand = node.operands[0]
            source = value_layout(operand, result)
            if source is None and isinstance(operand, Constant):
                # a constant is whole on every rank (MindSpore folds the Cast of a constant
                # into a new constant): its Cast stays whole, not split and gathered back
                source = replicated(operand.tensor_type.shape, result.devices)
            sharding = (_in_layout(node, source, result.devices) if source is not None
                        else None)
            if sharding is None:
                sharding = shard_node(node, result.devices,
                                      default_strategy(node, result.devices), None)
            result.shardings[node] = sharding
            node.parallel = ParallelInfo(in_strategy=sharding.strategy)


def annotate_parallel_detail(graph: Graph, assignment: ParallelAssignment, mode: str) -> None:
    """MindSpore's `MS_DEV_DUMP_IR_PARALLEL_DETAIL=1` on every op with a strategy (reference
    §5.2). `mode` "tensor_map" (MindSpore does it in semi_auto_parallel): the attributes
    `inputs_tensor_map`, `outputs_tensor_map` and `device_matrix` of its OperatorInfo, printed
    in `primitive_attrs` (`((1, 0), (2))`); "layout" (sharding_propagation): `in_layout` and
    `out_layout` in the parallel-info group, tuples of `{'device_matrix': ..., 'tensor_map':
    ...}` (a user's Layout also gives `interleaved_parallel` and `alias_name`)."""
    for node in graph.nodes:
        sharding = assignment.sharding(node)
        if sharding is None or node.parallel is None:
            continue
        ins, outs = sharding.mindspore_maps()
        if mode == "tensor_map":
            node.attrs["inputs_tensor_map"] = ins
            node.attrs["outputs_tensor_map"] = outs
            node.attrs["device_matrix"] = tuple(sharding.dev_matrix)
            continue
        dev = tuple(sharding.dev_matrix)
        user_in = node.attrs.get("in_strategy") or ()
        user_out = node.attrs.get("out_strategy") or ()
        # printed right after the strategies, as MindSpore prints them
        node.parallel.in_layout = tuple(
            _layout_detail(given, dev, tmap) for given, tmap in
            zip(list(user_in) + [None] * (len(ins) - len(user_in)), ins))
        node.parallel.out_layout = tuple(
            _layout_detail(given, dev, tmap) for given, tmap in
            zip(list(user_out) + [None] * (len(outs) - len(user_out)), outs))


def _layout_detail(given: Any, dev: tuple[int, ...], tmap: tuple[Any, ...]) -> LayoutDetail:
    if isinstance(given, dict):  # a user's Layout: its own fields, as MindSpore prints them
        return LayoutDetail(given["device_matrix"], given["tensor_map"],
                            given.get("interleaved_parallel"), given.get("alias_name"))
    return LayoutDetail(dev, tmap)


class StepParallelBeginPass:
    """`step_parallel_begin`: strategies (the user's, the search's, the default) and layouts
    for every forward op; with `parallel_detail` (MindSpore's MS_DEV_DUMP_IR_PARALLEL_DETAIL),
    tensor maps in semi_auto_parallel and layouts under sharding propagation in the dump."""

    name = "step_parallel_begin"
    appends_only = False

    def apply(self, unit: CompileUnit) -> None:
        from pcompile.passes.search.auto_parallel_pass import finish_assignment
        from pcompile.passes.search.strategy_checkpoint import load_strategies

        assert unit.graph is not None
        searched = unit.search.specs() if unit.search is not None else None
        files = unit.options.strategy_files
        loaded = (load_strategies(files.load_file, unit.graph, files.loaded)
                  if files.load_file and files.loaded is not None else None)
        unit.assignment = assign(unit.graph, unit.stage_devices, unit.options.dataset_strategy,
                                 searched=searched, loaded=loaded)
        finish_assignment(unit)  # the search's annotations and plan entry
        record_prediction(unit)
        if unit.options.parallel_detail:
            if unit.parallel_mode == "semi_auto_parallel":
                annotate_parallel_detail(unit.graph, unit.assignment, "tensor_map")
            elif unit.search_mode == "sharding_propagation":
                annotate_parallel_detail(unit.graph, unit.assignment, "layout")


def record_prediction(unit: CompileUnit) -> None:
    """The plan's predicted step time, memory and bytes under the cost model in seconds
    (passes/search/predict.py) in plan.json's `prediction`, with one line of advice when it
    is predicted not to fit the device's memory."""
    from pcompile.passes.recompute import marked
    from pcompile.passes.search.predict import fit_advice, predict
    from pcompile.passes.search.stages import pipeline_shape
    from pcompile.passes.search.time_model import load_profile

    assert unit.graph is not None
    profile = unit.options.device_profile or load_profile("h100")  # a built-in: no file
    memory = unit.options.device_memory
    # what the compiled program does (an ilp plan that assumed the parallel optimizer or
    # recompute the program does not switch on is predicted without them, and says so)
    popt, recompute = unit.options.optimizer_shard.enabled, marked(unit.graph)
    pred = predict(unit.graph, unit.stage_devices, profile,
                   memory if memory is not None else profile.memory,
                   training=unit.training, parallel_optimizer=popt, recompute=recompute,
                   dataset_strategy=unit.options.dataset_strategy,
                   enable_alltoall=unit.options.enable_alltoall,
                   pipeline=pipeline_shape(unit.pipeline, unit.graph,
                                           unit.micro_batched))
    record = pred.as_dict()
    if not pred.fits:
        record["advice"] = fit_advice(pred, unit.stage_devices)
    unit.plan.prediction = record

