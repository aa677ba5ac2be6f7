"""Checks on the batches a run reads from `dataset()` (compiler/driver/runtime.py), each found as
the batch is read, before the step that would use it, and each one line (`DataError`): which batch
(of which epoch, at which step of the run), what is wrong, what would be valid.

* the count, shapes and dtypes of a batch's arrays against the program's inputs and labels (a
  short last batch, a wrong-shape batch, float token ids);
* integer ids against what the program indexes with them (`index_ranges`, found at compile
  time on the traced graph and written into the rank programs' `DATASET`): an input that
  reaches a Gather's indices (an embedding lookup, through slices, reshapes and casts) must lie
  in 0..rows-1 of its table, a sparse cross-entropy's labels in 0..classes-1; on a device an
  id outside would be clamped or read as zeros, silently;
* a `dataset()` that raises, calls `sys.exit()`, or gives no batch in an epoch (an iterator
  that the first epoch used up).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.ir.errors import PcompileError
from pcompile.program.dataset import IndexRange, ranges_of  # noqa: F401  (re-exported)


class DataError(PcompileError):
    """A mistake in the data a run reads, found when the batch is read."""


@dataclass(frozen=True)
class BatchPlace:
    """Where a batch sits in the run: its epoch, its place in the epoch, the step using it."""

    epoch: int
    batch: int
    step: int

    def __str__(self) -> str:
        return f"batch {self.batch} of epoch {self.epoch} (step {self.step} of the run)"


# Ops whose result holds (some of) their first operand's values unchanged: an id passes them.
_PASSING = frozenset({"StridedSlice", "Slice", "Reshape", "Transpose", "ExpandDims", "Squeeze",
                      "Cast", "Concat", "Tile", "BroadcastTo", "Identity", "Flatten", "Split",
                      "TupleGetItem", "Depend"})


def _index_use(node: Any, operand: int) -> tuple[int, str] | None:
    """(entries, what) when `node` uses its operand `operand` as indices."""
    where = f"{node.op} '{node.instance_name or node.op}'"
    if node.source is not None:
        where += f" at {node.source}"
    if node.op == "Gather" and operand == 1:
        table = node.operands[0].shape
        if not table:
            return None
        axis = int(node.attrs.get("axis", 0)) % len(table)
        return table[axis], f"{where}, a lookup in a table of {table[axis]} rows"
    if node.op == "SparseSoftmaxCrossEntropyWithLogits" and operand == 1:
        logits = node.operands[0].shape
        if not logits:
            return None
        return logits[-1], f"{where}, over {logits[-1]} classes"
    return None


def _uses_of_ids(param: Any) -> Iterator[tuple[Any, int, Any]]:
    """(node, operand, value) of every use of a value that holds `param`'s ids unchanged
    (`param` itself, or what the `_PASSING` ops make of it)."""
    seen: set[int] = set()
    frontier = [param]
    while frontier:
        value = frontier.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for node, operand in value.uses:
            yield node, operand, value
            if node.op in _PASSING and operand == 0:
                frontier.append(node.result)


def _integer_inputs(graph: Any) -> list[Any]:
    return [p for p in graph.params if np.issubdtype(p.dtype.np, np.integer)]


def index_ranges(graph: Any) -> tuple[IndexRange, ...]:
    """The ranges of the graph's integer inputs that index something (the smallest, when an
    input indexes several things); inputs that do not index keep any value."""
    out = []
    for param in _integer_inputs(graph):
        uses = [use for node, operand, _ in _uses_of_ids(param)
                if (use := _index_use(node, operand)) is not None]
        if uses:
            size, what = min(uses, key=lambda use: use[0])
            out.append(IndexRange(param.name, size, what))
    return tuple(out)


def looked_up_ids(graph: Any, name: str) -> int:
    """How many ids of integer input `name` one step looks up: the elements of the Gather
    indices its ids reach (the most, over its Gathers), e.g. S of a sample of S + 1 token ids
    whose last is only a label; 0 when they reach no Gather."""
    return max((int(np.prod(value.shape, dtype=np.int64))
                for param in _integer_inputs(graph) if param.name == name
                for node, operand, value in _uses_of_ids(param)
                if node.op == "Gather" and operand == 1), default=0)


def check_batch(path: str, arrays: list[Any], expected: list[tuple[str, tuple[int, ...], Any]],
                sizes: tuple[int, int], place: BatchPlace, rows: tuple[int, int] | None,
                ranges: tuple[IndexRange, ...] = (), whole: str = "") -> list[np.ndarray]:
    """A batch's arrays in the program's dtypes after every check (with `rows` = (lo, hi):
    rows lo..hi of the global batch); `whole` says how to give only whole batches."""
    n_inputs, n_labels = sizes
    if len(arrays) != n_inputs + n_labels:
        raise DataError(
            f"dataset() in {path}, {place}: {len(arrays)} arrays; the program takes "
            f"{n_inputs} input(s) and {n_labels} label(s), in that order")
    limits = {r.name: r for r in ranges}
    out = []
    for arr, (name, shape, dtype) in zip(arrays, expected):
        arr = np.asarray(arr)
        want = shape if rows is None else (rows[1] - rows[0], *shape[1:])
        if arr.shape != want:
            got = arr.shape if rows is None else (shape[0], *arr.shape[1:])
            fix = "give arrays of that shape"
            if shape and got[1:] == shape[1:]:  # only the batch dim differs
                fix = whole or (f"yield only whole batches of {shape[0]} rows (leave out a "
                                "short last one)")
            raise DataError(f"dataset() in {path}, {place}: {name} has shape {got}; the program "
                            f"was compiled for {shape}: {fix}")
        target = np.dtype(dtype)
        if arr.dtype.kind in "fc" and target.kind in "biu":  # ids or a mask given as floats
            raise DataError(f"dataset() in {path}, {place}: {name} is {arr.dtype}; the program "
                            f"takes {target} (convert it in dataset(), e.g. "
                            f"`.astype(np.{target})`)")
        limit = limits.get(name)
        if limit is not None and arr.size:
            low, high = arr.min(), arr.max()
            if low < 0 or high >= limit.size:
                bad = low if low < 0 else high
                at = tuple(int(i) for i in np.argwhere(arr == bad)[0])
                if rows is not None and at:
                    at = (at[0] + rows[0], *at[1:])
                raise DataError(
                    f"dataset() in {path}, {place}: {name} holds id {bad} at {list(at)}; the "
                    f"program uses it in {limit.used_by}: ids 0..{limit.size - 1} are valid")
        out.append(arr.astype(target, copy=False))
    return out


def no_batch(path: str, epoch: int, step: int, used_up: bool) -> DataError:
    """`dataset()` gave nothing in `epoch` where the run needs step `step`."""
    if epoch == 1:
        return DataError(f"dataset() in {path} gives no batch; it must give at least one")
    why = (f"it returned an iterator that epoch {epoch - 1} used up; return a fresh iterable on "
           "every call (a list, a generator function's call, a pcompile.dataset object)"
           if used_up else "an epoch must give at least one batch")
    return DataError(f"dataset() in {path} gives no batch in epoch {epoch}, where the run needs "
                     f"step {step} (epochs restart dataset()): {why}; or train for at most "
                     f"{step - 1} steps (--steps)")
