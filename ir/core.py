"""SSA values, nodes and graphs.

Values compare by identity and know their users. A node's operands change only through
`Node.set_operand`, which keeps the use lists right; `Value.replace_all_uses_with` builds on it.
Names are hints: the printer numbers nodes (`%0`, `%1`, ...) and graph parameters
(`%para1_x`, ...) itself.

Op parameters (transpose flags, axes, groups) live in `Node.attrs` and are declared by the op's
registry entry; results of parallel passes (strategies, layouts, why a collective exists) live in
`Node.parallel`, a typed annotation, never in `attrs`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from pcompile.ir.parallel_info import ParallelInfo as ParallelInfo
from pcompile.ir.types import DType, TensorType, ValueType


@dataclass(frozen=True)
class SourceLoc:
    """Where the user wrote the call that produced a node."""

    file: str
    line: int
    text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


class Value:
    """An SSA value: a node result, a graph parameter or a constant."""

    def __init__(self, type_: ValueType, name_hint: str = "") -> None:
        self.type: ValueType = type_
        self.name_hint = name_hint
        self.uses: list[tuple[Node, int]] = []
        # (graph, k): this value is output k of graph (kept by `Graph.outputs`)
        self.output_uses: list[tuple[Graph, int]] = []

    @property
    def tensor_type(self) -> TensorType:
        if not isinstance(self.type, TensorType):
            raise TypeError(f"value {self.name_hint!r} is a tuple, not a tensor")
        return self.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor_type.shape

    @property
    def dtype(self) -> DType:
        return self.tensor_type.dtype

    @property
    def users(self) -> list[Node]:
        seen: list[Node] = []
        for node, _ in self.uses:
            if not any(node is s for s in seen):
                seen.append(node)
        return seen

    def replace_all_uses_with(self, other: Value) -> None:
        """Every use of this value, as an operand or as a graph's output, becomes `other`."""
        for node, index in list(self.uses):
            node.set_operand(index, other)
        for owner in {id(g): g for g, _ in self.output_uses}.values():
            owner.outputs = [other if o is self else o for o in owner.outputs]

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name_hint} {self.type}>"


class GraphParam(Value):
    """A graph parameter: an input (`kind="input"`) or a stored tensor (weight or optimizer
    state) that has a default value outside the graph."""

    def __init__(
        self,
        type_: TensorType,
        name: str,
        kind: str = "input",
        requires_grad: bool = False,
    ) -> None:
        super().__init__(type_, name)
        if kind not in ("input", "weight", "state"):
            raise ValueError(f"unknown graph parameter kind {kind!r}")
        self.name = name
        self.kind = kind
        self.requires_grad = requires_grad

    @property
    def has_default(self) -> bool:
        return self.kind != "input"


class Constant(Value):
    """A constant tensor printed inline where it is used."""

    def __init__(self, array: np.ndarray, dtype: DType) -> None:
        data = np.asarray(array, dtype=dtype.np)
        super().__init__(TensorType(dtype, tuple(int(d) for d in data.shape)), "const")
        self.array = data


class OpaqueConstant(Constant):
    """A constant whose data a dump does not hold: large constants are printed by the digest
    of their data (`value=@<digest>`), and a parsed dump gets this in their place. Its type
    is known; its data is not (executing it is an error)."""

    def __init__(self, type_: TensorType, digest: str) -> None:
        Value.__init__(self, type_, "const")
        self.digest = digest

    @property
    def array(self) -> np.ndarray:  # type: ignore[override]  # on purpose: no data to read or set
        raise ValueError(
            f"the data of this {self.type} constant is not in the dump (printed by its digest "
            f"@{self.digest}); run the compiled program, not a parsed dump"
        )


def array_digest(array: np.ndarray) -> str:
    """The digest a dump prints for a large constant: sha256 of its bytes, 16 hex digits.
    Remembered per array object (constants share their data across passes and layers)."""
    import hashlib
    import weakref

    known = _DIGESTS.get(id(array))
    if known is not None and known[0]() is array:
        return known[1]
    digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]
    try:
        _DIGESTS[id(array)] = (weakref.ref(array), digest)
    except TypeError:
        pass
    return digest


_DIGESTS: dict[int, tuple[Any, str]] = {}


class RankConstant(Constant):
    """A constant whose data depends on the rank (`ir.rank`): `data.at(rank)` is rank r's array.
    `array` holds rank 0's, which gives the type (every rank's has the same shape); a consumer
    that executes or prints one rank's view reads `constant_at(value, rank)`."""

    def __init__(self, data: Any, dtype: DType) -> None:
        super().__init__(np.asarray(data.at(0)), dtype)
        self.data = data

    def array_at(self, rank: int) -> np.ndarray:
        return np.asarray(self.data.at(rank), dtype=self.dtype.np)


def constant_at(value: Constant, rank: int | None) -> np.ndarray:
    """A constant's data on `rank` (plain constants are the same on every rank; an
    `OpaqueConstant` has none and raises)."""
    if isinstance(value, RankConstant):
        if rank is None:
            raise ValueError("a rank-dependent constant needs a rank")
        return value.array_at(rank)
    return value.array


class NodeResult(Value):
    """The (single, possibly tuple-typed) result of a node."""

    def __init__(self, type_: ValueType, node: Node, name_hint: str = "") -> None:
        super().__init__(type_, name_hint)
        self.node = node


class Node:
    """One primitive application: `result = op(operands) {attrs}`."""

    def __init__(
        self,
        op: str,
        operands: Sequence[Value],
        attrs: dict[str, Any],
        result_type: ValueType,
        *,
        instance_name: str = "",
        scope: str = "Default",
        source: SourceLoc | None = None,
        name_hint: str = "",
        parallel: ParallelInfo | None = None,
    ) -> None:
        self.op = op
        self._operands: list[Value] = []
        self._operand_tuple: tuple[Value, ...] | None = None  # `operands`, until they change
        self.attrs: dict[str, Any] = dict(attrs)
        self.instance_name = instance_name
        self.scope = scope
        self.source = source
        self.parallel = parallel
        self.fullname = ""  # "<scope>/<Op>-op<k>", set by the graph on insertion
        self.result = NodeResult(result_type, self, name_hint or "CNode")
        for value in operands:
            self._append_operand(value)

    @property
    def operands(self) -> tuple[Value, ...]:
        cached = self._operand_tuple
        if cached is None:
            cached = self._operand_tuple = tuple(self._operands)
        return cached

    def _append_operand(self, value: Value) -> None:
        if not isinstance(value, Value):
            raise TypeError(f"{self.op}: operand {value!r} is not an IR value")
        self._operands.append(value)
        self._operand_tuple = None
        value.uses.append((self, len(self._operands) - 1))

    def set_operand(self, index: int, value: Value) -> None:
        old = self._operands[index]
        old.uses = [(n, i) for n, i in old.uses if not (n is self and i == index)]
        self._operands[index] = value
        self._operand_tuple = None
        value.uses.append((self, index))

    def drop_operands(self) -> None:
        for index, old in enumerate(self._operands):
            old.uses = [(n, i) for n, i in old.uses if not (n is self and i == index)]
        self._operands = []
        self._operand_tuple = None

    @property
    def operand_types(self) -> list[ValueType]:
        return [v.type for v in self._operands]

    def where(self) -> str:
        """Human-readable location for error messages."""
        name = self.instance_name or self.op
        loc = f" at {self.source}" if self.source else ""
        return f"{self.op} '{name}' (scope {self.scope}){loc}"

    def __repr__(self) -> str:
        return f"<Node {self.op} {self.instance_name}>"


class NodeList:
    """The nodes of a graph, in order: appending, inserting before or after a node and removing
    one are O(1) (a doubly linked list keyed by node identity); iterating, indexing and
    `index` read an array that is rebuilt once after a run of edits in the middle. A node is
    in at most one place."""

    __slots__ = ("_array", "_head", "_key", "_next", "_position", "_prev", "_tail")

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        self._next: dict[int, Node | None] = {}
        self._prev: dict[int, Node | None] = {}
        # an increasing key per node (`order_key`): compares positions without the array
        self._key: dict[int, float] = {}
        self._head: Node | None = None
        self._tail: Node | None = None
        self._array: list[Node] | None = []
        self._position: dict[int, int] | None = None
        for node in nodes:
            self.append(node)

    def _link(self, node: Node, prev: Node | None, nxt: Node | None) -> None:
        key = id(node)
        if key in self._next:
            raise ValueError(f"{node!r} is already in this graph")
        self._prev[key], self._next[key] = prev, nxt
        if prev is None:
            self._head = node
        else:
            self._next[id(prev)] = node
        if nxt is None:
            self._tail = node
        else:
            self._prev[id(nxt)] = node
        low = self._key[id(prev)] if prev is not None else None
        high = self._key[id(nxt)] if nxt is not None else None
        if high is None:
            self._key[key] = (low if low is not None else 0.0) + 1.0
        elif low is None:
            self._key[key] = high - 1.0
        else:
            middle = (low + high) / 2
            if low < middle < high:
                self._key[key] = middle
            else:  # no float left between them: number the nodes afresh
                self._key[key] = low
                self._renumber()

    def _renumber(self) -> None:
        node, k = self._head, 0.0
        while node is not None:
            self._key[id(node)] = k
            k += 1.0
            node = self._next[id(node)]

    def append(self, node: Node) -> None:
        self._link(node, self._tail, None)
        if self._array is not None:
            if self._position is not None:
                self._position[id(node)] = len(self._array)
            self._array.append(node)

    def insert_after(self, anchor: Node, node: Node) -> None:
        if anchor is self._tail:
            self.append(node)
            return
        self._check(anchor)
        self._link(node, anchor, self._next[id(anchor)])
        self._array = self._position = None

    def insert_before(self, anchor: Node, node: Node) -> None:
        self._check(anchor)
        self._link(node, self._prev[id(anchor)], anchor)
        self._array = self._position = None

    def remove(self, node: Node) -> None:
        self._check(node)
        key = id(node)
        prev, nxt = self._prev.pop(key), self._next.pop(key)
        del self._key[key]
        if prev is None:
            self._head = nxt
        else:
            self._next[id(prev)] = nxt
        if nxt is None:
            self._tail = prev
        else:
            self._prev[id(nxt)] = prev
        if nxt is None and self._array is not None:  # the last node: the array stays valid
            self._array.pop()
            if self._position is not None:
                del self._position[key]
        else:
            self._array = self._position = None

    def _check(self, node: Node) -> None:
        if id(node) not in self._next:
            raise ValueError(f"{node!r} is not in this graph")

    def _list(self) -> list[Node]:
        if self._array is None:
            out: list[Node] = []
            node = self._head
            nxt = self._next
            while node is not None:
                out.append(node)
                node = nxt[id(node)]
            self._array = out
        return self._array

    def order_key(self, node: Node) -> float:
        """A number that increases along the list (changes when the list is edited): compares
        two nodes' positions in O(1)."""
        self._check(node)
        return self._key[id(node)]

    def index(self, node: Node) -> int:
        self._check(node)
        if self._position is None:
            self._position = {id(n): i for i, n in enumerate(self._list())}
        return self._position[id(node)]

    def __contains__(self, node: object) -> bool:
        return id(node) in self._next

    def __iter__(self) -> Iterator[Node]:
        return iter(self._list())

    def __reversed__(self) -> Iterator[Node]:
        return reversed(self._list())

    def __len__(self) -> int:
        return len(self._next)

    @overload
    def __getitem__(self, index: int) -> Node: ...

    @overload
    def __getitem__(self, index: slice) -> list[Node]: ...

    def __getitem__(self, index: int | slice) -> Node | list[Node]:
        return self._list()[index]

    def __repr__(self) -> str:
        return f"NodeList({self._list()!r})"

    def __reduce__(self) -> tuple[type[NodeList], tuple[list[Node]]]:
        # copied or pickled as its nodes in order: the links are keyed by node identity
        return NodeList, (self._list(),)


class Graph:
    """A function: parameters (inputs first, then stored tensors), nodes in a valid
    topological order, and the returned values. Nodes are added, moved and removed through
    the graph (`append`, `insert_after`, `insert_before`, `move_after`, `remove`, `reorder`),
    each O(1) per node; the outputs are uses of their values (`Value.output_uses`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.params: list[GraphParam] = []
        self._nodes = NodeList()
        self._outputs: tuple[Value, ...] = ()
        self.attrs: dict[str, Any] = {}
        self._op_counts: dict[str, int] = {}
        self._param_names: set[str] = set()
        self._param_index: dict[str, int] = {}  # name -> position, for `param` (may be stale)

    @property
    def nodes(self) -> NodeList:
        return self._nodes

    @property
    def outputs(self) -> tuple[Value, ...]:
        return self._outputs

    @outputs.setter
    def outputs(self, values: Iterable[Value]) -> None:
        for value in self._outputs:
            value.output_uses = [(g, k) for g, k in value.output_uses if g is not self]
        self._outputs = tuple(values)
        for k, value in enumerate(self._outputs):
            value.output_uses.append((self, k))

    # -- construction -------------------------------------------------------------------------
    def add_param(self, param: GraphParam) -> GraphParam:
        names = self._param_names
        if len(names) != len(self.params):  # params was assigned or edited directly
            names.clear()
            names.update(p.name for p in self.params)
        if param.name in names:
            raise ValueError(f"graph {self.name}: duplicate parameter name {param.name!r}")
        self.params.append(param)
        names.add(param.name)
        return param

    def append(self, node: Node) -> Node:
        self._assign_fullname(node)
        self._nodes.append(node)
        return node

    def insert_after(self, anchor: Node, node: Node) -> Node:
        self._assign_fullname(node)
        self._nodes.insert_after(anchor, node)
        return node

    def insert_before(self, anchor: Node, node: Node) -> Node:
        self._assign_fullname(node)
        self._nodes.insert_before(anchor, node)
        return node

    def move_after(self, anchor: Node | None, nodes: Sequence[Node]) -> None:
        """Move `nodes` (of this graph), in their given order, right after `anchor` (None: to
        the front)."""
        for node in nodes:
            self._nodes.remove(node)
        first = self._nodes[0] if anchor is None and len(self._nodes) else None
        for node in nodes:
            if first is not None:
                self._nodes.insert_before(first, node)
            elif anchor is None:  # the graph held only `nodes`
                self._nodes.append(node)
            else:
                self._nodes.insert_after(anchor, node)
                anchor = node

    def remove(self, node: Node) -> None:
        if node.result.uses or any(g is self for g, _ in node.result.output_uses):
            raise ValueError(f"cannot remove {node!r}: its result is still used")
        node.drop_operands()
        self._nodes.remove(node)

    def reorder(self, nodes: Sequence[Node]) -> None:
        """The same nodes in a new order (a topological order: the verifier checks)."""
        if (len(nodes) != len(self._nodes) or len({id(n) for n in nodes}) != len(nodes)
                or any(n not in self._nodes for n in nodes)):
            raise ValueError(f"graph {self.name}: reorder needs the graph's own nodes, each once")
        self._nodes = NodeList(nodes)

    def order_key(self, node: Node) -> float:
        """Compares positions in O(1): `order_key(a) < order_key(b)` iff a comes before b."""
        return self._nodes.order_key(node)

    def index_of(self, node: Node) -> int:
        try:
            return self._nodes.index(node)
        except ValueError:
            raise ValueError(f"{node!r} is not in graph {self.name}") from None

    def _assign_fullname(self, node: Node) -> None:
        if not node.fullname:
            k = self._op_counts.get(node.op, 0)
            self._op_counts[node.op] = k + 1
            node.fullname = f"{node.scope}/{node.op}-op{k}"

    # -- queries ------------------------------------------------------------------------------
    def param(self, name: str) -> GraphParam:
        params = self.params
        index = self._param_index.get(name)
        if index is not None and index < len(params) and params[index].name == name:
            return params[index]  # names are unique: the position remembered is still it
        self._param_index = {p.name: i for i, p in enumerate(params)}
        index = self._param_index.get(name)
        if index is None:
            raise KeyError(f"graph {self.name} has no parameter {name!r}")
        return params[index]

    @property
    def inputs(self) -> list[GraphParam]:
        return [p for p in self.params if p.kind == "input"]

    @property
    def weights(self) -> list[GraphParam]:
        return [p for p in self.params if p.kind == "weight"]

    @property
    def states(self) -> list[GraphParam]:
        return [p for p in self.params if p.kind == "state"]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def find(self, op: str | None = None, instance_name: str | None = None) -> list[Node]:
        return [
            n
            for n in self.nodes
            if (op is None or n.op == op)
            and (instance_name is None or n.instance_name == instance_name)
        ]

    def at_rank(self, rank: int) -> Graph:
        """Rank `rank`'s concrete view of a rank-parametric graph: a copy in which every
        `ir.rank` attribute and rank-dependent constant holds that rank's value."""
        from pcompile.ir.rank import resolve, resolve_attrs

        out = Graph(self.name)
        out.attrs = {k: resolve(v, rank) for k, v in self.attrs.items()}
        mapping: dict[int, Value] = {}
        for p in self.params:
            mapping[id(p)] = out.add_param(GraphParam(p.tensor_type, p.name, p.kind,
                                                      p.requires_grad))

        def value(v: Value) -> Value:
            if isinstance(v, Constant):  # a copy: constants keep their own use lists
                return Constant(constant_at(v, rank), v.dtype)
            return mapping[id(v)]

        for node in self.nodes:
            copy = Node(node.op, [value(v) for v in node.operands],
                        resolve_attrs(node.attrs, rank), node.result.type,
                        instance_name=node.instance_name, scope=node.scope, source=node.source,
                        name_hint=node.result.name_hint, parallel=node.parallel)
            copy.fullname = node.fullname
            out.nodes.append(copy)
            mapping[id(node.result)] = copy.result
        out.outputs = [value(v) for v in self.outputs]
        return out

    def dead_code_elimination(self) -> int:
        """Remove nodes whose results reach no output; returns how many were removed."""
        live: set[int] = set()
        stack: list[Value] = list(self.outputs)
        while stack:
            value = stack.pop()
            if isinstance(value, NodeResult) and id(value.node) not in live:
                live.add(id(value.node))
                stack.extend(value.node.operands)
        dead = [node for node in reversed(self.nodes) if id(node) not in live]
        for node in dead:
            node.result.uses.clear()
            node.drop_operands()
            self._nodes.remove(node)
        return len(dead)

