"""Checks one primitive against JAX written directly: forward values of the numpy interpreter
and of our JAX lowering, and gradients from IR autodiff (vjp rules executed by the interpreter)
against `jax.vjp` of the reference function."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pcompile.backends.jax import lower_graph
from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Value
from pcompile.ir.types import DType, TensorType, TupleType
from pcompile.passes.autodiff import append_gradients

jax.config.update("jax_enable_x64", True)
# The references must not depend on the device's float32 matmul precision (TF32 on an H100
# differs from float32 by ~1e-3): every JAX matmul here is full float32 (or float64).
jax.config.update("jax_default_matmul_precision", "highest")


def assert_close(got: Any, want: Any, rtol: float = 1e-5, what: str = "",
                 atol: float = 0.0) -> None:
    """Relative closeness; `atol` adds an absolute floor for values that float32 computes by
    cancellation (e.g. a loss near zero from logits of magnitude 3)."""
    got, want = np.asarray(got), np.asarray(want)
    got = got.astype(np.float64) if got.dtype != bool else got
    want = want.astype(np.float64) if want.dtype != bool else want
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if got.dtype == bool:
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale + atol, err_msg=what)


def low_precision_rtol(dtype: Any) -> float:
    """The relative bound for an element-wise op in a dtype below float32, against JAX in the
    same dtype: each side rounds at most 4 times along an output or its gradient (the result,
    then at most three ops of its derivative), each rounding to nearest, within half an ulp:
    at most u = eps / 2 relative; the two sides' errors add: 2 x 4 u = 4 eps."""
    import ml_dtypes

    return 4 * float(ml_dtypes.finfo(dtype).eps)


def _rounding_bound(inputs: Sequence[np.ndarray]) -> float:
    import ml_dtypes

    eps = 0.0
    for a in inputs:
        dtype = np.asarray(a).dtype
        if dtype.kind == "f" and dtype.itemsize < 4 or dtype == ml_dtypes.bfloat16:
            eps = max(eps, float(ml_dtypes.finfo(dtype).eps))
    size = max([np.asarray(a).size for a in inputs] + [1])
    return size * eps


def check_op(
    op: str,
    inputs: Sequence[np.ndarray],
    attrs: dict[str, Any],
    reference: Callable[..., Any],
    *,
    grad: bool = True,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    """`reference(*jnp_arrays)` is the op written directly in JAX (a tuple for multi-output
    ops). Gradients are checked for every floating-point input when `grad` is true."""
    graph = Graph("check_" + op)
    params = []
    for i, array in enumerate(inputs):
        arr = np.asarray(array)
        dtype = DType.from_any(arr.dtype)
        params.append(
            graph.add_param(
                GraphParam(TensorType(dtype, arr.shape), f"x{i}", "weight", dtype.is_float)
            )
        )
    b = Builder(graph)
    out = b.emit(op, list(params), attrs)
    if isinstance(out.type, TupleType):
        outs: list[Value] = [
            b("TupleGetItem", out, index=i) for i in range(len(out.type.elements))
        ]
    else:
        outs = [out]
    graph.outputs = list(outs)

    jin = [jnp.asarray(a) for a in inputs]
    want = reference(*jin)
    want_list = list(want) if isinstance(want, (tuple, list)) else [want]
    got = run_graph(graph, list(inputs))
    lowered = jax.jit(lower_graph(graph))(*jin)
    assert len(got) == len(want_list), f"{op}: {len(got)} outputs, reference has {len(want_list)}"
    # An absolute floor at float32 rounding of the inputs' magnitude: outputs and gradients
    # computed by cancellation (saturated softmax, a loss near zero) cannot be closer.
    finite = [np.abs(np.asarray(a, np.float64)) for a in inputs
              if np.asarray(a).dtype.kind == "f" and np.asarray(a).size]
    magnitude = max([float(np.max(x[np.isfinite(x)])) for x in finite
                     if np.isfinite(x).any()] + [1.0])
    # Low-precision inputs: both sides round every step to the dtype, in different orders, so
    # the bound is the dtype's: a reduction of n terms differs by at most n * eps relative to
    # the scale of its terms (n bounded by the largest tensor), which is the inputs' magnitude
    # when the result cancels to near zero (a mean of +-1 values); float32 keeps the caller's
    # rtol.
    low = _rounding_bound(inputs)
    floor = max(1e-6, low) * magnitude
    rtol = max(rtol, low)
    for i, (g, lj, w) in enumerate(zip(got, lowered, want_list)):
        assert_close(g, w, rtol, f"{op} numpy output {i}", atol=floor)
        assert_close(lj, w, rtol, f"{op} jax output {i}", atol=floor)

    if not grad:
        return
    wrt = [p for p in params if p.dtype.is_float]
    diff_outs = [v for v in outs if v.dtype.is_float]
    if not wrt or not diff_outs:
        return
    rng = np.random.default_rng(seed)
    cots = [rng.standard_normal(v.shape).astype(v.dtype.np) for v in diff_outs]
    seeds = [Constant(c, v.dtype) for c, v in zip(cots, diff_outs)]
    grads = append_gradients(graph, diff_outs, wrt, seeds)
    graph.outputs = list(outs) + list(grads)
    got_all = run_graph(graph, list(inputs))
    got_grads = got_all[len(outs):]

    float_idx = [i for i, p in enumerate(params) if p.dtype.is_float]
    diff_idx = [i for i, v in enumerate(outs) if v.dtype.is_float]

    def ref_float(*xs: Any) -> Any:
        full = list(jin)
        for i, x in zip(float_idx, xs):
            full[i] = x
        res = reference(*full)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        return tuple(res[i] for i in diff_idx)

    _, vjp_fn = jax.vjp(ref_float, *[jin[i] for i in float_idx])
    want_grads = vjp_fn(tuple(jnp.asarray(c) for c in cots))
    cot_scale = max([float(np.max(np.abs(c))) for c in cots if c.size] + [1.0])
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, rtol, f"{op} gradient of input {float_idx[i]}",
                     atol=floor * cot_scale)
    # The lowered backward graph must agree with the interpreter too.
    lowered_all = jax.jit(lower_graph(graph))(*jin)
    for i, (g, lj) in enumerate(zip(got_grads, lowered_all[len(outs):])):
        assert_close(lj, g, rtol, f"{op} jax-lowered gradient of input {float_idx[i]}",
                     atol=floor * cot_scale)
