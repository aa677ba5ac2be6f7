"""Strategy search for `auto_parallel` (reference §4): a printable decision, applied later.

`search(graph, devices, mode)` builds the cost graph of the forward graph (`cost_graph.py`:
ops, `_VirtualDataset`, `TmpIdentity` for shared parameters, redistribution edges through
Reshape/TupleGetItem), runs one algorithm and returns a `SearchResult`:

* `strategies`: node -> strategy for every op without a user strategy (Reshape,
  TupleGetItem and MakeTuple have none), to be applied by `step_parallel_begin.assign(...,
  searched=...)`;
* `explain`: id(node) -> the chosen strategy, its cost terms, the cost of its edges with the
  neighbours' chosen strategies, and the runner-up under the comparison the search made
  (`explain.py` states the invariant: the chosen cost is never above the runner-up's), so a
  plan can say why;
* `reshape_layouts`: Reshape -> output layout for Reshapes feeding other Reshapes (the
  layout the chain's consumer wants, mapped back through the chain), so a chain costs one
  redistribution instead of a gather to replicated and a slice;
* `objective`: the plan's total cost under the cost model.

Modes: `sharding_propagation` (`sharding_propagation.py`), `dynamic_programming`
(`dynamic_programming.py`), `recursive_programming` (`recursive_programming.py`). The cost
model is `cost_model.py`, candidates `candidates.py`, checkpoints `checkpoint.py`, the
explanations `explain.py`, which states the invariant every search keeps: the chosen
strategy's cost is the minimum over the candidates it printed, under the same cost model
(dynamic programming: the local objective; sharding propagation: `CompareSwcCost` on the
edges that decided the op).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pcompile.ir.core import Graph, Node
from pcompile.ir.layout import TensorLayout
from pcompile.ir.sharding import Strategy
from pcompile.ir.types import TensorType
from pcompile.passes.reshape_layout import map_layout
from pcompile.passes.search.cost_graph import CostGraph
from pcompile.passes.search.cost_model import CostConstants, printable
from pcompile.passes.search.explain import (
    local_explanation,
    plain_explanation,
    propagation_explanation,
)

MODES = ("sharding_propagation", "dynamic_programming", "recursive_programming", "ilp")


@dataclass
class SearchOptions:
    """Algorithm options (from `set_algo_parameters` / `set_cost_model_context` by default)."""

    fully_use_devices: bool = False
    interfered_sapp: bool = False  # recursive programming respects user strategies
    approximate: bool = False  # dynamic programming keeps ceil(1/epsilon) candidates per op
    epsilon: float = 0.1
    max_table: int = 1 << 24  # dynamic programming: largest elimination table (entries)
    # dynamic programming: edge tables with at most this many layout pairs are planned up
    # front; larger ones start from lower bounds (0: every table starts from bounds)
    exact_edge_classes: int = 256
    # ilp: the device profile (a built-in name or a JSON file, time_model.py) and the memory
    # per device (None: the profile's)
    device_profile: str = "h100"
    device_memory: float | None = None
    optimizer_states: int = 2


@dataclass
class SearchResult:
    """The decision of one search (see the module docstring)."""

    mode: str
    strategies: dict[Node, Strategy] = field(default_factory=dict)
    explain: dict[Node, dict[str, Any]] = field(default_factory=dict)
    reshape_layouts: dict[Node, TensorLayout] = field(default_factory=dict)
    objective: float = 0.0
    seconds: float = 0.0
    cost_graph: CostGraph | None = None
    choice: list[int] = field(default_factory=list)
    # propagation: vertex index -> the edges whose redistribution decided it
    decisions: dict[int, list[int]] = field(default_factory=dict)
    # ops whose strategy is layouts (built under a neighbour's device matrix): node -> one
    # `Layout` dict per input, what step_parallel_begin lays the op out by
    layouts: dict[Node, tuple[Any, ...]] = field(default_factory=dict)
    # ilp: the mesh, global choices, predictions and the program's size (IlpPlan.summary)
    ilp: dict[str, Any] | None = None
    # what the user should know of the plan (one line each; plan.json and the compile print)
    warnings: list[str] = field(default_factory=list)

    def specs(self) -> dict[Node, Any]:
        """What step_parallel_begin takes per searched op: its strategy, or its layouts."""
        return {**self.strategies, **self.layouts}

    def summary(self) -> dict[str, Any]:
        """What plan.json records of the search; no timings, so plans stay byte-identical
        (the CLI prints each pass's time)."""
        out: dict[str, Any] = {"mode": self.mode, "objective": printable(self.objective),
                               "searched_ops": len(self.strategies)}
        if self.ilp is not None:
            out.update(self.ilp)
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


def search(
    graph: Graph,
    devices: int,
    mode: str,
    *,
    dataset_strategy: Any = None,
    constants: CostConstants | None = None,
    options: SearchOptions | None = None,
    loaded: dict[Node, Strategy] | None = None,
    explain: bool = True,
    pipeline: Any = None,
    profile: Any = None,
) -> SearchResult:
    """Find a strategy for every op of the forward `graph` without a user strategy.

    `loaded`: node -> strategy read from a strategy checkpoint; such ops count as
    configured (the loaded strategy overrides the search). `pipeline`: the pipeline stages
    (stages.PipelineShape) `--search ilp` costs per stage; `devices` are then one stage's.
    `profile`: the ilp search's device profile (time_model.DeviceProfile; None: the one
    `options.device_profile` names, read here)."""
    if mode not in MODES:
        raise ValueError(f"unknown search mode {mode!r}; expected one of {', '.join(MODES)}")
    start = time.perf_counter()
    constants = constants or CostConstants()
    options = options or SearchOptions()
    if mode == "recursive_programming":
        from pcompile.passes.search.recursive_programming import check_devices

        check_devices(devices)
    ilp = mode == "ilp"
    cg = CostGraph(graph, devices, constants, dataset_strategy,
                   options.fully_use_devices and not ilp, loaded, weight_casts=ilp,
                   reduce_scatter=ilp)
    via: dict[int, str] = {}
    decision: dict[int, list[int]] = {}  # propagation: the edges that decided a vertex
    lagrange, allowed = 0.0, None
    ilp_summary = None
    if ilp:
        from pcompile.passes.search.ilp import IlpOptions
        from pcompile.passes.search.ilp import solve as solve_ilp
        from pcompile.passes.search.time_model import load_profile

        if profile is None:
            profile = load_profile(options.device_profile)
        memory = options.device_memory if options.device_memory is not None else profile.memory
        plan = solve_ilp(cg, IlpOptions(profile, memory, constants.training,
                                        options.optimizer_states, constants.enable_alltoall,
                                        pipeline=pipeline))
        choice = plan.choice
        ilp_summary = {"device_profile": profile.name,
                       "device_memory": round(memory), **plan.summary()}
    elif mode == "sharding_propagation":
        from pcompile.passes.search.sharding_propagation import propagate

        prop = propagate(cg, neighbour_layouts=True)
        choice, via, decision = prop.choice, prop.via, prop.decision
    elif mode == "dynamic_programming":
        from pcompile.passes.search.dynamic_programming import solve

        dp = solve(cg, options)
        choice, lagrange, allowed = dp.choice, dp.lagrange, dp.allowed
    else:
        from pcompile.passes.search.recursive_programming import recursive_search

        rp = recursive_search(cg, options)
        choice, via, decision = rp.choice, rp.via, rp.decision
    result = SearchResult(mode, cost_graph=cg, choice=choice, decisions=decision,
                          ilp=ilp_summary)
    loaded = loaded or {}
    for v in cg.vertices:
        if v.kind != "op" or v.node is None:
            continue
        node = v.node
        if node.attrs.get("in_strategy") is not None:
            continue
        chosen = v.candidates[choice[v.index]]
        result.strategies[node] = chosen.strategy
        if chosen.out_strategy is not None and result.ilp is not None:
            # applied by apply_plan_choices (and again by the shrunk check), by full name
            result.ilp.setdefault("out_strategies", {})[node.fullname] = [
                list(s) for s in chosen.out_strategy]
        if chosen.spec is not None:
            result.layouts[node] = chosen.spec
        if not explain:
            continue
        if node in loaded:
            info = plain_explanation(cg, v, choice, "strategy checkpoint")
        elif mode == "dynamic_programming":
            info = local_explanation(cg, v, choice, lagrange,
                                     allowed[v.index] if allowed else None)
        elif decision.get(v.index):
            info = propagation_explanation(cg, v, choice, decision[v.index],
                                           via[v.index])
        elif ilp:
            info = plan.explain(cg, v)
        elif v.index in decision:
            info = plain_explanation(cg, v, choice, "first candidate (not reached)")
        else:
            info = plain_explanation(cg, v, choice, "recursive programming")
        if v.index in via:
            info["via"] = via[v.index]
        if node in loaded:
            info["via"] = "strategy checkpoint"
        result.explain[node] = info
    # ilp: the predicted step time (seconds); the others: MindSpore's objective
    result.objective = plan.step_time if ilp else cg.total(choice)
    if mode == "recursive_programming":
        memory = cg.memory(choice)
        if memory > constants.memory_capacity:  # the partition does not look at the memory
            result.warnings.append(
                f"recursive_programming does not bound memory: its plan needs "
                f"{memory / 2**30:.1f} GiB by MindSpore's cost model (parameter and output "
                f"slices), above device_memory_capacity={constants.memory_capacity / 2**30:.1f} "
                "GiB; --search ilp chooses a plan within the device's memory")
    result.reshape_layouts = reshape_chain_layouts(graph, cg, choice)
    result.seconds = time.perf_counter() - start
    return result


def reshape_chain_layouts(graph: Graph, cg: CostGraph, choice: list[int]
                          ) -> dict[Node, TensorLayout]:
    """Output layouts for Reshapes whose first user is a Reshape: what the end of the chain
    wants, mapped back through it (when such a layout exists)."""
    out: dict[Node, TensorLayout] = {}

    def wanted(node: Node) -> TensorLayout | None:
        for user, index in node.result.uses:
            if user.op == "Reshape":
                after = wanted(user)
                if after is None:
                    return None
                t = node.result.type
                assert isinstance(t, TensorType)
                mapped = map_layout(after, t.shape)
                if mapped is not None:
                    out[node] = mapped
                return mapped
            vi = cg.vertex_of.get(id(user))
            if vi is None:
                return None
            return cg.vertices[vi].candidates[choice[vi]].in_layouts[index]
        return None

    for node in graph.nodes:
        if node.op == "Reshape" and node not in out:
            first = node.result.uses[0][0] if node.result.uses else None
            if first is not None and first.op == "Reshape":
                wanted(node)
    return out


__all__ = ["MODES", "SearchOptions", "SearchResult", "search"]
