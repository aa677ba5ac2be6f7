"""Layouts through a Reshape (reference §2.3), for the searches, Reshape chains and
step_parallel_begin's layout flow.

A Reshape from shape A to shape B keeps the row-major order of the elements, so a layout of A
has an equal layout on B exactly when every rank's slice stays a contiguous block of each group
of dims that the reshape merges or splits. `blocks(A, B)` cuts both shapes into the smallest
groups with equal products; within a group:

* nothing split: nothing split on B either;
* one dim of A split over device axes (a1, ..., ap) becoming several dims of B: the axes are
  handed, most significant first, to the B dims in order (a B dim takes axes while their
  product divides it; it must be fully split before the next dim takes any);
* several dims of A becoming one dim of B: the split dims of A must be a prefix whose dims
  before the last split one are fully split (slices of length 1), so the B dim is split over the
  concatenated axes;
* anything else has no equal layout (`map_layout` returns None).

When a device axis must be shared by two dims of B (a [256] split over an axis of 4 becoming
[2, 128]: 2 ways on the first dim, 2 on the second), the device matrix is refined first
(`refine`): the axis of 4 becomes two axes of 2, the same slices on every rank, so the output
keeps the split and the Reshape moves nothing.

`dim_map(A, B)` is the coarser correspondence recursive programming needs: the leading dim of
each group of A to the leading dim of the group in B.
"""

from __future__ import annotations

from math import prod

from pcompile.ir.layout import MapEntry, TensorLayout, map_axes
from pcompile.passes.redistribution import plan_redistribution


def blocks(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[range, range]]:
    """Groups of dims of `a` and `b` with equal products (size-1 dims join a neighbour)."""
    out: list[tuple[range, range]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        i0, j0 = i, j
        pa = pb = 1
        if i < len(a):
            pa *= a[i]
            i += 1
        if j < len(b):
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa *= a[i]
                i += 1
            elif j < len(b):
                pb *= b[j]
                j += 1
            else:
                pa *= a[i]
                i += 1
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            j += 1
        out.append((range(i0, i), range(j0, j)))
    return out


def _entry(axes: list[int]) -> MapEntry:
    if not axes:
        return -1
    return axes[0] if len(axes) == 1 else tuple(axes)


def refine(layout: TensorLayout, shape: tuple[int, ...]) -> TensorLayout:
    """`layout` on a finer device matrix, the same slices on every rank: each device axis that
    one dim of `layout` must hand to several dims of `shape` is cut where their sizes need it
    (module docstring). `layout` itself where no axis needs cutting or a cut cannot help."""
    dev = layout.dev_matrix
    n = len(dev)
    cuts: dict[int, set[int]] = {}  # device position -> sizes of its leading (major) parts
    for ra, rb in blocks(layout.shape, shape):
        if len(ra) != 1:
            continue
        axes = map_axes(layout.tensor_map[ra[0]])
        rest = prod(dev[n - 1 - v] for v in axes)
        need, done = [], 1  # the split counts at which a dim of `shape` is full
        for d in rb:
            if rest == 1 or shape[d] % rest == 0:
                break
            if rest % shape[d]:
                return layout
            done *= shape[d]
            rest //= shape[d]
            need.append(done)
        at = 1
        for v in axes:
            pos, size = n - 1 - v, dev[n - 1 - v]
            for g in need:
                if at < g < at * size and g % at == 0 and size % (g // at) == 0:
                    cuts.setdefault(pos, set()).add(g // at)
            at *= size
    if not cuts:
        return layout
    parts: list[list[int]] = []
    for pos, size in enumerate(dev):
        marks = sorted(cuts.get(pos, ()))
        if any(b % a for a, b in zip(marks, [*marks[1:], size])):
            return layout
        bounds = [1, *marks, size]
        parts.append([b // a for a, b in zip(bounds, bounds[1:])])
    new_dev = tuple(s for p in parts for s in p)
    first, positions = 0, []
    for p in parts:
        positions.append(list(range(first, first + len(p))))
        first += len(p)

    def values(v: int) -> list[int]:
        return [len(new_dev) - 1 - q for q in positions[n - 1 - v]]

    tmap = tuple(_entry([w for v in map_axes(e) for w in values(v)]) for e in layout.tensor_map)
    return TensorLayout(new_dev, tmap, layout.shape)


def map_layout(layout: TensorLayout, shape: tuple[int, ...]) -> TensorLayout | None:
    """The layout of `shape` holding on every rank the same elements as `layout`, or None."""
    shape = tuple(shape)
    if prod(layout.shape) != prod(shape):
        return None
    if layout.shape == shape:
        return layout
    found = _map_layout(layout, shape)
    if found is None:
        finer = refine(layout, shape)
        if finer is not layout:
            found = _map_layout(finer, shape, layout)
    return found


def _map_layout(layout: TensorLayout, shape: tuple[int, ...],
                original: TensorLayout | None = None) -> TensorLayout | None:
    dev = layout.dev_matrix

    def size(axes: list[int]) -> int:
        return prod(dev[len(dev) - 1 - v] for v in axes)

    tmap: list[MapEntry] = [-1] * len(shape)
    for ra, rb in blocks(layout.shape, shape):
        split = [d for d in ra if map_axes(layout.tensor_map[d])]
        if not split:
            continue
        if len(ra) == 1:  # one dim of A becomes the dims rb of B
            axes = list(map_axes(layout.tensor_map[ra[0]]))
            k = 0
            for d in rb:
                if k == len(axes):
                    break
                if shape[d] % size(axes[k:]) == 0:
                    tmap[d] = _entry(axes[k:])
                    k = len(axes)
                    break
                m = k
                while m < len(axes) and size(axes[k:m]) < shape[d]:
                    m += 1
                if size(axes[k:m]) != shape[d]:
                    return None
                tmap[d] = _entry(axes[k:m])
                k = m
            if k != len(axes):
                return None
            continue
        if len(rb) != 1:
            return None
        last = split[-1]  # several dims of A merge into one dim of B
        if any(layout.slice_shape[d] != 1 for d in ra if d < last):
            return None
        tmap[rb[0]] = _entry([v for d in ra if d <= last
                              for v in map_axes(layout.tensor_map[d])])
    try:
        mapped = TensorLayout(dev, tuple(tmap), shape)
    except ValueError:
        return None
    plan = plan_redistribution(original or layout, mapped)
    if any(op.kind != "Reshape" for op in plan.ops):
        return None
    return mapped


def map_layout_partly(layout: TensorLayout, shape: tuple[int, ...]) -> TensorLayout | None:
    """The layout of `shape` that keeps every split of `layout` the reshape allows: the splits
    of each group of dims that has no equal layout are dropped (gathered), the others kept.
    None when nothing split survives."""
    shape = tuple(shape)
    if prod(layout.shape) != prod(shape):
        return None
    groups = blocks(layout.shape, shape)

    def only(keep: set[int]) -> TensorLayout:
        return TensorLayout(layout.dev_matrix,
                            tuple(e if d in keep else -1 for d, e in enumerate(layout.tensor_map)),
                            layout.shape)

    kept: set[int] = set()
    for ra, _ in groups:
        if map_layout(only(set(ra)), shape) is not None:
            kept.update(ra)
    if not any(map_axes(layout.tensor_map[d]) for d in kept):
        return None
    return map_layout(only(kept), shape)


def dim_map(a: tuple[int, ...], b: tuple[int, ...]) -> dict[int, int]:
    """Leading dim of each group of `a` -> leading dim of the matching group of `b`."""
    out: dict[int, int] = {}
    if prod(a) != prod(b):
        return out
    for ra, rb in blocks(a, b):
        da = next((d for d in ra if a[d] != 1), None)
        db = next((d for d in rb if b[d] != 1), None)
        if da is not None and db is not None:
            out[da] = db
    return out
