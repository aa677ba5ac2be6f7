"""Sharding propagation (reference §4.2, `CostGraph::StrategyPropagate`).

Configured vertices (user `shard()` strategies and layouts, strategies loaded from a checkpoint,
and `_VirtualDataset`, whose topological index is infinity so it goes last) are taken in
topological order; each one not yet visited starts a breadth-first search (`propagate`):

* pop a vertex u; for each out-edge u -> v (`_visit_next`), then each in-edge w -> u
  (`_visit_prev`), decide the unvisited, unconfigured neighbour;
* a consumer v with several in-edges waits until the producers of all of them are decided
  (configured vertices count as decided); it then minimises the *sum* over its in-edges
  (`OperatorInfo::GetStrategyByVisitedEdges`);
* a neighbour's candidate is the minimum of `swc_key` (`CompareSwcCost`): (1) the edge's
  redistribution communication, (2) its redistribution computation, (3) the candidate's own
  forward communication, (4) `Strategy::Compare`: the larger product of all splits, then the
  lexicographically larger strategy; remaining ties keep candidate order;
* when every search is done, waiting vertices are decided in topological order from the
  in-edges they have, and the search continues from them;
* a vertex no search reached gets its first candidate (usually all ones);
* with `neighbour_layouts` (the `sharding_propagation` search), a neighbour about to be
  decided first gets the candidate that takes the decided op's layout as it is, built under
  that op's device matrix, where none of its candidates does (`neighbour_layouts.py`:
  backwards to a one-input producer, forwards to a several-input consumer whose in-edges are
  all visited (`_visited_before`), and forwards to a one-input consumer of an op laid out by a
  `Layout`);
* an edge that crosses two Reshape operators is not followed, in either direction:
  MindSpore's `Edge::GetReshapeSWCIndexByPrevOpStrategy` / `ByNextOpStrategy` stop at an edge
  between two Reshapes ("has two Reshapes, please set the strategy for at least one"), so the
  ops beyond are decided from elsewhere or get their first candidate. Consecutive Reshapes are
  one operator there (MindSpore 2.10 merges `Reshape(Reshape(x))` before the search: its
  `step_auto_parallel_begin` dump holds a single Reshape), so only Reshapes separated by
  another node (MindSpore's `test_reshape_depend_reshape` puts a Depend between) stop it.

Invariant (stated and checked with `explain.py`): every vertex decided here records the edges
that decided it (`Propagation.decision`), and its candidate is the minimum of `swc_key` over
all its candidates on exactly those edges; the explanation prints that key for the choice and
the runner-up, so the choice never contradicts the printed costs. (The local objective over
all edges, which edges decided later also enter, is not what propagation minimises: printing
it as the runner-up's cost made the choice look wrong.)

A parameter shared by several ops is a `TmpIdentity` vertex whose edges cost infinity unless
the layouts are equal, so its users agree. Cost: building the rows an edge needs (cached per
producer layout and consumer signature) plus a linear walk over the graph.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from pcompile.ir.layout import TensorLayout
from pcompile.passes.search.candidates import Candidate, layout_key
from pcompile.passes.search.cost_graph import CostGraph, Vertex
from pcompile.passes.search.explain import swc_key
from pcompile.passes.search.neighbour_layouts import tensor_input_count, with_inputs, with_output


def _best_by_in_edges(cg: CostGraph, v: Vertex, choice: list[int], edges: list[int],
                      memo: dict[Any, int]) -> int:
    rows = [cg.costs_to(cg.edges[ei], choice[cg.edges[ei].src]) for ei in edges]
    key = ("in", v.signature, tuple(id(row) for row in rows))  # rows are cached objects
    best = memo.get(key)
    if best is None:
        n = len(v.candidates)
        comm = [sum(row[k].communication for row in rows) for k in range(n)]
        comp = [sum(row[k].computation for row in rows) for k in range(n)]
        best = min(range(n), key=lambda k: swc_key(cg, v, k, comm[k], comp[k]))
        memo[key] = best
    return best


def _best_by_out_edge(cg: CostGraph, w: Vertex, choice: list[int], ei: int,
                      memo: dict[Any, int]) -> int:
    e = cg.edges[ei]
    col = cg.costs_from(e, choice[e.dst])
    key = ("out", w.signature, id(col))
    best = memo.get(key)
    if best is None:
        best = min(range(len(w.candidates)),
                   key=lambda k: swc_key(cg, w, k, col[k].communication, col[k].computation))
        memo[key] = best
    return best


class Propagation:
    """State of one propagation: the choice per vertex and why it was made."""

    def __init__(self, cg: CostGraph, fixed: dict[int, int] | None = None,
                 cross_reshape_chains: bool = False, neighbour_layouts: bool = False) -> None:
        self.cg = cg
        self.neighbour_layouts = neighbour_layouts
        # MindSpore's propagation stops at an edge between two Reshape operators
        self.blocked = set() if cross_reshape_chains else {
            e.index for e in cg.edges if e.reshapes >= 2}
        n = len(cg.vertices)
        self.choice = [-1] * n
        self.decided = [False] * n
        self.via: dict[int, str] = {}
        # vertex -> the edges whose redistribution decided it (empty: first candidate)
        self.decision: dict[int, list[int]] = {}
        self.waiting: set[int] = set()
        # vertices a search has popped: their out-edges are MindSpore's visited edges
        self.popped: set[int] = set()
        self.memo: dict[Any, int] = {}
        # candidates made under a neighbour's layouts, by ("under ...", signature, keys)
        self.made: dict[tuple[Any, ...], tuple[Candidate, ...]] = {}
        self.fixed = dict(fixed or {})
        for v in cg.vertices:
            if v.configured:
                self.fixed.setdefault(v.index, 0)
        for vi, k in self.fixed.items():
            self.choice[vi] = k
            self.decided[vi] = True

    def _set(self, vi: int, k: int, via: str, edges: list[int]) -> None:
        self.choice[vi] = k
        self.decided[vi] = True
        self.via[vi] = via
        self.decision[vi] = list(edges)
        self.waiting.discard(vi)

    def _visit_next(self, u: Vertex, ei: int, queue: deque[int]) -> None:
        cg = self.cg
        e = cg.edges[ei]
        v = cg.vertices[e.dst]
        if self.decided[v.index] or ei in self.blocked:
            return
        ins = self.live(v.in_edges)
        if len(ins) > 1 and not all(self.decided[cg.edges[x].src] for x in ins):
            self.waiting.add(v.index)
            return
        if all(self._visited_before(cg.edges[x].src, u, v) for x in ins):
            self._under_producers(v, ins)
        # MindSpore decides the op from its visited in-edges: an edge from `_VirtualDataset`,
        # whose search runs last, is not counted yet (a parameter's edges still are: its users
        # must agree on its layout)
        ins = [x for x in ins if cg.vertices[cg.edges[x].src].kind != "dataset"
               or self._visited_before(cg.edges[x].src, u, v)] or ins
        k = _best_by_in_edges(cg, v, self.choice, ins, self.memo)
        self._set(v.index, k, f"in-edges from {self._names(ins)}", ins)
        queue.append(v.index)

    def _visited_before(self, src: int, u: Vertex, v: Vertex) -> bool:
        """Whether MindSpore's search has visited the edge src -> v when it decides v from u:
        src was popped (u is), or src is configured and earlier than v, so its search starts
        before v leaves the waiting list (`CostGraph::ExistPrevConfiguredOps`). `_VirtualDataset`
        comes last: its edges are not visited yet."""
        w = self.cg.vertices[src]
        return src == u.index or src in self.popped or (w.configured and w.topo < v.topo)

    def _visit_prev(self, u: Vertex, ei: int, queue: deque[int]) -> None:
        cg = self.cg
        w = cg.vertices[cg.edges[ei].src]
        if self.decided[w.index] or ei in self.blocked:
            return
        self._under_consumer(w, ei)
        k = _best_by_out_edge(cg, w, self.choice, ei, self.memo)
        self._set(w.index, k, f"out-edge to {u.name}", [ei])
        queue.append(w.index)

    # -- candidates under a neighbour's device matrix (neighbour_layouts.py) ----------------------
    def _layout_out(self, ei: int) -> TensorLayout:
        e = self.cg.edges[ei]
        return self.cg.vertices[e.src].candidates[self.choice[e.src]].out_layouts[e.src_out]

    def _under_producers(self, v: Vertex, ins: list[int]) -> None:
        """MindSpore's `AddSwcUnderPrevOpDevMatrix{Multi,Single}` before `v` is decided from
        its (decided) in-edges `ins`."""
        cg = self.cg
        if not self.neighbour_layouts or v.kind != "op" or v.node is None:
            return
        edges = [ei for ei in ins if not cg.edges[ei].reshapes]
        if not edges:
            return
        if tensor_input_count(v.node) > 1:
            groups = [edges] + ([[ei] for ei in edges] if len(edges) > 1 else [])
        else:
            src = cg.vertices[cg.edges[edges[0]].src]
            if not src.candidates[self.choice[src.index]].by_layout:
                return
            groups = [edges[:1]]
        new: list[Candidate] = []
        for group in groups:
            given = {cg.edges[ei].dst_in: self._layout_out(ei) for ei in group}
            keys = tuple((i, layout_key(lay)) for i, lay in given.items())
            memo_key = ("under producers", v.signature, keys)
            found = self.made.get(memo_key)
            if found is None:
                found = ()
                if not any(all(c.in_keys[i] == k for i, k in keys) for c in v.candidates):
                    cand = with_inputs(v.node, cg.devices, given)
                    found = () if cand is None else (cand,)
                self.made[memo_key] = found
            new.extend(found)
        if new:
            cg.add_candidates(v, new)

    def _under_consumer(self, w: Vertex, ei: int) -> None:
        """MindSpore's `AddSwcUnderNextOpDevMatrix` before the producer `w` is decided from
        its out-edge `ei`: a producer with one tensor input, no Reshape between."""
        cg = self.cg
        e = cg.edges[ei]
        if (not self.neighbour_layouts or w.kind != "op" or w.node is None or e.reshapes
                or tensor_input_count(w.node) > 1):
            return
        consumer = cg.vertices[e.dst]
        wanted = consumer.candidates[self.choice[e.dst]]
        memo_key = ("under consumer", w.signature, e.src_out, wanted.in_keys[e.dst_in])
        found = self.made.get(memo_key)
        if found is None:
            found = ()
            if not any(c.out_keys[e.src_out] == wanted.in_keys[e.dst_in] for c in w.candidates):
                cand = with_output(w.node, cg.devices, e.src_out, wanted.in_layouts[e.dst_in])
                found = () if cand is None else (cand,)
            self.made[memo_key] = found
        if found:
            cg.add_candidates(w, found)

    def live(self, edges: list[int]) -> list[int]:
        """The edges propagation follows."""
        return [ei for ei in edges if ei not in self.blocked]

    def _names(self, edges: list[int]) -> str:
        cg = self.cg
        return ", ".join(dict.fromkeys(cg.vertices[cg.edges[x].src].name for x in edges))

    def bfs(self, start: int) -> None:
        cg = self.cg
        queue: deque[int] = deque([start])
        while queue:
            u = cg.vertices[queue.popleft()]
            self.popped.add(u.index)
            for ei in u.out_edges:
                self._visit_next(u, ei, queue)
            for ei in u.in_edges:
                self._visit_prev(u, ei, queue)

    def run(self, starts: list[int]) -> list[int]:
        cg = self.cg
        for vi in sorted(starts, key=lambda i: cg.vertices[i].topo):
            self.bfs(vi)
        while self.waiting:
            vi = min(self.waiting, key=lambda i: cg.vertices[i].topo)
            v = cg.vertices[vi]
            ins = [x for x in self.live(v.in_edges) if self.decided[cg.edges[x].src]]
            self._under_producers(v, ins)
            self._set(vi, _best_by_in_edges(cg, v, self.choice, ins, self.memo),
                      f"in-edges from {self._names(ins)} (not all inputs were decided)", ins)
            self.bfs(vi)
        for v in cg.vertices:
            if not self.decided[v.index]:
                self._set(v.index, 0, "unreachable: first candidate", [])
        return self.choice


def propagate(cg: CostGraph, fixed: dict[int, int] | None = None,
              cross_reshape_chains: bool = False, neighbour_layouts: bool = False
              ) -> Propagation:
    """Sharding propagation from the configured vertices (and `fixed` ones, which count as
    configured: recursive programming uses this to finish its plan, crossing Reshape chains
    as its own propagation does). `neighbour_layouts`: add candidates under a decided
    neighbour's device matrix, as MindSpore's sharding propagation does (module docstring)."""
    prop = Propagation(cg, fixed, cross_reshape_chains, neighbour_layouts)
    prop.run(list(prop.fixed))
    return prop
