"""Parameter data at run time: the initializers (`Normal`, `Uniform`, ..., `Constant`) and
`InitializedData`, reproducible, lazily evaluated data of known shape and dtype, any block of
which is generated on its own. The front end's `initializer(init, shape, dtype)`
(compiler/frontend/initializer.py) draws the seed tickets and makes them; a rank generates its
blocks from the tickets recorded in params.json (backends/params.py, backends/jax/param_init.py).
This room imports only `ir/`: a rank initialises its parameters without loading the front end.

Any block of a tensor is generated on its own, equal to the same block of the whole tensor
(`InitializedData.block(bounds)`): element i (its flat C-order index in the whole tensor) takes
its random bits from a counter-based generator, Philox4x32-10 (Salmon et al., SC 2011) keyed by
the ticket, at counter (i, draw). Uniforms take 53 bits; normals use the Box-Muller transform of
two uniforms; truncated normals redraw (the next `draw`) what falls outside [a, b]. The float64
arithmetic from bits to values is program/init_math.py's: IEEE basic operations only (its own
log and cos, not a math library's), so the values are the same on every machine, and the device
generator (backends/jax/param_init.py) makes the same bits at device speed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pcompile.ir.types import DType
from pcompile.program import init_math
from pcompile.program.init_math import NUMPY, Ops

if TYPE_CHECKING:
    from pcompile.program.pretrained import PretrainedTensor


_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers and Weyl key increments
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
_CHUNK = 1 << 19  # elements generated at a time: the transforms' temporaries stay under ~100 MB


def philox_key(ticket: tuple[int, int]) -> tuple[int, int]:
    """Two 32-bit Philox key words from a (seed, counter) ticket (splitmix64 of each)."""

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return x ^ (x >> 31)

    seed, counter = ticket
    word = mix(mix(seed) ^ counter)
    return word & 0xFFFFFFFF, word >> 32


def philox(index: np.ndarray, draw: int, key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """Philox4x32-10 at counters (index_lo, index_hi, draw, 0): four uint32 words (held in
    uint64 arrays) per element of `index` (uint64)."""
    c0: np.ndarray = index & _MASK32
    c1: np.ndarray = index >> np.uint64(32)
    c2: np.ndarray = np.full(index.shape, draw, np.uint64)
    c3: np.ndarray = np.zeros(index.shape, np.uint64)
    k0, k1 = key
    for _ in range(10):
        p0 = c0 * np.uint64(_M0)
        p1 = c2 * np.uint64(_M1)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0), p1 & _MASK32,
                          (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1), p0 & _MASK32)
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return c0, c1, c2, c3


def standard_normal(index: np.ndarray, draw: int, key: tuple[int, int]) -> np.ndarray:
    """N(0, 1) (float64) per element of `index` at `draw` (program/init_math.py)."""
    return np.asarray(init_math.standard_normal(NUMPY, philox(index, draw, key)))


def block_indices(shape: tuple[int, ...], bounds: Sequence[tuple[int, int]]) -> np.ndarray:
    """Flat C-order indices (uint64) of the block `bounds` of a tensor of `shape`."""
    index = np.zeros((1,) * len(shape), np.uint64)
    stride = 1
    for dim in reversed(range(len(shape))):
        lo, hi = bounds[dim]
        axis = np.arange(lo, hi, dtype=np.uint64) * np.uint64(stride)
        view = [1] * len(shape)
        view[dim] = hi - lo
        index = index + axis.reshape(view)
        stride *= shape[dim]
    return index.reshape(tuple(hi - lo for lo, hi in bounds))


def _fans(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    """(fan_in, fan_out) as MindSpore / PyTorch: weight [out, in, *receptive_field]."""
    if len(shape) < 2:
        raise ValueError(
            f"{what}: fan_in and fan_out cannot be computed for a tensor with fewer than 2 "
            f"dimensions, got shape {shape}"
        )
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def _check_number(value: Any, what: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if positive and not number > 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    return number


class Initializer:
    """Base class: `sample(shape, index, key)` returns float64 (or exact) values of the
    elements at flat `index` (any array of uint64 C-order indices) of a tensor of `shape`;
    `key` is the ticket's Philox key (None for inits that draw no random numbers).

    A random init defines `transform(shape, words, ops)`: its float64 values from the four
    Philox words of draw 0, in the arithmetic of program/init_math.py, so that the numpy
    reference (`sample`) and the device generator (backends/jax/param_init.py) run the same
    operations."""

    random = True
    """Whether the init draws random numbers (and so takes a (seed, counter) ticket)."""

    def sample(self, shape: tuple[int, ...], index: np.ndarray,
               key: tuple[int, int] | None) -> np.ndarray:
        assert key is not None
        return np.asarray(self.transform(shape, philox(index, 0, key), NUMPY))

    def transform(self, shape: tuple[int, ...], words: tuple[Any, ...], ops: Ops) -> Any:
        raise NotImplementedError

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise ValueError if the init cannot make a tensor of `shape`."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class Normal(Initializer):
    """N(mean, sigma^2); MindSpore's default sigma is 0.01."""

    def __init__(self, sigma: float = 0.01, mean: float = 0.0) -> None:
        self.sigma = _check_number(sigma, "Normal: sigma", positive=True)
        self.mean = _check_number(mean, "Normal: mean")

    def transform(self, shape: tuple[int, ...], words: tuple[Any, ...], ops: Ops) -> Any:
        return self.mean + ops.mul(self.sigma, init_math.standard_normal(ops, words))


class Uniform(Initializer):
    """U(-scale, scale); MindSpore's default scale is 0.07."""

    def __init__(self, scale: float = 0.07) -> None:
        self.scale = _check_number(scale, "Uniform: scale", positive=True)

    def transform(self, shape: tuple[int, ...], words: tuple[Any, ...], ops: Ops) -> Any:
        return init_math.uniform(ops, words, -self.scale, self.scale)


class XavierUniform(Initializer):
    """U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio)."""

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = _check_number(gain, "XavierUniform: gain", positive=True)

    def check(self, shape: tuple[int, ...]) -> None:
        _fans(shape, "XavierUniform")

    def transform(self, shape: tuple[int, ...], words: tuple[Any, ...], ops: Ops) -> Any:
        fan_in, fan_out = _fans(shape, "XavierUniform")
        bound = self.gain * math.sqrt(6.0 / (fan_in + fan_out))
        return init_math.uniform(ops, words, -bound, bound)


class HeUniform(Initializer):
    """Kaiming uniform: U(-b, b), b = gain * sqrt(3 / fan), gain = sqrt(2 / (1 + slope^2))
    for leaky_relu (MindSpore's default nonlinearity) or sqrt(2) for relu."""

    def __init__(
        self, negative_slope: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"
    ) -> None:
        self.negative_slope = _check_number(negative_slope, "HeUniform: negative_slope")
        if mode not in ("fan_in", "fan_out"):
            raise ValueError(f"HeUniform: mode must be 'fan_in' or 'fan_out', got {mode!r}")
        if nonlinearity not in ("leaky_relu", "relu"):
            raise ValueError(
                f"HeUniform: nonlinearity must be 'leaky_relu' or 'relu', got {nonlinearity!r}"
            )
        self.mode = mode
        self.nonlinearity = nonlinearity

    def check(self, shape: tuple[int, ...]) -> None:
        _fans(shape, "HeUniform")

    def transform(self, shape: tuple[int, ...], words: tuple[Any, ...], ops: Ops) -> Any:
        fan_in, fan_out = _fans(shape, "HeUniform")
        fan = fan_in if self.mode == "fan_in" else fan_out
        slope = self.negative_slope if self.nonlinearity == "leaky_relu" else 0.0
        gain = math.sqrt(2.0 / (1.0 + slope**2))
        bound = gain * math.sqrt(3.0 / fan)
        return init_math.uniform(ops, words, -bound, bound)


class TruncatedNormal(Initializer):
    """N(mean, sigma^2) restricted to [a, b] (MindSpore 2.x: a=-2, b=2 in absolute units).
    An element outside [a, b] takes the value of the next draw (its Philox counter's third
    word), until one falls inside."""

    def __init__(
        self, sigma: float = 0.01, mean: float = 0.0, a: float = -2.0, b: float = 2.0
    ) -> None:
        self.sigma = _check_number(sigma, "TruncatedNormal: sigma", positive=True)
        self.mean = _check_number(mean, "TruncatedNormal: mean")
        self.a = _check_number(a, "TruncatedNormal: a")
        self.b = _check_number(b, "TruncatedNormal: b")
        if not self.a < self.b:
            raise ValueError(f"TruncatedNormal: need a < b, got a={a!r}, b={b!r}")
        mass = _normal_cdf((self.b - self.mean) / self.sigma) - _normal_cdf(
            (self.a - self.mean) / self.sigma
        )
        if mass < 1e-3:
            raise ValueError(
                f"TruncatedNormal: [a, b] = [{a}, {b}] holds only {mass:.2e} of N({mean}, "
                f"{sigma}^2); choose bounds closer to the mean"
            )

    def transform(self, shape: tuple[int, ...], words: tuple[Any, ...], ops: Ops) -> Any:
        """The candidate of one draw (not yet truncated)."""
        return self.mean + ops.mul(self.sigma, init_math.standard_normal(ops, words))

    def outside(self, values: Any) -> Any:
        """Which candidates are rejected."""
        return (values < self.a) | (values > self.b)

    def sample(self, shape: tuple[int, ...], index: np.ndarray,
               key: tuple[int, int] | None) -> np.ndarray:
        assert key is not None
        out: np.ndarray = self.transform(shape, philox(index, 0, key), NUMPY)
        bad = self.outside(out)
        draw = 0
        while bad.any():  # rejection: the accepted mass is >= 1e-3, so this ends quickly
            draw += 1
            out[bad] = self.transform(shape, philox(index[bad], draw, key), NUMPY)
            bad = self.outside(out)
        return out


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class Constant(Initializer):
    """Every element equal to `value`."""

    random = False

    def __init__(self, value: Any) -> None:
        if not isinstance(value, (numbers.Number, np.bool_)) or isinstance(value, complex):
            raise TypeError(f"Constant: value must be a number, got {type(value).__name__}")
        self.value = value.item() if isinstance(value, np.generic) else value

    def sample(self, shape: tuple[int, ...], index: np.ndarray,
               key: tuple[int, int] | None) -> np.ndarray:
        return np.full(index.shape, self.value)


class Zero(Constant):
    """All zeros."""

    def __init__(self) -> None:
        super().__init__(0)


class One(Constant):
    """All ones."""

    def __init__(self) -> None:
        super().__init__(1)


NAMED_INITIALIZERS: dict[str, type[Initializer]] = {
    "normal": Normal,
    "zeros": Zero,
    "zero": Zero,
    "ones": One,
    "one": One,
    "uniform": Uniform,
    "xavier_uniform": XavierUniform,
    "xavieruniform": XavierUniform,
    "he_uniform": HeUniform,
    "heuniform": HeUniform,
    "truncatednormal": TruncatedNormal,
    "truncated_normal": TruncatedNormal,
}
INIT_NAMES = (
    "normal",
    "zeros",
    "ones",
    "uniform",
    "xavier_uniform",
    "he_uniform",
    "truncatednormal",
)
"""The documented names (aliases: zero, one, xavieruniform, heuniform, truncated_normal)."""


class InitializedData:
    """Parameter data of known shape and dtype, generated on demand and reproducibly.

    ``np.asarray(data)``, ``data.asnumpy()``, ``data.init_data()`` and ``data.to_numpy()`` all
    return the same values (a fresh array each time)."""

    __slots__ = ("init", "shape", "dtype", "ticket", "_array", "zero_rows")

    def __init__(
        self,
        init: Initializer | None,
        shape: tuple[int, ...],
        dtype: DType,
        ticket: tuple[int, int] | None,
        array: np.ndarray | PretrainedTensor | None = None,
        zero_rows: tuple[int, ...] = (),
    ) -> None:
        self.init = init
        self.shape = shape
        self.dtype = dtype
        self.ticket = ticket
        self._array = array
        self.zero_rows = zero_rows  # rows of dim 0 set to zero (an Embedding's padding_idx)

    @staticmethod
    def of_array(array: Any, dtype: Any = None) -> InitializedData:
        """Data given as an array (a numpy array, or a memory-mapped one: blocks are read
        from it lazily, never copied whole)."""
        arr = array if isinstance(array, np.ndarray) else np.asarray(array)
        return InitializedData(None, tuple(int(d) for d in arr.shape),
                               DType.from_any(dtype if dtype is not None else arr.dtype),
                               None, arr)

    @property
    def array(self) -> np.ndarray | PretrainedTensor | None:
        """The user's array, when the data was given as one (or a checkpoint's tensor)."""
        return self._array

    def with_zero_rows(self, rows: Sequence[int]) -> InitializedData:
        """The same data with rows `rows` of dim 0 set to zero."""
        return InitializedData(self.init, self.shape, self.dtype, self.ticket, self._array,
                               tuple(sorted(set(self.zero_rows) | {int(r) for r in rows})))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def to_numpy(self) -> np.ndarray:
        """The values, as a new numpy array of `dtype`."""
        return self.block(tuple((0, d) for d in self.shape))

    def block(self, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        """The values of the block `bounds` ((begin, end) per dim), equal to the same block of
        `to_numpy()`, generated without the rest of the tensor."""
        bounds = tuple((int(lo), int(hi)) for lo, hi in bounds)
        if len(bounds) != len(self.shape) or any(
                not 0 <= lo <= hi <= d for (lo, hi), d in zip(bounds, self.shape)):
            raise ValueError(f"block {bounds} is outside a tensor of shape {self.shape}")
        out = self._block(bounds)
        for row in self.zero_rows:
            if bounds and bounds[0][0] <= row < bounds[0][1]:
                out[row - bounds[0][0]] = 0
        return out

    def _block(self, bounds: tuple[tuple[int, int], ...]) -> np.ndarray:
        if self._array is not None:
            part = self._array[tuple(slice(lo, hi) for lo, hi in bounds)]
            return np.array(part, dtype=self.dtype.np, copy=True)
        assert self.init is not None
        key = philox_key(self.ticket) if self.ticket is not None else None
        out = np.empty(tuple(hi - lo for lo, hi in bounds), self.dtype.np)
        if not out.size:
            return out
        if not self.shape:
            index = np.zeros((), np.uint64)
            out[...] = _rounded(np.asarray(self.init.sample(self.shape, index, key)), out.dtype)
            return out
        # A few rows at a time, so the generator's temporaries stay small.
        rows = max(1, _CHUNK // max(1, out[0].size))
        lo0, hi0 = bounds[0]
        for start in range(lo0, hi0, rows):
            stop = min(hi0, start + rows)
            index = block_indices(self.shape, ((start, stop), *bounds[1:]))
            values = np.asarray(self.init.sample(self.shape, index, key))
            out[start - lo0:stop - lo0] = _rounded(values, out.dtype)
        return out

    asnumpy = to_numpy
    init_data = to_numpy

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.to_numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        what = repr(self.init) if self.init is not None else "array"
        return f"InitializedData({what}, shape={self.shape}, dtype={self.dtype.value})"



def _rounded(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 samples in `dtype` as the device rounds them (backends/jax/param_init.py):
    bfloat16 through float32, so that host and device blocks agree bit for bit whichever way
    the installed ml_dtypes casts float64 to bfloat16 (0.7 rounds once, directly)."""
    if dtype == np.dtype(DType.bfloat16.np):
        return values.astype(np.float32).astype(dtype)
    return values.astype(dtype, copy=False)
