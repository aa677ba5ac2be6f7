"""Tensor redistribution: the op list that turns one layout into another (reference §2).

Pipeline of one redistribution from layout F to layout T (same number of elements; the shapes
may differ, which is how Reshape is handled):

1. **Unify** (`unify`). Both device matrices are refined to a common matrix of *atomic* axes
   (cut points of the rank space, cumulative products, must form a divisibility chain), and the
   flattened tensor is cut into sub-dims so that every sub-dim maps to at most one atomic axis in
   both layouts. A tensor dim mapped to axes (a1..ap) is viewed, as MindSpore's extended layouts
   do, as sub-dims [n_a1, ..., n_a(p-1), rest] with a_p splitting `rest`. When cuts of the two
   layouts do not nest, there is no common refinement and the **unexpand** path is used:
   F -> replicated, Reshape, replicated -> T.
2. **Infer** (`_infer_ops`), the loop of `redistribution_operator_infer.cc`: split dims whose
   target axis is free; permute (gather + split, or AlltoAll when `enable_alltoall`) dims whose
   target axis is held by another dim; gather dims whose axis is not wanted anywhere; break
   cycles by gathering the first pending dim.
3. **Reshape** before (original slice -> expanded slice) and after (expanded -> target slice)
   when the expanded shapes differ from the originals.

`RedistributionPlan.ops_for_rank(rank)` instantiates the abstract list for one rank (slice
offsets, gather groups); `cost()` is MindSpore's redistribution cost (§2.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from pcompile.ir.layout import TensorLayout, axis_index, map_axes
from pcompile.ir.rank import RankGroup, RankOffsets
from pcompile.passes.redistribution_order import SlotMap


class NoUnification(Exception):  # noqa: N818  (a signal, not an error)
    """The two layouts have no common refinement."""


def _chain(cuts: set[int], what: str) -> list[int]:
    ordered = sorted(cuts)
    for a, b in zip(ordered, ordered[1:]):
        if b % a:
            raise NoUnification(
                f"{what} cut points {ordered} do not nest ({a} does not divide {b})"
            )
    return ordered


def _sizes(cuts: list[int]) -> list[int]:
    out, prev = [], 1
    for c in cuts:
        if c != prev:
            out.append(c // prev)
        prev = c
    return out


@dataclass
class Unified:
    """Both layouts on one atomic device matrix and one sub-dim shape. Maps give, per sub-dim,
    the left index of the atomic axis that splits it, or -1."""

    dev: list[int]
    shape: list[int]
    src_map: list[int]
    dst_map: list[int]


def _atomic_axes(layout: TensorLayout, dev_cuts: list[int]) -> list[list[tuple[int, int]]]:
    """For each tensor dim, the atomic axes (index, size) its map entry covers, most
    significant first."""
    atomic = _sizes(dev_cuts)
    bounds = [1]
    for size in atomic:
        bounds.append(bounds[-1] * size)
    out = []
    dev = layout.dev_matrix
    for entry in layout.tensor_map:
        axes: list[tuple[int, int]] = []
        for value in map_axes(entry):
            left = axis_index(value, dev)
            lo, hi = prod(dev[:left]), prod(dev[: left + 1])
            first = bounds.index(lo)
            last = bounds.index(hi)
            axes.extend((a, atomic[a]) for a in range(first, last))
        out.append(axes)
    return out


def unify(src: TensorLayout, dst: TensorLayout) -> Unified:
    if prod(src.shape) != prod(dst.shape):
        raise ValueError(f"cannot redistribute {src.shape} to {dst.shape}: sizes differ")
    if src.device_num != dst.device_num:
        raise ValueError("layouts use different device counts")
    dev_cuts = {prod(src.dev_matrix[: i + 1]) for i in range(len(src.dev_matrix))}
    dev_cuts |= {prod(dst.dev_matrix[: i + 1]) for i in range(len(dst.dev_matrix))}
    dev_cuts.add(1)
    tensor_cuts: set[int] = {1}
    for layout in (src, dst):
        for d in range(len(layout.shape) + 1):
            tensor_cuts.add(prod(layout.shape[:d]))
    for _ in range(64):  # each round adds cuts; a handful of rounds reach the fixpoint
        dev_list = _chain(dev_cuts, "device")
        cut_list = _chain(tensor_cuts, "tensor")
        new_dev: set[int] = set()
        new_tensor: set[int] = set()
        maps: list[list[int]] = []
        sub = _sizes(cut_list)
        sub_starts = [1]
        for s in sub:
            sub_starts.append(sub_starts[-1] * s)
        dev_starts = [1]
        for s in _sizes(dev_list):
            dev_starts.append(dev_starts[-1] * s)
        for layout in (src, dst):
            mapping = [-1] * len(sub)
            for d, axes in enumerate(_atomic_axes(layout, dev_list)):
                cursor = prod(layout.shape[:d])
                for k, (axis, size) in enumerate(axes):
                    last = k == len(axes) - 1
                    i = sub_starts.index(cursor)
                    if not last:
                        target = cursor * size
                        if target not in cut_list:
                            new_tensor.add(target)
                            break  # the rest of this dim is placed in the next round
                        j = sub_starts.index(target)
                        if j - i > 1:  # several sub-dims: the axis must be cut to match them
                            acc = dev_starts[axis]
                            for s in sub[i : j - 1]:
                                acc *= s
                                new_dev.add(acc)
                            break
                        mapping[i] = axis
                        cursor = target
                    else:
                        first = sub[i]
                        if first % size == 0:
                            mapping[i] = axis
                        elif size % first == 0:
                            new_dev.add(dev_starts[axis] * first)
                        else:
                            new_tensor.add(cursor * size)
            maps.append(mapping)
        if not (new_dev - dev_cuts) and not (new_tensor - tensor_cuts):
            return Unified(_sizes(dev_list), sub, maps[0], maps[1])
        dev_cuts |= new_dev
        tensor_cuts |= new_tensor
    raise NoUnification("no fixpoint")  # pragma: no cover


@dataclass(frozen=True)
class AbstractOp:
    """One step of a redistribution, independent of the rank.

    kind: "Split" (take my part of `dim` along device `axis`), "Concat" (gather `dim` along
    `axis`), "Permute" (AlltoAll: split `dim` and concat `concat_dim` along `axis`), or
    "Reshape" (to the local `shape`). `count` is the size of the axis; `in_shape` the local
    shape before the op."""

    kind: str
    in_shape: tuple[int, ...]
    dim: int = -1
    axis: int = -1
    count: int = 1
    concat_dim: int = -1
    shape: tuple[int, ...] = ()
    stride: int = 1  # rank-space stride of the device axis: its group is {base + k*stride}

    def coord(self, rank: int) -> int:
        return (rank // self.stride) % self.count

    def group(self, rank: int) -> tuple[int, ...]:
        base = rank - self.coord(rank) * self.stride
        return tuple(base + k * self.stride for k in range(self.count))


@dataclass
class RedistributionPlan:
    """The abstract op list from `src` to `dst` on the atomic device matrix `dev`."""

    src: TensorLayout
    dst: TensorLayout
    dev: tuple[int, ...]
    ops: list[AbstractOp] = field(default_factory=list)
    unexpand: bool = False

    @property
    def is_identity(self) -> bool:
        return not self.ops

    @property
    def communicates(self) -> bool:
        return any(op.kind in ("Concat", "Permute") for op in self.ops)

    def split_after_communication(self) -> tuple[RedistributionPlan, RedistributionPlan]:
        """(the steps up to the last collective, the local steps after it): two redistributions
        of one value whose first parts are equal move the same bytes and may share them."""
        last = max((i for i, op in enumerate(self.ops) if op.kind in ("Concat", "Permute")),
                   default=-1)
        return (RedistributionPlan(self.src, self.dst, self.dev, self.ops[:last + 1],
                                   self.unexpand),
                RedistributionPlan(self.src, self.dst, self.dev, self.ops[last + 1:],
                                   self.unexpand))

    def ops_for_rank(self, rank: int) -> list[tuple[object, ...]]:
        """Concrete steps for `rank`: ("StridedSlice", begin, end, strides),
        ("AllConcat", ranks, axis), ("AlltoAll", ranks, split_dim, concat_dim, count),
        ("Reshape", shape)."""
        out: list[tuple[object, ...]] = []
        for op in self.ops:
            if op.kind == "Reshape":
                out.append(("Reshape", op.shape))
            elif op.kind == "Split":
                length = op.in_shape[op.dim] // op.count
                begin = [0] * len(op.in_shape)
                end = list(op.in_shape)
                begin[op.dim] = op.coord(rank) * length
                end[op.dim] = begin[op.dim] + length
                out.append(("StridedSlice", tuple(begin), tuple(end), (1,) * len(op.in_shape)))
            elif op.kind == "Concat":
                out.append(("AllConcat", op.group(rank), op.dim))
            else:
                out.append(("AlltoAll", op.group(rank), op.dim, op.concat_dim, op.count))
        return out

    def symbolic_ops(self) -> list[tuple[object, ...]]:
        """The steps for every rank at once (`ir.rank` values): ("StridedSlice", begin, end,
        strides) with `RankOffsets` begin/end, ("AllConcat", group, axis) and ("AlltoAll",
        group, split_dim, concat_dim, count) with a `RankGroup`, ("Reshape", shape);
        `ops_for_rank(r)` is this evaluated at rank r."""
        world = prod(self.dev)
        out: list[tuple[object, ...]] = []
        for op in self.ops:
            if op.kind == "Reshape":
                out.append(("Reshape", op.shape))
            elif op.kind == "Split":
                length = op.in_shape[op.dim] // op.count
                rank_len = len(op.in_shape)
                terms = tuple(((op.stride, op.count, length),) if d == op.dim else ()
                              for d in range(rank_len))
                end = tuple(length if d == op.dim else n for d, n in enumerate(op.in_shape))
                out.append(("StridedSlice", RankOffsets((0,) * rank_len, terms),
                            RankOffsets(end, terms), (1,) * rank_len))
            elif op.kind == "Concat":
                out.append(("AllConcat", RankGroup(world, ((op.stride, op.count),)), op.dim))
            else:
                out.append(("AlltoAll", RankGroup(world, ((op.stride, op.count),)), op.dim,
                            op.concat_dim, op.count))
        return out

    def comm_bytes(self, itemsize: int) -> int:
        """Bytes each rank receives: (n-1)/n of a gathered result, (n-1)/n of an exchange."""
        total = 0
        for op in self.ops:
            size = prod(op.in_shape)
            if op.kind == "Concat":
                total += size * (op.count - 1)
            elif op.kind == "Permute":
                total += size * (op.count - 1) // op.count
        return total * itemsize

    def cost(self, itemsize: int = 4) -> RedistributionCost:
        return redistribution_cost(self, itemsize)


@dataclass(frozen=True)
class RedistributionCost:
    """MindSpore's `TensorRedistribution::ComputeCost` terms (bytes)."""

    forward_comm: float
    backward_comm: float
    comm: float
    computation: float
    memory: float


ALLGATHER_REDUCESCATTER_SCALE = 0.5
ALLTOALL_SCALE = 2.0
COST_FACTOR = 2.0


def redistribution_cost(plan: RedistributionPlan, itemsize: int) -> RedistributionCost:
    fwd = bwd = comm = comp = mem = 0.0
    for op in plan.ops:
        size = float(prod(op.in_shape))
        if op.kind == "Split":
            comp += size
            mem += size
        elif op.kind == "Concat":
            n = op.count
            fwd += size * n * ALLGATHER_REDUCESCATTER_SCALE
            bwd += size * ALLGATHER_REDUCESCATTER_SCALE
            comm += size * (n + 1) * ALLGATHER_REDUCESCATTER_SCALE
            if op.dim == 0:
                comp += size
                mem += size * n
            else:
                comp += size + 2 * size * n
                mem += 2 * size * n + size
        elif op.kind == "Permute":
            n = op.count
            fwd += ALLTOALL_SCALE * size
            bwd += ALLTOALL_SCALE * size
            comm += COST_FACTOR * ALLTOALL_SCALE * size
            comp += size + 2 * size * n
            mem += 2 * size * n + size
        elif op.kind == "Reshape":
            comp += 2 * size
            mem += 2 * size
    k = float(itemsize)
    return RedistributionCost(fwd * k, bwd * k, comm * k, comp * k, mem * k)


def _local(shape: list[int], mapping: list[int], dev: list[int]) -> tuple[int, ...]:
    return tuple(s // (dev[a] if a >= 0 else 1) for s, a in zip(shape, mapping))


def _infer_ops(
    dev: list[int], shape: list[int], src: list[int], dst: list[int], enable_alltoall: bool
) -> list[AbstractOp]:
    """MindSpore's `InferRedistributionOperator` on the unified layouts (maps give the left
    index of each sub-dim's atomic axis, or -1). The pending dims live in a `SlotMap`, walked
    and mutated as MindSpore walks its hash map, so independent ops come in MindSpore's order."""
    cur = list(src)
    pending = SlotMap()
    for d, axis in enumerate(src):
        pending.set(d, axis)
    ops: list[AbstractOp] = []

    def emit(kind: str, *, dim: int, axis: int, count: int, concat_dim: int = -1) -> None:
        stride = prod(dev[axis + 1 :])
        ops.append(AbstractOp(kind, _local(shape, cur, dev), dim=dim, axis=axis, count=count,
                              concat_dim=concat_dim, stride=stride))

    def split_phase() -> None:  # InferSplitByAxis
        pos = pending.begin()
        while pos != pending.end():
            d, axis = pending.item(pos)
            if axis == dst[d]:
                pos = pending.erase(pos)
            elif axis == -1 and not pending.holds(dst[d]):
                emit("Split", dim=d, axis=dst[d], count=dev[dst[d]])
                cur[d] = dst[d]
                pos = pending.erase(pos)
            else:
                pos = pending.next(pos)

    def permute_phase() -> None:  # InferPermuteByAxis
        pos = pending.begin()
        while pos != pending.end():
            d, axis = pending.item(pos)
            if axis == dst[d]:
                pos = pending.erase(pos)
            elif axis == -1 and pending.holds(dst[d]):
                c = cur.index(dst[d])  # the dim holding the wanted axis
                target, n = dst[d], dev[dst[d]]
                if enable_alltoall:
                    emit("Permute", dim=d, axis=target, count=n, concat_dim=c)
                else:
                    emit("Concat", dim=c, axis=target, count=n)
                    cur[c] = -1
                    emit("Split", dim=d, axis=target, count=n)
                cur[c], cur[d] = -1, target
                pos = pending.erase(pos)
                pending.set(c, -1)
            else:
                pos = pending.next(pos)

    def concat_phase() -> None:  # InferConcatByAxis
        pos = pending.begin()
        while pos != pending.end():
            d, axis = pending.item(pos)
            if axis != -1 and axis not in dst:
                emit("Concat", dim=d, axis=axis, count=dev[axis])
                cur[d] = -1
                if dst[d] == -1:
                    pos = pending.erase(pos)
                    continue
                pending.assign(pos, -1)
            pos = pending.next(pos)

    while len(pending):
        before = len(ops)
        while len(pending):
            before_split = len(ops)
            split_phase()
            while len(pending):
                before_permute = len(ops)
                permute_phase()
                if len(ops) == before_permute:
                    break
            if len(ops) == before_split:
                break
        concat_phase()
        if len(ops) == before and len(pending):  # break a cycle: gather the first entry
            pos = pending.begin()
            d, axis = pending.item(pos)
            pending.assign(pos, -1)
            emit("Concat", dim=d, axis=axis, count=dev[axis])
            cur[d] = -1
    return ops


def plan_redistribution(
    src: TensorLayout, dst: TensorLayout, enable_alltoall: bool = False
) -> RedistributionPlan:
    """Plan the ops turning `src` into `dst` (same element count; shapes may differ)."""
    return _plan_cached(src.normalized(), dst.normalized(), enable_alltoall)


@lru_cache(maxsize=65536)
def _plan_cached(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool) -> RedistributionPlan:
    if src.shape == dst.shape and src == dst:
        return RedistributionPlan(src, dst, src.dev_matrix)
    try:
        u = unify(src, dst)
    except NoUnification:
        return _unexpand(src, dst, enable_alltoall)
    ops: list[AbstractOp] = []
    src_local = src.slice_shape
    exp_src_local = _local(u.shape, u.src_map, u.dev)
    if exp_src_local != src_local:
        ops.append(AbstractOp("Reshape", src_local, shape=exp_src_local))
    ops += _infer_ops(u.dev, u.shape, u.src_map, u.dst_map, enable_alltoall)
    exp_dst_local = _local(u.shape, u.dst_map, u.dev)
    if exp_dst_local != dst.slice_shape:
        ops.append(AbstractOp("Reshape", exp_dst_local, shape=dst.slice_shape))
    return RedistributionPlan(src, dst, tuple(u.dev), _drop_noop_reshapes(ops))


def _drop_noop_reshapes(ops: list[AbstractOp]) -> list[AbstractOp]:
    """Consecutive Reshapes are one; a Reshape to the shape it already has is dropped (e.g. the
    pair around an empty list between two replicated layouts on different device matrices,
    which MindSpore emits as Reshape [1] then Reshape [1, 1]: it does nothing and costs
    2 x its size in computation)."""
    out: list[AbstractOp] = []
    for op in ops:
        if op.kind == "Reshape" and out and out[-1].kind == "Reshape":
            op = AbstractOp("Reshape", out.pop().in_shape, shape=op.shape)
        out.append(op)
    return [op for op in out if not (op.kind == "Reshape" and op.shape == op.in_shape)]


def _unexpand(src: TensorLayout, dst: TensorLayout, enable_alltoall: bool) -> RedistributionPlan:
    """No common refinement: gather to replicated, reshape the full tensor, slice to `dst`."""
    rep_src = TensorLayout(src.dev_matrix, tuple(-1 for _ in src.shape), src.shape)
    rep_dst = TensorLayout(dst.dev_matrix, tuple(-1 for _ in dst.shape), dst.shape)
    # Each half stays on its own device matrix (a layout always unifies with the replicated
    # layout of the same matrix), so this cannot recurse.
    ops: list[AbstractOp] = []
    if any(e != -1 for e in src.tensor_map):
        ops += _plan_cached(src, rep_src, enable_alltoall).ops
    if src.shape != dst.shape:
        ops.append(AbstractOp("Reshape", tuple(src.shape), shape=tuple(dst.shape)))
    if any(e != -1 for e in dst.tensor_map):
        ops += _plan_cached(rep_dst, dst, enable_alltoall).ops
    return RedistributionPlan(src, dst, src.dev_matrix, ops, unexpand=True)

