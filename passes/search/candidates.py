"""Candidate strategies of one op, in MindSpore's order (reference §4.0, §8).

MindSpore's `GenerateStrategiesForIndependentInputsBase` concatenates the splittable dims of all
inputs and recurses depth-first from the first one; every dim tries 1, 2, 4, ... as long as the
value divides both the devices not yet assigned and the dim size. The list is lexicographic with
the last dim varying fastest, and the search algorithms break ties by that order.

With dimension labels (`ir.sharding`), dims that must be split equally share a label, so the
recursion runs over the **distinct labels in order of first appearance** (`label_dims`); for
MatMul that is the virtual tensor `[batch..., i, k, j]`. Then:

* unsplittable labels (softmax axis, normalised dims, broadcast dims, ...) stay at 1;
* `fully_use_devices` keeps only strategies whose device product is the device count (or 1);
* a device count `2^a * m` with odd `m > 1` enumerates the `2^a` part and then multiplies `m`
  onto one splittable dim (each dim that divides, in order), as
  `GenerateStrategiesForIndependentInputs` does;
* every strategy goes through the op's rule (`LabelRule.apply`), so only strategies the rule
  accepts survive, each with its `OpSharding` (layouts and forward communication).

`CandidateTable` caches the list per op *signature* (op, operand types, attributes, devices):
the layers of a deep model repeat, so each distinct op is enumerated once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from pcompile.ir.core import Node
from pcompile.ir.errors import OpError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.sharding import (
    LabelDim,
    OpContext,
    OpSharding,
    Strategy,
    StrategyError,
    label_dims,
    rule_for,
    strategy_from_splits,
)

LayoutKey = tuple[Any, ...]


def layout_key(layout: TensorLayout) -> LayoutKey:
    """Hashable normalised form: two layouts with equal keys are equal layouts (§1.1)."""
    n = layout.normalized()
    return (n.dev_matrix, n.tensor_map, n.shape)


@dataclass(frozen=True)
class Candidate:
    """One valid strategy of an op with what it implies."""

    strategy: Strategy
    sharding: OpSharding
    in_keys: tuple[LayoutKey, ...]
    out_keys: tuple[LayoutKey, ...]
    # The strategy as `Layout` dicts, one per input, for a strategy given or built as layouts
    # (`neighbour_layouts.py`): what step_parallel_begin needs to lay the op out exactly so
    spec: tuple[Any, ...] | None = None
    # the ReduceScatter form of a strategy with a split reduced dim (`--search ilp`): the
    # out_strategy that scatters the sum over the output's first dim (sequence parallelism)
    out_strategy: Strategy | None = None

    @property
    def in_layouts(self) -> list[TensorLayout]:
        return self.sharding.in_layouts

    @property
    def out_layouts(self) -> list[TensorLayout]:
        return self.sharding.out_layouts

    @property
    def by_layout(self) -> bool:
        """The strategy is layouts (a `Layout` in `shard()`, or one built under a
        neighbour's device matrix), not split counts."""
        return self.spec is not None

    @property
    def split_product(self) -> int:
        """Product of every value of the strategy (`Strategy::Compare`'s first key)."""
        return prod(c for s in self.strategy for c in s)


def make_candidate(sharding: OpSharding, spec: tuple[Any, ...] | None = None,
                   out_strategy: Strategy | None = None) -> Candidate:
    return Candidate(
        sharding.strategy,
        sharding,
        tuple(layout_key(lay) for lay in sharding.in_layouts),
        tuple(layout_key(lay) for lay in sharding.out_layouts),
        spec,
        out_strategy,
    )


#: ops whose ReduceScatter form `--search ilp` weighs (`CandidateTable(reduce_scatter=True)`)
REDUCE_SCATTER_OPS = ("MatMul", "BatchMatMul")


def reduce_scatter_forms(ctx: OpContext, cands: list[Candidate]) -> list[Candidate]:
    """For each candidate whose forward communication is one summing AllReduce, the same
    strategy with the sum reduce-scattered over the output's first dim (MindSpore's
    `out_strategy` with dim 0 split further by the reduced dims), where that dim divides."""
    rule = rule_for(ctx.op)
    out: list[Candidate] = []
    if rule is None:
        return out
    for cand in cands:
        comms = [c for c in cand.sharding.forward if c.kind != "Div"]
        if len(comms) != 1 or comms[0].kind != "AllReduce" or comms[0].op != "sum" \
                or len(cand.out_layouts) != 1:
            continue
        red = prod(cand.sharding.dev_matrix[a] for a in comms[0].axes)
        want = cand.out_layouts[0].splits
        form = ((want[0] * red, *want[1:]),)
        try:
            sharding = rule.apply(ctx, cand.strategy, form)
        except StrategyError:
            continue
        if any(c.kind == "ReduceScatter" for c in sharding.forward):
            out.append(make_candidate(sharding, cand.spec, form))
    return out


def power_of_two_part(devices: int) -> int:
    """The largest power of two dividing `devices`."""
    return devices & -devices


def enumerate_splits(dims: Sequence[LabelDim], devices: int,
                     fully_use_devices: bool = False) -> list[tuple[int, ...]]:
    """Split counts per label (in `dims` order), MindSpore's depth-first order."""
    base = power_of_two_part(devices)
    odd = devices // base

    def rec(i: int, remaining: int) -> Iterator[tuple[int, ...]]:
        if i == len(dims):
            yield ()
            return
        dim = dims[i]
        count = 1
        while True:
            for rest in rec(i + 1, remaining // count):
                yield (count,) + rest
            count *= 2
            if not dim.splittable or remaining % count or dim.size % count:
                break

    out: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    for splits in rec(0, base):
        variants = [splits]
        if odd > 1:
            variants = [
                splits[:k] + (c * odd,) + splits[k + 1:]
                for k, (dim, c) in enumerate(zip(dims, splits))
                if dim.splittable and dim.size % (c * odd) == 0
            ] or [splits]
        for v in variants:
            used = prod(v)
            if fully_use_devices and used not in (1, devices):
                continue
            if v not in seen:
                seen.add(v)
                out.append(v)
    return out


def op_context(node: Node, devices: int) -> OpContext:
    in_types = [v.tensor_type for v in node.operands]  # ops with a rule take no tuples
    return OpContext(node.op, in_types, node.result.type, node.attrs, devices)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return str(value)
    return value


def node_signature(node: Node, devices: int) -> tuple[Any, ...]:
    """What the candidates of `node` depend on: op, operand types, attributes, devices."""
    attrs = {k: v for k, v in node.attrs.items() if k not in ("in_strategy", "out_strategy")}
    return (
        node.op,
        tuple(str(v.type) for v in node.operands),
        str(node.result.type),
        _freeze(attrs),
        devices,
    )


def candidate_strategies(ctx: OpContext, fully_use_devices: bool = False) -> list[OpSharding]:
    """Every valid strategy of the op in `ctx`, in MindSpore's order, with its sharding."""
    rule = rule_for(ctx.op)
    if rule is None:
        return []
    labels = rule.labels(ctx)
    dims = label_dims(ctx, labels)
    out: list[OpSharding] = []
    for splits in enumerate_splits(dims, ctx.devices, fully_use_devices):
        strategy = strategy_from_splits(labels, {d.name: c for d, c in zip(dims, splits)})
        if not rule.searchable(ctx, strategy):
            continue
        try:
            out.append(rule.apply(ctx, strategy))
        except StrategyError:
            continue
    return out


class CandidateTable:
    """Candidates per op, cached by signature for one search."""

    def __init__(self, devices: int, fully_use_devices: bool = False,
                 reduce_scatter: bool = False) -> None:
        self.devices = devices
        self.fully_use_devices = fully_use_devices
        self.reduce_scatter = reduce_scatter  # add the ReduceScatter forms (`--search ilp`)
        self._cache: dict[tuple[Any, ...], list[Candidate]] = {}
        self._signatures: dict[int, tuple[Any, ...]] = {}

    def signature(self, node: Node) -> tuple[Any, ...]:
        sig = self._signatures.get(id(node))
        if sig is None:
            sig = node_signature(node, self.devices)
            self._signatures[id(node)] = sig
        return sig

    def for_node(self, node: Node) -> list[Candidate]:
        sig = self.signature(node)
        cands = self._cache.get(sig)
        if cands is None:
            try:
                ctx = op_context(node, self.devices)
                cands = [make_candidate(s)
                         for s in candidate_strategies(ctx, self.fully_use_devices)]
                if self.reduce_scatter and node.op in REDUCE_SCATTER_OPS:
                    cands += reduce_scatter_forms(ctx, cands)
            except StrategyError as exc:  # one message naming the op, not a traceback
                raise _no_candidates(node, self.devices, str(exc)) from None
            if not cands:
                raise _no_candidates(node, self.devices, "none of its strategies is valid")
            self._cache[sig] = cands
        return cands


def _no_candidates(node: Node, devices: int, why: str) -> OpError:
    return OpError(node.op, f"the search finds no strategy for it on {devices} devices: {why}",
                   instance_name=node.instance_name, scope=node.scope, source=node.source,
                   shapes=[getattr(v.type, "shape", None) for v in node.operands],
                   hint="give it a strategy with shard(), or choose a device count its "
                        "shapes divide")

