"""TopKRouter: mindformers' fused routing kernel (`use_fused_ops_topkrouter`), MindSpore's
`P._inner_ops.TopKRouter()(x, capacity, expert_num, drop_type=0)`.

`x` (B, N, k) Int32 holds the k experts each of N tokens chose, in B groups. The choices are
queued in order (`drop_type` 0, "sdrop": token by token, each token's k choices in order; 1,
"kdrop": every token's first choice, then every token's second, ...); each expert keeps its
first `capacity` choices. Two Int32 results, as mindformers' unfused TopkRouterV2
(`_maskout_overflowed_tokens_sort_sdrop` / `_kdrop`) computes them with OneHot, CumSum, Sort:

* `dispatch_index` (B, expert_num, capacity): the token (1 + its position in the group) in each
  kept slot of each expert, 0 for an empty slot (a Gather from the tokens with a zero row
  prepended);
* `combine_index` (B, N, k): where each choice's output is, `expert * (capacity + 1) + slot`
  with slot 1..capacity, or `expert * (capacity + 1)` for a dropped choice (a Gather from the
  experts' outputs with a zero row prepended to each expert's).

Sharding: MindSpore's TopKRouterInfo splits only the group dim B (a strategy such as
`(1, 2, 1)` is refused). No gradient (integer results).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.dims import DimRule, Fixed, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define
from pcompile.ir.ops._jax import jnp
from pcompile.ir.ops._util import tensor, tuple_type
from pcompile.ir.sharding import LabelRule, Labels, OpContext
from pcompile.ir.types import DType, TensorType, ValueType


def _int_attr(attrs: dict[str, Any], name: str, least: int) -> int:
    value = attrs[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ShapeError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def _router_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    if x.dtype is not DType.int32:
        raise ShapeError(f"x holds expert ids: it must be Int32, got {x.dtype.value}")
    if x.rank != 3:
        raise ShapeError(f"x must be (groups, tokens, k) expert ids, got shape {x.shape}")
    capacity = _int_attr(attrs, "capacity", 1)
    experts = _int_attr(attrs, "expert_num", 1)
    if attrs["drop_type"] not in (0, 1):
        raise ShapeError(f"drop_type must be 0 (sdrop: token by token) or 1 (kdrop: by choice "
                         f"rank), got {attrs['drop_type']!r}")
    groups = x.shape[0]
    return tuple_type(TensorType(DType.int32, (groups, experts, capacity)),
                      TensorType(DType.int32, x.shape))


def _queue_order(shape: tuple[int, ...], drop_type: int) -> tuple[Any, Any]:
    """(position of each choice (token t, rank j) in its group's queue, its token): (N, k)."""
    tokens, k = shape[1], shape[2]
    t = np.arange(tokens)[:, None]
    j = np.arange(k)[None, :]
    order = t * k + j if drop_type == 0 else j * tokens + t
    return order, np.broadcast_to(t, (tokens, k))


def _router_np(x: Any, capacity: int, expert_num: int, drop_type: int) -> Any:
    x = np.asarray(x)
    groups, tokens, k = x.shape
    order, token = _queue_order(x.shape, drop_type)
    dispatch = np.zeros((groups, expert_num, capacity), np.int32)
    combine = np.zeros(x.shape, np.int32)
    flat = np.argsort(order, axis=None)  # the choices in queue order, as flat (t, j) indices
    for g in range(groups):
        filled = np.zeros(expert_num, np.int64)
        for index in flat:
            t, j = divmod(int(index), k)
            expert = int(x[g, t, j])
            if not 0 <= expert < expert_num:
                combine[g, t, j] = 0
                continue
            filled[expert] += 1
            slot = int(filled[expert])
            if slot <= capacity:
                dispatch[g, expert, slot - 1] = int(token[t, j]) + 1
                combine[g, t, j] = expert * (capacity + 1) + slot
            else:
                combine[g, t, j] = expert * (capacity + 1)
    return dispatch, combine


def _router_jax(x: Any, capacity: int, expert_num: int, drop_type: int) -> Any:
    groups, tokens, k = x.shape
    order, token = _queue_order(x.shape, drop_type)
    length = tokens * k
    # the choices in queue order (a static permutation), their experts and tokens
    perm = np.argsort(order, axis=None)
    queued = x.reshape(groups, length)[:, perm]
    queued_token = token.reshape(length)[perm]
    hot = (queued[:, :, None] == jnp.arange(expert_num, dtype=jnp.int32)).astype(jnp.int32)
    slot = jnp.sum(jnp.cumsum(hot, axis=1) * hot, axis=2)  # 1-based slot in its expert
    kept = (slot >= 1) & (slot <= capacity)
    combine_q = queued * (capacity + 1) + jnp.where(kept, slot, 0)
    combine_q = jnp.where(slot >= 1, combine_q, 0)  # an id outside the experts: 0
    # (under 64-bit mode the sums are int64: stored as the op's int32, as numpy's kernel)
    combine = jnp.zeros((groups, length), jnp.int32).at[:, perm].set(
        combine_q.astype(jnp.int32))
    target = jnp.where(kept, queued * capacity + slot - 1, expert_num * capacity)
    rows = jnp.arange(groups)[:, None]
    values = jnp.broadcast_to(jnp.asarray(queued_token + 1, jnp.int32), (groups, length))
    dispatch = jnp.zeros((groups, expert_num * capacity), jnp.int32).at[rows, target].set(
        values, mode="drop")
    return (dispatch.reshape(groups, expert_num, capacity),
            combine.reshape(groups, tokens, k).astype(jnp.int32))


def router_labels(ctx: OpContext) -> Labels:
    """Only the group dim splits (MindSpore's TopKRouterInfo): x `gnk`, dispatch `gec`,
    combine `gnk`."""
    return Labels(["gnk"], ["gec", "gnk"], {"n", "k", "e", "c"})


def _router_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    yield Same(In(0, 0), Out(0, 0))
    yield Same(In(0, 0), Out(0, 1))
    yield Same(In(0, 1), Out(1, 1))
    yield Same(In(0, 2), Out(2, 1))
    yield Fixed(Out(1, 0), "TopKRouter's expert_num")
    yield Fixed(Out(2, 0), "TopKRouter's capacity")


define("TopKRouter", _router_infer, _router_np, _router_jax,
       attrs={"capacity": 1, "expert_num": 1, "drop_type": 0}, num_inputs=1,
       differentiable=False,
       sharding=LabelRule(router_labels, unsplittable="the tokens and choices of a group, "
                          "which one kernel queues whole"),
       doc="mindformers' fused routing: (dispatch_index, combine_index) of the k experts each "
           "token chose, each expert keeping its first `capacity` choices.",
       section="linalg",
       operands="x (groups, tokens, k) Int32; `capacity`, `expert_num`, `drop_type` -> "
                "(dispatch (groups, experts, capacity), combine (groups, tokens, k)) Int32",
       dtypes=frozenset({DType.int32}), rule="only the group dim (0) splits",
       tests=("test_topk_router.py::test_mindspore_example",
              "test_topk_router.py::test_fused_router_equals_the_unfused_form",
              "test_topk_router.py::test_router_rule_matches_the_oracle",
              "test_topk_router.py::test_a_token_split_is_refused_with_one_message"),
       note="`TopKRouter` (`P._inner_ops.TopKRouter()(x, capacity, expert_num, drop_type=0)`, "
            "mindformers' `use_fused_ops_topkrouter`) computes what mindformers' unfused "
            "TopkRouterV2 computes with OneHot, CumSum and Sort: `dispatch_index[g, e, c]` is 1 "
            "plus the token in slot c of expert e (0: empty), `combine_index[g, t, j]` is "
            "`e * (capacity + 1) + slot` for a kept choice and `e * (capacity + 1)` for a "
            "dropped one; choices are queued token by token (`drop_type` 0) or by choice rank "
            "(1). Only the group dim splits, as MindSpore's TopKRouterInfo.",
       dims=DimRule(_router_dims))
