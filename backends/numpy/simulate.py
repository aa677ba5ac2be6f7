"""All ranks in one process: the per-rank graphs run in lockstep with simulated collectives.

The per-rank graphs of one plan have the same structure (they differ in slice offsets and
groups), so node k of every rank executes together; a collective at position k reads the
inputs of the members of each rank's group. Graphs that differ in structure (hand-written
per-rank code) run on threads that meet at each collective instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pcompile.ir.core import Constant, Graph, Node, Value
from pcompile.ir.interpret import (
    Collectives,
    checked_result,
    constant_value,
    node_attrs,
    run_graph,
    value_dtype,
)
from pcompile.ir.rank import resolve, resolve_attrs
from pcompile.ir.registry import get_op

#: The reductions of AllReduce and ReduceScatter, by their `op` attribute.
_REDUCE: dict[str, Callable[..., Any]] = {"sum": np.sum, "max": np.max, "min": np.min,
                                          "prod": np.prod}


def _reduced(node: Node, xs: list[np.ndarray]) -> Any:
    fn = _REDUCE[node.attrs.get("op", "sum")]
    return fn(np.stack(xs), axis=0).astype(xs[0].dtype)


def _all_reduce(node: Node, xs: list[np.ndarray], mine: int) -> Any:
    return _reduced(node, xs)


def _all_gather(node: Node, xs: list[np.ndarray], mine: int) -> Any:
    return np.concatenate(xs, axis=0)


def _reduce_scatter(node: Node, xs: list[np.ndarray], mine: int) -> Any:
    return np.split(_reduced(node, xs), len(xs), axis=0)[mine]


def _all_to_all(node: Node, xs: list[np.ndarray], mine: int) -> Any:
    count = node.attrs["split_count"]
    split_dim, concat_dim = node.attrs["split_dim"], node.attrs["concat_dim"]
    parts = [np.split(x, count, axis=split_dim)[mine] for x in xs]
    return np.concatenate(parts, axis=concat_dim)


def _broadcast(node: Node, xs: list[np.ndarray], mine: int) -> Any:
    return xs[node.attrs.get("root_rank", 0)].copy() if len(xs) > 1 else xs[0].copy()


#: One row per collective that runs over a group (`ir.registry.group_collectives`; a test
#: checks the two agree): f(node, every member's input in group order, this rank's position in
#: the group) -> this rank's output.
COLLECTIVES: dict[str, Callable[[Node, list[np.ndarray], int], Any]] = {
    "AllReduce": _all_reduce,
    "AllGather": _all_gather,
    "ReduceScatter": _reduce_scatter,
    "AlltoAll": _all_to_all,
    "Broadcast": _broadcast,
}


def collective_result(node: Node, rank: int, inputs: dict[int, list[np.ndarray]]) -> Any:
    """The output on `rank` of collective `node`, given every group member's inputs."""
    ranks = tuple(resolve(node.attrs["rank_list"], rank))
    if rank not in ranks:
        raise RuntimeError(f"{node.where()}: rank {rank} is not in its group {ranks}")
    run = COLLECTIVES.get(node.op)
    if run is None:
        raise RuntimeError(f"unknown collective {node.op}")
    return run(node, [inputs[r][0] for r in ranks], ranks.index(rank))


def run_ranks(graphs: Sequence[Graph], feeds: Sequence[Sequence[Any]],
              float64: bool = False) -> list[list[Any]]:
    """Run every rank's graph; `feeds[r]` lists rank r's parameter values in order
    (`float64`: see ir.interpret). Overflow gives inf or NaN without a numpy warning, as in
    `run_graph`."""
    if _same_structure(graphs):
        with np.errstate(all="ignore"):
            return _lockstep(graphs, feeds, float64)
    return _threaded(graphs, feeds, float64)  # each thread's run_graph


def _same_structure(graphs: Sequence[Graph]) -> bool:
    first = [n.op for n in graphs[0].nodes]
    return all([n.op for n in g.nodes] == first for g in graphs[1:])


def _lockstep(graphs: Sequence[Graph], feeds: Sequence[Sequence[Any]],
              float64: bool) -> list[list[Any]]:
    envs: list[dict[int, Any]] = []
    for g, values in zip(graphs, feeds):
        env = {}
        for p, v in zip(g.params, values):
            arr = np.asarray(v)
            if arr.shape != p.shape:
                raise ValueError(f"rank graph parameter {p.name}: expected {p.shape}, got "
                                 f"{arr.shape}")
            env[id(p)] = arr.astype(value_dtype(p.dtype, float64), copy=False)
        envs.append(env)

    def read(env: dict[int, Any], value: Value, rank: int) -> Any:
        if isinstance(value, Constant):
            return constant_value(value, float64, rank)
        return env[id(value)]

    for k in range(len(graphs[0].nodes)):
        nodes = [g.nodes[k] for g in graphs]
        opdef = get_op(nodes[0].op)
        args = [[read(env, v, r) for v in node.operands]
                for r, (env, node) in enumerate(zip(envs, nodes))]
        if opdef.collective:
            by_rank = dict(enumerate(args))
            outs = [collective_result(node, r, by_rank) for r, node in enumerate(nodes)]
        else:
            assert opdef.numpy is not None
            outs = [opdef.numpy(*a, **resolve_attrs(node_attrs(opdef, node, float64), r))
                    for r, (a, node) in enumerate(zip(args, nodes))]
        for env, node, out in zip(envs, nodes, outs):
            env[id(node.result)] = checked_result(node, node.result.type, out, float64)
    return [[read(env, v, r) for v in g.outputs] for r, (env, g) in enumerate(zip(envs, graphs))]


class _Exchange(Collectives):
    """Threads meet here: each collective call deposits its input and waits for the group."""

    def __init__(self, rank: int, shared: dict, lock: threading.Condition) -> None:
        self.rank = rank
        self.shared = shared
        self.lock = lock
        self.counts: dict[tuple[int, ...], int] = {}

    def run(self, node: Node, inputs: list[np.ndarray]) -> Any:
        ranks = tuple(resolve(node.attrs["rank_list"], self.rank))
        seq = self.counts.get(ranks, 0)
        self.counts[ranks] = seq + 1
        key = (ranks, seq)
        with self.lock:
            slot = self.shared.setdefault(key, {})
            slot[self.rank] = inputs
            self.lock.notify_all()
            if not self.lock.wait_for(lambda: len(slot) == len(ranks), timeout=60):
                raise RuntimeError(f"{node.where()}: collective timed out waiting for {ranks}")
        return collective_result(node, self.rank, slot)


def _threaded(graphs: Sequence[Graph], feeds: Sequence[Sequence[Any]],
              float64: bool) -> list[list[Any]]:
    shared: dict = {}
    lock = threading.Condition()
    results: list[Any] = [None] * len(graphs)
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            results[rank] = run_graph(graphs[rank], list(feeds[rank]),
                                      _Exchange(rank, shared, lock), float64)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(graphs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
