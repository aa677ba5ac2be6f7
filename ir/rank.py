"""Rank-parametric values: what differs between the ranks of one SPMD program.

The parallel passes build ONE local graph for all ranks that run the same code. Whatever differs
between ranks is a `RankValue` in a node's attributes (or a `RankConstant` operand): a function
of the rank, evaluated with `at(rank)` when one rank's view is needed (its dump, the numpy
simulator, a generated program's comments) and lowered symbolically to `lax.axis_index` of mesh
axes by the JAX backend.

Ranks are row-major indices of a device matrix; every rank dependence MindSpore's layouts
produce is a function of a few **digits** of the rank: `digit(rank, stride, count) =
(rank // stride) % count`, the coordinate along one device-matrix axis (stride = product of the
axis sizes to its right). So:

* `RankGroup(world, digits)`: a collective's group, the ranks that share this rank's
  coordinates everywhere except on `digits` (sorted ascending, as MindSpore's rank lists);
* `GroupName(group)`: MindSpore's name of that group (`4-<hash>`, or the world group);
* `RankOffsets(base, terms)`: per-dim offsets `base[d] + sum(digit * unit)` over `terms[d]`
  (the begin/end of a rank's slice);
* `SlicedArray(array, layout)` / `RankScalar(offsets, dim, dtype)`: rank-dependent constant
  data (a constant sliced to the rank's part, the first row a rank holds);
* `RankShift(delta)`: the rank `delta` places away (a pipeline Send's `dest_rank`, a
  Receive's `src_rank`: the rank at the same position of another stage).

Digits are kept canonical (sorted by stride, adjacent digits merged), so two descriptions of the
same groups compare equal, which communication fusion relies on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Any

import numpy as np

Digit = tuple[int, int]  # (stride, count)


def digit(rank: int, stride: int, count: int) -> int:
    """The coordinate of `rank` along a device axis of rank-space `stride` and size `count`."""
    return (rank // stride) % count


def canonical_digits(digits: Iterable[Digit]) -> tuple[Digit, ...]:
    """Sorted by stride (largest first), size-1 digits dropped, adjacent digits merged
    (`(s * c, c2)` followed by `(s, c)` is one digit `(s, c * c2)`)."""
    items = sorted(((s, c) for s, c in digits if c > 1), key=lambda d: -d[0])
    out: list[Digit] = []
    for stride, count in items:
        if out and out[-1][0] == stride * count:
            out[-1] = (stride, count * out[-1][1])
        else:
            out.append((stride, count))
    return tuple(out)


def axis_digits(dev: Sequence[int], axes: Iterable[int]) -> tuple[Digit, ...]:
    """The digits of device-matrix axes (left indices) of a row-major `dev`."""
    dev = tuple(dev)
    return tuple((prod(dev[a + 1:]), dev[a]) for a in axes)


class RankValue:
    """A value that depends on the rank. Subclasses are frozen dataclasses (hashable, compared
    by what they compute)."""

    def at(self, rank: int) -> Any:
        raise NotImplementedError

    def table(self, ranks: int) -> list[Any]:
        return [self.at(r) for r in range(ranks)]


@dataclass(frozen=True)
class RankGroup(RankValue):
    """The ranks of `world` that differ from a rank only in `digits`, ascending."""

    world: int
    digits: tuple[Digit, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "digits", canonical_digits(self.digits))

    @staticmethod
    def along(dev: Sequence[int], axes: Iterable[int]) -> RankGroup:
        """The group of a collective over device-matrix axes `axes` (left indices)."""
        return RankGroup(prod(dev), axis_digits(dev, axes))

    @property
    def size(self) -> int:
        return prod(c for _, c in self.digits)

    def __len__(self) -> int:
        return self.size

    @property
    def is_world(self) -> bool:
        return self.size == self.world

    def at(self, rank: int) -> tuple[int, ...]:
        return _members(rank, self.digits)

    def position(self, rank: int) -> int:
        """Index of `rank` in its group."""
        index = 0
        for stride, count in self.digits:
            index = index * count + digit(rank, stride, count)
        return index


@lru_cache(maxsize=65536)
def _members(rank: int, digits: tuple[Digit, ...]) -> tuple[int, ...]:
    base = rank
    for stride, count in digits:
        base -= digit(rank, stride, count) * stride
    out = [base]
    for stride, count in digits:
        out = [m + k * stride for m in out for k in range(count)]
    return tuple(sorted(out))


@dataclass(frozen=True)
class GroupName(RankValue):
    """MindSpore's group name of `group` at a rank (see ir.layout.group_name)."""

    group: RankGroup

    def at(self, rank: int) -> str:
        from pcompile.ir.layout import group_name

        return group_name(self.group.at(rank), self.group.world)


Term = tuple[int, int, int]  # (stride, count, unit)


@dataclass(frozen=True)
class RankOffsets(RankValue):
    """Per-dim offsets: `base[d] + sum(digit(rank, stride, count) * unit)` over `terms[d]`."""

    base: tuple[int, ...]
    terms: tuple[tuple[Term, ...], ...]

    def at(self, rank: int) -> tuple[int, ...]:
        return tuple(b + sum(digit(rank, s, c) * u for s, c, u in ts)
                     for b, ts in zip(self.base, self.terms))

    def shifted(self, delta: Sequence[int]) -> RankOffsets:
        return RankOffsets(tuple(b + d for b, d in zip(self.base, delta)), self.terms)

    def array(self, ranks: int) -> np.ndarray:
        """All ranks' offsets, shape (ranks, len(base)), computed at once."""
        r = np.arange(ranks, dtype=np.int64)
        cols = []
        for b, ts in zip(self.base, self.terms):
            col = np.full(ranks, b, np.int64)
            for s, c, u in ts:
                col += (r // s) % c * u
            cols.append(col)
        return np.stack(cols, axis=1) if cols else np.zeros((ranks, 0), np.int64)


def layout_offsets(layout: Any) -> RankOffsets:
    """Where a rank's slice of a `TensorLayout` begins, per dim (its `slice_bounds` begins)."""
    from pcompile.ir.layout import axis_index, map_axes

    dev = layout.dev_matrix
    terms = []
    for entry, length in zip(layout.tensor_map, layout.slice_shape):
        axes = [axis_index(v, dev) for v in map_axes(entry)]
        weight = length
        dim_terms: list[Term] = []
        for a in reversed(axes):  # least significant last in the map entry
            dim_terms.append((prod(dev[a + 1:]), dev[a], weight))
            weight *= dev[a]
        terms.append(tuple(reversed(dim_terms)))
    return RankOffsets((0,) * len(layout.shape), tuple(terms))


@dataclass(frozen=True, eq=False)
class SlicedArray(RankValue):
    """`array` (a global constant) sliced to a rank's part of `layout`."""

    array: np.ndarray
    layout: Any

    def at(self, rank: int) -> np.ndarray:
        arr = np.asarray(self.array)
        if not arr.shape:
            return arr
        return arr[tuple(slice(b, e) for b, e in self.layout.slice_bounds(rank))]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SlicedArray) and self.layout == other.layout
                and np.array_equal(self.array, other.array))

    def __hash__(self) -> int:
        return hash((self.layout, self.array.shape))


@dataclass(frozen=True)
class RankScalar(RankValue):
    """The scalar `offsets.at(rank)[dim]` (e.g. the first table row a rank holds)."""

    offsets: RankOffsets
    dim: int

    def at(self, rank: int) -> int:
        return self.offsets.at(rank)[self.dim]


@dataclass(frozen=True)
class RankId(RankValue):
    """The rank itself (a rank graph's `rank` attribute)."""

    def at(self, rank: int) -> int:
        return rank


@dataclass(frozen=True)
class RankShift(RankValue):
    """`rank + delta`: the peer of a point-to-point transfer between pipeline stages (stage s
    owns ranks [s*n, (s+1)*n), so the rank at the same position k stages on is k*n away)."""

    delta: int

    def at(self, rank: int) -> int:
        return rank + self.delta


def resolve(value: Any, rank: int) -> Any:
    """`value` at `rank` (plain values are returned unchanged)."""
    return _at(value, rank) if isinstance(value, RankValue) else value


@lru_cache(maxsize=1 << 16)
def _at(value: RankValue, rank: int) -> Any:
    # Passes resolve the same values over and over (types are inferred at rank 0 for every
    # node that carries one): a group of 512 ranks is listed once.
    return value.at(rank)


def resolve_attrs(attrs: dict[str, Any], rank: int) -> dict[str, Any]:
    """Attributes with every rank-dependent value evaluated at `rank`."""
    if not any(isinstance(v, RankValue) for v in attrs.values()):
        return attrs
    return {k: resolve(v, rank) for k, v in attrs.items()}


def has_rank_values(attrs: dict[str, Any]) -> bool:
    return any(isinstance(v, RankValue) for v in attrs.values())
