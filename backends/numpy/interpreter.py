"""Executes an `ir.Graph` with numpy.

Local ops run through each registry entry's `numpy` callable; collectives go through a
`Collectives` runtime, so the same interpreter runs one rank alone (`SingleRank`) or many ranks
in lockstep with simulated collectives. Every result is checked against the node's inferred type,
so a wrong implementation or inference rule is caught where it happens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pcompile.ir.core import Constant, Graph, Node, Value
from pcompile.ir.registry import get_op
from pcompile.ir.types import TensorType, TupleType, ValueType


class Collectives:
    """How collectives are executed; subclasses implement `run`."""

    def run(self, node: Node, inputs: list[np.ndarray]) -> Any:
        raise NotImplementedError


class SingleRank(Collectives):
    """A world of one: every group is this rank alone."""

    def run(self, node: Node, inputs: list[np.ndarray]) -> Any:
        ranks = tuple(node.attrs.get("rank_list") or (0,))
        if len(ranks) != 1:
            raise RuntimeError(
                f"{node.where()} communicates over ranks {ranks}, but this run has one rank; "
                "run the per-rank graphs with the multi-rank simulator"
            )
        # With one member every collective returns its input(s) unchanged.
        if len(inputs) == 1:
            return inputs[0].copy()
        return tuple(x.copy() for x in inputs)


def _check(node: Node, expected: ValueType, got: Any) -> Any:
    if isinstance(expected, TupleType):
        if not isinstance(got, tuple) or len(got) != len(expected.elements):
            raise AssertionError(f"{node.where()}: numpy result is not a {expected}")
        return tuple(_check(node, e, g) for e, g in zip(expected.elements, got))
    assert isinstance(expected, TensorType)
    arr = np.asarray(got)
    if arr.shape != expected.shape:
        raise AssertionError(
            f"{node.where()}: numpy result shape {arr.shape} != inferred {expected.shape}"
        )
    if arr.dtype != expected.dtype.np:
        arr = arr.astype(expected.dtype.np)
    return arr


def run_graph(
    graph: Graph,
    feeds: Mapping[str, Any] | Sequence[Any],
    collectives: Collectives | None = None,
) -> list[Any]:
    """Run `graph`. `feeds` maps parameter names to arrays (or lists them in parameter order).
    Returns the outputs in order."""
    comm = collectives or SingleRank()
    env: dict[int, Any] = {}
    if isinstance(feeds, Mapping):
        missing = [p.name for p in graph.params if p.name not in feeds]
        if missing:
            raise KeyError(f"graph {graph.name}: no value for parameter(s) {', '.join(missing)}")
        values = [feeds[p.name] for p in graph.params]
    else:
        if len(feeds) != len(graph.params):
            raise ValueError(
                f"graph {graph.name} takes {len(graph.params)} values, got {len(feeds)}"
            )
        values = list(feeds)
    for param, value in zip(graph.params, values):
        arr = np.asarray(value)
        if arr.shape != param.shape:
            raise ValueError(
                f"parameter {param.name}: expected shape {param.shape}, got {arr.shape}"
            )
        env[id(param)] = arr.astype(param.dtype.np, copy=False)

    def read(value: Value) -> Any:
        if isinstance(value, Constant):
            return value.array
        try:
            return env[id(value)]
        except KeyError:
            raise RuntimeError(f"value {value!r} used before it is defined") from None

    for node in graph.nodes:
        args = [read(v) for v in node.operands]
        opdef = get_op(node.op)
        if opdef.collective:
            out = comm.run(node, args)
        else:
            assert opdef.numpy is not None, f"{node.op} has no numpy implementation"
            out = opdef.numpy(*args, **opdef.impl_attrs(node.attrs))
        env[id(node.result)] = _check(node, node.result.type, out)
    return [read(v) for v in graph.outputs]


__all__ = ["Collectives", "SingleRank", "run_graph"]
