"""More element-wise primitives: FloorDiv, Mod, Cos, Sin, IsFinite, Sign.

* `FloorDiv(x, y)`: floor(x / y) for floats, floor division (rounding toward -inf) for integers,
  as MindSpore's FloorDiv. Its gradient is zero for both operands (MindSpore's bprop returns
  `zeros_like` of each), so the vjp returns no cotangent.
* `Mod(x, y)`: the remainder of x / y with the sign of x (C's fmod: x - trunc(x / y) y), as
  MindSpore's Mod (FloorMod is the one with the sign of y). mindformers' TopkRouterV2 takes a
  sorted position modulo the tokens of a group with it. Gradient: cot for x and
  -cot trunc(x / y) for y (the derivative of x - trunc(x / y) y where the quotient is constant).
* `Cos`, `Sin`: the learning-rate schedules (`nn.CosineDecayLR`) and rotary embeddings need them.
* `IsFinite(x)`: Bool, False where x is inf or NaN (integers and Bool are always finite); the
  loss-scale cells test gradients for overflow with it. It stops gradients.
* `Sign(x)`: -1, 0 or 1 in x's dtype (NaN stays NaN; unsigned integers give 0 or 1), as
  MindSpore's Sign; its gradient is zero (MindSpore's bprop returns `zeros_like`).
  mindformers' TopkRouterV2 takes the sign of expert loads with it.

Sharding: all of them are element-wise (each output dim may be split, a broadcast dim never),
declared in their entries (`sharding=ELEMENTWISE`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import elementwise
from pcompile.ir.ops._jax import jnp
from pcompile.ir.ops._util import infer_binary, infer_unary_float, tensor, unbroadcast
from pcompile.ir.registry import ALL, FLOATS, NUMERIC
from pcompile.ir.types import DType, TensorType, ValueType


def _in_f32(fn: Any) -> Any:
    """A float formula computed in float32 for 16-bit inputs and rounded once (as XLA does)."""

    def impl(*arrays: Any) -> Any:
        dtype = np.asarray(arrays[0]).dtype
        if dtype.kind == "f" and dtype.itemsize < 4 or dtype.name == "bfloat16":
            arrays = tuple(np.asarray(a, np.float32) for a in arrays)
        return np.asarray(fn(*arrays)).astype(dtype, copy=False)

    return impl


# -- FloorDiv ---------------------------------------------------------------------------------


def _floor_div_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    out = tensor(infer_binary(types, attrs))
    if out.dtype is DType.bool_:
        raise ShapeError("needs numeric operands, got Bool")
    return out


def _floor_div_np(x: Any, y: Any) -> Any:
    if np.asarray(x).dtype.kind in "iu":
        with np.errstate(divide="ignore"):
            return np.floor_divide(x, y)
    return _in_f32(lambda a, b: np.floor(a / b))(x, y)


def _floor_div_jax(x: Any, y: Any) -> Any:
    if jnp.issubdtype(x.dtype, jnp.integer):
        return jnp.floor_divide(x, y)
    if x.dtype.itemsize < 4:  # as the numpy implementation: divide in float32, round once
        wide = jnp.float32
        return jnp.floor(x.astype(wide) / y.astype(wide)).astype(x.dtype)
    return jnp.floor(x / y)


def _floor_div_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [None, None]  # MindSpore's bprop: zeros for both operands


elementwise("FloorDiv", _floor_div_infer, _floor_div_np, _floor_div_jax, vjp=_floor_div_vjp,
            num_inputs=2,
            doc="floor(x / y) with broadcasting (integers: floor division); zero gradient.",
            operands="x, y (broadcast)", dtypes=NUMERIC,
            tests=("test_ops_arith.py::test_floor_div_matches_jax",
                   "test_ops_arith.py::test_floor_div_rounds_toward_minus_infinity",
                   "test_ops_arith.py::test_rules_match_the_oracle"),
            note="`FloorDiv` computes floor(x / y) (integers floor-divide); its gradient is zero, "
                 "as MindSpore's bprop.")

# -- Mod ---------------------------------------------------------------------------------------


def _mod_np(x: Any, y: Any) -> Any:
    if np.asarray(x).dtype.kind in "iu":
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.fmod(x, y)
    return _in_f32(np.fmod)(x, y)


def _mod_jax(x: Any, y: Any) -> Any:
    if not jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize < 4:
        return jnp.fmod(x.astype(jnp.float32), y.astype(jnp.float32)).astype(x.dtype)
    return jnp.fmod(x, y)


def _mod_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    quotient = b("RealDiv", b("Sub", x, node.result), y)  # trunc(x / y): (x - fmod(x, y)) / y
    return [unbroadcast(b, cot, x.shape),
            unbroadcast(b, b("Neg", b("Mul", cot, quotient)), y.shape)]


elementwise("Mod", _floor_div_infer, _mod_np, _mod_jax, vjp=_mod_vjp, num_inputs=2,
            doc="x - trunc(x / y) y with broadcasting: the remainder with the sign of x (fmod).",
            operands="x, y (broadcast)", dtypes=NUMERIC,
            tests=("test_ops_arith.py::test_mod_matches_jax",
                   "test_ops_arith.py::test_mod_takes_the_sign_of_the_dividend",
                   "test_ops_arith.py::test_rules_match_the_oracle"),
            note="`Mod` is C's fmod (the sign of x), as MindSpore's Mod.")

# -- Cos, Sin ---------------------------------------------------------------------------------

elementwise("Cos", infer_unary_float, _in_f32(np.cos), lambda x: jnp.cos(x),
            vjp=lambda b, node, cot: [b("Neg", b("Mul", cot, b("Sin", node.operands[0])))],
            doc="cos(x).", dtypes=FLOATS,
            tests=("test_ops_arith.py::test_cos_sin_match_jax",
                   "test_ops_arith.py::test_rules_match_the_oracle"))

elementwise("Sin", infer_unary_float, _in_f32(np.sin), lambda x: jnp.sin(x),
            vjp=lambda b, node, cot: [b("Mul", cot, b("Cos", node.operands[0]))], doc="sin(x).",
            dtypes=FLOATS,
            tests=("test_ops_arith.py::test_cos_sin_match_jax",
                   "test_ops_arith.py::test_rules_match_the_oracle"))

# -- IsFinite ---------------------------------------------------------------------------------


def _is_finite_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    return TensorType(DType.bool_, tensor(types[0]).shape)


def _is_finite_np(x: Any) -> Any:
    x = np.asarray(x)
    if x.dtype.kind in "f" or x.dtype.name == "bfloat16":
        return np.isfinite(x.astype(np.float32) if x.dtype.itemsize < 4 else x)
    return np.ones(x.shape, bool)


elementwise("IsFinite", _is_finite_infer, _is_finite_np, lambda x: jnp.isfinite(x),
            differentiable=False,
            doc="Bool: x is neither inf nor NaN (always True for integers and Bool).",
            operands="x -> Bool", dtypes=ALL, rule="element-wise; stops gradients",
            tests=("test_ops_arith.py::test_is_finite",))

# -- Sign -------------------------------------------------------------------------------------


def _sign_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0])
    if x.dtype is DType.bool_:
        raise ShapeError("needs a numeric input, got Bool (Cast it to an integer or float "
                         "dtype first)")
    return x


def _sign_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [None]  # MindSpore's bprop: zeros_like(x)


elementwise("Sign", _sign_infer, lambda x: np.sign(x), lambda x: jnp.sign(x), vjp=_sign_vjp,
            doc="-1, 0 or 1 by the sign of x, in x's dtype (NaN stays NaN); zero gradient.",
            dtypes=NUMERIC,
            tests=("test_ops_arith.py::test_sign_matches_jax",
                   "test_ops_arith.py::test_sign_of_zero_and_integers",
                   "test_ops_arith.py::test_rules_match_the_oracle"),
            note="`Sign` gives -1, 0 or 1 in x's dtype, as MindSpore's Sign; its gradient is "
                 "zero, as MindSpore's bprop.")
