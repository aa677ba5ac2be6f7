"""nn losses: traced, run on the numpy interpreter and compared with the loss written directly in
JAX (forward and gradients w.r.t. the logits); WithLossCell; argument and input errors."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pcompile import Tensor, nn
from pcompile.compiler.driver.trace_model import trace_cell
from pcompile.compiler.frontend.nn.layers import LayerInputError
from tests.compiler.test_nn_layers import check_cell
from tests.op_harness import assert_close

SETTINGS = settings(max_examples=20, deadline=None)
REDUCTIONS = st.sampled_from(["mean", "sum", "none"])


def _reduce(x, reduction):
    if reduction == "mean":
        return jnp.mean(x)
    if reduction == "sum":
        return jnp.sum(x)
    return x


def _randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# -- MSELoss / L1Loss --------------------------------------------------------------------------


@SETTINGS
@given(
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    reduction=REDUCTIONS,
    l1=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_mse_and_l1(shape, reduction, l1, seed):
    rng = np.random.default_rng(seed)
    logits, labels = _randn(rng, *shape), _randn(rng, *shape)
    cell = nn.L1Loss(reduction) if l1 else nn.MSELoss(reduction)
    elem = jnp.abs if l1 else jnp.square
    check_cell(cell, [logits, labels], lambda p, x, y: _reduce(elem(x - y), reduction), seed=seed)


def test_mse_broadcast_and_names():
    rng = np.random.default_rng(0)
    logits, labels = _randn(rng, 4, 3), _randn(rng, 3)
    check_cell(nn.MSELoss(), [logits, labels], lambda p, x, y: jnp.mean((x - y) ** 2))
    graph, _ = trace_cell(nn.MSELoss(), logits, labels)
    assert [n.instance_name for n in graph.nodes] == ["sub", "square", "reduce_mean"]


def test_l1_gradient_at_zero_difference():
    """d|d|/dd is sign(d), 0 at d == 0, as MindSpore's AbsGrad and PyTorch (jnp.abs gives 1)."""
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    y = x.copy()
    y[0, 0] = 0.0

    def ref(p, x, y):
        d = x - y
        return jnp.sum(jnp.where(d == 0, 0.0, jnp.abs(d)))

    check_cell(nn.L1Loss("sum"), [x, y], ref)


# -- SoftmaxCrossEntropyWithLogits -------------------------------------------------------------


@pytest.mark.slow  # the sweep (~6-9 s); the fixed cases below run in the fast step
@SETTINGS
@given(
    n=st.integers(1, 5),
    classes=st.integers(1, 6),
    sparse=st.booleans(),
    reduction=REDUCTIONS,
    seed=st.integers(0, 2**31 - 1),
)
def test_softmax_cross_entropy_with_logits(n, classes, sparse, reduction, seed):
    rng = np.random.default_rng(seed)
    logits = 3 * _randn(rng, n, classes)
    if sparse:
        labels = rng.integers(0, classes, n).astype(np.int32)
        target = lambda y: jax.nn.one_hot(y, classes, dtype=jnp.float64)
    else:
        labels = rng.dirichlet(np.ones(classes), n).astype(np.float32)
        target = lambda y: y

    def ref(p, x, y):
        return _reduce(-jnp.sum(target(y) * jax.nn.log_softmax(x, -1), -1), reduction)

    cell = nn.SoftmaxCrossEntropyWithLogits(sparse=sparse, reduction=reduction)
    check_cell(cell, [logits, labels], ref, seed=seed)
    graph, _ = trace_cell(
        nn.SoftmaxCrossEntropyWithLogits(sparse=sparse, reduction=reduction), logits, labels
    )
    fused = sparse and reduction == "mean"
    ops_used = {node.op for node in graph.nodes}
    assert ("SparseSoftmaxCrossEntropyWithLogits" in ops_used) == fused
    assert ("SoftmaxCrossEntropyWithLogits" in ops_used) == (not fused)


@pytest.mark.parametrize(("n", "classes", "sparse", "reduction"),
                         [(3, 4, True, "mean"), (2, 3, False, "none"), (4, 2, True, "sum")])
def test_softmax_cross_entropy_with_logits_fixed_cases(n, classes, sparse, reduction):
    """The fused sparse mean, dense labels unreduced, sparse labels summed."""
    test_softmax_cross_entropy_with_logits.hypothesis.inner_test(n, classes, sparse, reduction, 4)


def test_softmax_cross_entropy_defaults_and_errors():
    cell = nn.SoftmaxCrossEntropyWithLogits()
    assert cell.sparse is False and cell.reduction == "none"
    with pytest.raises(LayerInputError, match="sparse=True"):
        trace_cell(cell, np.zeros((2, 3), np.float32), np.zeros((2,), np.int32))
    with pytest.raises(LayerInputError, match=r"shape \(2,\)"):
        trace_cell(
            nn.SoftmaxCrossEntropyWithLogits(sparse=True),
            np.zeros((2, 3), np.float32),
            np.zeros((2, 3), np.float32),
        )
    with pytest.raises(TypeError, match="sparse"):
        nn.SoftmaxCrossEntropyWithLogits(sparse="yes")


# -- CrossEntropyLoss --------------------------------------------------------------------------


def _ce_index_reference(weight, ignore_index, reduction, smoothing, classes):
    """PyTorch's / MindSpore's documented formula for class-id targets."""

    def ref(p, x, y):
        logp = jax.nn.log_softmax(x, -1)
        valid = (y != ignore_index) & (y >= 0) & (y < classes)
        safe = jnp.where(valid, y, 0)
        w = jnp.ones(classes) if weight is None else jnp.asarray(weight, jnp.float64)
        picked = jnp.take_along_axis(logp, safe[:, None], 1)[:, 0]
        nll = -w[safe] * picked * valid
        smooth = -jnp.sum(logp * w, -1) * valid
        losses = (1 - smoothing) * nll + smoothing / classes * smooth
        if reduction == "mean":
            return jnp.sum(losses) / jnp.sum(w[safe] * valid)
        return _reduce(losses, reduction)

    return ref


@pytest.mark.slow  # the sweep (~8 s); the fixed cases below run in the fast step
@SETTINGS
@given(
    n=st.integers(1, 6),
    classes=st.integers(2, 5),
    reduction=REDUCTIONS,
    weighted=st.booleans(),
    smoothing=st.sampled_from([0.0, 0.1, 0.35]),
    ignore_index=st.sampled_from([-100, 0, 1]),
    int64=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_cross_entropy_class_ids(
    n, classes, reduction, weighted, smoothing, ignore_index, int64, seed
):
    rng = np.random.default_rng(seed)
    logits = 3 * _randn(rng, n, classes)
    labels = rng.integers(0, classes, n).astype(np.int64 if int64 else np.int32)
    if ignore_index == -100 and n > 1:
        labels[rng.integers(0, n)] = -100  # an ignored sample
    if ignore_index in labels and np.all(labels == ignore_index):
        labels[0] = (ignore_index + 1) % classes  # keep one counted sample for 'mean'
    weight = rng.uniform(0.5, 2.0, classes).astype(np.float32) if weighted else None
    cell = nn.CrossEntropyLoss(
        weight=None if weight is None else Tensor(weight),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=smoothing,
    )
    ref = _ce_index_reference(weight, ignore_index, reduction, smoothing, classes)
    check_cell(cell, [logits, labels], ref, seed=seed)


@pytest.mark.parametrize("kwargs", [
    {"n": 5, "classes": 4, "reduction": "mean", "weighted": True, "smoothing": 0.1,
     "ignore_index": -100, "int64": True},
    {"n": 3, "classes": 3, "reduction": "none", "weighted": False, "smoothing": 0.35,
     "ignore_index": 1, "int64": False},
], ids=["mean-weighted-ignored", "none-smoothed"])
def test_cross_entropy_class_ids_fixed_cases(kwargs: dict) -> None:
    test_cross_entropy_class_ids.hypothesis.inner_test(**kwargs, seed=9)


@pytest.mark.slow  # the sweep (~6-9 s); the fixed cases below run in the fast step
@SETTINGS
@given(
    n=st.integers(1, 5),
    classes=st.integers(1, 5),
    reduction=REDUCTIONS,
    weighted=st.booleans(),
    smoothing=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_cross_entropy_probabilities(n, classes, reduction, weighted, smoothing, seed):
    rng = np.random.default_rng(seed)
    logits = 3 * _randn(rng, n, classes)
    labels = rng.dirichlet(np.ones(classes), n).astype(np.float32)
    weight = rng.uniform(0.5, 2.0, classes) if weighted else None

    def ref(p, x, y):
        target = y * (1 - smoothing) + smoothing / classes
        w = 1.0 if weight is None else jnp.asarray(weight)
        return _reduce(-jnp.sum(w * target * jax.nn.log_softmax(x, -1), -1), reduction)

    cell = nn.CrossEntropyLoss(weight=weight, reduction=reduction, label_smoothing=smoothing)
    check_cell(cell, [logits, labels], ref, seed=seed)


@pytest.mark.parametrize(("n", "classes", "reduction", "weighted", "smoothing"),
                         [(4, 3, "sum", True, 0.2), (2, 5, "mean", False, 0.0)])
def test_cross_entropy_probabilities_fixed_cases(n, classes, reduction, weighted, smoothing):
    test_cross_entropy_probabilities.hypothesis.inner_test(n, classes, reduction, weighted,
                                                           smoothing, 6)


def test_cross_entropy_default_matches_plain_mean():
    rng = np.random.default_rng(1)
    logits, labels = _randn(rng, 8, 10), rng.integers(0, 10, 8).astype(np.int32)

    def ref(p, x, y):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x, -1), y[:, None], 1))

    check_cell(nn.CrossEntropyLoss(), [logits, labels], ref)


def test_cross_entropy_eager():
    rng = np.random.default_rng(2)
    logits, labels = _randn(rng, 4, 3), np.array([0, 2, -100, 1], np.int32)
    got = nn.CrossEntropyLoss()(Tensor(logits), Tensor(labels))
    want = _ce_index_reference(None, -100, "mean", 0.0, 3)({}, jnp.asarray(logits), labels)
    assert_close(got.asnumpy(), want)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"reduction": "avg"}, ValueError, "reduction"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ({"label_smoothing": "0.1"}, TypeError, "label_smoothing"),
        ({"weight": np.ones((2, 2))}, ValueError, "1-D"),
        ({"weight": np.array([1.0, -1.0])}, ValueError, ">= 0"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    ],
)
def test_cross_entropy_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nn.CrossEntropyLoss(**kwargs)


def test_cross_entropy_input_errors():
    logits = np.zeros((2, 3), np.float32)
    with pytest.raises(LayerInputError, match="class-id labels"):
        trace_cell(nn.CrossEntropyLoss(), logits, np.zeros((2, 1), np.int32))
    with pytest.raises(LayerInputError, match="probabilities"):
        trace_cell(nn.CrossEntropyLoss(), logits, np.zeros((2, 4), np.float32))
    with pytest.raises(LayerInputError, match=r"logits must be \(N, C\)"):
        trace_cell(nn.CrossEntropyLoss(), np.zeros((2, 3, 4), np.float32), np.zeros(2, np.int32))
    with pytest.raises(LayerInputError, match="weight has 2 entries"):
        trace_cell(nn.CrossEntropyLoss(weight=[1.0, 2.0]), logits, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="reduction"):
        nn.MSELoss("mean_all")


# -- WithLossCell ------------------------------------------------------------------------------


class _Net(nn.Cell):
    def __init__(self, w1, w2):
        super().__init__()
        self.layer1 = nn.Dense(3, 5, weight_init=w1, activation="tanh")
        self.layer2 = nn.Dense(5, 4, weight_init=w2)

    def construct(self, x):
        return self.layer2(self.layer1(x))


def test_with_loss_cell():
    rng = np.random.default_rng(3)
    w1, w2 = _randn(rng, 5, 3), _randn(rng, 4, 5)
    net = nn.WithLossCell(_Net(w1, w2), nn.CrossEntropyLoss())
    x, y = _randn(rng, 6, 3), rng.integers(0, 4, 6).astype(np.int32)

    def ref(p, x, y):
        h = jnp.tanh(x @ p["layer1.weight"].T + p["layer1.bias"])
        logits = h @ p["layer2.weight"].T + p["layer2.bias"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), y[:, None], 1))

    check_cell(net, [x, y], ref)
    graph, values = trace_cell(net, x, y)
    # auto_prefix=False, as MindSpore: the network's parameters keep their own names.
    assert list(values) == ["layer1.weight", "layer1.bias", "layer2.weight", "layer2.bias"]
    scopes = {n.scope for n in graph.nodes}
    assert "Default/_backbone-_Net/layer1-Dense" in scopes
    assert "Default/_loss_fn-CrossEntropyLoss" in scopes
    assert net.backbone_network is net._backbone
    with pytest.raises(TypeError, match="backbone must be a Cell"):
        nn.WithLossCell(lambda x: x, nn.MSELoss())
