"""Evaluates an `ir.Graph` on numpy arrays: the reference interpreter's op loop.

Local ops run through each registry entry's `numpy` callable; collectives go through a
`Collectives` runtime, so the same loop runs one rank alone (`SingleRank`: eager mode, a
single-device program) or a rank among many (`backends.numpy` supplies collectives that meet
the other ranks). Every result is checked against the node's inferred type, so a wrong
implementation or inference rule is caught where it happens.

With `float64=True` every floating-point value is computed in float64 whatever its dtype in the
graph (parameters, constants, results, and the target of every Cast to a float type): the
program's arithmetic without its rounding. The oracle compares plans this way, so that a check
decides whether a plan is right independently of the precision it runs in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pcompile.ir.core import Constant, Graph, Node, Value, constant_at
from pcompile.ir.registry import OpDef, get_op
from pcompile.ir.types import DType, TensorType, TupleType, ValueType


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


def value_dtype(dtype: DType, float64: bool = False) -> np.dtype[Any]:
    """The numpy dtype a value of `dtype` is held in (float64 for every float in float64 mode)."""
    return np.dtype(np.float64) if float64 and dtype.is_float else np.dtype(dtype.np)


def node_attrs(opdef: OpDef, node: Node, float64: bool = False) -> dict[str, Any]:
    """The attributes the numpy implementation receives; in float64 mode a float dtype
    attribute (a Cast's target, a OneHot's dtype, ...) becomes float64."""
    attrs = opdef.impl_attrs(node.attrs)
    if float64:
        for key, value in attrs.items():
            if isinstance(value, DType) and value.is_float:
                attrs[key] = DType.float64
    return attrs


def constant_value(value: Constant, float64: bool = False, rank: int | None = None
                   ) -> np.ndarray:
    """A constant's data (on `rank`, for a rank-dependent constant)."""
    array = constant_at(value, rank)
    if float64 and value.dtype.is_float:
        return array.astype(np.float64)
    return array


def checked_result(node: Node, expected: ValueType, got: Any, float64: bool = False) -> Any:
    """`got`, the numpy result of `node`, checked against its inferred type `expected` and held
    in the dtype the interpreter keeps it in (`value_dtype`)."""
    if isinstance(expected, TupleType):
        if not isinstance(got, tuple) or len(got) != len(expected.elements):
            raise AssertionError(f"{node.where()}: numpy result is not a {expected}")
        return tuple(checked_result(node, e, g, float64) for e, g in zip(expected.elements, got))
    assert isinstance(expected, TensorType)
    arr = np.asarray(got)
    if arr.shape != expected.shape:
        raise AssertionError(
            f"{node.where()}: numpy result shape {arr.shape} != inferred {expected.shape}"
        )
    want = value_dtype(expected.dtype, float64)
    if arr.dtype != want:
        arr = arr.astype(want)
    return arr


def run_graph(
    graph: Graph,
    feeds: Mapping[str, Any] | Sequence[Any],
    collectives: Collectives | None = None,
    float64: bool = False,
) -> list[Any]:
    """Run `graph`. `feeds` maps parameter names to arrays (or lists them in parameter order).
    Returns the outputs in order (see the module docstring for `float64`)."""
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
        env[id(param)] = arr.astype(value_dtype(param.dtype, float64), copy=False)

    def read(value: Value) -> Any:
        if isinstance(value, Constant):
            return constant_value(value, float64)
        try:
            return env[id(value)]
        except KeyError:
            raise RuntimeError(f"value {value!r} used before it is defined") from None

    # IEEE arithmetic as on the devices: an overflow (a loss scale's, on purpose) gives inf or
    # NaN without a numpy warning; runs and checks report non-finite results themselves.
    with np.errstate(all="ignore"):
        for node in graph.nodes:
            args = [read(v) for v in node.operands]
            opdef = get_op(node.op)
            if opdef.collective:
                out = comm.run(node, args)
            else:
                assert opdef.numpy is not None, f"{node.op} has no numpy implementation"
                out = opdef.numpy(*args, **node_attrs(opdef, node, float64))
            env[id(node.result)] = checked_result(node, node.result.type, out, float64)
    return [read(v) for v in graph.outputs]


__all__ = ["Collectives", "SingleRank", "checked_result", "constant_value", "node_attrs",
           "run_graph", "value_dtype"]
