"""Why the search chose each strategy, in the terms the search itself compared.

**Invariant.** For every op a search decides by comparing candidates, the explanation prints
the chosen strategy's cost and the best other candidate's (`runner_up`) under the comparison
the search made, computed from the same cost model (`cost_model.py`, `cost_graph.py`); the
chosen cost is never above the runner-up's (`tests/passes/test_search_random.py` checks it on random
graphs for every mode):

* dynamic programming (`local_explanation`): the op's objective (`alpha * computation + beta *
  communication`, plus `lagrange * memory` when the memory bound is active) plus the
  redistributions on all its edges, the neighbours fixed at the plan. A plan of least total
  objective cannot be improved by changing one op, so the chosen candidate minimises this;
  the runner-up is taken among the candidates the search considered (all of them, or the
  `enable_algo_approxi` sample);
* sharding propagation (`propagation_explanation`): MindSpore's `CompareSwcCost` over the edges
  to the neighbours that were decided when the op was (`decision.edges`): redistribution
  communication, then redistribution computation, then the op's forward communication, then
  `Strategy::Compare`. Edges to neighbours decided later are not part of the choice; their
  redistribution shows in `redistribution` (all edges at the plan) only;
* ops a search did not decide by comparison print no runner-up: recursive programming's
  partition (its own cost, `recursive_programming.py`), strategies loaded from a checkpoint,
  and ops propagation never reached (their first candidate).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import inf
from typing import Any

import numpy as np

from pcompile.ir.parallel_info import ParallelInfo, RunnerUp, SearchCost, SwcCost
from pcompile.passes.search.cost_graph import CostGraph, Vertex
from pcompile.passes.search.cost_model import ZERO, Cost, printable


def swc_key(cg: CostGraph, v: Vertex, k: int, comm: float, comp: float
            ) -> tuple[float, float, float, int, tuple[int, ...]]:
    """`CompareSwcCost` as a sort key (smaller is better): redistribution communication and
    computation, own forward communication, then `Strategy::Compare` (larger product of
    splits, then the lexicographically larger strategy)."""
    cand = v.candidates[k]
    flat = tuple(x for s in cand.strategy for x in s)
    own = cg.op_costs(v)[k].comm_forward
    return comm, comp, own, -cand.split_product, tuple(-x for x in flat)


def decision_rows(cg: CostGraph, v: Vertex, choice: Sequence[int], edges: Sequence[int]
                  ) -> list[list[Cost]]:
    """For each edge of `edges` (in- or out-edges of `v`), the redistribution cost of every
    candidate of `v` with the neighbour fixed at `choice`."""
    rows = []
    for ei in edges:
        e = cg.edges[ei]
        if e.dst == v.index:
            rows.append(cg.costs_to(e, choice[e.src]))
        else:
            rows.append(cg.costs_from(e, choice[e.dst]))
    return rows


def swc_terms(rows: list[list[Cost]], n: int) -> tuple[list[float], list[float]]:
    """Summed redistribution communication and computation per candidate."""
    comm = [sum(row[k].communication for row in rows) for k in range(n)]
    comp = [sum(row[k].computation for row in rows) for k in range(n)]
    return comm, comp


def _cached(cg: CostGraph, key: tuple[Any, ...], make: Any) -> dict[str, Any]:
    """Explanations by (op signature, choice, the cost rows involved): the rows are cached
    objects of the cost graph, so the repeated layers of a deep model are explained once."""
    hit = cg.explain_cache.get(key)
    if hit is None:
        hit = make()
        cg.explain_cache[key] = hit
    return {**hit, "cost": dict(hit["cost"]), "redistribution": dict(hit["redistribution"])}


def _row_ids(cg: CostGraph, v: Vertex, choice: Sequence[int], edges: Sequence[int]
             ) -> tuple[int, ...]:
    return tuple(id(row) for row in decision_rows(cg, v, choice, edges))


def _base(cg: CostGraph, v: Vertex, k: int, choice: Sequence[int], decided_by: str
          ) -> dict[str, Any]:
    """What every explanation holds: the strategy, its own cost terms and the redistribution
    on all its edges with the neighbours at the plan."""
    edge = ZERO
    for row in decision_rows(cg, v, choice, v.in_edges + v.out_edges):
        edge = edge + row[k]
    return {"strategy": v.candidates[k].strategy,
            "cost": cg.op_costs(v)[k].as_dict(cg.constants),
            "redistribution": edge.as_dict(cg.constants),
            "candidates": len(v.candidates),
            "decided_by": decided_by}


def local_objectives(cg: CostGraph, v: Vertex, choice: Sequence[int], lagrange: float = 0.0
                     ) -> np.ndarray:
    """Dynamic programming's local objective of every candidate of `v` (see above)."""
    c = cg.constants
    local: np.ndarray = cg.op_objectives(v).copy()
    if lagrange:
        local += lagrange * np.array([x.memory for x in cg.op_costs(v)])
    for row in decision_rows(cg, v, choice, v.in_edges + v.out_edges):
        local += np.fromiter((x.objective(c) for x in row), dtype=np.float64, count=len(row))
    return local


def local_explanation(cg: CostGraph, v: Vertex, choice: Sequence[int], lagrange: float = 0.0,
                      allowed: Sequence[int] | None = None) -> dict[str, Any]:
    """Dynamic programming: the local objective of the choice and of the runner-up."""
    key = ("local", v.signature, choice[v.index], lagrange,
           tuple(allowed) if allowed is not None else None,
           _row_ids(cg, v, choice, v.in_edges + v.out_edges))
    return _cached(cg, key, lambda: _local(cg, v, choice, lagrange, allowed))


def _local(cg: CostGraph, v: Vertex, choice: Sequence[int], lagrange: float,
           allowed: Sequence[int] | None) -> dict[str, Any]:
    k = choice[v.index]
    info = _base(cg, v, k, choice, "dynamic programming")
    local = local_objectives(cg, v, choice, lagrange)
    info["local_objective"] = printable(float(local[k]))
    if lagrange:
        info["lagrange"] = printable(lagrange)
    others = [i for i in (allowed if allowed is not None else range(len(v.candidates)))
              if i != k]
    if others:
        r = min(others, key=lambda i: (local[i], i))
        info["runner_up"] = {"strategy": v.candidates[r].strategy,
                             "local_objective": printable(float(local[r]))}
    return info


def _swc_dict(comm: float, comp: float, forward: float) -> dict[str, float | None]:
    return {"communication": printable(comm), "computation": printable(comp),
            "forward": printable(forward)}


def propagation_explanation(cg: CostGraph, v: Vertex, choice: Sequence[int],
                            edges: Sequence[int], names: str) -> dict[str, Any]:
    """Sharding propagation: `CompareSwcCost` over the edges that decided the op."""
    key = ("propagation", v.signature, choice[v.index], names, _row_ids(cg, v, choice, edges),
           _row_ids(cg, v, choice, v.in_edges + v.out_edges))
    info = _cached(cg, key, lambda: _propagation(cg, v, choice, edges, names))
    info["decision"] = dict(info["decision"])
    return info


def _propagation(cg: CostGraph, v: Vertex, choice: Sequence[int], edges: Sequence[int],
                 names: str) -> dict[str, Any]:
    k = choice[v.index]
    info = _base(cg, v, k, choice, "sharding propagation")
    n = len(v.candidates)
    comm, comp = swc_terms(decision_rows(cg, v, choice, edges), n)
    own = cg.op_costs(v)
    info["decision"] = {"edges": names, **_swc_dict(comm[k], comp[k], own[k].comm_forward)}
    others = [i for i in range(n) if i != k]
    if others:
        r = min(others, key=lambda i: swc_key(cg, v, i, comm[i], comp[i]))
        info["runner_up"] = {"strategy": v.candidates[r].strategy,
                             **_swc_dict(comm[r], comp[r], own[r].comm_forward)}
    return info


def plain_explanation(cg: CostGraph, v: Vertex, choice: Sequence[int], decided_by: str
                      ) -> dict[str, Any]:
    """An op the search did not decide by comparing candidates."""
    key = ("plain", v.signature, choice[v.index], decided_by,
           _row_ids(cg, v, choice, v.in_edges + v.out_edges))
    return _cached(cg, key, lambda: _base(cg, v, choice[v.index], choice, decided_by))


def annotate(parallel: ParallelInfo, info: dict[str, Any]) -> None:
    """Set the `cost`, `decision` and `runner_up` (or `decided_by`) annotations of the
    step_parallel_begin dump from an explanation (infinite costs, None in it, are inf)."""
    parallel.cost = SearchCost(_number(info["cost"]["objective"]),
                               _number(info["redistribution"]["objective"]),
                               _number(info["local_objective"]) if "local_objective" in info
                               else None)
    decision = info.get("decision")
    if decision is not None:
        parallel.decision = _swc_cost(decision)
    runner = info.get("runner_up")
    if runner is not None:
        if "local_objective" in runner:
            parallel.runner_up = RunnerUp(runner["strategy"],
                                          local=_number(runner["local_objective"]))
        else:
            parallel.runner_up = RunnerUp(runner["strategy"], swc=_swc_cost(runner))
    if "runner_up" not in info:
        parallel.decided_by = info["decided_by"]


def _number(value: float | None) -> float:
    return inf if value is None else value


def _swc_cost(terms: dict[str, Any]) -> SwcCost:
    return SwcCost(_number(terms["communication"]), _number(terms["computation"]),
                   _number(terms["forward"]))


__all__ = ["annotate", "local_explanation", "local_objectives", "plain_explanation",
           "propagation_explanation", "swc_key"]
