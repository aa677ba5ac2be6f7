"""Where the parallel program sums partial cotangents (`passes/step_parallel.py` applies it).

The parallel passes' convention (docs/parallel.md, "Gradients"): a value held by several ranks
carries a *share* of its cotangent on each of them; the true cotangent is the sum of the shares.
A collective's vjp sums them where the program needs the whole: a forward AllReduce's vjp is an
AllReduce, a replicated parameter's `_MirrorOperator` all-reduces its gradient. Two choices
move fewer bytes than those defaults, each decided here from the global graph and its layouts:

* `plan_cotangent_reductions`: a replicated parameter whose only user's output is replicated too
  (an embedding's Gather) can have the shares summed on that output (over the axes both are
  replicated on) and its gradient over the remaining axes only, when that is fewer ring bytes;
* `replicated_cotangents`: a forward AllReduce whose result flows to the loss only through
  values that every rank of its group holds alike receives the same cotangent share on every
  rank of the group, so the AllReduce of its vjp is that share times the group size: a local
  multiplication (the `replicated_cotangent` attribute; `ir/ops/comm.py`), no collective. XLA's
  partitioner does the same when a replicated loss follows a row-parallel matmul.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from math import prod

from pcompile.ir.core import Constant, Graph, Node, Value
from pcompile.ir.layout import TensorLayout
from pcompile.ir.rank import Digit, RankGroup
from pcompile.ir.registry import Trait, get_op, has_trait
from pcompile.ir.types import TensorType, TupleType
from pcompile.passes.layouts import ParallelAssignment

#: the attribute of a forward AllReduce whose vjp is a local multiplication (see above)
REPLICATED_COTANGENT = "replicated_cotangent"


def ring_all_reduce_bytes(group: int, nbytes: int) -> float:
    """Bytes one rank sends in a ring AllReduce of `nbytes` over `group` ranks."""
    return 2.0 * (group - 1) / group * nbytes if group > 1 else 0.0


@dataclass(frozen=True)
class OutputReduction:
    """Sum an op's output cotangent over device axes `axes` (left indices of `dev_matrix`)
    so that the gradient of `parameter` is reduced over fewer ranks."""

    parameter: str
    dev_matrix: tuple[int, ...]
    axes: tuple[int, ...]
    param_group: int
    full_group: int
    chosen_bytes: float
    default_bytes: float


@dataclass
class CotangentReductions:
    """Where partial cotangents are summed: per parameter, the device axes its gradient is
    all-reduced over (when not all of its repeat axes); per op, an output reduction."""

    param_axes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    outputs: dict[Node, OutputReduction] = field(default_factory=dict)


def _real_users(value: Value) -> list[tuple[Node, int]] | None:
    """The users of `value`, looking through single-operand pass-through ops (`VALUE_COPY`: a
    weight's Cast); None when a pass-through op is used by more than one op."""
    out: list[tuple[Node, int]] = []
    for user, index in value.uses:
        if has_trait(user.op, Trait.VALUE_COPY) and len(user.operands) == 1:
            inner = _real_users(user.result)
            if inner is None or len(inner) != 1:
                return None
            out.extend(inner)
        else:
            out.append((user, index))
    return out


def _cheapest_cast(node: Node, assignment: ParallelAssignment, nbytes: int
                   ) -> tuple[Node, int]:
    """Where along `node`'s chain of sole-user Casts (linear, same layout) its output is
    smallest: an embedding's float32 rows are summed after their cast to the compute dtype."""
    best, best_bytes = node, nbytes
    layout = assignment.shardings[node].out_layouts[0]
    while len(node.result.uses) == 1:
        user = node.result.uses[0][0]
        sharding = assignment.sharding(user)
        if (user.op != "Cast" or sharding is None or sharding.forward
                or sharding.out_layouts[0] != layout):
            break
        node = user
        t = node.result.type
        assert isinstance(t, TensorType)
        size = prod(layout.slice_shape) * t.dtype.itemsize
        if size < best_bytes:
            best, best_bytes = node, size
    return best, best_bytes


def plan_cotangent_reductions(graph: Graph, assignment: ParallelAssignment,
                              opt_sharded: Collection[str],
                              forced: Collection[str] | None = None) -> CotangentReductions:
    """Reduce partial cotangents once, where it moves fewest bytes.

    Under the parallel passes' convention a value held by several ranks (replicated over some
    device axes) carries a *share* of its cotangent on each of them, so a parameter that is
    replicated gets a share of its gradient on every rank holding it and its mirror sums over
    all of them (MindSpore's rule). When the parameter's only user U (an op without forward
    communication whose other operands carry no gradient, such as an embedding's Gather) has
    an output replicated over axes B that the parameter is replicated over too, the shares can
    instead be summed on U's output over B; the ranks of a B group then compute the same
    gradient, and the mirror sums only over the remaining axes A. The choice is made per
    parameter by ring bytes: AR(|A||B|, P) against AR(|B|, O) + AR(|A|, P), P the gradient
    slice and O the output slice, taken after the Casts that follow U where it is smallest
    (Megatron-LM's embedding: the activation is summed over the
    tensor-parallel group, the table's gradient over the data-parallel group only). `forced`:
    the parameters to apply it to, whatever the bytes (the shrunk check reproduces the full
    plan's choice at smaller sizes); the conditions on the user still hold."""
    out = CotangentReductions()
    users_of: dict[str, list[tuple[Node, int]] | None] = {}
    for param in graph.params:
        if (param.kind != "weight" or not param.requires_grad
                or param.name in opt_sharded):
            continue
        users_of[param.name] = _real_users(param)
    for param in graph.params:
        users = users_of.get(param.name)
        if not users or len(users) != 1:
            continue
        user, index = users[0]
        sharding = assignment.sharding(user)
        if (sharding is None or sharding.forward or sharding.expand
                or len(sharding.out_layouts) != 1 or get_op(user.op).collective):
            continue
        out_type = user.result.type
        if not isinstance(out_type, TensorType) or not out_type.dtype.is_float:
            continue
        if any(i != index and isinstance(v.type, TensorType) and v.type.dtype.is_float
               and not isinstance(v, Constant) for i, v in enumerate(user.operands)):
            continue
        p_layout = assignment.param_layouts[param.name]
        o_layout = sharding.out_layouts[0]
        if p_layout.dev_matrix != o_layout.dev_matrix:
            continue
        shared = tuple(a for a in o_layout.repeat_axes if a in p_layout.repeat_axes)
        rest = tuple(a for a in p_layout.repeat_axes if a not in shared)
        dev = p_layout.dev_matrix
        b_size = prod(dev[a] for a in shared)
        a_size = prod(dev[a] for a in rest)
        if b_size <= 1:
            continue
        p_bytes = prod(p_layout.slice_shape) * param.dtype.itemsize
        at, o_bytes = _cheapest_cast(user, assignment,
                                     prod(o_layout.slice_shape) * out_type.dtype.itemsize)
        default = ring_all_reduce_bytes(a_size * b_size, p_bytes)
        chosen = ring_all_reduce_bytes(b_size, o_bytes) + ring_all_reduce_bytes(a_size, p_bytes)
        if (chosen >= default) if forced is None else (param.name not in forced):
            continue
        out.param_axes[param.name] = rest
        out.outputs[at] = OutputReduction(param.name, dev, shared, a_size, a_size * b_size,
                                          chosen, default)
    return out


# -- replicated cotangents ------------------------------------------------------------------------


def _within(inner: tuple[Digit, ...], outer: tuple[Digit, ...]) -> bool:
    """Whether every rank's `inner` group lies in its `outer` group (digits of one world)."""
    for stride, count in inner:
        if not any(stride % lo == 0 and (lo * span) % (stride * count) == 0
                   for lo, span in outer):
            return False
    return True


def _holds_alike(layout: TensorLayout | None, group: tuple[Digit, ...]) -> bool:
    """Whether the ranks of `group` hold the same slice under `layout`."""
    if layout is None:
        return False
    repeat = RankGroup.along(layout.dev_matrix, layout.repeat_axes).digits
    return _within(group, repeat)


def _on_loss_path(graph: Graph) -> set[int]:
    """Ids of the values the loss (output 0) depends on, through float values."""
    if not graph.outputs:
        return set()
    found: set[int] = set()
    stack: list[Value] = [graph.outputs[0]]
    while stack:
        value = stack.pop()
        if id(value) in found:
            continue
        found.add(id(value))
        node = getattr(value, "node", None)
        if node is not None:
            stack.extend(v for v in node.operands if not isinstance(v, Constant))
    return found


def _consumed_layouts(node: Node, assignment: ParallelAssignment) -> list[TensorLayout] | None:
    """The layouts `node` reads its operands in and produces its outputs in, or None when
    some are not known (an op the check cannot vouch for)."""
    if node.op == "Reshape":
        out = assignment.reshape_layouts.get(node)
        return None if out is None else [out]
    if has_trait(node.op, Trait.FIRST_OPERAND) or node.op == "TupleGetItem":
        return []
    sharding = assignment.sharding(node)
    if sharding is None or sharding.expand:
        return None
    return [*sharding.in_layouts, *sharding.out_layouts]


def _alike_downstream(start: Node, group: tuple[Digit, ...], assignment: ParallelAssignment,
                      loss_path: set[int]) -> bool:
    """Whether every value from `start`'s result to the loss is held alike by the ranks of
    `group` (their local computations then match, and so do their cotangents)."""
    stack, seen = [start], {start}
    while stack:
        node = stack.pop()
        for user, _ in node.result.uses:
            if id(user.result) not in loss_path or user in seen:
                continue
            if get_op(user.op).collective:
                return False
            layouts = _consumed_layouts(user, assignment)
            if layouts is None or not all(_holds_alike(lay, group) for lay in layouts):
                return False
            seen.add(user)
            stack.append(user)
    return True


def replicated_cotangents(graph: Graph, assignment: ParallelAssignment
                          ) -> set[tuple[Node, int]]:
    """(node, index into its forward communication) of the forward AllReduces whose
    cotangent every rank of the group holds alike (module docstring). The loss must be seeded
    alike on every rank (the standard training form: ones, divided by `_VirtualDiv`), which
    the caller vouches for; ops whose ranks compute different things under a replicated
    layout (`cross_batch`, `skip_redistribution`) turn the analysis off."""
    if not graph.outputs or any(n.attrs.get("cross_batch") or n.attrs.get("skip_redistribution")
                                for n in graph.nodes):
        return set()
    if isinstance(graph.outputs[0].type, TupleType):
        return set()
    loss_path = _on_loss_path(graph)
    out: set[tuple[Node, int]] = set()
    for node in graph.nodes:
        if id(node.result) not in loss_path:
            continue
        sharding = assignment.sharding(node)
        if sharding is None:
            continue
        for index, comm in enumerate(sharding.forward):
            if comm.kind != "AllReduce" or comm.op not in ("sum", "max", "min"):
                continue
            group = RankGroup.along(sharding.dev_matrix, comm.axes).digits
            if not all(_holds_alike(lay, group) for lay in sharding.out_layouts):
                continue
            if _alike_downstream(node, group, assignment, loss_path):
                out.add((node, index))
    return out
