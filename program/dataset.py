"""What a rank program knows of its data at run time, written at compile time: the dataset spec
(`DatasetSpec`, program.py's `DATASET`: the model file, how many arrays of a batch are inputs
and labels, the ranges its integer inputs must lie in) and the batch slicing by layout
(`batch_rows`: the rows a group of ranks reads; `slice_rows`: one rank's slice). Reading the
batches themselves runs the model file's `dataset()` (compiler/driver/runtime.py,
`spec_batches`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pcompile.ir.layout import TensorLayout


@dataclass(frozen=True)
class IndexRange:
    """Integer input `name` indexes `size` entries of something (`used_by`, for the message):
    its values must lie in 0..size-1."""

    name: str
    size: int
    used_by: str

    def literal(self) -> tuple[str, int, str]:
        return (self.name, self.size, self.used_by)


def ranges_of(literal: Any) -> tuple[IndexRange, ...]:
    """`IndexRange`s from their literals (a program's `DATASET`)."""
    return tuple(IndexRange(str(name), int(size), str(used))
                 for name, size, used in (literal or ()))


@dataclass(frozen=True)
class DatasetSpec:
    """What a rank program reads its batches from, written at compile time (program.py's
    `DATASET`): the model file whose `dataset()` gives them (without one, one batch of
    `inputs()` and `labels()` repeats, tensor specs filled with random values) and how many
    arrays of each batch are inputs and labels. The arrays' names, global shapes and dtypes
    are the program's input parameters; `ranges` the ids its integer inputs may hold
    (compiler/driver/data_checks.py, `index_ranges`: every batch is checked as it is read)."""

    model_file: str
    inputs: int
    labels: int
    ranges: tuple[IndexRange, ...] = ()

    def literal(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranges"] = [r.literal() for r in self.ranges]
        return out

    @classmethod
    def from_literal(cls, data: dict[str, Any]) -> DatasetSpec:
        return cls(str(data["model_file"]), int(data["inputs"]), int(data["labels"]),
                   ranges_of(data.get("ranges")))


def batch_rows(layouts: list[TensorLayout], ranks: list[int]) -> tuple[int, int] | None:
    """The rows of the global batch that `ranks` read, (lo, hi) along dim 0, from the inputs'
    layouts: the span of their slices of dim 0 (None when an input has no batch dim or the
    inputs' batches differ in size: then a rank reads the whole batch)."""
    if not layouts or any(not layout.shape for layout in layouts):
        return None
    if len({layout.shape[0] for layout in layouts}) != 1:
        return None
    bounds = [layout.slice_bounds(r)[0] for layout in layouts for r in ranks]
    return min(lo for lo, _ in bounds), max(hi for _, hi in bounds)


def slice_rows(array: np.ndarray, layout: TensorLayout, rank: int,
               first_row: int = 0) -> np.ndarray:
    """`rank`'s slice of an input by its layout, from `array` = rows first_row.. of the global
    batch (the whole batch when first_row is 0 and `array` has the global shape)."""
    if not array.shape:
        return array
    bounds = list(layout.slice_bounds(rank))
    lo, hi = bounds[0]
    bounds[0] = (lo - first_row, hi - first_row)
    return array[tuple(slice(b, e) for b, e in bounds)]
