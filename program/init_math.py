"""From random bits to initial values, written once for numpy and for jax.numpy.

The initializers (program/initializers.py) turn the four 32-bit Philox words of an element
into a float64 value, then round it to the parameter's dtype. The numpy reference and the
device generator (backends/jax/param_init.py) must agree bit for bit, on any machine, so the
arithmetic here is restricted to what every backend rounds the same way:

- only IEEE-754 basic operations on float64 (+, -, *, /, sqrt), integer and bit operations,
  and exact integer-to-float conversions; never a math library's `log` or `cos`, whose last
  bit differs between glibc, numpy's SIMD loops (SVML on AVX-512 machines) and XLA;
- every product that feeds an addition goes through `ops.mul`, which on the device passes the
  rounded product through an opaque integer OR with zero: XLA allows LLVM to fuse a multiply
  and an add into one FMA (one rounding instead of two), which numpy never does, and it drops
  `lax.optimization_barrier`s; an integer operation on a runtime operand cannot be fused away.

The transforms:

- `unit_bits(hi, lo)`: a 53-bit integer K from two words; uniform U = K * 2^-53 in [0, 1).
- `uniform(words, low, high)`: low + (high - low) * U (U from words 0 and 1).
- `standard_normal(words)`: Box-Muller, sqrt(-2 log(1 - U1)) * cos(2 pi U2), with
  1 - U1 = (2^53 - K1) * 2^-53 exact, `log_unit` (fdlibm's log: an argument reduction by bit
  manipulation to m in [sqrt(2)/2, sqrt(2)) and a degree-14 odd polynomial in s = f / (2 + f),
  error < 1 ulp) and `cos_turns` (the angle reduced exactly on the integer K2 to a quarter turn
  q and a remainder x in [-pi/4, pi/4], then fdlibm's cos or sin kernel polynomial).

An `Ops` names the array namespace (`xp`) and the product fence (`mul`); `NUMPY` is numpy's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["NUMPY", "Ops", "cos_turns", "log_unit", "standard_normal", "uniform", "unit_bits"]


@dataclass(frozen=True)
class Ops:
    """An array namespace (numpy or jax.numpy) and the fenced product `mul(a, b)`."""

    xp: Any
    mul: Callable[[Any, Any], Any]

    def u64(self, x: Any) -> Any:
        return x if getattr(x, "dtype", None) == np.uint64 else x.astype(self.xp.uint64)

    def f64(self, x: Any) -> Any:
        return x.astype(self.xp.float64)

    def bits(self, x: Any) -> Any:
        """The uint64 bit pattern of float64 `x`."""
        if self.xp is np:
            return x.view(np.uint64)
        from jax import lax

        return lax.bitcast_convert_type(x, self.xp.uint64)

    def from_bits(self, u: Any) -> Any:
        if self.xp is np:
            return u.view(np.float64)
        from jax import lax

        return lax.bitcast_convert_type(u, self.xp.float64)


NUMPY = Ops(np, lambda a, b: a * b)
"""numpy: every operation is its own loop, rounded on its own (nothing to fence)."""

_TWO_M53 = 2.0 ** -53
_SQRT2 = 1.4142135623730951
_FRAC_MASK = (1 << 52) - 1

# log: fdlibm's e_log.c (Sun Microsystems, 1993): ln 2 in two parts and the minimax
# coefficients of log(1 + f) = 2s + s*R(s^2), s = f / (2 + f).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_LG = (6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01,
       2.222219843214978396e-01, 1.818357216161805012e-01, 1.531383769920937332e-01,
       1.479819860511658591e-01)
# cos and sin on [-pi/4, pi/4]: fdlibm's k_cos.c and k_sin.c coefficients.
_COS = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
        -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)
_SIN = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
        2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
_TWO_PI = 6.283185307179586


def _horner(ops: Ops, x: Any, coefficients: tuple[float, ...]) -> Any:
    """c0 + x*(c1 + x*(c2 + ...)), every product fenced."""
    out = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        out = c + ops.mul(x, out)
    return out


def unit_bits(ops: Ops, hi: Any, lo: Any) -> Any:
    """The 53-bit integer (uint64) of the top 32 bits of `hi` and the top 21 bits of `lo`."""
    return (ops.u64(hi) << np.uint64(21)) | (ops.u64(lo) >> np.uint64(11))


def uniform(ops: Ops, words: tuple[Any, ...], low: float, high: float) -> Any:
    """U(low, high) in float64 from words 0 and 1: low + (high - low) * U."""
    u = ops.f64(unit_bits(ops, words[0], words[1])) * _TWO_M53
    return low + ops.mul(high - low, u)


def log_unit(ops: Ops, k: Any) -> Any:
    """log(1 - K * 2^-53) for 53-bit integers K (the argument (2^53 - K) * 2^-53 is exact)."""
    xp = ops.xp
    v = ops.f64(np.uint64(1 << 53) - k) * _TWO_M53  # in (0, 1]
    bits = ops.bits(v)
    exponent = (bits >> np.uint64(52)).astype(xp.int64) - 1023
    m = ops.from_bits((bits & np.uint64(_FRAC_MASK)) | np.uint64(1023 << 52))  # [1, 2)
    big = m > _SQRT2
    m = xp.where(big, m * 0.5, m)  # [sqrt(2)/2, sqrt(2)); exact
    dk = ops.f64(exponent + big.astype(xp.int64))
    f = m - 1.0  # exact (Sterbenz)
    s = f / (2.0 + f)
    z = ops.mul(s, s)
    w = ops.mul(z, z)
    t1 = ops.mul(w, _horner(ops, w, _LG[1::2]))
    t2 = ops.mul(z, _horner(ops, w, _LG[0::2]))
    r = t2 + t1
    hfsq = ops.mul(ops.mul(0.5, f), f)
    inner = ops.mul(s, hfsq + r) + ops.mul(dk, _LN2_LO)
    return ops.mul(dk, _LN2_HI) - ((hfsq - inner) - f)


def cos_turns(ops: Ops, j: Any) -> Any:
    """cos(2 pi J * 2^-53) for 53-bit integers J: J is split exactly into a quarter turn q and
    a remainder of at most an eighth of a turn (x in [-pi/4, pi/4]); cos(x + q pi/2) is then
    cos x, -sin x, -cos x or sin x."""
    xp = ops.xp
    quarter = (j + np.uint64(1 << 50)) >> np.uint64(51)  # nearest quarter turn (2^51 units)
    rest = j.astype(xp.int64) - (quarter << np.uint64(51)).astype(xp.int64)  # |rest| <= 2^50
    x = ops.mul(_TWO_PI, ops.f64(rest) * _TWO_M53)
    z = ops.mul(x, x)
    hz = ops.mul(0.5, z)
    one_minus = 1.0 - hz
    cos = one_minus + (((1.0 - one_minus) - hz) + ops.mul(z, ops.mul(z, _horner(ops, z, _COS))))
    sin = x + ops.mul(ops.mul(z, x), _horner(ops, z, _SIN))
    q = quarter & np.uint64(3)
    return xp.where(q == 0, cos, xp.where(q == 1, -sin, xp.where(q == 2, -cos, sin)))


def standard_normal(ops: Ops, words: tuple[Any, ...]) -> Any:
    """N(0, 1) in float64 from four words (Box-Muller on two 53-bit uniforms)."""
    radius = ops.xp.sqrt(-2.0 * log_unit(ops, unit_bits(ops, words[0], words[1])))
    return radius * cos_turns(ops, unit_bits(ops, words[2], words[3]))
