"""Per-rank graphs for `data_parallel` and `hybrid_parallel` (manual) modes.

No op is sharded by the compiler: every rank runs the whole traced graph (on its local batch in
`data_parallel`; on whatever the user's own code slices in `hybrid_parallel`), and every
trainable parameter not marked `layerwise_parallel` gets a `_MirrorOperator` over all ranks, so
its gradient is all-reduced (summed, or averaged with `gradients_mean`), as in MindSpore. Each
rank's loss is its own (no `_VirtualDiv`): with `gradients_mean=True` and a loss that is a mean
over equal-size local batches, training equals single-device training on the global batch.
"""

from __future__ import annotations

from collections.abc import Mapping

from pcompile.ir.core import Graph, GraphParam, Node, Value
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops.state import batch_assigned_names, refuse_assignments
from pcompile.ir.sharding import OpSharding
from pcompile.ir.types import TensorType, TupleType
from pcompile.passes.layouts import ParallelAssignment, replicated
from pcompile.passes.step_parallel import RankBuilder, SplitOptions
from pcompile.passes.unit import CompileUnit, ParameterFacts


def _types(node: Node) -> list[TensorType]:
    t = node.result.type
    return list(t.elements) if isinstance(t, TupleType) else [t]


def replicated_assignment(graph: Graph, devices: int) -> ParallelAssignment:
    """Every value replicated, every op run whole on every rank, no forward communication."""
    result = ParallelAssignment(devices)
    for p in graph.params:
        result.param_layouts[p.name] = replicated(p.shape, devices)
    for node in graph.nodes:
        ins = [replicated(getattr(v.type, "shape", ()), devices) for v in node.operands]
        outs = [replicated(t.shape, devices) for t in _types(node)]
        strategy = tuple(tuple(1 for _ in lay.shape) for lay in ins)
        result.shardings[node] = OpSharding(strategy, (devices,), ins, outs)
        if node.op == "Reshape":
            result.reshape_layouts[node] = outs[0]
    return result


class _Builder(RankBuilder):
    # every value is laid out "replicated" though each rank holds its own batch
    reduce_cotangents = False

    def __init__(self, graph: Graph, assignment: ParallelAssignment, rank: int | None,
                 options: SplitOptions, fusion_ids: dict[str, int], *,
                 layerwise: set[str]) -> None:
        super().__init__(graph, assignment, rank, options, fusion_ids)
        self.layerwise = layerwise

    def mirror(self, param: GraphParam, user: Node) -> Value:
        if param.name in self.layerwise:
            return self.local[id(param)][0]
        return super().mirror(param, user)


def build_replicated_graphs(
    graphs: list[Graph], options: SplitOptions, fusion_ids: dict[str, int],
    layerwise: set[str],
) -> list[Graph]:
    """The graph of each rank from `graphs[r]`, with mirrors over all ranks: one
    rank-parametric graph for every rank when they all run the same traced graph
    (data_parallel), one per rank when the model was traced per rank (hybrid_parallel)."""
    local_options = SplitOptions(options.devices, options.training, options.gradients_mean,
                                 loss_repeated_mean=False, opt_shard=options.opt_shard)

    def build(graph: Graph, rank: int | None) -> Graph:
        assignment = replicated_assignment(graph, options.devices)
        for name, shard in options.opt_shard.items():
            assignment.param_layouts[name] = shard.stored
        builder = _Builder(graph, assignment, rank, local_options, fusion_ids,
                           layerwise=layerwise)
        g = builder.build()
        for node in g.nodes:
            if node.parallel is not None and node.op != "_MirrorOperator":
                node.parallel = None  # nothing was sharded: no strategy to print
        return g

    if all(g is graphs[0] for g in graphs):
        return [build(graphs[0], None)] * len(graphs)
    return [build(graph, rank) for rank, graph in enumerate(graphs)]


def data_parallel_feed_layouts(graph: Graph, devices: int) -> dict[str, TensorLayout]:
    """How the global batch is cut for the ranks: dim 0 of every input over all ranks."""
    layouts = {}
    for p in graph.inputs:
        shape = (p.shape[0] * devices, *p.shape[1:]) if p.shape else p.shape
        tmap = (0,) + (-1,) * (len(shape) - 1) if shape else ()
        layouts[p.name] = TensorLayout((devices,), tmap, shape)
    return layouts


class ReplicatePass:
    """`split_ranks` in data_parallel / hybrid_parallel: every rank runs the whole graph
    (hybrid: the graph traced for that rank, already in `unit.rank_graphs`), with gradient
    mirrors over all ranks for parameters not marked `layerwise_parallel`."""

    name = "split_ranks"
    appends_only = False

    def __init__(self, parameters: Mapping[str, ParameterFacts]) -> None:
        self.parameters = parameters

    def apply(self, unit: CompileUnit) -> None:
        from pcompile.passes.optimizer_shard import optimizer_sharding

        assert unit.graph is not None
        refuse_assignments(unit.graph, (
            f"in {unit.parallel_mode} mode every rank would update it from its own batch, so "
            "the ranks' copies of the Parameter would differ and none would be the "
            "single-device value; compile in semi_auto_parallel or auto_parallel, where a "
            "reduction over the batch counts every rank's part"),
            batch_assigned_names(unit.graph))
        if unit.parallel_mode == "hybrid_parallel":
            graphs = list(unit.rank_graphs)  # traced per rank by the front end
        else:
            graphs = [unit.graph] * unit.devices
        options = SplitOptions(unit.devices, unit.backward,
                               gradients_mean=unit.options.gradients_mean)
        fusion = {name: p.comm_fusion for name, p in self.parameters.items()}
        layerwise = {name for name, p in self.parameters.items() if p.layerwise_parallel}
        assignment = replicated_assignment(unit.graph, unit.devices)
        options.opt_shard = optimizer_sharding(unit, assignment.param_layouts, self.parameters,
                                               unit.options.optimizer_shard)
        unit.opt_shard = dict(options.opt_shard)
        unit.rank_graphs = build_replicated_graphs(graphs, options, fusion, layerwise)
        for name, shard in options.opt_shard.items():
            assignment.param_layouts[name] = shard.stored
        if unit.parallel_mode == "data_parallel":
            assignment.param_layouts.update(data_parallel_feed_layouts(unit.graph, unit.devices))
        unit.assignment = assignment
        unit.output_layouts = [None] * len(unit.graph.outputs)
        unit.split = True
