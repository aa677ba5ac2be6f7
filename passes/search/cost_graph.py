"""The cost graph the three searches share (reference §4.0 steps 1-4).

Vertices:

* one per op with a sharding rule (`Reshape`, `TupleGetItem` and `MakeTuple` have no strategy
  and are looked through, and so is a Cast without one (`_looked_through`: it keeps its
  input's layout, or a weight's Cast its configured users', so it costs and decides nothing),
  with its candidate strategies (`candidates.py`); an op with a user `shard()` strategy (or
  one loaded from a strategy checkpoint) is *configured*: its only candidate is that strategy;
* `_VirtualDataset`: a configured vertex whose outputs are the graph inputs under
  `dataset_strategy` (topological index "infinity", so sharding propagation visits it last);
* `TmpIdentity`, one per parameter used directly by several ops: its candidates are the
  layouts its users can want, and its edges cost 0 to a user wanting the same layout and
  infinity otherwise, so that all users of a parameter agree (parameters are stored sliced and
  never redistributed, §3.4).

Edges run from a producer output to a consumer input, through Reshape, Depend, transparent
Casts and TupleGetItem (an edge records how many Reshape operators it crosses: consecutive Reshapes
count once, as MindSpore merges them before its search). An edge's cost for a pair of
strategies is the redistribution from the producer's output layout to the consumer's input
layout (through a Reshape the shapes differ and the redistribution planner turns the reshape
into splits and merges of dims, §2.3). Costs are cached by layout
pair, edge rows by (producer layout, consumer signature) and whole tables by (producer
signature, consumer signature), so the repeated layers of a deep model cost one evaluation.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.ir.core import Constant, Graph, GraphParam, Node, NodeResult, Value
from pcompile.ir.layout import TensorLayout
from pcompile.ir.sharding import OpSharding, rule_for
from pcompile.ir.types import DType, TensorType
from pcompile.passes.layouts import (
    dataset_layouts,
    is_transparent_cast,
    shard_node,
)
from pcompile.passes.search.candidates import Candidate, CandidateTable, LayoutKey, make_candidate
from pcompile.passes.search.cost_model import (
    INFINITE,
    ZERO,
    Cost,
    CostConstants,
    op_cost,
    redistribution_cost,
)

DATASET_TOPO = 1 << 62


def _looked_through(node: Node, weight_casts: bool | Collection[Node] = False) -> bool:
    """A Cast without a user strategy: not a vertex. It keeps its input's layout
    (step_parallel_begin: transparent), so it decides nothing and costs nothing. A weight's
    Cast is looked through only when every user of it has a `shard()` strategy: it takes
    theirs (the weight is stored as its real user wants it, as MindSpore's propagation of a
    configured strategy gives it); otherwise it is searched like any op (MindSpore's
    test_auto_parallel_parameter_cast)."""
    if is_transparent_cast(node):
        return True
    if node.op != "Cast" or len(node.operands) != 1 or node.attrs.get("in_strategy") is not None:
        return False
    if weight_casts is True or (not isinstance(weight_casts, bool) and node in weight_casts):
        # the ilp search: a weight's Cast always follows its user (a collection: these Casts)
        source = node.operands[0]
        while isinstance(source, NodeResult) and source.node.op == "Cast" \
                and len(source.node.operands) == 1:
            source = source.node.operands[0]
        if isinstance(source, GraphParam) and source.kind != "input":
            return True
    return bool(node.result.uses) and all(  # a weight's Cast
        user.attrs.get("in_strategy") is not None for user, _ in node.result.uses)


@dataclass
class Vertex:
    """A node of the cost graph."""

    index: int
    kind: str  # "op", "dataset" or "param"
    name: str
    topo: float
    candidates: list[Candidate]
    configured: bool = False
    node: Node | None = None
    signature: Any = None
    trainable: tuple[bool, ...] = ()  # operands that are trainable parameters
    params: tuple[bool, ...] = ()  # operands that are stored parameters
    in_edges: list[int] = field(default_factory=list)
    out_edges: list[int] = field(default_factory=list)


@dataclass
class Edge:
    """Producer output `src_out` of vertex `src` -> input `dst_in` of vertex `dst`."""

    index: int
    src: int
    src_out: int
    dst: int
    dst_in: int
    itemsize: int
    is_bool: bool
    parameter: bool = False  # an edge of a TmpIdentity: equal layouts or infinity
    reshapes: int = 0  # Reshape operators between (consecutive Reshapes count once)


@dataclass(frozen=True)
class EdgeClasses:
    """Distinct layouts at the two ends of an edge; `src_rows[k]` is the class of producer
    candidate k, `dst_cols[k]` that of consumer candidate k."""

    src_rows: np.ndarray
    src_reps: list[tuple[LayoutKey, TensorLayout]]
    dst_cols: np.ndarray
    dst_reps: list[tuple[LayoutKey, TensorLayout]]


def _classes(pairs: list[tuple[LayoutKey, TensorLayout]]
             ) -> tuple[list[int], list[tuple[LayoutKey, TensorLayout]]]:
    index: dict[LayoutKey, int] = {}
    reps: list[tuple[LayoutKey, TensorLayout]] = []
    rows = []
    for k, lay in pairs:
        if k not in index:
            index[k] = len(reps)
            reps.append((k, lay))
        rows.append(index[k])
    return rows, reps


def _identity_candidate(layout: TensorLayout) -> Candidate:
    sharding = OpSharding((layout.splits,), layout.dev_matrix, [layout], [layout])
    return make_candidate(sharding)


class CostGraph:
    """Vertices, edges and cached cost tables of one search."""

    def __init__(self, graph: Graph, devices: int, constants: CostConstants,
                 dataset_strategy: Any = None, fully_use_devices: bool = False,
                 configured: dict[Node, Any] | None = None,
                 weight_casts: bool | Collection[Node] = False, reduce_scatter: bool = False
                 ) -> None:
        """`weight_casts`: look through every strategy-less Cast of a weight (the ilp search:
        the weight is stored as its user wants it), not only those whose users are all
        configured; a collection: those Casts only. `reduce_scatter`: a
        MatMul's candidates include their ReduceScatter forms
        (`candidates.reduce_scatter_forms`)."""
        self.graph = graph
        self.weight_casts = weight_casts
        self.devices = devices
        self.constants = constants
        self.table = CandidateTable(devices, fully_use_devices, reduce_scatter)
        self._configured: dict[Any, list[Candidate]] = {}  # configured ops by signature
        self.vertices: list[Vertex] = []
        self.edges: list[Edge] = []
        self.vertex_of: dict[int, int] = {}  # id(node) -> vertex index
        self._op_costs: dict[Any, list[Cost]] = {}
        self._pair: dict[tuple[LayoutKey, LayoutKey, int, bool], Cost] = {}
        self._rows: dict[Any, list[Cost]] = {}
        self._matrices: dict[Any, np.ndarray] = {}
        self._classes: dict[Any, EdgeClasses] = {}
        self.explain_cache: dict[Any, dict[str, Any]] = {}
        self._build(dataset_strategy, configured or {})

    # -- construction -----------------------------------------------------------------------------
    def _add_vertex(self, kind: str, name: str, topo: float, candidates: list[Candidate],
                    configured: bool, node: Node | None, signature: Any) -> Vertex:
        v = Vertex(len(self.vertices), kind, name, topo, candidates, configured, node,
                   signature)
        self.vertices.append(v)
        return v

    def _build(self, dataset_strategy: Any, loaded: dict[Node, Any]) -> None:
        devices = self.devices
        for topo, node in enumerate(self.graph.nodes):
            if rule_for(node.op) is None:  # no rule, or no strategy of its own (Reshape)
                continue
            user = node.attrs.get("in_strategy")
            if user is None:
                user = loaded.get(node)
            if user is None and _looked_through(node, self.weight_casts):
                continue  # step_parallel_begin lays it out (transparent, or a weight's Cast)
            trainable = tuple(isinstance(v, GraphParam) and v.kind == "weight"
                              and v.requires_grad for v in node.operands)
            params = tuple(isinstance(v, GraphParam) and v.kind != "input"
                           for v in node.operands)
            sig: Any
            if user is not None:
                # alike ops given alike strategies (a deep model's layers) share their
                # candidate, and every cache keyed by the signature
                out_strategy = node.attrs.get("out_strategy")
                sig = ("configured", self.table.signature(node), trainable, params,
                       repr(user), repr(out_strategy))
                cands = self._configured.get(sig)
                if cands is None:
                    sharding = shard_node(node, devices, user, out_strategy)
                    by_layout = any(isinstance(s, dict) for s in user)
                    cands = [make_candidate(sharding, spec=tuple(user) if by_layout else None)]
                    self._configured[sig] = cands
            else:
                cands = self.table.for_node(node)
                sig = (self.table.signature(node), trainable, params)
            v = self._add_vertex("op", node.instance_name or node.op, topo, cands,
                                 user is not None, node, sig)
            v.trainable, v.params = trainable, params
            self.vertex_of[id(node)] = v.index
        inputs = self.graph.inputs
        self.dataset: Vertex | None = None
        if inputs:
            layouts = dataset_layouts(self.graph, dataset_strategy, devices)
            outs = [layouts[p.name] for p in inputs]
            sharding = OpSharding(tuple(lay.splits for lay in outs), (devices,), [], outs)
            self.dataset = self._add_vertex("dataset", "_VirtualDataset", DATASET_TOPO,
                                            [make_candidate(sharding)], True, None,
                                            ("dataset",))
        self._input_index = {id(p): i for i, p in enumerate(inputs)}
        self._add_parameter_vertices()
        for v in list(self.vertices):
            if v.kind != "op":
                continue
            assert v.node is not None
            for index, operand in enumerate(v.node.operands):
                source = self._source(operand, v.node, index)
                if source is None:
                    continue
                src, out, parameter, reshapes = source
                if not isinstance(operand.type, TensorType):
                    continue
                dtype = operand.type.dtype
                self._add_edge(src, out, v.index, index, dtype, parameter, reshapes)

    def _add_parameter_vertices(self) -> None:
        users: dict[int, list[tuple[int, int]]] = {}
        params: dict[int, GraphParam] = {}
        for v in self.vertices:
            if v.kind != "op":
                continue
            assert v.node is not None
            for index, operand in enumerate(v.node.operands):
                while (isinstance(operand, NodeResult) and id(operand.node) not in self.vertex_of
                       and _looked_through(operand.node, self.weight_casts)):
                    operand = operand.node.operands[0]  # a weight read through its Cast
                if isinstance(operand, GraphParam) and operand.kind != "input":
                    users.setdefault(id(operand), []).append((v.index, index))
                    params[id(operand)] = operand
        self._param_vertex: dict[int, int] = {}
        for pid, entries in users.items():
            if len(entries) < 2:
                continue
            keys: dict[LayoutKey, TensorLayout] = {}
            for vi, index in entries:
                for cand in self.vertices[vi].candidates:
                    keys.setdefault(cand.in_keys[index], cand.in_layouts[index])
            cands = [_identity_candidate(lay) for lay in keys.values()]
            topo = min(self.vertices[vi].topo for vi, _ in entries) - 0.5
            v = self._add_vertex("param", f"TmpIdentity({params[pid].name})", topo, cands,
                                 False, None, ("param", tuple(keys)))
            self._param_vertex[pid] = v.index

    def _source(self, value: Value, user: Node, index: int
                ) -> tuple[int, int, bool, int] | None:
        """The vertex output feeding `value`, looking through Reshape, Depend and
        TupleGetItem, and how many Reshape operators lie between: consecutive Reshapes count
        as one (MindSpore merges Reshape(Reshape(x)) before its search), Reshapes separated
        by a Depend as two."""
        reshapes = 0
        run = False  # the previous node looked through was a Reshape
        while True:
            if isinstance(value, Constant):
                return None
            if isinstance(value, GraphParam):
                if value.kind == "input":
                    assert self.dataset is not None
                    return self.dataset.index, self._input_index[id(value)], False, reshapes
                if not reshapes and id(value) in self._param_vertex:
                    return self._param_vertex[id(value)], 0, True, 0
                return None
            assert isinstance(value, NodeResult)
            node = value.node
            if node.op == "Reshape":
                value = node.operands[0]
                reshapes += 0 if run else 1
                run = True
                continue
            if node.op == "Depend" or (id(node) not in self.vertex_of
                                       and _looked_through(node, self.weight_casts)):
                value = node.operands[0]
                run = False
                continue
            if node.op == "TupleGetItem":
                producer = node.operands[0]
                if isinstance(producer, NodeResult) and id(producer.node) in self.vertex_of:
                    return (self.vertex_of[id(producer.node)], int(node.attrs["index"]), False,
                            reshapes)
                return None
            vi = self.vertex_of.get(id(node))
            if vi is None or not isinstance(node.result.type, TensorType):
                return None
            return vi, 0, False, reshapes

    def _add_edge(self, src: int, out: int, dst: int, index: int, dtype: DType,
                  parameter: bool, reshapes: int) -> None:
        e = Edge(len(self.edges), src, out, dst, index, dtype.itemsize,
                 dtype == DType.bool_, parameter, reshapes)
        self.edges.append(e)
        self.vertices[src].out_edges.append(e.index)
        self.vertices[dst].in_edges.append(e.index)

    def add_candidates(self, v: Vertex, new: Sequence[Candidate]) -> None:
        """Give `v` more candidates (sharding propagation's candidates under a neighbour's
        device matrix, `neighbour_layouts.py`). The list is the vertex's own from then on and
        its signature names the additions, so no cache keyed by the old signature (the
        shared candidate list of its op, cost rows, propagation's memo) is reused for it."""
        have = {(c.in_keys, c.out_keys) for c in v.candidates}
        added = []
        for cand in new:
            key = (cand.in_keys, cand.out_keys)
            if key not in have:
                have.add(key)
                added.append(cand)
        if added:
            v.candidates = list(v.candidates) + added
            v.signature = (v.signature, "under", tuple(c.in_keys for c in added))

    # -- op costs ---------------------------------------------------------------------------------
    def op_costs(self, v: Vertex) -> list[Cost]:
        """Cost of every candidate of `v` (cached by signature)."""
        costs = self._op_costs.get(v.signature)
        if costs is None:
            if v.kind != "op":
                costs = [ZERO] * len(v.candidates)
            else:
                node = v.node
                assert node is not None
                in_types = [o.tensor_type for o in node.operands]  # ops with a rule: no tuples
                out_type = node.result.type
                if not isinstance(out_type, TensorType):
                    out_type = out_type.elements[0]
                costs = [
                    op_cost(node.op, c.sharding, in_types, out_type,
                            v.trainable, v.params, self.devices, self.constants)
                    for c in v.candidates
                ]
            self._op_costs[v.signature] = costs
        return costs

    def op_objectives(self, v: Vertex) -> np.ndarray:
        c = self.constants
        return np.array([cost.objective(c) for cost in self.op_costs(v)], dtype=np.float64)

    # -- edge costs -------------------------------------------------------------------------------
    def pair_cost(self, e: Edge, src_key: LayoutKey, src: TensorLayout, dst_key: LayoutKey,
                  dst: TensorLayout) -> Cost:
        """Cost of one edge for a producer layout and a consumer layout (keys: their
        normalised forms)."""
        if e.parameter:
            return ZERO if src_key == dst_key else INFINITE
        key = (src_key, dst_key, e.itemsize, e.is_bool)
        cost = self._pair.get(key)
        if cost is None:
            if src_key == dst_key:
                cost = ZERO
            else:
                cost = redistribution_cost(src, dst, e.itemsize, e.is_bool, self.constants)
            self._pair[key] = cost
        return cost

    def edge_cost(self, e: Edge, cu: int, cv: int) -> Cost:
        a = self.vertices[e.src].candidates[cu]
        b = self.vertices[e.dst].candidates[cv]
        return self.pair_cost(e, a.out_keys[e.src_out], a.out_layouts[e.src_out],
                              b.in_keys[e.dst_in], b.in_layouts[e.dst_in])

    def costs_to(self, e: Edge, cu: int) -> list[Cost]:
        """Edge cost of every consumer candidate, the producer fixed at candidate `cu`."""
        a = self.vertices[e.src].candidates[cu]
        dst = self.vertices[e.dst]
        key = ("to", a.out_keys[e.src_out], dst.signature, e.dst_in, e.itemsize, e.is_bool,
               e.parameter)
        row = self._rows.get(key)
        if row is None:
            src_key, src_layout = a.out_keys[e.src_out], a.out_layouts[e.src_out]
            i = e.dst_in
            row = [self.pair_cost(e, src_key, src_layout, b.in_keys[i], b.in_layouts[i])
                   for b in dst.candidates]
            self._rows[key] = row
        return row

    def costs_from(self, e: Edge, cv: int) -> list[Cost]:
        """Edge cost of every producer candidate, the consumer fixed at candidate `cv`."""
        b = self.vertices[e.dst].candidates[cv]
        src = self.vertices[e.src]
        key = ("from", b.in_keys[e.dst_in], src.signature, e.src_out, e.itemsize, e.is_bool,
               e.parameter)
        col = self._rows.get(key)
        if col is None:
            dst_key, dst_layout = b.in_keys[e.dst_in], b.in_layouts[e.dst_in]
            o = e.src_out
            col = [self.pair_cost(e, a.out_keys[o], a.out_layouts[o], dst_key, dst_layout)
                   for a in src.candidates]
            self._rows[key] = col
        return col

    def edge_key(self, e: Edge) -> tuple[Any, ...]:
        """What an edge's cost table depends on (edges of repeated layers share it)."""
        src, dst = self.vertices[e.src], self.vertices[e.dst]
        return (src.signature, e.src_out, dst.signature, e.dst_in, e.itemsize, e.is_bool,
                e.parameter)

    def edge_classes(self, e: Edge) -> EdgeClasses:
        """The distinct producer output layouts and consumer input layouts of an edge, with
        the class of every candidate (the cost table is a table over classes)."""
        key = self.edge_key(e)
        hit = self._classes.get(key)
        if hit is None:
            src, dst = self.vertices[e.src], self.vertices[e.dst]
            o, i = e.src_out, e.dst_in
            src_rows, src_reps = _classes([(a.out_keys[o], a.out_layouts[o])
                                           for a in src.candidates])
            dst_cols, dst_reps = _classes([(b.in_keys[i], b.in_layouts[i])
                                           for b in dst.candidates])
            hit = EdgeClasses(np.array(src_rows, dtype=np.intp), src_reps,
                              np.array(dst_cols, dtype=np.intp), dst_reps)
            self._classes[key] = hit
        return hit

    def class_cost(self, e: Edge, r: int, q: int) -> float:
        """Objective of the edge for producer class `r` and consumer class `q`."""
        cls = self.edge_classes(e)
        (ka, la), (kb, lb) = cls.src_reps[r], cls.dst_reps[q]
        return self.pair_cost(e, ka, la, kb, lb).objective(self.constants)

    def edge_matrix(self, e: Edge) -> np.ndarray:
        """Objective of the edge for every (producer, consumer) candidate pair."""
        key = self.edge_key(e)
        m = self._matrices.get(key)
        if m is None:
            cls = self.edge_classes(e)
            small = np.empty((len(cls.src_reps), len(cls.dst_reps)), dtype=np.float64)
            for r in range(len(cls.src_reps)):
                for q in range(len(cls.dst_reps)):
                    small[r, q] = self.class_cost(e, r, q)
            m = small[np.ix_(cls.src_rows, cls.dst_cols)]
            self._matrices[key] = m
        return m

    # -- evaluation -------------------------------------------------------------------------------
    def total(self, choice: Sequence[int]) -> float:
        """The objective of a full assignment (vertex index -> candidate index)."""
        c = self.constants
        value = 0.0
        for v in self.vertices:
            value += self.op_costs(v)[choice[v.index]].objective(c)
        for e in self.edges:
            value += self.edge_cost(e, choice[e.src], choice[e.dst]).objective(c)
        return value

    def memory(self, choice: Sequence[int]) -> float:
        return sum(self.op_costs(v)[choice[v.index]].memory for v in self.vertices)
