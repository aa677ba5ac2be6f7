"""Ops along one axis whose every output element depends on the order of the others: TopK,
Sort and CumSum (MindSpore 2.x semantics; the routing of a mixture of experts uses all three).

TopK and Sort return `(values, indices)`, the indices Int32 positions along the sorted axis;
equal values keep their original order (lower index first, in both directions), on both
backends. Their vjp scatters the values' cotangent back to the positions the indices name (a
OneHot of the indices times the cotangent, summed over the sorted positions); the indices
carry no gradient. CumSum's vjp is the cumulative sum of the cotangent in the other direction,
with the same `exclusive`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, Fixed, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define
from pcompile.ir.ops._jax import jnp, lax
from pcompile.ir.ops._util import normalize_axis, tensor, tuple_type
from pcompile.ir.registry import NUMERIC
from pcompile.ir.sharding import ALPHA, LabelRule, Labels, OpContext, fresh_labels, identity_labels
from pcompile.ir.types import DType, ValueType


def _numeric(x: Any) -> None:
    if x.dtype is DType.bool_:
        raise ShapeError("needs a numeric input, got Bool (Cast it first)")


def _bool_attr(attrs: dict[str, Any], name: str) -> bool:
    value = attrs[name]
    if not isinstance(value, bool):
        raise ShapeError(f"attribute {name} must be a bool, got {value!r}")
    return value


def _axis_attr(attrs: dict[str, Any], rank: int) -> int:
    axis = attrs["axis"]
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ShapeError(f"axis must be an int, got {axis!r}")
    if rank == 0:
        raise ShapeError("needs an input of rank >= 1, got a scalar")
    return normalize_axis(axis, rank)


def _sort_keys(x: Any) -> Any:
    """numpy sort keys of `x` in the same order: 16-bit floats as float32 (exact)."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype.kind in "fV" and x.dtype.itemsize < 4 else x


def _order_np(x: Any, axis: int, descending: bool) -> Any:
    """Int32 positions sorting `x` along `axis`; ties keep their original order."""
    keys = _sort_keys(x)
    if not descending:
        return np.argsort(keys, axis=axis, kind="stable").astype(np.int32)
    # Stable ascending order of the reversed axis, reversed: descending, ties in original order.
    n = keys.shape[axis]
    rev = np.argsort(np.flip(keys, axis), axis=axis, kind="stable")
    return (n - 1 - np.flip(rev, axis)).astype(np.int32)


def _order_jax(x: Any, axis: int, descending: bool) -> Any:
    n = x.shape[axis]
    iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    if not descending:
        return lax.sort((x, iota), dimension=axis, is_stable=True, num_keys=1)[1]
    rev = lax.sort((jnp.flip(x, axis), iota), dimension=axis, is_stable=True, num_keys=1)[1]
    return n - 1 - jnp.flip(rev, axis)


def _scatter_back(b: Builder, node: Node, cot: Value, indices: Value, axis: int) -> Value:
    """The cotangent of the input of a TopK or Sort along `axis`: `cot[..., j, ...]` added at
    position `indices[..., j, ...]` (one-hot of the indices, times the cotangent, summed over
    the sorted positions j)."""
    x = node.operands[0]
    depth = x.shape[axis]
    hot = b("OneHot", indices, depth=depth, on_value=1.0, off_value=0.0, axis=axis + 1,
            dtype=x.dtype)
    spread = b("Mul", hot, b("ExpandDims", cot, axis=axis + 1))
    return b("ReduceSum", spread, axis=(axis,), keep_dims=False)


# -- TopK -----------------------------------------------------------------------------------


def _top_k_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    _numeric(x)
    if x.rank == 0:
        raise ShapeError("needs an input of rank >= 1, got a scalar")
    k = attrs["k"]
    if isinstance(k, bool) or not isinstance(k, int):
        raise ShapeError(f"k must be an int, got {k!r}")
    n = x.shape[-1]
    if not 0 <= k <= n:
        raise ShapeError(f"k must be in [0, {n}] (the size of the last axis), got {k}")
    _bool_attr(attrs, "sorted")
    shape = x.shape[:-1] + (k,)
    return tuple_type(x.with_shape(shape), x.with_shape(shape).with_dtype(DType.int32))


def _top_k_np(x: Any, k: int, sorted: bool) -> Any:
    x = np.asarray(x)
    idx = _order_np(x, x.ndim - 1, True)[..., :k]
    return np.take_along_axis(x, idx, axis=-1), idx


def _top_k_jax(x: Any, k: int, sorted: bool) -> Any:
    values, indices = lax.top_k(x, k)
    return values, indices.astype(jnp.int32)


def _top_k_vjp(b: Builder, node: Node, cots: list[Value]) -> list[Value | None]:
    indices = b("TupleGetItem", node.result, index=1)
    return [_scatter_back(b, node, cots[0], indices, len(node.operands[0].shape) - 1)]


_TOP_K_NOTE = """\
**TopK** follows MindSpore's TopKInfo, and **Sort** the same rule: the sorted axis (TopK's
last axis, Sort's `axis`) is never split, every other dim may be, and the values and indices
keep the input's layout on those dims (the indices are positions along the whole axis).
Equal values keep their original order (lower index first) on both backends.
TopK always returns its values in descending order (`sorted=False` is accepted and gives the
same order). The vjp scatters the values' cotangent back to the positions the indices name;
the indices carry no gradient.

**CumSum**'s summed `axis` is never split either (a split would need the totals of the
earlier ranks' slices); other dims may be. `exclusive` leaves each element out of its own
sum, `reverse` sums from the end; 16-bit floats accumulate in float32. The vjp is the
cumulative sum of the cotangent with the same `exclusive` and the opposite `reverse`."""

def top_k_labels(ctx: OpContext) -> Labels:
    """TopK (MindSpore's TopKInfo): the last axis is sorted whole; values and indices keep the
    input's other dims, their last dim (k) is new and never split."""
    rank = ctx.in_types[0].rank
    lab = ALPHA[:rank]
    fresh = fresh_labels(1, set(lab))[0]
    out = lab[:-1] + fresh
    return Labels([lab], [out, out], {lab[-1], fresh})


def _top_k_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """Leading dims follow the input; the last axis and k keep their sizes."""
    x = ins[0][0]
    for d in range(len(x) - 1):
        for elem in (0, 1):
            yield Same(In(0, d), Out(d, elem))
    yield Fixed(In(0, len(x) - 1), "TopK's k is at most its size")
    yield Fixed(Out(len(x) - 1, 0), "TopK's k")
    yield Fixed(Out(len(x) - 1, 1), "TopK's k")


define("TopK", _top_k_infer, _top_k_np, _top_k_jax, vjp=_top_k_vjp, attrs={"k": 1, "sorted": True},
       num_inputs=1,
       sharding=LabelRule(top_k_labels, unsplittable="the sorted last axis, which every rank "
                          "needs whole to pick the top k"),
       doc="The k largest values along the last axis, descending, and their Int32 positions.",
       section="linalg", operands="x; `k`, `sorted` -> (values, Int32 indices)", dtypes=NUMERIC,
       rule="the last (sorted) axis never splits; other dims split",
       tests=("test_ops_moe.py::test_top_k_matches_jax",
              "test_ops_moe.py::test_top_k_gradient_by_finite_differences",
              "test_ops_moe.py::test_sort_rules_match_the_oracle",
              "test_ops_moe.py::test_sorted_axis_split_is_refused_with_one_message",
              "test_ops_moe.py::test_top_k_and_cumsum_on_a_batch_split_compile_like_one_device"),
       note=_TOP_K_NOTE, dims=DimRule(_top_k_dims))

# -- Sort -----------------------------------------------------------------------------------


def _sort_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    _numeric(x)
    _axis_attr(attrs, x.rank)
    _bool_attr(attrs, "descending")
    return tuple_type(x, x.with_dtype(DType.int32))


def _sort_np(x: Any, axis: int, descending: bool) -> Any:
    x = np.asarray(x)
    axis = axis % x.ndim
    idx = _order_np(x, axis, descending)
    return np.take_along_axis(x, idx, axis=axis), idx


def _sort_jax(x: Any, axis: int, descending: bool) -> Any:
    axis = axis % x.ndim
    idx = _order_jax(x, axis, descending)
    return jnp.take_along_axis(x, idx, axis=axis), idx


def _sort_vjp(b: Builder, node: Node, cots: list[Value]) -> list[Value | None]:
    indices = b("TupleGetItem", node.result, index=1)
    axis = node.attrs["axis"] % len(node.operands[0].shape)
    return [_scatter_back(b, node, cots[0], indices, axis)]


def sort_labels(ctx: OpContext) -> Labels:
    """Sort: values and indices keep the input's labels; the sorted axis never splits."""
    rank = ctx.in_types[0].rank
    lab = ALPHA[:rank]
    axis = int(ctx.attrs.get("axis", -1)) % rank
    return Labels([lab], [lab, lab], {lab[axis]})


def _along_axis_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """Every dim of every result is the input's (the sorted axis too: sorting fewer)."""
    x = ins[0][0]
    for d in range(len(x)):
        for elem in range(len(outs)):
            yield Same(In(0, d), Out(d, elem))


define("Sort", _sort_infer, _sort_np, _sort_jax, vjp=_sort_vjp,
       attrs={"axis": -1, "descending": False}, num_inputs=1,
       sharding=LabelRule(sort_labels,
                          unsplittable="the sorted axis, which every rank needs whole"),
       doc="x sorted along `axis` (ascending unless `descending`) and the Int32 positions.",
       section="linalg", operands="x; `axis`, `descending` -> (values, Int32 indices)",
       dtypes=NUMERIC, rule="the sorted axis never splits; other dims split",
       tests=("test_ops_moe.py::test_sort_matches_jax",
              "test_ops_moe.py::test_sort_gradient_by_finite_differences",
              "test_ops_moe.py::test_sort_rules_match_the_oracle",
              "test_ops_moe.py::test_sorted_axis_split_is_refused_with_one_message"),
       dims=DimRule(_along_axis_dims))

# -- CumSum ---------------------------------------------------------------------------------


def _cumsum_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    _numeric(x)
    _axis_attr(attrs, x.rank)
    _bool_attr(attrs, "exclusive")
    _bool_attr(attrs, "reverse")
    return x


def _accumulator(dtype: Any) -> Any:
    """16-bit floats accumulate in float32 (as XLA sums them); other dtypes in their own."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.kind in "fV" and dtype.itemsize < 4 else dtype


def _cumsum_np(x: Any, axis: int, exclusive: bool, reverse: bool) -> Any:
    x = np.asarray(x)
    axis = axis % x.ndim
    acc = np.flip(x, axis) if reverse else x
    out = np.cumsum(acc, axis=axis, dtype=_accumulator(x.dtype))
    if exclusive:
        lead = np.zeros_like(np.take(out, [0], axis=axis))
        out = np.concatenate([lead, np.take(out, np.arange(x.shape[axis] - 1), axis=axis)],
                             axis=axis)
    out = np.flip(out, axis) if reverse else out
    return np.ascontiguousarray(out).astype(x.dtype, copy=False)


def _cumsum_jax(x: Any, axis: int, exclusive: bool, reverse: bool) -> Any:
    axis = axis % x.ndim
    acc = jnp.flip(x, axis) if reverse else x
    out = jnp.cumsum(acc, axis=axis, dtype=_accumulator(x.dtype))
    if exclusive:
        lead = jnp.zeros_like(lax.slice_in_dim(out, 0, 1, axis=axis))
        out = jnp.concatenate([lead, lax.slice_in_dim(out, 0, x.shape[axis] - 1, axis=axis)],
                              axis=axis)
    out = jnp.flip(out, axis) if reverse else out
    return out.astype(x.dtype)


def _cumsum_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    attrs = node.attrs
    return [b("CumSum", cot, axis=attrs["axis"], exclusive=attrs["exclusive"],
              reverse=not attrs["reverse"])]


def cumsum_axes(ctx: OpContext) -> Sequence[int]:
    return (int(ctx.attrs.get("axis", 0)),)


define("CumSum", _cumsum_infer, _cumsum_np, _cumsum_jax, vjp=_cumsum_vjp,
       attrs={"axis": 0, "exclusive": False, "reverse": False}, num_inputs=1,
       sharding=LabelRule(identity_labels(cumsum_axes),
                          unsplittable="the summed axis; a split would need the totals of "
                          "the earlier ranks' slices"),
       doc="Cumulative sum along `axis` (`exclusive`: without the element itself; `reverse`: from "
           "the end).", section="linalg", operands="x; `axis`, `exclusive`, `reverse`",
       dtypes=NUMERIC, rule="the summed axis never splits; other dims split",
       tests=("test_ops_moe.py::test_cumsum_matches_jax",
              "test_ops_moe.py::test_cumsum_gradient_by_finite_differences",
              "test_ops_moe.py::test_sort_rules_match_the_oracle",
              "test_ops_moe.py::test_sorted_axis_split_is_refused_with_one_message",
              "test_ops_moe.py::test_top_k_and_cumsum_on_a_batch_split_compile_like_one_device"),
       dims=DimRule(_along_axis_dims))
