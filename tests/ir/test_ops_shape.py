"""Shape primitives against JAX written directly: forward, gradients, error messages."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType, TupleType
from pcompile.passes.autodiff import append_gradients
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=4)
NONSCALAR = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4)
EXAMPLES = settings(max_examples=20, deadline=None)


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# -- Reshape / Transpose / ExpandDims / Squeeze / Flatten -----------------------------------


@st.composite
def _reshape_case(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An input shape and a target of the same size: its dims shuffled, some adjacent ones
    merged, maybe one replaced by -1."""
    shape = draw(SHAPES)
    dims = list(draw(st.permutations(shape)))
    merged: list[int] = []
    for d in dims:
        if merged and draw(st.booleans()):
            merged[-1] *= d
        else:
            merged.append(d)
    if merged and draw(st.booleans()):
        merged[draw(st.integers(0, len(merged) - 1))] = -1
    return shape, tuple(merged)


@EXAMPLES
@given(_reshape_case(), SEEDS)
def test_reshape(case: tuple[tuple[int, ...], tuple[int, ...]], seed: int) -> None:
    shape, target = case
    check_op("Reshape", [_rand(shape, seed)], {"shape": target}, lambda x: jnp.reshape(x, target))


@st.composite
def _perm_case(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = draw(SHAPES)
    perm = draw(st.permutations(range(len(shape))))
    signs = draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    return shape, tuple(p - len(shape) if neg else p for p, neg in zip(perm, signs))


@EXAMPLES
@given(_perm_case(), SEEDS)
def test_transpose(case: tuple[tuple[int, ...], tuple[int, ...]], seed: int) -> None:
    shape, perm = case
    check_op("Transpose", [_rand(shape, seed)], {"perm": perm}, lambda x: jnp.transpose(x, perm))


@EXAMPLES
@given(SHAPES, st.data(), SEEDS)
def test_expand_dims(shape: tuple[int, ...], data: Any, seed: int) -> None:
    r = len(shape)
    axis = data.draw(st.integers(-r - 1, r))
    check_op("ExpandDims", [_rand(shape, seed)], {"axis": axis}, lambda x: jnp.expand_dims(x, axis))


@EXAMPLES
@given(hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=2), st.data(), SEEDS)
def test_squeeze(shape: tuple[int, ...], data: Any, seed: int) -> None:
    ones = [i for i, d in enumerate(shape) if d == 1]
    chosen = data.draw(st.lists(st.sampled_from(ones), unique=True) if ones else st.just([]))
    axis = tuple(a - len(shape) if data.draw(st.booleans()) else a for a in chosen)
    check_op(
        "Squeeze",
        [_rand(shape, seed)],
        {"axis": axis},
        lambda x: jnp.squeeze(x, axis if axis else None),
    )


def test_squeeze_int_axis() -> None:
    """MindSpore also accepts a single int axis."""
    x = _rand((2, 1, 3), 0)
    check_op("Squeeze", [x], {"axis": -2}, lambda x: jnp.squeeze(x, 1))


@EXAMPLES
@given(NONSCALAR, SEEDS)
def test_flatten(shape: tuple[int, ...], seed: int) -> None:
    check_op("Flatten", [_rand(shape, seed)], {}, lambda x: jnp.reshape(x, (x.shape[0], -1)))


# -- Concat / Split / tuples ----------------------------------------------------------------


@EXAMPLES
@given(NONSCALAR, st.data(), SEEDS)
def test_concat(shape: tuple[int, ...], data: Any, seed: int) -> None:
    r = len(shape)
    axis = data.draw(st.integers(-r, r - 1))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    xs = []
    for i, size in enumerate(sizes):
        s = list(shape)
        s[axis] = size
        xs.append(_rand(tuple(s), seed + i))
    check_op("Concat", xs, {"axis": axis}, lambda *a: jnp.concatenate(a, axis))


@EXAMPLES
@given(NONSCALAR, st.data(), SEEDS)
def test_split(shape: tuple[int, ...], data: Any, seed: int) -> None:
    r = len(shape)
    axis = data.draw(st.integers(-r, r - 1))
    dim = shape[axis]
    num = data.draw(st.sampled_from([k for k in range(1, dim + 1) if dim % k == 0]))
    check_op(
        "Split",
        [_rand(shape, seed)],
        {"axis": axis, "output_num": num},
        lambda x: tuple(jnp.split(x, num, axis)),
    )


def _graph(*specs: tuple[tuple[int, ...], DType]) -> tuple[Graph, list[GraphParam]]:
    graph = Graph("t")
    params = [
        graph.add_param(GraphParam(TensorType(dtype, s), f"x{i}", "weight", dtype.is_float))
        for i, (s, dtype) in enumerate(specs)
    ]
    return graph, params


def test_split_partial_use_gradient() -> None:
    """Only one piece reaches the output: the other pieces' cotangents are zeros."""
    graph, (p,) = _graph(((6, 4), DType.float32))
    b = Builder(graph)
    pieces = b("Split", p, axis=0, output_num=3)
    mid = b("TupleGetItem", pieces, index=1)
    seed = np.arange(8, dtype=np.float32).reshape(2, 4)
    (grad,) = append_gradients(graph, [mid], [p], [b.const(seed)])
    graph.outputs = [grad]
    (got,) = run_graph(graph, [_rand((6, 4), 0)])
    want = np.zeros((6, 4), np.float32)
    want[2:4] = seed
    np.testing.assert_array_equal(got, want)


@EXAMPLES
@given(st.lists(SHAPES, min_size=1, max_size=3), SEEDS)
def test_make_tuple(shapes: list[tuple[int, ...]], seed: int) -> None:
    xs = [_rand(s, seed + i) for i, s in enumerate(shapes)]
    check_op("MakeTuple", xs, {}, lambda *a: tuple(a))


def test_tuple_get_item_negative_index() -> None:
    graph, (x, y) = _graph(((2,), DType.float32), ((3,), DType.float32))
    b = Builder(graph)
    t = b("MakeTuple", x, y)
    assert isinstance(t.type, TupleType)
    last = b("TupleGetItem", t, index=-1)
    assert last.shape == (3,)
    graph.outputs = [last]
    (got,) = run_graph(graph, [np.zeros(2, np.float32), np.arange(3, dtype=np.float32)])
    np.testing.assert_array_equal(got, np.arange(3))


# -- StridedSlice ---------------------------------------------------------------------------


@st.composite
def _slice_case(draw: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    """Bounds that may be negative, past the ends (clamped) or empty; strides -3..3 but 0 (a
    negative one reverses); sometimes fewer entries than the rank (the rest taken whole)."""
    shape = draw(NONSCALAR)
    n = draw(st.integers(1, len(shape))) if draw(st.booleans()) else len(shape)
    begin = tuple(draw(st.integers(-d - 2, d + 2)) for d in shape[:n])
    end = tuple(draw(st.integers(-d - 2, d + 2)) for d in shape[:n])
    strides = tuple(draw(st.sampled_from([-3, -2, -1, 1, 2, 3])) for _ in range(n))
    return shape, {"begin": begin, "end": end, "strides": strides}


def _py_slices(attrs: dict[str, Any]) -> tuple[slice, ...]:
    return tuple(slice(*bes) for bes in zip(attrs["begin"], attrs["end"], attrs["strides"]))


@settings(max_examples=25, deadline=None)
@given(_slice_case(), SEEDS)
def test_strided_slice(case: tuple[tuple[int, ...], dict[str, Any]], seed: int) -> None:
    shape, attrs = case
    slices = _py_slices(attrs)
    check_op("StridedSlice", [_rand(shape, seed)], attrs, lambda x: x[slices])


@EXAMPLES
@given(_slice_case(), SEEDS)
def test_strided_slice_grad(case: tuple[tuple[int, ...], dict[str, Any]], seed: int) -> None:
    shape, attrs = case
    slices = _py_slices(attrs)
    out_shape = np.zeros(shape)[slices].shape
    check_op(
        "StridedSliceGrad",
        [_rand(out_shape, seed)],
        {"shape": shape, **attrs},
        lambda dy: jnp.zeros(shape, dy.dtype).at[slices].set(dy),
    )


# -- Gather ---------------------------------------------------------------------------------


@st.composite
def _gather_case(draw: Any) -> tuple[tuple[int, ...], int, np.ndarray]:
    shape = draw(NONSCALAR)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    idx_shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=4))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    dim = shape[axis]
    # Repeated indices exercise the scatter-add; negatives wrap as in numpy/jnp.take.
    indices = draw(hnp.arrays(dtype, idx_shape, elements=st.integers(-dim, dim - 1)))
    return shape, axis, indices


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@settings(max_examples=25, deadline=None)
@given(_gather_case(), SEEDS)
def test_gather(case: tuple[tuple[int, ...], int, np.ndarray], seed: int) -> None:
    shape, axis, indices = case
    check_op(
        "Gather",
        [_rand(shape, seed), indices],
        {"axis": axis},
        lambda p, i: jnp.take(p, i, axis=axis),
    )


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@EXAMPLES
@given(_gather_case(), SEEDS)
def test_gather_grad(case: tuple[tuple[int, ...], int, np.ndarray], seed: int) -> None:
    shape, axis, indices = case
    a = axis % len(shape)
    dy_shape = shape[:a] + indices.shape + shape[a + 1 :]
    index = (slice(None),) * a

    def ref(dy: Any, i: Any) -> Any:
        return jnp.zeros(shape, dy.dtype).at[index + (i,)].add(dy)

    check_op("GatherGrad", [_rand(dy_shape, seed), indices], {"shape": shape, "axis": axis}, ref)


#: Repeated and negative indices along the first axis; one scalar index along the last.
GATHER_CASES = [((4, 3), 0, np.array([[3, -1], [0, 3]], np.int32)),
                ((2, 3, 4), -1, np.array(2, np.int64))]


@pytest.mark.parametrize("case", GATHER_CASES, ids=["repeated-negative", "scalar-index"])
def test_gather_fixed_cases(case: tuple[tuple[int, ...], int, np.ndarray]) -> None:
    test_gather.hypothesis.inner_test(case, 5)
    test_gather_grad.hypothesis.inner_test(case, 6)


# -- OneHot ---------------------------------------------------------------------------------


@EXAMPLES
@given(
    hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4),
    st.integers(1, 5),
    st.sampled_from([np.int32, np.int64]),
    st.sampled_from([DType.float32, DType.int32]),
    st.data(),
)
def test_one_hot(
    shape: tuple[int, ...], depth: int, idx_dtype: Any, dtype: DType, data: Any
) -> None:
    r = len(shape)
    axis = data.draw(st.integers(-r - 1, r))
    on, off = data.draw(st.sampled_from([(1.0, 0.0), (2.0, -1.0), (0.5, 0.25)]))
    if dtype is DType.int32:
        on, off = float(int(on)), float(int(off))
    # Out-of-range and negative indices give an all-off_value row, as in jax.nn.one_hot.
    indices = data.draw(hnp.arrays(idx_dtype, shape, elements=st.integers(-2, depth + 1)))

    def ref(i: Any) -> Any:
        hot = jax.nn.one_hot(i, depth, axis=axis, dtype=jnp.float32)
        return (hot * (on - off) + off).astype(dtype.np)

    attrs = {"depth": depth, "on_value": on, "off_value": off, "axis": axis, "dtype": dtype}
    check_op("OneHot", [indices], attrs, ref, grad=False)


# -- errors ---------------------------------------------------------------------------------


def _emit(
    op: str, shapes: list[tuple[int, ...]], dtypes: list[DType] | None = None, **attrs: Any
) -> Any:
    graph, params = _graph(*zip(shapes, dtypes or [DType.float32] * len(shapes)))
    return Builder(graph).emit(op, list(params), attrs)


@pytest.mark.parametrize(
    ("op", "shapes", "dtypes", "attrs", "pattern"),
    [
        (
            "Reshape",
            [(2, 3)],
            None,
            {"shape": (4, 2)},
            r"cannot reshape 6 elements to \(4, 2\) \(8 elements\)",
        ),
        (
            "Reshape",
            [(2, 3)],
            None,
            {"shape": (4, -1)},
            r"cannot infer the -1 in \(4, -1\): 6 elements are not a multiple of .* 4",
        ),
        ("Reshape", [(2, 3)], None, {"shape": (-1, -1)}, "more than one -1"),
        ("Reshape", [(2, 3)], None, {"shape": [3, 2]}, r"tuple of Python ints.*tuple\(\[3, 2\]\)"),
        ("Reshape", [(2, 3)], None, {}, "attribute shape is required"),
        ("Transpose", [(2, 3)], None, {"perm": (0, 0)}, "not a permutation of the 2 axes"),
        ("Transpose", [(2, 3)], None, {"perm": (0, 1, 2)}, "not a permutation"),
        ("ExpandDims", [(2, 3)], None, {"axis": 3}, r"axis 3 is out of range.*\[-3, 2\]"),
        ("Squeeze", [(2, 1)], None, {"axis": (0,)}, "cannot squeeze axis 0: its size is 2"),
        ("Squeeze", [(2, 1)], None, {"axis": (2,)}, r"axis 2 is out of range.*\[-2, 2\)"),
        ("Flatten", [()], None, {}, "rank >= 1"),
        (
            "Concat",
            [(2, 3), (2, 4)],
            None,
            {"axis": 0},
            "input 1 has size 4 in dim 1 but input 0 has 3",
        ),
        ("Concat", [(2, 3), (2, 3)], None, {"axis": 2}, r"axis 2 is out of range.*\[-2, 2\)"),
        ("Concat", [(2, 3), (2, 3, 1)], None, {"axis": 0}, "input 1 has rank 3"),
        ("Concat", [(2, 3), (2, 3)], [DType.float32, DType.int32], {"axis": 0}, "one dtype"),
        (
            "Split",
            [(6, 5)],
            None,
            {"axis": 1, "output_num": 2},
            r"size 5 cannot be split into 2 equal pieces.*valid: 1, 5",
        ),
        ("Split", [(6, 5)], None, {"axis": -3, "output_num": 2}, "axis -3 is out of range"),
        (
            "StridedSlice",
            [(4, 4)],
            None,
            {"begin": (4, 0), "end": (5, 4), "strides": (1, 1), "shrink_axis_mask": 1},
            r"shrink_axis_mask takes index begin\[0\]=4 of dim 0",
        ),
        (
            "StridedSlice",
            [(4, 4)],
            None,
            {"begin": (0, 0), "end": (4, 4), "strides": (1, 0)},
            r"strides \(1, 0\) cannot contain 0",
        ),
        (
            "StridedSlice",
            [(4,)],
            None,
            {"begin": (0, 0), "end": (4, 4), "strides": (1, 1)},
            "input has rank 1",
        ),
        (
            "StridedSlice",
            [(4, 4)],
            None,
            {"begin": (0,), "end": (4, 4), "strides": (1, 1)},
            "same length",
        ),
        (
            "Gather",
            [(4, 3), (2,)],
            [DType.float32, DType.float32],
            {"axis": 0},
            "indices must be Int32 or Int64, got Float32",
        ),
        (
            "Gather",
            [(4, 3), (2,)],
            [DType.float32, DType.int32],
            {"axis": 2},
            "axis 2 is out of range for rank 2",
        ),
        ("OneHot", [(3,)], [DType.int32], {"depth": 4, "axis": 2}, r"axis 2 is out of range"),
        ("Tile", [(3,)], [DType.float32], {"multiples": (0,)}, "positive ints"),
        ("Tile", [(3,)], [DType.float32], {"multiples": [2]}, r"write \(2,\)"),
        ("Tile", [(3,)], [DType.float32], {}, "needs attribute multiples"),
        ("OneHot", [(3,)], [DType.float32], {"depth": 4}, "indices must be Int32 or Int64"),
        ("OneHot", [(3,)], [DType.int32], {"depth": 4, "dtype": "float32"}, "must be an ir.types"),
    ],
)
def test_invalid(
    op: str,
    shapes: list[tuple[int, ...]],
    dtypes: list[DType] | None,
    attrs: dict[str, Any],
    pattern: str,
) -> None:
    with pytest.raises(OpError, match=pattern) as info:
        _emit(op, shapes, dtypes, **attrs)
    assert str(info.value).startswith(op)


def test_tuple_get_item_errors() -> None:
    graph, (x,) = _graph(((2,), DType.float32))
    b = Builder(graph)
    with pytest.raises(OpError, match="needs a tuple input"):
        b("TupleGetItem", x, index=0)
    t = b("Split", x, axis=0, output_num=2)
    with pytest.raises(OpError, match=r"index 2 is out of range for a tuple of 2"):
        b("TupleGetItem", t, index=2)


def test_strided_slice_grad_shape_mismatch() -> None:
    with pytest.raises(OpError, match=r"dy has shape \(3,\) but slicing \(4,\)"):
        _emit("StridedSliceGrad", [(3,)], shape=(4,), begin=(0,), end=(4,), strides=(2,))


# -- Tile ---------------------------------------------------------------------------------------


@st.composite
def _tile_case(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = draw(SHAPES)
    extra = draw(st.integers(0, 2))
    count = draw(st.integers(max(0, len(shape) - 1), len(shape) + extra))
    return shape, tuple(draw(st.integers(1, 3)) for _ in range(count))


@EXAMPLES
@given(_tile_case(), SEEDS)
def test_tile(case: tuple[tuple[int, ...], tuple[int, ...]], seed: int) -> None:
    """Fewer multiples than dims, more, or as many (numpy's padding with leading 1s)."""
    shape, reps = case
    check_op("Tile", [_rand(shape, seed)], {"multiples": reps}, lambda x: jnp.tile(x, reps))


def test_tile_as_repeat_kv() -> None:
    """mindformers' _repeat_kv: (bs, n_kv, 1, seq * hd) tiled (1, 1, rep, 1)."""
    x = _rand((2, 2, 1, 12), 3)
    check_op("Tile", [x], {"multiples": (1, 1, 3, 1)}, lambda x: jnp.tile(x, (1, 1, 3, 1)))
