"""The `Layout` API: name the axes of a device matrix, then map tensor dims onto them.

This reproduces MindSpore's `mindspore.Layout` (reference/parallel-semantics.md §1.4)::

    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))     # or Layout((2, 2, 2), name=(...))
    spec = layout("dp", ("sp", "mp"))                    # one entry per tensor dim
    spec.tensor_map                                      # (2, (1, 0))
    spec.to_dict()                                       # MindSpore's dict

Tensor-map values count device axes **from the right**: alias number ``i`` of ``n`` becomes
``n - 1 - i`` and ``"None"`` (not split) becomes ``-1``. A tuple entry maps one tensor dim onto
several device axes; the first alias listed is the most significant.

Calling a `Layout` returns an immutable `LayoutSpec`; that is what `shard()`, `in_strategy`,
`out_strategy` and `dataset_strategy` accept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

INTERLEAVED_PARALLEL = "interleaved_parallel"
"""Alias of the virtual axis used for micro-interleaving; only allowed as the last alias."""

NONE_ALIAS = "None"
"""Tensor-map entry meaning "this dim is not split"."""

TensorMapEntry = int | tuple[int, ...]
"""One entry of a tensor map: a device-axis index (from the right), -1, or a tuple of them."""


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_device_matrix(device_matrix: object) -> tuple[int, ...]:
    if not isinstance(device_matrix, (tuple, list)):
        raise TypeError(
            "Layout: device_matrix must be a tuple of positive ints such as (2, 2, 2), got "
            f"{type(device_matrix).__name__} {device_matrix!r}"
        )
    if not device_matrix:
        raise ValueError("Layout: device_matrix must not be empty")
    for size in device_matrix:
        if not _is_int(size):
            raise TypeError(
                f"Layout: device_matrix must contain only ints, got {type(size).__name__} "
                f"{size!r} in {tuple(device_matrix)!r}"
            )
        if size <= 0:
            raise ValueError(
                f"Layout: every device_matrix entry must be > 0, got {tuple(device_matrix)!r}"
            )
    return tuple(int(s) for s in device_matrix)


def _check_alias_name(alias_name: object, n_axes: int) -> tuple[str, ...]:
    if not isinstance(alias_name, (tuple, list)):
        raise TypeError(
            "Layout: alias_name must be a tuple of strings such as ('dp', 'sp', 'mp'), got "
            f"{type(alias_name).__name__} {alias_name!r}"
        )
    for alias in alias_name:
        if not isinstance(alias, str):
            raise TypeError(
                f"Layout: alias_name must contain only strings, got {type(alias).__name__} "
                f"{alias!r} in {tuple(alias_name)!r}"
            )
        if not alias:
            raise ValueError("Layout: an alias name must not be empty")
        if alias == NONE_ALIAS:
            raise ValueError(
                'Layout: "None" cannot be an alias name, it means "not split" in a tensor map'
            )
    aliases = tuple(alias_name)
    if len(aliases) != n_axes:
        raise ValueError(
            f"Layout: alias_name {aliases!r} has {len(aliases)} names but device_matrix has "
            f"{n_axes} axes; give one name per axis"
        )
    duplicated = sorted({a for a in aliases if aliases.count(a) > 1})
    if duplicated:
        raise ValueError(
            f"Layout: alias names must be unique, {duplicated} repeated in {aliases!r}"
        )
    if INTERLEAVED_PARALLEL in aliases[:-1]:
        raise ValueError(
            f'Layout: "{INTERLEAVED_PARALLEL}" must be the last alias name, got {aliases!r}'
        )
    return aliases


def _physical_device_num(device_matrix: tuple[int, ...], aliases: tuple[str, ...]) -> int:
    """Number of real devices: the interleaved (virtual) axis lives inside one device."""
    total = 1
    for size, alias in zip(device_matrix, aliases):
        if alias != INTERLEAVED_PARALLEL:
            total *= size
    return total


def _check_rank_list(rank_list: object, device_num: int) -> tuple[int, ...]:
    if not isinstance(rank_list, (tuple, list)):
        raise TypeError(
            f"Layout: rank_list must be a list of ints, got {type(rank_list).__name__} "
            f"{rank_list!r}"
        )
    for rank in rank_list:
        if not _is_int(rank):
            raise TypeError(
                f"Layout: rank_list must contain only ints, got {type(rank).__name__} {rank!r}"
            )
        if rank < 0:
            raise ValueError(f"Layout: rank_list entries must be >= 0, got {rank!r}")
    ranks = tuple(int(r) for r in rank_list)
    if len(ranks) != device_num:
        raise ValueError(
            f"Layout: rank_list has {len(ranks)} entries but the device matrix holds "
            f"{device_num} devices; give one rank per device"
        )
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"Layout: rank_list entries must be unique, got {list(ranks)!r}")
    return ranks


@dataclass(frozen=True)
class LayoutSpec:
    """A tensor layout produced by calling a `Layout`: immutable and hashable.

    Attributes:
        device_matrix: sizes of the device axes, e.g. ``(2, 2, 2)``.
        tensor_map: one entry per tensor dim: a device-axis index counted from the right,
            ``-1`` for "not split", or a tuple of indices (first = most significant).
        alias_name: the axis names, e.g. ``("dp", "sp", "mp")``.
        rank_list: the devices, in device-matrix (row-major) order.
        interleaved_parallel: whether the last axis is the virtual ``"interleaved_parallel"``.
        alias_map: the tensor map as the user wrote it, with names (for messages and repr).
    """

    device_matrix: tuple[int, ...]
    tensor_map: tuple[TensorMapEntry, ...]
    alias_name: tuple[str, ...]
    rank_list: tuple[int, ...]
    interleaved_parallel: bool
    alias_map: tuple[str | tuple[str, ...], ...]

    @property
    def ndim(self) -> int:
        """Number of tensor dims this layout describes."""
        return len(self.tensor_map)

    @property
    def device_num(self) -> int:
        """Number of physical devices (the interleaved axis, if any, is not a device)."""
        return len(self.rank_list)

    def axis_size(self, index: int) -> int:
        """Size of the device axis with tensor-map value `index` (counted from the right)."""
        if index == -1:
            return 1
        return self.device_matrix[len(self.device_matrix) - 1 - index]

    @property
    def shard_strategy(self) -> tuple[int, ...]:
        """Number of slices of each tensor dim: ``(2, 4)`` for ``layout("dp", ("sp", "mp"))``
        on a (2, 2, 2) device matrix."""
        out = []
        for entry in self.tensor_map:
            indices = entry if isinstance(entry, tuple) else (entry,)
            count = 1
            for index in indices:
                count *= self.axis_size(index)
            out.append(count)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """The dict MindSpore's ``Layout.to_dict()`` returns (same keys, order and types)."""
        return {
            "device_matrix": self.device_matrix,
            "tensor_map": self.tensor_map,
            "interleaved_parallel": self.interleaved_parallel,
            "alias_name": self.alias_name,
            "rank_list": list(self.rank_list),
        }

    def __repr__(self) -> str:
        rank = (
            ""
            if self.rank_list == tuple(range(len(self.rank_list)))
            else (f", rank_list={list(self.rank_list)!r}")
        )
        entries = ", ".join(repr(entry) for entry in self.alias_map)
        return f"Layout({self.device_matrix!r}, {self.alias_name!r}{rank})({entries})"


class Layout:
    """A device matrix with a name for each axis; call it to lay out one tensor.

    Args:
        device_matrix: sizes of the device axes, e.g. ``(2, 2, 2)``; ints > 0.
        alias_name: one unique string per axis, e.g. ``("dp", "sp", "mp")``. ``"None"`` is not
            allowed; ``"interleaved_parallel"`` is allowed only as the last name. ``name=`` is
            accepted as a synonym (the spelling of MindSpore's tutorials).
        rank_list: optional permutation of the devices, in device-matrix order; default
            ``0 .. n-1``.
    """

    def __init__(
        self,
        device_matrix: Sequence[int],
        alias_name: Sequence[str] | None = None,
        rank_list: Sequence[int] | None = None,
        *,
        name: Sequence[str] | None = None,
    ) -> None:
        if alias_name is not None and name is not None:
            raise TypeError("Layout: give the axis names once, as alias_name or as name")
        if alias_name is None:
            alias_name = name
        if alias_name is None:
            raise TypeError(
                "Layout: missing the axis names, e.g. Layout((2, 2, 2), ('dp', 'sp', 'mp'))"
            )
        self._device_matrix = _check_device_matrix(device_matrix)
        self._alias_name = _check_alias_name(alias_name, len(self._device_matrix))
        device_num = _physical_device_num(self._device_matrix, self._alias_name)
        if rank_list is None:
            self._rank_list = tuple(range(device_num))
        else:
            self._rank_list = _check_rank_list(rank_list, device_num)

    @property
    def device_matrix(self) -> tuple[int, ...]:
        return self._device_matrix

    @property
    def alias_name(self) -> tuple[str, ...]:
        return self._alias_name

    @property
    def rank_list(self) -> list[int]:
        return list(self._rank_list)

    def _index(self, alias: object, position: int) -> int:
        if not isinstance(alias, str):
            raise TypeError(
                f'Layout: tensor map entry {position} must be an alias name, "None" or a tuple '
                f"of alias names, got {type(alias).__name__} {alias!r}"
            )
        if alias not in self._alias_name:
            raise ValueError(
                f"Layout: unknown alias {alias!r} in tensor map entry {position}; the aliases "
                f'are {self._alias_name!r} (or "None" for not split)'
            )
        return len(self._alias_name) - 1 - self._alias_name.index(alias)

    def __call__(self, *tensor_map: str | tuple[str, ...]) -> LayoutSpec:
        """Lay out a tensor: one entry per tensor dim (an alias, ``"None"`` or a tuple)."""
        values: list[TensorMapEntry] = []
        names: list[str | tuple[str, ...]] = []
        used: list[str] = []
        for position, entry in enumerate(tensor_map):
            if isinstance(entry, (tuple, list)):
                if not entry:
                    raise ValueError(
                        f'Layout: tensor map entry {position} is an empty tuple; use "None" '
                        "for a dim that is not split"
                    )
                # "None" inside a tuple is an axis of size 1 (-1), as in MindSpore:
                # ("sp", "None") splits the dim as "sp" alone.
                values.append(tuple(-1 if a == NONE_ALIAS else self._index(a, position)
                                    for a in entry))
                names.append(tuple(entry))
                used.extend(a for a in entry if a != NONE_ALIAS)
            elif entry == NONE_ALIAS:
                values.append(-1)
                names.append(NONE_ALIAS)
            else:
                values.append(self._index(entry, position))
                names.append(entry)  # type: ignore[arg-type]
                used.append(entry)  # type: ignore[arg-type]
        repeated = sorted({a for a in used if used.count(a) > 1})
        if repeated:
            raise ValueError(
                f"Layout: alias {repeated[0]!r} is used more than once in tensor map "
                f"{tuple(tensor_map)!r}; each device axis may split at most one tensor dim"
            )
        return LayoutSpec(
            device_matrix=self._device_matrix,
            tensor_map=tuple(values),
            alias_name=self._alias_name,
            rank_list=self._rank_list,
            interleaved_parallel=INTERLEAVED_PARALLEL in self._alias_name,
            alias_map=tuple(names),
        )

    def to_dict(self) -> dict[str, Any]:
        """MindSpore raises here too: a Layout needs a tensor map before it is a layout."""
        raise ValueError(
            "Layout.to_dict(): call the layout with a tensor map first, e.g. "
            "layout('dp', 'None').to_dict()"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (self._device_matrix, self._alias_name, self._rank_list) == (
            other._device_matrix,
            other._alias_name,
            other._rank_list,
        )

    def __hash__(self) -> int:
        return hash((self._device_matrix, self._alias_name, self._rank_list))

    def __repr__(self) -> str:
        rank = (
            ""
            if self._rank_list == tuple(range(len(self._rank_list)))
            else (f", rank_list={list(self._rank_list)!r}")
        )
        return f"Layout({self._device_matrix!r}, {self._alias_name!r}{rank})"
