"""Communication fusion (`comm_fusion`, reference §6): bucket the collectives of each rank's
training graph and replace every bucket of two or more by ONE collective.

The pass is a pure IR rewrite of each rank's graph, run after the optimizer pass.

Candidates (reference §6.1-6.3) are the AllReduce / AllGather / ReduceScatter nodes whose
`fusion` attribute is > 0 and whose kind is enabled by `comm_fusion` (AllReduce by default,
AllGather and ReduceScatter only when configured):

* the gradient AllReduce emitted by each `_MirrorOperator`'s vjp (fusion = the parameter's
  `comm_fusion`, default 1);
* the parallel optimizer's AllGather (forward) and ReduceScatter (its vjp), which carry the
  parameter's fusion id too;
* user collectives given an id with `ops.AllReduce().add_prim_attr("fusion", k)`.

Collectives made by `shard` / redistribution / forward communication have `fusion: 0` and
are never fused, nor is a parameter whose `comm_fusion` is 0.

Bucketing. Candidates are taken in the graph's order, which for gradients is the backward
execution order (the gradient nearest the output first). They are grouped by the key
(op, group / rank_list, fusion id, dtype, reduce op); within a key:

* mode ``auto`` (64 MB) / ``size`` (MB): MindSpore's greedy `SetFusionBySize` on element
  counts with a threshold of ``MB x 262144`` elements (the opener of a new bucket is not
  subtracted from the budget, as in MindSpore);
* mode ``index`` (AllReduce only; also `all_reduce_fusion_config`): the backend's
  `GetSplitSegments`: each index closes a segment (inclusive), indices >= the number of
  candidates are ignored, the last candidate always closes a segment. As in MindSpore the
  indices apply to the world group; other groups fuse each key into one bucket;
* a member whose input depends on the output of another member of its bucket starts a new
  bucket (MindSpore's "communication zone"); this is re-checked on the graph being rewritten,
  so fusing one bucket never creates a cycle through another.

Rewrite. Each bucket of >= 2 members becomes: a Reshape of each member to 1-D (AllReduce,
AllGather) or to (n, size/n) (ReduceScatter, so that rank i's block of every member lands in
row i), one Concat, ONE collective, then a Split (equal member sizes) or a StridedSlice per
member, and a Reshape back to each member's result shape. For AllGather the gathered buffer is
reshaped to (n, total) and each member's columns are cut and reshaped to (n * d0, ...), which
is exactly the concatenation of the ranks' pieces along dim 0. The users of the old
collectives are rewired, the old collectives removed, and the new nodes placed right after the
last producer of a member input; users that came earlier are moved after it by a stable
topological re-sort.

Ids. Buckets are numbered per kind 1, 2, ... ordered by (the users' fusion id, position of the
first member), so that when every user id forms one bucket the fused ids are the user's ids.
The fused collective, the unfused single members and the `_MirrorOperator` of every member
parameter get `fusion: <id>` (MindSpore writes the id on the mirror); the fused collective's
parallel annotation lists the bucket (`fusion`, `members`, `bytes`). The `FusionReport` gives
`{parameter: id}` like MindSpore's `_get_allreduce_fusion` and the bucket list.

Differences from MindSpore (documented in docs/comm-fusion.md): the greedy size bucketing runs
per key, not over all candidates, and respects the users' ids instead of overwriting them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import networkx as nx

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Node, NodeResult, ParallelInfo, Value
from pcompile.ir.rank import RankGroup, RankValue, resolve
from pcompile.ir.registry import all_ops, get_op
from pcompile.passes.unit import CompileUnit

__all__ = [
    "FUSIBLE_OPS",
    "MB_TO_ELEMENTS",
    "CommFusionPass",
    "FusionBucket",
    "FusionConfig",
    "FusionReport",
    "KindConfig",
    "count_collectives",
    "fuse_communication",
]

_log = logging.getLogger(__name__)

MB_TO_ELEMENTS = 262144
"""MindSpore's `DEFAULT_THRESHOLD_MB_TO_BYTE`: a threshold of k MB is k x 262144 elements."""

FUSIBLE_OPS: dict[str, str] = {
    name: opdef.comm.fusion_key for name, opdef in all_ops().items()
    if opdef.comm is not None and opdef.comm.fusion_key
}
"""Op name -> its comm_fusion key: the collectives whose `CommFacts.fusion_key` (their op block
in `ir/ops/comm.py`) names one (AllReduce, AllGather, ReduceScatter)."""

_GRAD_SCOPE = "Gradients/"
_MAX_CONCAT = 1000  # Concat takes at most 1000 inputs; larger buckets concat in two levels


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KindConfig:
    """How one collective kind is bucketed: by size (`threshold_mb`) or at `split_indices`."""

    mode: str  # "auto" | "size" | "index"
    threshold_mb: int | None = None
    split_indices: tuple[int, ...] = ()

    @property
    def threshold_elements(self) -> int:
        """The size budget of a bucket, in elements (size modes)."""
        assert self.threshold_mb is not None, "index mode has no size threshold"
        return self.threshold_mb * MB_TO_ELEMENTS


@dataclass(frozen=True)
class FusionConfig:
    """What `fuse_communication` does: the switch, the enabled kinds and the world size (the
    group that index mode applies to; None: every group)."""

    openstate: bool = True
    kinds: dict[str, KindConfig] = field(
        default_factory=lambda: {"AllReduce": KindConfig("auto", 64)}
    )
    world_size: int | None = None

    def enabled(self, op: str) -> KindConfig | None:
        """The config of collective `op`, or None when it is not fused."""
        if not self.openstate:
            return None
        return self.kinds.get(op)

    def as_dict(self) -> dict[str, Any]:
        return {
            "openstate": self.openstate,
            "kinds": {op: asdict(k) for op, k in self.kinds.items()},
        }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


@dataclass
class FusionBucket:
    """One bucket: its members (parameter names, or the collective's name for user
    collectives) and the fused collective's full name ("" when the bucket has one member)."""

    kind: str
    fusion: int
    user_fusion: int
    group: str
    rank_list: tuple[int, ...]
    dtype: str
    members: tuple[str, ...]
    elements: int
    nbytes: int
    fused: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rank_list"] = list(self.rank_list)
        out["members"] = list(self.members)
        return out


@dataclass
class FusionReport:
    """The result of `fuse_communication` on one rank's graph."""

    buckets: list[FusionBucket] = field(default_factory=list)
    parameter_fusion: dict[str, int] = field(default_factory=dict)
    collectives_before: int = 0
    collectives_after: int = 0

    @property
    def fused_buckets(self) -> list[FusionBucket]:
        """The buckets that became one collective (two or more members)."""
        return [b for b in self.buckets if b.fused]

    def fusion_ids(self, kind: str = "AllReduce") -> dict[str, int]:
        """{member: bucket id} for one collective kind."""
        return {m: b.fusion for b in self.buckets if b.kind == kind for m in b.members}

    def as_dict(self) -> dict[str, Any]:
        return {
            "parameter_fusion": dict(self.parameter_fusion),
            "buckets": [b.as_dict() for b in self.buckets],
            "collectives_before": self.collectives_before,
            "collectives_after": self.collectives_after,
        }


def count_collectives(graph: Graph, ops: Iterable[str] | None = None) -> int:
    """The number of collective nodes of `graph` (only of `ops` when given)."""
    wanted = set(ops) if ops is not None else None
    return sum(
        1
        for n in graph.nodes
        if get_op(n.op).collective and (wanted is None or n.op in wanted)
    )


# --------------------------------------------------------------------------------------------
# Candidates and the parameters they belong to
# --------------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    node: Node
    position: int
    key: tuple[Any, ...]
    elements: int
    nbytes: int
    name: str  # the parameter, or the collective's own name


def _value_parameter(value: Value) -> str:
    """The weight a value is (directly, or through a `_MirrorOperator`), or ""."""
    if isinstance(value, GraphParam) and value.kind == "weight":
        return value.name
    if isinstance(value, NodeResult) and value.node.op == "_MirrorOperator":
        return _own_parameter(value.node)
    return ""


def _own_parameter(node: Node) -> str:
    """The parameter a forward node names itself (attr or annotation) or reads directly."""
    name = node.attrs.get("parameter")
    if isinstance(name, str) and name:
        return name
    if node.parallel is not None and node.parallel.parameter:
        return node.parallel.parameter
    if node.op == "_MirrorOperator" or get_op(node.op).collective:
        if node.operands:
            return _value_parameter(node.operands[0])
    return ""


def _signature(node: Node, scope: str, operand: Value, result: Value) -> tuple[Any, ...]:
    return (
        scope,
        str(node.source) if node.source else "",
        node.attrs.get("group"),
        node.attrs.get("rank_list"),
        node.attrs.get("fusion"),
        operand.type,
        result.type,
    )


@dataclass
class _Owners:
    """Which parameter each collective and mirror belongs to."""

    names: dict[Node, str] = field(default_factory=dict)  # collective -> parameter
    mirrors: dict[Node, str] = field(default_factory=dict)  # _MirrorOperator -> parameter
    mirror_of: dict[Node, Node] = field(default_factory=dict)  # gradient AllReduce -> mirror


def _parameter_names(graph: Graph) -> _Owners:
    """Map collectives and mirrors to their parameter.

    A forward anchor (a `_MirrorOperator`, or a collective that reads a weight, such as the
    parallel optimizer's AllGather) owns its parameter. A backward collective (scope
    `Gradients/...`) made by an anchor's vjp has the anchor's scope, source line, group and
    fusion id, and swaps its operand and result types; several anchors with the same
    signature pair up in reverse order (the backward visits them last-first)."""
    anchors: dict[tuple[Any, ...], list[tuple[Node, str]]] = {}
    owners = _Owners()
    names, mirrors = owners.names, owners.mirrors
    for node in graph.nodes:
        if node.scope.startswith(_GRAD_SCOPE):
            continue
        if node.op != "_MirrorOperator" and node.op not in FUSIBLE_OPS:
            continue
        name = _own_parameter(node)
        if not name:
            continue
        if node.op == "_MirrorOperator":
            mirrors[node] = name
        else:
            names[node] = name
        sig = _signature(node, node.scope, node.result, node.operands[0])
        anchors.setdefault(sig, []).append((node, name))
    for pending in anchors.values():
        pending.reverse()
    for node in graph.nodes:
        if node.op not in FUSIBLE_OPS or not node.scope.startswith(_GRAD_SCOPE):
            continue
        own = node.attrs.get("parameter")
        if isinstance(own, str) and own:
            names[node] = own
            continue
        sig = _signature(node, node.scope[len(_GRAD_SCOPE):], node.operands[0], node.result)
        queue = anchors.get(sig)
        if queue:
            anchor, name = queue.pop(0)
            names[node] = name
            if anchor.op == "_MirrorOperator":
                owners.mirror_of[node] = anchor
    return owners


def _group_key(ranks: Any) -> Any:
    """A group for bucketing: a `RankGroup` (the same groups at every rank) or a rank list."""
    return ranks if isinstance(ranks, RankValue) else tuple(ranks)


def _key(node: Node) -> tuple[Any, ...]:
    return (
        node.op,
        node.attrs.get("group"),
        _group_key(node.attrs.get("rank_list", ())),
        int(node.attrs.get("fusion", 0)),
        node.operands[0].dtype,
        node.attrs.get("op"),
        node.attrs.get("mean_flag"),
    )


def _candidates(graph: Graph, config: FusionConfig, names: dict[Node, str]) -> list[_Candidate]:
    out: list[_Candidate] = []
    for node in graph.nodes:
        if config.enabled(node.op) is None:
            continue
        fusion = node.attrs.get("fusion", 0)
        if not isinstance(fusion, int) or fusion <= 0:
            continue
        if len(node.attrs.get("rank_list", ())) <= 1:
            continue  # a group of one communicates nothing
        operand = node.operands[0].tensor_type
        name = names.get(node) or node.instance_name or node.fullname
        out.append(_Candidate(node, len(out), _key(node), operand.size, operand.nbytes, name))
    return out


# --------------------------------------------------------------------------------------------
# Bucketing
# --------------------------------------------------------------------------------------------


def _split_by_size(members: list[_Candidate], threshold: int) -> list[list[_Candidate]]:
    """MindSpore's `SetFusionBySize`: greedy in order; a candidate that does not fit in what
    remains opens a new bucket (and the budget is reset without subtracting it)."""
    buckets: list[list[_Candidate]] = []
    remaining, first = threshold, True
    for cand in members:
        if first or cand.elements < remaining:
            remaining -= cand.elements
            first = False
            if not buckets:
                buckets.append([])
            buckets[-1].append(cand)
        else:
            remaining = threshold
            buckets.append([cand])
    return buckets


def _split_by_index(members: list[_Candidate], indices: Sequence[int]) -> list[list[_Candidate]]:
    """The backend's `GetSplitSegments`: every index closes a segment (inclusive)."""
    count = len(members)
    ends: list[int] = []
    for index in indices:
        if index >= count:
            _log.warning(
                "comm_fusion: split index %d is >= the number of gradients %d; ignored",
                index, count,
            )
            continue
        ends.append(index)
    if not ends or ends[-1] != count - 1:
        ends.append(count - 1)
    out, start = [], 0
    for end in ends:
        out.append(members[start:end + 1])
        start = end + 1
    return [seg for seg in out if seg]


def _split_by_dependency(members: list[_Candidate]) -> list[list[_Candidate]]:
    """Cut a bucket (members in topological order) wherever a member's input depends on the
    output of a member already in the current part, in the graph as it is now (reachability
    in the graph's dependency DiGraph, networkx)."""
    if len(members) < 2:
        return [list(members)]
    deps = _dependency_graph([c.node for c in members])
    parts: list[list[_Candidate]] = []
    reach: set[Node] = set()
    for cand in members:
        if parts and cand.node not in reach:
            parts[-1].append(cand)
        else:
            parts.append([cand])
            reach = set()
        reach |= nx.descendants(deps, cand.node)
    return parts


def _dependency_graph(starts: list[Node]) -> nx.DiGraph:
    """node -> user edges of everything downstream of `starts`: the nodes reachable from them
    through use lists, which is all a later member can depend on through an earlier one."""
    deps = nx.DiGraph()
    deps.add_nodes_from(starts)
    stack, seen = list(starts), set(starts)
    while stack:
        node = stack.pop()
        for user, _ in node.result.uses:
            deps.add_edge(node, user)
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return deps


def _plan(candidates: list[_Candidate], config: FusionConfig) -> list[list[_Candidate]]:
    by_key: dict[tuple[Any, ...], list[_Candidate]] = {}
    for cand in candidates:
        by_key.setdefault(cand.key, []).append(cand)
    buckets: list[list[_Candidate]] = []
    for key, members in by_key.items():
        kind = config.enabled(key[0])
        assert kind is not None
        if kind.mode == "index":
            ranks = key[2]
            world = config.world_size is None or (
                ranks.is_world if isinstance(ranks, RankGroup)
                else ranks == tuple(range(config.world_size)))
            segments = _split_by_index(members, kind.split_indices if world else ())
        else:
            segments = _split_by_size(members, kind.threshold_elements)
        for segment in segments:
            buckets.extend(_split_by_dependency(segment))
    buckets.sort(key=lambda b: b[0].position)
    return buckets


# --------------------------------------------------------------------------------------------
# Rewrite
# --------------------------------------------------------------------------------------------


def _common_scope(nodes: Sequence[Node]) -> str:
    paths = [n.scope.split("/") for n in nodes]
    common: list[str] = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return "/".join(common) or "Default"


def _concat(b: Builder, values: list[Value], axis: int) -> Value:
    if len(values) <= _MAX_CONCAT:
        return b.emit("Concat", values, {"axis": axis})
    chunks = [
        b.emit("Concat", values[i:i + _MAX_CONCAT], {"axis": axis})
        for i in range(0, len(values), _MAX_CONCAT)
    ]
    return _concat(b, chunks, axis)


def _reshape(b: Builder, value: Value, shape: tuple[int, ...], hint: str = "") -> Value:
    if value.shape == shape:
        return value
    return b.emit("Reshape", [value], {"shape": shape}, name_hint=hint)


def _slice(b: Builder, value: Value, begin: tuple[int, ...], end: tuple[int, ...],
           hint: str) -> Value:
    return b.emit(
        "StridedSlice",
        [value],
        {"begin": begin, "end": end, "strides": (1,) * len(begin)},
        name_hint=hint,
    )


def _pieces(b: Builder, flat: Value, sizes: list[int], rows: int | None,
            hints: list[str]) -> list[Value]:
    """Cut `flat` (1-D, or (rows, total) when `rows`) into consecutive pieces of `sizes`
    along its last dim: one Split when the sizes are equal, else a StridedSlice each."""
    if len(set(sizes)) == 1:
        parts = b.emit("Split", [flat], {"axis": -1 if rows else 0, "output_num": len(sizes)})
        return [
            b.emit("TupleGetItem", [parts], {"index": i}, name_hint=hint)
            for i, hint in enumerate(hints)
        ]
    out, offset = [], 0
    for size, hint in zip(sizes, hints):
        if rows:
            out.append(_slice(b, flat, (0, offset), (rows, offset + size), hint))
        else:
            out.append(_slice(b, flat, (offset,), (offset + size,), hint))
        offset += size
    return out


def _fuse_bucket(graph: Graph, members: list[_Candidate]) -> Node:
    """Replace `members` (same key, no dependency among them) by one collective."""
    first = members[0].node
    op = first.op
    n = len(first.attrs["rank_list"])
    b = Builder(graph, scope=_common_scope([m.node for m in members]))
    inputs = [m.node.operands[0] for m in members]
    results = [m.node.result for m in members]
    hints = [r.name_hint for r in results]
    sizes = [v.tensor_type.size for v in inputs]
    attrs = {k: v for k, v in first.attrs.items() if k in get_op(op).attrs}
    total_bytes = sum(m.nbytes for m in members)
    info = ParallelInfo(
        reason=f"comm_fusion: {len(members)} {op} fused into one",
        fusion=attrs.get("fusion", 0),
        members=tuple(m.name for m in members),
        bytes=total_bytes,
    )
    if op == "ReduceScatter":
        rows = [_reshape(b, v, (n, s // n)) for v, s in zip(inputs, sizes)]
        buffer = _reshape(b, _concat(b, rows, 1), (sum(sizes),))
    else:
        flats = [_reshape(b, v, (s,)) for v, s in zip(inputs, sizes)]
        buffer = _concat(b, flats, 0)
    fused = b.emit(op, [buffer], attrs, instance_name=f"{op.lower()}_fusion",
                   name_hint="fusion", parallel=info)
    if op == "AllReduce":
        outs = _pieces(b, fused, sizes, None, hints)
    elif op == "ReduceScatter":
        outs = _pieces(b, fused, [s // n for s in sizes], None, hints)
    else:  # AllGather: row r of (n, total) is rank r's buffer
        table = _reshape(b, fused, (n, sum(sizes)))
        outs = _pieces(b, table, sizes, n, hints)
    outs = [_reshape(b, v, r.shape, r.name_hint) for v, r in zip(outs, results)]
    created = list(b.created)
    # Move the new nodes (the Builder appended them) right after the last producer of a
    # member input (to the front when none is a node).
    producers = [v.node for v in inputs if isinstance(v, NodeResult)]
    last = max(producers, key=graph.order_key) if producers else None
    graph.move_after(last, created)
    for result, new in zip(results, outs):
        result.replace_all_uses_with(new)  # its uses as an operand and as a graph output
    for m in members:
        assert not m.node.result.uses
        m.node.drop_operands()  # removed from the graph once every bucket is fused
    assert isinstance(fused, NodeResult)
    return fused.node


def _ordered(graph: Graph) -> bool:
    defined: set[Node] = set()
    for node in graph.nodes:
        for v in node.operands:
            if isinstance(v, NodeResult) and v.node not in defined:
                return False
        defined.add(node)
    return True


def _stable_toposort(graph: Graph) -> None:
    """Reorder `graph.nodes` into a valid topological order that keeps the current order
    wherever the dependencies allow (networkx's lexicographical topological sort keyed by the
    current position: Kahn's algorithm, earliest position first)."""
    nodes = list(graph.nodes)
    position = {nd: i for i, nd in enumerate(nodes)}
    deps = nx.DiGraph()
    deps.add_nodes_from(position)
    deps.add_edges_from((v.node, nd) for nd in nodes for v in nd.operands
                        if isinstance(v, NodeResult) and v.node in position)
    try:
        order = list(nx.lexicographical_topological_sort(deps, key=position.__getitem__))
    except nx.NetworkXUnfeasible:
        raise AssertionError("comm_fusion produced a cycle") from None  # excluded by the cut
    graph.reorder(order)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def fuse_communication(graph: Graph, config: FusionConfig | None = None) -> FusionReport:
    """Bucket and fuse the collectives of one rank's graph in place (see the module doc)."""
    config = config or FusionConfig()
    report = FusionReport(collectives_before=count_collectives(graph))
    owners = _parameter_names(graph)
    mirrors, grad_of = owners.mirrors, owners.mirror_of
    candidates = _candidates(graph, config, owners.names) if config.openstate else []
    done: list[tuple[list[_Candidate], Node | None]] = []
    fused_members: set[Node] = set()
    for bucket in _plan(candidates, config):
        for part in _split_by_dependency(bucket):  # re-checked after earlier rewrites
            if len(part) >= 2:
                done.append((part, _fuse_bucket(graph, part)))
                fused_members.update(m.node for m in part)
            else:
                done.append((part, None))
    for node in [nd for nd in graph.nodes if nd in fused_members]:
        graph.remove(node)
    if not _ordered(graph):
        _stable_toposort(graph)
    # Number the buckets per kind by (user fusion id, first member).
    done.sort(key=lambda item: (item[0][0].key[0], item[0][0].key[3], item[0][0].position))
    counters: dict[str, int] = {}
    member_ids: dict[Node, int] = {}  # a member -> its bucket's fusion id
    for part, fused in done:
        head = part[0]
        op = head.key[0]
        fusion = counters.get(op, 0) + 1
        counters[op] = fusion
        if fused is not None:
            fused.attrs["fusion"] = fusion
            assert fused.parallel is not None
            fused.parallel.fusion = fusion
        else:
            head.node.attrs["fusion"] = fusion
        for cand in part:
            member_ids[cand.node] = fusion
            mirror = grad_of.get(cand.node)
            if mirror is not None:
                mirror.attrs["fusion"] = fusion
        report.buckets.append(FusionBucket(
            kind=op,
            fusion=fusion,
            user_fusion=head.key[3],
            group=str(resolve(head.key[1], 0)),
            rank_list=tuple(resolve(head.key[2], 0)),
            dtype=head.key[4].value,
            members=tuple(c.name for c in part),
            elements=sum(c.elements for c in part),
            nbytes=sum(c.nbytes for c in part),
            fused=fused.fullname if fused is not None else "",
        ))
    report.buckets.sort(key=lambda bk: (bk.kind, bk.fusion))
    # {parameter: AllReduce id}: every mirrored parameter; unfused ones keep their own id.
    by_mirror = {mirror: grad for grad, mirror in grad_of.items()}
    for mirror, name in mirrors.items():
        grad = by_mirror.get(mirror)
        if grad is not None and grad in member_ids:
            report.parameter_fusion[name] = member_ids[grad]
    for node in graph.nodes:
        if node.op == "_MirrorOperator" and node in mirrors:
            report.parameter_fusion.setdefault(mirrors[node], int(node.attrs["fusion"]))
    report.collectives_after = count_collectives(graph)
    return report


class CommFusionPass:
    """The driver pass `comm_fusion` (after `optimizer`): fuses every rank's collectives.

    The driver gives the config (`compiler.pass_options.fusion_config`: the context's
    `comm_fusion`); without one, the defaults (AllReduce fusion, `auto`). The rank reports are
    kept in `self.reports`, and a summary (rank 0's buckets and parameter ids, collectives per
    rank before and after) in `unit.plan.comm_fusion`."""

    name = "comm_fusion"
    appends_only = False

    def __init__(self, config: FusionConfig | None = None) -> None:
        self.config = config
        self.reports: list[FusionReport] = []

    def apply(self, unit: CompileUnit) -> None:
        if not unit.parallel or not unit.rank_graphs:
            return  # one device: every collective is the identity
        # the nodes before fusion, whose buckets depend on byte sizes: the shrunk check
        # compares a plan's communication by them
        unit.unfused = [list(g.nodes) for g in unit.graphs]
        config = replace(self.config or FusionConfig(), world_size=unit.devices)
        reports = {id(g): fuse_communication(g, config) for g in unit.graphs}
        self.reports = [reports[id(g)] for g in unit.rank_graphs]
        first = self.reports[0]
        unit.plan.comm_fusion = {
            "config": config.as_dict(),
            "parameter_fusion": dict(first.parameter_fusion),
            "buckets": [b.as_dict() for b in first.buckets],
            "collectives_per_rank": [
                {"before": r.collectives_before, "after": r.collectives_after}
                for r in self.reports
            ],
        }
