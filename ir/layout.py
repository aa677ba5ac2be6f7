"""The tensor layout model (reference §1): device matrices, tensor maps, slices and groups.

A `TensorLayout` is (device matrix, tensor map, global shape). Ranks are laid out row-major on
the device matrix (last axis fastest). A tensor-map entry names device axes **counted from the
right** (0 = last axis), -1 = not split, or a tuple of axes for a dimension split over several
axes (first listed = most significant). Layout equality compares the normalised form (size-1
device axes removed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

MapEntry = int | tuple[int, ...]

WORLD_GROUP = "nccl_world_group"

_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_MASK = (1 << 64) - 1


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_hash(text: str, seed: int = 0xC70F6907) -> int:
    """libstdc++'s `std::hash<std::string>` (`_Hash_bytes`, 64-bit MurmurHash2 variant), so
    group and instance names match MindSpore's byte for byte."""
    data = text.encode()
    n = len(data)
    h = (seed ^ (n * _MUL)) & _MASK
    aligned = n & ~7
    for i in range(0, aligned, 8):
        word = int.from_bytes(data[i : i + 8], "little")
        h ^= (_shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = (_shift_mix(h) * _MUL) & _MASK
    return _shift_mix(h)


def group_name(ranks: Sequence[int], world_size: int) -> str:
    """MindSpore's group name: the world group, or `<size>-<hash of "r0-r1-...">`."""
    members = sorted(ranks)
    if len(members) == world_size and world_size > 1:
        return WORLD_GROUP
    return f"{len(members)}-{std_hash('-'.join(str(r) for r in members))}"


def rank_to_coord(rank: int, dev: Sequence[int]) -> tuple[int, ...]:
    coord = []
    for size in reversed(dev):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def coord_to_rank(coord: Sequence[int], dev: Sequence[int]) -> int:
    rank = 0
    for c, size in zip(coord, dev):
        rank = rank * size + c
    return rank


def axis_index(value: int, dev: Sequence[int]) -> int:
    """Tensor-map value (counted from the right) -> index into `dev` (from the left)."""
    return len(dev) - 1 - value


def devices_along_axes(rank: int, dev: Sequence[int], axes: Sequence[int]) -> tuple[int, ...]:
    """Ranks that share `rank`'s coordinates on every axis except `axes` (left indices), in
    rank order: the group of a collective over those axes."""
    return _along(rank, tuple(dev), tuple(sorted(set(axes))))


@lru_cache(maxsize=65536)
def _along(rank: int, dev: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    base = list(rank_to_coord(rank, dev))
    out = []
    for combo in range(prod(dev[a] for a in axes)):
        coord = list(base)
        for a in reversed(axes):
            coord[a] = combo % dev[a]
            combo //= dev[a]
        out.append(coord_to_rank(coord, dev))
    return tuple(sorted(out))


def _canonical_entry(entry: MapEntry | list[int]) -> MapEntry:
    """One tensor-map entry in canonical form: an int, or a tuple of at least two axes. A -1
    inside a tuple (MindSpore's `("sp", "None")`) adds an axis of size 1, i.e. nothing; a tuple
    left with one axis is that axis."""
    if not isinstance(entry, (tuple, list)):
        return int(entry)
    axes = tuple(int(a) for a in entry if int(a) != -1)
    if not axes:
        return -1
    return axes[0] if len(axes) == 1 else axes


def map_axes(entry: MapEntry) -> tuple[int, ...]:
    """The device-axis values (from the right) one tensor-map entry uses."""
    if isinstance(entry, tuple):
        return entry
    return () if entry == -1 else (entry,)


@dataclass(frozen=True)
class TensorLayout:
    """(device matrix, tensor map, global shape), validated on construction."""

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[MapEntry, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dev, tmap, shape = self.dev_matrix, self.tensor_map, self.shape
        object.__setattr__(self, "dev_matrix", tuple(int(d) for d in dev))
        object.__setattr__(self, "tensor_map", tuple(_canonical_entry(e) for e in tmap))
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if len(self.tensor_map) != len(self.shape):
            raise ValueError(
                f"tensor map {self.tensor_map} has {len(self.tensor_map)} entries for a tensor "
                f"of rank {len(self.shape)}"
            )
        used: list[int] = []
        for entry in self.tensor_map:
            for value in map_axes(entry):
                if not 0 <= value < len(self.dev_matrix):
                    raise ValueError(
                        f"tensor map value {value} is out of range for device matrix "
                        f"{self.dev_matrix}"
                    )
                if value in used:
                    raise ValueError(f"device axis {value} is used twice in {self.tensor_map}")
                used.append(value)
        matrix = self.dev_matrix
        splits = tuple(prod(matrix[axis_index(v, matrix)] for v in map_axes(e))
                       for e in self.tensor_map)
        # computed once: the passes ask a layout for its splits hundreds of thousands of times
        object.__setattr__(self, "_splits", splits)
        for dim, (size, count) in enumerate(zip(self.shape, splits)):
            if size % count:
                raise ValueError(
                    f"dim {dim} of shape {self.shape} (size {size}) is not divisible by its "
                    f"split {count} (device matrix {self.dev_matrix}, map {self.tensor_map})"
                )

    # -- derived ------------------------------------------------------------------------------
    @property
    def device_num(self) -> int:
        return prod(self.dev_matrix)

    @property
    def splits(self) -> tuple[int, ...]:
        """Number of slices of each tensor dim (MindSpore's shard strategy)."""
        splits: tuple[int, ...] = self.__dict__["_splits"]  # set by __post_init__
        return splits

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shape, self.splits))

    @property
    def used_axes(self) -> tuple[int, ...]:
        """Left indices of the device axes the tensor is split over."""
        return tuple(
            sorted(axis_index(v, self.dev_matrix) for e in self.tensor_map for v in map_axes(e))
        )

    def slice_index(self, rank: int) -> tuple[int, ...]:
        """Which slice of each dim `rank` holds."""
        coord = rank_to_coord(rank, self.dev_matrix)
        out = []
        for entry in self.tensor_map:
            index = 0
            for v in map_axes(entry):
                a = axis_index(v, self.dev_matrix)
                index = index * self.dev_matrix[a] + coord[a]
            out.append(index)
        return tuple(out)

    def slice_bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        """(begin, end) of `rank`'s slice along every dim of the global tensor."""
        return tuple(
            (i * s, (i + 1) * s) for i, s in zip(self.slice_index(rank), self.slice_shape)
        )

    def repeat_group(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same slice as `rank` (the mirror group of a parameter)."""
        return devices_along_axes(rank, self.dev_matrix, self.repeat_axes)

    @property
    def repeat_axes(self) -> tuple[int, ...]:
        """Left indices of the device axes the tensor is not split over (it repeats there)."""
        return tuple(a for a in range(len(self.dev_matrix)) if a not in self.used_axes)

    @property
    def repeat_count(self) -> int:
        """How many ranks hold each slice."""
        return prod(self.dev_matrix[a] for a in self.repeat_axes)

    def normalized(self) -> TensorLayout:
        """Remove size-1 device axes; entries mapped to them become -1."""
        return _normalized(self.dev_matrix, self.tensor_map, self.shape)

    def _normalize(self) -> TensorLayout:
        dev = self.dev_matrix
        keep = [a for a, size in enumerate(dev) if size != 1]
        new_dev = tuple(dev[a] for a in keep)
        renum = {len(dev) - 1 - a: len(new_dev) - 1 - i for i, a in enumerate(keep)}
        tmap: list[MapEntry] = []
        for entry in self.tensor_map:
            values = tuple(renum[v] for v in map_axes(entry) if v in renum)
            if isinstance(entry, tuple) and len(values) > 1:
                tmap.append(values)
            else:
                tmap.append(values[0] if values else -1)
        return TensorLayout(new_dev or (1,), tuple(tmap), self.shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorLayout):
            return NotImplemented
        a, b = self.normalized(), other.normalized()
        return (a.dev_matrix, a.tensor_map, a.shape) == (b.dev_matrix, b.tensor_map, b.shape)

    def __hash__(self) -> int:
        n = self.normalized()
        return hash((n.dev_matrix, n.tensor_map, n.shape))

    def to_tuple(self) -> tuple[tuple[int, ...], tuple[MapEntry, ...], tuple[int, ...]]:
        return (self.dev_matrix, self.tensor_map, self.slice_shape)

    def __str__(self) -> str:
        return (f"(dev {list(self.dev_matrix)}, map {list(self.tensor_map)}, "
                f"shape {list(self.shape)})")


@lru_cache(maxsize=65536)
def _normalized(dev: tuple[int, ...], tmap: tuple[MapEntry, ...], shape: tuple[int, ...]
                ) -> TensorLayout:
    """Layouts are compared and hashed through their normalised form all the time (search,
    redistribution caches): compute it once per distinct layout."""
    layout = TensorLayout(dev, tmap, shape)
    if 1 not in dev:
        return layout
    return layout._normalize()


def replicated(shape: Sequence[int], dev: Sequence[int]) -> TensorLayout:
    return TensorLayout(tuple(dev), tuple(-1 for _ in shape), tuple(shape))
