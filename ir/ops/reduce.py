"""Reductions (ReduceSum, ReduceMean, ReduceMax, ReduceMin), BroadcastTo, Tile, ZerosLike and
OnesLike.

Reductions take `axis`: a tuple of ints (negative counts from the end; `()` reduces every axis)
and `keep_dims`: whether reduced axes stay as size-1 dims. The result has the input's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, In, Out, Product, Same, broadcast
from pcompile.ir.errors import ShapeError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops._define import define, elementwise
from pcompile.ir.ops._jax import jnp
from pcompile.ir.ops._util import infer_unary, tensor, unbroadcast
from pcompile.ir.registry import ALL, FLOATS, NUMERIC, InferFn, Trait
from pcompile.ir.sharding import (
    ALPHA,
    LabelRule,
    Labels,
    OpContext,
    OpSharding,
    Strategy,
    StrategyError,
    aligned_labels,
    fresh_labels,
    label_sharding,
    reduce_labels,
)
from pcompile.ir.types import DType, TensorType, ValueType

# -- axis handling --------------------------------------------------------------------------


def reduce_axes(axis: Any, rank: int) -> tuple[int, ...]:
    """Normalized, sorted axes of a reduction over a rank-`rank` input; `()` means all.

    Raises ShapeError for a malformed, out-of-range or repeated axis."""
    if isinstance(axis, int) and not isinstance(axis, bool):
        axis = (axis,)
    if not isinstance(axis, tuple) or not all(
        isinstance(a, int) and not isinstance(a, bool) for a in axis
    ):
        hint = f"; write {tuple(axis)!r}" if isinstance(axis, list) else ""
        raise ShapeError(f"axis must be a tuple of ints (or () for all axes), got {axis!r}{hint}")
    if not axis:
        return tuple(range(rank))
    out: list[int] = []
    for a in axis:
        if not -rank <= a < rank:
            valid = f"[{-rank}, {rank - 1}]" if rank else "none (the input is a scalar)"
            raise ShapeError(f"axis {a} is out of range for rank {rank}; valid axes: {valid}")
        a %= rank
        if a in out:
            raise ShapeError(f"axis {axis} names dimension {a} more than once")
        out.append(a)
    return tuple(sorted(out))


def _keep_dims_shape(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _check_keep_dims(attrs: dict[str, Any]) -> bool:
    keep = attrs["keep_dims"]
    if not isinstance(keep, bool):
        raise ShapeError(f"keep_dims must be a bool, got {keep!r}")
    return keep


def _make_reduce_infer(op: str, allowed: str) -> InferFn:
    """Inference for a reduction; `allowed` is "numeric", "float" or "any" input dtypes."""

    def infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
        x = tensor(types[0])
        if allowed == "float" and not x.dtype.is_float:
            raise ShapeError(f"needs a floating-point input, got {x.dtype.value}")
        if allowed == "numeric" and x.dtype is DType.bool_:
            raise ShapeError("needs a numeric input, got Bool (Cast it first)")
        axes = reduce_axes(attrs["axis"], x.rank)
        keep = _check_keep_dims(attrs)
        if op in ("ReduceMax", "ReduceMin"):
            empty = [a for a in axes if x.shape[a] == 0]
            if empty:
                what = "max" if op == "ReduceMax" else "min"
                raise ShapeError(f"cannot take the {what} over empty axis {empty[0]}")
        if keep:
            return x.with_shape(_keep_dims_shape(x.shape, axes))
        return x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))

    return infer


def _to_keep_dims(b: Builder, node: Node, value: Value) -> Value:
    """`value` (shaped like the reduction's result) reshaped to the keep_dims shape."""
    x = node.operands[0]
    axes = reduce_axes(node.attrs["axis"], len(x.shape))
    shape = _keep_dims_shape(x.shape, axes)
    return value if value.shape == shape else b("Reshape", value, shape=shape)


def _broadcast_back(b: Builder, node: Node, value: Value) -> Value:
    shape = node.operands[0].shape
    return value if value.shape == shape else b("BroadcastTo", value, shape=shape)


def _accumulator(dtype: np.dtype) -> np.dtype:
    """Sum 16-bit floats in float32, as XLA does."""
    return np.dtype(np.float32) if dtype.kind == "f" and dtype.itemsize < 4 else dtype


# -- ReduceSum ------------------------------------------------------------------------------


def _sum_np(x: Any, axis: Any, keep_dims: bool) -> Any:
    x = np.asarray(x)
    axes = reduce_axes(axis, x.ndim)
    out = np.sum(x, axis=axes, keepdims=keep_dims, dtype=_accumulator(x.dtype))
    return np.asarray(out).astype(x.dtype, copy=False)


def _sum_jax(x: Any, axis: Any, keep_dims: bool) -> Any:
    # dtype= keeps integer sums in the input dtype (jnp.sum would promote them).
    return jnp.sum(x, axis=reduce_axes(axis, x.ndim), keepdims=keep_dims, dtype=x.dtype)


def _sum_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [_broadcast_back(b, node, _to_keep_dims(b, node, cot))]


def _reduce_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """Kept dims follow the input; reduced dims are free (summing fewer terms)."""
    rank = len(ins[0][0])
    axes = reduce_axes(attrs["axis"], rank)
    o = 0
    for d in range(rank):
        if d in axes:
            o += 1 if attrs["keep_dims"] else 0
            continue
        yield Same(In(0, d), Out(o))
        o += 1


define("ReduceSum", _make_reduce_infer("ReduceSum", "numeric"), _sum_np, _sum_jax, vjp=_sum_vjp,
       attrs={"axis": (), "keep_dims": False}, num_inputs=1,
       sharding=LabelRule(reduce_labels("sum"), cross_batch=True),
       traits=frozenset({Trait.REDUCTION}), doc="Sum over `axis` (() = all axes).",
       section="linalg", operands="x; `axis`, `keep_dims`", dtypes=NUMERIC,
       rule="reduced dims may split (AllReduce sum)",
       tests=("test_ops_reduce.py::test_reduce", "test_ops_reduce.py::test_reduce_integer",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(_reduce_dims))

# -- ReduceMean -----------------------------------------------------------------------------


def _mean_np(x: Any, axis: Any, keep_dims: bool) -> Any:
    x = np.asarray(x)
    axes = reduce_axes(axis, x.ndim)
    out = np.mean(x, axis=axes, keepdims=keep_dims, dtype=_accumulator(x.dtype))
    return np.asarray(out).astype(x.dtype, copy=False)


def _mean_jax(x: Any, axis: Any, keep_dims: bool) -> Any:
    return jnp.mean(x, axis=reduce_axes(axis, x.ndim), keepdims=keep_dims)


def _mean_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x = node.operands[0]
    axes = reduce_axes(node.attrs["axis"], len(x.shape))
    count = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    scaled = b("RealDiv", cot, float(count))
    return [_broadcast_back(b, node, _to_keep_dims(b, node, scaled))]


define("ReduceMean", _make_reduce_infer("ReduceMean", "float"), _mean_np, _mean_jax, vjp=_mean_vjp,
       attrs={"axis": (), "keep_dims": False}, num_inputs=1,
       sharding=LabelRule(reduce_labels("sum", mean=True), cross_batch=True),
       traits=frozenset({Trait.REDUCTION}),
       doc="Mean over `axis` (() = all axes); floating-point input.", section="linalg",
       operands="x; `axis`, `keep_dims`", dtypes=FLOATS,
       rule="reduced dims may split (AllReduce sum, then divides)",
       tests=("test_ops_reduce.py::test_reduce",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(_reduce_dims))

# -- ReduceMax ------------------------------------------------------------------------------


def _max_np(x: Any, axis: Any, keep_dims: bool) -> Any:
    x = np.asarray(x)
    return np.max(x, axis=reduce_axes(axis, x.ndim), keepdims=keep_dims)


def _max_jax(x: Any, axis: Any, keep_dims: bool) -> Any:
    return jnp.max(x, axis=reduce_axes(axis, x.ndim), keepdims=keep_dims)


def _max_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    """The cotangent is shared equally by all positions equal to the max (as JAX does); the
    same for the min (ReduceMin's vjp)."""
    x = node.operands[0]
    axes = reduce_axes(node.attrs["axis"], len(x.shape))
    is_max = b("Cast", b("Equal", x, _to_keep_dims(b, node, node.result)), dst_type=x.dtype)
    ties = b("ReduceSum", is_max, axis=axes, keep_dims=True)
    share = b("RealDiv", _to_keep_dims(b, node, cot), ties)
    return [b("Mul", is_max, share)]


define("ReduceMax", _make_reduce_infer("ReduceMax", "any"), _max_np, _max_jax, vjp=_max_vjp,
       attrs={"axis": (), "keep_dims": False}, num_inputs=1,
       sharding=LabelRule(reduce_labels("max"), cross_batch=True),
       traits=frozenset({Trait.REDUCTION}),
       doc="Max over `axis` (() = all axes); gradient split evenly among ties.", section="linalg",
       operands="x; `axis`, `keep_dims`", dtypes=ALL, rule="reduced dims may split (AllReduce max)",
       tests=("test_ops_reduce.py::test_reduce", "test_ops_reduce.py::test_reduce_max_bool",
              "test_ops_reduce.py::test_reduce_max_gradient_shared_by_ties",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(_reduce_dims))

# -- ReduceMin ------------------------------------------------------------------------------


def _min_np(x: Any, axis: Any, keep_dims: bool) -> Any:
    x = np.asarray(x)
    return np.min(x, axis=reduce_axes(axis, x.ndim), keepdims=keep_dims)


def _min_jax(x: Any, axis: Any, keep_dims: bool) -> Any:
    return jnp.min(x, axis=reduce_axes(axis, x.ndim), keepdims=keep_dims)


define("ReduceMin", _make_reduce_infer("ReduceMin", "any"), _min_np, _min_jax, vjp=_max_vjp,
       attrs={"axis": (), "keep_dims": False}, num_inputs=1,
       sharding=LabelRule(reduce_labels("min"), cross_batch=True),
       traits=frozenset({Trait.REDUCTION}),
       doc="Min over `axis` (() = all axes); gradient split evenly among ties.", section="linalg",
       operands="x; `axis`, `keep_dims`", dtypes=ALL, rule="reduced dims may split (AllReduce min)",
       tests=("test_ops_reduce.py::test_reduce", "test_ops_reduce.py::test_reduce_integer",
              "test_ops_reduce.py::test_reduce_min_of_bool_and_ties",
              "test_parallel_ops.py::test_rule_matches_the_oracle"), dims=DimRule(_reduce_dims))

# -- BroadcastTo ----------------------------------------------------------------------------


def broadcast_target(shape: Any, src: tuple[int, ...]) -> tuple[int, ...]:
    """The concrete result shape of broadcasting `src` to `shape` (where -1 keeps the input's
    dim, as in MindSpore); ShapeError when numpy broadcasting does not allow it."""
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        hint = f"; write {tuple(shape)!r}" if isinstance(shape, list) else ""
        raise ShapeError(f"shape must be a tuple of ints, got {shape!r}{hint}")
    if len(shape) < len(src):
        raise ShapeError(
            f"cannot broadcast rank {len(src)} input {src} to lower rank {len(shape)} {shape}"
        )
    lead = len(shape) - len(src)
    out: list[int] = []
    for i, d in enumerate(shape):
        s = src[i - lead] if i >= lead else None
        if d == -1:
            if s is None:
                raise ShapeError(f"shape {shape}: -1 at new leading dim {i} has no input dim")
            d = s
        elif d < 0:
            raise ShapeError(f"shape {shape} has negative dim {d} (only -1 = keep is allowed)")
        elif s is not None and s != d and s != 1:
            raise ShapeError(
                f"cannot broadcast {src} to {shape}: input dim {i - lead} is {s}, "
                f"which is neither 1 nor {d}"
            )
        out.append(d)
    return tuple(out)


def _broadcast_to_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if attrs["shape"] is None:
        raise ShapeError("needs attribute shape, e.g. shape=(4, 8)")
    return x.with_shape(broadcast_target(attrs["shape"], x.shape))


def _broadcast_to_np(x: Any, shape: tuple[int, ...]) -> Any:
    x = np.asarray(x)
    # A copy: np.broadcast_to returns a read-only view with zero strides.
    return np.array(np.broadcast_to(x, broadcast_target(shape, x.shape)))


def broadcast_to_labels(ctx: OpContext) -> Labels:
    t = ctx.in_types[0]
    out = ctx.out_types[0]
    olab = ALPHA[: out.rank]
    lead = out.rank - t.rank
    lab, unsplit = aligned_labels(t.shape, out.shape, olab, set(olab))
    unsplit |= set(olab[:lead]) | {olab[lead + j] for j, s in enumerate(t.shape)
                                   if s == 1 and out.shape[lead + j] != 1}
    return Labels([lab], [olab], unsplit)


define("BroadcastTo", _broadcast_to_infer, _broadcast_to_np,
       lambda x, shape: jnp.broadcast_to(x, broadcast_target(shape, x.shape)),
       vjp=lambda b, node, cot: [unbroadcast(b, cot, node.operands[0].shape)],
       attrs={"shape": None}, num_inputs=1, sharding=LabelRule(broadcast_to_labels),
       doc="Broadcast x to `shape` with numpy rules (-1 keeps the input's dim).", section="shape",
       operands="x; `shape` (-1 keeps a dim)", dtypes=ALL, rule="broadcast dims never split",
       tests=("test_ops_reduce.py::test_broadcast_to",),
       dims=DimRule(broadcast, rewrite=lambda attrs, oi, oo, ni, no: {**attrs,
                                                                      "shape": tuple(no[0])},
                    preserves_values=True))

# -- Tile ---------------------------------------------------------------------------------------


def tile_multiples(multiples: Any, rank: int) -> tuple[int, ...]:
    """`multiples` checked and padded with leading 1s to at least `rank` entries (x is padded
    with leading size-1 dims to as many), as np.tile and MindSpore's Tile do."""
    if not isinstance(multiples, tuple) or not all(
        isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in multiples
    ):
        hint = f"; write {tuple(multiples)!r}" if isinstance(multiples, list) else ""
        raise ShapeError(f"multiples must be a tuple of positive ints, got {multiples!r}{hint}")
    return (1,) * (rank - len(multiples)) + multiples


def _tile_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if attrs["multiples"] is None:
        raise ShapeError("needs attribute multiples, e.g. multiples=(1, 2)")
    reps = tile_multiples(attrs["multiples"], x.rank)
    padded = (1,) * (len(reps) - x.rank) + x.shape
    return x.with_shape(tuple(m * d for m, d in zip(reps, padded)))


def _tile_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    """Sum the copies: view the cotangent as (m0, d0, m1, d1, ...) and reduce the m axes."""
    x = node.operands[0]
    reps = tile_multiples(node.attrs["multiples"], len(x.shape))
    padded = (1,) * (len(reps) - len(x.shape)) + tuple(x.shape)
    if all(m == 1 for m in reps):
        return [_reshape_same(b, cot, tuple(x.shape))]
    split = tuple(v for m, d in zip(reps, padded) for v in (m, d))
    axes = tuple(2 * i for i, m in enumerate(reps) if m > 1)
    summed = b("ReduceSum", b("Reshape", cot, shape=split), axis=axes, keep_dims=False)
    return [_reshape_same(b, summed, tuple(x.shape))]


def _reshape_same(b: Builder, value: Value, shape: tuple[int, ...]) -> Value:
    return value if value.shape == shape else b("Reshape", value, shape=shape)


_TILE_NOTE = """\
**Tile** follows MindSpore's tile_info: the strategy has one value per multiple (per output
dim; one per dim of x is read with leading 1s, as the searches give it). A dim whose multiple
is > 1 splits its *copies*: every rank holds the whole input dim and tiles it
`multiple / split` times (the split divides the multiple); a dim whose multiple is 1 splits
the input dim; a new leading dim of multiple 1 is not split. So mindformers'
`tile_kv.shard(((dp, mp, 1, 1),))` with multiples `(1, 1, rep, 1)` splits batch and kv heads
and tiles every head fully. An `out_strategy` may give the copies' splits instead (1 or the
same in `in_strategy`; dims of multiple 1 split alike in both); with `Layout`s, an input dim
whose multiple and size are both > 1 is not split, and the out layout splits the copies of
tiled dims by a divisor of their multiple and maps every other dim as the input does.
`multiples` may be shorter than x's rank (leading 1s) or longer (x gains leading size-1 dims),
as in numpy. The searches do not split copies (only a given strategy does). The vjp reshapes
the cotangent to `(m0, d0, m1, d1, ...)` and sums the copies."""

def tile_labels(ctx: OpContext) -> Labels:
    """A dim with multiple 1 is shared by input and output; a dim with multiple > 1 is never
    split in the input (every rank holds the whole input dim), and its output label appears
    in no input, so only an explicit strategy (TileRule.apply) splits its copies."""
    x = ctx.in_types[0]
    out = ctx.out_types[0]
    olab = ALPHA[: out.rank]
    reps = _tile_reps(ctx)
    lead = out.rank - x.rank
    fresh = fresh_labels(x.rank, set(olab))
    lab = "".join(fresh[j] if reps[lead + j] > 1 else olab[lead + j] for j in range(x.rank))
    return Labels([lab], [olab], {c for c in lab if c not in olab})


def _tile_reps(ctx: OpContext) -> tuple[int, ...]:
    reps = tuple(ctx.attrs.get("multiples") or ())
    return (1,) * (ctx.out_types[0].rank - len(reps)) + reps


class TileRule(LabelRule):
    """Tile (MindSpore's tile_info): the strategy has one value per multiple (per output dim;
    one per input dim is also read, with leading 1s, as the searches give it); a dim whose
    multiple is > 1 splits the multiple (each rank tiles its share of the copies of the whole
    input dim: local multiple = multiple / split), a dim whose multiple is 1 splits the input
    dim. An `out_strategy` (or out Layout) may split the copies of tiled dims instead."""

    def __init__(self) -> None:
        super().__init__(tile_labels, unsplittable="a tiled dim (multiple > 1): the strategy "
                                                  "splits its copies instead")

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        x, out = ctx.in_types[0], ctx.out_types[0]
        reps = _tile_reps(ctx)
        lead = out.rank - x.rank
        if len(strategy) != 1:
            raise StrategyError(
                f"the strategy has {len(strategy)} entries but Tile has 1 tensor input",
                "give one tuple with a split per multiple",
            )
        split = tuple(strategy[0])
        if lead and len(split) == x.rank:
            split = (1,) * lead + split  # one split per input dim: the new dims whole
        if len(split) != out.rank:
            raise StrategyError(
                f"the strategy {strategy} has {len(split)} values, but Tile's strategy has one "
                f"per multiple: {out.rank} (multiples {ctx.attrs.get('multiples')}, x of rank "
                f"{x.rank})",
                f"give {out.rank} values",
            )
        if out_strategy is not None:
            split = _tile_out_split(reps, split, out_strategy)
        for i, (m, count) in enumerate(zip(reps, split)):
            if m > 1 and m % count:
                raise StrategyError(
                    f"dim {i} is tiled {m} times, and the strategy of a tiled dim splits its "
                    f"multiple: {m} cannot be divisible by strategy value {count}",
                    f"choose a split that divides the multiple {m}",
                )
        padded = (1,) * lead + x.shape
        # The strategy splits a virtual tensor: the multiple of a tiled dim, else the dim.
        extent = tuple(m if m > 1 else d for m, d in zip(reps, padded))
        virtual = OpContext(ctx.op, [TensorType(x.dtype, extent)], TensorType(x.dtype, extent),
                            ctx.attrs, ctx.devices)
        lab = ALPHA[: out.rank]
        base = label_sharding(virtual, Labels([lab], [lab]), (split,))
        tmap = base.in_layouts[0].tensor_map
        in_map = tuple(-1 if reps[lead + j] > 1 else tmap[lead + j] for j in range(x.rank))
        return OpSharding(
            tuple(strategy), base.dev_matrix,
            [TensorLayout(base.dev_matrix, in_map, x.shape)],
            [TensorLayout(base.dev_matrix, tmap, out.shape)],
            local_attrs={"multiples": _local_multiples(reps, split)},
        )

    def apply_layouts(self, ctx: OpContext, layouts: list[TensorLayout],
                      out_layout: TensorLayout | None) -> OpSharding | None:
        """In and out `Layout`s (tile_info's CheckInputLayout / CheckOutputLayout): an input
        dim whose multiple and size are both > 1 is not split; the out layout may split the
        copies of a tiled dim by a divisor of its multiple, and maps every other dim as the
        input does."""
        x, out = ctx.in_types[0], ctx.out_types[0]
        reps = _tile_reps(ctx)
        lead = out.rank - x.rank
        lay = layouts[0]
        for j, count in enumerate(lay.splits):
            if reps[lead + j] > 1 and x.shape[j] > 1 and count > 1:
                raise StrategyError(
                    f"dim {j} of the input should not be split, because its multiple "
                    f"({reps[lead + j]}) and its size ({x.shape[j]}) are both greater than 1",
                    "leave it unsplit and split its copies with an out_strategy layout",
                )
        follow = (-1,) * lead + tuple(lay.tensor_map)
        if out_layout is None:
            out_layout = TensorLayout(lay.dev_matrix, follow, out.shape)
        if out_layout.dev_matrix != lay.dev_matrix:
            raise StrategyError(
                f"the out layout's device matrix {out_layout.dev_matrix} differs from the "
                f"input's {lay.dev_matrix}"
            )
        split = out_layout.splits
        for i, m in enumerate(reps):
            if m > 1 and m % split[i]:
                raise StrategyError(
                    f"the multiple {m} of output dim {i} is not divisible by its split "
                    f"{split[i]} in the out layout",
                    f"split the copies by a divisor of {m}",
                )
            if m == 1 and out_layout.tensor_map[i] != follow[i]:
                raise StrategyError(
                    f"output dim {i} has multiple 1, so the out layout must map it as the "
                    f"input does ({follow[i]}), got {out_layout.tensor_map[i]}"
                )
        return OpSharding(
            (lay.splits,), lay.dev_matrix, [lay], [out_layout],
            local_attrs={"multiples": _local_multiples(reps, split)},
        )


def _tile_out_split(reps: tuple[int, ...], split: tuple[int, ...], out_strategy: Strategy
                    ) -> tuple[int, ...]:
    """The split per output dim of in_strategy `split` with `out_strategy`: the copies of a
    tiled dim split as out_strategy says (in_strategy gives 1 or the same), every other dim as
    in_strategy."""
    if len(out_strategy) != 1 or len(out_strategy[0]) != len(reps):
        raise StrategyError(
            f"out_strategy {out_strategy} must have one tuple of {len(reps)} values (one per "
            "output dim)"
        )
    merged = []
    for i, (m, s_in, s_out) in enumerate(zip(reps, split, out_strategy[0])):
        if m > 1 and s_in not in (1, s_out):
            raise StrategyError(
                f"dim {i} is tiled {m} times: in_strategy splits its copies {s_in} ways but "
                f"out_strategy {s_out} ways",
                "give the split of the copies in out_strategy and 1 in in_strategy",
            )
        if m == 1 and s_in != s_out:
            raise StrategyError(
                f"out_strategy {out_strategy} splits dim {i} (multiple 1) {s_out} ways but "
                f"in_strategy {s_in} ways; only the copies of tiled dims may differ",
                "give dims with multiple 1 the same split in both",
            )
        merged.append(s_out if m > 1 else s_in)
    return tuple(merged)


def _local_multiples(reps: tuple[int, ...], split: tuple[int, ...]) -> tuple[int, ...]:
    """Each rank's multiples: the copies of a tiled dim shared by its split, 1 elsewhere."""
    return tuple(m // c if m > 1 else 1 for m, c in zip(reps, split))


def _tile_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """out = in * multiple; a tiled size-1 dim is free (its multiple follows the result)."""
    x, out = ins[0][0], outs[0]
    lead = len(out) - len(x)
    for d, n in enumerate(x):
        if n != 1:
            yield Product((In(0, d),), (Out(lead + d),), out[lead + d] // n)


def _tile_rewrite(attrs: dict[str, Any], old_in: Any, old_out: Any, new_in: Any,
                  new_out: Any) -> dict[str, Any]:
    x, out = new_in[0][0], new_out[0]
    padded = (1,) * (len(out) - len(x)) + tuple(x)
    return {**attrs, "multiples": tuple(o // i for o, i in zip(out, padded))}


define("Tile", _tile_infer, lambda x, multiples: np.tile(x, multiples),
       lambda x, multiples: jnp.tile(x, multiples), vjp=_tile_vjp, attrs={"multiples": None},
       num_inputs=1, sharding=TileRule(),
       doc="x repeated multiples[i] times along dim i (x padded with leading size-1 dims, "
           "multiples with leading 1s, to one rank).", section="shape", operands="x; `multiples`",
       dtypes=ALL,
       rule="a dim with multiple > 1 splits its copies, a dim with multiple 1 splits the input dim",
       tests=("test_ops_shape.py::test_tile", "test_ops_shape.py::test_tile_as_repeat_kv",
              "test_parallel_ops.py::test_tile_rule_matches_the_oracle",
              "test_parallel_ops.py::test_tile_strategy_of_a_tiled_dim_splits_its_multiple",
              "test_tile_sharding.py::test_tile_strategies_of_every_multiple_match_the_oracle",
              "test_tile_sharding.py::test_tile_networks_train_like_one_device",
              "test_mindformers_ops.py::test_tile_as_repeat_kv_calls_it_trains_like_one_device"),
       note=_TILE_NOTE, dims=DimRule(_tile_dims, rewrite=_tile_rewrite, preserves_values=True))

# -- ZerosLike / OnesLike -------------------------------------------------------------------

elementwise("ZerosLike", infer_unary, lambda x: np.zeros_like(x), lambda x: jnp.zeros_like(x),
            differentiable=False, doc="Zeros of x's shape and dtype.", dtypes=ALL,
            tests=("test_ops_reduce.py::test_zeros_ones_like",))

elementwise("OnesLike", infer_unary, lambda x: np.ones_like(x), lambda x: jnp.ones_like(x),
            differentiable=False, doc="Ones of x's shape and dtype.", dtypes=ALL,
            tests=("test_ops_reduce.py::test_zeros_ones_like",))
