"""The lower bounds dynamic programming starts its edge tables from (`passes/search/bounds.py`)
never exceed the cost of the plan the redistribution planner builds, for random layout pairs
of one shape and through a reshape, under training and inference objectives, for any cost
model constants; and the lazy tables give the same plan as planning every pair."""

from __future__ import annotations

import os
from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcompile.ir.layout import TensorLayout as L
from pcompile.passes.search import SearchOptions
from pcompile.passes.search.bounds import lower_bound_matrix, practical_lower
from pcompile.passes.search.cost_graph import CostGraph
from pcompile.passes.search.cost_model import CostConstants, practical, redistribution_cost
from pcompile.passes.search.dynamic_programming import solve
from tests import ROOT
from tests.passes.test_redistribution import layout_pairs

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))

constants = st.builds(
    CostConstants,
    alpha=st.sampled_from([1.0, 0.5, 3.0]),
    beta=st.sampled_from([400.0, 50.0, 1.0]),
    communi_threshold=st.sampled_from([2048.0, 100.0]),
    communi_const=st.sampled_from([3072.0, 10.0, 5000.0]),
    communi_bias=st.sampled_from([1024.0, 0.0, -50.0]),
    training=st.booleans(),
)


def exact(src: L, dst: L, itemsize: int, is_bool: bool, c: CostConstants) -> float:
    if src == dst:
        return 0.0
    return redistribution_cost(src, dst, itemsize, is_bool, c).objective(c)


def check_bounds(sources: list[L], targets: list[L], c: CostConstants, is_bool: bool) -> None:
    devices = sources[0].device_num
    itemsize = 1 if is_bool else 4
    lb = lower_bound_matrix(sources, targets, itemsize, is_bool, devices, c)
    for i, a in enumerate(sources):
        for j, b in enumerate(targets):
            true = exact(a, b, itemsize, is_bool, c)
            assert lb[i, j] <= true * (1 + 1e-12) + 1e-9, (a, b, lb[i, j], true)


@pytest.mark.parametrize("volume", [0.0, 1e-9, 1.0, 2047.0, 2048.0, 2049.0, 1e6])
def test_practical_lower_is_the_infimum_above(volume: float) -> None:
    for c in (CostConstants(), CostConstants(communi_const=10.0),
              CostConstants(communi_bias=-50.0)):
        above = [volume * f + d for f in (1.0, 1.5, 3.0) for d in (0.0, 1e-6, 1.0, 5000.0)]
        assert practical_lower(volume, c) <= min(practical(v, c) for v in above)


@SETTINGS
@given(st.lists(layout_pairs(), min_size=1, max_size=3), constants, st.booleans())
def test_bounds_hold_for_layouts_of_one_shape(pairs, c, is_bool) -> None:
    shape = pairs[0][0].shape
    devices = pairs[0][0].device_num
    same = [p for p in pairs if p[0].shape == shape and p[0].device_num == devices]
    check_bounds([p[0] for p in same], [p[1] for p in same], c, is_bool)


@SETTINGS
@given(layout_pairs(), st.sampled_from([(2, 3), (6,), (3, 2), (1,), (2, 2), (4,)]),
       st.randoms(), constants)
def test_bounds_hold_through_a_reshape(pair, new_tail, rnd, c) -> None:
    src, dst = pair
    total = prod(dst.shape)
    tail = prod(new_tail)
    if total % tail:
        return
    new_shape = (total // tail, *new_tail)
    targets = []
    for dev in (dst.dev_matrix, src.dev_matrix):
        for _ in range(10):
            tmap = tuple(rnd.choice([-1, *range(len(dev))]) for _ in new_shape)
            used = [v for v in tmap if v != -1]
            if len(used) != len(set(used)):
                continue
            try:
                targets.append(L(dev, tmap, new_shape))
            except ValueError:
                continue
    targets.append(L(dst.dev_matrix, (-1,) * len(new_shape), new_shape))
    check_bounds([src, dst], targets, c, False)
    check_bounds(targets, [src, dst], c, False)


# ~10 s each: the slow step (the bounds themselves are checked fast above)
@pytest.mark.slow
@pytest.mark.parametrize("dataset,batch", [("full_batch", "8"), ("data_parallel", "16")])
def test_lazy_tables_plan_like_full_tables_on_the_gpt_example(dataset, batch,
                                                              monkeypatch) -> None:
    """16 devices, one GPT layer: starting every table from bounds gives the plan that
    planning all ~20k layout pairs gives."""
    from pcompile.compiler.driver.trace_model import trace_model
    from pcompile.compiler.frontend.model_file import load_model_file

    monkeypatch.setenv("GPT_LAYERS", "1")
    monkeypatch.setenv("GPT_BATCH", batch)
    graph = trace_model(load_model_file(os.path.join(ROOT, "examples", "gpt_block.py"))).graph
    lazy = CostGraph(graph, 16, CostConstants(), dataset)
    full = CostGraph(graph, 16, CostConstants(), dataset)
    a = solve(lazy, SearchOptions(exact_edge_classes=0))
    b = solve(full, SearchOptions(exact_edge_classes=1 << 40))
    assert lazy.total(a.choice) == pytest.approx(full.total(b.choice), rel=1e-12)
    assert np.isfinite(lazy.total(a.choice))
    assert len(lazy._pair) < len(full._pair) / 4  # planned far fewer pairs
