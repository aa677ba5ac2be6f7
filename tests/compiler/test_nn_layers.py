"""nn layers: each traced with `trace_cell`, run on the numpy interpreter and compared with the
same computation written directly in JAX (float64), forward and gradients (IR autodiff vs
`jax.vjp`); parameter naming; eager execution; constructor and input errors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from jax import lax

from pcompile import Tensor, nn, ops
from pcompile.backends.numpy import run_graph
from pcompile.compiler.driver.trace_model import trace_cell
from pcompile.compiler.frontend.nn.layers import LayerInputError
from pcompile.ir.core import Constant
from pcompile.passes.autodiff import append_gradients
from tests.op_harness import assert_close

SETTINGS = settings(max_examples=20, deadline=None)


def _f64(tree: Any) -> Any:
    """Float arrays as float64 jnp arrays (the references run in double precision)."""

    def convert(a: Any) -> Any:
        return jnp.asarray(a, jnp.float64) if np.asarray(a).dtype.kind == "f" else jnp.asarray(a)

    return jax.tree_util.tree_map(convert, tree)


def check_cell(
    cell: nn.Cell,
    inputs: Sequence[np.ndarray],
    reference: Callable[..., Any],
    *,
    grad: bool = True,
    rtol: float = 1e-5,
    seed: int = 0,
) -> None:
    """Trace `cell` on `inputs`, run it, and compare with `reference(params, *inputs)` (params
    by name, float64 jnp arrays); gradients w.r.t. every float input and trainable parameter
    for a random cotangent are compared with `jax.vjp` of the reference."""
    graph, values = trace_cell(cell, *inputs)
    inputs = [np.asarray(a) for a in inputs]
    feeds = {f"x{i}": a for i, a in enumerate(inputs)}
    feeds.update(values)
    outs = list(graph.outputs)
    got = run_graph(graph, feeds)

    params64 = _f64(values)
    inputs64 = _f64(list(inputs))
    names = [n for n, a in values.items() if a.dtype.kind == "f"] if grad else []
    float_inputs = [i for i, a in enumerate(inputs) if a.dtype.kind == "f"] if grad else []

    def fn(params: dict[str, Any], xs: list[Any]) -> tuple[Any, ...]:
        full_params = dict(params64, **params)
        full_inputs = list(inputs64)
        for i, x in zip(float_inputs, xs):
            full_inputs[i] = x
        res = reference(full_params, *full_inputs)
        return tuple(res) if isinstance(res, (tuple, list)) else (res,)

    rng = np.random.default_rng(seed)
    cots = [rng.standard_normal(v.shape).astype(v.dtype.np) for v in outs]

    # One jit per check: far cheaper than compiling every small op for every new shape.
    @jax.jit
    def forward_and_vjp(params: dict[str, Any], xs: list[Any], cot: tuple[Any, ...]) -> Any:
        out, vjp = jax.vjp(fn, params, xs)
        return out, vjp(cot)

    want, (d_params, d_inputs) = forward_and_vjp(
        {n: params64[n] for n in names},
        [inputs64[i] for i in float_inputs],
        tuple(jnp.asarray(c, jnp.float64) for c in cots),
    )
    assert len(got) == len(want)
    # float32 rounding of intermediates of the inputs' magnitude (the reference is float64).
    magnitude = max([float(np.max(np.abs(a))) for a in inputs if a.dtype.kind == "f" and a.size]
                    + [1.0])
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, rtol, f"output {i}", atol=1e-6 * magnitude)
    wrt = [graph.param(n) for n in names] + [graph.param(f"x{i}") for i in float_inputs]
    if not wrt:
        return
    seeds = [Constant(c, v.dtype) for c, v in zip(cots, outs)]
    grads = append_gradients(graph, outs, wrt, seeds)
    graph.outputs = outs + list(grads)
    got_grads = run_graph(graph, feeds)[len(outs):]
    want_grads = [d_params[n] for n in names] + list(d_inputs)
    labels = names + [f"x{i}" for i in float_inputs]
    cot_scale = max([float(np.max(np.abs(c))) for c in cots if c.size] + [1.0])
    for label, g, w in zip(labels, got_grads, want_grads):
        assert_close(g, w, rtol, f"gradient of {label}", atol=1e-6 * magnitude * cot_scale)


def _randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


_JAX_ACT: dict[str | None, Callable[[Any], Any]] = {
    None: lambda x: x,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "softmax": lambda x: jax.nn.softmax(x, axis=-1),
}


# -- Dense ------------------------------------------------------------------------------------


@SETTINGS
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    in_ch=st.integers(1, 6),
    out_ch=st.integers(1, 6),
    has_bias=st.booleans(),
    activation=st.sampled_from([None, "relu", "gelu", "tanh", "sigmoid", "silu", "softmax"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dense(batch, in_ch, out_ch, has_bias, activation, seed):
    rng = np.random.default_rng(seed)
    cell = nn.Dense(
        in_ch,
        out_ch,
        weight_init=_randn(rng, out_ch, in_ch),
        bias_init=_randn(rng, out_ch),
        has_bias=has_bias,
        activation=activation,
    )
    x = _randn(rng, *batch, in_ch)
    act = _JAX_ACT[activation]

    def ref(p, x):
        y = x.reshape(-1, in_ch) @ p["weight"].T
        if has_bias:
            y = y + p["bias"]
        return act(y).reshape(tuple(batch) + (out_ch,))

    check_cell(cell, [x], ref, seed=seed)


def test_dense_default_init_and_names():
    cell = nn.Dense(5, 3)
    assert cell.weight.shape == (3, 5) and cell.bias.shape == (3,)
    assert np.all(cell.bias.asnumpy() == 0)
    assert 0 < np.std(cell.weight.asnumpy()) < 0.1  # "normal": sigma 0.01
    graph, values = trace_cell(cell, np.zeros((2, 5), np.float32))
    assert list(values) == ["weight", "bias"]
    nodes = {n.op: n for n in graph.nodes}
    assert nodes["MatMul"].instance_name == "matmul"
    assert nodes["MatMul"].attrs["transpose_b"] is True
    assert nodes["BiasAdd"].instance_name == "bias_add"
    assert nn.Dense(5, 3, has_bias=False).bias is None


def test_dense_activation_cell_and_primitive():
    rng = np.random.default_rng(1)
    w = _randn(rng, 4, 3)
    x = _randn(rng, 2, 3)
    for activation in (nn.Tanh(), ops.Tanh()):
        cell = nn.Dense(3, 4, weight_init=w, activation=activation)
        check_cell(cell, [x], lambda p, x: jnp.tanh(x @ p["weight"].T + p["bias"]))


def test_dense_eager_matches_traced():
    rng = np.random.default_rng(2)
    cell = nn.Dense(
        3, 4, weight_init=_randn(rng, 4, 3), bias_init=_randn(rng, 4), activation="relu"
    )
    x = _randn(rng, 2, 5, 3)
    eager = cell(Tensor(x))
    graph, values = trace_cell(cell, x)
    (traced,) = run_graph(graph, {"x0": x, **values})
    assert eager.shape == (2, 5, 4)
    assert_close(eager.asnumpy(), traced, 1e-6)


# -- Embedding ---------------------------------------------------------------------------------


@SETTINGS
@given(
    vocab=st.integers(1, 8),
    size=st.integers(1, 5),
    ids_shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    use_one_hot=st.booleans(),
    int64=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_embedding(vocab, size, ids_shape, use_one_hot, int64, seed):
    rng = np.random.default_rng(seed)
    table = _randn(rng, vocab, size)
    dtype = np.int64 if int64 else np.int32
    cell = nn.Embedding(vocab, size, use_one_hot=use_one_hot, embedding_table=table, dtype=dtype)
    ids = rng.integers(0, vocab, ids_shape).astype(dtype)
    if use_one_hot:
        ref = lambda p, ids: jax.nn.one_hot(ids, vocab, dtype=jnp.float64) @ p["embedding_table"]
    else:
        ref = lambda p, ids: p["embedding_table"][ids]
    check_cell(cell, [ids], ref, seed=seed)
    graph, _ = trace_cell(
        nn.Embedding(vocab, size, use_one_hot=use_one_hot, embedding_table=table), ids
    )
    assert ("MatMul" if use_one_hot else "Gather") in {n.op for n in graph.nodes}


def test_embedding_padding_idx_and_errors():
    cell = nn.Embedding(5, 3, embedding_table="ones", padding_idx=2)
    assert np.all(cell.embedding_table.asnumpy()[2] == 0)
    assert np.all(cell.embedding_table.asnumpy()[[0, 1, 3, 4]] == 1)
    with pytest.raises(ValueError, match="padding_idx"):
        nn.Embedding(5, 3, padding_idx=5)
    with pytest.raises(TypeError, match="dtype"):
        nn.Embedding(5, 3, dtype=np.float32)
    with pytest.raises(LayerInputError, match="ids must be int32 or int64"):
        trace_cell(nn.Embedding(5, 3), np.zeros((2,), np.float32))


# -- LayerNorm ---------------------------------------------------------------------------------


@pytest.mark.slow  # the sweep (~6-9 s); the fixed cases below run in the fast step
@SETTINGS
@given(
    shape=st.lists(st.integers(2, 4), min_size=1, max_size=4),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_norm(shape, data, seed):
    rank = len(shape)
    begin_norm = data.draw(st.integers(-rank, rank - 1), "begin_norm_axis")
    begin_params = data.draw(st.integers(-rank, rank - 1), "begin_params_axis")
    # Over 2 elements the normalised output is +-1 whatever x is: d/dx is 0 up to rounding.
    assume(np.prod(shape[begin_norm % rank:]) > 2)
    _check_layer_norm(shape, begin_norm, begin_params, seed)


def _check_layer_norm(shape: list[int], begin_norm: int, begin_params: int, seed: int) -> None:
    rank = len(shape)
    rng = np.random.default_rng(seed)
    pshape = tuple(shape[begin_params % rank:])
    cell = nn.LayerNorm(
        pshape,
        begin_norm_axis=begin_norm,
        begin_params_axis=begin_params,
        gamma_init=_randn(rng, *pshape),
        beta_init=_randn(rng, *pshape),
        epsilon=1e-5,
    )
    x = _randn(rng, *shape, scale=2.0) + 0.5

    def ref(p, x):
        axes = tuple(range(begin_norm % rank, rank))
        mean = jnp.mean(x, axis=axes, keepdims=True)
        var = jnp.mean((x - mean) ** 2, axis=axes, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * p["gamma"] + p["beta"]

    check_cell(cell, [x], ref, seed=seed, rtol=2e-5)


@pytest.mark.parametrize(("shape", "begin_norm", "begin_params"),
                         [([2, 3, 4], -1, 1), ([3, 2, 2, 4], 1, -2)])
def test_layer_norm_fixed_cases(shape: list[int], begin_norm: int, begin_params: int) -> None:
    _check_layer_norm(shape, begin_norm, begin_params, 5)


def test_layer_norm_defaults_and_errors():
    cell = nn.LayerNorm((4,))
    assert np.all(cell.gamma.asnumpy() == 1) and np.all(cell.beta.asnumpy() == 0)
    assert cell.epsilon == 1e-7
    with pytest.raises(TypeError, match="normalized_shape"):
        nn.LayerNorm(4)
    with pytest.raises(ValueError, match="epsilon"):
        nn.LayerNorm((4,), epsilon=0.0)
    with pytest.raises(LayerInputError, match="normalized_shape"):
        trace_cell(nn.LayerNorm((3,)), np.zeros((2, 4), np.float32))


# -- Conv2d ------------------------------------------------------------------------------------


@pytest.mark.slow  # the sweep (~10 s); the fixed cases below run in the fast step
@SETTINGS
@given(
    n=st.integers(1, 2),
    group=st.sampled_from([1, 2]),
    cin_per_group=st.integers(1, 2),
    cout_per_group=st.integers(1, 2),
    hw=st.tuples(st.integers(3, 6), st.integers(3, 6)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    dilation=st.sampled_from([(1, 1), (1, 2), (2, 1)]),
    pad_mode=st.sampled_from(["same", "valid", "pad"]),
    padding=st.tuples(*[st.integers(0, 2)] * 4),
    has_bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_conv2d(
    n, group, cin_per_group, cout_per_group, hw, kernel, stride, dilation, pad_mode, padding,
    has_bias, seed,
):
    cin, cout = cin_per_group * group, cout_per_group * group
    eff = [dilation[i] * (kernel[i] - 1) + 1 for i in range(2)]
    padding = padding if pad_mode == "pad" else (0, 0, 0, 0)
    pads = ((padding[0], padding[1]), (padding[2], padding[3]))
    if pad_mode != "same" and any(hw[i] + sum(pads[i]) < eff[i] for i in range(2)):
        return  # kernel larger than the (padded) input
    rng = np.random.default_rng(seed)
    cell = nn.Conv2d(
        cin, cout, kernel, stride=stride, pad_mode=pad_mode, padding=padding,
        dilation=dilation, group=group, has_bias=has_bias,
        weight_init=_randn(rng, cout, cin_per_group, *kernel), bias_init=_randn(rng, cout),
    )
    x = _randn(rng, n, cin, *hw)
    lax_padding = {"same": "SAME", "valid": "VALID", "pad": list(pads)}[pad_mode]

    def ref(p, x):
        y = lax.conv_general_dilated(
            x, p["weight"], window_strides=stride, padding=lax_padding, rhs_dilation=dilation,
            dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=group,
            precision=lax.Precision.HIGHEST,
        )
        return y + p["bias"][None, :, None, None] if has_bias else y

    check_cell(cell, [x], ref, seed=seed)


@pytest.mark.parametrize("kwargs", [
    {"n": 2, "group": 2, "cin_per_group": 1, "cout_per_group": 2, "hw": (5, 6),
     "kernel": (2, 3), "stride": (1, 2), "dilation": (2, 1), "pad_mode": "pad",
     "padding": (1, 0, 0, 2), "has_bias": True},
    {"n": 1, "group": 1, "cin_per_group": 2, "cout_per_group": 1, "hw": (4, 3),
     "kernel": (3, 3), "stride": (2, 2), "dilation": (1, 1), "pad_mode": "same",
     "padding": (0, 0, 0, 0), "has_bias": False},
], ids=["group2-pad-bias", "same-stride2"])
def test_conv2d_fixed_cases(kwargs: dict) -> None:
    test_conv2d.hypothesis.inner_test(**kwargs, seed=3)


def test_conv2d_names_and_errors():
    cell = nn.Conv2d(2, 4, 3, has_bias=True)
    assert cell.weight.shape == (4, 2, 3, 3) and cell.bias.shape == (4,)
    graph, _ = trace_cell(cell, np.zeros((1, 2, 5, 5), np.float32))
    assert {n.instance_name for n in graph.nodes} == {"conv2d", "bias_add"}
    assert [n for n in graph.nodes if n.op == "Conv2D"][0].attrs["pad_mode"] == "same"
    with pytest.raises(ValueError, match="divisible by group"):
        nn.Conv2d(3, 4, 3, group=2)
    with pytest.raises(ValueError, match="pad_mode"):
        nn.Conv2d(2, 4, 3, pad_mode="full")
    with pytest.raises(ValueError, match="padding must be 0"):
        nn.Conv2d(2, 4, 3, padding=1)
    with pytest.raises(TypeError, match="kernel_size"):
        nn.Conv2d(2, 4, (3, 3, 3))
    with pytest.raises(ValueError, match="stride"):
        nn.Conv2d(2, 4, 3, stride=0)
    with pytest.raises(LayerInputError, match="in_channels = 2"):
        trace_cell(nn.Conv2d(2, 4, 3), np.zeros((1, 3, 5, 5), np.float32))


# -- activations, Flatten, Dropout -------------------------------------------------------------


@SETTINGS
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    which=st.sampled_from(["relu", "gelu", "tanh", "sigmoid", "silu", "softmax", "logsoftmax"]),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_activations(shape, which, data, seed):
    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1), "axis")
    cells = {
        "relu": (nn.ReLU(), jax.nn.relu),
        "gelu": (nn.GELU(), lambda x: jax.nn.gelu(x, approximate=True)),
        "tanh": (nn.Tanh(), jnp.tanh),
        "sigmoid": (nn.Sigmoid(), jax.nn.sigmoid),
        "silu": (nn.SiLU(), jax.nn.silu),
        "softmax": (nn.Softmax(axis), lambda x: jax.nn.softmax(x, axis=axis)),
        "logsoftmax": (nn.layers.LogSoftmax(axis), lambda x: jax.nn.log_softmax(x, axis=axis)),
    }
    cell, fn = cells[which]
    x = _randn(np.random.default_rng(seed), *shape, scale=2.0)
    check_cell(cell, [x], lambda p, x: fn(x), seed=seed)


def test_softmax_tuple_axis():
    x = _randn(np.random.default_rng(3), 2, 3, 4)
    check_cell(nn.Softmax((1, 2)), [x], lambda p, x: jax.nn.softmax(x, axis=(1, 2)))


@pytest.mark.parametrize(
    "shape,start,end",
    [((2, 3, 4), 1, -1), ((2, 3, 4, 5), 1, 2), ((2, 3, 4), 0, -1), ((5,), 0, 0), ((2, 3), 1, 1)],
)
def test_flatten(shape, start, end):
    x = _randn(np.random.default_rng(4), *shape)
    rank = len(shape)
    s, e = start % rank, end % rank
    new = shape[:s] + (int(np.prod(shape[s:e + 1])),) + shape[e + 1:]
    check_cell(nn.Flatten(start, end), [x], lambda p, x: x.reshape(new))
    graph, _ = trace_cell(nn.Flatten(), np.zeros((2, 3, 4), np.float32))
    assert [n.op for n in graph.nodes] == ["Flatten"]


def test_dropout_identity_and_errors():
    """Outside training (and with nothing to drop) nn.Dropout passes its input through; any
    rate is accepted (tests/compiler/test_dropout.py trains it)."""
    x = _randn(np.random.default_rng(5), 3, 4)
    check_cell(nn.Dropout(), [x], lambda p, x: x)
    check_cell(nn.Dropout(p=0.0), [x], lambda p, x: x)
    check_cell(nn.Dropout(keep_prob=1.0), [x], lambda p, x: x)
    assert nn.Dropout(keep_prob=0.5).keep_prob == 0.5
    with pytest.raises(ValueError, match="keep_prob"):
        nn.Dropout(keep_prob=1.5)
    with pytest.raises(ValueError, match="p must be"):
        nn.Dropout(p=1.0)
    with pytest.raises(TypeError, match="keep_prob"):
        nn.Dropout(keep_prob="0.9")


def test_gelu_exact_not_supported():
    with pytest.raises(ValueError, match="approximate"):
        nn.GELU(approximate=False)


# -- SequentialCell and naming -----------------------------------------------------------------


def test_sequential_cell_forward_and_names():
    rng = np.random.default_rng(6)
    w1, b1, w2 = _randn(rng, 5, 3), _randn(rng, 5), _randn(rng, 2, 5)
    seq = nn.SequentialCell(
        nn.Dense(3, 5, weight_init=w1, bias_init=b1), nn.ReLU(), nn.Dense(5, 2, weight_init=w2)
    )
    assert len(seq) == 3 and isinstance(seq[1], nn.ReLU) and len(seq[0:2]) == 2
    x = _randn(rng, 4, 3)

    def ref(p, x):
        h = jax.nn.relu(x @ p["0.weight"].T + p["0.bias"])
        return h @ p["2.weight"].T + p["2.bias"]

    check_cell(seq, [x], ref)
    graph, _ = trace_cell(seq, x)
    scopes = [n.scope for n in graph.nodes]
    assert scopes[0] == "Default/0-Dense" and "Default/1-ReLU" in scopes


def test_sequential_cell_list_dict_append():
    seq = nn.SequentialCell([nn.ReLU(), nn.Tanh()])
    seq.append(nn.Dense(2, 2))
    assert list(seq.name_cells()) == ["0", "1", "2"]
    named = nn.SequentialCell(OrderedDict([("fc", nn.Dense(2, 3)), ("act", nn.ReLU())]))
    _, values = trace_cell(named, np.zeros((1, 2), np.float32))
    assert list(values) == ["fc.weight", "fc.bias"]
    with pytest.raises(TypeError, match="must be a Cell"):
        nn.SequentialCell([nn.ReLU(), lambda x: x])


class _Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm((4,))
        self.fc = nn.Dense(4, 4)

    def construct(self, x):
        return self.fc(self.ln(x))


class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.blocks = nn.SequentialCell([_Block(), _Block()])
        self.layer1 = nn.Dense(4, 3, has_bias=False)

    def construct(self, ids):
        return self.layer1(self.blocks(self.embedding(ids)))


def test_nested_parameter_names():
    _, values = trace_cell(_Net(), np.zeros((2, 5), np.int32))
    assert list(values) == [
        "embedding.embedding_table",
        "blocks.0.ln.gamma",
        "blocks.0.ln.beta",
        "blocks.0.fc.weight",
        "blocks.0.fc.bias",
        "blocks.1.ln.gamma",
        "blocks.1.ln.beta",
        "blocks.1.fc.weight",
        "blocks.1.fc.bias",
        "layer1.weight",
    ]


def test_nested_network_gradients():
    net = _Net()
    ids = np.random.default_rng(7).integers(0, 10, (2, 5)).astype(np.int32)
    for p in net.get_parameters():  # non-trivial LayerNorm parameters
        p.set_data(np.random.default_rng(8).standard_normal(p.shape).astype(np.float32))

    def block(p, prefix, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
        h = (x - mean) / jnp.sqrt(var + 1e-7) * p[prefix + "ln.gamma"] + p[prefix + "ln.beta"]
        return h @ p[prefix + "fc.weight"].T + p[prefix + "fc.bias"]

    def ref(p, ids):
        x = p["embedding.embedding_table"][ids]
        x = block(p, "blocks.1.", block(p, "blocks.0.", x))
        return x @ p["layer1.weight"].T

    check_cell(net, [ids], ref, rtol=5e-5)


# -- constructor and input errors --------------------------------------------------------------


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: nn.Dense(0, 3), ValueError, "in_channels must be > 0"),
        (lambda: nn.Dense(3.0, 3), TypeError, "in_channels must be an int"),
        (lambda: nn.Dense(3, 3, has_bias=1), TypeError, "has_bias must be a bool"),
        (lambda: nn.Dense(3, 3, activation="swish"), ValueError, "unknown activation"),
        (lambda: nn.Dense(3, 3, activation=3), TypeError, "activation must be"),
        (lambda: nn.Dense(3, 3, weight_init="bogus"), ValueError, "Dense: weight"),
        (lambda: nn.Dense(3, 3, weight_init=np.zeros((3, 2))), ValueError, "shape"),
        (lambda: nn.Embedding(0, 3), ValueError, "vocab_size"),
        (lambda: nn.Softmax(1.5), TypeError, "axis"),
        (lambda: nn.Flatten(start_dim="1"), TypeError, "start_dim"),
    ],
)
def test_constructor_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_dense_input_error_names_scope():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Dense(4, 2)

        def construct(self, x):
            return self.layer1(x)

    with pytest.raises(LayerInputError, match=r"Default/layer1-Dense.*in_channels=4.*\(2, 3\)"):
        trace_cell(Net(), np.zeros((2, 3), np.float32))


class _ListNet(nn.Cell):
    """Blocks held by a CellList, called by index and by iteration, as mindformers does."""

    def __init__(self, count: int):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.layers = nn.CellList()
        for _ in range(count):
            self.layers.append(_Block())
        self.extra = nn.CellList([nn.SiLU()])

    def construct(self, ids):
        x = self.embedding(ids)
        for i in range(len(self.layers) - 1):
            x = self.layers[i](x)
        for act in self.extra:
            x = act(x)
        return self.layers[-1](x)


def test_cell_list_names_scopes_and_values():
    net = _ListNet(3)
    ids = np.random.default_rng(9).integers(0, 10, (2, 5)).astype(np.int32)
    graph, values = trace_cell(net, ids)
    assert list(values)[:4] == ["embedding.embedding_table", "layers.0.ln.gamma",
                                "layers.0.ln.beta", "layers.0.fc.weight"]
    assert "layers.2.fc.bias" in values
    scopes = {n.scope for n in graph.nodes}
    assert "Default/layers-CellList/1-_Block/fc-Dense" in scopes
    assert "Default/extra-CellList/0-SiLU" in scopes

    def block(p, prefix, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
        h = (x - mean) / jnp.sqrt(var + 1e-7) * p[prefix + "ln.gamma"] + p[prefix + "ln.beta"]
        return h @ p[prefix + "fc.weight"].T + p[prefix + "fc.bias"]

    def ref(p, ids):
        x = p["embedding.embedding_table"][ids]
        x = jax.nn.silu(block(p, "layers.1.", block(p, "layers.0.", x)))
        return block(p, "layers.2.", x)

    check_cell(net, [ids], ref, rtol=5e-5)


def test_cell_list_container_operations():
    a, b, c = nn.ReLU(), nn.Tanh(), nn.SiLU()
    cells = nn.CellList([a, b])
    cells.insert(0, c)
    assert list(cells) == [c, a, b] and list(cells.name_cells()) == ["0", "1", "2"]
    assert cells[-1] is b and len(cells[1:]) == 2 and cells[1:][0] is a
    cells[1] = nn.GELU()
    del cells[0]
    assert [type(x).__name__ for x in cells] == ["GELU", "Tanh"]
    cells.extend([nn.ReLU()])
    assert len(cells) == 3 and cells[2]._attr_name == "2"
    with pytest.raises(TypeError, match="must be a Cell"):
        cells.append(lambda x: x)
    with pytest.raises(IndexError, match="out of range"):
        cells[3]
    with pytest.raises(TypeError, match="cannot be called"):
        cells(np.zeros(2, np.float32))
