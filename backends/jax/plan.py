"""SPMD analysis of a list of rank graphs (no JAX import).

The ranks of one plan run graphs of the same structure: node k is the same op on every rank,
with the same operand wiring and result types. They differ in attributes (StridedSlice offsets,
the groups of collectives) and in some constants. `SpmdPlan.build(rank_graphs)` checks that and
records, per node, how one SPMD program serves every rank:

* `op`: the same op with the same attributes everywhere. Constants that differ between ranks are
  stacked into tables (`const_tables`, shape `(N, *shape)`) indexed by the rank.
* `slice` / `slice_grad`: StridedSlice(Grad) whose begin/end differ between ranks but whose
  slice sizes agree: a `dynamic_slice` (`dynamic_update_slice`) at per-rank offsets (`starts`,
  shape `(N, rank of the tensor)`).
* `switch`: any other op whose attributes differ: one branch per distinct attribute set, chosen
  by a per-rank index (`variant`).
* `collective`: the groups of all ranks (`rank_list` of each rank's node) must partition the
  ranks into blocks of one size. Ranks are laid out on a mesh of prime-sized axes (`MeshSpec`,
  rank = row-major index); a block structure that equals "vary these mesh axes, in this order"
  lowers to one JAX collective over those axes (`axes`). Others use the exact fallback: gather
  from all ranks and pick the group's members (`members`, `position` tables; N times the data).

The mesh's axis order (for sizes that are not all equal) is chosen to align the most
collectives. Everything here is deterministic, so generated programs are byte-identical.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from pcompile.backends.jax.collectives import COLLECTIVES
from pcompile.ir.core import Constant, Graph, GraphParam, Node, NodeResult, RankConstant, Value
from pcompile.ir.rank import RankGroup, RankOffsets, has_rank_values, resolve_attrs
from pcompile.ir.registry import get_op

# Attributes that do not change what a non-collective op computes (its implementation ignores
# them); they may differ between ranks freely.
IGNORED_RANK_ATTRS: dict[str, frozenset[str]] = {
    "_MirrorOperator": frozenset({"group", "rank_list", "fusion", "dev_num", "mean_flag",
                                  "parameter"}),
}


class SpmdLoweringError(Exception):
    """The rank graphs cannot be run as one SPMD program (the message says why)."""


# -- mesh ---------------------------------------------------------------------------------------


def prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


@dataclass(frozen=True)
class MeshSpec:
    """Axis names and sizes of the rank mesh; rank r sits at the row-major coordinate of r."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def from_sizes(sizes: tuple[int, ...]) -> MeshSpec:
        if not sizes:
            sizes = (1,)
        return MeshSpec(tuple(f"r{i}" for i in range(len(sizes))), tuple(sizes))

    @property
    def size(self) -> int:
        return prod(self.sizes)

    def coord(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.sizes):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def rank(self, coord: tuple[int, ...]) -> int:
        r = 0
        for c, size in zip(coord, self.sizes):
            r = r * size + c
        return r


def group_along(mesh: MeshSpec, rank: int, axes: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks that share `rank`'s coordinates off `axes`, ordered row-major over `axes` in
    the given order (the order JAX uses for a collective over that tuple of axis names)."""
    base = list(mesh.coord(rank))
    out = []
    for combo in itertools.product(*(range(mesh.sizes[a]) for a in axes)):
        coord = list(base)
        for a, c in zip(axes, combo):
            coord[a] = c
        out.append(mesh.rank(tuple(coord)))
    return tuple(out)


def align_groups(mesh: MeshSpec, groups: list[tuple[int, ...]]) -> tuple[int, ...] | None:
    """Mesh axis indices (in collective order) whose groups are exactly `groups[r]` for every
    rank r (same members in the same order), or None."""
    first = groups[0]
    coords = [mesh.coord(r) for r in first]
    varying = [a for a in range(len(mesh.sizes)) if len({c[a] for c in coords}) > 1]
    if prod(mesh.sizes[a] for a in varying) != len(first):
        return None
    for perm in itertools.permutations(varying):
        if group_along(mesh, first[0], perm) != first:
            continue
        if all(group_along(mesh, r, perm) == g for r, g in enumerate(groups)):
            return tuple(perm)
    return None


def align_digits(mesh: MeshSpec, group: RankGroup) -> tuple[int, ...] | None:
    """Mesh axis indices (in mesh order) whose variation gives exactly `group`'s members at
    every rank, or None. Both the mesh and the device matrices are row-major over the ranks,
    so a digit (stride s, count c) is a run of mesh axes when s and s * c are cut points of
    the mesh; members ascend, which is the row-major order of the axes in mesh order."""
    strides = [prod(mesh.sizes[j + 1:]) for j in range(len(mesh.sizes))]
    cuts = set(strides) | {mesh.size}
    axes: list[int] = []
    for stride, count in group.digits:
        if stride not in cuts or stride * count not in cuts:
            return None
        axes += [j for j, s in enumerate(strides) if stride <= s < stride * count]
    return tuple(sorted(axes))


def layout_axes(layout: Any, mesh: MeshSpec) -> tuple[tuple[str, ...] | None, ...] | None:
    """The mesh axes each dim of a TensorLayout is split over (None: not split), i.e. the
    PartitionSpec of the global tensor on the rank mesh; None when a device-matrix axis is not
    a set of mesh axes."""
    from pcompile.ir.layout import axis_index, devices_along_axes, map_axes

    dev = layout.dev_matrix
    if prod(dev) != mesh.size:
        return None
    out: list[tuple[str, ...] | None] = []
    for entry in layout.tensor_map:
        names: list[str] = []
        for value in map_axes(entry):
            a = axis_index(value, dev)
            groups = [devices_along_axes(r, dev, [a]) for r in range(mesh.size)]
            axes = align_groups(mesh, groups)
            if axes is None:
                return None
            names += [mesh.names[i] for i in axes]
        out.append(tuple(names) or None)
    return tuple(out)


# -- per-node plans -----------------------------------------------------------------------------


@dataclass
class CollectivePlan:
    """How a collective runs: over mesh axes (`axes`, names) or by the gather fallback.
    Its groups are given per rank (`rank_groups`) or, in a rank-parametric graph, as one
    `RankGroup` (`group`) that `groups` evaluates for every rank when it is needed."""

    op: str
    rank_groups: tuple[tuple[int, ...], ...] | None
    axes: tuple[str, ...] | None
    attrs: dict[str, Any]
    group: RankGroup | None = None
    num_ranks: int = 0

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """groups[r]: rank r's group in rank_list order."""
        if self.rank_groups is None:
            assert self.group is not None
            self.rank_groups = tuple(self.group.table(self.num_ranks))
        return self.rank_groups

    def group_of(self, rank: int) -> tuple[int, ...]:
        return self.group.at(rank) if self.group is not None else self.groups[rank]

    @property
    def group_size(self) -> int:
        return len(self.group) if self.group is not None else len(self.groups[0])

    @property
    def members(self) -> np.ndarray:
        return np.asarray(self.groups, np.int32)

    @property
    def positions(self) -> np.ndarray:
        return np.asarray([g.index(r) for r, g in enumerate(self.groups)], np.int32)


@dataclass
class SlicePlan:
    """A StridedSlice(Grad) at per-rank offsets: `starts[r]` per dim, `span` elements read
    (written) from there, every `steps`-th kept; `shape` is the full (Grad: output) shape."""

    starts: np.ndarray  # (N, rank) int32
    span: tuple[int, ...]
    steps: tuple[int, ...]
    shape: tuple[int, ...]
    #: The offsets as arithmetic on the rank (`ir.rank.RankOffsets`) when the slice is a
    #: layout's: the program computes them from the rank index instead of reading `starts`,
    #: so its size does not grow with the device count.
    offsets: RankOffsets | None = None


@dataclass
class NodePlan:
    index: int
    node: Node  # rank 0's node: op, operands and result of the structure
    kind: str  # "op" | "slice" | "slice_grad" | "switch" | "collective"
    attrs: dict[str, Any]  # implementation attributes (rank 0's)
    operands: list[tuple[str, int]]  # ("node", k) | ("param", i) | ("const", i)
    const_tables: dict[int, np.ndarray] = field(default_factory=dict)  # operand -> (N, ...)
    slice: SlicePlan | None = None
    variants: list[dict[str, Any]] = field(default_factory=list)
    variant: tuple[int, ...] = ()  # rank -> index into variants
    collective: CollectivePlan | None = None

    @property
    def op(self) -> str:
        return self.node.op


@dataclass
class SpmdPlan:
    """One SPMD program for all ranks (see the module docstring)."""

    graphs: list[Graph]
    mesh: MeshSpec
    nodes: list[NodePlan]
    outputs: list[tuple[str, int]]

    @property
    def num_ranks(self) -> int:
        return len(self.graphs)

    @property
    def graph(self) -> Graph:
        return self.graphs[0]

    @property
    def params(self) -> list[GraphParam]:
        return list(self.graphs[0].params)

    @staticmethod
    def build(graphs: list[Graph]) -> SpmdPlan:
        if not graphs:
            raise SpmdLoweringError("no rank graphs")
        n = len(graphs)
        if all(g is graphs[0] for g in graphs):
            return _build_parametric(graphs, n)
        _check_structure(graphs)
        raw: list[tuple[int, Node, list[Node]]] = []
        collective_groups: list[list[tuple[int, ...]]] = []
        for k, node in enumerate(graphs[0].nodes):
            nodes = [g.nodes[k] for g in graphs]
            raw.append((k, node, nodes))
            if get_op(node.op).collective:
                collective_groups.append(_groups(nodes, n))
        mesh = choose_mesh(n, collective_groups)
        ref = _Refs(graphs[0])
        plans = [plan_node(k, node, ref, n, mesh, nodes) for k, node, nodes in raw]
        outputs = [ref(v) for v in graphs[0].outputs]
        return SpmdPlan(list(graphs), mesh, plans, outputs)


def choose_mesh(n: int, collective_groups: list[Any]) -> MeshSpec:
    """Prime-sized mesh axes; among the distinct orders of the primes, the one that aligns the
    most collectives (first in sorted order on ties). A collective's groups are given per rank
    or as one `RankGroup`."""
    primes = prime_factors(n)
    orders = distinct_orders(primes, 720)
    best, best_score = MeshSpec.from_sizes(tuple(primes)), -1
    if len(orders) == 1:
        return best
    for order in orders:
        mesh = MeshSpec.from_sizes(order)
        score = sum((align_digits(mesh, g) if isinstance(g, RankGroup)
                     else align_groups(mesh, g)) is not None for g in collective_groups)
        if score > best_score:
            best, best_score = mesh, score
    return best


def distinct_orders(items: list[int], limit: int) -> list[tuple[int, ...]]:
    """The first `limit` distinct orders of `items`, in sorted order: what
    `sorted(set(itertools.permutations(items)))[:limit]` gives, without making every
    permutation (2048 devices are eleven 2s: 40 million permutations of one order, 14 s)."""
    order = sorted(items)
    out: list[tuple[int, ...]] = []
    while len(out) < limit:
        out.append(tuple(order))
        i = len(order) - 2  # the next order in sorted order: the classic next permutation
        while i >= 0 and order[i] >= order[i + 1]:
            i -= 1
        if i < 0:
            break
        j = len(order) - 1
        while order[j] <= order[i]:
            j -= 1
        order[i], order[j] = order[j], order[i]
        order[i + 1:] = reversed(order[i + 1:])
    return out


class _Refs:
    """Where a value comes from, as ("node", k) | ("param", i) | ("const", -1)."""

    def __init__(self, graph: Graph) -> None:
        self.nodes = {id(node.result): k for k, node in enumerate(graph.nodes)}
        self.params = {id(p): i for i, p in enumerate(graph.params)}

    def __call__(self, value: Value) -> tuple[str, int]:
        if isinstance(value, NodeResult):
            return ("node", self.nodes[id(value)])
        if isinstance(value, GraphParam):
            return ("param", self.params[id(value)])
        if isinstance(value, Constant):
            return ("const", -1)
        raise SpmdLoweringError(f"unknown value {value!r}")


def _check_structure(graphs: list[Graph]) -> None:
    first = graphs[0]
    ref0 = _Refs(first)
    sig0 = [(p.name, p.kind, p.type) for p in first.params]
    for r, g in enumerate(graphs[1:], start=1):
        if g is first:
            continue
        ref = _Refs(g)
        if [(p.name, p.kind, p.type) for p in g.params] != sig0:
            raise SpmdLoweringError(f"rank {r}'s graph parameters differ from rank 0's")
        if len(g.nodes) != len(first.nodes):
            raise SpmdLoweringError(
                f"rank {r}'s graph has {len(g.nodes)} nodes, rank 0's {len(first.nodes)}: the "
                "ranks do not share one structure (hand-written per-rank code?)"
            )
        if len(g.outputs) != len(first.outputs):
            raise SpmdLoweringError(f"rank {r}'s graph returns a different number of outputs")
        for out_a, out_b in zip(first.outputs, g.outputs):
            if ref0(out_a) != ref(out_b) or out_a.type != out_b.type:
                raise SpmdLoweringError(f"rank {r}'s graph outputs differ from rank 0's")
        for k, (a, b) in enumerate(zip(first.nodes, g.nodes)):
            if a.op != b.op or a.result.type != b.result.type:
                raise SpmdLoweringError(
                    f"node %{k} is {a.op} {a.result.type} on rank 0 but {b.op} {b.result.type} "
                    f"on rank {r}: the ranks do not share one structure"
                )
            if len(a.operands) != len(b.operands):
                raise SpmdLoweringError(f"node %{k} ({a.op}) has different operands on rank {r}")
            for va, vb in zip(a.operands, b.operands):
                if ref0(va) != ref(vb) or va.type != vb.type:
                    raise SpmdLoweringError(
                        f"node %{k} ({a.where()}) reads different values on rank 0 and rank {r}"
                    )


def _groups(nodes: list[Node], n: int) -> list[tuple[int, ...]]:
    node = nodes[0]
    groups = [tuple(int(x) for x in (nd.attrs.get("rank_list") or (0,))) for nd in nodes]
    if n == 1:
        if groups[0] != (0,):
            raise SpmdLoweringError(f"{node.where()}: one rank, but rank_list {groups[0]}")
        return groups
    for r, g in enumerate(groups):
        if r not in g:
            raise SpmdLoweringError(
                f"node {node.where()}: rank {r}'s rank_list {g} does not contain rank {r}")
        if any(not 0 <= x < n for x in g):
            raise SpmdLoweringError(f"node {node.where()}: rank_list {g} names a rank >= {n}")
    for r, g in enumerate(groups):
        for member in g:
            if groups[member] != g:
                raise SpmdLoweringError(
                    f"node {node.where()}: rank {r}'s group is {g} but rank {member}'s is "
                    f"{groups[member]}; the groups must partition the ranks (same members, "
                    "same order)"
                )
    if len({len(g) for g in groups}) != 1:
        raise SpmdLoweringError(
            f"node {node.where()}: groups of different sizes {sorted(set(groups))}")
    return groups


def _impl_attrs(node: Node) -> dict[str, Any]:
    attrs = get_op(node.op).jax_attrs(node)
    ignored = IGNORED_RANK_ATTRS.get(node.op, frozenset())
    return {k: v for k, v in attrs.items() if k not in ignored}


def _collective_attrs(node: Node) -> dict[str, Any]:
    """The attributes of collective `node` that the JAX lowering reads (its row in
    backends/jax/collectives.py), in the node's order."""
    row = COLLECTIVES.get(node.op)
    if row is None:
        raise SpmdLoweringError(f"{node.where()}: no SPMD lowering for collective {node.op}")
    return {k: v for k, v in node.attrs.items() if k in row.attrs}


def _slice_plan(node: Node, nodes: list[Node],
                rank_attrs: list[dict[str, Any]] | None = None) -> SlicePlan | None:
    """`rank_attrs[r]`: rank r's attributes (default: those of `nodes[r]`)."""
    from pcompile.ir.ops.shape import slice_spec

    if node.op == "StridedSlice":
        shape = node.operands[0].shape
    else:
        shape = tuple(int(d) for d in node.attrs["shape"])
    starts, spans, steps_seen = [], set(), set()
    for attrs in rank_attrs if rank_attrs is not None else [nd.attrs for nd in nodes]:
        if node.op == "StridedSliceGrad" and tuple(attrs["shape"]) != shape:
            return None
        slices, out = slice_spec(shape, attrs)
        starts.append([s.start for s in slices])
        steps = tuple(s.step for s in slices)
        spans.add(tuple((o - 1) * st + 1 if o else 0 for o, st in zip(out, steps)))
        steps_seen.add(steps)
    if len(spans) != 1 or len(steps_seen) != 1:
        return None
    span = spans.pop()
    if any(d == 0 for d in span):
        return None
    return SlicePlan(np.asarray(starts, np.int32), span, steps_seen.pop(), tuple(shape))


_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")


def _affine_slice_plan(node: Node, impl: dict[str, Any], n: int) -> SlicePlan | None:
    """A StridedSlice(Grad) whose begin and end are one `RankOffsets` apart by a fixed span
    (a layout's slice): planned without visiting the ranks one by one. None when the slice
    has another form (masks, rank-dependent strides or spans, a window that could leave the
    tensor), which `_slice_plan` handles rank by rank."""
    begin, end, strides = impl.get("begin"), impl.get("end"), impl.get("strides")
    if not (isinstance(begin, RankOffsets) and isinstance(end, RankOffsets)
            and begin.terms == end.terms and isinstance(strides, tuple)
            and all(isinstance(st, int) and st > 0 for st in strides)
            and all(impl.get(m, 0) == 0 for m in _MASKS)):
        return None
    if node.op == "StridedSlice":
        shape = tuple(node.operands[0].shape)
    else:
        raw = impl.get("shape")
        if not isinstance(raw, (tuple, list)) or not all(isinstance(d, int) for d in raw):
            return None
        shape = tuple(raw)
    if not len(shape) == len(begin.base) == len(strides):
        return None
    span, steps = [], []
    for d, (b, e, st) in enumerate(zip(begin.base, end.base, strides)):
        length = e - b
        reach = b + sum((c - 1) * u for _, c, u in begin.terms[d])  # the last rank's begin
        if b < 0 or length <= 0 or reach + length > shape[d]:
            return None
        count = -(-length // st)
        span.append((count - 1) * st + 1)
        steps.append(st)
    starts = begin.array(n).astype(np.int32)
    return SlicePlan(starts, tuple(span), tuple(steps), shape, offsets=begin)


def _build_parametric(graphs: list[Graph], n: int) -> SpmdPlan:
    """The plan of one rank-parametric graph run by all `n` ranks (`ir.rank` values say what
    differs between them)."""
    graph = graphs[0]
    collective_groups: list[Any] = []
    for node in graph.nodes:
        if get_op(node.op).collective:
            group = node.attrs.get("rank_list")
            collective_groups.append(group if isinstance(group, RankGroup)
                                     else _groups([node] * n, n))
    mesh = choose_mesh(n, collective_groups)
    ref = _Refs(graph)
    tables: dict[Any, np.ndarray] = {}  # one table per distinct per-rank constant
    plans = [plan_node(k, node, ref, n, mesh, tables=tables)
             for k, node in enumerate(graph.nodes)]
    return SpmdPlan(list(graphs), mesh, plans, [ref(v) for v in graph.outputs])


def plan_node(k: int, node: Node, ref: _Refs, n: int, mesh: MeshSpec,
              nodes: list[Node] | None = None,
              tables: dict[Any, np.ndarray] | None = None) -> NodePlan:
    """The plan of node `k` for all `n` ranks: `nodes` holds node k of each rank's own graph
    (`node` is rank 0's); without them `node` is of one rank-parametric graph that every rank
    runs (`ir.rank` values say what differs between ranks; `tables` shares the per-rank
    constant tables between its nodes)."""
    opdef = get_op(node.op)
    operands = [("const", i) if isinstance(v, Constant) else ref(v)
                for i, v in enumerate(node.operands)]
    impl = _impl_attrs(node)
    plan = NodePlan(k, node, "op", impl if nodes is not None else resolve_attrs(impl, 0),
                    operands)
    if nodes is not None:
        _rank_graph_constants(plan, nodes)
    else:
        _parametric_constants(plan, n, tables)
    if opdef.collective:
        plan.kind = "collective"
        plan.collective = _collective_plan(node, nodes, n, mesh)
        return plan
    if opdef.jax is None:
        raise SpmdLoweringError(f"{node.where()}: {node.op} has no JAX implementation")
    if nodes is not None:
        per_rank = [_impl_attrs(nd) for nd in nodes]
        if all(a == per_rank[0] for a in per_rank[1:]):
            return plan
        sliced = _slice_plan(node, nodes) if node.op in _SLICES else None
    else:
        if not has_rank_values(impl):
            return plan
        sliced = _affine_slice_plan(node, impl, n) if node.op in _SLICES else None
        if sliced is None:
            per_rank = [resolve_attrs(impl, r) for r in range(n)]
            if node.op in _SLICES:
                sliced = _slice_plan(node, [node] * n, per_rank)
    if sliced is not None:
        plan.kind = "slice" if node.op == "StridedSlice" else "slice_grad"
        plan.slice = sliced
        return plan
    variants: list[dict[str, Any]] = []
    index = []
    for attrs in per_rank:
        if attrs not in variants:
            variants.append(attrs)
        index.append(variants.index(attrs))
    plan.kind = "switch"
    plan.variants = variants
    plan.variant = tuple(index)
    return plan


_SLICES = ("StridedSlice", "StridedSliceGrad")


def _rank_graph_constants(plan: NodePlan, nodes: list[Node]) -> None:
    """Constants that differ between the ranks' graphs become tables."""
    for i, v in enumerate(plan.node.operands):
        if isinstance(v, Constant):
            arrays = [nd.operands[i].array for nd in nodes]  # type: ignore[attr-defined]
            if any(not np.array_equal(arrays[0], a) for a in arrays[1:]):
                plan.const_tables[i] = np.stack(arrays)


def _parametric_constants(plan: NodePlan, n: int, tables: dict[Any, np.ndarray] | None) -> None:
    """A rank-parametric graph's per-rank constants become tables; the same constant laid out
    alike (a table per layer's use of a rotary or mask constant) is one array: 80 layers on
    1024 ranks held 80 copies."""
    for i, v in enumerate(plan.node.operands):
        if isinstance(v, RankConstant):
            key = (v.data, v.dtype)
            table = tables.get(key) if tables is not None else None
            if table is None:
                table = np.stack([v.array_at(r) for r in range(n)])
                if tables is not None:
                    tables[key] = table
            plan.const_tables[i] = table


def _collective_plan(node: Node, nodes: list[Node] | None, n: int,
                     mesh: MeshSpec) -> CollectivePlan:
    """How collective `node` runs: over the mesh axes that give its groups, or the fallback.
    Its groups are the ranks' own (`nodes`) or one `RankGroup` of a rank-parametric graph."""
    attrs = _collective_attrs(node)
    group = node.attrs.get("rank_list") if nodes is None else None
    if isinstance(group, RankGroup):
        if group.world != n:
            raise SpmdLoweringError(
                f"{node.where()}: its group spans {group.world} ranks, the program {n}")
        axes = align_digits(mesh, group)
        names = tuple(mesh.names[a] for a in axes) if axes is not None else None
        return CollectivePlan(node.op, None, names, attrs, group, n)
    groups = _groups(nodes if nodes is not None else [node] * n, n)
    axes = align_groups(mesh, groups)
    names = tuple(mesh.names[a] for a in axes) if axes is not None else None
    return CollectivePlan(node.op, tuple(groups), names, attrs, num_ranks=n)
