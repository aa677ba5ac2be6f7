"""What every plan predicts of itself: step time, memory by kind and bytes, under the cost model
in seconds (`time_model.py`) that `--search ilp` minimises.

`predict(graph, devices, ...)` takes the forward graph after `step_parallel_begin` (every op
laid out: a user strategy, a searched one or the semi-auto default) and evaluates that plan:
the cost graph is built with every op configured to the strategy it got, so that hand-written,
searched and default plans are costed by one function (`ilp.evaluate`, repeated layers folded
as the search folds them). The result goes into plan.json (`prediction`) and `pcompile show`;
a plan whose memory exceeds the device's is reported at compile time in one line, with what
would make it fit (`fit_advice`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pcompile.ir.core import Graph, Node
from pcompile.ir.sharding import rule_for
from pcompile.passes.search.cost_graph import CostGraph, _looked_through
from pcompile.passes.search.cost_model import CostConstants
from pcompile.passes.search.ilp import (
    Costs,
    IlpOptions,
    fold,
    mapped_edges,
    stage_totals,
    stages_summary,
    summarise,
)
from pcompile.passes.search.stages import PipelineShape
from pcompile.passes.search.time_model import DeviceProfile, Memory, stored_param


@dataclass
class Prediction:
    profile: DeviceProfile
    memory_capacity: float
    compute: float
    communication: float
    comm_bytes: float
    memory: Memory
    parallel_optimizer: bool
    recompute: bool
    stages: dict[str, Any] | None = None  # pipeline stages (ilp.stages_summary)

    @property
    def step_time(self) -> float:
        return self.compute + self.communication

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_capacity

    def as_dict(self) -> dict[str, Any]:
        return {"device_profile": self.profile.name,
                "device_memory": round(self.memory_capacity),
                "step_time": float(f"{self.step_time:.6g}"),
                "compute": float(f"{self.compute:.6g}"),
                "communication": float(f"{self.communication:.6g}"),
                "communication_bytes": round(self.comm_bytes),
                "memory": self.memory.as_dict(),
                "fits": self.fits,
                "parallel_optimizer": self.parallel_optimizer,
                "recompute": self.recompute,
                **({"stages": self.stages} if self.stages is not None else {})}


def predict(graph: Graph, devices: int, profile: DeviceProfile, memory_capacity: float, *,
            training: bool, parallel_optimizer: bool, recompute: bool,
            dataset_strategy: Any = None, enable_alltoall: bool = False,
            optimizer_states: int = 2, pipeline: PipelineShape | None = None) -> Prediction:
    """The plan's prediction (module docstring). Ops without a layout (no rule) are skipped.
    With pipeline stages (`pipeline`; `devices` are one stage's), the step is the slowest
    stage's stretched by the bubble and the memory the largest stage's (stages.py)."""
    configured: dict[Node, Any] = {}
    follows = _following_casts(graph)
    for node in graph.nodes:
        if node.parallel is None or rule_for(node.op) is None:
            continue
        if _looked_through(node) or node in follows:  # laid out as its input or user
            continue
        if node.attrs.get("in_strategy") is None and node.parallel.in_strategy is not None:
            configured[node] = node.parallel.in_strategy
    constants = CostConstants(training=training, enable_alltoall=enable_alltoall)
    # a weight's Cast laid out otherwise than its users is a vertex of its own: its layout is
    # where the plan stores the weight (a search may cast it whole and slice it for its user)
    cg = CostGraph(graph, devices, constants, dataset_strategy, False, configured,
                   weight_casts=follows)
    options = IlpOptions(profile, memory_capacity, training, optimizer_states, enable_alltoall,
                         pipeline=pipeline)
    costs = Costs(cg, options, parameters_agree=False)
    folding = fold(cg, costs.stages, costs.grad)
    edges = mapped_edges(cg, folding)
    choice = {v.index: 0 for v in cg.vertices}
    totals = stage_totals(cg, costs, folding, edges, choice, parallel_optimizer, recompute)
    compute, comm, memory = summarise(totals)
    comm_bytes = max(st.comm_bytes for st in totals)  # the busiest stage's rank
    stages = stages_summary(totals, costs) if pipeline is not None else None
    return Prediction(profile, memory_capacity, compute, comm, comm_bytes, memory,
                      parallel_optimizer, recompute, stages)


def _following_casts(graph: Graph) -> set[Node]:
    """The Casts of a weight laid out as every user of theirs reads them (the weight
    stored as its users want it, as `--search ilp` plans and MindSpore's propagation of a
    configured strategy lay it out)."""
    out: set[Node] = set()
    for node in graph.nodes:
        if node.op != "Cast" or len(node.operands) != 1 or node.parallel is None:
            continue
        if stored_param(node.operands[0]) is None or not node.parallel.in_strategy:
            continue
        mine = tuple(node.parallel.in_strategy[0])
        uses = node.result.uses
        if uses and all(u.parallel is not None and u.parallel.in_strategy is not None
                        and i < len(u.parallel.in_strategy)
                        and tuple(u.parallel.in_strategy[i]) == mine for u, i in uses):
            out.add(node)
    return out


def fit_advice(p: Prediction, devices: int) -> str:
    """One line for a plan predicted not to fit: its memory, the device's, and what would fit."""
    m = p.memory
    ways = []
    if not p.parallel_optimizer and m.optimizer + m.gradients > 0:
        ways.append("the parallel optimizer (enable_parallel_optimizer=True) shards the "
                    f"{(m.optimizer + m.gradients + m.weights) / 1e9:.1f} GB of weights, "
                    "gradients and optimizer states over their repeat groups")
    if not p.recompute and m.activations > 0:
        ways.append(f"recompute (Cell.recompute()) keeps less of the "
                    f"{m.activations / 1e9:.1f} GB of activations")
    if p.stages is not None:
        ways.append("more pipeline stages (each stage stores only its own layers)")
    ways.append(f"more than {devices} devices or `--search ilp`, which chooses a plan that fits")
    return (f"the plan is predicted to need {m.total / 1e9:.2f} GB per device "
            f"(weights {m.weights / 1e9:.2f}, gradients {m.gradients / 1e9:.2f}, optimizer "
            f"{m.optimizer / 1e9:.2f}, activations {m.activations / 1e9:.2f}), more than the "
            f"{p.memory_capacity / 1e9:.2f} GB of a {p.profile.name} device; "
            + "; ".join(ways))
