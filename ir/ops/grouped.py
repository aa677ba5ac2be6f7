"""GroupedMatmul: MindSpore's grouped matrix product (`ops.auto_generate.GroupedMatmul`,
mindformers' MoEV3 `use_gmm`), in the form MoEV3 calls it: `split_item=3`, `group_type=0`, one
2-D x, one 3-D weight and a cumulative `group_list`.

`x` (M, K) holds the tokens of every expert one after the other (sorted by expert); `weight`
(E, K, N) one matrix per expert; `group_list` (E,) integer, the cumulative end of each expert's
rows (MindSpore's group_list_type 0: expert e owns rows group_list[e-1] <= m < group_list[e]).
The result (M, N) is row m times its expert's matrix; rows at or after group_list[-1] belong to
no expert and are zero (the rows a static capacity leaves unused). The counts are known only
when the step runs, which is the point: the shapes are static bounds, the split is data.

JAX lowers it to `jax.lax.ragged_dot` with the group sizes (the differences of group_list);
numpy multiplies each expert's rows. Its vjp: dx = GroupedMatmul(dy, weight transposed), the
weight's cotangent per expert (`GroupedMatmulWeightGrad`, `jax.lax.ragged_dot_general` with
the rows as the ragged contraction); group_list carries no gradient.

Sharding (MindSpore's GroupedMatmulInfo, with one difference): the contraction K splits as
x's last dim and the weight's middle dim together, the result then partial (an AllReduce); N
splits the weight's and the result's last dim. The expert dim of the weight is never split
(MindSpore's tensor map -1), nor is group_list. MindSpore also lets x's rows split; here the
rows stay whole, since a row split of a global group_list would not compute the single-device
result (each rank would need the counts of its own rows, which only a manually written region
knows).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define, grad_helper
from pcompile.ir.ops._jax import jax, jnp
from pcompile.ir.ops._util import tensor
from pcompile.ir.registry import FLOATS, Trait
from pcompile.ir.sharding import LabelRule, Labels, OpContext
from pcompile.ir.types import DType, TensorType, ValueType

_GROUP_DTYPES = (DType.int32, DType.int64)


def _check_attrs(attrs: dict[str, Any]) -> None:
    if attrs["split_item"] != 3 or attrs["group_type"] != 0:
        raise ShapeError(
            f"split_item={attrs['split_item']!r}, group_type={attrs['group_type']!r}: pcompile "
            "implements the form mindformers' MoEV3 calls, split_item=3 (one x, one weight, one "
            "result) and group_type=0 (groups along x's rows)")


def _check_float(t: TensorType, what: str) -> None:
    if t.dtype not in FLOATS and t.dtype is not DType.float64:
        raise ShapeError(f"{what} must be a float tensor (Float16, BFloat16, Float32), got "
                         f"{t.dtype.value}")


def _check_group_list(t: TensorType, experts: int) -> None:
    if t.dtype not in _GROUP_DTYPES:
        raise ShapeError(f"group_list holds row counts: it must be Int64 or Int32, got "
                         f"{t.dtype.value}")
    if t.shape != (experts,):
        raise ShapeError(f"group_list must be ({experts},), one cumulative row end per expert "
                         f"of the weight, got shape {t.shape}")


def _gmm_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    _check_attrs(attrs)
    x, w, groups = tensor(types[0], "x"), tensor(types[1], "weight"), tensor(types[2],
                                                                             "group_list")
    _check_float(x, "x")
    if x.rank != 2 or w.rank != 3:
        raise ShapeError(f"x must be 2-D (rows, K) and weight 3-D (experts, K, N), got shapes "
                         f"{x.shape} and {w.shape}")
    if w.dtype is not x.dtype:
        raise ShapeError(f"x and weight must have one dtype, got {x.dtype.value} and "
                         f"{w.dtype.value} (Cast the weight)")
    if x.shape[1] != w.shape[1]:
        raise ShapeError(f"x has {x.shape[1]} columns but each expert's matrix {w.shape[1]} "
                         "rows; they must be equal")
    _check_group_list(groups, w.shape[0])
    return TensorType(x.dtype, (x.shape[0], w.shape[2]))


def _group_sizes(group_list: Any, rows: int, xp: Any) -> Any:
    """Each expert's row count from the cumulative ends, clipped to the rows there are (a
    decreasing end gives an empty group)."""
    ends = xp.clip(group_list.astype(np.int64), 0, rows)
    ends = xp.maximum.accumulate(ends) if xp is np else jax.lax.cummax(ends)
    starts = xp.concatenate([xp.zeros((1,), ends.dtype), ends[:-1]])
    return starts, ends


def _acc(dtype: Any) -> Any:
    return np.result_type(np.float32, dtype)


def _gmm_np(x: Any, weight: Any, group_list: Any, split_item: int, group_type: int) -> Any:
    acc = _acc(x.dtype)
    out = np.zeros((x.shape[0], weight.shape[2]), acc)
    starts, ends = _group_sizes(np.asarray(group_list), x.shape[0], np)
    for e, (lo, hi) in enumerate(zip(starts, ends)):
        if hi > lo:
            out[lo:hi] = x[lo:hi].astype(acc) @ weight[e].astype(acc)
    return out.astype(x.dtype)


def _sizes_jax(group_list: Any, rows: int) -> Any:
    starts, ends = _group_sizes(group_list, rows, jnp)
    return (ends - starts).astype(jnp.int32)


def _gmm_jax(x: Any, weight: Any, group_list: Any, split_item: int, group_type: int) -> Any:
    acc = jnp.promote_types(x.dtype, jnp.float32)
    out = jax.lax.ragged_dot(x, weight, _sizes_jax(group_list, x.shape[0]),
                             preferred_element_type=acc)
    return out.astype(x.dtype)


def _gmm_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, weight, group_list = node.operands
    dx = b("GroupedMatmul", cot, b("Transpose", weight, perm=(0, 2, 1)), group_list)
    dw = b("GroupedMatmulWeightGrad", x, cot, group_list)
    return [dx, dw, None]


def _gmm_labels(ctx: OpContext) -> Labels:
    return Labels(["mk", "ekn", "e"], ["mn"], unsplittable={"m", "e"})


def _gmm_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    yield Same(In(0, 0), Out(0))
    yield Same(In(0, 1), In(1, 1))
    yield Same(In(1, 2), Out(1))
    yield Same(In(1, 0), In(2, 0))


define("GroupedMatmul", _gmm_infer, _gmm_np, _gmm_jax, vjp=_gmm_vjp,
       attrs={"split_item": 3, "group_type": 0}, num_inputs=3,
       sharding=LabelRule(_gmm_labels, unsplittable="the grouped rows and the expert dim "
                                                     "(group_list names them)"),
       traits=frozenset({Trait.MATMUL, Trait.REDUCTION}), dims=DimRule(_gmm_dims),
       doc="Row m of x times the matrix of the expert whose rows contain it (group_list: "
           "cumulative row ends); rows after the last end are zero.",
       section="linalg",
       operands="x (M, K), weight (E, K, N), group_list (E,) Int64 cumulative ends; "
                "`split_item` 3, `group_type` 0",
       dtypes=FLOATS,
       rule="`mk,ekn,e->mn`; a split K all-reduces; the rows and the experts stay whole "
            "(MindSpore also splits the rows)",
       tests=("test_ops_grouped.py::test_grouped_matmul",
              "test_ops_grouped.py::test_grouped_matmul_rule_matches_the_oracle"),
       note="`GroupedMatmul` (`ops.auto_generate.GroupedMatmul(split_item=3, group_type=0)("
            "[x], [weight], None, None, None, None, None, group_list)`, mindformers' MoEV3) "
            "lowers to `jax.lax.ragged_dot`: the counts are data, the shapes static bounds. "
            "A group may be empty; rows past group_list[-1] are zero.")


def _wgrad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x, dy, groups = tensor(types[0], "x"), tensor(types[1], "dy"), tensor(types[2],
                                                                          "group_list")
    _check_float(x, "x")
    if x.rank != 2 or dy.rank != 2 or x.shape[0] != dy.shape[0]:
        raise ShapeError(f"x (M, K) and dy (M, N) must be 2-D with the same rows, got {x.shape} "
                         f"and {dy.shape}")
    if dy.dtype is not x.dtype:
        raise ShapeError(f"x and dy must have one dtype, got {x.dtype.value} and "
                         f"{dy.dtype.value}")
    if groups.rank != 1:
        raise ShapeError(f"group_list must be 1-D, got shape {groups.shape}")
    _check_group_list(groups, groups.shape[0])
    return TensorType(x.dtype, (groups.shape[0], x.shape[1], dy.shape[1]))


def _wgrad_np(x: Any, dy: Any, group_list: Any) -> Any:
    acc = _acc(x.dtype)
    experts = group_list.shape[0]
    out = np.zeros((experts, x.shape[1], dy.shape[1]), acc)
    starts, ends = _group_sizes(np.asarray(group_list), x.shape[0], np)
    for e, (lo, hi) in enumerate(zip(starts, ends)):
        if hi > lo:
            out[e] = x[lo:hi].astype(acc).T @ dy[lo:hi].astype(acc)
    return out.astype(x.dtype)


def _wgrad_jax(x: Any, dy: Any, group_list: Any) -> Any:
    acc = jnp.promote_types(x.dtype, jnp.float32)
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[])
    out = jax.lax.ragged_dot_general(x, dy, _sizes_jax(group_list, x.shape[0]), numbers,
                                     preferred_element_type=acc)
    return out.astype(x.dtype)


grad_helper("GroupedMatmulWeightGrad", _wgrad_infer, _wgrad_np, _wgrad_jax,
            grad_of="GroupedMatmul", num_inputs=3, section="linalg",
            doc="The weight's cotangent of GroupedMatmul: per expert, its rows of x transposed "
                "times its rows of dy.",
            operands="x (M, K), dy (M, N), group_list (E,) -> (E, K, N)", dtypes=FLOATS,
            tests=("test_ops_grouped.py::test_grouped_matmul",))
