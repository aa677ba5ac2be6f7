"""Redistribution planner: the ground-truth op lists of reference §2.6 (golden), and a property
test that executes random plans on every rank with simulated collectives and compares with the
target layout's slices."""

from __future__ import annotations

import json
import os
from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.layout import TensorLayout as L
from pcompile.passes.redistribution import plan_redistribution
from tests import ROOT

GOLDEN = [
    # (from, to, rank-0 ops, rank-5 ops or None when equal to rank 0's)
    (L((8,), (0, -1), (128, 32)), L((8,), (-1, -1), (128, 32)),
     [("AllConcat", tuple(range(8)), 0)], None),
    (L((8,), (-1, 0), (128, 32)), L((8,), (-1, -1), (128, 32)),
     [("AllConcat", tuple(range(8)), 1)], None),
    (L((8,), (-1, -1), (16, 64)), L((8,), (0, -1), (16, 64)),
     [("StridedSlice", (0, 0), (2, 64), (1, 1))],
     [("StridedSlice", (10, 0), (12, 64), (1, 1))]),
    (L((8,), (0, -1), (16, 64)), L((8,), (-1, 0), (16, 64)),
     [("AllConcat", tuple(range(8)), 0), ("StridedSlice", (0, 0), (16, 8), (1, 1))],
     [("AllConcat", tuple(range(8)), 0), ("StridedSlice", (0, 40), (16, 48), (1, 1))]),
    (L((2, 4), (1, -1), (128, 32)), L((4, 2), (1, -1), (128, 32)),
     [("Reshape", (1, 64, 32)), ("StridedSlice", (0, 0, 0), (1, 32, 32), (1, 1, 1)),
      ("Reshape", (32, 32))], None),
    (L((4, 2), (1, -1), (128, 32)), L((8,), (-1, 0), (128, 32)),
     [("Reshape", (32, 4, 8)), ("StridedSlice", (0, 0, 0), (32, 4, 4), (1, 1, 1)),
      ("AllConcat", (0, 2, 4, 6), 0), ("StridedSlice", (0, 0, 0), (128, 1, 4), (1, 1, 1)),
      ("Reshape", (128, 4))],
     [("Reshape", (32, 4, 8)), ("StridedSlice", (0, 0, 4), (32, 4, 8), (1, 1, 1)),
      ("AllConcat", (1, 3, 5, 7), 0), ("StridedSlice", (0, 2, 0), (128, 3, 4), (1, 1, 1)),
      ("Reshape", (128, 4))]),
    (L((2, 4), (-1, 0), (16, 64)), L((2, 4), (0, -1), (16, 64)),
     [("AllConcat", (0, 1, 2, 3), 1), ("StridedSlice", (0, 0), (4, 64), (1, 1))],
     [("AllConcat", (4, 5, 6, 7), 1), ("StridedSlice", (4, 0), (8, 64), (1, 1))]),
    (L((2, 2, 2), (2, 0), (128, 32)), L((2, 2, 2), (0, 2), (128, 32)),
     [("AllConcat", (0, 4), 0), ("AllConcat", (0, 1), 1),
      ("StridedSlice", (0, 0), (64, 32), (1, 1)), ("StridedSlice", (0, 0), (64, 16), (1, 1))],
     [("AllConcat", (1, 5), 0), ("AllConcat", (4, 5), 1),
      ("StridedSlice", (64, 0), (128, 32), (1, 1)), ("StridedSlice", (0, 16), (64, 32), (1, 1))]),
]


@pytest.mark.parametrize("src,dst,rank0,rank5", GOLDEN)
def test_reference_ground_truth(src, dst, rank0, rank5) -> None:
    plan = plan_redistribution(src, dst)
    assert plan.ops_for_rank(0) == rank0
    assert plan.ops_for_rank(5) == (rank5 if rank5 is not None else rank0)
    assert_executes(src, dst)


def local_slice(full: np.ndarray, layout: L, rank: int) -> np.ndarray:
    return full[tuple(slice(b, e) for b, e in layout.slice_bounds(rank))]


def execute(src: L, dst: L, full: np.ndarray, alltoall: bool = False) -> list[np.ndarray]:
    """Run the plan on every rank in lockstep with simulated collectives."""
    plan = plan_redistribution(src, dst, enable_alltoall=alltoall)
    n = src.device_num
    values = [local_slice(full, src, r) for r in range(n)]
    per_rank = [plan.ops_for_rank(r) for r in range(n)]
    for step in range(len(plan.ops)):
        new = []
        for r in range(n):
            op = per_rank[r][step]
            x = values[r]
            if op[0] == "Reshape":
                new.append(x.reshape(op[1]))
            elif op[0] == "StridedSlice":
                new.append(x[tuple(slice(b, e, s) for b, e, s in zip(*op[1:]))])
            elif op[0] == "AllConcat":
                new.append(np.concatenate([values[g] for g in op[1]], axis=op[2]))
            else:
                _, group, split_dim, concat_dim, count = op
                me = group.index(r)
                parts = [np.split(values[g], count, axis=split_dim)[me] for g in group]
                new.append(np.concatenate(parts, axis=concat_dim))
        values = new
    return values


def assert_executes(src: L, dst: L, alltoall: bool = False) -> None:
    full = np.arange(prod(src.shape), dtype=np.int64).reshape(src.shape)
    target = full.reshape(dst.shape)
    got = execute(src, dst, full, alltoall)
    for r in range(src.device_num):
        np.testing.assert_array_equal(got[r], local_slice(target, dst, r), err_msg=f"rank {r}")


def factorizations(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Ordered factorizations of n into factors > 1 (n == 1 gives (1,))."""
    if n == 1:
        return st.just((1,))
    divisors = [d for d in range(2, n + 1) if n % d == 0]
    return st.sampled_from(divisors).flatmap(
        lambda d: (factorizations(n // d) if n // d > 1 else st.just(()))
        .map(lambda rest, d=d: (d,) + tuple(x for x in rest if x != 1))
    )


@st.composite
def layout_on(draw, shape_seed: tuple[int, ...], dev: tuple[int, ...]) -> L:
    """A random valid layout of a tensor of rank len(shape_seed) on `dev` (shape built to fit)."""
    rank = len(shape_seed)
    axes = list(range(len(dev)))
    draw(st.randoms()).shuffle(axes)
    entries: list[list[int]] = [[] for _ in range(rank)]
    for a in axes:
        where = draw(st.integers(-1, rank - 1))
        if where >= 0:
            entries[where].append(len(dev) - 1 - a)
    tmap = tuple(tuple(e) if len(e) > 1 else (e[0] if e else -1) for e in entries)
    shape = []
    for d, e in enumerate(entries):
        split = prod(dev[len(dev) - 1 - v] for v in e)
        shape.append(split * shape_seed[d])
    return L(dev, tmap, tuple(shape))


@st.composite
def layout_pairs(draw):
    n = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16]))
    rank = draw(st.integers(1, 3))
    dev_a = draw(factorizations(n))
    dev_b = draw(factorizations(n))
    a = draw(layout_on(tuple(1 for _ in range(rank)), dev_a))
    b = draw(layout_on(tuple(1 for _ in range(rank)), dev_b))
    # One global shape both layouts divide: the lcm of their split requirements per dim.
    shape = tuple(int(np.lcm(x, y)) * draw(st.sampled_from([1, 2, 3]))
                  for x, y in zip(a.shape, b.shape))
    return L(a.dev_matrix, a.tensor_map, shape), L(b.dev_matrix, b.tensor_map, shape)


@settings(max_examples=150, deadline=None)
@given(layout_pairs(), st.booleans())
def test_random_redistributions_execute_exactly(pair, alltoall) -> None:
    src, dst = pair
    assert_executes(src, dst, alltoall)


@settings(max_examples=150, deadline=None)
@given(layout_pairs(), st.sampled_from([(2, 3), (6,), (3, 2), (1,), (2, 2), (4,)]),
       st.randoms(), st.booleans())
def test_reshape_redistributions_execute_exactly(pair, new_tail, rnd, alltoall) -> None:
    """Layouts of different shapes with the same element count (how Reshape is planned)."""
    src, dst = pair
    total = prod(dst.shape)
    tail = prod(new_tail)
    if total % tail:
        return
    new_shape = (total // tail, *new_tail)
    dev = dst.dev_matrix
    for _ in range(20):  # a random layout of the new shape that divides it
        tmap = tuple(rnd.choice([-1, *range(len(dev))]) for _ in new_shape)
        used = [v for v in tmap if v != -1]
        if len(used) != len(set(used)):
            continue
        try:
            target = L(dev, tmap, new_shape)
        except ValueError:
            continue
        assert_executes(src, target, alltoall)
        assert_executes(target, src, alltoall)
        return
    assert_executes(src, L(dev, (-1,) * len(new_shape), new_shape), alltoall)


def test_identity_plan_is_empty() -> None:
    a = L((2, 4), (1, -1), (8, 8))
    b = L((2, 4, 1), (2, -1), (8, 8))  # the same layout with a size-1 axis
    assert plan_redistribution(a, b).is_identity


def test_cost_of_gather_matches_reference_formula() -> None:
    plan = plan_redistribution(L((8,), (0, -1), (128, 32)), L((8,), (-1, -1), (128, 32)))
    cost = plan.cost(itemsize=4)
    size = 16 * 32
    assert cost.forward_comm == size * 8 * 0.5 * 4
    assert cost.backward_comm == size * 0.5 * 4
    assert cost.comm == size * 9 * 0.5 * 4


# -- MindSpore's solver on recorded random pairs -------------------------------------------------

RECORDED = os.path.join(ROOT, "tests", "data",
                        "mindspore_redistribution.json")


def as_mindspore(ops: list[tuple]) -> list[list]:
    """Our concrete op list in the form `_transform_tensor_by_layout` returns."""
    out: list[list] = []
    for op in ops:
        if op[0] == "AllConcat":
            out.append(["AllConcat", [*op[1], op[2]]])
        elif op[0] == "StridedSlice":
            out.append(["StridedSlice", [*op[1], *op[2], *op[3]]])
        else:
            out.append([op[0], list(op[1])])
    return out


def without_noop_reshapes(ops: list[list], start: list[int]) -> list[list]:
    """MindSpore's list with consecutive Reshapes merged and Reshapes to the shape the tensor
    already has dropped (pcompile drops them: they do nothing)."""
    shape, merged = list(start), []
    for name, args in ops:
        before = list(shape)
        if name == "Reshape":
            shape = list(args)
            if merged and merged[-1][0] == "Reshape":
                merged[-1] = ["Reshape", list(shape), merged[-1][2]]
                continue
            merged.append(["Reshape", list(shape), before])
            continue
        if name == "StridedSlice":
            n = len(args) // 3
            shape = [e - b for b, e in zip(args[:n], args[n:2 * n])]
        elif name == "AllConcat":
            shape[args[-1]] *= len(args) - 1
        merged.append([name, args])
    return [op[:2] for op in merged if not (op[0] == "Reshape" and op[1] == op[2])]


def test_mindspore_recorded_op_lists() -> None:
    """400 random pairs on 8, 16 and 64 devices, recorded from MindSpore 2.10's solver
    (tests/data/record_mindspore_redistribution.py): the same op list, op for op and rank for
    rank (the order of independent gathers and slices included: it follows the slot order of
    MindSpore's hash map, passes/redistribution_order.py), except for Reshapes that do
    nothing, which pcompile drops."""
    with open(RECORDED) as f:
        cases = json.load(f)["cases"]
    assert len(cases) == 400
    dropped = 0
    for case in cases:
        src, dst = (L(tuple(c[0]), tuple(c[1]), tuple(c[2])) for c in (case["from"], case["to"]))
        plan = plan_redistribution(src, dst)
        for rank, want in case["ops"].items():
            expected = without_noop_reshapes(want, list(src.slice_shape))
            dropped += expected != want
            assert as_mindspore(plan.ops_for_rank(int(rank))) == expected, (case, rank)
    assert dropped <= 4  # the few pairs where MindSpore reshapes to the same shape


def test_noop_reshape_pairs_are_dropped() -> None:
    """Two replicated layouts on different device matrices: MindSpore emits Reshape [1] then
    Reshape [1, 1] (recorded); that does nothing and costs computation, so the plan is empty."""
    src, dst = L((2, 2, 2), (-1, -1), (1, 1)), L((8,), (-1, -1), (1, 1))
    plan = plan_redistribution(src, dst)
    assert plan.ops == [] and plan.cost().computation == 0
    assert without_noop_reshapes([["Reshape", [1]], ["Reshape", [1, 1]]], [1, 1]) == []
