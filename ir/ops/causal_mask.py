"""Compile-time recognition of MindSpore's causal attention mask.

mindformers hands `FlashAttentionScore` its causal mask as data: a uint8 constant with 1
(masked) strictly above the diagonal, `np.triu(ones((1, 1, S, S)), 1)`, tiled over the batch by
a Tile, and under a parallel plan reshaped and sliced to the rank's part of the batch (or made a
`RankConstant` when a constant operand is split). `is_causal_mask(value)` decides, from the
graph alone, that every (S1, S2) block of such a value is that pattern, so that the JAX
lowering can run the fused causal kernel instead of reading a mask (`ir/ops/attention.py`,
`causal_lowering_attrs`).

The value is followed back through ops that keep each trailing (S1, S2) block a copy of a
block of their input: Tile with multiples 1 on the last two dims; Reshape, ExpandDims,
Squeeze, Flatten and BroadcastTo whose output keeps the input's last two dims (the first
four keep the element order, so each output block is one input block; BroadcastTo repeats
blocks); StridedSlice whose slice of the last two dims is whole on every rank (the leading
dims may be sliced at rank-dependent offsets); Cast (applied to the block), Identity and
Depend's value. It ends at a Constant whose leading blocks are all equal, or a
`RankConstant` slicing such a constant on its leading dims only. Anything else (a graph
input, a computed mask, a slice of the rows as context parallelism makes) is not recognised:
the caller keeps the general path, which is always right.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from pcompile.ir.core import Constant, NodeResult, RankConstant, Value
from pcompile.ir.rank import RankOffsets, SlicedArray
from pcompile.ir.types import DType

# Ops whose output blocks are input blocks when both keep the same last two dims.
_SAME_BLOCKS = ("Reshape", "ExpandDims", "Squeeze", "Flatten", "BroadcastTo", "Identity")
_MAX_CHAIN = 64  # ops followed back from the mask before giving up

# (id of the source array, casts) -> (weak reference to the array, verdict)
_VERDICTS: dict[tuple[int, tuple[DType, ...]], tuple[Any, bool]] = {}


def is_causal_mask(value: Value) -> bool:
    """True when every trailing (S1, S2) block of `value`, on every rank, is nonzero exactly
    where j > i (i the row, j the column): MindSpore's mask for causal attention."""
    source = block_source(value)
    if source is None:
        return False
    array, casts = source
    key = (id(array), casts)
    known = _VERDICTS.get(key)
    if known is not None and known[0]() is array:
        return bool(known[1])
    verdict = _strictly_upper(array, casts)
    try:
        _VERDICTS[key] = (weakref.ref(array), verdict)
    except TypeError:  # an array type without weak references: no memo
        pass
    return verdict


def block_source(value: Value) -> tuple[np.ndarray, tuple[DType, ...]] | None:
    """(array, casts): every trailing block of `value` is a trailing block of `array` (a
    constant's data) converted by `casts` in order; None when the graph does not show that."""
    casts: list[DType] = []
    for _ in range(_MAX_CHAIN):
        if len(value.shape) < 2:
            return None
        if isinstance(value, RankConstant):
            data = value.data
            if not isinstance(data, SlicedArray):
                return None
            array = np.asarray(data.array)
            if array.shape[-2:] != tuple(data.layout.slice_shape[-2:]):
                return None  # the rank's part cuts the blocks
            return array, tuple(casts)
        if isinstance(value, Constant):
            try:
                return value.array, tuple(casts)
            except ValueError:  # an OpaqueConstant (a parsed dump): no data
                return None
        if not isinstance(value, NodeResult) or not value.node.operands:
            return None
        node = value.node
        source = node.operands[0]
        if node.op == "Cast":
            if not isinstance(node.attrs.get("dst_type"), DType):
                return None
            casts.insert(0, node.attrs["dst_type"])
        elif node.op == "Depend":
            pass
        elif node.op == "Tile":
            if not _tile_keeps_blocks(node.attrs.get("multiples"), len(source.shape)):
                return None
        elif node.op == "StridedSlice":
            if not _slice_keeps_blocks(node.attrs, tuple(source.shape)):
                return None
        elif node.op in _SAME_BLOCKS:
            if len(source.shape) < 2 or source.shape[-2:] != value.shape[-2:]:
                return None
        else:
            return None
        value = source
    return None


def _tile_keeps_blocks(multiples: Any, rank: int) -> bool:
    if rank < 2 or not isinstance(multiples, tuple) or len(multiples) < 2:
        return False
    return multiples[-2:] == (1, 1)


def _slice_keeps_blocks(attrs: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """The slice takes the last two dims whole on every rank (begin/end may be rank-dependent
    `RankOffsets`; only their leading dims may then vary)."""
    begin, end, strides = attrs.get("begin"), attrs.get("end"), attrs.get("strides")
    if not isinstance(strides, tuple):
        return False
    rank = len(shape)
    for d in (rank - 2, rank - 1):
        if d >= len(strides):
            continue  # dims past the given entries are taken whole
        lo, hi = _fixed(begin, d), _fixed(end, d)
        if lo is None or hi is None or not isinstance(strides[d], int):
            return False
        if len(range(*slice(lo, hi, strides[d]).indices(shape[d]))) != shape[d]:
            return False
    return True


def _fixed(bounds: Any, dim: int) -> int | None:
    """Entry `dim` of a begin/end that is the same on every rank, else None."""
    if isinstance(bounds, RankOffsets):
        return None if bounds.terms[dim] else int(bounds.base[dim])
    if isinstance(bounds, tuple) and isinstance(bounds[dim], int):
        return int(bounds[dim])
    return None


def _strictly_upper(array: np.ndarray, casts: tuple[DType, ...]) -> bool:
    """Every (S1, S2) block of `array` is the same, and after `casts` nonzero exactly above
    the diagonal. Checked a band of rows at a time, so that a long sequence's mask (8192^2
    elements) never has whole-block temporaries beside it at compile time."""
    rows, cols = array.shape[-2:]
    blocks = np.asarray(array).reshape(-1, rows, cols)
    cast = None
    if casts:
        from pcompile.ir.registry import get_op

        cast = get_op("Cast").numpy
        assert cast is not None
    band = max(1, (1 << 20) // max(cols, 1))  # about a million elements per band
    columns = np.arange(cols)
    for start in range(0, rows, band):
        part = blocks[:, start:start + band]
        if blocks.shape[0] > 1 and not bool((part == part[:1]).all()):
            return False
        piece = part[0]
        for dtype in casts:
            assert cast is not None
            piece = cast(piece, dst_type=dtype)
        upper = columns[None, :] > np.arange(start, start + piece.shape[0])[:, None]
        if not np.array_equal(piece != 0, upper):
            return False
    return True
