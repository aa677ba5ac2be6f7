"""The driver's side of the search: `step_auto_parallel_begin` and what follows `assign`.

`StepAutoParallelPass` (dumped as `NN_step_auto_parallel_begin.ir`, the graph the search
reads) loads a strategy checkpoint if one is configured, runs the search of
`unit.search_mode` on the forward graph and keeps the `SearchResult` on the unit. After
`step_parallel_begin.assign(..., searched=result.strategies)`, `finish_assignment` applies the
Reshape-chain layouts, writes each searched op's cost, the terms it was chosen by and the
runner-up into its parallel annotation (`cost`, `decision`, `runner_up` or `decided_by` in the
step_parallel_begin dump, `explain.annotate`) and records the decision under `search` in
plan.json. The strategy checkpoint's file is read and written by the driver
(compiler/driver/strategy_files.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pcompile.passes.search import SearchOptions, search
from pcompile.passes.search.cost_model import CostConstants
from pcompile.passes.search.explain import annotate
from pcompile.passes.search.stages import pipeline_shape
from pcompile.passes.search.strategy_checkpoint import load_strategies
from pcompile.passes.unit import CompileUnit


@dataclass(frozen=True)
class AutoParallelOptions:
    """The search's options: the algorithms' (`set_algo_parameters`) and MindSpore's cost
    model's constants (`set_cost_model_context`), as the driver read them from the contexts
    (`compiler.pass_options`). The cost model in seconds (`--search ilp`, the predictions)
    takes its device profile and memory from the unit's `CompileOptions`."""

    search: SearchOptions = field(default_factory=SearchOptions)
    constants: CostConstants = field(default_factory=CostConstants)


class StepAutoParallelPass:
    """Strategy search for `auto_parallel` (sharding propagation, dynamic or recursive
    programming, ilp)."""

    name = "step_auto_parallel_begin"
    appends_only = False

    def __init__(self, options: AutoParallelOptions | None = None) -> None:
        self.options = options or AutoParallelOptions()

    def apply(self, unit: CompileUnit) -> None:
        assert unit.graph is not None
        files = unit.options.strategy_files
        loaded = (load_strategies(files.load_file, unit.graph, files.loaded)
                  if files.load_file and files.loaded is not None else {})
        constants = replace(self.options.constants, training=unit.training,
                            enable_alltoall=unit.options.enable_alltoall)
        unit.search = search(
            unit.graph,
            unit.stage_devices,  # a pipeline stage's devices
            unit.search_mode,
            dataset_strategy=unit.options.dataset_strategy,
            constants=constants,
            options=replace(self.options.search, device_memory=unit.options.device_memory),
            loaded=loaded,
            pipeline=pipeline_shape(unit.pipeline, unit.graph, unit.micro_batched),
            profile=unit.options.device_profile,  # read by the driver: no file opened here
        )
        apply_plan_choices(unit)


def apply_plan_choices(unit: CompileUnit) -> None:
    """The ilp search's global choices made real: the ReduceScatter forms it chose (the op's
    `out_strategy`), the parallel optimizer switched on, and every forward op of the folded
    layers marked for recompute except each layer's outputs (what `Cell.recompute()` on every
    layer marks); nothing for the other searches."""
    from dataclasses import replace as replaced

    from pcompile.passes.search.ilp import layer_groups

    result = unit.search
    if result is None or result.ilp is None:
        return
    scattered = result.ilp.get("out_strategies") or {}
    if scattered and unit.graph is not None:
        for node in unit.graph.nodes:  # the ReduceScatter forms the search chose
            form = scattered.get(node.fullname)
            if form is not None and node.attrs.get("out_strategy") is None:
                node.attrs["out_strategy"] = tuple(tuple(s) for s in form)
    if result.ilp.get("parallel_optimizer") and not unit.options.optimizer_shard.enabled:
        unit.options = replaced(unit.options, optimizer_shard=replaced(
            unit.options.optimizer_shard, enabled=True))
    if result.ilp.get("recompute") and unit.graph is not None:
        group = layer_groups(unit.graph)
        outputs = {id(v) for v in unit.graph.outputs}
        for node in unit.graph.nodes:
            key = group.get(id(node))
            if key is None or id(node.result) in outputs:
                continue
            if any(group.get(id(user)) != key for user, _ in node.result.uses):
                continue  # a layer's output is kept, as Cell.recompute() keeps a cell's
            if node.attrs.get("recompute") is None:
                node.attrs["recompute"] = True


def finish_assignment(unit: CompileUnit) -> None:
    """Reshape-chain layouts, cost annotations and plan.json entry (see above)."""
    result = unit.search
    if result is None:
        return
    graph, assignment = unit.graph, unit.assignment
    assert graph is not None and assignment is not None
    assignment.reshape_layouts.update(result.reshape_layouts)
    ops: dict[str, Any] = {}
    for node in graph.nodes:
        info = result.explain.get(node)
        if info is None:
            continue
        if node.parallel is not None:
            annotate(node.parallel, info)
        ops[node.fullname] = {"instance_name": node.instance_name, **info}
    unit.plan.search = {**result.summary(), "ops": ops}
