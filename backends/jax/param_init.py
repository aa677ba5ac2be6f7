"""Parameter slices made on the device: the initializers' generator in jax.numpy.

`compiler/frontend/initializer.py` defines every random init by the Philox4x32-10 words at counter
(flat index, draw) under the key of its (seed, counter) ticket, and a float64 transform of
those words (program/init_math.py); numpy runs it on the host. Here the same generator runs
jitted on the device that holds the block, so a rank makes its slices at device speed and
nothing crosses from the host but the block's offsets and the key:

- Philox on uint32 words; the 32 x 32 -> 64-bit products are uint64 multiplications of
  zero-extended words (mul.wide / mulhi on GPUs);
- the transform is `Initializer.transform` itself, run with jax.numpy and `fenced` products
  (init_math: no FMA contraction), in float64 under a scoped `jax.enable_x64` (the rest of the
  program keeps its own setting);
- the rounding to the parameter's dtype is done on the bits (`round_bits`), as numpy does it:
  float32 and float16 directly from float64, bfloat16 through float32 (ml_dtypes' cast), each
  round-to-nearest-even with subnormals, and no flush-to-zero;
- truncated normals redraw in a `lax.while_loop` until every element is inside [a, b]: the
  same draws as numpy's masked loop, since each element's value at a draw depends only on its
  index and the draw;
- constant inits (zeros, ones, numbers: optimizer state) are filled on the device with the
  value numpy casts to the dtype.

`device_block(data, bounds, device)` returns the block as a jax.Array on `device` (a 0-d
value as a 1-element vector, as the SPMD program's global arrays hold it:
`spmd.blocked_shape`), or None for what only
numpy makes (user arrays, which are read from their .npy; integer dtypes of random inits;
inits without a `transform`). tests/backends/test_param_init.py checks it bit for bit against
`InitializedData.block` for every init and dtype on random blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pcompile.ir.types import DType
from pcompile.program.init_math import Ops
from pcompile.program.initializers import (
    Constant,
    InitializedData,
    Initializer,
    TruncatedNormal,
    philox_key,
)

__all__ = ["DEVICE_MIN_CONSTANT", "DEVICE_MIN_RANDOM", "device_block", "make_blocks", "mesh_blocks",
           "on_device", "philox", "round_bits", "supports"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_FLOATS = (DType.float32, DType.float16, DType.bfloat16, DType.float64)

# `auto`: a block is made on the device when the host would take longer than compiling the
# device's maker (~0.1-0.8 s on a CPU, once per distinct init, shape and block); smaller blocks
# (in values) are made with numpy.
DEVICE_MIN_RANDOM = 1 << 18
DEVICE_MIN_CONSTANT = 1 << 12


def philox(c0: Any, c1: Any, c2: Any, c3: Any, k0: Any, k1: Any) -> tuple[Any, ...]:
    """Philox4x32-10 on uint32 counter words and key words (the numpy reference:
    compiler/frontend/initializer.py `philox`)."""
    m0, m1 = np.uint64(_M0), np.uint64(_M1)
    w0, w1 = np.uint32(_W0), np.uint32(_W1)
    shift = np.uint64(32)
    for _ in range(10):
        p0 = c0.astype(jnp.uint64) * m0
        p1 = c2.astype(jnp.uint64) * m1
        c0, c1, c2, c3 = ((p1 >> shift).astype(jnp.uint32) ^ c1 ^ k0, p1.astype(jnp.uint32),
                          (p0 >> shift).astype(jnp.uint32) ^ c3 ^ k1, p0.astype(jnp.uint32))
        k0, k1 = k0 + w0, k1 + w1
    return c0, c1, c2, c3


def _fenced(zero: Any) -> Ops:
    """jax.numpy with every product rounded on its own: OR-ing the product's bits with a
    runtime zero keeps XLA and LLVM from fusing it into an FMA with the add that uses it."""

    def mul(a: Any, b: Any) -> Any:
        bits = lax.bitcast_convert_type(jnp.asarray(a * b, jnp.float64), jnp.uint64)
        return lax.bitcast_convert_type(bits | zero, jnp.float64)

    return Ops(jnp, mul)


def round_bits(x: Any, exponent_bits: int, mantissa_bits: int) -> Any:
    """The bits (uint64) of float64 `x` rounded to nearest-even in a binary format with the
    given field widths: subnormals, overflow to infinity, NaN kept, all on integers."""
    one = np.uint64(1)
    bits = lax.bitcast_convert_type(x, jnp.uint64)
    sign = bits >> np.uint64(63)
    biased = ((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(jnp.int64)
    frac = bits & np.uint64((1 << 52) - 1)
    normal = biased > 0
    significand = jnp.where(normal, frac | np.uint64(1 << 52), frac)
    unbiased = jnp.where(normal, biased - 1023, -1022)
    target = unbiased + (2 ** (exponent_bits - 1) - 1)  # the target's biased exponent
    extra = jnp.maximum(1 - target, 0)  # subnormal in the target: shift further
    shift = jnp.minimum(52 - mantissa_bits + extra, 63).astype(jnp.uint64)
    keep = significand >> shift
    rest = significand & ((one << shift) - one)
    half = one << (shift - one)
    up = (rest > half) | ((rest == half) & ((keep & one) == one))
    out = (jnp.maximum(target, 1) - 1).astype(jnp.uint64) * np.uint64(1 << mantissa_bits)
    out = out + keep + up.astype(jnp.uint64)  # a carry out of the mantissa bumps the exponent
    infinity = np.uint64(((1 << exponent_bits) - 1) << mantissa_bits)
    out = jnp.minimum(out, infinity)
    special = biased == 0x7FF  # inf stays inf, NaN a quiet NaN
    quiet = jnp.where(frac != 0, np.uint64(1 << (mantissa_bits - 1)), np.uint64(0))
    out = jnp.where(special, infinity | quiet, out)
    return out | (sign << np.uint64(exponent_bits + mantissa_bits))


def _to_dtype(values: Any, dtype: DType) -> Any:
    """float64 `values` cast to `dtype` bit for bit as numpy's `astype` does it."""
    if dtype is DType.float64:
        return values
    if dtype is DType.float16:
        return lax.bitcast_convert_type(round_bits(values, 5, 10).astype(jnp.uint16),
                                        jnp.float16)
    single = round_bits(values, 8, 23).astype(jnp.uint32)
    if dtype is DType.float32:
        return lax.bitcast_convert_type(single, jnp.float32)
    # bfloat16: ml_dtypes casts float64 to float32, then rounds the float32 bits to nearest
    # even (NaN kept quiet)
    nan = (single & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (single + np.uint32(0x7FFF) + ((single >> np.uint32(16)) & np.uint32(1)))
    half = jnp.where(nan, (single >> np.uint32(16)) | np.uint32(0x40),
                     rounded >> np.uint32(16))
    return lax.bitcast_convert_type(half.astype(jnp.uint16), jnp.bfloat16)


def supports(data: InitializedData) -> bool:
    """Whether `device_block` makes `data` on the device (else: numpy on the host)."""
    init = data.init
    if init is None:
        return False
    if isinstance(init, Constant):
        return True
    return (data.dtype in _FLOATS and data.ticket is not None
            and type(init).transform is not Initializer.transform)


@functools.lru_cache(maxsize=256)
def _generator(init: Initializer, shape: tuple[int, ...], block: tuple[int, ...],
               dtype: DType, zero_rows: tuple[int, ...]) -> Any:
    """The jitted maker of blocks of shape `block` of a tensor of `shape`: (starts uint64[ndim],
    key uint32[2], zero uint64[]) -> dtype[1, *block]."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

    def make(starts: Any, key: Any, zero: Any) -> Any:
        ops = _fenced(zero)
        index = jnp.zeros(block, jnp.uint64)
        for d, stride in enumerate(strides):
            along = lax.broadcasted_iota(jnp.uint64, block, d) + starts[d]
            index = index + along * np.uint64(stride)
        c0 = index.astype(jnp.uint32)
        c1 = (index >> np.uint64(32)).astype(jnp.uint32)
        c3 = jnp.zeros(block, jnp.uint32)

        def words(draw: Any) -> tuple[Any, ...]:
            c2 = jnp.broadcast_to(jnp.asarray(draw, jnp.uint32), block)
            return philox(c0, c1, c2, c3, key[0], key[1])

        values = init.transform(shape, words(0), ops)
        if isinstance(init, TruncatedNormal):
            def redraw(state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
                draw, out, bad = state
                out = jnp.where(bad, init.transform(shape, words(draw + 1), ops), out)
                return draw + 1, out, init.outside(out)

            _, values, _ = lax.while_loop(lambda state: state[2].any(), redraw,
                                          (jnp.uint32(0), values, init.outside(values)))
        out = _to_dtype(values, dtype)
        if zero_rows and block:
            row = lax.broadcasted_iota(jnp.uint64, block, 0) + starts[0]
            hit = functools.reduce(jnp.logical_or, [row == np.uint64(r) for r in zero_rows])
            out = jnp.where(hit, jnp.zeros((), out.dtype), out)
        return out if block else out.reshape((1,))  # its block of the global array

    return jax.jit(make)


def device_block(data: InitializedData, bounds: Sequence[tuple[int, int]], device: Any
                 ) -> jax.Array | None:
    """Block `bounds` of `data` made on `device` (of the block's shape; a 0-d value's: (1,)),
    bit for bit equal to `data.block(bounds)` (None: not made on the device, see
    `supports`)."""
    if not supports(data):
        return None
    bounds = tuple((int(lo), int(hi)) for lo, hi in bounds)
    if len(bounds) != len(data.shape) or any(
            not 0 <= lo <= hi <= d for (lo, hi), d in zip(bounds, data.shape)):
        raise ValueError(f"block {bounds} is outside a tensor of shape {data.shape}")
    block = tuple(hi - lo for lo, hi in bounds)
    init = data.init
    assert init is not None
    if isinstance(init, Constant) or not math.prod(block):
        value = np.zeros((), data.dtype.np)
        if isinstance(init, Constant):
            value = np.asarray(init.value).astype(data.dtype.np)  # numpy's cast, on the host
        with jax.enable_x64(data.dtype is DType.float64):
            out = jnp.full(block or (1,), value, device=device)
        rows = [r - bounds[0][0] for r in data.zero_rows
                if bounds and bounds[0][0] <= r < bounds[0][1]]
        if rows and value != 0:
            out = out.at[np.asarray(rows)].set(0)
        return out
    assert data.ticket is not None
    key = np.asarray(philox_key(data.ticket), np.uint32)
    starts = np.asarray([lo for lo, _ in bounds], np.uint64)
    with jax.enable_x64(True):
        fn = _generator(init, data.shape, block, data.dtype, tuple(data.zero_rows))
        args = [jax.device_put(a, device) for a in (starts, key, np.zeros((), np.uint64))]
        return fn(*args)


def on_device(data: InitializedData, bounds: Sequence[tuple[int, int]], where: str = "auto"
              ) -> bool:
    """Whether block `bounds` of `data` is made on the device (`where`: `device`, `host`, or
    `auto`: blocks of at least DEVICE_MIN_* values). 8-byte values stay on the host without
    x64: the device would hold them as 4-byte ones, as a device_put of the host's values
    gives them."""
    size = math.prod(hi - lo for lo, hi in bounds)
    constant = data.init is not None and not data.init.random
    wanted = where == "device" or (where == "auto" and size >= (
        DEVICE_MIN_CONSTANT if constant else DEVICE_MIN_RANDOM))
    return (wanted and supports(data)
            and (data.dtype.itemsize < 8 or bool(jax.config.read("jax_enable_x64"))))


def make_blocks(jobs: Sequence[tuple[InitializedData, Sequence[tuple[int, int]], Any]],
                where: str = "auto") -> tuple[list[jax.Array], dict[str, int]]:
    """Each job's block (data, bounds, device) as a jax.Array on its device, in job order (a
    0-d value as a 1-element vector), made on the device where `on_device` says so and with
    numpy otherwise, from a few threads: the device generator compiles once per distinct
    init, shape and block (XLA compiles in parallel), host blocks use numpy's loops. Also the
    number of values made on the device and on the host."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    counts = {"device": 0, "host": 0}

    def make(data: InitializedData, bounds: Sequence[tuple[int, int]], device: Any,
             here: bool) -> jax.Array:
        block = device_block(data, bounds, device) if here else None
        if block is None:
            host = np.asarray(data.block(bounds))
            block = jax.device_put(host if host.ndim else host.reshape((1,)), device)
        return block

    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pcompile-init") as pool:
        futures = []
        for data, bounds, device in jobs:
            here = on_device(data, bounds, where)
            counts["device" if here else "host"] += math.prod(hi - lo for lo, hi in bounds)
            futures.append(pool.submit(make, data, bounds, device, here))
        return [f.result() for f in futures], counts


@functools.lru_cache(maxsize=256)
def _mesh_generator(init: Initializer, shape: tuple[int, ...], block: tuple[int, ...],
                    dtype: DType, zero_rows: tuple[int, ...], mesh: Any) -> Any:
    """`_generator`'s maker run on every device of `mesh` at once: (starts uint64[n * ndim],
    each device's block's starts, sharded; key; zero) -> the global array of the n blocks
    (`spmd.blocked_shape`), one compilation for all devices."""
    from jax.sharding import PartitionSpec as P

    make = _generator(init, shape, block, dtype, zero_rows)
    axes = tuple(mesh.axis_names)
    return jax.jit(jax.shard_map(make, mesh=mesh, in_specs=(P(axes), P(), P()),
                                 out_specs=P(axes)))


@functools.lru_cache(maxsize=256)
def _mesh_filler(global_shape: tuple[int, ...], dtype: str, mesh: Any) -> Any:
    """A jitted (value) -> the global array of `global_shape` filled with it, sharded over
    every axis of `mesh` along its first dimension."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.jit(lambda value: jnp.full(global_shape, value, np.dtype(dtype)),
                   out_shardings=sharding)


def mesh_blocks(data: InitializedData, bounds: Sequence[Sequence[tuple[int, int]]], mesh: Any,
                where: str = "auto") -> jax.Array | None:
    """The global array (`spmd.blocked_shape`) of `data`'s blocks `bounds[r]` on the devices of
    `mesh` (rank r on `mesh.devices.flat[r]`, every device of this process), made by one
    program for all devices: bit for bit `device_block`'s blocks, with one compilation where
    `device_block` compiles once per device. None where the blocks differ in shape, the value
    is 0-d, a block is made on the host (`on_device`), or a constant has zeroed rows."""
    shapes = {tuple(hi - lo for lo, hi in b) for b in bounds}
    if len(shapes) != 1 or not data.shape or len(bounds) != mesh.size:
        return None
    block = shapes.pop()
    if not on_device(data, bounds[0], where):
        return None
    n = mesh.size
    global_shape = (n * block[0], *block[1:])
    init = data.init
    assert init is not None
    if isinstance(init, Constant) or not math.prod(block):
        value = np.zeros((), data.dtype.np)
        if isinstance(init, Constant):
            value = np.asarray(init.value).astype(data.dtype.np)  # numpy's cast, on the host
        if data.zero_rows and value != 0:
            return None
        with jax.enable_x64(data.dtype is DType.float64):
            return _mesh_filler(global_shape, value.dtype.str, mesh)(value)  # type: ignore[no-any-return]
    assert data.ticket is not None
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    key = np.asarray(philox_key(data.ticket), np.uint32)
    starts = np.asarray([[lo for lo, _ in b] for b in bounds], np.uint64).reshape(-1)
    with jax.enable_x64(True):
        fn = _mesh_generator(init, data.shape, block, data.dtype, tuple(data.zero_rows), mesh)
        sharded = jax.device_put(starts, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        return fn(sharded, key, np.zeros((), np.uint64))  # type: ignore[no-any-return]
