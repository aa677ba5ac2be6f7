"""The driver's side of the search: `step_auto_parallel_begin` and what follows `assign`.

`StepAutoParallelPass` (dumped as `NN_step_auto_parallel_begin.ir`, the graph the search
reads) loads a strategy checkpoint if one is configured, runs the search of
`state.search_mode` on the forward graph and keeps the `SearchResult` on the state. After
`step_parallel_begin.assign(..., searched=result.strategies)`, `finish_assignment` applies the
Reshape-chain layouts, writes each searched op's cost, the terms it was chosen by and the
runner-up into its parallel annotation (`cost`, `decision`, `runner_up` or `decided_by` in the
step_parallel_begin dump, `explain.annotate`), records the decision under
`search` in plan.json, and saves the strategy checkpoint.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pcompile.passes.search import SearchOptions, SearchResult, search
from pcompile.passes.search.cost_model import CostConstants
from pcompile.passes.search.explain import annotate
from pcompile.passes.search.strategy_checkpoint import load_strategies, save_checkpoint


class StepAutoParallelPass:
    """Strategy search for `auto_parallel` (sharding propagation, dynamic or recursive
    programming), with the options and cost-model constants the driver read from the contexts
    (`compiler.pass_options`)."""

    name = "step_auto_parallel_begin"

    def __init__(self, options: SearchOptions | None = None,
                 constants: CostConstants | None = None) -> None:
        self.options = options or SearchOptions()
        self.constants = constants or CostConstants()

    def apply(self, state: Any) -> None:
        assert state.graph is not None
        opts = state.options
        ckpt = opts.get("strategy_ckpt_config")
        loaded = {}
        if ckpt is not None and ckpt.load_file:
            loaded = load_strategies(ckpt.load_file, state.graph)
        constants = replace(self.constants, training=state.training,
                            enable_alltoall=bool(opts.get("enable_alltoall", False)))
        state.search = search(
            state.graph,
            getattr(state, "stage_devices", state.devices),  # a pipeline stage's devices
            state.search_mode,
            dataset_strategy=opts.get("dataset_strategy"),
            constants=constants,
            options=self.options,
            loaded=loaded,
        )


def searched_strategies(state: Any) -> dict[int, Any] | None:
    result: SearchResult | None = getattr(state, "search", None)
    return result.specs() if result is not None else None


def finish_assignment(state: Any) -> None:
    """Reshape-chain layouts, cost annotations, plan.json entry and checkpoint (see above)."""
    result: SearchResult | None = getattr(state, "search", None)
    if result is None:
        return
    graph, assignment = state.graph, state.assignment
    assignment.reshape_layouts.update(result.reshape_layouts)
    ops: dict[str, Any] = {}
    for node in graph.nodes:
        info = result.explain.get(id(node))
        if info is None:
            continue
        if node.parallel is not None:
            annotate(node.parallel, info)
        ops[node.fullname] = {"instance_name": node.instance_name, **info}
    state.plan["search"] = {**result.summary(), "ops": ops}
    ckpt = state.options.get("strategy_ckpt_config")
    if ckpt is not None and ckpt.save_file:
        save_checkpoint(ckpt.save_file, graph, assignment, ckpt.only_trainable_params)
