"""The op registry: one `OpDef` per primitive.

Each primitive is declared once, in one block of `ir/ops/*.py`: its attributes with defaults,
shape/dtype inference, vjp rule (written with IR ops through a `Builder`), numpy implementation
and JAX implementation, sharding rule (`OpDef.sharding`, None: the op cannot be sharded),
traits and dimension relations, registered right below (`register(OpDef(...))`, or the short
constructors of `ir/ops/_define.py`).

Contracts of the callables (`attrs` is the node's full attribute dict, defaults filled in):

* `infer(types: list[ValueType], attrs) -> ValueType` raises `ShapeError(message)` on bad
  operands.
* `numpy(*arrays, **attrs)` / `jax(*arrays, **attrs)` return an array, or a tuple of arrays
  when the result type is a `TupleType`.
* `vjp(b: Builder, node: Node, cotangent) -> list[Value | None]` returns one cotangent per
  operand (None: no gradient). `cotangent` is a Value, or for tuple-typed results a list with
  one Value per element (zeros already filled in for unused elements).
* Collectives (`collective=True`) have no `numpy`/`jax` callables: backends execute them with
  their own communication runtime, using the node's `group`/`rank_list` attributes.
* `lowering_attrs(node, attrs) -> attrs`, optional: attributes equivalent to `attrs` (the
  node's implementation attributes) given what is known of its operands at compile time,
  for a faster `jax` path (a constant causal mask read as a causal sparse mode). The JAX
  lowering calls it; the numpy interpreter, the oracle, never does, so the check compares
  the specialised program with the definition.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from pcompile.ir.errors import ShapeError
from pcompile.ir.memo import items_key
from pcompile.ir.rank import resolve_attrs
from pcompile.ir.types import DType, ValueType

if TYPE_CHECKING:
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Node, Value
    from pcompile.ir.dims import DimRule
    from pcompile.ir.sharding import LabelRule

InferFn = Callable[[list[ValueType], dict[str, Any]], ValueType]

FLOATS = frozenset({DType.float16, DType.bfloat16, DType.float32})
INTS = frozenset({DType.uint8, DType.int32, DType.int64})
NUMERIC = FLOATS | INTS
ALL = NUMERIC | {DType.bool_}
BOOL = frozenset({DType.bool_})

# The sections of docs/ops.md an op's table row goes to (tools/ops_doc.py gives their
# titles and prose, in this order).
SECTIONS = ("elementwise", "linalg", "attention", "shape", "conv", "compiler")


@dataclass(frozen=True)
class OpDoc:
    """What docs/ops.md says of one primitive. `python -m pcompile.tools.ops_doc` writes the
    page from these records; `test_ops_page_lists_every_functional_name`
    (tests/compiler/test_functional_ops.py) fails when the page is stale,
    tests/ir/test_ops_dtypes.py when `dtypes` is not exactly what the op accepts on both
    backends or a named test is missing.

    How a model file spells the op (`ops.Div()` for RealDiv, `ops.TensorAdd()` for Add) is
    read from `compiler/frontend/ops.py`, not restated here; `spelling` is for ops no `ops.X` class
    emits (tuple plumbing, compiler-inserted ops). Whether the op has a sharding rule is
    checked against `OpDef.sharding`: a `rule` not starting with "no strategy" claims one."""

    section: str  # one of SECTIONS
    operands: str  # "x, y (broadcast) -> Bool"; attributes after a ";"
    dtypes: frozenset[DType]  # accepted element types (tests/ir/test_ops_dtypes.py runs each)
    rule: str = ""  # the sharding rule in one line; "" with `grad_of`: no rule (per rank)
    tests: tuple[str, ...] = ()  # "test_ops_nn.py::test_softmax" (tests/ implied)
    grad_of: str = ""  # a gradient helper: the op whose vjp emits it
    spelling: str = ""  # the user's spelling when no `ops.X` class emits the op
    note: str = ""  # facts that do not fit a table cell, printed after the section's table

    def __post_init__(self) -> None:
        if self.section not in SECTIONS:
            raise ValueError(f"OpDoc section {self.section!r} is not one of {SECTIONS}")
        if not self.rule and not self.grad_of:
            raise ValueError("OpDoc needs a sharding rule, or grad_of for a gradient helper")

class Trait(Enum):
    """A fact about an op that passes ask of it (`has_trait`) instead of keeping lists of op
    names."""

    # A matrix product (MatMul, BatchMatMul): its labels read [batch..., i, k, j] whatever
    # the transposes; a split k leaves partial sums the size of the output.
    MATMUL = "matmul"
    # Combines the elements of its operand along a dim (ReduceSum, ...): on a split operand
    # each rank sees a slice.
    REDUCTION = "reduction"
    # Recursive programming splits only its batch dim (lookups, one-hot, the losses).
    BATCH_ONLY = "batch_only"
    # A table lookup: operand 1 indexes operand 0, and its batch dim is the indices' first.
    LOOKUP = "lookup"
    # One operand whose values it passes on unchanged but for the dtype (Cast, Identity): a
    # weight read through it is laid out for the op that really uses it.
    VALUE_COPY = "value_copy"
    # Without a user strategy it is not planned: its output keeps its input's layout, with no
    # redistribution around it (MindSpore gives such a Cast no operator info).
    TRANSPARENT = "transparent"
    # No strategy: its result is its first operand, in that operand's layout; the others are
    # kept as they are (Depend).
    FIRST_OPERAND = "first_operand"
    # A transfer between two ranks (pipeline stages), paired with its peer by `sr_tag`.
    POINT_TO_POINT = "point_to_point"
    # No strategy of its own: Reshape is planned as a redistribution between the layouts
    # around it; tuple plumbing passes layouts through.
    NO_STRATEGY = "no_strategy"


@dataclass(frozen=True)
class CommFacts:
    """What a communication op moves on ONE rank, in the two conventions of
    `passes/comm_info.py` (its module docstring has the tables), and whether the comm_fusion
    pass buckets it. Declared in the op's block (`ir/ops/comm.py`, `ir/ops/pipeline.py`);
    passes read it instead of keeping lists of collective names."""

    #: bytes one rank receives: f(operand bytes, result bytes, group size n >= 1)
    received: Callable[[int, int, int], int]
    #: bytes one rank sends with ring algorithms: f(operand bytes S, group size n >= 2)
    ring_sent: Callable[[int, int], int]
    #: the op's key in MindSpore's `comm_fusion` config ("allreduce"); "" when never fused
    fusion_key: str = ""


VjpFn = Callable[["Builder", "Node", Any], list["Value | None"]]
LoweringAttrsFn = Callable[["Node", dict[str, Any]], dict[str, Any]]


@dataclass
class OpDef:
    """Everything the compiler knows about one primitive."""

    name: str
    infer: InferFn
    numpy: Callable[..., Any] | None = None
    jax: Callable[..., Any] | None = None
    vjp: VjpFn | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    num_inputs: int | tuple[int, int] | None = None  # exact, (min, max), or None = any
    differentiable: bool = True  # False: no gradient flows through (comparisons, int ops)
    collective: bool = False
    sharding: LabelRule | None = None  # its sharding rule (ir/sharding.py); None: not shardable
    traits: frozenset[Trait] = frozenset()  # what passes ask of it (`Trait`)
    dims: DimRule | None = None  # how its dims relate (ir/dims.py, the shrunk check)
    lowering_attrs: LoweringAttrsFn | None = None  # compile-time specialisation (JAX)
    comm: CommFacts | None = None  # what a communication op moves (`CommFacts`)
    doc: str = ""
    page: OpDoc | None = None  # its row on docs/ops.md
    module: str = ""  # the module that registered it (filled in by `register`)
    _memo: dict[Any, ValueType] = field(default_factory=dict, repr=False, compare=False)

    def check_arity(self, count: int) -> None:
        n = self.num_inputs
        if n is None:
            return
        if isinstance(n, int):
            if count != n:
                raise ShapeError(f"expects {n} input(s), got {count}")
        elif not n[0] <= count <= n[1]:
            raise ShapeError(f"expects {n[0]} to {n[1]} inputs, got {count}")

    def full_attrs(self, given: dict[str, Any], allow_extra: bool = False) -> dict[str, Any]:
        """Declared attributes with defaults filled in, in declaration order, followed by
        generic parallel attributes (`in_strategy`, ...) and, when `allow_extra`, the user's
        own `add_prim_attr` keys."""
        unknown = sorted(set(given) - set(self.attrs) - set(GENERIC_ATTRS))
        if unknown and not allow_extra:
            raise TypeError(
                f"{self.name} has no attribute(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(self.attrs)) or 'none'}"
            )
        out = dict(self.attrs)
        out.update(given)
        return out

    def impl_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The attributes an implementation receives: the declared ones only."""
        return {k: v for k, v in attrs.items() if k in self.attrs}

    def jax_attrs(self, node: Node) -> dict[str, Any]:
        """The attributes the `jax` implementation receives for `node`: `impl_attrs`, then
        `lowering_attrs` where the op has one."""
        attrs = self.impl_attrs(node.attrs)
        return attrs if self.lowering_attrs is None else self.lowering_attrs(node, attrs)

    def infer_type(self, types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
        """`infer`, memoised: inference is a pure function of the operand types and the
        attributes, and a model's layers repeat the same (op, types, attrs) many times.
        Rank-dependent attributes (`ir.rank`) give the same type on every rank: they are
        inferred at rank 0."""
        try:
            key = (tuple(types), items_key(attrs))
        except TypeError:  # an unhashable attribute value: infer without the memo
            return self.infer(types, resolve_attrs(attrs, 0))
        cached = self._memo.get(key)
        if cached is None:
            cached = self.infer(types, resolve_attrs(attrs, 0))
            if len(self._memo) < _MEMO_LIMIT:
                self._memo[key] = cached
        return cached


_MEMO_LIMIT = 100_000  # inferred types remembered per op


# Attributes every primitive may carry (set by `shard()` / `add_prim_attr`, read by passes).
GENERIC_ATTRS = (
    "in_strategy",
    "out_strategy",
    "cross_batch",
    "skip_redistribution",
    "repeated_num_in_dev_matrix_right_",
    "self_define_shard",
    "recompute",  # Primitive.recompute() / Cell.recompute(): rematerialised for the backward
    "duplicated",  # a recomputed copy made by passes.recompute (MindSpore's mark)
)

_REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in _REGISTRY:
        raise ValueError(f"op {opdef.name} registered twice")
    if not opdef.module:  # the declaring module (orders docs/ops.md's rows)
        opdef.module = sys._getframe(1).f_globals.get("__name__", "")
    _REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}") from None


def find_op(name: str) -> OpDef | None:
    """The op called `name`, or None where the registry has none."""
    _ensure_loaded()
    return _REGISTRY.get(name)


def has_trait(name: str, trait: Trait) -> bool:
    """Whether the op called `name` has `trait` (False for a name the registry does not know)."""
    opdef = find_op(name)
    return opdef is not None and trait in opdef.traits


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_REGISTRY)


def group_collectives() -> tuple[str, ...]:
    """The collectives that run over a group of ranks (`collective=True`, not the point to
    point Send / Receive), in registry order: each backend keeps one row for each."""
    return tuple(name for name, d in all_ops().items()
                 if d.collective and Trait.POINT_TO_POINT not in d.traits)


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import pcompile.ir.ops  # noqa: F401  (registers every primitive)
