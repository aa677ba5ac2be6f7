"""Dynamic programming (reference §4.3): exact minimisation of the cost model by elimination.

Objective (`cost_model.py`): over one candidate s_v per vertex,

    minimise  F(s) = sum_v op_v(s_v) + sum_(u->v) edge_uv(s_u, s_v)

with `op_v = alpha * comp + beta * comm_partial` of the op and `edge_uv` the same of the
redistribution, subject to `sum_v mem_v(s_v) <= device_memory_capacity`.

F is a sum of unary and pairwise terms, so MindSpore's graph eliminations are exact when each
one eliminates a vertex x by minimising over s_x the terms that mention x (`_eliminate`),
which leaves a term over x's neighbours and a table argmin[s_neighbours] for recovery. The
rules are tried in MindSpore's order, the first vertex (topological order) that matches wins;
edges point from the earlier to the later vertex:

1. OpElimination (`_rule` 1): x has one in-edge u->x and one out-edge x->w; the result is an
   edge u->w, added to an existing one (2. EdgeElimination: parallel edges are summed as soon
   as they appear);
3. MergeElimination: x has no in-edge and one out-edge x->v; the result is a unary term on v;
4. ContractElimination: x has one in-edge u->x and no out-edge; a unary term on u;
5. TriangleElimination: x has no in-edge and two out-edges x->v, x->w with v, w adjacent; the
   result is added to the edge between v and w (exact, so no strategy overwrite is needed);
6. StarElimination: x has no in-edge and several out-edges; the result is one term over all
   its successors (a table over their candidates);
7. when nothing matches (terms over three or more vertices), the vertex whose remaining term
   is smallest is eliminated (min-weight variable elimination).

Vertices with one candidate (configured ops, `_VirtualDataset`) are conditioned away first.
The final search is over the components: each ends as one constant. Recovery (`solve`) walks
the eliminations backwards and reads each argmin table.

Lazy edge tables (`EdgeTables`): an edge's table has one entry per (producer layout, consumer
layout) pair, each a redistribution plan; at 64 devices the GPT example has ~235k of them, far
too many to plan. The tables start from lower bounds instead (`bounds.py`: what any
redistribution must receive and do, under the planner's own cost formulas; equal layouts are
exactly 0, small tables and parameter edges are planned up front). With tables H <= F entry by
entry, the elimination above gives a plan P minimising H. P's entries are then planned
(`settle`), together with every entry between layouts some earlier plan used on that edge. If
none of P's entries was raised, H(P) = F(P), and for every plan Q, F(Q) >= H(Q) >= H(P) = F(P):
P minimises F exactly. Otherwise the minimisation runs again on the raised tables; each round
plans at least one new entry, so it ends, in a few rounds in practice. The result equals
planning every entry (`tests/passes/test_search_random.py` checks it against brute force with every
table starting from bounds).

Invariant (`explain.py`): the plan minimises F, so no op can lower F by changing its own
candidate; each op's local objective (its terms of F, neighbours fixed) is minimal at its
choice among the candidates considered, which is what the explanation prints.

Memory: the plan minimising F is taken when it fits `device_memory_capacity`; otherwise
`F + lambda * memory` is minimised with the smallest lambda (found by bisection) whose plan
fits (Lagrangian relaxation; exact for the penalised objective).

Approximation (`enable_algo_approxi` / `dp_algo_enable_approxi`): an op keeps at most
ceil(1/epsilon) candidates, evenly sampled after sorting by `alpha * comp + beta * comm`.

Cost: each elimination evaluates a table over x and its neighbours (in chunks); the term it
leaves is capped by `SearchOptions.max_table` entries (a graph whose eliminations need larger
terms raises `SearchTooLargeError`). The redistribution planner runs only for the entries the
rounds settle (a few hundred for the GPT example at 64 devices), plus the rows the
explanation needs.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field
from math import ceil, prod
from typing import Any

import numpy as np

from pcompile.ir.errors import PcompileError
from pcompile.passes.search.bounds import lower_bound_matrix
from pcompile.passes.search.cost_graph import CostGraph, Edge


class SearchTooLargeError(PcompileError):
    """An elimination needs a table larger than the configured cap."""


@dataclass
class DPResult:
    choice: list[int]
    objective: float
    memory: float
    lagrange: float = 0.0
    eliminations: list[tuple[int, str]] = field(default_factory=list)
    rounds: int = 1  # minimisations until the plan used exact edge costs only
    allowed: list[list[int]] = field(default_factory=list)  # candidates considered per vertex


Key = tuple[int, ...]
EXACT_EDGE_CLASSES = 256  # default of SearchOptions.exact_edge_classes


class EdgeTables:
    """The objective of every edge per (producer layout class, consumer layout class), exact
    where the redistribution was planned and a lower bound (`bounds.py`) elsewhere.

    Tables with at most `exact_limit` class pairs, and parameter edges, are exact from the
    start. `settle(choice)` plans the entries a plan uses, and every entry between classes some
    plan has used on that edge (`active`), so the next minimisation sees them exactly."""

    def __init__(self, cg: CostGraph, exact_limit: int) -> None:
        self.cg = cg
        self.exact_limit = exact_limit
        self.value: dict[Any, np.ndarray] = {}
        self.known: dict[Any, np.ndarray] = {}
        self.active: dict[Any, tuple[set[int], set[int]]] = {}
        self._expanded: dict[Any, tuple[int, np.ndarray]] = {}
        self.version: dict[Any, int] = {}
        # elimination results by their input terms: the layers of a deep model, and the
        # rounds of one search, repeat most eliminations exactly
        self.memo: dict[Any, tuple[np.ndarray, np.ndarray]] = {}

    def _table(self, e: Edge) -> Any:
        cg = self.cg
        key = cg.edge_key(e)
        if key in self.value:
            return key
        cls = cg.edge_classes(e)
        a, b = len(cls.src_reps), len(cls.dst_reps)
        if e.parameter or a * b <= self.exact_limit:
            value = np.empty((a, b), dtype=np.float64)
            for r in range(a):
                for q in range(b):
                    value[r, q] = cg.class_cost(e, r, q)
            known = np.ones((a, b), dtype=bool)
        else:
            value = lower_bound_matrix([lay for _, lay in cls.src_reps],
                                       [lay for _, lay in cls.dst_reps], e.itemsize,
                                       e.is_bool, cg.devices, cg.constants)
            known = np.zeros((a, b), dtype=bool)
            cols = {k: q for q, (k, _) in enumerate(cls.dst_reps)}
            for r, (k, _) in enumerate(cls.src_reps):
                col = cols.get(k)
                if col is not None:  # equal layouts: no redistribution, exactly 0
                    value[r, col] = 0.0
                    known[r, col] = True
        self.value[key], self.known[key] = value, known
        self.active[key] = (set(), set())
        self.version[key] = 0
        return key

    def matrix(self, e: Edge) -> np.ndarray:
        """The table over candidate pairs (producer candidate, consumer candidate)."""
        key = self._table(e)
        hit = self._expanded.get(key)
        if hit is None or hit[0] != self.version[key]:
            cls = self.cg.edge_classes(e)
            hit = (self.version[key], self.value[key][np.ix_(cls.src_rows, cls.dst_cols)])
            self._expanded[key] = hit
        return hit[1]

    def settle(self, choice: list[int]) -> bool:
        """Plan the entries `choice` uses (and those between active classes); True when one
        of the entries `choice` uses was below its exact value."""
        cg = self.cg
        raised = False
        grown: dict[Any, Edge] = {}
        for e in cg.edges:
            key = self._table(e)
            cls = cg.edge_classes(e)
            r, q = int(cls.src_rows[choice[e.src]]), int(cls.dst_cols[choice[e.dst]])
            srcs, dsts = self.active[key]
            if r not in srcs or q not in dsts:
                srcs.add(r)
                dsts.add(q)
                grown[key] = e
            if not self.known[key][r, q]:
                exact = cg.class_cost(e, r, q)
                raised = raised or exact > self.value[key][r, q]
                self._set(key, r, q, exact)
        for key, e in grown.items():
            srcs, dsts = self.active[key]
            known = self.known[key]
            for r in srcs:
                for q in dsts:
                    if not known[r, q]:
                        self._set(key, r, q, cg.class_cost(e, r, q))
        return raised

    def _set(self, key: Any, r: int, q: int, exact: float) -> None:
        self.value[key][r, q] = exact
        self.known[key][r, q] = True
        self.version[key] += 1
CHUNK = 1 << 22  # entries of the joint table built at once
MAX_WORK = 1 << 31  # entries of the joint table of one elimination


class _Problem:
    """Unary and higher-order terms over the vertices' candidate indices."""

    def __init__(self, cg: CostGraph, allowed: list[list[int]], lagrange: float,
                 max_table: int, tables: EdgeTables) -> None:
        self.cg = cg
        self.memo = tables.memo
        self.allowed = allowed
        self.max_table = max_table
        self.topo = [v.topo for v in cg.vertices]
        self.size = [len(a) for a in allowed]
        n = len(cg.vertices)
        self.unary: list[np.ndarray] = []
        for v in cg.vertices:
            obj = cg.op_objectives(v)
            if lagrange:
                mem = np.array([c.memory for c in cg.op_costs(v)], dtype=np.float64)
                obj = obj + lagrange * mem
            self.unary.append(obj[allowed[v.index]])
        self.terms: dict[Key, np.ndarray] = {}
        self.incident: list[set[Key]] = [set() for _ in range(n)]
        self.alive = [True] * n
        self.constant = 0.0
        self.records: list[tuple[int, Key, np.ndarray]] = []
        self.rule_names: list[tuple[int, str]] = []
        for e in cg.edges:
            m = tables.matrix(e)[np.ix_(allowed[e.src], allowed[e.dst])]
            self.add_term((e.src, e.dst), m)

    # -- terms ------------------------------------------------------------------------------------
    def order(self, vs: list[int] | tuple[int, ...]) -> Key:
        return tuple(sorted(vs, key=lambda x: (self.topo[x], x)))

    def add_term(self, vs: tuple[int, ...], table: np.ndarray) -> None:
        """Add a term over vertices `vs` (axes of `table` in that order)."""
        if len(vs) == 0:
            self.constant += float(table)
            return
        if len(vs) == 1:
            self.unary[vs[0]] = self.unary[vs[0]] + table
            return
        if len(set(vs)) != len(vs):
            raise AssertionError("a term mentions a vertex twice")
        key = self.order(vs)
        if key != tuple(vs):
            table = np.transpose(table, [vs.index(x) for x in key])
        old = self.terms.get(key)
        self.terms[key] = table if old is None else old + table
        for x in key:
            self.incident[x].add(key)

    def drop_term(self, key: Key) -> np.ndarray:
        table = self.terms.pop(key)
        for x in key:
            self.incident[x].discard(key)
        return table

    # -- structure --------------------------------------------------------------------------------
    def degrees(self, x: int) -> tuple[list[int], list[int], int]:
        """Predecessors, successors (through pairwise terms) and the number of larger
        terms of x."""
        preds, succs, hyper = [], [], 0
        for key in self.incident[x]:
            if len(key) > 2:
                hyper += 1
            elif key[0] == x:
                succs.append(key[1])
            else:
                preds.append(key[0])
        return preds, succs, hyper

    def neighbours(self, x: int) -> set[int]:
        out: set[int] = set()
        for key in self.incident[x]:
            out.update(key)
        out.discard(x)
        return out

    def rule(self, x: int) -> int:
        """The first rule that applies to x (1, 3, 4, 5, 6), 0 for an isolated vertex, 7
        otherwise."""
        if not self.incident[x]:
            return 0
        preds, succs, hyper = self.degrees(x)
        if hyper:
            return 7
        if len(preds) == 1 and len(succs) == 1:
            return 1
        if not preds and len(succs) == 1:
            return 3
        if len(preds) == 1 and not succs:
            return 4
        if not preds and len(succs) == 2:
            a, b = self.order(succs)
            return 5 if (a, b) in self.terms else 6
        if not preds and len(succs) > 2:
            return 6
        return 7

    def table_size(self, x: int) -> int:
        """Entries of the term eliminating x leaves (min-weight heuristic)."""
        return prod(self.size[n] for n in self.neighbours(x))

    # -- elimination ------------------------------------------------------------------------------
    def eliminate(self, x: int, rule: str) -> None:
        keys = list(self.incident[x])
        nbrs = list(self.order(list(self.neighbours(x))))
        axes = nbrs + [x]
        shape = [self.size[a] for a in axes]
        out_size = prod(shape[:-1])
        if out_size > self.max_table or out_size * shape[-1] > MAX_WORK:
            raise SearchTooLargeError(
                f"dynamic programming: eliminating {self.cg.vertices[x].name} needs a table of "
                f"{out_size} entries over {len(nbrs)} ops ({out_size * shape[-1]} evaluations)"
            )
        views: list[np.ndarray] = [self.unary[x].reshape([1] * len(nbrs) + [self.size[x]])]
        for key in keys:
            table = self.drop_term(key)
            pos = sorted(range(len(key)), key=lambda i: axes.index(key[i]))
            full = [1] * len(axes)
            for i in pos:
                full[axes.index(key[i])] = self.size[key[i]]
            views.append(np.transpose(table, pos).reshape(full))
        memo_key = tuple((view.shape, hashlib.blake2b(np.ascontiguousarray(view).tobytes(),
                                                      digest_size=16).digest())
                         for view in views)
        hit = self.memo.get(memo_key)
        if hit is not None:
            best, arg = hit
        elif not nbrs:
            total = views[0][...]
            for view in views[1:]:
                total = total + view
            arg = np.argmin(total, axis=-1)
            best = np.take_along_axis(total, arg[..., None], axis=-1)[..., 0]
        else:
            best = np.empty(shape[:-1], dtype=np.float64)
            arg = np.empty(shape[:-1], dtype=np.int32)
            step = max(1, CHUNK // max(1, prod(shape[1:])))
            for lo in range(0, shape[0], step):
                hi = min(shape[0], lo + step)
                total = views[0]
                for view in views[1:]:
                    total = total + (view[lo:hi] if view.shape[0] > 1 else view)
                total = np.broadcast_to(total, [hi - lo] + shape[1:])
                a = np.argmin(total, axis=-1)
                arg[lo:hi] = a
                best[lo:hi] = np.take_along_axis(total, a[..., None], axis=-1)[..., 0]
        if hit is None:
            self.memo[memo_key] = (best, arg)
        self.records.append((x, tuple(nbrs), arg))
        self.rule_names.append((x, rule))
        self.alive[x] = False
        self.add_term(tuple(nbrs), best)

    def condition_fixed(self) -> None:
        """Vertices with one candidate: fold their terms into their neighbours."""
        for x in range(len(self.size)):
            if self.size[x] == 1 and self.alive[x]:
                self.eliminate(x, "fixed")

    def run(self) -> None:
        self.condition_fixed()
        names = {0: "isolated", 1: "op", 3: "merge", 4: "contract", 5: "triangle",
                 6: "star", 7: "min-weight"}
        heaps: dict[int, list[tuple[float, int, int]]] = {r: [] for r in names}
        status = [-1] * len(self.size)

        def refresh(x: int) -> None:
            if not self.alive[x]:
                return
            r = self.rule(x)
            status[x] = r
            weight = float(self.table_size(x)) if r in (6, 7) else self.topo[x]
            heapq.heappush(heaps[r], (weight, x, r))

        for x in range(len(self.size)):
            refresh(x)
        while True:
            picked = None
            for r in (1, 3, 4, 5, 6, 7, 0):
                heap = heaps[r]
                while heap:
                    _, x, rr = heap[0]
                    if not self.alive[x] or status[x] != rr:
                        heapq.heappop(heap)
                        continue
                    if rr in (6, 7) and heap[0][0] != float(self.table_size(x)):
                        heapq.heappop(heap)
                        refresh(x)
                        continue
                    picked = (x, rr)
                    break
                if picked:
                    break
            if picked is None:
                return
            x, r = picked
            touched = self.neighbours(x)
            self.eliminate(x, names[r])
            around = set(touched)
            for n in touched:
                around |= self.neighbours(n)
            for n in around:
                refresh(n)

    def recover(self) -> list[int]:
        local = [0] * len(self.size)
        for x, nbrs, arg in reversed(self.records):
            local[x] = int(arg[tuple(local[n] for n in nbrs)]) if nbrs else int(arg)
        return [self.allowed[x][k] for x, k in enumerate(local)]


def allowed_candidates(cg: CostGraph, approximate: bool, epsilon: float) -> list[list[int]]:
    """Candidate indices each vertex may take (all, or an even sample when approximating)."""
    out: list[list[int]] = []
    keep = max(1, ceil(1.0 / epsilon))
    c = cg.constants
    for v in cg.vertices:
        n = len(v.candidates)
        if not approximate or v.kind != "op" or n <= keep:
            out.append(list(range(n)))
            continue
        costs = cg.op_costs(v)
        ranked = sorted(range(n), key=lambda k: (c.alpha * costs[k].computation
                                                 + c.beta * costs[k].communication, k))
        step = n / keep
        out.append(sorted({ranked[int(i * step)] for i in range(keep)}))
    return out


def _solve_once(cg: CostGraph, allowed: list[list[int]], lagrange: float,
                max_table: int, tables: EdgeTables) -> DPResult:
    """The exact minimum of `F + lagrange * memory`: minimise with the edge tables as they
    are (exact or lower bounds) until the plan found uses exact entries only."""
    rounds = 0
    while True:
        rounds += 1
        problem = _Problem(cg, allowed, lagrange, max_table, tables)
        problem.run()
        choice = problem.recover()
        if not tables.settle(choice):
            break
    return DPResult(choice, cg.total(choice), cg.memory(choice), lagrange, problem.rule_names,
                    rounds, allowed)


def solve(cg: CostGraph, options: object) -> DPResult:
    """The plan of least objective whose memory fits the device (see the module doc); a
    table too large says what would help, given whether the approximation is already on."""
    try:
        return _solve(cg, options)
    except SearchTooLargeError as exc:
        if getattr(options, "approximate", False):
            keep = ceil(1 / float(getattr(options, "epsilon", 0.1)))
            advice = (f"; the approximation is already on (epsilon "
                      f"{getattr(options, 'epsilon', 0.1)}: up to {keep} candidates per op): "
                      "raise algo_approxi_epsilon to keep fewer, or use --search ilp (repeated "
                      "layers solved once), sharding_propagation or recursive_programming")
        else:
            advice = ("; use --search ilp (repeated layers solved once), sharding_propagation "
                      "or recursive_programming, or set_algo_parameters("
                      "enable_algo_approxi=True)")
        raise SearchTooLargeError(str(exc) + advice) from None


def _solve(cg: CostGraph, options: object) -> DPResult:
    approximate = bool(getattr(options, "approximate", False))
    epsilon = float(getattr(options, "epsilon", 0.1))
    max_table = int(getattr(options, "max_table", 1 << 24))
    allowed = allowed_candidates(cg, approximate, epsilon)
    tables = EdgeTables(cg, int(getattr(options, "exact_edge_classes", EXACT_EDGE_CLASSES)))
    capacity = cg.constants.memory_capacity
    best = _solve_once(cg, allowed, 0.0, max_table, tables)
    if best.memory <= capacity:
        return best
    low, high = 0.0, 1.0
    feasible = None
    for _ in range(60):
        trial = _solve_once(cg, allowed, high, max_table, tables)
        if trial.memory <= capacity:
            feasible = trial
            break
        low, high = high, high * 16
    if feasible is None:
        raise PcompileError(
            f"dynamic programming: no plan fits device_memory_capacity={capacity:.0f} bytes "
            f"(the smallest found needs {best.memory:.0f}); raise it with "
            "set_cost_model_context(device_memory_capacity=...)"
        )
    for _ in range(40):
        mid = (low + high) / 2
        trial = _solve_once(cg, allowed, mid, max_table, tables)
        if trial.memory <= capacity:
            feasible, high = trial, mid
        else:
            low = mid
    return feasible
