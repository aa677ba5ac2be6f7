"""mindformers' fused kernels (`ops.auto_generate.gen_ops_prim.*`), each lowered to the math of
its unfused form.

* `Swiglu(x; dim)`: x split along `dim` into two halves a (first) and b (second), then
  silu(a) * b, as MindSpore's `ops.swiglu` (the first half is gated). mindformers'
  FeedForward (`use_fused_swiglu`) calls it on (bs, seq, 2, hidden) with dim = -2. Its gradient
  is `SwigluGrad(dy, x; dim)` (MindSpore's name): the two halves' gradients side by side.
  Sharding: every dim but `dim` may split (the halves of `dim` must stay on one rank;
  mindformers shards Swiglu `("dp", "cp", "None", "mp")`).
* `RotaryPositionEmbedding(x, cos, sin; mode)`: x * cos + rotate(x) * sin, as MindSpore's
  `ops.rotary_position_embedding` (mindformers' `use_fused_rope`). x is 4-D (BNSD, BSND or
  SBND: the op is the same formula for each), cos and sin broadcast to it and share its last
  dim D (even). `mode` 0 rotates halves (GPT-NeoX: (x1, x2) -> (-x2, x1) for the two halves
  of D), 1 rotates interleaved pairs (GPT-J: (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])).
  `RotateHalf(x; mode)` is that rotation alone, which the gradient needs: rotate is linear and
  its transpose is -rotate, so dx = dy * cos - rotate(dy * sin), dcos = dy * x and
  dsin = dy * rotate(x), each summed over the dims cos and sin broadcast. Sharding: element-wise
  with broadcasting, but D never splits (a rotation mixes its two halves or pairs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, In, Out, Product, Same, broadcast
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define, grad_helper
from pcompile.ir.ops._jax import jax, jnp
from pcompile.ir.ops._util import broadcast_shapes, same_dtype, tensor, unbroadcast
from pcompile.ir.registry import FLOATS
from pcompile.ir.sharding import (
    ALPHA,
    LabelRule,
    Labels,
    OpContext,
    elementwise_labels,
    fresh_labels,
    identity_labels,
)
from pcompile.ir.types import TensorType, ValueType


def _wide(x: Any) -> Any:
    """16-bit floats computed in float32 and rounded once (as XLA does)."""
    return np.asarray(x, np.float32) if x.dtype.itemsize < 4 else x


def _sigmoid_np(x: Any) -> Any:
    e = np.exp(-np.abs(x))  # split by sign: exp never overflows
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# -- Swiglu -----------------------------------------------------------------------------------


def _split_dim(x: TensorType, dim: Any) -> int:
    """`dim` normalised for x; ShapeError unless it is an int naming an even-sized dim."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ShapeError(f"dim must be an int, got {dim!r}")
    if not -x.rank <= dim < x.rank:
        valid = f"[{-x.rank}, {x.rank - 1}]" if x.rank else "none (x is a scalar)"
        raise ShapeError(f"dim {dim} is out of range for x of rank {x.rank}; valid: {valid}")
    axis = dim % x.rank
    if x.shape[axis] % 2:
        raise ShapeError(f"dim {dim} of x {x.shape} has odd size {x.shape[axis]}; Swiglu splits "
                         "it into two equal halves (a, b), so it must be even")
    return axis


def _swiglu_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    if not x.dtype.is_float:
        raise ShapeError(f"needs a floating-point x, got {x.dtype.value}")
    axis = _split_dim(x, attrs["dim"])
    return x.with_shape(tuple(d // 2 if i == axis else d for i, d in enumerate(x.shape)))


def _swiglu_np(x: Any, dim: int) -> Any:
    a, b = np.split(_wide(x), 2, axis=dim)
    out: np.ndarray = (a * _sigmoid_np(a) * b).astype(x.dtype)
    return out


def _swiglu_jax(x: Any, dim: int) -> Any:
    a, b = jnp.split(x, 2, axis=dim)
    return jax.nn.silu(a) * b


def _swiglu_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("SwigluGrad", cot, node.operands[0], dim=node.attrs["dim"])]


def swiglu_labels(ctx: OpContext) -> Labels:
    """Every dim but `dim` keeps its label; `dim` and the result's half of it never split."""
    x = ctx.in_types[0]
    lab = ALPHA[: x.rank]
    axis = ctx.attrs["dim"] % x.rank
    half = fresh_labels(1, set(lab))[0]
    out = lab[:axis] + half + lab[axis + 1:]
    return Labels([lab], [out], {lab[axis], half})


def _swiglu_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Iterator[Any]:
    rank = len(ins[0][0])
    axis = attrs["dim"] % rank
    for d in range(rank):
        if d != axis:
            yield Same(In(0, d), Out(d))
    yield Product((Out(axis),), (In(0, axis),), 2)


define("Swiglu", _swiglu_infer, _swiglu_np, _swiglu_jax, vjp=_swiglu_vjp,
       attrs={"dim": -1}, num_inputs=1,
       sharding=LabelRule(swiglu_labels, unsplittable="Swiglu's split dim"),
       doc="silu(a) * b, a and b the first and second halves of x along `dim`.",
       section="elementwise", operands="x; `dim` (even-sized)", dtypes=FLOATS,
       rule="every dim but `dim` splits",
       tests=("test_ops_fused.py::test_swiglu_matches_jax",
              "test_ops_fused.py::test_swiglu_refuses_an_odd_dim",
              "test_ops_fused.py::test_rules_match_the_oracle",
              "test_ops_fused.py::test_swiglu_split_dim_split_is_refused_with_one_message",
              "test_routing_api.py::test_fused_swiglu_feed_forward_matches_single_device"),
       note="`Swiglu` (`ops.auto_generate.gen_ops_prim.Swiglu()(x, dim)`, mindformers' "
            "`use_fused_swiglu`) gates the first half of `dim`: silu(a) * b, as MindSpore's "
            "`ops.swiglu`.",
       dims=DimRule(_swiglu_dims))


def _swiglu_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dy, x = tensor(types[0], "dy"), tensor(types[1], "x")
    same_dtype([dy, x])
    want = tensor(_swiglu_infer([x], attrs))
    if dy.shape != want.shape:
        raise ShapeError(f"dy must have Swiglu's result shape {want.shape}, got {dy.shape}")
    return x


def _swiglu_grad_np(dy: Any, x: Any, dim: int) -> Any:
    a, b = np.split(_wide(x), 2, axis=dim)
    g = _wide(dy)
    sig = _sigmoid_np(a)
    silu = a * sig
    da = g * b * (sig * (1.0 + a * (1.0 - sig)))
    out: np.ndarray = np.concatenate([da, g * silu], axis=dim).astype(x.dtype)
    return out


def _swiglu_grad_jax(dy: Any, x: Any, dim: int) -> Any:
    a, b = jnp.split(x, 2, axis=dim)
    sig = jax.nn.sigmoid(a)
    da = dy * b * (sig * (1.0 + a * (1.0 - sig)))
    return jnp.concatenate([da, dy * (a * sig)], axis=dim)


def _swiglu_grad_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Iterator[Any]:
    rank = len(ins[1][0])
    axis = attrs["dim"] % rank
    for d in range(rank):
        yield Same(In(1, d), Out(d))
        if d != axis:
            yield Same(In(0, d), Out(d))
    yield Product((In(0, axis),), (Out(axis),), 2)


grad_helper("SwigluGrad", _swiglu_grad_infer, _swiglu_grad_np, _swiglu_grad_jax,
            attrs={"dim": -1}, grad_of="Swiglu", section="elementwise", operands="dy, x; `dim`",
            doc="The gradient of Swiglu with respect to x: (dy b silu'(a), dy silu(a)) along "
                "`dim` (MindSpore operand order: dy, x).",
            dtypes=FLOATS, tests=("test_ops_fused.py::test_swiglu_grad_matches_jax",),
            dims=DimRule(_swiglu_grad_dims))


# -- RotaryPositionEmbedding ------------------------------------------------------------------

_MODES = {0: "rotate_half (GPT-NeoX)", 1: "rotate_interleaved (GPT-J)"}


def _rope_mode(attrs: dict[str, Any]) -> int:
    mode = attrs["mode"]
    if isinstance(mode, bool) or mode not in _MODES:
        raise ShapeError(f"mode must be 0 ({_MODES[0]}) or 1 ({_MODES[1]}), got {mode!r}")
    return int(mode)


def _rotate_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    if not x.dtype.is_float:
        raise ShapeError(f"needs a floating-point x, got {x.dtype.value}")
    _rope_mode(attrs)
    if x.rank == 0 or x.shape[-1] % 2:
        last = x.shape[-1] if x.rank else "none (x is a scalar)"
        raise ShapeError(f"the last dim of x {x.shape} must be even (it rotates halves or "
                         f"pairs), got {last}")
    return x


def _rotate(x: Any, mode: int, lib: Any) -> Any:
    """x's last dim rotated: halves (mode 0) or interleaved pairs (mode 1)."""
    if mode == 0:
        first, second = lib.split(x, 2, axis=-1)
        return lib.concatenate([-second, first], axis=-1)
    pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    return lib.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)


def _rotate_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("Neg", b("RotateHalf", cot, mode=node.attrs["mode"]))]


define("RotateHalf", _rotate_infer, lambda x, mode: _rotate(np.asarray(x), mode, np),
       lambda x, mode: _rotate(x, mode, jnp), vjp=_rotate_vjp, attrs={"mode": 0},
       num_inputs=1,
       sharding=LabelRule(identity_labels(lambda ctx: (-1,)), unsplittable="the rotated dim"),
       doc="x's last dim rotated: (x1, x2) -> (-x2, x1) by halves (mode 0) or by interleaved "
           "pairs (mode 1); RotaryPositionEmbedding's gradient uses it.",
       section="attention", operands="x; `mode`", dtypes=FLOATS,
       rule="the last dim never splits; other dims split",
       spelling="emitted by RotaryPositionEmbedding's vjp",
       tests=("test_ops_fused.py::test_rotate_half_matches_jax",
              "test_ops_fused.py::test_rules_match_the_oracle"),
       dims=DimRule(broadcast))


def _rope_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x, cos, sin = (tensor(types[i], what) for i, what in enumerate(("x", "cos", "sin")))
    same_dtype([x, cos, sin])
    if x.rank != 4:
        raise ShapeError(f"x must be 4-D (BNSD, BSND or SBND), got shape {x.shape}")
    _rotate_infer([x], attrs)
    if cos.shape != sin.shape:
        raise ShapeError(f"cos {cos.shape} and sin {sin.shape} must have one shape")
    if (cos.rank != 4 or cos.shape[-1] != x.shape[-1]
            or broadcast_shapes(x.shape, cos.shape) != x.shape):
        raise ShapeError(f"cos and sin {cos.shape} must be 4-D with x's last dim "
                         f"{x.shape[-1]} and broadcast to x {x.shape} (e.g. "
                         f"(1, 1, {x.shape[2]}, {x.shape[3]}) for BNSD)")
    return x


def _rope_np(x: Any, cos: Any, sin: Any, mode: int) -> Any:
    wide = [_wide(np.asarray(v)) for v in (x, cos, sin)]
    out: np.ndarray = (wide[0] * wide[1] + _rotate(wide[0], mode, np) * wide[2]).astype(x.dtype)
    return out


def _rope_jax(x: Any, cos: Any, sin: Any, mode: int) -> Any:
    return x * cos + _rotate(x, mode, jnp) * sin


def _rope_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, cos, sin = node.operands
    mode = node.attrs["mode"]
    dx = b("Sub", b("Mul", cot, cos), b("RotateHalf", b("Mul", cot, sin), mode=mode))
    dcos = unbroadcast(b, b("Mul", cot, x), cos.shape)
    dsin = unbroadcast(b, b("Mul", cot, b("RotateHalf", x, mode=mode)), sin.shape)
    return [dx, dcos, dsin]


def rope_labels(ctx: OpContext) -> Labels:
    """Element-wise with broadcasting; the rotated (last) dim never splits."""
    labels = elementwise_labels(ctx)
    labels.unsplittable |= {labels.outputs[0][-1]}
    return labels


define("RotaryPositionEmbedding", _rope_infer, _rope_np, _rope_jax, vjp=_rope_vjp,
       attrs={"mode": 0}, num_inputs=3,
       sharding=LabelRule(rope_labels, unsplittable="the rotated dim D"),
       doc="x * cos + rotate(x) * sin; rotate by halves (mode 0) or interleaved pairs (mode 1).",
       section="attention", operands="4-D x, cos, sin (broadcast to x); `mode`",
       dtypes=FLOATS, rule="element-wise (cos, sin broadcast); the last dim never splits",
       tests=("test_ops_fused.py::test_rope_matches_jax",
              "test_ops_fused.py::test_rope_refuses_bad_shapes",
              "test_ops_fused.py::test_rope_split_of_the_rotated_dim_is_refused_with_one_message",
              "test_ops_fused.py::test_rules_match_the_oracle",
              "test_routing_api.py::test_fused_rope_matches_single_device"),
       note="`RotaryPositionEmbedding` (`ops.auto_generate.gen_ops_prim."
            "RotaryPositionEmbedding()(x, cos, sin, mode)`, mindformers' `use_fused_rope`) is "
            "MindSpore's `ops.rotary_position_embedding`: mode 0 rotates the halves of D "
            "(GPT-NeoX), mode 1 interleaved pairs (GPT-J). cos and sin may take any shape that "
            "broadcasts to x with x's D (MindSpore's kernel takes a few of them).",
       dims=DimRule(broadcast))
