"""NN primitives against JAX written directly: forward values, gradients, error messages."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax import lax

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from tests.op_harness import check_op

SEEDS = st.integers(0, 2**31 - 1)
EXAMPLES = settings(max_examples=10, deadline=None)
HIGHEST = lax.Precision.HIGHEST


def _rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _build(
    op: str, shapes: list[tuple[int, ...]], attrs: dict[str, Any], dtypes: list[DType] | None = None
) -> Any:
    graph = Graph("t")
    dtypes = dtypes or [DType.float32] * len(shapes)
    params = [
        graph.add_param(GraphParam(TensorType(d, s), f"x{i}"))
        for i, (s, d) in enumerate(zip(shapes, dtypes))
    ]
    return Builder(graph).emit(op, list(params), attrs)


# -- Softmax / LogSoftmax -------------------------------------------------------------------


@st.composite
def _shape_and_axis(draw: Any) -> tuple[tuple[int, ...], int]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return shape, axis


@EXAMPLES
@given(_shape_and_axis(), SEEDS)
def test_softmax(case: tuple[tuple[int, ...], int], seed: int) -> None:
    shape, axis = case
    x = _rand(shape, seed, 3.0)
    check_op("Softmax", [x], {"axis": (axis,)}, lambda x: jax.nn.softmax(x, axis=axis))


def test_softmax_default_axis_and_int_axis() -> None:
    x = _rand((3, 4), 1)
    check_op("Softmax", [x], {}, lambda x: jax.nn.softmax(x, axis=-1))
    check_op("Softmax", [x], {"axis": 0}, lambda x: jax.nn.softmax(x, axis=0))


@EXAMPLES
@given(_shape_and_axis(), SEEDS)
def test_log_softmax(case: tuple[tuple[int, ...], int], seed: int) -> None:
    shape, axis = case
    x = _rand(shape, seed, 3.0)
    check_op("LogSoftmax", [x], {"axis": axis}, lambda x: jax.nn.log_softmax(x, axis=axis))


def test_softmax_large_logits_are_stable() -> None:
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1002.0, -1001.0]], np.float32)
    check_op("Softmax", [x], {"axis": (-1,)}, lambda x: jax.nn.softmax(x, axis=-1))
    check_op("LogSoftmax", [x], {"axis": -1}, lambda x: jax.nn.log_softmax(x, axis=-1))


# -- LayerNorm ------------------------------------------------------------------------------


@st.composite
def _layer_norm_case(draw: Any) -> tuple[tuple[int, ...], int, int, float]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    rank = len(shape)
    bna = draw(st.integers(-rank, rank - 1))
    bpa = draw(st.integers(-rank, rank - 1))
    # With fewer than 3 normalised elements dx is pure cancellation noise (exactly 0 for 1,
    # O(epsilon) for 2), which float32 cannot reproduce to 1e-4.
    assume(int(np.prod(shape[bna % rank :])) >= 3)
    eps = draw(st.sampled_from([1e-5, 1e-3]))
    return shape, bna, bpa, eps


def _layer_norm_ref(x: Any, g: Any, b: Any, bna: int, eps: float) -> Any:
    axes = tuple(range(bna % x.ndim, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * g + b


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@EXAMPLES
@given(_layer_norm_case(), SEEDS)
def test_layer_norm(case: tuple[tuple[int, ...], int, int, float], seed: int) -> None:
    shape, bna, bpa, eps = case
    pshape = shape[bpa % len(shape) :]
    x, g, b = _rand(shape, seed), _rand(pshape, seed + 1), _rand(pshape, seed + 2)
    attrs = {"begin_norm_axis": bna, "begin_params_axis": bpa, "epsilon": eps}
    check_op(
        "LayerNorm", [x, g, b], attrs, lambda x, g, b: _layer_norm_ref(x, g, b, bna, eps),
        conditioning=_layer_norm_conditioning(x, bna, eps),
    )


def _layer_norm_conditioning(x: np.ndarray, bna: int, eps: float) -> float:
    """1 + 2 max|x| / sqrt(var + epsilon) over the normalised groups: x - mean is computed
    with an error of about 2 ulps of max|x| (the mean's rounding and the subtraction's), and
    the normalised value and the gradients (which divide by the same spread once more, as
    their scale does) carry it relative to the spread: a group of close values (spread 0.1,
    values near 0.85) loses 3 bits."""
    axes = tuple(range(bna % x.ndim, x.ndim))
    x64 = x.astype(np.float64)
    spread = np.sqrt(x64.var(axis=axes, keepdims=True) + eps)
    return float(1.0 + 2.0 * np.max(np.max(np.abs(x64), axis=axes, keepdims=True) / spread))


@pytest.mark.parametrize("case", [((2, 3, 4), -1, -2, 1e-3), ((3, 5), 0, 1, 1e-5)])
def test_layer_norm_fixed_cases(case: tuple[tuple[int, ...], int, int, float]) -> None:
    """Parameters wider than the normalised axes, and a normalisation over every axis."""
    test_layer_norm.hypothesis.inner_test(case, 7)


def test_layer_norm_defaults() -> None:
    x, g, b = _rand((4, 3, 5), 0), _rand((3, 5), 1), _rand((3, 5), 2)
    check_op(
        "LayerNorm", [x, g, b], {}, lambda x, g, b: _layer_norm_ref(x, g, b, 1, 1e-7)
    )


# -- cross entropy --------------------------------------------------------------------------


@pytest.mark.slow  # the sweep (~7 s); the fixed cases below run in the fast step
@EXAMPLES
@given(st.integers(1, 5), st.integers(1, 6), st.booleans(), SEEDS)
def test_softmax_cross_entropy(n: int, c: int, normalised: bool, seed: int) -> None:
    logits = _rand((n, c), seed, 2.0)
    labels = np.random.default_rng(seed + 1).uniform(0, 1, (n, c)).astype(np.float32)
    if normalised:
        labels /= labels.sum(axis=-1, keepdims=True)

    def ref(z: Any, y: Any) -> Any:
        return -jnp.sum(y * jax.nn.log_softmax(z, axis=-1), axis=-1)

    check_op("SoftmaxCrossEntropyWithLogits", [logits, labels], {}, ref)


@pytest.mark.parametrize(("n", "c", "normalised"), [(3, 4, True), (2, 5, False)])
def test_softmax_cross_entropy_fixed_cases(n: int, c: int, normalised: bool) -> None:
    test_softmax_cross_entropy.hypothesis.inner_test(n, c, normalised, 2)


def _sparse_ref(z: Any, y: Any) -> Any:
    picked = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), y[:, None], axis=1)
    return -jnp.mean(picked)


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@EXAMPLES
@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from([np.int32, np.int64]), SEEDS)
def test_sparse_softmax_cross_entropy(n: int, c: int, dtype: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = _rand((n, c), seed, 2.0)
    labels = rng.integers(0, c, n).astype(dtype)
    check_op("SparseSoftmaxCrossEntropyWithLogits", [logits, labels], {}, _sparse_ref)
    # is_grad=True returns the gradient of the mean loss (what MindSpore's bprop uses).
    check_op(
        "SparseSoftmaxCrossEntropyWithLogits",
        [logits, labels],
        {"is_grad": True},
        lambda z, y: jax.grad(_sparse_ref)(z, y),
        grad=False,
    )


@pytest.mark.parametrize(("n", "c", "dtype"), [(4, 5, np.int64), (2, 1, np.int32)])
def test_sparse_softmax_cross_entropy_fixed_cases(n: int, c: int, dtype: Any) -> None:
    test_sparse_softmax_cross_entropy.hypothesis.inner_test(n, c, dtype, 3)


# -- Conv2D ---------------------------------------------------------------------------------


@st.composite
def _conv_case(draw: Any) -> dict[str, Any]:
    group = draw(st.sampled_from([1, 1, 2]))
    cin = group * draw(st.integers(1, 3))
    cout = group * draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad_mode = draw(st.sampled_from(["valid", "same", "pad"]))
    pad = tuple(draw(st.integers(0, 2)) for _ in range(4)) if pad_mode == "pad" else (0, 0, 0, 0)
    ekh, ekw = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    min_h = max(1, ekh - pad[0] - pad[1]) if pad_mode != "same" else 1
    min_w = max(1, ekw - pad[2] - pad[3]) if pad_mode != "same" else 1
    h = draw(st.integers(min_h, min_h + 5))
    w = draw(st.integers(min_w, min_w + 5))
    n = draw(st.integers(1, 2))
    return {
        "x": (n, cin, h, w),
        "w": (cout, cin // group, kh, kw),
        "attrs": {
            "out_channel": cout,
            "kernel_size": (kh, kw),
            "stride": stride,
            "dilation": dilation,
            "pad_mode": pad_mode,
            "pad": pad,
            "group": group,
        },
    }


def _conv_ref(attrs: dict[str, Any]) -> Any:
    mode = attrs["pad_mode"]
    if mode == "pad":
        p = attrs["pad"]
        padding: Any = [(p[0], p[1]), (p[2], p[3])]
    else:
        padding = mode.upper()

    def conv(x: Any, w: Any) -> Any:
        if mode == "pad":  # padded by jnp.pad: JAX's own transpose of conv padding can be wrong
            x = jnp.pad(x, ((0, 0), (0, 0), *padding))
        return lax.conv_general_dilated(
            x,
            w,
            attrs["stride"],
            "VALID" if mode == "pad" else padding,
            rhs_dilation=attrs["dilation"],
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            feature_group_count=attrs["group"],
            precision=HIGHEST,
        )

    return conv


def test_conv2d_gradient_with_a_pad_as_wide_as_the_kernel() -> None:
    """JAX 0.10 transposes `conv_general_dilated(padding=[(1, 1), (2, 0)])` wrongly (a pad that
    reaches the 2x2 kernel's width): pcompile's gradient (numpy, and JAX through jnp.pad) must
    be the true one; checked against the gradient summed element by element."""
    attrs = {"out_channel": 2, "kernel_size": (2, 2), "stride": (1, 1), "dilation": (1, 1),
             "pad_mode": "pad", "pad": (1, 1, 2, 0), "group": 1}
    x, w = _rand((2, 1, 1, 2), 0), _rand((2, 1, 2, 2), 1)
    check_op("Conv2D", [x, w], attrs, _conv_ref(attrs))
    ref = _conv_ref(attrs)
    d = _rand(tuple(jax.eval_shape(ref, x, w).shape), 2)
    basis = np.eye(x.size, dtype=np.float32).reshape((x.size, *x.shape))
    brute = [float(np.sum(d * np.asarray(ref(e, w)))) for e in basis]
    grad = jax.vjp(lambda a: ref(a, w), jnp.asarray(x))[1](jnp.asarray(d))[0]
    bound = d.size * float(np.finfo(np.float32).eps)  # float32 sums of d.size terms
    scale = max(abs(b) for b in brute)
    np.testing.assert_allclose(np.asarray(grad).ravel(), brute, rtol=bound, atol=bound * scale)


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@settings(max_examples=15, deadline=None)
@given(_conv_case(), SEEDS)
def test_conv2d(case: dict[str, Any], seed: int) -> None:
    x, w = _rand(case["x"], seed), _rand(case["w"], seed + 1)
    check_op("Conv2D", [x, w], case["attrs"], _conv_ref(case["attrs"]))


def _conv_attrs(cout: int, kernel: tuple[int, int], stride: tuple[int, int],
                dilation: tuple[int, int], pad_mode: str, pad: tuple[int, ...], group: int
                ) -> dict[str, Any]:
    return {"out_channel": cout, "kernel_size": kernel, "stride": stride, "dilation": dilation,
            "pad_mode": pad_mode, "pad": pad, "group": group}


@pytest.mark.parametrize("case", [
    # two groups, valid, a stride and a dilation along different axes
    {"x": (2, 4, 7, 6), "w": (4, 2, 2, 3),
     "attrs": _conv_attrs(4, (2, 3), (1, 2), (2, 1), "valid", (0, 0, 0, 0), 2)},
    # an uneven explicit pad with stride 2 (same mode: test_conv2d_mindspore_style_attrs)
    {"x": (1, 3, 5, 5), "w": (2, 3, 3, 3),
     "attrs": _conv_attrs(2, (3, 3), (2, 2), (1, 1), "pad", (1, 0, 2, 1), 1)},
], ids=["group2-valid", "pad-stride2"])
def test_conv2d_fixed_cases(case: dict[str, Any]) -> None:
    test_conv2d.hypothesis.inner_test(case, 5)


@settings(max_examples=6, deadline=None)
@given(_conv_case(), SEEDS)
def test_conv2d_backprop_ops(case: dict[str, Any], seed: int) -> None:
    """The backprop primitives on their own, against jax.vjp of lax.conv_general_dilated."""
    attrs = case["attrs"]
    ref = _conv_ref(attrs)
    x, w = _rand(case["x"], seed), _rand(case["w"], seed + 1)
    out_shape = jax.eval_shape(ref, x, w).shape
    dout = _rand(out_shape, seed + 2)
    check_op(
        "Conv2DBackpropInput",
        [dout, w],
        {**attrs, "input_size": case["x"]},
        lambda d, w: jax.vjp(lambda a: ref(a, w), jnp.asarray(x, d.dtype))[1](d)[0],
        grad=False,
    )
    check_op(
        "Conv2DBackpropFilter",
        [dout, x],
        {**attrs, "filter_size": case["w"]},
        lambda d, x: jax.vjp(lambda b: ref(x, b), jnp.asarray(w, d.dtype))[1](d)[0],
        grad=False,
    )


def test_conv2d_mindspore_style_attrs() -> None:
    """int kernel/stride and MindSpore's 4-tuple stride/dilation are accepted."""
    x, w = _rand((1, 2, 7, 7), 0), _rand((3, 2, 3, 3), 1)
    attrs = {
        "out_channel": 3,
        "kernel_size": 3,
        "stride": (1, 1, 2, 2),
        "dilation": (1, 1, 1, 1),
        "pad_mode": "SAME",
    }
    ref = _conv_ref({"stride": (2, 2), "dilation": (1, 1), "pad_mode": "same", "group": 1})
    check_op("Conv2D", [x, w], attrs, ref)


# -- pooling --------------------------------------------------------------------------------


@st.composite
def _pool_case(draw: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    strides = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    pad_mode = draw(st.sampled_from(["VALID", "SAME", "same"]))
    h, w = draw(st.integers(kh, kh + 5)), draw(st.integers(kw, kw + 5))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w)
    return shape, {"kernel_size": (kh, kw), "strides": strides, "pad_mode": pad_mode}


def _window_args(attrs: dict[str, Any]) -> tuple[Any, Any, str]:
    return (1, 1) + attrs["kernel_size"], (1, 1) + attrs["strides"], attrs["pad_mode"].upper()


@pytest.mark.slow  # the sweep (~7 s); the fixed cases below run in the fast step
@EXAMPLES
@given(_pool_case(), SEEDS)
def test_max_pool(case: tuple[tuple[int, ...], dict[str, Any]], seed: int) -> None:
    shape, attrs = case
    dims, strides, padding = _window_args(attrs)

    def ref(x: Any) -> Any:
        return lax.reduce_window(x, -jnp.inf, lax.max, dims, strides, padding)

    # Continuous random data: no ties inside a window.
    check_op("MaxPool", [_rand(shape, seed)], attrs, ref)


@pytest.mark.parametrize("case", [
    ((2, 3, 5, 6), {"kernel_size": (2, 3), "strides": (2, 1), "pad_mode": "VALID"}),
    ((1, 2, 4, 5), {"kernel_size": (3, 2), "strides": (2, 3), "pad_mode": "same"}),
], ids=["valid", "same"])
def test_max_pool_fixed_cases(case: tuple[tuple[int, ...], dict[str, Any]]) -> None:
    test_max_pool.hypothesis.inner_test(case, 4)


@EXAMPLES
@given(_pool_case(), SEEDS)
def test_avg_pool(case: tuple[tuple[int, ...], dict[str, Any]], seed: int) -> None:
    shape, attrs = case
    dims, strides, padding = _window_args(attrs)

    def ref(x: Any) -> Any:
        s = lax.reduce_window(x, 0.0, lax.add, dims, strides, padding)
        count = lax.reduce_window(jnp.ones_like(x), 0.0, lax.add, dims, strides, padding)
        return s / count

    check_op("AvgPool", [_rand(shape, seed)], attrs, ref)


# -- graph structure and errors -------------------------------------------------------------


def test_vjps_use_dedicated_grad_ops() -> None:
    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (2, 3, 6, 6)), "x", "weight", True))
    w = graph.add_param(GraphParam(TensorType(DType.float32, (4, 3, 3, 3)), "w", "weight", True))
    g = graph.add_param(GraphParam(TensorType(DType.float32, (4, 3, 3)), "g", "weight", True))
    b = Builder(graph)
    y = b("Conv2D", x, w, out_channel=4, kernel_size=(3, 3))
    y = b("MaxPool", y, kernel_size=(2, 2), strides=(1, 1))
    y = b("AvgPool", y, kernel_size=(2, 2), strides=(1, 1), pad_mode="SAME")
    y = b("LayerNorm", y, g, g)
    y = b("Softmax", y)
    y = b("LogSoftmax", y)
    loss = b("ReduceSum", y, axis=(0, 1, 2, 3))
    append_gradients(graph, loss, [x, w, g])
    ops = {n.op for n in graph.nodes}
    for op in (
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "MaxPoolGrad",
        "AvgPoolGrad",
        "LayerNormGrad",
        "SoftmaxGrad",
        "LogSoftmaxGrad",
    ):
        assert op in ops, op
    (bp,) = graph.find("Conv2DBackpropInput")
    assert bp.attrs["input_size"] == (2, 3, 6, 6) and bp.attrs["out_channel"] == 4


def _raises(
    op: str,
    shapes: list[tuple[int, ...]],
    attrs: dict[str, Any],
    needle: str,
    dtypes: list[DType] | None = None,
) -> None:
    with pytest.raises(OpError) as info:
        _build(op, shapes, attrs, dtypes)
    assert needle in str(info.value), str(info.value)
    assert op in str(info.value)


def test_invalid_inputs() -> None:
    _raises("Softmax", [(2, 3)], {"axis": (2,)}, "out of range")
    _raises("Softmax", [(2, 3)], {"axis": (0, -2)}, "same dimension")
    _raises("Softmax", [(2, 3)], {}, "floating-point", [DType.int32])
    _raises("LogSoftmax", [(2, 3)], {"axis": -3}, "out of range")
    _raises("LayerNorm", [(2, 3, 4), (3, 5), (3, 4)], {}, "gamma shape (3, 5)")
    _raises("LayerNorm", [(2, 3, 4), (4,), (4,)], {}, "x.shape[begin_params_axis:]")
    _raises("LayerNorm", [(2, 3), (3,), (3,)], {"begin_norm_axis": 2}, "begin_norm_axis")
    _raises(
        "Conv2D",
        [(1, 3, 5, 5), (4, 2, 3, 3)],
        {"out_channel": 4, "kernel_size": (3, 3)},
        "weight shape (4, 2, 3, 3)",
    )
    _raises(
        "Conv2D",
        [(1, 3, 5, 5), (4, 3, 3, 3)],
        {"out_channel": 4, "kernel_size": (3, 3), "group": 2},
        "divide by group",
    )
    _raises(
        "Conv2D",
        [(1, 3, 2, 2), (4, 3, 3, 3)],
        {"out_channel": 4, "kernel_size": (3, 3)},
        "exceeds the padded input",
    )
    _raises(
        "Conv2D",
        [(1, 3, 5, 5), (4, 3, 3, 3)],
        {"out_channel": 4, "kernel_size": (3, 3), "pad": (1, 1, 1, 1)},
        "pad must be 0",
    )
    _raises(
        "Conv2D", [(3, 5, 5), (4, 3, 3, 3)], {"out_channel": 4, "kernel_size": (3, 3)}, "rank 4"
    )
    _raises("MaxPool", [(1, 1, 2, 2)], {"kernel_size": (3, 3)}, "exceeds")
    _raises("AvgPool", [(1, 1, 4, 4)], {"pad_mode": "pad"}, "pad_mode")
    _raises("AvgPool", [(1, 1, 4, 4)], {"data_format": "NHWC"}, "NCHW")
    _raises("SoftmaxCrossEntropyWithLogits", [(2, 3), (2, 4)], {}, "labels shape")
    _raises("SparseSoftmaxCrossEntropyWithLogits", [(2, 3), (2,)], {}, "Int32 or Int64")
    _raises(
        "SparseSoftmaxCrossEntropyWithLogits",
        [(2, 3), (3,)],
        {},
        "labels shape",
        [DType.float32, DType.int32],
    )


def test_sparse_labels_out_of_range_rejected_by_numpy() -> None:
    g = Graph("t")
    logits = g.add_param(GraphParam(TensorType(DType.float32, (2, 3)), "l"))
    labels = g.add_param(GraphParam(TensorType(DType.int32, (2,)), "y"))
    g.outputs = [Builder(g)("SparseSoftmaxCrossEntropyWithLogits", logits, labels)]
    with pytest.raises(ValueError, match="labels must lie in"):
        run_graph(g, [np.zeros((2, 3), np.float32), np.array([0, 3], np.int32)])


# -- RmsNorm ------------------------------------------------------------------------------------


def _rms_norm_ref(epsilon: float) -> Any:
    def ref(x: Any, gamma: Any) -> Any:
        # The op computes in (at least) float32; y rounds back to the input's dtype.
        xa = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
        rstd = lax.rsqrt(jnp.mean(xa * xa, axis=axes, keepdims=True) + epsilon)
        return (xa * rstd * gamma.astype(xa.dtype)).astype(x.dtype), rstd

    return ref


@st.composite
def _rms_case(draw: Any) -> tuple[tuple[int, ...], int]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    return shape, draw(st.integers(1, len(shape)))


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@settings(max_examples=15, deadline=None)
@given(_rms_case(), st.sampled_from([1e-6, 1e-5, 0.5]), st.integers(0, 2**31 - 1))
def test_rms_norm(case: tuple[tuple[int, ...], int], epsilon: float, seed: int) -> None:
    """y and rstd; gradients for random cotangents of both (rstd's too, though MindSpore's
    bprop drops it: pcompile differentiates what the program computes)."""
    shape, k = case
    rng = np.random.default_rng(seed)
    x = (2.0 * rng.standard_normal(shape)).astype(np.float32)
    gamma = rng.standard_normal(shape[len(shape) - k:]).astype(np.float32)
    check_op("RmsNorm", [x, gamma], {"epsilon": epsilon}, _rms_norm_ref(epsilon), seed=seed)


@pytest.mark.slow  # the sweep (~7 s); the fixed cases below run in the fast step
@settings(max_examples=10, deadline=None)
@given(_rms_case(), st.sampled_from([np.float16, ml_dtypes.bfloat16]), st.integers(0, 2**31 - 1))
def test_rms_norm_low_precision(case: tuple[tuple[int, ...], int], dtype: Any, seed: int) -> None:
    shape, k = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    gamma = rng.standard_normal(shape[len(shape) - k:]).astype(dtype)
    check_op("RmsNorm", [x, gamma], {}, _rms_norm_ref(1e-6), seed=seed)


@pytest.mark.parametrize(("case", "epsilon"), [(((2, 3, 4), 2), 0.5), (((5,), 1), 1e-6)])
def test_rms_norm_fixed_cases(case: tuple[tuple[int, ...], int], epsilon: float) -> None:
    """A gamma over two axes with a large epsilon, and a rank-1 input."""
    test_rms_norm.hypothesis.inner_test(case, epsilon, 11)


@pytest.mark.parametrize(("case", "dtype"), [(((3, 8), 1), np.float16),
                                           (((2, 2, 5), 2), ml_dtypes.bfloat16)])
def test_rms_norm_low_precision_fixed_cases(case: tuple[tuple[int, ...], int], dtype: Any) -> None:
    test_rms_norm_low_precision.hypothesis.inner_test(case, dtype, 13)


def test_rms_norm_default_epsilon_and_grad_op() -> None:
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    gamma = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    check_op("RmsNorm", [x, gamma], {}, _rms_norm_ref(1e-6))
    graph = Graph("g")
    px = graph.add_param(GraphParam(TensorType(DType.float32, x.shape), "x", "weight", True))
    pg = graph.add_param(GraphParam(TensorType(DType.float32, gamma.shape), "g", "weight", True))
    b = Builder(graph)
    y = b("TupleGetItem", b("RmsNorm", px, pg), index=0)
    loss = b("ReduceSum", y, axis=(), keep_dims=False)
    append_gradients(graph, loss, [px, pg])
    ops = [n.op for n in graph.nodes]
    # rstd's cotangent is zero here: no extra nodes beyond MindSpore's RmsNormGrad.
    assert ops.count("RmsNormGrad") == 1 and "Cast" not in ops
