"""`ParallelInfo`: the typed results of the parallel passes on one node.

Every field is typed and reads None while no pass has set it; `ir.printer.PARALLEL_FIELDS` and
`FIELD_READERS` below (`ir.parser.PARALLEL_FIELDS`) hold each field's one text form. A dump
prints the set fields as `{name: value, ...}`: the strategies and the layouts first (where
MindSpore prints them), then the others in the order the passes set them, so the text records
the order in which a node was annotated (a node made for micro-batch k says `micro` first; a
node copied into it later gets `micro` after its own notes). The arguments of the constructor
count as set in the order of the fields below. Values are immutable (tuples and frozen
dataclasses); to change one, set it anew.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

#: A strategy: one tuple of dims per input or output (a user's Layout prints as its dict).
Strategy = tuple[Any, ...]

T = TypeVar("T")


@dataclass(frozen=True)
class LayoutDetail:
    """One tensor's layout as MindSpore prints it with `MS_DEV_DUMP_IR_PARALLEL_DETAIL=1`
    (`{'device_matrix': (2, 4), 'tensor_map': (1, 0)}`); a user's Layout adds its
    `interleaved_parallel` and `alias_name`."""

    device_matrix: tuple[int, ...]
    tensor_map: tuple[Any, ...]  # an int per dim, or a tuple of ints for a dim split twice
    interleaved_parallel: bool | None = None
    alias_name: tuple[str, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The printed dict: the fields that are set, in this order."""
        out: dict[str, Any] = {"device_matrix": self.device_matrix, "tensor_map": self.tensor_map}
        if self.interleaved_parallel is not None:
            out["interleaved_parallel"] = self.interleaved_parallel
        if self.alias_name is not None:
            out["alias_name"] = self.alias_name
        return out


@dataclass(frozen=True)
class SearchCost:
    """`cost`: the chosen strategy's objective (`op`) and that of the redistributions on all
    its edges with the neighbours at the plan; `local` is dynamic programming's local objective
    (None for the other searches). An infinite cost (a forbidden layout) is `math.inf`."""

    op: float
    redistribution: float
    local: float | None = None


@dataclass(frozen=True)
class SwcCost:
    """Sharding propagation's comparison terms (MindSpore's `CompareSwcCost`): redistribution
    communication and computation over the deciding edges, and the op's forward
    communication."""

    communication: float
    computation: float
    forward: float


@dataclass(frozen=True)
class RunnerUp:
    """The best other candidate: its strategy and its cost under the comparison the search
    made (`local` objective for dynamic programming, `swc` terms for sharding propagation)."""

    strategy: Strategy
    local: float | None = None
    swc: SwcCost | None = None


class _Field(Generic[T]):
    """One typed field of ParallelInfo: None while unset; setting None unsets it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, info: None, owner: type | None = None) -> _Field[T]: ...

    @overload
    def __get__(self, info: ParallelInfo, owner: type | None = None) -> T | None: ...

    def __get__(self, info: ParallelInfo | None, owner: type | None = None
                ) -> _Field[T] | T | None:
        if info is None:
            return self
        value: T | None = info._values.get(self.name)
        return value

    def __set__(self, info: ParallelInfo, value: T | None) -> None:
        if value is None:
            info._values.pop(self.name, None)
        else:
            info._values[self.name] = value


class ParallelInfo:
    """Parallel annotations of a node, filled by the parallel passes (see the module doc for
    the order in which they print)."""

    __slots__ = ("_values",)  # the fields below, nothing else

    #: the effective strategies (the user's or the search's), nested tuples of ints
    in_strategy = _Field[Strategy]()
    out_strategy = _Field[Strategy]()
    #: MindSpore's parallel detail under sharding propagation: one layout per input / output
    in_layout = _Field[tuple[LayoutDetail, ...]]()
    out_layout = _Field[tuple[LayoutDetail, ...]]()
    #: why the search chose the strategy (step_parallel_begin): its cost, the comparison that
    #: decided it, the best other candidate, or what decided it when nothing was compared
    cost = _Field[SearchCost]()
    decision = _Field[SwcCost]()
    runner_up = _Field[RunnerUp]()
    decided_by = _Field[str]()
    #: the pipeline unit a node belongs to: micro-batch k (MindSpore's `micro` cnode attr) and
    #: the virtual-stage chunk of an interleaved schedule
    micro = _Field[int]()
    chunk = _Field[int]()
    #: why an inserted node (a collective, a slice, a Send) exists
    reason = _Field[str]()
    #: a fused collective: its bucket number and the collectives it replaced
    fusion = _Field[int]()
    members = _Field[tuple[str, ...]]()
    #: the bytes a collective moves per rank (ring algorithm) or a Receive receives
    bytes = _Field[int]()
    #: the parameter a gather of the parallel optimizer serves
    parameter = _Field[str]()

    #: every field, in the order of the constructor
    FIELDS = ("in_strategy", "out_strategy", "in_layout", "out_layout", "cost", "decision",
              "runner_up", "decided_by", "micro", "chunk", "reason", "fusion", "members",
              "bytes", "parameter")
    #: the fields that print first, in this order, whenever they are set
    LEADING = ("in_strategy", "out_strategy", "in_layout", "out_layout")

    def __init__(
        self,
        in_strategy: Strategy | None = None,
        out_strategy: Strategy | None = None,
        *,
        in_layout: tuple[LayoutDetail, ...] | None = None,
        out_layout: tuple[LayoutDetail, ...] | None = None,
        cost: SearchCost | None = None,
        decision: SwcCost | None = None,
        runner_up: RunnerUp | None = None,
        decided_by: str | None = None,
        micro: int | None = None,
        chunk: int | None = None,
        reason: str | None = None,
        fusion: int | None = None,
        members: tuple[str, ...] | None = None,
        bytes: int | None = None,
        parameter: str | None = None,
    ) -> None:
        self._values: dict[str, Any] = {}  # the set fields, in the order they were set
        self.in_strategy = in_strategy
        self.out_strategy = out_strategy
        self.in_layout = in_layout
        self.out_layout = out_layout
        self.cost = cost
        self.decision = decision
        self.runner_up = runner_up
        self.decided_by = decided_by
        self.micro = micro
        self.chunk = chunk
        self.reason = reason
        self.fusion = fusion
        self.members = members
        self.bytes = bytes
        self.parameter = parameter

    def items(self) -> list[tuple[str, Any]]:
        """The set fields as (name, value), in the order they print."""
        values = self._values
        lead = [(k, values[k]) for k in self.LEADING if k in values]
        return lead + [(k, v) for k, v in values.items() if k not in self.LEADING]

    def copy(self) -> ParallelInfo:
        """A copy with the same fields, set in the same order."""
        out = ParallelInfo()
        out._values = dict(self._values)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParallelInfo):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return "ParallelInfo(" + ", ".join(f"{k}={v!r}" for k, v in self.items()) + ")"


__all__ = ["FIELD_READERS", "LayoutDetail", "ParallelInfo", "RunnerUp", "SearchCost", "Strategy",
           "SwcCost"]


# -- reading the fields back from a dump -----------------------------------------------------------
# Each field of `ParallelInfo` read back from the value `ir.printer.PARALLEL_FIELDS` wrote:
# a function from the parsed value to the field's typed value, raising ValueError("<what it
# expected>") for anything else.


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any) -> int:
    if not _is_int(value):
        raise ValueError("an integer")
    return int(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a string")
    return value


def _strategy(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, tuple):
        raise ValueError("a strategy (a tuple)")
    return value


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError("a tuple of strings")
    return value


def _cost(value: Any) -> float:
    """A cost number; None is an infinite cost (`ir.printer._cost_number`)."""
    if value is None:
        return math.inf
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError("a number or None")
    return value  # type: ignore[no-any-return]  # an int stays an int: it prints as one


def _fields_of(value: Any, what: str, *orders: tuple[str, ...]) -> dict[str, Any]:
    """A dict whose keys are exactly one of `orders`."""
    if not isinstance(value, dict) or tuple(value) not in orders:
        shown = " or ".join("{" + ", ".join(order) + "}" for order in orders)
        raise ValueError(f"{what} {shown}")
    return value


def _layouts(value: Any) -> tuple[LayoutDetail, ...]:
    if not isinstance(value, tuple):
        raise ValueError("a tuple of layouts")
    out = []
    for item in value:
        d = _fields_of(item, "a layout", ("device_matrix", "tensor_map"),
                       ("device_matrix", "tensor_map", "interleaved_parallel"),
                       ("device_matrix", "tensor_map", "alias_name"),
                       ("device_matrix", "tensor_map", "interleaved_parallel", "alias_name"))
        matrix, tmap = d["device_matrix"], d["tensor_map"]
        if not isinstance(matrix, tuple) or not all(_is_int(v) for v in matrix):
            raise ValueError("a layout whose device_matrix is a tuple of integers")
        if not isinstance(tmap, tuple):
            raise ValueError("a layout whose tensor_map is a tuple")
        interleaved = d.get("interleaved_parallel")
        if interleaved is not None and not isinstance(interleaved, bool):
            raise ValueError("a layout whose interleaved_parallel is true or false")
        alias = d.get("alias_name")
        out.append(LayoutDetail(matrix, tmap, interleaved,
                                None if alias is None else _strings(alias)))
    return tuple(out)


def _search_cost(value: Any) -> SearchCost:
    d = _fields_of(value, "a cost", ("op", "redistribution"), ("local", "op", "redistribution"))
    local = _cost(d["local"]) if "local" in d else None
    return SearchCost(_cost(d["op"]), _cost(d["redistribution"]), local)


_SWC = ("communication", "computation", "forward")


def _swc(value: Any) -> SwcCost:
    d = _fields_of(value, "a decision", _SWC)
    return SwcCost(*(_cost(d[k]) for k in _SWC))


def _runner_up(value: Any) -> RunnerUp:
    d = _fields_of(value, "a runner-up", ("strategy",), ("strategy", "local"),
                   ("strategy", *_SWC), ("strategy", "local", *_SWC))
    swc = SwcCost(*(_cost(d[k]) for k in _SWC)) if "forward" in d else None
    local = _cost(d["local"]) if "local" in d else None
    return RunnerUp(_strategy(d["strategy"]), local, swc)


#: How each `ParallelInfo` field is read (the inverse of `ir.printer.PARALLEL_FIELDS`;
#: `ir.parser.PARALLEL_FIELDS`).
FIELD_READERS: dict[str, Callable[[Any], Any]] = {
    "in_strategy": _strategy,
    "out_strategy": _strategy,
    "in_layout": _layouts,
    "out_layout": _layouts,
    "cost": _search_cost,
    "decision": _swc,
    "runner_up": _runner_up,
    "decided_by": _str,
    "micro": _int,
    "chunk": _int,
    "reason": _str,
    "fusion": _int,
    "members": _strings,
    "bytes": _int,
    "parameter": _str,
}
