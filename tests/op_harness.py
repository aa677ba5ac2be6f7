"""Checks one primitive against JAX written directly: forward values of the numpy interpreter
and of our JAX lowering, and gradients from IR autodiff (vjp rules executed by the interpreter)
against `jax.vjp` of the reference function.

Two checks, each with a derived bound (`check_op`'s docstring gives the argument):

* semantics, in float64: the graph evaluated with every float in float64 (the numpy
  interpreter's and the lowering's `float64` mode) against the reference on the inputs upcast
  to float64, within `FLOAT64_RTOL`;
* rounding, in the inputs' dtype: the program as it runs (float32, float16, bfloat16) against
  that float64 reference, within `rounding_rtol` (n * eps of the dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pcompile.backends.jax import lower_graph
from pcompile.backends.jax.lowering import x64
from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Value
from pcompile.ir.types import DType, TensorType, TupleType
from pcompile.passes.autodiff import append_gradients
from pcompile.tools.oracle import FLOAT64_RTOL

jax.config.update("jax_enable_x64", True)
# The references must not depend on the device's float32 matmul precision (TF32 on an H100
# differs from float32 by ~1e-3): every JAX matmul here is full float32 (or float64).
jax.config.update("jax_default_matmul_precision", "highest")

#: Roundings an element-wise result or gradient element takes at most: the result, then at
#: most three ops of its derivative (the floor of `rounding_rtol`'s count).
ELEMENTWISE_ROUNDINGS = 4


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


def _is_float(dtype: Any) -> bool:
    import ml_dtypes

    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype == ml_dtypes.bfloat16


def _eps(dtype: Any) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(dtype).eps)


def rounding_rtol(arrays: Sequence[Any]) -> float:
    """The relative difference between an op evaluated in its own float dtypes and the exact
    (float64) result: n * eps of the lowest-precision float among `arrays` (the inputs and
    outputs), with n the size of the largest of them, at least `ELEMENTWISE_ROUNDINGS`.

    Why: every output or gradient element is a reduction of at most n terms (a contraction,
    a sum, a norm's statistics; n bounds every reduction length), each term after a few
    roundings. Summing n terms in any order (numpy pairwise, XLA in blocks) rounds at most
    n - 1 partial sums, each by at most u = eps / 2 relative to the running sum, whose size is
    the scale the comparison measures against (the largest output, or the inputs' magnitude
    when the result cancels to near zero); with the terms' own roundings that is within
    2 n u = n eps. Only the evaluated side rounds: the reference is float64, whose rounding
    (2^-53 n) is far below. An element-wise op reduces nothing: its output and gradient
    elements each round at most `ELEMENTWISE_ROUNDINGS` times."""
    lowest = 0.0
    size = ELEMENTWISE_ROUNDINGS
    for a in arrays:
        a = np.asarray(a)
        size = max(size, a.size)
        if _is_float(a.dtype):
            lowest = max(lowest, _eps(a.dtype))
    return size * lowest


def _upcast(a: Any) -> Any:
    a = np.asarray(a)
    return a.astype(np.float64) if _is_float(a.dtype) else a


def _magnitude(inputs: Sequence[np.ndarray]) -> float:
    """The largest finite magnitude among the float inputs (at least 1)."""
    finite = [np.abs(np.asarray(a, np.float64)) for a in inputs
              if _is_float(np.asarray(a).dtype) and np.asarray(a).size]
    return max([float(np.max(x[np.isfinite(x)])) for x in finite
                if np.isfinite(x).any()] + [1.0])


def _compare(got: Any, want: Any, rtol: float, floor: float, what: str) -> None:
    """Non-float results exactly; floats within `rtol` relative to the larger of their own
    scale and `floor` (the scale of the terms that produced them)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if not _is_float(want.dtype) or not _is_float(got.dtype):
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    scale = max(float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0)), floor)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale,
                               err_msg=f"{what} (bound {rtol:.3g} of scale {scale:.3g})")


#: What tracing raises when a function reads its arguments' values.
_NEEDS_VALUES = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                 jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError)


def check_op(
    op: str,
    inputs: Sequence[np.ndarray],
    attrs: dict[str, Any],
    reference: Callable[..., Any],
    *,
    grad: bool = True,
    seed: int = 0,
    conditioning: float = 1.0,
) -> None:
    """`reference(*jnp_arrays)` is the op written directly in JAX (a tuple for multi-output
    ops). Gradients are checked for every floating-point input when `grad` is true.

    The reference runs once, on the inputs upcast to float64 (with its vjp): the exact result
    up to float64 rounding. Against it:

    * the graph in float64 (numpy interpreter and JAX lowering, `float64=True`) within
      `FLOAT64_RTOL` (2^-26, `pcompile.tools.oracle`): both sides compute the same
      arithmetic in float64, differing only in the order of roundings of 2^-53, so a wrong
      formula, constant or vjp rule shows however small. Constants a vjp rule puts in the
      graph (-1/n) are stored in the graph's dtype: each adds its half ulp (u of its dtype)
      to the gradients' bound. A reference output that is not float64 (it casts to a fixed
      dtype, e.g. `astype(jnp.float32)`) is compared with the rounding bound of its dtype;
    * the graph as it runs, in the inputs' dtypes, within `rounding_rtol(inputs + outputs)`:
      n * eps of the lowest float dtype, n the largest tensor (derivation there);

    both relative to the larger of the result's scale and the inputs' magnitude (times the
    cotangents' for gradients): outputs computed by cancellation (a saturated softmax, a loss
    near zero) are only as exact as the terms they cancel. Non-float outputs (integers,
    booleans) must be equal.

    `conditioning` multiplies the bound of the run in the inputs' dtypes for an op whose
    result divides by a spread it computes from the inputs (a normalisation: x - mean carries
    the rounding of x, relative to the spread, amplified by max|x| / spread); the caller
    derives it from the inputs (test_ops_nn's layer norm)."""
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

    float_idx = [i for i, p in enumerate(params) if p.dtype.is_float]
    diff_idx = [i for i, v in enumerate(outs) if v.dtype.is_float]
    with_grads = grad and bool(float_idx) and bool(diff_idx)
    cots: list[np.ndarray] = []
    if with_grads:
        rng = np.random.default_rng(seed)
        cots = [rng.standard_normal(outs[i].shape).astype(outs[i].dtype.np) for i in diff_idx]
        seeds = [Constant(c, outs[i].dtype) for c, i in zip(cots, diff_idx)]
        grads = append_gradients(graph, [outs[i] for i in diff_idx],
                                 [params[i] for i in float_idx], seeds)
        graph.outputs = list(outs) + list(grads)

    # The exact result: the reference on the inputs upcast to float64, with its vjp.
    # (device_put: jnp.asarray compiles a program per shape to copy a numpy array in)
    j64 = [jax.device_put(_upcast(a)) for a in inputs]

    def ref_float(*xs: Any) -> Any:
        full = list(j64)
        for i, x in zip(float_idx, xs):
            full[i] = x
        res = reference(*full)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        return tuple(res[i] for i in diff_idx), tuple(res)

    def exact_reference(*xs: Any) -> list[Any]:
        if not with_grads:
            return list(ref_float(*xs)[1])
        _, vjp_fn, want_outs = jax.vjp(ref_float, *xs, has_aux=True)
        # Cotangents in the dtype of the reference's outputs (float64, unless it casts).
        return list(want_outs) + list(vjp_fn(tuple(
            jnp.asarray(_upcast(c)).astype(want_outs[i].dtype) for c, i in zip(cots, diff_idx))))

    # The reference (with its vjp) and the lowering, in the inputs' dtypes and in float64,
    # traced and compiled as one program: eager JAX compiles every primitive and every
    # primitive of a vjp separately, which was most of an op check's time. A reference that
    # reads its arguments' values runs eagerly.
    lowered, lowered64 = lower_graph(graph), lower_graph(graph, float64=True)
    xs = [jax.device_put(np.asarray(a)) for a in inputs]
    xs_ref = [j64[i] for i in float_idx]
    with x64():
        try:
            want_all, got_jax, got_jax64 = jax.jit(lambda r, x, x64_: (
                exact_reference(*r), lowered(*x), lowered64(*x64_)))(xs_ref, xs, j64)
        except _NEEDS_VALUES:
            want_all = exact_reference(*xs_ref)
            got_jax, got_jax64 = jax.jit(lambda x, x64_: (lowered(*x), lowered64(*x64_)))(
                xs, j64)
    want_all = list(want_all)
    assert len(want_all) == len(graph.outputs), \
        f"{op}: {len(outs)} outputs, reference has {len(want_all) - len(graph.outputs) + len(outs)}"
    native = [("numpy", run_graph(graph, list(inputs))), ("jax", got_jax)]
    exact = [("numpy float64", run_graph(graph, list(inputs), float64=True)),
             ("jax float64", got_jax64)]

    # The graph's own constants (those a vjp rule emits, e.g. -1/n) are stored in their dtype,
    # so its float64 evaluation carries their rounding: at most half an ulp each, relative.
    seed_ids = {id(c) for c in seeds} if with_grads else set()
    constants = {id(v): v for node in graph.nodes for v in node.operands
                 if isinstance(v, Constant) and v.dtype.is_float and id(v) not in seed_ids
                 and v.dtype.np.itemsize < 8}
    stored = sum(_eps(v.dtype.np) / 2 for v in constants.values())
    magnitude = _magnitude(inputs)
    cot_scale = max([float(np.max(np.abs(c))) for c in cots if c.size] + [1.0])
    bound = rounding_rtol([*inputs, *native[0][1][:len(outs)]]) * conditioning
    labels = [f"output {i}" for i in range(len(outs))] + [
        f"gradient of input {i}" for i in float_idx]
    for k, (label, want) in enumerate(zip(labels, want_all)):
        floor = magnitude * (cot_scale if k >= len(outs) else 1.0)
        want_dtype = np.asarray(want).dtype
        # A reference that rounds to a fixed dtype is exact only to that dtype's rounding.
        bound64 = FLOAT64_RTOL + stored if want_dtype == np.float64 or not _is_float(
            want_dtype) else max(bound, rounding_rtol([np.zeros(0, want_dtype), *inputs]))
        for side, results in exact:
            _compare(results[k], want, bound64, floor, f"{op} {side} {label}")
        for side, results in native:
            _compare(results[k], want, bound, floor, f"{op} {side} {label}")
