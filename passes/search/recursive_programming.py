"""Recursive programming, MindSpore's double-recursive search (SAPP, reference §4.4).

The device count must be a power of two, D = 2^R. A strategy is a split count per dimension
label of an op (`ir.sharding` labels), all 1 at the start. The **outer recursion** runs R rounds;
each round bisects the machine: every op, visited in **reverse topological order** (the inner
pass), halves at most one of its labels (`_partition_round`). The op picks the option of least

    op_cost(option) + sum over neighbours already decided in this round of redis(option)

* MatMul / BatchMatMul (`matmul_costs`), with i, j, k the current local sizes of the row,
  column and reduced labels: cut I costs `j*k/2 * rp_matmul_mem_coef`, cut J `i*k/2`, cut K
  `i*j/2`, no cut `min(cut I, cut J, cut K)^2 / 25` (REPLICATE_BELOW); a batch label costs
  `min(i*k, k*j, i*j)/2 / 32` (NUMBER_ASCEND_CORES: batch splits need no communication); J and
  K are never both cut on one MatMul;
* batch-only ops (OneHot, the softmax cross-entropies, Gather) may cut only their batch label,
  other ops (element-wise, Softmax, LayerNorm, BiasAdd, Transpose, reductions, ...) any
  splittable label; both at no cost of their own, so the choice follows the neighbours;
* a label is cut only if its local size is even and at least 2, and never when unsplittable;
* `redis`: for each edge to a neighbour decided in this round, if the two ops halve different
  dims of the shared tensor (through a Reshape the leading dims of merged or split groups
  correspond, `reshape.dim_map`), the tensor's local size times REDIS_COEF = 16.

Ops that read only parameters and constants (a Cast or StridedSlice of a weight) take no part:
MindSpore's SAPP eliminates such element-wise ops from the partition and its propagation
reaches them only from their producer, which they do not have, so they keep `((1, ...))`
(`test_auto_parallel_sapp_strided_slice.py`: the StridedSlice of a parameter feeding a MatMul
through a Reshape stays `[[1, 1, 1]]`; `test_auto_parallel_parameter_cast.py`: the Casts of a
parameter stay `[[1, 1]]`). They are fixed at their all-ones candidate for phase 2.

`_VirtualDataset` takes part with its `dataset_strategy` decomposed into one halving per round
(dims in order); with `MS_INTERFERED_SAPP=1` (`SearchOptions.interfered_sapp`) user `shard()`
strategies are fixed the same way, otherwise the search ignores them (step_parallel_begin still
applies them).

Phase 2 (`recursive_search`): the splits become strategies (a Gather's is MindSpore's own,
`gather_strategy`; a valid strategy that is no candidate, under `fully_use_devices`, becomes
one); an op whose strategy the rule refuses, a FlashAttentionScore (`FROM_PRODUCER`), and every
user but the first of a shared parameter whose layouts disagree, are left undecided; sharding
propagation (`sharding_propagation.propagate`) from the decided ops gives their strategies and
keeps shared parameters consistent.

Cost: O(R * (ops + edges)), linear in the number of layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import log2, prod

from pcompile.ir.core import Constant, GraphParam, Node
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops.shape import shard_batch_and_axis
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.sharding import (
    Labels,
    Strategy,
    StrategyError,
    is_power_of_two,
    label_dims,
    rule_for,
)
from pcompile.passes.reshape_layout import dim_map
from pcompile.passes.search.candidates import make_candidate, op_context
from pcompile.passes.search.cost_graph import CostGraph, Vertex
from pcompile.passes.search.sharding_propagation import propagate

#: Ops whose strategy SAPP takes from the layout its query's producer gives them (through
#: a Reshape, on the first dims that fit), not from the partition:
#: test_auto_parallel_sapp_flash_attention.py checks FlashAttentionScore's batch and
#: sequence splits against the MatMul before its Reshape in every input layout.
FROM_PRODUCER = frozenset({"FlashAttentionScore"})

REDIS_COEF = 16.0
REPLICATE_BELOW = 25.0
NUMBER_ASCEND_CORES = 32.0


def check_devices(devices: int) -> None:
    if not is_power_of_two(devices):
        raise PcompileError(
            "The recursive auto parallel strategy searching mode requires the device num be "
            f"the power of 2, but the device num is {devices}; use a power-of-two device "
            "count or search_mode='sharding_propagation' / 'dynamic_programming'"
        )


@dataclass
class RecOp:
    """One participant of the partition: an op, or a fixed `_VirtualDataset` / configured op
    with its halvings given per round. Labels are per input / output tensor, one per dim."""

    vertex: int
    kind: str  # "matmul", "batch", "common" or "fixed"
    in_labels: list[list[str]]
    out_labels: list[list[str]]
    sizes: dict[str, int]
    allowed: list[str]  # labels it may cut, in preference order
    splits: dict[str, int] = field(default_factory=dict)
    schedule: list[str | None] = field(default_factory=list)  # "fixed": label per round
    ijk: tuple[str, str, str] = ("", "", "")
    batch: tuple[str, ...] = ()

    def local(self, label: str) -> int:
        return self.sizes[label] // self.splits.get(label, 1)


@dataclass
class RPResult:
    choice: list[int]
    via: dict[int, str]
    splits: dict[int, dict[str, int]]
    partitioned: set[int] = field(default_factory=set)  # vertices the partition decided
    decision: dict[int, list[int]] = field(default_factory=dict)  # the others: propagation


def _halvings(splits: dict[str, int], order: list[str]) -> list[str | None]:
    out: list[str | None] = []
    for label in order:
        out += [label] * int(round(log2(max(1, splits.get(label, 1)))))
    return out


def _matmul_labels(labels: Labels) -> tuple[tuple[str, str, str], tuple[str, ...]]:
    out = labels.outputs[0]
    used = set("".join(labels.inputs))
    reduced = [x for x in dict.fromkeys("".join(labels.inputs)) if x not in out]
    k = reduced[0] if reduced else ""
    return (out[-2], out[-1], k), tuple(x for x in out[:-2] if x in used)


def _dataset_op(index: int, layouts: list[TensorLayout]) -> RecOp:
    labels = [[f"d{i}_{j}" for j in range(len(lay.shape))] for i, lay in enumerate(layouts)]
    sizes: dict[str, int] = {}
    splits: dict[str, int] = {}
    for labs, lay in zip(labels, layouts):
        for name, size, count in zip(labs, lay.shape, lay.splits):
            sizes[name], splits[name] = size, count
    op = RecOp(index, "fixed", [], labels, sizes, [], splits)
    op.schedule = _halvings(splits, [x for labs in labels for x in labs])
    return op


def weight_only(v: Vertex) -> bool:
    """An unconfigured op reading only parameters and constants (a Cast or StridedSlice of a
    weight): it takes no part in the partition and stays unsplit (see the module doc)."""
    node = v.node
    return (node is not None and not v.configured and bool(node.operands) and all(
        isinstance(x, Constant) or (isinstance(x, GraphParam) and x.kind != "input")
        for x in node.operands))


def build_ops(cg: CostGraph, interfered: bool) -> list[RecOp]:
    ops: list[RecOp] = []
    for v in cg.vertices:
        if v.kind == "dataset":
            ops.append(_dataset_op(v.index, v.candidates[0].out_layouts))
            continue
        if v.kind != "op" or v.node is None or weight_only(v):
            continue
        node = v.node
        rule = rule_for(node.op)
        assert rule is not None
        ctx = op_context(node, cg.devices)
        labels = rule.labels(ctx)
        dims = label_dims(ctx, labels)
        sizes = {d.name: d.size for d in dims}
        for labs, t in zip(labels.outputs, ctx.out_types):
            for x, s in zip(labs, t.shape):
                sizes.setdefault(x, s)
        splittable = [d.name for d in dims if d.splittable]
        if has_trait(node.op, Trait.MATMUL):
            kind = "matmul"
            allowed = splittable
        elif has_trait(node.op, Trait.BATCH_ONLY):
            kind = "batch"
            batch_in = labels.inputs[1 if has_trait(node.op, Trait.LOOKUP) else 0]
            allowed = [x for x in batch_in[:1] if x in splittable]
        else:
            kind = "common"
            allowed = splittable
        op = RecOp(v.index, kind, [list(x) for x in labels.inputs],
                   [list(x) for x in labels.outputs], sizes, allowed)
        if kind == "matmul":
            op.ijk, op.batch = _matmul_labels(labels)
        if v.configured and interfered:
            user: dict[str, int] = {}
            for labs, counts in zip(labels.inputs, v.candidates[0].strategy):
                for x, c in zip(labs, counts):
                    user.setdefault(x, c)
            op.kind = "fixed"
            op.splits = user
            op.schedule = _halvings(user, [d.name for d in dims])
        ops.append(op)
    return ops


def matmul_costs(op: RecOp, coef: float) -> dict[str | None, float]:
    i_l, j_l, k_l = op.ijk
    i, j = op.local(i_l), op.local(j_l)
    k = op.local(k_l) if k_l else 1
    cut_i, cut_j, cut_k = j * k / 2 * coef, i * k / 2, i * j / 2
    costs: dict[str | None, float] = {}
    for b in op.batch:
        costs[b] = min(i * k, k * j, i * j) / 2 / NUMBER_ASCEND_CORES
    costs[i_l] = cut_i
    costs[j_l] = cut_j
    if k_l:
        costs[k_l] = cut_k
    costs[None] = min(cut_i, cut_j, cut_k) ** 2 / REPLICATE_BELOW
    if op.splits.get(j_l, 1) > 1:
        costs.pop(k_l, None)
    if k_l and op.splits.get(k_l, 1) > 1:
        costs.pop(j_l, None)
    return costs


def _options(op: RecOp, coef: float) -> dict[str | None, float]:
    cuttable = [x for x in op.allowed if op.local(x) >= 2 and op.local(x) % 2 == 0]
    if op.kind == "matmul":
        costs = matmul_costs(op, coef)
        return {x: c for x, c in costs.items() if x is None or x in cuttable}
    out: dict[str | None, float] = {x: 0.0 for x in cuttable}
    if not out:
        out[None] = 0.0
    return out


class _Partition:
    def __init__(self, cg: CostGraph, ops: list[RecOp], coef: float) -> None:
        self.cg = cg
        self.ops = ops
        self.coef = coef
        self.by_vertex = {op.vertex: op for op in ops}
        self.maps: dict[int, dict[int, int] | None] = {}

    def tensor_cut(self, labels: list[str], cut: str | None) -> int | None:
        """The dim of a tensor (given by its labels) that halving `cut` splits."""
        if cut is None or cut not in labels:
            return None
        return labels.index(cut)

    def edge_map(self, ei: int) -> dict[int, int] | None:
        """Producer dim -> consumer dim of an edge (None: same shape)."""
        if ei not in self.maps:
            e = self.cg.edges[ei]
            src = self.cg.vertices[e.src].candidates[0].out_layouts[e.src_out].shape
            dst = self.cg.vertices[e.dst].candidates[0].in_layouts[e.dst_in].shape
            self.maps[ei] = None if src == dst else dim_map(src, dst)
        return self.maps[ei]

    def redis(self, op: RecOp, cut: str | None, decided: dict[int, str | None]) -> float:
        cg = self.cg
        v = cg.vertices[op.vertex]
        total = 0.0
        for ei in v.in_edges + v.out_edges:
            e = cg.edges[ei]
            other = e.src if e.dst == op.vertex else e.dst
            if other not in decided:
                continue
            prod_op = self.by_vertex[e.src]
            cons_op = self.by_vertex[e.dst]
            prod_cut = decided[e.src] if e.src != op.vertex else cut
            cons_cut = decided[e.dst] if e.dst != op.vertex else cut
            p = self.tensor_cut(prod_op.out_labels[e.src_out], prod_cut)
            c = self.tensor_cut(cons_op.in_labels[e.dst_in], cons_cut)
            mapping = self.edge_map(ei)
            if mapping is not None and p is not None:
                p = mapping.get(p, -1)
            if p != c:
                labs = cons_op.in_labels[e.dst_in]
                total += prod(cons_op.local(x) for x in labs) * REDIS_COEF
        return total

    def round(self, r: int) -> None:
        decided: dict[int, str | None] = {}
        for op in self.ops:
            if op.kind == "fixed":
                decided[op.vertex] = op.schedule[r] if r < len(op.schedule) else None
        order = sorted((op for op in self.ops if op.kind != "fixed"),
                       key=lambda o: self.cg.vertices[o.vertex].topo, reverse=True)
        for op in order:
            options = _options(op, self.coef)
            best, best_cost = None, None
            for cut, own in options.items():
                cost = own + self.redis(op, cut, decided)
                if best_cost is None or cost < best_cost:
                    best, best_cost = cut, cost
            decided[op.vertex] = best
            if best is not None:
                op.splits[best] = op.splits.get(best, 1) * 2


def partition(cg: CostGraph, interfered: bool, coef: float) -> list[RecOp]:
    """The R rounds of bisection; returns the participants with their final splits."""
    check_devices(cg.devices)
    ops = build_ops(cg, interfered)
    part = _Partition(cg, ops, coef)
    for r in range(int(log2(cg.devices))):
        part.round(r)
    return ops


def _candidate_index(cg: CostGraph, v: Vertex, strategy: Strategy) -> int | None:
    """The index of `strategy` among `v`'s candidates. SAPP sets the strategies it finds
    whatever `fully_use_devices` says (Gather ((1,), (4,)) on 8 devices), so a valid strategy
    that is no candidate becomes one; None: the rule refuses it (propagation decides `v`)."""
    for index, cand in enumerate(v.candidates):
        if cand.strategy == strategy:
            return index
    assert v.node is not None
    rule = rule_for(v.node.op)
    assert rule is not None
    try:
        sharding = rule.apply(op_context(v.node, cg.devices), strategy)
    except StrategyError:
        return None
    cg.add_candidates(v, [make_candidate(sharding)])
    return next((i for i, c in enumerate(v.candidates) if c.strategy == strategy), None)


def _halve_dims(shape: list[int], dims: list[int], devices: int) -> dict[int, int]:
    """Halve each of `dims` in turn while even, until the cuts use `devices`."""
    cut, splits = 1, {d: 1 for d in dims}
    for d in dims:
        while shape[d] > 0 and shape[d] % 2 == 0 and cut < devices:
            shape[d] //= 2
            cut *= 2
            splits[d] *= 2
        if cut == devices:
            break
    return splits


def gather_strategy(node: Node, devices: int) -> Strategy | None:
    """MindSpore's SAPP strategy for a Gather (rec_generate_strategy's PrepareGather), which
    replaces what the partition found: axis 0 halves the indices' dim 0, then the table's,
    until all devices are used; axis 1 splits the output (dim 0 first, then the others
    largest first) and reads the table's dim 0 and the indices' dims from it. A split
    gathered axis with split indices outside the shard-batch-and-axis mode goes back to 1.
    None (the partition's strategy stays) for `batch_dims` and other axes."""
    if node.attrs.get("batch_dims"):
        return None
    table, idx = (tuple(x.shape) for x in node.operands)
    axis = int(node.attrs.get("axis", 0)) % max(1, len(table))
    if axis == 0 and table and idx:
        shapes = [list(table), list(idx)]
        cut = 1
        counts = [[1] * len(table), [1] * len(idx)]
        for i in (1, 0):  # the indices first
            while shapes[i][0] % 2 == 0 and shapes[i][0] > 0 and cut < devices:
                shapes[i][0] //= 2
                cut *= 2
                counts[i][0] *= 2
            if cut == devices:
                break
        strategy: Strategy = (tuple(counts[0]), tuple(counts[1]))
    elif axis == 1 and len(table) == 2:
        out = list(node.result.shape)
        rest = sorted(range(1, len(out)), key=lambda d: -out[d])  # stable: ties keep order
        got = _halve_dims(out, [0] + rest, devices)
        strategy = ((got[0], 1), tuple(got[len(table) - 1 + i] for i in range(len(idx))))
    else:
        return None
    ctx = op_context(node, devices)
    if (strategy[0][axis] != 1 and any(c != 1 for c in strategy[1])
            and not shard_batch_and_axis(ctx, strategy)):
        strategy = (tuple(1 if d == axis else c for d, c in enumerate(strategy[0])),
                    strategy[1])
    return strategy


def recursive_search(cg: CostGraph, options: object) -> RPResult:
    interfered = bool(getattr(options, "interfered_sapp", False))
    ops = partition(cg, interfered, cg.constants.rp_matmul_mem_coef)
    fixed: dict[int, int] = {}
    splits: dict[int, dict[str, int]] = {}
    for v in cg.vertices:
        if v.kind == "op" and weight_only(v):
            fixed[v.index] = next(
                (i for i, c in enumerate(v.candidates)
                 if all(x == 1 for dims in c.strategy for x in dims)), 0)
    for op in ops:
        v = cg.vertices[op.vertex]
        if v.kind != "op" or v.configured:
            continue
        strategy = tuple(tuple(op.splits.get(x, 1) for x in labs) for labs in op.in_labels)
        assert v.node is not None
        if v.node.op == "Gather":
            strategy = gather_strategy(v.node, cg.devices) or strategy
        splits[op.vertex] = dict(op.splits)
        if v.node.op in FROM_PRODUCER:
            continue
        index = _candidate_index(cg, v, strategy)
        if index is not None:
            fixed[op.vertex] = index
    for p in cg.vertices:
        if p.kind != "param":
            continue
        users = sorted((cg.edges[ei] for ei in p.out_edges),
                       key=lambda e: cg.vertices[e.dst].topo)
        first_key = None
        for e in users:
            u = cg.vertices[e.dst]
            k: int | None = 0 if u.configured else fixed.get(u.index)
            if k is None:
                continue
            key = u.candidates[k].in_keys[e.dst_in]
            if first_key is None:
                first_key = key
                match = [i for i, c in enumerate(p.candidates) if c.out_keys[0] == key]
                if match:
                    fixed[p.index] = match[0]
            elif key != first_key and not u.configured:
                fixed.pop(u.index, None)
    prop = propagate(cg, fixed, cross_reshape_chains=True)
    via = {vi: "recursive programming (reads only parameters: unsplit)"
           if weight_only(cg.vertices[vi]) else "recursive programming" for vi in fixed}
    for vi, why in prop.via.items():
        via.setdefault(vi, why)
    decision = {vi: edges for vi, edges in prop.decision.items() if vi not in fixed}
    return RPResult(prop.choice, via, splits, set(fixed), decision)
