"""Matrix products: MatMul (2-D) and BatchMatMul (batched, numpy-broadcast batch dims)."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Node, Value
from pcompile.ir.dims import DimRule, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define
from pcompile.ir.ops._jax import jnp
from pcompile.ir.ops._util import broadcast_shapes, same_dtype, tensor, unbroadcast
from pcompile.ir.registry import NUMERIC, Trait
from pcompile.ir.sharding import ALPHA, LabelRule, Labels, OpContext, aligned_labels
from pcompile.ir.types import DType, TensorType, ValueType


def _check_flags(attrs: dict[str, Any]) -> tuple[bool, bool]:
    flags = []
    for name in ("transpose_a", "transpose_b"):
        value = attrs[name]
        if not isinstance(value, bool):
            raise ShapeError(f"attribute {name} must be a bool, got {value!r}")
        flags.append(value)
    return flags[0], flags[1]


def _matrix_dims(a: TensorType, b: TensorType, ta: bool, tb: bool) -> tuple[int, int, int]:
    """(M, N, K) of op(a) @ op(b) from the last two dims; ShapeError when K differs."""
    m, ka = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if tb else (b.shape[-2], b.shape[-1])
    if ka != kb:
        a_desc = f"a{' (transposed)' if ta else ''} has {ka} columns"
        b_desc = f"b{' (transposed)' if tb else ''} has {kb} rows"
        raise ShapeError(
            f"contraction dims differ: {a_desc} but {b_desc}; "
            "they must be equal (check transpose_a/transpose_b)"
        )
    return m, n, ka


def _check_dtype(a: TensorType, b: TensorType) -> DType:
    dtype = same_dtype([a, b])
    if dtype is DType.bool_:
        raise ShapeError("needs numeric operands, got Bool")
    return dtype


def _np_matmul(a: Any, b: Any, ta: bool, tb: bool) -> Any:
    a = np.swapaxes(a, -1, -2) if ta else a
    b = np.swapaxes(b, -1, -2) if tb else b
    return np.matmul(a, b).astype(a.dtype, copy=False)


def _jax_matmul(a: Any, b: Any, ta: bool, tb: bool,
                permutation: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Any:
    if permutation is not None:  # b is a signed permutation (`signed_permutation_attrs`)
        return _permute_columns(a, *permutation)
    a = jnp.swapaxes(a, -1, -2) if ta else a
    b = jnp.swapaxes(b, -1, -2) if tb else b
    return jnp.matmul(a, b)


def _permute_columns(a: Any, rows: tuple[int, ...], signs: tuple[int, ...]) -> Any:
    """a[..., rows] * signs: runs of consecutive rows with one sign as slices (rotate-half is
    two), joined; a gather when there are many runs."""
    runs: list[list[int]] = []  # [first row, length, sign]
    for r, sign in zip(rows, signs):
        if runs and runs[-1][0] + runs[-1][1] == r and runs[-1][2] == sign:
            runs[-1][1] += 1
        else:
            runs.append([r, 1, sign])
    if len(runs) > 8:
        return jnp.take(a, np.asarray(rows), axis=-1) * jnp.asarray(signs, a.dtype)
    parts = [a[..., r:r + n] if sign == 1 else -a[..., r:r + n] for r, n, sign in runs]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def signed_permutation(matrix: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(rows, signs) when every column j of the 2-D `matrix` holds exactly one nonzero,
    `signs[j]` (+1 or -1), in row `rows[j]`, and every row exactly one: then
    `x @ matrix == x[..., rows] * signs`. Else None."""
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.dtype.kind not in "fiu":
        return None
    nonzero = matrix != 0
    if not ((nonzero.sum(0) == 1).all() and (nonzero.sum(1) == 1).all()):
        return None
    rows = nonzero.argmax(0)
    signs = matrix[rows, np.arange(matrix.shape[1])]
    if not np.isin(signs, (1, -1)).all():
        return None
    return tuple(int(r) for r in rows), tuple(int(x) for x in signs)


def signed_permutation_attrs(node: Node, attrs: dict[str, Any]) -> dict[str, Any]:
    """`lowering_attrs` of MatMul and BatchMatMul: when b is a constant 2-D signed permutation
    (op(b) as the product reads it; mindformers' rotary embedding rotates half of each head by
    a BatchMatMul with such a swap matrix, forward and, transposed, backward) and a is not
    transposed, the JAX implementation gathers a's columns and flips their signs instead of
    multiplying: the same values for finite a (each result is one element of a times +1 or
    -1, plus zeros), without the matrix product. A NaN or infinity in a stays in its own
    column where the product would spread NaN along the row; the numpy interpreter (the
    oracle) always multiplies. Anything else keeps `attrs`."""
    b = node.operands[1]
    if attrs.get("transpose_a") or type(b) is not Constant or b.array.ndim != 2:
        return attrs
    transposed = bool(attrs.get("transpose_b"))
    key = (id(b.array), transposed)
    found = _PERMUTATIONS.get(key)
    if found is None or found[0]() is not b.array:
        found = (weakref.ref(b.array),
                 signed_permutation(b.array.T if transposed else b.array))
        _PERMUTATIONS[key] = found
    return attrs if found[1] is None else {**attrs, "permutation": found[1]}


# (id of a constant's array, transposed) -> (weak reference to it, signed_permutation or None)
_PERMUTATIONS: dict[tuple[int, bool], tuple[Any, Any]] = {}


def _jax_matmul_op(a: Any, b: Any, transpose_a: bool, transpose_b: bool,
                   permutation: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Any:
    return _jax_matmul(a, b, transpose_a, transpose_b, permutation)


def _matmul_cotangents(b: Builder, op: str, node: Node, cot: Value) -> tuple[Value, Value]:
    """d a and d b of `op(a, b)` before any un-broadcasting: each is again `op` with flags
    chosen so no explicit transpose is needed (C = op(A) op(B))."""
    x, y = node.operands
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    if not ta:
        # dA = dC op(B)^T
        da = b(op, cot, y, transpose_a=False, transpose_b=not tb)
    else:
        # dA = (dC op(B)^T)^T = op(B) dC^T
        da = b(op, y, cot, transpose_a=tb, transpose_b=True)
    if not tb:
        # dB = op(A)^T dC
        db = b(op, x, cot, transpose_a=not ta, transpose_b=False)
    else:
        # dB = (op(A)^T dC)^T = dC^T op(A)
        db = b(op, cot, x, transpose_a=True, transpose_b=ta)
    return da, db


# -- MatMul ---------------------------------------------------------------------------------


def _matmul_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    a, b = tensor(types[0], "a"), tensor(types[1], "b")
    ta, tb = _check_flags(attrs)
    if a.rank != 2 or b.rank != 2:
        raise ShapeError(
            f"needs 2-D operands, got ranks {a.rank} and {b.rank}; "
            "use BatchMatMul for batched (rank >= 3) products"
        )
    dtype = _check_dtype(a, b)
    m, n, _ = _matrix_dims(a, b, ta, tb)
    return TensorType(dtype, (m, n))


def _matmul_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    da, db = _matmul_cotangents(b, "MatMul", node, cot)
    return [da, db]


def _transpose_ab(lab: str, flag: bool) -> str:
    return lab[:-2] + lab[-1] + lab[-2] if flag else lab


def _logical_a_order(a: str, transpose_a: bool) -> tuple[str, ...]:
    """MindSpore orders a MatMul's device matrix as the logical operand, `[batch..., M, K]`
    then `N` (it swaps the last two values of a transposed a's strategy first), so that a
    Transpose feeding `transpose_a` and the op after the MatMul's AllReduce read their
    layouts as they are. Only a transposed a changes the order of first appearance."""
    return tuple(_transpose_ab(a, True)) if transpose_a else ()


def matmul_labels(ctx: OpContext) -> Labels:
    ta = bool(ctx.attrs.get("transpose_a"))
    a = _transpose_ab("ik", ta)
    b = _transpose_ab("kj", bool(ctx.attrs.get("transpose_b")))
    return Labels([a, b], ["ij"], dev_order=_logical_a_order(a, ta))


def _matmul_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """m, n follow the result, the contraction is shared; batch dims broadcast."""
    a, b, out = ins[0][0], ins[1][0], outs[0]
    ta, tb = attrs["transpose_a"], attrs["transpose_b"]
    ra, rb, ro = len(a), len(b), len(out)
    am, ak = (ra - 1, ra - 2) if ta else (ra - 2, ra - 1)
    bk, bn = (rb - 1, rb - 2) if tb else (rb - 2, rb - 1)
    yield Same(In(0, am), Out(ro - 2))
    yield Same(In(1, bn), Out(ro - 1))
    yield Same(In(0, ak), In(1, bk))
    for i, shape in enumerate((a, b)):
        for d in range(len(shape) - 2):
            od = ro - 2 - (len(shape) - 2) + d
            if shape[d] == out[od] and shape[d] != 1:
                yield Same(In(i, d), Out(od))


define("MatMul", _matmul_infer,
       lambda a, b, transpose_a, transpose_b: _np_matmul(a, b, transpose_a, transpose_b),
       _jax_matmul_op, lowering_attrs=signed_permutation_attrs, vjp=_matmul_vjp,
       attrs={"transpose_a": False, "transpose_b": False}, num_inputs=2,
       sharding=LabelRule(matmul_labels), traits=frozenset({Trait.MATMUL, Trait.REDUCTION}),
       doc="op(a) @ op(b) for 2-D a, b; op transposes when transpose_a/transpose_b is set.",
       section="linalg", operands="a, b; `transpose_a`, `transpose_b`", dtypes=NUMERIC,
       rule="`ik,kj->ij`; a split k all-reduces (or reduce-scatters with `out_strategy`); "
            "device matrix `[M, K, N]` of the logical operands, whatever `transpose_a`",
       tests=("test_ops_linalg.py::test_matmul", "test_ops_linalg.py::test_matmul_int32",
              "test_parallel.py::test_every_rule_matches_the_oracle",
              "test_parallel.py::test_reduce_scatter_out_strategy",
              "test_matmul_transpose_a.py::test_the_device_matrix_is_the_logical_operands"),
       dims=DimRule(_matmul_dims))

# -- BatchMatMul ----------------------------------------------------------------------------


def _batch_matmul_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    a, b = tensor(types[0], "a"), tensor(types[1], "b")
    ta, tb = _check_flags(attrs)
    # One operand may be a plain matrix shared by every batch (MindSpore broadcasts it);
    # the vjp relies on this, since it passes the cotangent with a rank-2 operand either side.
    if a.rank < 2 or b.rank < 2 or max(a.rank, b.rank) < 3:
        raise ShapeError(
            f"needs rank >= 3 operands (one of them may be a rank-2 matrix), got ranks "
            f"{a.rank} and {b.rank}; use MatMul for two 2-D operands"
        )
    dtype = _check_dtype(a, b)
    m, n, _ = _matrix_dims(a, b, ta, tb)
    try:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ShapeError:
        raise ShapeError(
            f"batch dims {a.shape[:-2]} and {b.shape[:-2]} do not broadcast; each pair "
            "(aligned from the right) must be equal or contain a 1"
        ) from None
    return TensorType(dtype, batch + (m, n))


def _batch_matmul_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    da, db = _matmul_cotangents(b, "BatchMatMul", node, cot)
    # The cotangents carry the broadcast batch dims; sum them back to each operand's shape.
    return [unbroadcast(b, da, x.shape), unbroadcast(b, db, y.shape)]


def batch_matmul_labels(ctx: OpContext) -> Labels:
    out = ctx.out_types[0]
    batch = out.rank - 2
    blab = ALPHA[:batch]
    used = set(blab) | set("ikj")
    ins, unsplit = [], set()
    for t, tail, flag in ((ctx.in_types[0], "ik", ctx.attrs.get("transpose_a")),
                          (ctx.in_types[1], "kj", ctx.attrs.get("transpose_b"))):
        lab, fresh = aligned_labels(t.shape[:-2], out.shape[:-2], blab, used)
        unsplit |= fresh
        ins.append(_transpose_ab(lab + tail, bool(flag)))
    ta = bool(ctx.attrs.get("transpose_a"))
    order = tuple(n for n in _logical_a_order(ins[0], ta) if n not in unsplit)
    return Labels(ins, [blab + "ij"], unsplit, broadcast=frozenset(unsplit), dev_order=order)


define("BatchMatMul", _batch_matmul_infer,
       lambda a, b, transpose_a, transpose_b: _np_matmul(a, b, transpose_a, transpose_b),
       _jax_matmul_op, lowering_attrs=signed_permutation_attrs, vjp=_batch_matmul_vjp,
       attrs={"transpose_a": False, "transpose_b": False}, num_inputs=2,
       sharding=LabelRule(batch_matmul_labels), traits=frozenset({Trait.MATMUL, Trait.REDUCTION}),
       doc="Batched op(a) @ op(b) over the last two dims; leading batch dims broadcast numpy-style "
           "and one operand may be a rank-2 matrix.", section="linalg",
       operands="a, b (batch dims broadcast); `transpose_a`, `transpose_b`", dtypes=NUMERIC,
       rule="batch labels plus `ik,kj->ij`; device matrix `[batch..., M, K, N]` of the logical "
            "operands, whatever `transpose_a`",
       tests=("test_ops_linalg.py::test_batch_matmul",
              "test_ops_linalg.py::test_batch_matmul_rank2_rhs",
              "test_parallel.py::test_every_rule_matches_the_oracle",
              "test_matmul_transpose_a.py::test_the_device_matrix_is_the_logical_operands"),
       dims=DimRule(_matmul_dims))
