"""Shape and data-movement primitives: Reshape, Transpose, ExpandDims, Squeeze, Flatten,
Concat, Split, the tuple ops (MakeTuple, TupleGetItem), StridedSlice (+ StridedSliceGrad),
Gather (+ GatherGrad) and OneHot. Semantics and names follow MindSpore, with operands that
MindSpore passes as constant tensors (shapes, slice bounds, on/off values) as attributes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import gcd
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Node, ParallelInfo, Value
from pcompile.ir.dims import DimRule, Fixed, In, Index, Offset, Out, Product, Same, Total
from pcompile.ir.errors import ShapeError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops._define import define
from pcompile.ir.ops._jax import jax, jnp
from pcompile.ir.ops._util import same_dtype, tensor
from pcompile.ir.rank import RankScalar, layout_offsets
from pcompile.ir.registry import ALL, NUMERIC, Trait
from pcompile.ir.sharding import (
    ALPHA,
    Expansion,
    LabelRule,
    Labels,
    LocalLowering,
    OpContext,
    OpSharding,
    Strategy,
    StrategyError,
    fresh_labels,
    label_sharding,
)
from pcompile.ir.types import DType, TensorType, TupleType, ValueType

# -- attribute checks -----------------------------------------------------------------------


def _int_attr(attrs: dict[str, Any], name: str) -> int:
    value = attrs[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ShapeError(f"attribute {name} must be a Python int, got {value!r}")
    return value


def _int_tuple_attr(attrs: dict[str, Any], name: str) -> tuple[int, ...]:
    value = attrs[name]
    if value is None:
        raise ShapeError(f"attribute {name} is required (a tuple of ints)")
    if not isinstance(value, tuple) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ShapeError(
            f"attribute {name} must be a tuple of Python ints, got {value!r}"
            + (f"; pass tuple({value!r})" if isinstance(value, list) else "")
        )
    return value


def _axis(attrs: dict[str, Any], rank: int, name: str = "axis") -> int:
    """`attrs[name]` normalized to [0, rank); negative counts from the end."""
    axis = _int_attr(attrs, name)
    if rank == 0:
        raise ShapeError(f"{name} {axis} is invalid for a rank-0 (scalar) input")
    if not -rank <= axis < rank:
        raise ShapeError(f"{name} {axis} is out of range for rank {rank}; valid: [{-rank}, {rank})")
    return axis % rank


def _reshape_to(b: Builder, value: Value, shape: tuple[int, ...]) -> Value:
    return value if value.shape == shape else b("Reshape", value, shape=shape)


# -- Reshape --------------------------------------------------------------------------------


def _reshape_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    shape = _int_tuple_attr(attrs, "shape")
    if sum(d == -1 for d in shape) > 1:
        raise ShapeError(f"shape {shape} has more than one -1; at most one dim can be inferred")
    if any(d < -1 for d in shape):
        raise ShapeError(f"shape {shape} has a negative dim other than -1")
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if known == 0 or x.size % known:
            raise ShapeError(
                f"cannot infer the -1 in {shape}: {x.size} elements are not a multiple of "
                f"the product {known} of the other dims"
            )
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    elif known != x.size:
        raise ShapeError(
            f"cannot reshape {x.size} elements to {shape} ({known} elements); the product "
            "of the new shape must equal the input size"
        )
    return x.with_shape(shape)


def _reshape_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [_reshape_to(b, cot, node.operands[0].shape)]


def reshape_blocks(src: tuple[int, ...], dst: tuple[int, ...]
                   ) -> list[tuple[list[int], list[int]]]:
    """The dims of `src` and `dst` (size-1 dims left out) grouped into consecutive blocks of
    equal products: (32, 16, 4096) -> (32, 16, 32, 128) is ([0], [0]), ([1], [1]), ([2], [2, 3])."""
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    blocks: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        left, right = [a[i]], [b[j]]
        pl, pr = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pl != pr:
            if pl < pr:
                left.append(a[i])
                pl *= src[a[i]]
                i += 1
            else:
                right.append(b[j])
                pr *= dst[b[j]]
                j += 1
        blocks.append((left, right))
    return blocks


def _reshape_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    for left, right in reshape_blocks(ins[0][0], outs[0]):
        yield Product(tuple(In(0, d) for d in left), tuple(Out(d) for d in right))


def _new_shape(attrs: dict[str, Any], old_in: Any, old_out: Any, new_in: Any,
               new_out: Any) -> dict[str, Any]:
    return {**attrs, "shape": tuple(new_out[0])}


define("Reshape", _reshape_infer, lambda x, shape: np.reshape(x, shape),
       lambda x, shape: jnp.reshape(x, shape), vjp=_reshape_vjp, attrs={"shape": None},
       num_inputs=1, traits=frozenset({Trait.NO_STRATEGY}),
       doc="x with a new shape of the same size; one dim may be -1 (inferred).", section="shape",
       operands="x; `shape` (one -1)", dtypes=ALL,
       rule="no strategy: its output takes the layout its consumer wants",
       tests=("test_ops_shape.py::test_reshape",
              "test_redistribution.py::test_reshape_redistributions_execute_exactly"),
       dims=DimRule(_reshape_dims, rewrite=_new_shape, preserves_values=True))

# -- Transpose ------------------------------------------------------------------------------


def _perm(attrs: dict[str, Any], rank: int) -> tuple[int, ...]:
    perm = _int_tuple_attr(attrs, "perm")
    if len(perm) == rank and all(-rank <= p < rank for p in perm):
        normalized = tuple(p % rank for p in perm)
        if sorted(normalized) == list(range(rank)):
            return normalized
    raise ShapeError(
        f"perm {perm} is not a permutation of the {rank} axes; valid: an ordering of "
        f"{tuple(range(rank))} (negative axes allowed)"
    )


def _transpose_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    perm = _perm(attrs, x.rank)
    return x.with_shape(tuple(x.shape[p] for p in perm))


def _transpose_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    perm = _perm(node.attrs, cot.tensor_type.rank)
    inverse = tuple(int(i) for i in np.argsort(perm))
    return [b("Transpose", cot, perm=inverse)]


def transpose_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = ALPHA[:rank]
    perm = [p % rank for p in ctx.attrs["perm"]]
    return Labels([lab], ["".join(lab[p] for p in perm)])


def _transpose_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    for d, p in enumerate(attrs["perm"]):
        yield Same(In(0, p), Out(d))


define("Transpose", _transpose_infer, lambda x, perm: np.transpose(x, perm),
       lambda x, perm: jnp.transpose(x, perm), vjp=_transpose_vjp, attrs={"perm": None},
       num_inputs=1, sharding=LabelRule(transpose_labels),
       doc="Permute the axes of x: output dim i is input dim perm[i].", section="shape",
       operands="x; `perm`", dtypes=ALL, rule="dims follow the permutation",
       tests=("test_ops_shape.py::test_transpose",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       dims=DimRule(_transpose_dims, preserves_values=True))

# -- ExpandDims -----------------------------------------------------------------------------


def _expand_axis(attrs: dict[str, Any], rank: int) -> int:
    axis = _int_attr(attrs, "axis")
    if not -rank - 1 <= axis <= rank:
        raise ShapeError(
            f"axis {axis} is out of range for inserting into rank {rank}; "
            f"valid: [{-rank - 1}, {rank}]"
        )
    return axis % (rank + 1)


def _expand_dims_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    axis = _expand_axis(attrs, x.rank)
    return x.with_shape(x.shape[:axis] + (1,) + x.shape[axis:])


def _shape_restoring_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [_reshape_to(b, cot, node.operands[0].shape)]


def expand_dims_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = ALPHA[:rank]
    axis = ctx.attrs["axis"] % (rank + 1)
    fresh = fresh_labels(1, set(lab))[0]
    return Labels([lab], [lab[:axis] + fresh + lab[axis:]], {fresh})


def _pair_non_unit(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """Ops that only add or drop size-1 dims: the other dims pair up in order."""
    a = [d for d, n in enumerate(ins[0][0]) if n != 1]
    b = [d for d, n in enumerate(outs[0]) if n != 1]
    for d, e in zip(a, b):
        yield Same(In(0, d), Out(e))


define("ExpandDims", _expand_dims_infer, lambda x, axis: np.expand_dims(x, axis),
       lambda x, axis: jnp.expand_dims(x, axis), vjp=_shape_restoring_vjp, attrs={"axis": 0},
       num_inputs=1, sharding=LabelRule(expand_dims_labels),
       doc="Insert a size-1 dim at axis (negative: counted from the end of the output).",
       section="shape", operands="x; `axis`", dtypes=ALL, rule="the new dim never splits",
       tests=("test_ops_shape.py::test_expand_dims",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       dims=DimRule(_pair_non_unit, preserves_values=True))

# -- Squeeze --------------------------------------------------------------------------------


def _squeeze_axes(x: TensorType, attrs: dict[str, Any]) -> tuple[int, ...]:
    raw = attrs["axis"]
    # MindSpore also accepts a single int.
    given: tuple[int, ...]
    if isinstance(raw, int) and not isinstance(raw, bool):
        given = (raw,)
    else:
        given = _int_tuple_attr(attrs, "axis")
    if not given:
        return tuple(i for i, d in enumerate(x.shape) if d == 1)
    axes: list[int] = []
    for a in given:
        if not -x.rank <= a < x.rank:
            raise ShapeError(
                f"axis {a} is out of range for rank {x.rank}; valid: [{-x.rank}, {x.rank})"
            )
        a %= x.rank
        if x.shape[a] != 1:
            raise ShapeError(f"cannot squeeze axis {a}: its size is {x.shape[a]}, not 1")
        if a in axes:
            raise ShapeError(f"axis {a} is given twice in {given}")
        axes.append(a)
    return tuple(sorted(axes))


def _squeeze_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    axes = _squeeze_axes(x, attrs)
    return x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _squeeze_np(x: Any, axis: Any) -> Any:
    axes = (axis,) if isinstance(axis, int) else axis
    return np.squeeze(x, axes if axes else None)


def _squeeze_jax(x: Any, axis: Any) -> Any:
    axes = (axis,) if isinstance(axis, int) else axis
    return jnp.squeeze(x, axes if axes else None)


def squeeze_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    lab = ALPHA[: t.rank]
    axes = ctx.attrs.get("axis", ())
    if isinstance(axes, int):
        axes = (axes,)
    gone = {a % t.rank for a in axes} if axes else {i for i, d in enumerate(t.shape) if d == 1}
    return Labels([lab], ["".join(c for i, c in enumerate(lab) if i not in gone)])


define("Squeeze", _squeeze_infer, _squeeze_np, _squeeze_jax, vjp=_shape_restoring_vjp,
       attrs={"axis": ()}, num_inputs=1, sharding=LabelRule(squeeze_labels),
       doc="Remove the size-1 dims in axis (a tuple; () removes every size-1 dim).",
       section="shape", operands="x; `axis`", dtypes=ALL, rule="the removed dims never split",
       tests=("test_ops_shape.py::test_squeeze", "test_ops_shape.py::test_squeeze_int_axis",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       dims=DimRule(_pair_non_unit, preserves_values=True))

# -- Flatten --------------------------------------------------------------------------------


def _flatten_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    if x.rank == 0:
        raise ShapeError("needs an input of rank >= 1 (dim 0 is kept), got a scalar")
    return x.with_shape((x.shape[0], math.prod(x.shape[1:])))


def _flatten_np(x: Any) -> Any:
    return np.reshape(x, (x.shape[0], math.prod(x.shape[1:])))


def _flatten_jax(x: Any) -> Any:
    return jnp.reshape(x, (x.shape[0], math.prod(x.shape[1:])))


def flatten_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    lab = ALPHA[: t.rank]
    fresh = fresh_labels(1, set(lab))[0]
    return Labels([lab], [lab[:1] + fresh], set(lab[1:]) | {fresh})


def _flatten_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    x = ins[0][0]
    yield Same(In(0, 0), Out(0))
    yield Product(tuple(In(0, d) for d in range(1, len(x))), (Out(1),))


define("Flatten", _flatten_infer, _flatten_np, _flatten_jax, vjp=_shape_restoring_vjp, num_inputs=1,
       sharding=LabelRule(flatten_labels),
       doc="Keep dim 0 and flatten the rest: (N, ...) -> (N, prod(...)); (N,) -> (N, 1).",
       section="shape", operands="x (N, ...) -> (N, prod(...))", dtypes=ALL,
       rule="the flattened dims never split",
       tests=("test_ops_shape.py::test_flatten",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       dims=DimRule(_flatten_dims, preserves_values=True))

# -- StridedSlice / StridedSliceGrad --------------------------------------------------------

_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")


@dataclass(frozen=True)
class SliceLayout:
    """What a StridedSlice's begin/end/strides and masks select, dim by dim, as MindSpore (and
    TensorFlow) read them. Bit i of a mask belongs to entry i of begin/end/strides; bits past
    their length are ignored; a `new_axis_mask` bit wins over a `shrink_axis_mask` bit.

    * `slices`: one clamped Python slice per input dim (a shrunk dim: its one index; a
      reversed slice that runs to index 0 ends at None);
    * `dense_shape`: `x[slices]`'s shape, one entry per input dim;
    * `out_dims`: for each output dim, the input dim it comes from, or None for a new axis;
    * `shrunk`: the input dims a `shrink_axis_mask` bit removes;
    * `ellipsis`: the input dims an `ellipsis_mask` entry stands for (taken whole)."""

    in_shape: tuple[int, ...]
    slices: tuple[slice, ...]
    dense_shape: tuple[int, ...]
    out_dims: tuple[int | None, ...]
    shrunk: frozenset[int]
    ellipsis: frozenset[int]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(1 if d is None else self.dense_shape[d] for d in self.out_dims)

    def whole(self, dim: int) -> bool:
        """Input dim `dim` is kept whole and in order (MindSpore's "fully fetched", stride 1,
        not shrunk): the only kind of dim a strategy may split."""
        s = self.slices[dim]
        return (dim not in self.shrunk and s.start == 0 and s.step == 1
                and self.dense_shape[dim] == self.in_shape[dim])


def _mask_bits(attrs: dict[str, Any], name: str, count: int) -> tuple[bool, ...]:
    mask = _int_attr(attrs, name) if attrs.get(name) is not None else 0
    if mask < 0:
        raise ShapeError(f"{name}={mask} must be >= 0 (bit i belongs to begin/end/strides[i])")
    return tuple(bool(mask >> i & 1) for i in range(count))


def slice_layout(shape: tuple[int, ...], attrs: dict[str, Any]) -> SliceLayout:
    """The selection of a StridedSlice of an input of `shape` (see `SliceLayout`).

    Entry i of begin/end/strides is, by its mask bits: an ellipsis (the input dims no other
    entry takes, whole), a new axis (a size-1 output dim; begin/end/strides ignored), a shrink
    (the one index begin[i], negative counting from the end, which must exist; the dim is
    removed), or a slice begin[i]:end[i]:strides[i] with Python clamping, begin[i] read as the
    dim's start where begin_mask has bit i, end[i] as its end where end_mask has. Input dims
    after the last entry are taken whole."""
    begin = _int_tuple_attr(attrs, "begin")
    end = _int_tuple_attr(attrs, "end")
    strides = _int_tuple_attr(attrs, "strides")
    if not len(begin) == len(end) == len(strides):
        raise ShapeError(
            f"begin {begin}, end {end} and strides {strides} must have the same length"
        )
    if any(s == 0 for s in strides):
        raise ShapeError(f"strides {strides} cannot contain 0")
    count = len(begin)
    begin_bits = _mask_bits(attrs, "begin_mask", count)
    end_bits = _mask_bits(attrs, "end_mask", count)
    ellipsis_bits = _mask_bits(attrs, "ellipsis_mask", count)
    new_bits = _mask_bits(attrs, "new_axis_mask", count)
    shrink_bits = tuple(s and not n for s, n in zip(_mask_bits(attrs, "shrink_axis_mask", count),
                                                     new_bits))
    if sum(ellipsis_bits) > 1:
        raise ShapeError(
            f"ellipsis_mask={attrs['ellipsis_mask']} sets {sum(ellipsis_bits)} bits; only one "
            "ellipsis is allowed in an index"
        )
    taking = sum(1 for i in range(count) if not new_bits[i] and not ellipsis_bits[i])
    if taking > len(shape):
        raise ShapeError(
            f"begin/end/strides have {taking} entries that index input dims but the input has "
            f"rank {len(shape)}; give at most one entry per dim"
        )
    slices: list[slice] = []
    out_dims: list[int | None] = []
    shrunk: set[int] = set()
    ellipsis: set[int] = set()

    def take_whole() -> None:
        dim = len(slices)
        slices.append(slice(0, shape[dim], 1))
        out_dims.append(dim)

    for i in range(count):
        if ellipsis_bits[i]:
            for _ in range(len(shape) - taking):
                ellipsis.add(len(slices))
                take_whole()
        elif new_bits[i]:
            out_dims.append(None)
        elif shrink_bits[i]:
            dim, size = len(slices), shape[len(slices)]
            if strides[i] < 0:
                raise ShapeError(
                    f"shrink_axis_mask takes index begin[{i}] of dim {dim} with stride "
                    f"{strides[i]}; when shrinking an axis, the stride cannot be negative"
                )
            if not -size <= begin[i] < size:
                raise ShapeError(
                    f"shrink_axis_mask takes index begin[{i}]={begin[i]} of dim {dim}, which "
                    f"has size {size}; the index must lie in [{-size}, {size})"
                )
            index = begin[i] % size
            slices.append(slice(index, index + 1, 1))
            shrunk.add(dim)
        else:
            dim = len(slices)
            start, stop, step = slice(None if begin_bits[i] else begin[i],
                                      None if end_bits[i] else end[i],
                                      strides[i]).indices(shape[dim])
            if not range(start, stop, step):
                slices.append(slice(0, 0, 1))  # clamped bounds of -1 would read as the last
            else:  # a reversed slice's end before index 0 is None, not -1 (the last index)
                slices.append(slice(start, stop if stop >= 0 else None, step))
            out_dims.append(dim)
    while len(slices) < len(shape):
        take_whole()
    dense = tuple(len(range(*s.indices(n))) for s, n in zip(slices, shape))
    return SliceLayout(tuple(shape), tuple(slices), dense, tuple(out_dims), frozenset(shrunk),
                       frozenset(ellipsis))


def slice_spec(
    shape: tuple[int, ...], attrs: dict[str, Any]
) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The Python slices of a StridedSlice, one per input dim, and `x[slices]`'s shape (the
    output's before new axes are added and shrunk dims removed; `slice_layout` has both)."""
    spec = slice_layout(shape, attrs)
    return spec.slices, spec.dense_shape


def _bounds(s: slice, count: int, size: int) -> tuple[int, int, int]:
    """Mask-free begin, end, stride selecting the `count` elements of clamped slice `s` of a
    dim of `size` (an end before index 0 of a reversed slice written -(size + 1))."""
    if count == 0:
        return 0, 0, 1
    stop = s.start + count * s.step
    return s.start, stop if stop >= 0 else -(size + 1), s.step


def _dense_bounds(spec: SliceLayout) -> dict[str, Any]:
    """Mask-free begin/end/strides selecting `spec.slices` (StridedSliceGrad's attributes)."""
    bounds = [_bounds(s, n, size)
              for s, n, size in zip(spec.slices, spec.dense_shape, spec.in_shape)]
    return {"begin": tuple(b[0] for b in bounds), "end": tuple(b[1] for b in bounds),
            "strides": tuple(b[2] for b in bounds)}


def _strided_slice_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    return x.with_shape(slice_layout(x.shape, attrs).out_shape)


def _strided_slice_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    """The cotangent viewed as `x[slices]` (new axes dropped, shrunk dims back as size 1),
    written into zeros by StridedSliceGrad."""
    a = node.attrs
    shape = node.operands[0].shape
    if not any(a.get(mask) for mask in _MASKS):
        # bounds pass through as they are (a redistribution's are per-rank offsets)
        return [b("StridedSliceGrad", cot, shape=shape, begin=a["begin"], end=a["end"],
                  strides=a["strides"])]
    spec = slice_layout(shape, a)
    dense = cot if cot.shape == spec.dense_shape else b("Reshape", cot, shape=spec.dense_shape)
    return [b("StridedSliceGrad", dense, shape=shape, **_dense_bounds(spec))]


def _strided_slice_np(x: Any, begin: Any, end: Any, strides: Any, **masks: Any) -> Any:
    spec = slice_layout(x.shape, {"begin": begin, "end": end, "strides": strides, **masks})
    return np.reshape(x[spec.slices], spec.out_shape)


def _strided_slice_jax(x: Any, begin: Any, end: Any, strides: Any, **masks: Any) -> Any:
    spec = slice_layout(x.shape, {"begin": begin, "end": end, "strides": strides, **masks})
    return jnp.reshape(x[spec.slices], spec.out_shape)


def strided_slice_labels(ctx: OpContext) -> Labels:
    """Input dim d is labelled d; an output dim has its input dim's label, a new axis a fresh
    one (size 1, never split); a shrunk dim's label is dropped. Every dim not kept whole (sliced,
    strided, shrunk) is unsplittable."""
    t = ctx.in_types[0]
    spec = slice_layout(t.shape, ctx.attrs)
    lab = ALPHA[: t.rank]
    fresh = iter(fresh_labels(len(spec.out_dims), set(lab)))
    out = "".join(next(fresh) if d is None else lab[d] for d in spec.out_dims)
    return Labels([lab], [out], {lab[d] for d in range(t.rank) if not spec.whole(d)})


class StridedSliceRule(LabelRule):
    """MindSpore's stridedslice_info: the strategy has one split per input dim; a dim may be
    split only where it is fetched whole with stride 1 and not shrunk (a masked begin or end
    counts as the dim's start or end); a new axis is never split; an ellipsis_mask is refused
    in a parallel plan. Each rank slices its part with the same attributes."""

    def __init__(self) -> None:
        super().__init__(strided_slice_labels, unsplittable="a sliced dim")

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        split = strategy[0] if len(strategy) == 1 else ()
        _check_slice_splits(ctx, tuple(split), f"the strategy is {strategy}")
        return super().apply(ctx, strategy, out_strategy)

    def apply_layouts(self, ctx: OpContext, layouts: list[TensorLayout],
                      out_layout: TensorLayout | None) -> OpSharding | None:
        """The same checks for an input `Layout`; its sharding follows from the labels."""
        if layouts:
            _check_slice_splits(ctx, layouts[0].splits,
                                f"the layout splits the input {layouts[0].splits}")
        return None


def _check_slice_splits(ctx: OpContext, split: tuple[int, ...], given: str) -> None:
    """MindSpore's refusals (stridedslice_info's CheckInputStrategy and GetAttrs), with the
    reason: an ellipsis_mask, or a split dim that is shrunk, strided or not fully fetched."""
    t = ctx.in_types[0]
    if ctx.attrs.get("ellipsis_mask"):
        raise StrategyError(
            f"ellipsis_mask={ctx.attrs['ellipsis_mask']} is not supported in a parallel "
            "plan (MindSpore's StridedSlice refuses it there too)",
            "spell the dims the ellipsis stands for: begin 0, end the dim's size, stride 1 "
            "(or set their begin_mask and end_mask bits)",
        )
    spec = slice_layout(t.shape, ctx.attrs)
    for d, count in enumerate(split if len(split) == t.rank else ()):
        if count == 1 or spec.whole(d):
            continue
        s = spec.slices[d]
        if d in spec.shrunk:
            why = f"it is shrunk (shrink_axis_mask); a shrunk dimension can not be split, {given}"
        elif s.step != 1:
            why = f"its stride is {s.step}; a split dimension needs stride 1, {given}"
        else:
            why = (f"it is not fully fetched ([{s.start}:{s.stop}] of {t.shape[d]}); a "
                   f"dimension that is not fully fetched can not be split, {given}")
        raise StrategyError(f"dim {d} of the input cannot be split {count} ways: {why}",
                            f"use 1 (or None in a Layout) for dim {d}")


def _slice_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """A dim sliced with stride 1 keeps its margins: in = out + what the slice leaves out; a
    shrunk dim keeps its size (its index must stay)."""
    spec = slice_layout(ins[0][0], attrs)
    out_of = {d: k for k, d in enumerate(spec.out_dims) if d is not None}
    for d, (s, n) in enumerate(zip(spec.slices, ins[0][0])):
        if d in spec.shrunk:
            yield Fixed(In(0, d), "a shrunk dim")
        elif s.step != 1:
            yield Fixed(In(0, d), "a strided slice")
            yield Fixed(Out(out_of[d]), "a strided slice")
        elif spec.dense_shape[d] == n:
            yield Same(In(0, d), Out(out_of[d]))
        else:
            yield Offset(In(0, d), Out(out_of[d]), n - spec.dense_shape[d])


def _slice_rewrite(attrs: dict[str, Any], old_in: Any, old_out: Any, new_in: Any,
                   new_out: Any) -> dict[str, Any]:
    """The shrunk op's attributes, one begin/end/strides entry per input dim and new axis in
    output order (masks recomputed: new axes and shrunk dims keep theirs)."""
    spec = slice_layout(old_in[0][0], attrs)
    new_size = {d: new_out[0][k] for k, d in enumerate(spec.out_dims) if d is not None}
    begin, end, strides, new_axis, shrink = [], [], [], 0, 0
    dim = 0
    entries: list[int | None] = []
    for d in spec.out_dims:
        while d is not None and dim < d:  # shrunk dims before this output dim
            entries.append(dim)
            dim += 1
        entries.append(d)
        if d is not None:
            dim = d + 1
    entries += list(range(dim, len(spec.slices)))
    for i, d in enumerate(entries):
        if d is None:
            begin.append(0)
            end.append(1)
            strides.append(1)
            new_axis |= 1 << i
            continue
        first, stop, step = _bounds(spec.slices[d], 1 if d in spec.shrunk else new_size[d],
                                    new_in[0][0][d])
        begin.append(first)
        end.append(stop)
        strides.append(step)
        if d in spec.shrunk:
            shrink |= 1 << i
    return {**attrs, "begin": tuple(begin), "end": tuple(end), "strides": tuple(strides),
            "begin_mask": 0, "end_mask": 0, "ellipsis_mask": 0, "new_axis_mask": new_axis,
            "shrink_axis_mask": shrink}


_STRIDED_SLICE_NOTE = """\
**StridedSlice** reads its masks as MindSpore does: bit i of a mask belongs to entry i of
`begin`/`end`/`strides` (bits past their length are ignored). `begin_mask` / `end_mask`: that
entry starts at the dim's start / runs to its end. `ellipsis_mask` (one bit): the entry stands
for every input dim no other entry takes, whole. `new_axis_mask`: the entry adds a size-1 dim
(its bounds are ignored; it wins over a `shrink_axis_mask` bit). `shrink_axis_mask`: the entry
takes the one index `begin[i]` (negative counts from the end; the masks of bounds do not apply)
and removes the dim. Dims after the last entry are taken whole. Sharding follows MindSpore's
stridedslice_info: the strategy has one split per input dim, and only a dim fetched whole with
stride 1 and not shrunk may be split (a negative stride reverses a dim, as in numpy, and
keeps it whole); a new axis is never split; a StridedSlice with an
`ellipsis_mask` is refused in a parallel plan (spell those dims out instead). The vjp reshapes
the cotangent to `x[slices]`'s shape and writes it into zeros (StridedSliceGrad)."""

define("StridedSlice", _strided_slice_infer, _strided_slice_np, _strided_slice_jax,
       vjp=_strided_slice_vjp,
       attrs={
           "begin": None,
           "end": None,
           "strides": None,
           "begin_mask": 0,
           "end_mask": 0,
           "ellipsis_mask": 0,
           "new_axis_mask": 0,
           "shrink_axis_mask": 0,
       }, num_inputs=1, sharding=StridedSliceRule(),
       doc="x[begin[i]:end[i]:strides[i], ...] with Python clamping and MindSpore's masks "
           "(begin, end, ellipsis, new axis, shrink axis); a negative stride reverses.",
       section="shape", operands="x; `begin`, `end`, `strides`, masks", dtypes=ALL,
       rule="only dims fetched whole with stride 1 (not shrunk) split",
       tests=("test_ops_shape.py::test_strided_slice",
              "test_strided_slice_masks.py::test_strided_slice_masks",
              "test_strided_slice_masks.py::test_masked_slice_rule_matches_the_oracle",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       note=_STRIDED_SLICE_NOTE,
       dims=DimRule(_slice_dims, rewrite=_slice_rewrite, preserves_values=True))


def _strided_slice_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dy = tensor(types[0], "dy")
    shape = _int_tuple_attr(attrs, "shape")
    if any(d < 0 for d in shape):
        raise ShapeError(f"shape {shape} has a negative dim")
    _, out = slice_spec(shape, attrs)
    if dy.shape != out:
        raise ShapeError(
            f"dy has shape {dy.shape} but slicing {shape} with these bounds gives {out}"
        )
    return dy.with_shape(shape)


def _strided_slice_grad_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    a = node.attrs
    return [b("StridedSlice", cot, begin=a["begin"], end=a["end"], strides=a["strides"])]


def _strided_slice_grad_np(dy: Any, shape: Any, begin: Any, end: Any, strides: Any) -> Any:
    slices, _ = slice_spec(shape, {"begin": begin, "end": end, "strides": strides})
    out = np.zeros(shape, dy.dtype)
    out[slices] = dy
    return out


def _strided_slice_grad_jax(dy: Any, shape: Any, begin: Any, end: Any, strides: Any) -> Any:
    slices, _ = slice_spec(shape, {"begin": begin, "end": end, "strides": strides})
    return jnp.zeros(shape, dy.dtype).at[slices].set(dy)


define("StridedSliceGrad", _strided_slice_grad_infer, _strided_slice_grad_np,
       _strided_slice_grad_jax, vjp=_strided_slice_grad_vjp,
       attrs={"shape": None, "begin": None, "end": None, "strides": None}, num_inputs=1,
       doc="Zeros of `shape` with dy written into the StridedSlice region (its vjp).",
       section="shape", operands="dy; `shape`, `begin`, `end`, `strides`", dtypes=ALL,
       grad_of="StridedSlice",
       tests=("test_ops_shape.py::test_strided_slice_grad",
              "test_ops_shape.py::test_strided_slice_grad_shape_mismatch"))

# -- Concat ---------------------------------------------------------------------------------


def _concat_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    xs = [tensor(t, f"input {i}") for i, t in enumerate(types)]
    dtype = same_dtype(xs)
    first = xs[0]
    axis = _axis(attrs, first.rank)
    for i, x in enumerate(xs[1:], 1):
        if x.rank != first.rank:
            raise ShapeError(
                f"input {i} has rank {x.rank} but input 0 has rank {first.rank}; "
                "all inputs need the same rank"
            )
        others = [d for d in range(x.rank) if d != axis and x.shape[d] != first.shape[d]]
        if others:
            d = others[0]
            raise ShapeError(
                f"input {i} has size {x.shape[d]} in dim {d} but input 0 has "
                f"{first.shape[d]}; all dims except the concat axis {axis} must match"
            )
    total = sum(x.shape[axis] for x in xs)
    return TensorType(dtype, first.shape[:axis] + (total,) + first.shape[axis + 1 :])


def _concat_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    rank = cot.tensor_type.rank
    axis = _axis(node.attrs, rank)
    grads: list[Value | None] = []
    offset = 0
    for x in node.operands:
        size = x.shape[axis]
        begin = tuple(offset if d == axis else 0 for d in range(rank))
        end = tuple(offset + size if d == axis else cot.shape[d] for d in range(rank))
        grads.append(b("StridedSlice", cot, begin=begin, end=end, strides=(1,) * rank))
        offset += size
    return grads


def concat_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = ALPHA[:rank]
    axis = ctx.attrs.get("axis", 0) % rank
    return Labels([lab] * len(ctx.in_types), [lab], {lab[axis]})


def _concat_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    rank = len(outs[0])
    axis = attrs["axis"] % rank
    for i in range(len(ins)):
        for d in range(rank):
            if d != axis:
                yield Same(In(i, d), Out(d))
    yield Total(Out(axis), tuple(In(i, axis) for i in range(len(ins))))


define("Concat", _concat_infer, lambda *xs, axis: np.concatenate(xs, axis),
       lambda *xs, axis: jnp.concatenate(xs, axis), vjp=_concat_vjp, attrs={"axis": 0},
       num_inputs=(1, 1000), sharding=LabelRule(concat_labels, unsplittable="the concat axis"),
       doc="Join the inputs along axis; all other dims must match.", section="shape",
       operands="tensors; `axis`", dtypes=ALL, rule="the concat axis never splits",
       tests=("test_ops_shape.py::test_concat",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(_concat_dims))

# -- Split ----------------------------------------------------------------------------------


def _split_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    axis = _axis(attrs, x.rank)
    num = _int_attr(attrs, "output_num")
    if num < 1:
        raise ShapeError(f"output_num must be >= 1, got {num}")
    if x.shape[axis] % num:
        divisors = [k for k in range(1, x.shape[axis] + 1) if x.shape[axis] % k == 0]
        raise ShapeError(
            f"dim {axis} of size {x.shape[axis]} cannot be split into {num} equal pieces; "
            f"output_num must divide it (valid: {', '.join(map(str, divisors))})"
        )
    piece = x.with_shape(x.shape[:axis] + (x.shape[axis] // num,) + x.shape[axis + 1 :])
    return TupleType((piece,) * num)


def _split_vjp(b: Builder, node: Node, cots: list[Value]) -> list[Value | None]:
    return [b("Concat", *cots, axis=node.attrs["axis"])]


def split_labels(ctx: OpContext) -> Labels:
    rank = ctx.in_types[0].rank
    lab = ALPHA[:rank]
    axis = ctx.attrs.get("axis", 0) % rank
    return Labels([lab], [lab] * len(ctx.out_types), {lab[axis]})


def _split_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    rank = len(ins[0][0])
    axis = attrs["axis"] % rank
    for k in range(len(outs)):
        for d in range(rank):
            if d != axis:
                yield Same(In(0, d), Out(d, k))
            else:  # equal pieces
                yield Product((Out(d, k),), (In(0, d),), attrs["output_num"])
                yield Same(Out(d, 0), Out(d, k))


define("Split", _split_infer, lambda x, axis, output_num: tuple(np.split(x, output_num, axis)),
       lambda x, axis, output_num: tuple(jnp.split(x, output_num, axis)), vjp=_split_vjp,
       attrs={"axis": 0, "output_num": 1}, num_inputs=1,
       sharding=LabelRule(split_labels, unsplittable="the split axis"),
       doc="output_num equal pieces of x along axis, as a tuple (read with TupleGetItem).",
       section="shape", operands="x; `axis`, `output_num` -> tuple", dtypes=ALL,
       rule="the split axis never splits",
       tests=("test_ops_shape.py::test_split",
              "test_ops_shape.py::test_split_partial_use_gradient",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(_split_dims))

# -- MakeTuple / TupleGetItem ---------------------------------------------------------------


def _make_tuple_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    return TupleType(tuple(tensor(t, f"element {i}") for i, t in enumerate(types)))


def _make_tuple_vjp(b: Builder, node: Node, cots: list[Value]) -> list[Value | None]:
    return list(cots)


def _make_tuple_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    for i, shapes in enumerate(ins):
        for d in range(len(shapes[0])):
            yield Same(In(i, d), Out(d, i))


define("MakeTuple", _make_tuple_infer, lambda *xs: tuple(xs), lambda *xs: tuple(xs),
       vjp=_make_tuple_vjp, num_inputs=(1, 1000), traits=frozenset({Trait.NO_STRATEGY}),
       doc="A tuple of the tensor inputs.", section="shape", operands="tensors -> tuple",
       dtypes=ALL, rule="no strategy", tests=("test_ops_shape.py::test_make_tuple",),
       spelling="a Python tuple of tensors", dims=DimRule(_make_tuple_dims))


def _tuple_get_item_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    t = types[0]
    if not isinstance(t, TupleType):
        raise ShapeError(f"needs a tuple input, got {t}")
    index = _int_attr(attrs, "index")
    n = len(t.elements)
    if not -n <= index < n:
        raise ShapeError(f"index {index} is out of range for a tuple of {n}; valid: [{-n}, {n})")
    return t.elements[index]


def _tuple_get_item_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    # Must be non-None so autodiff treats the op as differentiable; autodiff routes
    # TupleGetItem cotangents itself and never calls this.
    raise AssertionError("TupleGetItem gradients are routed by passes.autodiff")


def _tuple_get_item_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    for d in range(len(outs[0])):
        yield Same(In(0, d, attrs["index"]), Out(d))


define("TupleGetItem", _tuple_get_item_infer, lambda t, index: t[index], lambda t, index: t[index],
       vjp=_tuple_get_item_vjp, attrs={"index": 0}, num_inputs=1,
       traits=frozenset({Trait.NO_STRATEGY}), doc="Element `index` of a tuple value.",
       section="shape", operands="tuple; `index`", dtypes=ALL, rule="no strategy",
       tests=("test_ops_shape.py::test_tuple_get_item_negative_index",
              "test_ops_shape.py::test_tuple_get_item_errors", "test_ops_shape.py::test_split"),
       spelling="indexing a tuple result (`out[0]`)",
       dims=DimRule(_tuple_get_item_dims, preserves_values=True))

# -- Gather / GatherGrad --------------------------------------------------------------------


def _check_indices(t: TensorType) -> None:
    if t.dtype not in (DType.int32, DType.int64):
        raise ShapeError(f"indices must be Int32 or Int64, got {t.dtype.value}")


def _batch_dims(attrs: dict[str, Any], params: TensorType, indices: TensorType,
                axis: int) -> int:
    """`batch_dims` normalized to [0, indices.rank] (negative counts from the end): the leading
    dims params and indices share, gathered independently (MindSpore's batch mode)."""
    value = _int_attr(attrs, "batch_dims")
    bd = value + indices.rank if value < 0 else value
    if not 0 <= bd <= indices.rank:
        raise ShapeError(
            f"batch_dims {value} is out of range for indices of rank {indices.rank}; valid: "
            f"[{-indices.rank}, {indices.rank}]"
        )
    if bd > axis:
        raise ShapeError(f"batch_dims {bd} must be <= axis {axis} (the batch dims come first)")
    if params.shape[:bd] != indices.shape[:bd]:
        raise ShapeError(
            f"with batch_dims {bd}, the first {bd} dims of params {params.shape} and indices "
            f"{indices.shape} must be equal"
        )
    return bd


def gathered_shape(shape: tuple[int, ...], indices: tuple[int, ...], axis: int,
                   batch_dims: int) -> tuple[int, ...]:
    """params.shape[:axis] + indices.shape[batch_dims:] + params.shape[axis + 1:]."""
    return shape[:axis] + indices[batch_dims:] + shape[axis + 1:]


def _gather_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    params, indices = tensor(types[0], "params"), tensor(types[1], "indices")
    _check_indices(indices)
    axis = _axis(attrs, params.rank)
    bd = _batch_dims(attrs, params, indices, axis)
    return params.with_shape(gathered_shape(params.shape, indices.shape, axis, bd))


def _gather_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    params, indices = node.operands
    grad = b("GatherGrad", cot, indices, shape=params.shape, axis=node.attrs["axis"],
             batch_dims=node.attrs["batch_dims"])
    return [grad, None]


def _per_batch(batch: tuple[int, ...], fn: Any, *arrays: Any) -> np.ndarray:
    """`fn` applied to each batch element of `arrays` (their leading `batch` dims), stacked."""
    parts = [fn(*(a[index] for a in arrays)) for index in np.ndindex(*batch)]
    result: np.ndarray = np.stack(parts).reshape(batch + parts[0].shape)
    return result


def _gather_np(params: Any, indices: Any, axis: int, batch_dims: int) -> Any:
    # In-range indices only; negatives wrap. Out of range: numpy raises, JAX fills NaN.
    axis %= params.ndim
    bd = batch_dims + indices.ndim if batch_dims < 0 else batch_dims
    if not bd:
        return np.take(params, indices, axis)
    return _per_batch(params.shape[:bd], lambda p, i: np.take(p, i, axis - bd), params, indices)


def _batched_jax(fn: Any, batch_dims: int) -> Any:
    for _ in range(batch_dims):
        fn = jax.vmap(fn)
    return fn


def _gather_jax(params: Any, indices: Any, axis: int, batch_dims: int) -> Any:
    axis %= params.ndim
    bd = batch_dims + indices.ndim if batch_dims < 0 else batch_dims
    return _batched_jax(lambda p, i: jnp.take(p, i, axis - bd), bd)(params, indices)


_GATHER_NOTE = """\
**Gather** with `batch_dims` = b > 0 (MindSpore's batch mode: the first b dims of
params and indices are shared batch dims) splits the batch dims alike and never the gathered
axis. Otherwise its device matrix is [indices' splits, table's splits], as MindSpore's; the
indices and the table's other dims split freely; a split gathered axis (0) becomes a masked
local lookup plus an AllReduce (or ReduceScatter with `out_strategy`) over the ranks that hold
the same index block, with the indices whole or split as well when the strategy uses every
device: `((2, 1), (2, 2))` on 8 devices all-reduces over pairs of ranks (split indices with
repeated calculation, `((2, 1), (2, 1))` on 8, are refused, as MindSpore does). The searches
enumerate a split gathered axis with split indices only in MindSpore's shard-batch-and-axis
mode `((mp, 1), (dp, 1))`, mp · dp = devices, as MindSpore's strategy generation does."""

def gather_labels(ctx: OpContext) -> Labels:
    """The table's dims with the gathered axis replaced by the indices' dims. The device matrix
    is [indices' splits..., table's splits...] (MindSpore's gather_info, normal mode), so the
    output keeps the indices' axes in front: Gather ((1, 2), (4,)) has dev (4, 1, 2) and output
    map (2, 0), the layout of a following ((4, 2),) op."""
    table, idx = ctx.in_types
    axis = ctx.attrs.get("axis", 0) % table.rank
    tlab = ALPHA[: table.rank]
    used = set(tlab)
    batch = int(ctx.attrs.get("batch_dims", 0) or 0)
    batch = batch + idx.rank if batch < 0 else batch
    # batch_dims (MindSpore's batch mode): the indices' leading dims are the table's; the
    # gathered axis is never split.
    ilab = tlab[:batch] + "".join(fresh_labels(idx.rank - batch, used))
    out = tlab[:axis] + ilab[batch:] + tlab[axis + 1 :]
    order = tuple(dict.fromkeys(ilab + tlab))  # the indices' splits first, as MindSpore
    return Labels([tlab, ilab], [out], {tlab[axis]} if batch else set(), dev_order=order)


def shard_batch_and_axis(ctx: OpContext, strategy: Strategy) -> bool:
    """MindSpore's SHARD_BATCH_AND_AXIS mode of Gather (gather_info's ShardBatchAndAxis): axis
    0 of a 2-D table split `a` ways and the first dim of 2-D indices split `b` ways, nothing
    else split, a * b the whole stage, neither alone. Each rank looks up its vocabulary slice
    for its batch slice; the partial rows are summed by a forward AllReduce over the table's
    axis."""
    if len(strategy) != 2 or int(ctx.attrs.get("axis", 0)) % ctx.in_types[0].rank != 0:
        return False
    table, idx = strategy
    if len(table) != 2 or len(idx) != 2 or table[1] != 1 or idx[1] != 1:
        return False
    return (table[0] * idx[0] == ctx.devices and table[0] != ctx.devices
            and idx[0] != ctx.devices)


class _MaskedGather(Expansion):
    """Gather from a table split on its rows: look up the rows this rank holds, zero the
    others; the forward AllReduce then sums the parts."""

    def emit(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
             attrs: dict[str, Any], info: ParallelInfo, sharding: OpSharding) -> Value:
        table, idx = operands
        layout = sharding.in_layouts[0]
        rows = table.shape[0]
        start = lower.rank_constant(RankScalar(layout_offsets(layout), 0), idx.dtype)
        sub = b.emit("Sub", [idx, start])
        low = b.emit("GreaterEqual", [sub, Constant(np.asarray(0), idx.dtype)])
        high = b.emit("Less", [sub, Constant(np.asarray(rows), idx.dtype)])
        mask = b.emit("Mul", [b.emit("Cast", [low], {"dst_type": table.dtype}),
                              b.emit("Cast", [high], {"dst_type": table.dtype})])
        clipped = b.emit("Minimum", [b.emit("Maximum", [sub, Constant(np.asarray(0), idx.dtype)]),
                                     Constant(np.asarray(rows - 1), idx.dtype)])
        gathered = b.emit("Gather", [table, clipped], {"axis": 0},
                          instance_name=node.instance_name, name_hint=node.result.name_hint,
                          parallel=ParallelInfo(in_strategy=sharding.strategy))
        for _ in range(len(table.shape) - 1):  # the table's other dims (none for a 1-D one)
            mask = b.emit("ExpandDims", [mask], {"axis": -1})
        return b.emit("Mul", [gathered, mask])


MASKED_GATHER = _MaskedGather()


class GatherRule(LabelRule):
    """Gather: a split table axis needs the masked local gather plus AllReduce over the ranks
    that share an index block (reference §3.2, SHARD_AXIS_0), the indices whole or split
    (MindSpore's shard-batch-and-axis mode `((mp, 1), (dp, 1))`, the vocab-parallel embedding,
    is one case)."""

    def __init__(self) -> None:
        super().__init__(gather_labels, unsplittable="the gathered axis, which batch mode "
                                                    "(batch_dims > 0) never splits")

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        labels = self.labels(ctx)
        if ctx.attrs.get("batch_dims"):
            return label_sharding(ctx, labels, strategy)
        axis = ctx.attrs.get("axis", 0) % ctx.in_types[0].rank
        table_split = strategy[0][axis] if len(strategy) == 2 and len(strategy[0]) > axis else 1
        if table_split == 1:
            return label_sharding(ctx, labels, strategy, out_strategy)
        if axis != 0:
            raise StrategyError("only axis 0 of a gathered table can be split")
        used = math.prod(c for dims in strategy for c in dims)
        if any(c != 1 for c in strategy[1]) and used != ctx.devices:
            raise StrategyError(
                "when the table's gathered axis is split and the indices are split too, the "
                f"strategy must use every device ({ctx.devices}; it uses {used}): no repeated "
                "calculation (MindSpore's shard-batch-and-axis mode ((mp, 1), (dp, 1)) with "
                f"mp * dp = {ctx.devices} is one such strategy)",
                "split the indices or the table further, or use 1 for every dim of the indices",
            )
        result = label_sharding(ctx, labels, strategy, out_strategy)
        result.expand = MASKED_GATHER
        return result

    def searchable(self, ctx: OpContext, strategy: Strategy) -> bool:
        """MindSpore's auto-parallel strategy generation filters out a split gathered axis with
        split indices (gather_info's "param is split at dim (axis), index can't be split"),
        but for the shard-batch-and-axis mode: the searches enumerate what they enumerate."""
        if ctx.attrs.get("batch_dims") or len(strategy) != 2:
            return True
        axis = ctx.attrs.get("axis", 0) % ctx.in_types[0].rank
        table, idx = strategy
        return (len(table) <= axis or table[axis] == 1 or all(c == 1 for c in idx)
                or shard_batch_and_axis(ctx, strategy))

    def default_strategy(self, ctx: OpContext) -> Strategy:
        if ctx.attrs.get("batch_dims"):
            return super().default_strategy(ctx)  # the shared batch dim 0
        table, idx = ctx.in_types
        count = gcd(idx.shape[0], ctx.devices) if idx.rank else 1
        return (tuple(1 for _ in table.shape),
                tuple(count if i == 0 else 1 for i in range(idx.rank)))


def _gather_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    params, indices = ins[0][0], ins[1][0]
    axis = attrs["axis"] % len(params)
    bd = attrs["batch_dims"] % (len(indices) + 1) if attrs["batch_dims"] < 0 \
        else attrs["batch_dims"]
    for d in range(bd):
        yield Same(In(0, d), In(1, d))
    for d in range(axis):
        yield Same(In(0, d), Out(d))
    for d in range(bd, len(indices)):
        yield Same(In(1, d), Out(axis + d - bd))
    tail = axis + len(indices) - bd
    for d in range(axis + 1, len(params)):
        yield Same(In(0, d), Out(tail + d - axis - 1))
    yield Index(1, In(0, axis))


define("Gather", _gather_infer, _gather_np, _gather_jax, vjp=_gather_vjp,
       attrs={"axis": 0, "batch_dims": 0}, num_inputs=2, sharding=GatherRule(),
       traits=frozenset({Trait.BATCH_ONLY, Trait.LOOKUP}),
       doc="Slices of params along axis picked by integer indices (jnp.take); with batch_dims = b "
           "the first b dims of params and indices are batch dims, each batch element gathered "
           "from its own slice: out shape params.shape[:axis] + indices.shape[b:] + "
           "params.shape[axis + 1:] (MindSpore's `Gather(batch_dims)`).", section="shape",
       operands="params, int indices; `axis`, `batch_dims` (default 0)", dtypes=ALL,
       rule="indices and the table's other dims split freely; a split gathered axis is a masked "
            "local lookup plus AllReduce over the ranks sharing an index block",
       tests=("test_ops_shape.py::test_gather",
              "test_parallel.py::test_every_rule_matches_the_oracle",
              "test_parallel.py::test_gather_on_a_split_table",
              "test_parallel_ops.py::test_rule_matches_the_oracle",
              "test_gather_split_axis_and_indices.py::test_split_axis_and_split_indices"),
       note=_GATHER_NOTE,
       dims=DimRule(_gather_dims))


def _gather_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dy, indices = tensor(types[0], "dy"), tensor(types[1], "indices")
    _check_indices(indices)
    if dy.dtype is DType.bool_:
        raise ShapeError("dy must be numeric (it is scatter-added), got Bool")
    shape = _int_tuple_attr(attrs, "shape")
    axis = _axis(attrs, len(shape))
    bd = _batch_dims(attrs, dy.with_shape(shape), indices, axis)
    expected = gathered_shape(shape, indices.shape, axis, bd)
    if dy.shape != expected:
        raise ShapeError(
            f"dy has shape {dy.shape} but gathering {shape} along axis {axis} with indices "
            f"{indices.shape} gives {expected}"
        )
    return dy.with_shape(shape)


def _gather_grad_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    _, indices = node.operands
    return [b("Gather", cot, indices, axis=node.attrs["axis"],
              batch_dims=node.attrs["batch_dims"]), None]


def _gather_index(axis: int, rank: int, indices: Any) -> tuple[Any, ...]:
    return (slice(None),) * (axis % rank) + (indices,)


def _scatter_np(dy: Any, indices: Any, shape: tuple[int, ...], axis: int) -> Any:
    out = np.zeros(shape, dy.dtype)
    np.add.at(out, _gather_index(axis, len(shape), indices), dy)
    return out


def _gather_grad_np(dy: Any, indices: Any, shape: Any, axis: Any, batch_dims: Any) -> Any:
    axis %= len(shape)
    bd = batch_dims + indices.ndim if batch_dims < 0 else batch_dims
    if not bd:
        return _scatter_np(dy, indices, tuple(shape), axis)
    inner = tuple(shape[bd:])
    return _per_batch(tuple(shape[:bd]), lambda d, i: _scatter_np(d, i, inner, axis - bd),
                      dy, indices)


def _gather_grad_jax(dy: Any, indices: Any, shape: Any, axis: Any, batch_dims: Any) -> Any:
    axis %= len(shape)
    bd = batch_dims + indices.ndim if batch_dims < 0 else batch_dims
    inner = tuple(shape[bd:])

    def scatter(d: Any, i: Any) -> Any:
        index = _gather_index(axis - bd, len(inner), i)
        return jnp.zeros(inner, d.dtype).at[index].add(d)

    return _batched_jax(scatter, bd)(dy, indices)


define("GatherGrad", _gather_grad_infer, _gather_grad_np, _gather_grad_jax, vjp=_gather_grad_vjp,
       attrs={"shape": None, "axis": 0, "batch_dims": 0}, num_inputs=2,
       doc="Scatter-add dy into zeros of `shape` at the Gather positions (Gather's vjp).",
       section="shape", operands="dy, int indices; `shape`, `axis`, `batch_dims`", dtypes=NUMERIC,
       grad_of="Gather", tests=("test_ops_shape.py::test_gather_grad",))

# -- OneHot ---------------------------------------------------------------------------------


def _onehot_axis(attrs: dict[str, Any], rank: int) -> int:
    axis = _int_attr(attrs, "axis")
    if not -rank - 1 <= axis <= rank:
        raise ShapeError(
            f"axis {axis} is out of range for a rank-{rank} indices tensor; the depth dim is "
            f"inserted at an output position in [{-rank - 1}, {rank}] (-1: last)"
        )
    return axis % (rank + 1)


def _onehot_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    indices = tensor(types[0], "indices")
    _check_indices(indices)
    depth = _int_attr(attrs, "depth")
    if depth < 0:
        raise ShapeError(f"depth must be >= 0, got {depth}")
    for name in ("on_value", "off_value"):
        value = attrs[name]
        if not isinstance(value, (int, float)):
            raise ShapeError(f"attribute {name} must be a Python number, got {value!r}")
    dtype = attrs["dtype"]
    if not isinstance(dtype, DType):
        raise ShapeError(f"attribute dtype must be an ir.types.DType, got {dtype!r}")
    axis = _onehot_axis(attrs, indices.rank)
    return TensorType(dtype, indices.shape[:axis] + (depth,) + indices.shape[axis:])


def _onehot_np(
    indices: Any, depth: int, on_value: float, off_value: float, axis: int, dtype: DType
) -> Any:
    hot = indices[..., None] == np.arange(depth)
    out = np.where(hot, np.asarray(on_value, dtype.np), np.asarray(off_value, dtype.np))
    return np.moveaxis(out, -1, axis % (indices.ndim + 1)).astype(dtype.np, copy=False)


def _onehot_jax(
    indices: Any, depth: int, on_value: float, off_value: float, axis: int, dtype: DType
) -> Any:
    hot = indices[..., None] == jnp.arange(depth, dtype=indices.dtype)
    out = jnp.where(hot, jnp.asarray(on_value, dtype.np), jnp.asarray(off_value, dtype.np))
    return jnp.moveaxis(out, -1, axis % (indices.ndim + 1))


_ONE_HOT_NOTE = """\
**OneHot** takes its strategy in MindSpore's form `((dp, mp), (), ())`: the first
tuple splits the output `indices.shape + (depth,)` (depth at `axis`), the depth included; the
two `()` stand for the on and off values. A rank holding classes `[start, start + depth / mp)`
looks up `indices - start` with the local depth (other classes give off_value). The older
form, one tuple for the indices (depth whole on every rank), still works. Out-of-range and
negative indices give a row of off_value."""

def one_hot_labels(ctx: OpContext) -> Labels:
    idx = ctx.in_types[0]
    lab = ALPHA[: idx.rank]
    fresh = fresh_labels(1, set(lab))[0]
    axis = ctx.attrs.get("axis", -1) % (idx.rank + 1)
    return Labels([lab], [lab[:axis] + fresh + lab[axis:]], {fresh})


class _OffsetOneHot(Expansion):
    """OneHot with a split depth axis: this rank holds classes [start, start + depth) of the
    output, so it looks up `indices - start` (outside [0, depth): all off_value)."""

    def operands(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
                 sharding: OpSharding) -> list[Value]:
        idx = operands[0]
        axis = int(node.attrs["axis"]) % len(sharding.out_layouts[0].shape)
        start = lower.rank_constant(RankScalar(layout_offsets(sharding.out_layouts[0]), axis),
                                    idx.dtype)
        shifted = b.emit("Sub", [idx, start],
                         parallel=ParallelInfo(
                             reason=f"OneHot '{node.instance_name}': each rank holds a slice "
                                    "of the classes (its depth axis is split); the indices are "
                                    "shifted by the first class it holds"))
        return [shifted] + operands[1:]


OFFSET_ONE_HOT = _OffsetOneHot()


class OneHotRule(LabelRule):
    """OneHot takes its strategy in two forms: one tuple for the indices (the depth axis is
    whole on every rank), or MindSpore's `((dp, mp), (), ())`, which splits the output
    `indices.shape + (depth,)` (depth at `axis`), depth included, followed by empty strategies
    for the on/off values. A rank holding depth slice [start, start + depth / k) looks up
    `indices - start` with the local depth (indices outside fall off the table: all off_value);
    `start` differs by rank ("offset_one_hot")."""

    def __init__(self) -> None:
        super().__init__(one_hot_labels, unsplittable="the depth axis")

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        idx = ctx.in_types[0]
        if not (len(strategy) == 3 and strategy[1] == () and strategy[2] == ()):
            return label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        out_split = tuple(strategy[0])
        out = ctx.out_types[0]
        if len(out_split) != out.rank:
            raise StrategyError(
                f"the first strategy of OneHot's MindSpore form splits the output "
                f"{out.shape}, so it has {out.rank} values; got {out_split}"
            )
        axis = int(ctx.attrs.get("axis", -1)) % out.rank
        depth = out.shape[axis]
        if depth % out_split[axis]:
            raise StrategyError(
                f"the depth {depth} (dim {axis} of the output {out.shape}) cannot be divisible "
                f"by strategy value {out_split[axis]}",
                f"choose a split of the depth that divides {depth}",
            )
        lab = ALPHA[: idx.rank]
        fresh = fresh_labels(1, set(lab))[0]
        virtual = OpContext(ctx.op, [idx, TensorType(idx.dtype, (depth,))], out, ctx.attrs,
                            ctx.devices)
        labels = Labels([lab, fresh], [lab[:axis] + fresh + lab[axis:]])
        idx_split = out_split[:axis] + out_split[axis + 1:]
        result = label_sharding(virtual, labels, (idx_split, (out_split[axis],)), out_strategy)
        result.in_layouts = result.in_layouts[:1]
        result.tensor_maps = None
        result.strategy = tuple(strategy)
        if out_split[axis] > 1:
            result.local_attrs["depth"] = depth // out_split[axis]
            result.expand = OFFSET_ONE_HOT
        return result


def _onehot_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    rank = len(ins[0][0])
    axis = attrs["axis"] % (rank + 1)
    for d in range(rank):
        yield Same(In(0, d), Out(d if d < axis else d + 1))
    yield Index(0, Out(axis), total=True)  # an index >= depth gives a row of off_value


def _onehot_rewrite(attrs: dict[str, Any], old_in: Any, old_out: Any, new_in: Any,
                    new_out: Any) -> dict[str, Any]:
    rank = len(new_in[0][0])
    return {**attrs, "depth": new_out[0][attrs["axis"] % (rank + 1)]}


define("OneHot", _onehot_infer, _onehot_np, _onehot_jax,
       attrs={
           "depth": 1,
           "on_value": 1.0,
           "off_value": 0.0,
           "axis": -1,
           "dtype": DType.float32,
       }, num_inputs=1, differentiable=False, sharding=OneHotRule(),
       traits=frozenset({Trait.BATCH_ONLY}),
       doc="on_value where indices == k along a new depth dim at axis, off_value elsewhere "
           "(out-of-range indices give all off_value).", section="shape",
       operands="int indices; `depth`, `on_value`, `off_value`, `axis`, `dtype`",
       dtypes=frozenset({DType.int32, DType.int64}),
       rule="MindSpore's `((dp, mp), (), ())` splits the output, depth included",
       tests=("test_ops_shape.py::test_one_hot",
              "test_parallel.py::test_every_rule_matches_the_oracle",
              "test_parallel_ops.py::test_one_hot_mindspore_form_matches_the_oracle",
              "test_parallel_ops.py::test_one_hot_forms_agree_and_name_problems",
              "test_mindformers_ops.py::test_one_hot_mindspore_strategy_splits_depth_and_trains_lik"
              "e_one_device"),
       note=_ONE_HOT_NOTE, dims=DimRule(_onehot_dims, _onehot_rewrite))
