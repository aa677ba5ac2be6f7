"""Element-wise arithmetic MindSpore's parallel tests and `ops` functions use: Trunc, FloorMod,
Atan2, DivNoNan, MulNoNan, BitwiseAnd, BitwiseOr, BitwiseXor, AddExt, SubExt.

* `Trunc(x)`: x rounded toward zero (integers unchanged); zero gradient (MindSpore's bprop),
  so it stops gradients. `ops.div(x, y, rounding_mode="trunc")` is Trunc(RealDiv(x, y)).
* `FloorMod(x, y)`: x - floor(x / y) y, the remainder with the sign of y (Python's %), as
  MindSpore's FloorMod (Mod is the one with the sign of x). Gradient: cot for x and
  -cot floor(x / y) for y.
* `Atan2(x, y)`: atan(x / y) in the quadrant of the point (y, x) (numpy's arctan2(x, y)), as
  MindSpore's. Gradient: cot y / (x^2 + y^2) for x and -cot x / (x^2 + y^2) for y.
* `DivNoNan(x, y)`: x / y, and 0 where y is 0. Gradient (MindSpore's bprop): DivNoNan(cot, y)
  for x and -DivNoNan(cot, y) * out for y.
* `MulNoNan(x, y)`: x * y, and 0 where y is 0 (even where x is inf or NaN). Gradient:
  MulNoNan(cot, y) for x and MulNoNan(x, cot) for y, as MindSpore's bprop.
* `BitwiseAnd`, `BitwiseOr`, `BitwiseXor`: integers and Bool; no gradient.
* `AddExt(x, y; alpha)`, `SubExt(x, y; alpha)`: x + alpha y and x - alpha y (MindSpore's
  `ops.auto_generate` primitives behind `mint.add` / `mint.sub`); a float alpha needs float
  operands. Gradient: cot for x, +-alpha cot for y.

Sharding: every one is MindSpore's ArithmeticBase (`ELEMENTWISE`, each output dim may be split,
a broadcast dim never).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import elementwise
from pcompile.ir.ops._jax import deferred, jnp
from pcompile.ir.ops._util import infer_binary, tensor, unbroadcast
from pcompile.ir.registry import BOOL, FLOATS, INTS, NUMERIC
from pcompile.ir.types import DType, ValueType

_RULE_TESTS = "test_ops_numeric.py::test_rules_match_the_oracle"


def _wide(fn: Any) -> Any:
    """A float formula computed in float32 for 16-bit inputs and rounded once (as XLA does)."""

    def impl(*arrays: Any, **attrs: Any) -> Any:
        dtype = np.asarray(arrays[0]).dtype
        if dtype.kind == "f" and dtype.itemsize < 4 or dtype.name == "bfloat16":
            arrays = tuple(np.asarray(a, np.float32) for a in arrays)
        with np.errstate(all="ignore"):
            return np.asarray(fn(*arrays, **attrs)).astype(dtype, copy=False)

    return impl


def _wide_jax(fn: Any) -> Any:
    def impl(*arrays: Any, **attrs: Any) -> Any:
        dtype = arrays[0].dtype
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return fn(*(a.astype(jnp.float32) for a in arrays), **attrs).astype(dtype)
        return fn(*arrays, **attrs)

    return impl


def _numeric_binary(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(infer_binary(types, attrs))
    if out.dtype is DType.bool_:
        raise ShapeError("needs numeric operands, got Bool")
    return out


def _float_binary(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(infer_binary(types, attrs))
    if not out.dtype.is_float:
        raise ShapeError(f"needs floating-point operands, got {out.dtype.value}")
    return out


def _int_binary(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(infer_binary(types, attrs))
    if out.dtype.is_float:
        raise ShapeError(f"needs integer or Bool operands, got {out.dtype.value}")
    return out


def _numeric_unary(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if x.dtype is DType.bool_:
        raise ShapeError("needs a numeric input, got Bool")
    return x


# -- Trunc ------------------------------------------------------------------------------------


def _trunc_np(x: Any) -> Any:
    x = np.asarray(x)
    return x if x.dtype.kind in "iu" else _wide(np.trunc)(x)


elementwise("Trunc", _numeric_unary, _trunc_np,
            lambda x: x if jnp.issubdtype(x.dtype, jnp.integer) else jnp.trunc(x),
            differentiable=False, dtypes=NUMERIC,
            doc="x rounded toward zero (integers unchanged); zero gradient.",
            rule="element-wise; stops gradients",
            tests=("test_ops_numeric.py::test_values_match_jax", _RULE_TESTS))

# -- FloorMod ---------------------------------------------------------------------------------


def _floor_mod_np(x: Any, y: Any) -> Any:
    if np.asarray(x).dtype.kind in "iu":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.mod(x, y)
    return _wide(lambda a, b: a - np.floor(a / b) * b)(x, y)


def _floor_mod_jax(x: Any, y: Any) -> Any:
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.mod(x, y)
    return _wide_jax(lambda a, b: a - jnp.floor(a / b) * b)(x, y)


def _floor_mod_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    quotient = b("FloorDiv", x, y)
    return [unbroadcast(b, cot, x.shape),
            unbroadcast(b, b("Neg", b("Mul", cot, quotient)), y.shape)]


elementwise("FloorMod", _numeric_binary, _floor_mod_np, _floor_mod_jax, vjp=_floor_mod_vjp,
            num_inputs=2, operands="x, y (broadcast)", dtypes=NUMERIC,
            doc="x - floor(x / y) y with broadcasting: the remainder with the sign of y.",
            tests=("test_ops_numeric.py::test_values_match_jax",
                   "test_ops_numeric.py::test_mindspore_semantics_on_edge_values", _RULE_TESTS))

# -- Atan2 ------------------------------------------------------------------------------------


def _atan2_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    norm = b("Add", b("Mul", x, x), b("Mul", y, y))
    return [unbroadcast(b, b("RealDiv", b("Mul", cot, y), norm), x.shape),
            unbroadcast(b, b("Neg", b("RealDiv", b("Mul", cot, x), norm)), y.shape)]


elementwise("Atan2", _float_binary, _wide(np.arctan2),
            _wide_jax(lambda a, b: jnp.arctan2(a, b)), vjp=_atan2_vjp,
            num_inputs=2, operands="x, y (broadcast)", dtypes=FLOATS,
            doc="atan(x / y) in the quadrant of (y, x), with broadcasting.",
            tests=("test_ops_numeric.py::test_atan2_and_no_nan_ops_match_jax", _RULE_TESTS))

# -- DivNoNan, MulNoNan -----------------------------------------------------------------------


def _div_no_nan(a: Any, b: Any) -> Any:
    return np.where(b == 0, np.zeros((), a.dtype), a / np.where(b == 0, np.ones((), b.dtype), b))


def _div_no_nan_jax(a: Any, b: Any) -> Any:
    safe = jnp.where(b == 0, jnp.ones((), b.dtype), b)
    return jnp.where(b == 0, jnp.zeros((), a.dtype), a / safe)


def _div_no_nan_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    dx = b("DivNoNan", cot, y)
    return [unbroadcast(b, dx, x.shape),
            unbroadcast(b, b("Neg", b("Mul", dx, node.result)), y.shape)]


elementwise("DivNoNan", _float_binary, _wide(_div_no_nan), _wide_jax(_div_no_nan_jax),
            vjp=_div_no_nan_vjp, num_inputs=2, operands="x, y (broadcast)", dtypes=FLOATS,
            doc="x / y with broadcasting, 0 where y is 0.",
            tests=("test_ops_numeric.py::test_atan2_and_no_nan_ops_match_jax",
                   "test_ops_numeric.py::test_mindspore_semantics_on_edge_values", _RULE_TESTS))


def _mul_no_nan(a: Any, b: Any) -> Any:
    return np.where(b == 0, np.zeros((), a.dtype), a * b)


def _mul_no_nan_jax(a: Any, b: Any) -> Any:
    return jnp.where(b == 0, jnp.zeros((), a.dtype), a * b)


def _mul_no_nan_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    return [unbroadcast(b, b("MulNoNan", cot, y), x.shape),
            unbroadcast(b, b("MulNoNan", x, cot), y.shape)]


elementwise("MulNoNan", _float_binary, _wide(_mul_no_nan), _wide_jax(_mul_no_nan_jax),
            vjp=_mul_no_nan_vjp, num_inputs=2, operands="x, y (broadcast)", dtypes=FLOATS,
            doc="x * y with broadcasting, 0 where y is 0 (even where x is inf or NaN).",
            tests=("test_ops_numeric.py::test_atan2_and_no_nan_ops_match_jax",
                   "test_ops_numeric.py::test_mindspore_semantics_on_edge_values", _RULE_TESTS))

# -- BitwiseAnd, BitwiseOr, BitwiseXor --------------------------------------------------------

for _name, _fn in (("BitwiseAnd", "bitwise_and"), ("BitwiseOr", "bitwise_or"),
                   ("BitwiseXor", "bitwise_xor")):
    elementwise(_name, _int_binary, getattr(np, _fn), deferred(jnp, _fn), differentiable=False,
                num_inputs=2,
                operands="x, y (broadcast)", dtypes=INTS | BOOL,
                rule="element-wise; stops gradients",
                doc=f"bitwise {_name[len('Bitwise'):].lower()} of integers or Bool, with "
                    "broadcasting.",
                tests=("test_ops_numeric.py::test_values_match_jax", _RULE_TESTS))

# -- AddExt, SubExt ---------------------------------------------------------------------------


def _scaled(y: Any, alpha: Any, dtype: Any) -> Any:
    return y if alpha == 1 else y * np.asarray(alpha, dtype)


def _alpha_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(_numeric_binary(types, attrs))
    alpha = attrs["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ShapeError(f"alpha must be a number, got {alpha!r}")
    if isinstance(alpha, float) and not out.dtype.is_float:
        raise ShapeError(f"a float alpha ({alpha}) needs floating-point operands, got "
                         f"{out.dtype.value}")
    return out


def _ext_vjp(sign: str) -> Any:
    def vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
        x, y = node.operands
        alpha = node.attrs["alpha"]
        dy = cot if alpha == 1 else b("Mul", cot, alpha)
        if sign == "-":
            dy = b("Neg", dy)
        return [unbroadcast(b, cot, x.shape), unbroadcast(b, dy, y.shape)]

    return vjp


elementwise("AddExt", _alpha_infer,
            _wide(lambda x, y, alpha: x + _scaled(y, alpha, x.dtype)),
            _wide_jax(lambda x, y, alpha: x + (y if alpha == 1 else y * jnp.asarray(alpha,
                                                                                  y.dtype))),
            vjp=_ext_vjp("+"), num_inputs=2, attrs={"alpha": 1},
            operands="input, other (broadcast); `alpha`", dtypes=NUMERIC,
            doc="input + alpha * other with broadcasting (MindSpore's AddExt, `mint.add`).",
            tests=("test_ops_numeric.py::test_add_ext_and_sub_ext", _RULE_TESTS))

elementwise("SubExt", _alpha_infer,
            _wide(lambda x, y, alpha: x - _scaled(y, alpha, x.dtype)),
            _wide_jax(lambda x, y, alpha: x - (y if alpha == 1 else y * jnp.asarray(alpha,
                                                                                  y.dtype))),
            vjp=_ext_vjp("-"), num_inputs=2, attrs={"alpha": 1},
            operands="input, other (broadcast); `alpha`", dtypes=NUMERIC,
            doc="input - alpha * other with broadcasting (MindSpore's SubExt, `mint.sub`).",
            tests=("test_ops_numeric.py::test_add_ext_and_sub_ext", _RULE_TESTS))
