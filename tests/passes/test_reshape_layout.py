"""Layouts through a Reshape (passes/reshape_layout.py): whatever `map_layout` returns holds, on
every rank, the same elements in the same order as the input layout (checked by slicing an
index array), and a device axis shared by two output dims is refined instead of gathered."""

from __future__ import annotations

from math import prod

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.layout import TensorLayout
from pcompile.passes.reshape_layout import map_layout, refine


def _local(layout: TensorLayout, array: np.ndarray, rank: int) -> np.ndarray:
    return array[tuple(slice(a, b) for a, b in layout.slice_bounds(rank))]


def _same_elements(a: TensorLayout, b: TensorLayout) -> bool:
    index = np.arange(prod(a.shape)).reshape(a.shape)
    devices = prod(a.dev_matrix)
    assert prod(b.dev_matrix) == devices
    return all(np.array_equal(_local(a, index, r).ravel(),
                              _local(b, index.reshape(b.shape), r).ravel())
               for r in range(devices))


def test_an_axis_shared_by_two_dims_is_refined() -> None:
    """[256, 4096] with the tokens over an axis of 4 -> [2, 128, 4096]: 2 ways on the batch and
    2 on the sequence (the axis of 4 cut into 2 x 2), where the Reshape used to gather."""
    tokens = TensorLayout((4, 2, 1), (2, -1), (256, 4096))
    assert refine(tokens, (2, 128, 4096)) == TensorLayout((2, 2, 2, 1), ((3, 2), -1),
                                                          (256, 4096))
    mapped = map_layout(tokens, (2, 128, 4096))
    assert mapped == TensorLayout((2, 2, 2, 1), (3, 2, -1), (2, 128, 4096))
    assert _same_elements(tokens, mapped)
    # and back: the two dims merge into one over the refined axes
    back = map_layout(mapped, (256, 4096))
    assert back is not None and _same_elements(mapped, back)
    # nothing to refine: the layout itself
    rows = TensorLayout((8,), (0, -1), (128, 32))
    assert refine(rows, (8, 16, 32)) is rows
    # an axis of 4 over a dim of 6 cannot be cut to fit
    assert map_layout(TensorLayout((4,), (0,), (24,)), (6, 4)) is None


@st.composite
def layouts_and_shapes(draw: st.DrawFn) -> tuple[TensorLayout, tuple[int, ...]]:
    dev = tuple(draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=3)))
    rank = draw(st.integers(1, 3))
    tmap: list[int | tuple[int, ...]] = [-1] * rank
    for v in range(len(dev)):
        d = draw(st.integers(-1, rank - 1))
        if d >= 0:
            e = tmap[d]
            tmap[d] = v if e == -1 else (*(e if isinstance(e, tuple) else (e,)), v)
    splits = [prod(dev[len(dev) - 1 - v] for v in (e if isinstance(e, tuple) else (e,)))
              if e != -1 else 1 for e in tmap]
    shape = tuple(s * draw(st.sampled_from([1, 2, 3, 4])) for s in splits)
    # a target shape: the product cut into factors in a random order
    total = prod(shape)
    factors = []
    while total > 1:
        f = draw(st.sampled_from([f for f in (2, 3, 4, 6, 8, 16) if total % f == 0] or [total]))
        factors.append(f)
        total //= f
    cut = draw(st.lists(st.booleans(), min_size=len(factors), max_size=len(factors)))
    out: list[int] = []
    for f, new in zip(factors, cut):
        if new or not out:
            out.append(f)
        else:
            out[-1] *= f
    return TensorLayout(dev, tuple(tmap), shape), tuple(out or [1])


@settings(max_examples=300, deadline=None)
@given(layouts_and_shapes())
def test_mapped_layouts_hold_the_same_elements(case: tuple[TensorLayout, tuple[int, ...]]) -> None:
    layout, shape = case
    mapped = map_layout(layout, shape)
    if mapped is not None:
        assert mapped.shape == shape
        assert _same_elements(layout, mapped)
    finer = refine(layout, shape)
    assert _same_elements(layout, finer)
