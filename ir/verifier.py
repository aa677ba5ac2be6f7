"""The IR verifier: `verify(graph)` checks the invariants every pass must keep.

* parameters are `GraphParam`s with tensor types and unique names;
* every node appears once, is registered, has its result attached, and names only declared
  attributes (plus the generic parallel ones; `allow_extra_attrs=True` also admits the keys a
  user set with `add_prim_attr`), with every declared attribute present;
* every operand is a constant, a parameter of this graph, or the result of an *earlier* node;
* use lists agree with operands: `(node, i)` is in `v.uses` exactly once iff
  `node.operands[i] is v`, and no value lists a use by a node outside the graph;
* a node's result type is what its op infers from its operand types and attributes;
* every output is defined (constant, parameter of this graph, or a node result) and lists
  that use (`Value.output_uses`).

The first violation raises `VerifyError` naming the graph, the node (`%<n>`, op, instance name,
scope and source line) and what is wrong.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NoReturn

import numpy as np

from pcompile.ir import registry
from pcompile.ir.core import (
    Constant,
    Graph,
    GraphParam,
    Node,
    NodeResult,
    OpaqueConstant,
    Value,
)
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.types import TensorType, TupleType


class VerifyError(PcompileError):
    """A graph breaks an IR invariant; `node` is the offending node, when there is one."""

    def __init__(self, message: str, node: Node | None = None) -> None:
        super().__init__(message)
        self.node = node


def _generic_attrs() -> frozenset[str]:
    return frozenset(getattr(registry, "GENERIC_ATTRS", ()))


class _Verifier:
    def __init__(self, graph: Graph, allow_extra_attrs: bool, start: int = 0) -> None:
        self.graph = graph
        self.allow_extra_attrs = allow_extra_attrs
        self.start = start
        self.names: dict[int, str] = {}
        self.position: dict[int, int] = {}  # id(node) -> index in graph.nodes

    def name(self, value: Value) -> str:
        if isinstance(value, Constant):
            return f"constant {value.type}"
        known = self.names.get(id(value))
        if known is not None:
            return known
        if isinstance(value, NodeResult):
            return f"result of {value.node.where()} (not in the graph)"
        if isinstance(value, GraphParam):
            return f"parameter {value.name!r} (not of this graph)"
        return f"value {value.name_hint!r} of type {type(value).__name__}"

    def fail(self, message: str, node: Node | None = None, index: int | None = None) -> NoReturn:
        where = f"graph {self.graph.name}"
        if node is not None:
            where += f": node %{index} {node.where()}"
        raise VerifyError(f"{where}: {message}", node)

    # -- checks -------------------------------------------------------------------------------
    def params(self) -> None:
        seen: set[str] = set()
        for k, param in enumerate(self.graph.params, start=1):
            if not isinstance(param, GraphParam):
                self.fail(f"parameter {k} is a {type(param).__name__}, not a GraphParam")
            if not isinstance(param.type, TensorType):
                self.fail(f"parameter {param.name!r} has type {param.type}, not a tensor type")
            if param.name in seen:
                self.fail(f"duplicate parameter name {param.name!r}")
            seen.add(param.name)
            if id(param) in self.names:
                self.fail(f"parameter {param.name!r} is listed twice")
            self.names[id(param)] = f"%para{k}_{param.name}"

    def constant(self, const: Constant) -> str | None:
        ttype = const.type
        if not isinstance(ttype, TensorType):
            return f"has tuple type {ttype}"
        if isinstance(const, OpaqueConstant):
            return None  # a parsed dump's large constant: only its type is known
        array = np.asarray(const.array)
        if tuple(array.shape) != ttype.shape or array.dtype != ttype.dtype.np:
            return f"holds a {array.dtype} array of shape {array.shape} but has type {ttype}"
        return None

    def operand(self, node: Node, index: int, j: int, value: Value) -> None:
        if isinstance(value, Constant):
            problem = self.constant(value)
            if problem:
                self.fail(f"operand {j} is a constant that {problem}", node, index)
            return
        if isinstance(value, GraphParam):
            if id(value) not in self.names:
                self.fail(f"operand {j} is {self.name(value)}", node, index)
            return
        if isinstance(value, NodeResult):
            producer = self.position.get(id(value.node))
            if producer is None or value.node.result is not value:
                self.fail(f"operand {j} is the {self.name(value)}", node, index)
            elif producer >= index:
                self.fail(
                    f"operand {j} is %{producer} ({value.node.op}), which is defined later "
                    "(nodes must be in topological order)",
                    node,
                    index,
                )
            return
        self.fail(f"operand {j} is a {type(value).__name__}, not an IR value", node, index)

    def attrs(self, node: Node, index: int, opdef: registry.OpDef) -> dict[str, Any]:
        declared = opdef.attrs
        unknown = [k for k in node.attrs if k not in declared and k not in _generic_attrs()]
        if unknown and not self.allow_extra_attrs:
            self.fail(
                f"unknown attribute(s) {', '.join(map(str, unknown))}; {opdef.name} declares "
                f"{', '.join(declared) or 'none'}",
                node,
                index,
            )
        missing = [k for k in declared if k not in node.attrs]
        if missing:
            self.fail(f"missing attribute(s) {', '.join(missing)}", node, index)
        return {k: v for k, v in node.attrs.items() if k in declared}

    def node_type(self, node: Node, index: int, opdef: registry.OpDef) -> None:
        impl_attrs = self.attrs(node, index, opdef)
        types = [v.type for v in node.operands]
        try:
            opdef.check_arity(len(types))
            # A rank-parametric graph has the same types on every rank: infer at rank 0.
            inferred = opdef.infer_type(types, impl_attrs)
        except ShapeError as exc:
            shapes = ", ".join(str(t) for t in types)
            self.fail(f"{opdef.name} rejects its operands ({shapes}): {exc}", node, index)
        if not isinstance(node.result.type, (TensorType, TupleType)):
            self.fail(f"result type {node.result.type!r} is not a value type", node, index)
        if inferred != node.result.type:
            self.fail(
                f"result type {node.result.type} disagrees with {inferred}, which {opdef.name} "
                "infers from its operands and attributes",
                node,
                index,
            )

    def nodes(self) -> None:
        for index, node in enumerate(self.graph.nodes):
            if id(node) in self.position:
                self.fail(
                    f"appears twice in the node list (also at %{self.position[id(node)]})",
                    node,
                    index,
                )
            self.position[id(node)] = index
        for index, node in enumerate(self.graph.nodes):
            if index < self.start:
                self.names[id(node.result)] = f"%{index}"
                continue
            if node.result.node is not node:
                self.fail("its result belongs to another node", node, index)
            try:
                opdef = registry.get_op(node.op)
            except KeyError:
                self.fail(f"unknown op {node.op!r}", node, index)
            for j, value in enumerate(node.operands):
                self.operand(node, index, j, value)
            self.node_type(node, index, opdef)
            self.names[id(node.result)] = f"%{index}"

    def uses(self) -> None:
        """Use lists are exact: every operand slot of a checked node is listed in its value's
        uses, and every use a checked value lists is an operand slot of a node in the graph,
        once. With `start`, the checked values are those the new nodes define or read."""
        position = self.position
        nodes = self.graph.nodes[self.start:]
        values: dict[int, Value] = {} if self.start else {id(p): p for p in self.graph.params}
        for node in nodes:
            values[id(node.result)] = node.result
            for value in node.operands:
                values[id(value)] = value
        listed: dict[int, set[tuple[int, int]]] = {}
        for key, value in values.items():
            seen: set[tuple[int, int]] = set()
            for user, j in value.uses:
                pos = position.get(id(user))
                if pos is None:
                    self.fail(
                        f"use lists: {self.name(value)} lists a use by {user.where()} "
                        f"(operand {j}), which is not in the graph"
                    )
                operands = user.operands
                if (pos, j) in seen or j >= len(operands) or operands[j] is not value:
                    self._use_mismatch(value)
                seen.add((pos, j))
            listed[key] = seen
        for index, node in enumerate(nodes, start=self.start):
            for j, value in enumerate(node.operands):
                if (index, j) not in listed[id(value)]:
                    self._use_mismatch(value)

    def _expected_uses(self, value: Value) -> Counter[tuple[int, int]]:
        want: Counter[tuple[int, int]] = Counter()
        for index, node in enumerate(self.graph.nodes):
            for j, operand in enumerate(node.operands):
                if operand is value:
                    want[(index, j)] += 1
        return want

    def _use_mismatch(self, value: Value) -> NoReturn:
        """Name the first slot where `value`'s use list and the graph disagree (the slow,
        precise comparison, only once a mismatch is known)."""
        actual: Counter[tuple[int, int]] = Counter(
            (self.position[id(user)], j) for user, j in value.uses)
        want = self._expected_uses(value)
        for index, j in sorted(set(actual) | set(want)):
            have, need = actual[(index, j)], want[(index, j)]
            if have == need:
                continue
            if have < need:
                problem = f"is operand {j} but its use list lacks that use"
            else:
                problem = f"lists {have} use(s) as operand {j}, but the node has {need}"
            self.fail(f"use lists: {self.name(value)} {problem}", self.graph.nodes[index], index)
        self.fail(f"use lists: {self.name(value)} disagree with the graph")

    def outputs(self) -> None:
        for k, value in enumerate(self.graph.outputs):
            if isinstance(value, Constant):
                problem = self.constant(value)
                if problem:
                    self.fail(f"output {k} is a constant that {problem}")
            elif id(value) not in self.names:
                self.fail(f"output {k} is undefined: the {self.name(value)}")
            if not any(g is self.graph and i == k for g, i in value.output_uses):
                self.fail(f"use lists: output {k} ({self.name(value)}) does not list its use "
                          "as the graph's output")

    def run(self) -> None:
        self.params()
        self.nodes()
        self.uses()
        self.outputs()


def verify(graph: Graph, *, allow_extra_attrs: bool = False, start: int = 0) -> None:
    """Check `graph`'s invariants (see the module docstring); raise `VerifyError` on the first
    violation. `allow_extra_attrs` admits attributes an op does not declare (the user's
    `add_prim_attr` keys). `start`: the nodes before it were verified already and not changed
    since (a pass only appended): check the nodes from `start`, and the use lists of the
    values they define or read."""
    _Verifier(graph, allow_extra_attrs, start).run()
