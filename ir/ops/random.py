"""Dropout: `Dropout`, its gradient `DropoutGrad` and the mask `DropoutMask`.

MindSpore's `P.Dropout(keep_prob, Seed0, Seed1)(x)` keeps each element with probability
`keep_prob` and scales the kept ones by `1 / keep_prob`. Here the randomness is a function of
the element's place, not of the device that computes it, so that any plan computes exactly the
single-device program's values:

    bits(i) = hash(seed0, seed1, step, i)      i: the element's flat index in the whole tensor
    kept(i) = bits(i) < floor(keep_prob * 2**32)   (every element when keep_prob == 1)
    Dropout(x)     = x * (1 / keep_prob) where kept, else 0
    DropoutGrad(dy) = dy * (1 / keep_prob) where kept, else 0   (the same elements)
    DropoutMask(x) = 1 where kept, else 0 (x's dtype)

`hash` is a counter-based generator on uint32 arithmetic (`mix`: Wellons' lowbias32 finalizer,
applied to the keys and then to each index), the same in numpy and JAX, bit for bit. The
operands besides `x` are `step` (int32 scalar: which step of training, advanced by the front
end each time the op runs; compiler/frontend/random_state.py) and `offset` (int32, one value per
dim: where this tensor's block begins in the whole tensor; zeros in the single-device program). The
attribute `global_shape` is the whole tensor's shape: a rank's block of shape `s` starting at
`offset` computes `i = sum_d (offset[d] + k_d) * stride_d` with the whole tensor's strides, so
each rank draws exactly its elements' bits. The sharding rule (`DropoutRule`) is element-wise
on `x` and asks the split for its per-rank offsets ("global_offsets":
passes/step_parallel.py puts a rank constant in `offset`); the vjp's `DropoutGrad` reads the
same operands, so the backward keeps the forward's elements.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define, grad_helper
from pcompile.ir.ops._jax import jnp
from pcompile.ir.ops._util import tensor
from pcompile.ir.rank import layout_offsets
from pcompile.ir.registry import FLOATS
from pcompile.ir.sharding import (
    ALPHA,
    Expansion,
    LabelRule,
    Labels,
    LocalLowering,
    OpContext,
    OpSharding,
    Strategy,
    fresh_labels,
)
from pcompile.ir.types import DType, ValueType

_M32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B
_KEY = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35)  # odd constants that separate the key's parts

_ATTRS = {"keep_prob": 0.5, "seed0": 0, "seed1": 0, "global_shape": ()}

#: the name of the step counter the front end's random ops advance
#: (compiler/frontend/random_state.py), which passes recognise (a pipeline's micro-batches advance
#: it once a step)
COUNTER_NAME = "random_step"


def threshold(keep_prob: float) -> int | None:
    """Elements whose bits are below this are kept; None: every element (keep_prob 1)."""
    if keep_prob >= 1.0:
        return None
    return min(int(keep_prob * 2**32), _M32)


def _mix_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(_MUL1)) & np.uint64(_M32)
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(_MUL2)) & np.uint64(_M32)
    out: np.ndarray = h ^ (h >> np.uint64(16))
    return out


def _key_np(seed0: int, seed1: int, step: Any) -> tuple[np.ndarray, np.ndarray]:
    k = _mix_np(np.asarray((seed0 ^ _KEY[0]) & _M32, np.uint64))
    k = _mix_np(k ^ np.uint64(seed1 & _M32))
    k = _mix_np(k ^ (np.asarray(step).astype(np.int64).astype(np.uint64) & np.uint64(_M32)))
    return k, _mix_np(k ^ np.uint64(_KEY[1]))


def _index_np(shape: tuple[int, ...], offset: Any, global_shape: tuple[int, ...]) -> np.ndarray:
    offsets = np.asarray(offset).astype(np.int64).reshape(-1)
    index = np.zeros(shape, np.uint64)
    stride = 1
    for d in reversed(range(len(shape))):
        coord = (np.arange(shape[d], dtype=np.uint64) + np.uint64(int(offsets[d]) & _M32))
        coord = (coord * np.uint64(stride & _M32)) & np.uint64(_M32)
        view = [1] * len(shape)
        view[d] = shape[d]
        index = (index + coord.reshape(view)) & np.uint64(_M32)
        stride *= int(global_shape[d])
    return index


def kept_np(shape: tuple[int, ...], step: Any, offset: Any, keep_prob: float, seed0: int,
            seed1: int, global_shape: tuple[int, ...]) -> np.ndarray:
    """Which elements of a block of `shape` at `offset` are kept (bool)."""
    limit = threshold(keep_prob)
    if limit is None:
        return np.ones(shape, bool)
    k, k2 = _key_np(seed0, seed1, step)
    index = _index_np(shape, offset, global_shape)
    bits = _mix_np((_mix_np((index + k) & np.uint64(_M32))) ^ k2)
    result: np.ndarray = bits < np.uint64(limit)
    return result


def _mix_jax(h: Any) -> Any:
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(_MUL1)
    h = h ^ (h >> jnp.uint32(15))
    h = h * jnp.uint32(_MUL2)
    return h ^ (h >> jnp.uint32(16))


def kept_jax(shape: tuple[int, ...], step: Any, offset: Any, keep_prob: float, seed0: int,
             seed1: int, global_shape: tuple[int, ...]) -> Any:
    limit = threshold(keep_prob)
    if limit is None:
        return jnp.ones(shape, bool)
    k = _mix_jax(jnp.uint32((seed0 ^ _KEY[0]) & _M32))
    k = _mix_jax(k ^ jnp.uint32(seed1 & _M32))
    k = _mix_jax(k ^ jnp.asarray(step).astype(jnp.int32).astype(jnp.uint32))
    k2 = _mix_jax(k ^ jnp.uint32(_KEY[1]))
    offsets = jnp.asarray(offset).astype(jnp.int32).astype(jnp.uint32).reshape(-1)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        coord = (jnp.arange(shape[d], dtype=jnp.uint32) + offsets[d]) * jnp.uint32(stride & _M32)
        view = [1] * len(shape)
        view[d] = shape[d]
        index = index + coord.reshape(view)
        stride *= int(global_shape[d])
    bits = _mix_jax(_mix_jax(index + k) ^ k2)
    return bits < jnp.uint32(limit)


def _infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if not x.dtype.is_float:
        raise ShapeError(f"needs a floating-point input, got {x.dtype.value}")
    step, offset = tensor(types[1], "step"), tensor(types[2], "offset")
    if step.shape != () or step.dtype is not DType.int32:
        raise ShapeError(f"step must be an Int32 scalar, got {step}")
    if offset.shape != (x.rank,) or offset.dtype is not DType.int32:
        raise ShapeError(f"offset must be Int32 of shape ({x.rank},), got {offset}")
    keep = attrs["keep_prob"]
    if not 0.0 < float(keep) <= 1.0:
        raise ShapeError(f"keep_prob must be in (0, 1], got {keep!r}")
    whole = tuple(attrs["global_shape"])
    if len(whole) != x.rank or any(w < s for w, s in zip(whole, x.shape)):
        raise ShapeError(f"global_shape {whole} must be the whole tensor of the block {x.shape}")
    return x


def _scaled_np(x: np.ndarray, kept: np.ndarray, keep_prob: float) -> np.ndarray:
    scale = np.asarray(1.0 / keep_prob, x.dtype)
    out: np.ndarray = np.where(kept, x * scale, np.zeros((), x.dtype)).astype(x.dtype)
    return out


def _dropout_np(x: np.ndarray, step: Any, offset: Any, keep_prob: float, seed0: int,
                seed1: int, global_shape: tuple[int, ...]) -> np.ndarray:
    kept = kept_np(x.shape, step, offset, keep_prob, seed0, seed1, global_shape)
    return _scaled_np(x, kept, keep_prob)


def _dropout_jax(x: Any, step: Any, offset: Any, keep_prob: float, seed0: int, seed1: int,
                 global_shape: tuple[int, ...]) -> Any:
    kept = kept_jax(x.shape, step, offset, keep_prob, seed0, seed1, global_shape)
    scale = jnp.asarray(1.0 / keep_prob, x.dtype)
    return jnp.where(kept, x * scale, jnp.zeros((), x.dtype))


def _mask_np(x: np.ndarray, step: Any, offset: Any, keep_prob: float, seed0: int, seed1: int,
             global_shape: tuple[int, ...]) -> np.ndarray:
    kept = kept_np(x.shape, step, offset, keep_prob, seed0, seed1, global_shape)
    return kept.astype(x.dtype)


def _mask_jax(x: Any, step: Any, offset: Any, keep_prob: float, seed0: int, seed1: int,
              global_shape: tuple[int, ...]) -> Any:
    return kept_jax(x.shape, step, offset, keep_prob, seed0, seed1, global_shape).astype(x.dtype)


def _dropout_vjp(b: Any, node: Any, cot: Any) -> list[Any]:
    _, step, offset = node.operands
    return [b("DropoutGrad", cot, step, offset, **dict(node.attrs)), None, None]


def dropout_labels(ctx: OpContext) -> Labels:
    lab = ALPHA[: ctx.in_types[0].rank]
    place = fresh_labels(1, set(lab))[0]
    return Labels([lab, "", place], [lab], {place})


class _GlobalOffsets(Expansion):
    """Dropout with a split input: its offsets operand is where this rank's block begins, so
    each element draws the bit it draws on one device."""

    def operands(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
                 sharding: OpSharding) -> list[Value]:
        out = list(operands)
        out[2] = lower.rank_constant(layout_offsets(sharding.in_layouts[0]), DType.int32)
        return out


GLOBAL_OFFSETS = _GlobalOffsets()


class DropoutRule(LabelRule):
    """Element-wise on `x` (MindSpore's DropoutInfo: any split of x, the output alike); `step`
    is a scalar and `offset` stays whole. A split x needs each rank's offsets
    ("global_offsets")."""

    def __init__(self) -> None:
        super().__init__(dropout_labels, unsplittable="the offsets")

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        result = super().apply(ctx, strategy, out_strategy)
        if any(s > 1 for s in result.strategy[0]):
            result.expand = GLOBAL_OFFSETS
        return result


def _dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    for d in range(len(ins[0][0])):
        yield Same(In(0, d), Out(d))


def _rewrite(attrs: dict[str, Any], old_in: Any, old_out: Any, new_in: Any,
             new_out: Any) -> dict[str, Any]:
    return {**attrs, "global_shape": tuple(new_in[0][0])}


_NOTE = """\
**Dropout** (MindSpore's `ops.Dropout(keep_prob, Seed0, Seed1)` and `nn.Dropout`) draws each
element's mask from its place in the whole tensor: `hash(seed0, seed1, step, flat index) <
keep_prob * 2**32`, the same bits in numpy and JAX. A split input keeps the single-device
program's mask: each rank draws its block's elements (their offsets in the whole tensor are a
rank constant, the `offset` operand), so any strategy trains exactly like one device under the
same seed. `step` is advanced every time the op runs (docs/user-guide.md, "Dropout and
randomness"). `DropoutGrad` keeps the forward's elements; `DropoutMask` is the mask itself (1
kept, 0 dropped)."""

_TESTS = ("test_ops_random.py::test_dropout_values_and_statistics",
          "test_ops_random.py::test_every_strategy_draws_the_single_device_mask")
_COMMON = dict(attrs=_ATTRS, num_inputs=3, sharding=DropoutRule(),
               dims=DimRule(_dims, _rewrite), section="elementwise", dtypes=FLOATS,
               rule="element-wise on x; each rank draws its block of the whole tensor's mask")

define("Dropout", _infer, _dropout_np, _dropout_jax, vjp=_dropout_vjp,
       doc="x / keep_prob where the element is kept (probability keep_prob), else 0.",
       operands="x, int32 step, int32 offset; `keep_prob`, `seed0`, `seed1`, `global_shape`",
       tests=_TESTS, note=_NOTE, **_COMMON)  # type: ignore[arg-type]

define("DropoutMask", _infer, _mask_np, _mask_jax, differentiable=False,
       doc="1 where Dropout with the same operands keeps the element, else 0 (x's dtype).",
       operands="x, int32 step, int32 offset; as Dropout",
       spelling="the mask `ops.Dropout` returns with its output", tests=_TESTS,
       **_COMMON)  # type: ignore[arg-type]

grad_helper("DropoutGrad", _infer, _dropout_np, _dropout_jax, grad_of="Dropout", num_inputs=3,
            attrs=_ATTRS, section="elementwise", dtypes=FLOATS,
            doc="dy / keep_prob where Dropout with the same operands keeps the element, else 0.",
            operands="dy, int32 step, int32 offset; as Dropout", tests=_TESTS)


# -- MindSpore's two-op dropout: DropoutGenMask and DropoutDoMask --------------------------------
#
# `DropoutGenMask(step)` draws the mask of a tensor of shape `shape` as `ops.Dropout` draws it
# (the same seeds, step and flat indices give the same bits) and packs it as MindSpore's op
# returns it: UInt8 of shape (ceil(n / 128) * 16,), n = prod(shape) (a whole number of 128-bit
# blocks, the bits past n zero). Element i is bit i % 8 of byte i // 8 (least significant bit
# first); MindSpore leaves the order inside its bytes to its kernels (they differ between
# devices) and only DropoutDoMask reads them. `DropoutDoMask(x, mask, offset)` reads bit i for
# the element of flat index i in the whole tensor of shape `global_shape` (a split x reads its
# block's bits at its offsets, as Dropout does) and gives x / keep_prob where it is set, else 0
# (0 everywhere when keep_prob is 0).

_GEN_ATTRS = {"shape": (), "keep_prob": 0.5, "seed0": 0, "seed1": 0}
_DO_ATTRS = {"keep_prob": 0.5, "global_shape": ()}


def mask_bytes(shape: tuple[int, ...]) -> int:
    """The length of MindSpore's packed mask of a tensor of `shape`."""
    count = 1
    for d in shape:
        count *= int(d)
    return -(-count // 128) * 16


def _gen_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    step = tensor(types[0], "step")
    if step.shape != () or step.dtype is not DType.int32:
        raise ShapeError(f"step must be an Int32 scalar, got {step}")
    shape = tuple(attrs["shape"])
    if any(int(d) <= 0 for d in shape):
        raise ShapeError(f"every value of shape must be > 0, got {shape}")
    keep = float(attrs["keep_prob"])
    if not 0.0 <= keep <= 1.0:
        raise ShapeError(f"keep_prob must be in [0, 1], got {keep!r}")
    from pcompile.ir.types import TensorType

    return TensorType(DType.uint8, (mask_bytes(shape),))


def _gen_np(step: Any, shape: tuple[int, ...], keep_prob: float, seed0: int,
            seed1: int) -> np.ndarray:
    shape = tuple(int(d) for d in shape)
    kept = kept_np(shape, step, np.zeros(len(shape), np.int32), keep_prob, seed0, seed1, shape)
    bits = np.zeros(mask_bytes(shape) * 8, bool)
    bits[: kept.size] = kept.reshape(-1)
    out: np.ndarray = np.packbits(bits, bitorder="little")
    return out


def _gen_jax(step: Any, shape: tuple[int, ...], keep_prob: float, seed0: int,
             seed1: int) -> Any:
    shape = tuple(int(d) for d in shape)
    kept = kept_jax(shape, step, jnp.zeros((len(shape),), jnp.int32), keep_prob, seed0, seed1,
                    shape).reshape(-1)
    size = mask_bytes(shape) * 8
    bits = jnp.zeros((size,), jnp.uint8).at[: kept.size].set(kept.astype(jnp.uint8))
    weights = jnp.left_shift(jnp.uint8(1), jnp.arange(8, dtype=jnp.uint8))
    return jnp.sum(bits.reshape(-1, 8) * weights, axis=1, dtype=jnp.uint8)


def _do_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if not x.dtype.is_float:
        raise ShapeError(f"needs a floating-point input, got {x.dtype.value}")
    mask, offset = tensor(types[1], "mask"), tensor(types[2], "offset")
    if mask.dtype is not DType.uint8 or mask.rank != 1:
        raise ShapeError(f"the mask must be 1-D UInt8 (DropoutGenMask's output), got {mask}")
    if offset.shape != (x.rank,) or offset.dtype is not DType.int32:
        raise ShapeError(f"offset must be Int32 of shape ({x.rank},), got {offset}")
    keep = float(attrs["keep_prob"])
    if not 0.0 <= keep <= 1.0:
        raise ShapeError(f"keep_prob must be in [0, 1], got {keep!r}")
    whole = tuple(attrs["global_shape"])
    if len(whole) != x.rank or any(w < s for w, s in zip(whole, x.shape)):
        raise ShapeError(f"global_shape {whole} must be the whole tensor of the block {x.shape}")
    count = 1
    for d in whole:
        count *= int(d)
    if count > mask.shape[0] * 8:
        raise ShapeError(f"the mask {mask.shape} holds {mask.shape[0] * 8} bits, fewer than the "
                         f"{count} elements of x {whole}")
    return x


def _do_np(x: np.ndarray, mask: np.ndarray, offset: Any, keep_prob: float,
           global_shape: tuple[int, ...]) -> np.ndarray:
    index = _index_np(x.shape, offset, tuple(global_shape)).astype(np.int64)
    kept = (np.asarray(mask, np.uint8)[index >> 3] >> (index & 7).astype(np.uint8)) & 1
    if keep_prob <= 0.0:
        return np.zeros_like(x)
    return _scaled_np(x, kept.astype(bool), keep_prob)


def _do_jax(x: Any, mask: Any, offset: Any, keep_prob: float,
            global_shape: tuple[int, ...]) -> Any:
    if keep_prob <= 0.0:
        return jnp.zeros_like(x)
    offsets = jnp.asarray(offset).astype(jnp.int32).astype(jnp.uint32).reshape(-1)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        coord = (jnp.arange(x.shape[d], dtype=jnp.uint32) + offsets[d]) * jnp.uint32(stride)
        view = [1] * x.ndim
        view[d] = x.shape[d]
        index = index + coord.reshape(view)
        stride *= int(global_shape[d])
    byte = jnp.asarray(mask, jnp.uint8)[(index >> jnp.uint32(3)).astype(jnp.int32)]
    kept = ((byte >> (index & jnp.uint32(7)).astype(jnp.uint8)) & jnp.uint8(1)) == 1
    scale = jnp.asarray(1.0 / keep_prob, x.dtype)
    return jnp.where(kept, x * scale, jnp.zeros((), x.dtype))


def _do_vjp(b: Any, node: Any, cot: Any) -> list[Any]:
    _, mask, offset = node.operands
    return [b("DropoutDoMask", cot, mask, offset, **dict(node.attrs)), None, None]


def gen_mask_labels(ctx: OpContext) -> Labels:
    whole = fresh_labels(1, set())[0]
    return Labels([""], [whole], {whole})


def do_mask_labels(ctx: OpContext) -> Labels:
    lab = ALPHA[: ctx.in_types[0].rank]
    whole, place = fresh_labels(2, set(lab))
    return Labels([lab, whole, place], [lab], {whole, place})


class DropoutDoMaskRule(DropoutRule):
    """MindSpore's DropoutDoMaskInfo: any split of x, the output alike; the mask is read whole
    (every rank holds the packed bits of the whole tensor) and a split x needs each rank's
    offsets ("global_offsets", as Dropout's), so each rank reads its block's bits."""

    def __init__(self) -> None:
        LabelRule.__init__(self, do_mask_labels,
                           unsplittable="the packed mask and the offsets")


_MASK_NOTE = """\
**DropoutGenMask / DropoutDoMask** (MindSpore's `P.DropoutGenMask(Seed0, Seed1)(shape,
keep_prob)` and `P.DropoutDoMask()(x, mask, keep_prob)`): GenMask draws the bits `ops.Dropout`
draws (the same seeds and step keep the same elements) and packs them as MindSpore's mask,
UInt8 of shape `(ceil(prod(shape) / 128) * 16,)`, element i in bit `i % 8` of byte `i // 8`.
DoMask reads the bit of each element's flat index in the whole tensor: its strategy splits x
(MindSpore's `((dp, mp),)`), the mask stays whole on every rank and each rank reads its block's
bits at its offsets, so any plan drops what one device drops."""

_MASK_TESTS = ("test_ops_random.py::test_gen_mask_packs_the_dropout_bits",
               "test_dropout_do_mask.py::test_mindspore_do_mask_networks_train_like_one_device")

define("DropoutGenMask", _gen_infer, _gen_np, _gen_jax, differentiable=False, num_inputs=1,
       attrs=_GEN_ATTRS, sharding=LabelRule(gen_mask_labels, unsplittable="the packed mask"),
       section="elementwise", dtypes=frozenset({DType.int32}),
       doc="The bits Dropout keeps for a tensor of `shape`, packed as MindSpore's UInt8 mask.",
       operands="int32 step; `shape`, `keep_prob`, `seed0`, `seed1`",
       rule="the packed mask is whole on every rank", note=_MASK_NOTE,
       spelling="`P.DropoutGenMask(Seed0, Seed1)(shape, keep_prob)`",
       tests=_MASK_TESTS)

define("DropoutDoMask", _do_infer, _do_np, _do_jax, vjp=_do_vjp, num_inputs=3,
       attrs=_DO_ATTRS, sharding=DropoutDoMaskRule(),
       dims=DimRule(_dims, _rewrite), section="elementwise", dtypes=FLOATS,
       doc="x / keep_prob where the packed mask's bit of the element is set, else 0.",
       operands="x, UInt8 mask, int32 offset; `keep_prob`, `global_shape`",
       rule="element-wise on x; the mask whole; each rank reads its block's bits",
       spelling="`P.DropoutDoMask()(x, mask, keep_prob)`",
       tests=_MASK_TESTS)
