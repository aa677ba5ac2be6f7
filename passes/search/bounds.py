"""Cheap lower bounds on redistribution costs, for dynamic programming's lazy edge tables.

Dynamic programming needs the cost of every (producer layout, consumer layout) pair of an
edge; at 64 devices that is hundreds of thousands of redistribution plans. Most pairs never
matter, so `dynamic_programming.py` starts from a lower bound of each pair and plans only the
pairs an optimal plan uses (see its module docstring). The bound must hold for the cost the
planner (`passes.redistribution`) gives, whatever plan it builds. It rests on what every
correct plan must do and on how `RedistributionCost` charges each op:

* **missing data**: rank r must receive every element of its target slice that its source
  slice lacks, `missing_r = |dst_r| - |dst_r ∩ src_r|` elements. Only Concat (AllGather) and
  Permute (AlltoAll) move data. A Concat of n slices of s elements receives s(n-1) and charges
  forward 0.5 s n >= 0.5 s(n-1) and backward 0.5 s >= 0.5 s(n-1)/(D-1); a Permute receives at
  most s and charges 2s both ways. So `forward >= 0.5 * missing_r` and `backward >= 0.5 *
  missing_r / (D-1)` elements for every rank r (D: device count); any rank gives a bound, so a
  few ranks are sampled: 0, D-1 and the stride of every device axis of the layouts involved
  (the unit vectors of each device matrix, which see any axis placed differently);
* **first exchange**: data moves only if some rank misses data; the first Concat or Permute
  then takes the local slice at that moment, which is split only over device axes the source
  or the target layout uses, so it holds at least `elements / U` elements, U the product of
  the sizes of those axes together (for a power-of-two device count the union of their rank
  bits; otherwise at most the source's slice count times the target's). That op charges
  forward >= `elements / U` (Concat: 0.5 s n with n >= 2; Permute: 2 s) and backward >= 0.5
  `elements / U`;
* **work**: if some rank's target slice differs from its source slice, the plan has at least
  one op; its first op takes the source slice and charges computation >= its input (Split and
  Concat charge their input, Permute and Reshape more), so computation >= source slice elements;
* the latency model `practical` is applied to the bounds through its infimum over larger
  volumes (`practical_lower`), so the bound holds for any `set_cost_model_context` constants;
* a bool tensor that must receive data costs infinity (as `redistribution_cost` does);
* equal layouts cost 0 (exactly).

Through a Reshape the slices are compared on the consumer's shape when the producer's layout
has an equal layout there (`reshape.map_layout`: the same elements on every rank), or on the
producer's shape when the consumer's has one; otherwise only sizes count (a rank whose target
slice is larger than its source slice misses the difference, and a slice whose shape changes
needs an op).
`tests/passes/test_search_bounds.py` checks the bound against the planner on random layout pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from math import inf, prod

import numpy as np

from pcompile.ir.layout import TensorLayout, axis_index, map_axes, rank_to_coord
from pcompile.passes.reshape_layout import map_layout
from pcompile.passes.search.cost_model import EPS, CostConstants


def practical_lower(volume: float, c: CostConstants) -> float:
    """The infimum of `practical(v)` over every `v >= volume`."""
    if volume <= EPS:
        return 0.0
    if volume <= c.communi_threshold:
        return min(c.communi_const, c.communi_threshold + c.communi_bias)
    return volume + c.communi_bias


def practical_lower_array(volume: np.ndarray, c: CostConstants) -> np.ndarray:
    """`practical_lower` elementwise."""
    low = min(c.communi_const, c.communi_threshold + c.communi_bias)
    return np.where(volume <= EPS, 0.0,
                    np.where(volume <= c.communi_threshold, low, volume + c.communi_bias))


def sample_ranks(layouts: Sequence[TensorLayout], devices: int) -> list[int]:
    """Rank 0, the last rank and the stride of every device axis of `layouts`."""
    ranks = {0, devices - 1}
    for lay in layouts:
        dev = lay.dev_matrix
        for a in range(len(dev)):
            stride = prod(dev[a + 1:])
            if stride < devices:
                ranks.add(stride)
    return sorted(ranks)


@lru_cache(maxsize=1 << 16)
def _layout_boxes(layout: TensorLayout, ranks: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(begin, end) of `layout`'s slice on each of `ranks`: arrays [rank, dim]."""
    dev = layout.dev_matrix
    coords = np.array([rank_to_coord(r, dev) for r in ranks], dtype=np.int64).reshape(
        len(ranks), len(dev))
    index = np.zeros((len(ranks), len(layout.shape)), dtype=np.int64)
    for d, entry in enumerate(layout.tensor_map):
        for v in map_axes(entry):
            a = axis_index(v, dev)
            index[:, d] = index[:, d] * dev[a] + coords[:, a]
    size = np.array(layout.slice_shape, dtype=np.int64)
    return index * size, (index + 1) * size


def _boxes(layouts: Sequence[TensorLayout], ranks: Sequence[int], ndim: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(begin, end) of every layout's slice on every sampled rank: arrays [layout, rank, dim]."""
    lo = np.zeros((len(layouts), len(ranks), ndim), dtype=np.int64)
    hi = np.zeros_like(lo)
    key = tuple(ranks)
    for i, lay in enumerate(layouts):
        lo[i], hi[i] = _layout_boxes(lay, key)
    return lo, hi


def _axis_bits(layout: TensorLayout) -> int:
    """The rank bits the device axes splitting `layout` cover (power-of-two device count)."""
    dev = layout.dev_matrix
    bits = 0
    for entry in layout.tensor_map:
        for v in map_axes(entry):
            a = axis_index(v, dev)
            low = prod(dev[a + 1:]).bit_length() - 1
            bits |= ((1 << (dev[a].bit_length() - 1)) - 1) << low
    return bits


def _union_sizes(src: Sequence[TensorLayout], dst: Sequence[TensorLayout], devices: int
                 ) -> np.ndarray:
    """For every (source, target) pair, the product of the sizes of the device axes either
    layout splits over (an upper bound when the device count is not a power of two)."""
    if devices & (devices - 1) == 0:
        a = np.array([_axis_bits(lay) for lay in src], dtype=np.int64)
        b = np.array([_axis_bits(lay) for lay in dst], dtype=np.int64)
        both = a[:, None] | b[None, :]
        count = np.zeros(both.shape, dtype=np.int64)
        for k in range(devices.bit_length()):
            count += (both >> k) & 1
        return np.power(2.0, count)
    ns = np.array([float(prod(lay.splits)) for lay in src])
    nd = np.array([float(prod(lay.splits)) for lay in dst])
    sizes: np.ndarray = np.minimum(float(devices), ns[:, None] * nd[None, :])
    return sizes


def lower_bound_matrix(src: Sequence[TensorLayout], dst: Sequence[TensorLayout],
                       itemsize: int, is_bool: bool, devices: int,
                       c: CostConstants) -> np.ndarray:
    """Lower bound of the objective of redistributing each `src[i]` into each `dst[j]`."""
    a_shape, b_shape = src[0].shape, dst[0].shape
    src_elems = np.array([float(prod(lay.slice_shape)) for lay in src])
    dst_elems = np.array([float(prod(lay.slice_shape)) for lay in dst])
    union = _union_sizes(src, dst, devices)
    total = float(prod(b_shape))
    # Sizes alone: a rank holding fewer elements than it needs misses the difference.
    missing = np.maximum(0.0, dst_elems[None, :] - src_elems[:, None])
    reshaped = np.array([[lay_a.slice_shape != lay_b.slice_shape for lay_b in dst]
                         for lay_a in src]) if a_shape != b_shape else None
    differ = reshaped if reshaped is not None else np.zeros(missing.shape, dtype=bool)
    if a_shape == b_shape:
        geo_missing, geo_differ = _geometry(src, dst, devices)
        missing, differ = np.maximum(missing, geo_missing), differ | geo_differ
    else:  # compare where one side has an equal layout on the other's shape
        to_b = [(i, m) for i, m in enumerate(map_layout(lay, b_shape) for lay in src)
                if m is not None]
        rows = [i for i, _ in to_b]
        if rows:
            gm, gd = _geometry([m for _, m in to_b], dst, devices)
            missing[rows] = np.maximum(missing[rows], gm)
            differ[rows] |= gd
        to_a = [(j, m) for j, m in enumerate(map_layout(lay, a_shape) for lay in dst)
                if m is not None]
        cols = [j for j, _ in to_a]
        if cols:
            gm, gd = _geometry(src, [m for _, m in to_a], devices)
            missing[:, cols] = np.maximum(missing[:, cols], gm)
            differ[:, cols] |= gd
    first = np.where(missing > 0, total / union, 0.0)
    fwd = np.maximum(0.5 * missing, first) * itemsize
    bwd = np.maximum(0.5 * missing / max(1, devices - 1), 0.5 * first) * itemsize
    comp = np.where(differ | (missing > 0), src_elems[:, None] * itemsize, 0.0)
    comm = practical_lower_array(fwd, c)
    if c.training:
        comm = comm + practical_lower_array(bwd, c)
    out = c.alpha * comp + c.beta * comm
    if is_bool:
        out = np.where(missing > 0, inf, out)
    return out


def _geometry(src: Sequence[TensorLayout], dst: Sequence[TensorLayout], devices: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """For layouts of one shape: the largest number of elements a sampled rank misses, and
    whether some sampled rank's slice differs."""
    ranks = sample_ranks(list(src) + list(dst), devices)
    ndim = len(dst[0].shape)
    slo, shi = _boxes(src, ranks, ndim)
    dlo, dhi = _boxes(dst, ranks, ndim)
    dvol = np.prod(dhi - dlo, axis=-1)  # [dst, rank]
    missing = np.zeros((len(src), len(dst)), dtype=np.float64)
    differ = np.zeros((len(src), len(dst)), dtype=bool)
    step = max(1, (1 << 21) // max(1, len(dst) * len(ranks) * max(ndim, 1)))
    for a in range(0, len(src), step):
        b = min(len(src), a + step)
        lo = np.maximum(slo[a:b, None], dlo[None])  # [src, dst, rank, dim]
        hi = np.minimum(shi[a:b, None], dhi[None])
        overlap = np.prod(np.clip(hi - lo, 0, None), axis=-1)
        missing[a:b] = (dvol[None] - overlap).max(axis=-1)
        differ[a:b] = ((slo[a:b, None] != dlo[None]) | (shi[a:b, None] != dhi[None])).any(
            axis=(-1, -2))
    return missing, differ
