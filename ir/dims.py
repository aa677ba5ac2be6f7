"""Dimension relations: which dims of a graph are the same size, and a shrunk copy of the graph.

Each op may declare, in its registry entry (`OpDef.dims`, a `DimRule`), how the dims of its
operands and result relate: equal (`Same`), equal up to a constant (`Offset`: a slice that
drops a margin), products (`Product`: Reshape's blocks, Tile's multiples), sums
(`Total`: Concat), dims that must stay as they are (`Fixed`), a divisibility (`Divides`), and
operands whose integer values index a dim (`Index`: Gather's indices, OneHot's). An op without
a rule keeps every dim it touches at full size.

`shrink_graph` joins these relations over a whole graph (a union-find over (value, dim) with
offsets), adds the caller's divisibility requirements (a plan's splits), and picks for every
free class of dims the largest divisor of its size up to a factor that keeps every relation and
requirement; derived dims (products, sums) follow their parts. `Shrink.apply` rewrites a graph
traced the same way: types, shape attributes (each rule's `rewrite`), constants (their leading
block) and parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.ir.core import Constant, Graph, GraphParam, Node, NodeResult, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import TensorType, TupleType, ValueType

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Ref:
    """Dim `dim` of operand `index` (`index` = -1: the result); `elem`: the tuple element."""

    index: int
    dim: int
    elem: int = 0


def In(i: int, d: int, elem: int = 0) -> Ref:  # noqa: N802  (reads like a shape formula)
    return Ref(i, d, elem)


def Out(d: int, elem: int = 0) -> Ref:  # noqa: N802
    return Ref(-1, d, elem)


@dataclass(frozen=True)
class Same:
    a: Ref
    b: Ref


@dataclass(frozen=True)
class Offset:
    """size(a) = size(b) + k."""

    a: Ref
    b: Ref
    k: int


@dataclass(frozen=True)
class Product:
    """prod(lhs) * const = prod(rhs)."""

    lhs: tuple[Ref, ...]
    rhs: tuple[Ref, ...]
    const: int = 1


@dataclass(frozen=True)
class Total:
    """size(target) = sum(parts)."""

    target: Ref
    parts: tuple[Ref, ...]


@dataclass(frozen=True)
class Fixed:
    ref: Ref
    why: str = ""


@dataclass(frozen=True)
class Divides:
    """size(ref) stays a multiple of k (e.g. a hidden size of `head_num` heads)."""

    ref: Ref
    k: int


@dataclass(frozen=True)
class Index:
    """The integer values of operand `operand` index dim `ref` (they must stay below it).
    `total`: a value outside the range is defined too (OneHot: a row of off_value), so values
    computed in the graph do not pin the dim; data given as input is still bounded."""

    operand: int
    ref: Ref
    total: bool = False


Relation = Same | Offset | Product | Total | Fixed | Divides | Index
Relations = Callable[[list[list[Shape]], list[Shape], dict[str, Any]], Iterable[Relation]]
Rewrite = Callable[[dict[str, Any], list[list[Shape]], list[Shape], list[list[Shape]],
                    list[Shape]], dict[str, Any]]


@dataclass
class DimRule:
    """How an op's dims relate; `rewrite(attrs, old_in, old_out, new_in, new_out)` returns the
    attributes for shrunk shapes (shape attributes); `preserves_values`: the result holds
    values of operand 0 only (a data-movement op), so an index range carries through it."""

    relations: Relations
    rewrite: Rewrite | None = None
    preserves_values: bool = False


def rule_of(op: str) -> DimRule | None:
    """The dimension relations of `op` (its `OpDef.dims`), None where it declares none."""
    from pcompile.ir.registry import find_op

    opdef = find_op(op)
    return None if opdef is None else opdef.dims


# -- rules shared by many ops ---------------------------------------------------------------


def shapes_of(t: ValueType) -> list[Shape]:
    if isinstance(t, TupleType):
        return [tuple(e.shape) if isinstance(e, TensorType) else () for e in t.elements]
    return [tuple(t.shape)] if isinstance(t, TensorType) else [()]


def broadcast(ins: list[list[Shape]], outs: list[Shape], attrs: dict[str, Any]
              ) -> Iterable[Relation]:
    """Element-wise with numpy broadcasting: each operand dim of the result's size is the
    result's dim (aligned from the right); a broadcast dim of size 1 stays 1."""
    out = outs[0]
    for i, shapes in enumerate(ins):
        shape = shapes[0]
        for d, size in enumerate(shape):
            od = len(out) - len(shape) + d
            if od >= 0 and size == out[od] and size != 1:
                yield Same(In(i, d), Out(od))


def same_shape_tuple(ins: list[list[Shape]], outs: list[Shape], attrs: dict[str, Any]
                     ) -> Iterable[Relation]:
    """Every result element whose shape is operand 0's takes its dims."""
    x = ins[0][0]
    for k, shape in enumerate(outs):
        if shape == x:
            for d in range(len(x)):
                yield Same(In(0, d), Out(d, k))


def keep_attrs(attrs: dict[str, Any], *_: Any) -> dict[str, Any]:
    return dict(attrs)


# -- the solver -----------------------------------------------------------------------------

Sym = tuple[int, int, int]  # (id(value), elem, dim)


class ShrinkError(PcompileError):
    """The graph cannot be shrunk as asked (the message says why)."""


@dataclass
class Shrink:
    """The new size of every (value, dim) of a graph, by position: `params` by parameter
    name, `results[i]` the shapes of node i's result, `constants[(i, j)]` node i's constant
    operand j, `bounds` the index range of integer inputs and constants, and the rewritten
    attributes of every node."""

    factor: int
    ops: list[str]
    params: dict[str, Shape]
    results: list[list[Shape]]
    attrs: list[dict[str, Any]]
    constants: dict[tuple[int, int], Shape]
    bounds: dict[str, int] = field(default_factory=dict)
    const_bounds: dict[tuple[int, int], int] = field(default_factory=dict)
    kept: dict[str, list[str]] = field(default_factory=dict)  # full-size dim -> why
    sizes: dict[int, set[int]] = field(default_factory=dict)  # original size -> new sizes
    original: dict[str, Shape] = field(default_factory=dict)  # parameter shapes before

    def ratio(self, graph: Graph) -> float:
        """Elements of the shrunk graph's values over the original's."""
        old = new = 0
        for node, shapes in zip(graph.nodes, self.results):
            old += sum(math.prod(s) for s in shapes_of(node.result.type))
            new += sum(math.prod(s) for s in shapes)
        for p in graph.params:
            old += math.prod(p.shape)
            new += math.prod(self.params[p.name])
        return new / old if old else 1.0

    def apply(self, graph: Graph) -> None:
        """Rewrite `graph` (traced the same way as the one this was computed on) in place."""
        if [n.op for n in graph.nodes] != self.ops:
            raise ShrinkError("the graph traced for the shrunk check differs from the plan's")
        for p in graph.params:
            p.type = p.tensor_type.with_shape(self.params[p.name])
        for i, node in enumerate(graph.nodes):
            for j, operand in enumerate(node.operands):
                if isinstance(operand, Constant) and (i, j) in self.constants:
                    shape = self.constants[(i, j)]
                    data = np.asarray(operand.array)[tuple(slice(0, n) for n in shape)]
                    bound = self.const_bounds.get((i, j))
                    if bound is not None:
                        data = data % bound
                    node.set_operand(j, Constant(data, operand.dtype))
            node.attrs = dict(self.attrs[i])
            t = node.result.type
            shapes = self.results[i]
            if isinstance(t, TupleType):
                node.result.type = TupleType(tuple(
                    e.with_shape(s) if isinstance(e, TensorType) else e
                    for e, s in zip(t.elements, shapes)))
            elif isinstance(t, TensorType):
                node.result.type = t.with_shape(shapes[0])

    def shrink_input(self, name: str, array: np.ndarray) -> np.ndarray:
        """An input batch's leading block of the shrunk shape (integer values indexing a
        shrunk dim are taken modulo its new size)."""
        shape = self.params[name]
        out = np.asarray(array)[tuple(slice(0, n) for n in shape)]
        bound = self.bounds.get(name)
        return np.array(out % bound if bound is not None else out)  # a copy; 0-d stays 0-d


class _Solver:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.parent: dict[Sym, tuple[Sym, int]] = {}
        self.size: dict[Sym, int] = {}
        self.products: list[tuple[list[Sym], list[Sym], int]] = []
        self.totals: list[tuple[Sym, list[Sym]]] = []
        self.fixed: dict[Sym, str] = {}
        self.divides: list[tuple[Sym, int, int]] = []  # sym, k, minimum per slice
        self.indexes: list[tuple[int, int, Sym]] = []  # node index, operand, indexed dim
        self.total: set[tuple[int, int]] = set()  # (node, operand) of a total Index
        self.tangled: dict[Sym, str] = {}  # dims a Reshape regroups across several dims
        self.values: dict[int, Value] = {}

    # union-find with offsets: size(sym) = size(root) + offset
    def sym(self, value: Value, elem: int, dim: int, size: int) -> Sym:
        s = (id(value), elem, dim)
        if s not in self.parent:
            self.parent[s] = (s, 0)
            self.size[s] = size
            self.values[id(value)] = value
            if size <= 1:
                self.fixed[s] = ""
        return s

    def find(self, s: Sym) -> tuple[Sym, int]:
        p, off = self.parent[s]
        if p == s:
            return s, 0
        root, poff = self.find(p)
        self.parent[s] = (root, off + poff)
        return root, off + poff

    def union(self, a: Sym, b: Sym, k: int, why: str) -> None:
        """size(a) = size(b) + k."""
        ra, oa = self.find(a)
        rb, ob = self.find(b)
        if ra == rb:
            if oa != ob + k:
                self.fixed[a] = self.fixed[b] = why
            return
        # size(ra) + oa = size(rb) + ob + k
        self.parent[ra] = (rb, ob + k - oa)


def _syms(solver: _Solver, node: Node, ref: Ref) -> Sym:
    value = node.result if ref.index < 0 else node.operands[ref.index]
    shape = shapes_of(value.type)[ref.elem]
    return solver.sym(value, ref.elem, ref.dim, shape[ref.dim])


def _where(node: Node) -> str:
    return f"{node.op} ({node.source or node.scope or node.fullname})"


def shrink_graph(graph: Graph, splits: Iterable[tuple[Value, int, int, int]],
                 factor: int) -> Shrink:
    """Divide the dims of `graph` by up to `factor`, keeping every op's dimension relations
    and every (value, elem, dim, k) of `splits` a multiple of k with at least 2 elements
    per slice (or as many as before, when fewer)."""
    return shrinker(graph, splits)(factor)


def shrinker(graph: Graph, splits: Iterable[tuple[Value, int, int, int]]
             ) -> Callable[[int], Shrink]:
    """`shrink_graph` for several factors: the relations are gathered once."""
    solver = _Solver(graph)
    for p in graph.params:
        for d, n in enumerate(p.shape):
            solver.sym(p, 0, d, n)
    preserving: dict[int, Node] = {}
    for i, node in enumerate(graph.nodes):
        ins = [shapes_of(o.type) for o in node.operands]
        outs = shapes_of(node.result.type)
        for j, o in enumerate(node.operands):
            for k, shape in enumerate(ins[j]):
                for d, n in enumerate(shape):
                    solver.sym(o, k, d, n)
        for k, shape in enumerate(outs):
            for d, n in enumerate(shape):
                solver.sym(node.result, k, d, n)
        rule = rule_of(node.op)
        if rule is None:
            why = f"{_where(node)} has no dimension rule"
            for ref_value in (*node.operands, node.result):
                for k, shape in enumerate(shapes_of(ref_value.type)):
                    for d in range(len(shape)):
                        solver.fixed[(id(ref_value), k, d)] = why
            continue
        if rule.preserves_values:
            preserving[id(node.result)] = node
        for rel in rule.relations(ins, outs, node.attrs):
            _relate(solver, node, i, rel)
    for value, elem, dim, k in splits:
        s = solver.sym(value, elem, dim, shapes_of(value.type)[elem][dim])
        if k > 1:
            solver.divides.append((s, k, min(2, solver.size[s] // k)))
    for i, j, s in solver.indexes:
        source = _index_source(graph.nodes[i].operands[j], preserving)
        if (i, j) not in solver.total and not isinstance(source, Constant) and not (
                isinstance(source, GraphParam) and source.kind == "input"):
            what = _where(source.node) if isinstance(source, NodeResult) else "a parameter"
            solver.fixed[s] = (f"{_where(graph.nodes[i])} indexes it with values computed by "
                               f"{what}, whose range a shrunk copy cannot bound")
    _unify_factorizations(solver)
    return lambda factor: _solve(solver, graph, factor, preserving)


def _unify_factorizations(solver: _Solver) -> None:
    """A dim split into the same sizes in the same order in two places is split into the same
    dims: [B, S, H] -> [B*S, H] -> ... -> [B*S, H'] -> [B, S, H'] gives the B and S of both
    ends one class each (the product alone would leave them free of each other)."""
    changed = True
    while changed:
        changed = False
        seen: dict[tuple[Any, ...], list[Sym]] = {}
        for lhs, rhs, const in solver.products:
            for one, other in ((rhs, lhs), (lhs, rhs)):
                if len(one) != 1 or not other or solver.find(one[0])[1] != 0:
                    continue
                key = (solver.find(one[0])[0], const if one is rhs or const == 1 else -const,
                       tuple(solver.size[o] for o in other))
                first = seen.setdefault(key, other)
                for a, b in zip(first, other):
                    if solver.find(a) != solver.find(b):
                        solver.union(a, b, 0, "")
                        changed = True


def _index_source(value: Value, preserving: dict[int, Node]) -> Value:
    """Where index values come from, through data-movement ops."""
    while id(value) in preserving:
        value = preserving[id(value)].operands[0]
    return value


def _relate(solver: _Solver, node: Node, i: int, rel: Relation) -> None:
    why = f"{_where(node)}"
    if isinstance(rel, Same):
        solver.union(_syms(solver, node, rel.a), _syms(solver, node, rel.b), 0, why)
    elif isinstance(rel, Offset):
        solver.union(_syms(solver, node, rel.a), _syms(solver, node, rel.b), rel.k, why)
    elif isinstance(rel, Product):
        lhs = [_syms(solver, node, r) for r in rel.lhs]
        rhs = [_syms(solver, node, r) for r in rel.rhs]
        lhs = [s for s in lhs if solver.size[s] != 1]
        rhs = [s for s in rhs if solver.size[s] != 1]
        if rel.const == 1 and len(lhs) == 1 and len(rhs) == 1:
            solver.union(lhs[0], rhs[0], 0, why)
        elif lhs or rhs:
            solver.products.append((lhs, rhs, rel.const))
            if len(lhs) > 1 and len(rhs) > 1:  # no side is one dim: only shrinks as a whole
                what = (f"{why} regroups dims {[solver.size[x] for x in lhs]} as "
                        f"{[solver.size[x] for x in rhs]}")
                for x in (*lhs, *rhs):
                    solver.tangled.setdefault(x, what)
    elif isinstance(rel, Total):
        solver.totals.append((_syms(solver, node, rel.target),
                              [_syms(solver, node, r) for r in rel.parts]))
    elif isinstance(rel, Fixed):
        # without a reason the dim is the op's own constant (nothing to report)
        solver.fixed[_syms(solver, node, rel.ref)] = f"{why}: {rel.why}" if rel.why else ""
    elif isinstance(rel, Divides):
        solver.divides.append((_syms(solver, node, rel.ref), rel.k, 1))
    elif isinstance(rel, Index):
        solver.indexes.append((i, rel.operand, _syms(solver, node, rel.ref)))
        if rel.total:
            solver.total.add((i, rel.operand))


def _solve(solver: _Solver, graph: Graph, factor: int, preserving: dict[int, Node]) -> Shrink:
    find, size = solver.find, solver.size
    roots = _ordered_roots(solver)
    fixed_roots: dict[Sym, str] = {}
    for s, why in solver.fixed.items():
        fixed_roots.setdefault(find(s)[0], why)
    # derived roots: the single dim of a product (or sum) side follows the other side
    derived: dict[Sym, tuple[str, list[Sym], int]] = {}
    for lhs, rhs, const in solver.products:
        for one, other, c in ((rhs, lhs, const), (lhs, rhs, int(const == 1))):
            if len(one) == 1 and find(one[0])[1] == 0 and c:
                r = find(one[0])[0]
                if r not in derived and r not in fixed_roots and \
                        all(find(o)[0] != r for o in other):
                    derived[r] = ("prod", other, c)
                break
    for target, parts in solver.totals:
        r, off = find(target)
        if off == 0 and r not in derived and r not in fixed_roots:
            derived[r] = ("sum", parts, 0)
    chosen: dict[Sym, int] = {}
    cache: dict[Sym, int] = {}
    where = {s: find(s) for s in solver.parent}  # the classes no longer change
    def root_size(r: Sym, seen: frozenset[Sym] = frozenset()) -> int:
        if r in chosen:
            return chosen[r]
        rule = derived.get(r)
        if rule is None or r in seen:
            return size[r]
        if r in cache:
            return cache[r]
        kind, parts, c = rule
        vals = [root_size(where[p][0], seen | {r}) + where[p][1] for p in parts]
        cache[r] = math.prod(vals) * c if kind == "prod" else sum(vals)
        return cache[r]

    def term_size(t: tuple[Sym, int]) -> int:
        return root_size(t[0]) + t[1]

    def sym_size(s: Sym) -> int:
        return term_size(where[s])

    # the constraints on classes, each once (a model's layers repeat the same ones)
    products = {(tuple(sorted(where[x] for x in lhs)), tuple(sorted(where[x] for x in rhs)), c)
                for lhs, rhs, c in solver.products}
    totals = {(where[t], tuple(sorted(where[x] for x in parts))) for t, parts in solver.totals}
    divides = {(where[x], k, least) for x, k, least in solver.divides}
    fixed = {(where[x], size[x]) for x in solver.fixed}
    # a dim never becomes 1 (that would change broadcasting and which dims are units)
    offsets = {where[x] for x in solver.parent if where[x][1] != 0}

    def consistent() -> bool:
        for lhs, rhs, const in products:
            if math.prod(map(term_size, lhs)) * const != math.prod(map(term_size, rhs)):
                return False
        for target, parts in totals:
            if term_size(target) != sum(map(term_size, parts)):
                return False
        for t, k, least in divides:
            n = term_size(t)
            if n % k or n // k < least:
                return False
        if any(term_size(t) != n for t, n in fixed):
            return False
        return all(term_size(t) >= 2 for t in offsets)

    free = [r for r in roots if r not in derived and r not in fixed_roots and size[r] > 1]
    free.sort(key=lambda r: -size[r])
    for r in free:
        n = size[r]
        for d in sorted((d for d in range(2, min(factor, n // 2) + 1) if n % d == 0),
                        reverse=True):
            chosen[r] = n // d
            cache.clear()
            if consistent():
                break
            del chosen[r]
        cache.clear()
    return _result(solver, graph, factor, sym_size, fixed_roots, preserving)


def _ordered_roots(solver: _Solver) -> list[Sym]:
    seen: dict[Sym, None] = {}
    for s in solver.parent:
        seen.setdefault(solver.find(s)[0], None)
    return list(seen)


def _result(solver: _Solver, graph: Graph, factor: int, sym_size: Callable[[Sym], int],
            fixed_roots: dict[Sym, str], preserving: dict[int, Node]) -> Shrink:
    def new_shapes(value: Value) -> list[Shape]:
        return [tuple(sym_size((id(value), k, d)) for d in range(len(shape)))
                for k, shape in enumerate(shapes_of(value.type))]

    params = {p.name: new_shapes(p)[0] for p in graph.params}
    results, attrs, ops = [], [], []
    constants: dict[tuple[int, int], Shape] = {}
    for i, node in enumerate(graph.nodes):
        ins_old = [shapes_of(o.type) for o in node.operands]
        ins_new = [new_shapes(o) for o in node.operands]
        for j, o in enumerate(node.operands):
            if isinstance(o, Constant):
                constants[(i, j)] = ins_new[j][0]
        outs_new = new_shapes(node.result)
        rule = rule_of(node.op)
        new_attrs = dict(node.attrs)
        if rule is not None and rule.rewrite is not None and \
                (ins_new != ins_old or outs_new != shapes_of(node.result.type)):
            new_attrs = rule.rewrite(dict(node.attrs), ins_old, shapes_of(node.result.type),
                                     ins_new, outs_new)
        ops.append(node.op)
        results.append(outs_new)
        attrs.append(new_attrs)
    shrink = Shrink(factor, ops, params, results, attrs, constants,
                    original={p.name: tuple(p.shape) for p in graph.params})
    for i, j, s in solver.indexes:
        bound = sym_size(s)
        if bound == solver.size[s]:
            continue
        value = _index_source(graph.nodes[i].operands[j], preserving)
        if isinstance(value, GraphParam):
            shrink.bounds[value.name] = min(bound, shrink.bounds.get(value.name, bound))
        else:
            for (ci, cj), _ in constants.items():
                if graph.nodes[ci].operands[cj] is value:
                    shrink.const_bounds[(ci, cj)] = bound
    for s in solver.parent:
        if solver.size[s] > 1 and sym_size(s) == solver.size[s]:
            why = (fixed_roots.get(solver.find(s)[0]) or solver.fixed.get(s)
                   or solver.tangled.get(s))
            if why:
                shrink.kept.setdefault(why, [])
        shrink.sizes.setdefault(solver.size[s], set()).add(sym_size(s))
    return shrink
