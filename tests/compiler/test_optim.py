"""Optimizers: `update()` run eagerly on concrete tensors over several steps against hand-written
float64 references of MindSpore's formulas; the full training path (trace, IR autodiff,
`append_optimizer`, numpy interpreter, outputs fed back) against a JAX training loop; state
names; argument validation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pcompile import Parameter, Tensor, nn
from pcompile.backends.numpy import run_graph
from pcompile.compiler.driver.trace_model import trace_cell
from pcompile.compiler.frontend.optimizer_update import append_optimizer
from pcompile.passes.autodiff import append_gradients
from tests.op_harness import assert_close

# -- references (float64 numpy, written from MindSpore's documented formulas) ----------------


def _decays(name: str) -> bool:
    return "beta" not in name and "gamma" not in name


def ref_sgd(cfg: dict[str, Any]):
    lr, mom = cfg.get("learning_rate", 0.1), cfg.get("momentum", 0.0)
    damp, wd = cfg.get("dampening", 0.0), cfg.get("weight_decay", 0.0)
    nesterov, ls = cfg.get("nesterov", False), cfg.get("loss_scale", 1.0)

    def step(name, w, g, state, t):
        g = g / ls + wd * w  # SGD decays every parameter
        if mom > 0:
            accum = g if t == 1 else mom * state.get("accum", 0.0) + (1 - damp) * g
            state["accum"] = accum
            g = g + mom * accum if nesterov else accum
        return w - lr * g

    return step


def ref_momentum(cfg: dict[str, Any]):
    lr, mom = cfg["learning_rate"], cfg["momentum"]
    wd, ls = cfg.get("weight_decay", 0.0), cfg.get("loss_scale", 1.0)
    nesterov = cfg.get("use_nesterov", False)

    def step(name, w, g, state, t):
        g = g / ls + (wd * w if _decays(name) else 0.0)
        v = mom * state.get("moments", 0.0) + g
        state["moments"] = v
        return w - lr * (g + mom * v) if nesterov else w - lr * v

    return step


def ref_adam(cfg: dict[str, Any]):
    lr, b1, b2 = cfg.get("learning_rate", 1e-3), cfg.get("beta1", 0.9), cfg.get("beta2", 0.999)
    eps, wd, ls = cfg.get("eps", 1e-8), cfg.get("weight_decay", 0.0), cfg.get("loss_scale", 1.0)
    nesterov = cfg.get("use_nesterov", False)

    def step(name, w, g, state, t):
        g = g / ls + (wd * w if _decays(name) else 0.0)
        m = b1 * state.get("m", 0.0) + (1 - b1) * g
        v = b2 * state.get("v", 0.0) + (1 - b2) * g * g
        state["m"], state["v"] = m, v
        lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        num = b1 * m + (1 - b1) * g if nesterov else m
        return w - lr_t * num / (np.sqrt(v) + eps)

    return step


def ref_adam_weight_decay(cfg: dict[str, Any]):
    lr, b1, b2 = cfg.get("learning_rate", 1e-3), cfg.get("beta1", 0.9), cfg.get("beta2", 0.999)
    eps, wd = cfg.get("eps", 1e-6), cfg.get("weight_decay", 0.0)

    def step(name, w, g, state, t):
        m = b1 * state.get("m", 0.0) + (1 - b1) * g
        v = b2 * state.get("v", 0.0) + (1 - b2) * g * g
        state["m"], state["v"] = m, v
        update = m / (np.sqrt(v) + eps) + (wd * w if _decays(name) else 0.0)
        return w - lr * update

    return step


def ref_lamb(cfg: dict[str, Any]):
    lr, b1, b2 = cfg["learning_rate"], cfg.get("beta1", 0.9), cfg.get("beta2", 0.999)
    eps, wd = cfg.get("eps", 1e-6), cfg.get("weight_decay", 0.0)

    def step(name, w, g, state, t):
        m = b1 * state.get("m", 0.0) + (1 - b1) * g
        v = b2 * state.get("v", 0.0) + (1 - b2) * g * g
        state["m"], state["v"] = m, v
        r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        r = r + (wd * w if _decays(name) else 0.0)
        w_norm, r_norm = np.linalg.norm(w), np.linalg.norm(r)
        trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
        return w - lr * trust * r

    return step



def ref_adafactor(cfg: dict[str, Any]):
    """MindSpore's AdaFactor graph (float64), written from its documented formulas."""
    lr_cfg, relative = cfg.get("learning_rate"), cfg.get("relative_step", True)
    eps1, eps2 = cfg.get("eps", (1e-30, 1e-3))
    clip, decay = cfg.get("clip_threshold", 1.0), cfg.get("decay_rate", 0.8)
    beta1, wd = cfg.get("beta1", 0.9) or 0.0, cfg.get("weight_decay", 0.0)
    scale, warmup = cfg.get("scale_parameter", True), cfg.get("warmup_init", False)

    def rms(x):
        return np.sqrt(np.mean(x * x))

    def step(name, w, g, state, t):
        beta2t = 1.0 - t ** (-decay)
        lr = min(1e-6 * t if warmup else 1e-2, 1 / np.sqrt(t)) if relative else lr_cfg
        if scale:
            lr = lr * max(eps2, rms(w))
        sq = g * g + eps1
        if w.ndim >= 2:
            row = beta2t * state.get("row", 0.0) + (1 - beta2t) * sq.mean(-1)
            col = beta2t * state.get("col", 0.0) + (1 - beta2t) * sq.mean(-2)
            state["row"], state["col"] = row, col
            r = 1 / np.sqrt(row / row.mean(-1, keepdims=True))
            u = r[..., None] * (1 / np.sqrt(col))[..., None, :] * g
        else:
            v = beta2t * state.get("v", 0.0) + (1 - beta2t) * sq
            state["v"] = v
            u = g / np.sqrt(v)
        u = u / max(rms(u) / clip, 1.0) * lr
        if beta1 > 0:
            state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * u
            u = state["m"]
        if wd:
            w = w - wd * lr * w
        return w - u

    return step


CASES = [
    (nn.SGD, ref_sgd, {}),
    (nn.SGD, ref_sgd, {"learning_rate": 0.05, "momentum": 0.9}),
    (nn.SGD, ref_sgd, {"momentum": 0.8, "dampening": 0.3, "weight_decay": 0.01}),
    (nn.SGD, ref_sgd, {"momentum": 0.9, "nesterov": True, "loss_scale": 8.0}),
    (nn.Momentum, ref_momentum, {"learning_rate": 0.1, "momentum": 0.9}),
    (nn.Momentum, ref_momentum,
     {"learning_rate": 0.05, "momentum": 0.5, "weight_decay": 0.1, "loss_scale": 4.0}),
    (nn.Momentum, ref_momentum, {"learning_rate": 0.1, "momentum": 0.9, "use_nesterov": True}),
    (nn.Adam, ref_adam, {}),
    (nn.Adam, ref_adam, {"learning_rate": 0.01, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6}),
    (nn.Adam, ref_adam, {"learning_rate": 0.01, "use_nesterov": True, "weight_decay": 0.1,
                         "loss_scale": 2.0}),
    (nn.AdamWeightDecay, ref_adam_weight_decay, {}),
    (nn.AdamWeightDecay, ref_adam_weight_decay,
     {"learning_rate": 0.01, "beta1": 0.8, "eps": 1e-4, "weight_decay": 0.1}),
    (nn.Lamb, ref_lamb, {"learning_rate": 0.01}),
    (nn.Lamb, ref_lamb, {"learning_rate": 0.05, "beta1": 0.8, "beta2": 0.9, "eps": 1e-4,
                         "weight_decay": 0.1}),
    (nn.AdaFactor, ref_adafactor, {}),
    (nn.AdaFactor, ref_adafactor, {"beta1": None, "warmup_init": True, "weight_decay": 0.1,
                                   "clip_threshold": 0.5}),
    (nn.AdaFactor, ref_adafactor, {"learning_rate": 0.05, "relative_step": False,
                                   "scale_parameter": False, "decay_rate": 0.5,
                                   "eps": (1e-20, 1e-2)}),
]


def _ids(case: Any) -> str:
    return f"{case[0].__name__}-{'-'.join(f'{k}={v}' for k, v in case[2].items()) or 'default'}"


# -- eager update() ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_eager_update_matches_reference(case):
    opt_cls, ref_factory, cfg = case
    rng = np.random.default_rng(0)
    params = [
        Parameter(rng.standard_normal((3, 4)).astype(np.float32), name="fc.weight"),
        Parameter(rng.standard_normal((4,)).astype(np.float32), name="ln.gamma"),
    ]
    opt = opt_cls(params, **cfg)
    ref_step = ref_factory(cfg)
    ref_w = {p.name: p.asnumpy().astype(np.float64) for p in params}
    ref_state: dict[str, dict[str, Any]] = {p.name: {} for p in params}
    state = {
        p.name: {k: Tensor(opt.init_state(k, p)) for k in opt.state_prefixes} for p in params
    }
    global_state = {k: Tensor(v) for k, v in opt.global_state().items()}
    for t in range(1, 6):
        global_state = opt.update_global(global_state)
        for p in params:
            grad = rng.standard_normal(p.shape).astype(np.float32)
            new_w, new_state = opt.update(p, Tensor(grad), state[p.name], global_state)
            assert set(new_state) == set(opt.state_prefixes)
            assert new_w.dtype == p.dtype and new_w.shape == p.shape
            p.set_data(new_w.asnumpy())
            state[p.name] = new_state
            ref_w[p.name] = ref_step(p.name, ref_w[p.name], grad.astype(np.float64),
                                     ref_state[p.name], t)
            assert_close(p.asnumpy(), ref_w[p.name], 1e-5, f"{p.name} after step {t}")
    if opt_cls is nn.Adam:
        b1, b2 = cfg.get("beta1", 0.9), cfg.get("beta2", 0.999)
        assert_close(global_state["beta1_power"].asnumpy(), b1**5)
        assert_close(global_state["beta2_power"].asnumpy(), b2**5)


def test_state_prefixes():
    p = [Parameter(np.zeros((2,), np.float32), name="w")]
    assert nn.SGD(p).state_prefixes == ()
    assert nn.SGD(p, momentum=0.9).state_prefixes == ("accum",)
    assert nn.SGD(p, momentum=0.9, dampening=0.1).state_prefixes == ("accum", "stat")
    assert nn.Momentum(p, 0.1, 0.9).state_prefixes == ("moments",)
    assert nn.Adam(p).state_prefixes == ("moment1", "moment2")
    assert set(nn.Adam(p).global_state()) == {"beta1_power", "beta2_power"}
    assert nn.AdamWeightDecay(p).state_prefixes == ("moment1", "moment2")
    assert nn.AdamWeightDecay(p).global_state() == {}



def test_adafactor_state_shapes_and_arguments():
    w = Parameter(np.zeros((3, 4, 5), np.float32), name="w")
    b = Parameter(np.zeros((5,), np.float32), name="b")
    opt = nn.AdaFactor([w, b])
    assert opt.state_prefixes == ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq")
    assert nn.AdaFactor([w], beta1=None).state_prefixes[0] == "exp_avg_sq_row"
    shapes = {k: tuple(opt.init_state(k, w).shape) for k in opt.state_prefixes}
    assert shapes == {"exp_avg": (3, 4, 5), "exp_avg_sq_row": (3, 4),
                      "exp_avg_sq_col": (3, 5), "exp_avg_sq": (1,)}
    assert opt.state_dims("exp_avg_sq_row", w) == (0, 1)
    assert opt.state_dims("exp_avg_sq_col", w) == (0, 2)
    assert tuple(opt.init_state("exp_avg_sq", b).shape) == (5,)
    assert tuple(opt.init_state("exp_avg_sq_row", b).shape) == (1,)
    assert set(opt.global_state()) == {"afactor_step"}


def test_adafactor_compression_stores_vector_statistics_in_float16():
    """MindSpore's `compression=True`: the second-moment statistic of a parameter of rank < 2
    is stored in float16 (rounded once per step, read back rounded); the factored row and
    column statistics, the first moment and a matrix's (1,) placeholder keep the parameter's
    dtype, so a matrix updates exactly as without compression."""
    rng = np.random.default_rng(5)
    w = Parameter(rng.standard_normal((3, 4)).astype(np.float32), name="w")
    b = Parameter(rng.standard_normal((4,)).astype(np.float32), name="b")
    plain, packed = nn.AdaFactor([w, b]), nn.AdaFactor([w, b], compression=True)
    dtypes = {(k, p.name): np.asarray(packed.init_state(k, p)).dtype
              for k in packed.state_prefixes for p in (w, b)}
    assert dtypes.pop(("exp_avg_sq", "b")) == np.float16
    assert set(dtypes.values()) == {np.dtype(np.float32)}
    grads = {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in (w, b)}
    out = {}
    for opt in (plain, packed):
        glob = opt.update_global({k: Tensor(v) for k, v in opt.global_state().items()})
        for p in (w, b):
            state = {k: Tensor(opt.init_state(k, p)) for k in opt.state_prefixes}
            out[opt.compression, p.name] = opt.update(p, Tensor(grads[p.name]), state, glob)
    (w16, state16), (w32, state32) = out[True, "w"], out[False, "w"]
    for k in plain.state_prefixes:  # the matrix: bit for bit the same
        np.testing.assert_array_equal(state16[k].asnumpy(), state32[k].asnumpy())
    np.testing.assert_array_equal(w16.asnumpy(), w32.asnumpy())
    # the vector's statistic: the float32 one rounded to float16
    v16 = out[True, "b"][1]["exp_avg_sq"].asnumpy()
    v32 = out[False, "b"][1]["exp_avg_sq"].asnumpy()
    assert v16.dtype == np.float16 and v32.dtype == np.float32
    np.testing.assert_array_equal(v16, v32.astype(np.float16))
    assert not np.array_equal(v16.astype(np.float32), v32)  # the rounding is not a no-op here
    with pytest.raises(TypeError, match="compression must be a bool"):
        nn.AdaFactor([w], compression=1)


def test_adafactor_compressed_update_reads_the_rounded_statistic():
    """Each step's update divides by the float16 statistic it stored, not by the float32 value
    before rounding: three steps of a vector parameter against float64 references built from
    the stored statistic and from the unrounded one. The optimizer computes in float32: u =
    g / sqrt(v) / max(1, RMS(u)) * lr, the RMS summing n = 64 squares, so u is within
    2 * eps32 * (n + 4) relative of the first reference; the rounded statistic differs from
    the unrounded one by up to 2**-11 relative, so the second reference is missed."""
    n, lr = 64, 0.5
    rng = np.random.default_rng(2)
    b = Parameter((rng.standard_normal((n,)) * 1e-3).astype(np.float32), name="b")
    opt = nn.AdaFactor([b], learning_rate=lr, relative_step=False, scale_parameter=False,
                       beta1=None, compression=True)
    state = {k: Tensor(opt.init_state(k, b)) for k in opt.state_prefixes}
    glob = {k: Tensor(v) for k, v in opt.global_state().items()}
    eps32 = float(np.finfo(np.float32).eps)
    rtol = 2 * eps32 * (n + 4)
    missed = 0
    for t in range(1, 4):
        glob = opt.update_global(glob)
        grad = rng.standard_normal((n,)).astype(np.float32)
        v_prev = state["exp_avg_sq"].asnumpy().astype(np.float64)
        w_prev = b.asnumpy().astype(np.float64)
        new_w, state = opt.update(b, Tensor(grad), state, glob)
        b.set_data(new_w.asnumpy())
        stored = state["exp_avg_sq"].asnumpy()
        assert stored.dtype == np.float16
        g = grad.astype(np.float64)
        beta2t = 1.0 - t ** -0.8
        v = beta2t * v_prev + (1 - beta2t) * (g * g + 1e-30)
        # rounded once to float16 (the float32 value may round one unit apart)
        ulp = np.spacing(np.abs(v).astype(np.float16)).astype(np.float64)
        assert np.all(np.abs(stored.astype(np.float64) - v) <= ulp), t

        def update(stat: np.ndarray, g: np.ndarray = g) -> np.ndarray:
            u = g / np.sqrt(stat)
            return u / max(1.0, float(np.sqrt(np.mean(u * u)))) * lr

        got = w_prev - b.asnumpy().astype(np.float64)
        slack = eps32 * np.abs(b.asnumpy()).astype(np.float64) + eps32 * np.abs(w_prev)
        want = update(stored.astype(np.float64))
        assert np.all(np.abs(got - want) <= rtol * np.abs(want) + slack), t
        unrounded = update(v)
        missed += int(np.any(np.abs(got - unrounded) > rtol * np.abs(unrounded) + slack))
    assert missed == 3  # the test tells the stored statistic from the unrounded one


@pytest.mark.parametrize("kwargs, match", [
    ({"learning_rate": 0.1}, "relative_step"),
    ({"relative_step": False}, "needs a learning_rate"),
    ({"learning_rate": 0.1, "relative_step": False, "warmup_init": True}, "warmup_init"),
    ({"eps": (1e-30,)}, "eps must be a pair"),
    ({"decay_rate": 1.0}, "decay_rate"),
    ({"weight_decay": 1.0}, "weight_decay"),
])
def test_adafactor_argument_errors(kwargs, match):
    w = Parameter(np.zeros((2, 2), np.float32), name="w")
    with pytest.raises(ValueError, match=match):
        nn.AdaFactor([w], **kwargs)


# -- the traced training step ------------------------------------------------------------------


class _Net(nn.Cell):
    def __init__(self, rng: np.random.Generator):
        super().__init__()
        self.layer1 = nn.Dense(4, 8, weight_init=rng.standard_normal((8, 4)) * 0.5,
                               activation="tanh")
        self.ln = nn.LayerNorm((8,))
        self.layer2 = nn.Dense(8, 3, weight_init=rng.standard_normal((3, 8)) * 0.5)

    def construct(self, x):
        return self.layer2(self.ln(self.layer1(x)))


def _jax_forward(p: dict[str, Any], x: Any) -> Any:
    h = jnp.tanh(x @ p["layer1.weight"].T + p["layer1.bias"])
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, -1, keepdims=True)
    h = (h - mean) / jnp.sqrt(var + 1e-7) * p["ln.gamma"] + p["ln.beta"]
    return h @ p["layer2.weight"].T + p["layer2.bias"]


def _jax_loss(kind: str):
    def mse(p, x, y):
        return jnp.mean((_jax_forward(p, x) - y) ** 2)

    def ce(p, x, y):
        logp = jax.nn.log_softmax(_jax_forward(p, x), -1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))

    return mse if kind == "mse" else ce


def _batches(kind: str, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(42)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    if kind == "mse":
        y = np.tanh(x[:, :3] * 2.0).astype(np.float32)
    else:
        y = (np.argmax(x[:, :3], -1)).astype(np.int32)
    return [(x, y)] * steps


TRAIN_CASES = [
    ("mse", nn.SGD, ref_sgd, {"learning_rate": 0.1}),
    ("ce", nn.SGD, ref_sgd, {"learning_rate": 0.1, "momentum": 0.9, "dampening": 0.1,
                             "weight_decay": 0.01}),
    ("mse", nn.Momentum, ref_momentum, {"learning_rate": 0.05, "momentum": 0.9,
                                        "weight_decay": 0.01}),
    ("ce", nn.Adam, ref_adam, {"learning_rate": 0.01, "weight_decay": 0.01}),
    ("mse", nn.AdamWeightDecay, ref_adam_weight_decay, {"learning_rate": 0.01,
                                                        "weight_decay": 0.1}),
]


@pytest.mark.parametrize(
    "kind,opt_cls,ref_factory,cfg",
    TRAIN_CASES,
    ids=[f"{c[0]}-{c[1].__name__}" for c in TRAIN_CASES],
)
def test_traced_training_matches_jax(kind, opt_cls, ref_factory, cfg):
    steps = 5
    rng = np.random.default_rng(7)
    net = _Net(rng)
    loss_fn = nn.MSELoss() if kind == "mse" else nn.CrossEntropyLoss()
    train_net = nn.WithLossCell(net, loss_fn)
    batches = _batches(kind, steps)
    graph, values = trace_cell(train_net, *batches[0])
    loss = graph.outputs[0]
    wrt = [p for p in graph.weights if p.requires_grad]
    grads = append_gradients(graph, loss, wrt)
    params = {p.name: p for p in train_net.get_parameters()}
    opt = opt_cls(train_net.trainable_params(), **cfg)
    init = append_optimizer(
        graph, opt, params, {p.name: g for p, g in zip(wrt, grads)}, loss
    )
    names = graph.attrs["outputs"]
    assert names[0] == "loss"
    assert names[1 : 1 + len(params)] == tuple(params)
    expected_state = [f"{k}.{n}" for n in params for k in opt.state_prefixes]
    expected_state += list(opt.global_state())
    assert list(names[1 + len(params):]) == expected_state
    assert set(init) == set(expected_state)

    # The compiled step, outputs fed back as the next step's inputs.
    current = dict(values)
    current.update(init)
    losses = []
    for x, y in batches:
        outs = run_graph(graph, {"x0": x, "x1": y, **current})
        result = dict(zip(names, outs))
        losses.append(float(result.pop("loss")))
        current.update(result)

    # The same training loop in JAX (float64), with the reference optimizer formula.
    ref_step = ref_factory(cfg)
    ref_params = {n: np.asarray(v, np.float64) for n, v in values.items()}
    ref_state: dict[str, dict[str, Any]] = {n: {} for n in ref_params}
    value_and_grad = jax.jit(jax.value_and_grad(_jax_loss(kind)))
    ref_losses = []
    for t, (x, y) in enumerate(batches, start=1):
        value, g = value_and_grad(ref_params, jnp.asarray(x, jnp.float64), jnp.asarray(y))
        ref_losses.append(float(value))
        ref_params = {
            n: ref_step(n, w, np.asarray(g[n]), ref_state[n], t) for n, w in ref_params.items()
        }
    assert_close(losses, ref_losses, 1e-5, "losses")
    for n in ref_params:
        assert_close(current[n], ref_params[n], 1e-5, f"{n} after {steps} steps")
    assert losses[-1] < losses[0]


# -- argument validation -----------------------------------------------------------------------


def _p() -> list[Parameter]:
    return [Parameter(np.zeros((2,), np.float32), name="w")]


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: nn.SGD(_p(), momentum=-0.1), ValueError, "momentum"),
        (lambda: nn.SGD(_p(), dampening=-1.0), ValueError, "dampening"),
        (lambda: nn.SGD(_p(), nesterov=True), ValueError, "nesterov"),
        (lambda: nn.SGD(_p(), momentum=0.9, dampening=0.1, nesterov=True), ValueError,
         "nesterov"),
        (lambda: nn.SGD(_p(), nesterov=1), TypeError, "nesterov must be a bool"),
        (lambda: nn.SGD(_p(), learning_rate=-0.1), ValueError, "learning_rate"),
        (lambda: nn.SGD(_p(), learning_rate="0.1"), TypeError, "learning_rate"),
        (lambda: nn.SGD(_p(), loss_scale=0.0), ValueError, "loss_scale"),
        (lambda: nn.SGD(_p(), weight_decay=-1e-4), ValueError, "weight_decay"),
        (lambda: nn.SGD([]), ValueError, "empty"),
        (lambda: nn.SGD([np.zeros(2)]), TypeError, "Parameters"),
        (lambda: nn.Momentum(_p(), 0.1, -0.9), ValueError, "momentum"),
        (lambda: nn.Momentum(_p(), 0.1, "0.9"), TypeError, "momentum must be a number"),
        (lambda: nn.Momentum(_p(), 0.1, 0.9, use_nesterov="no"), TypeError, "use_nesterov"),
        (lambda: nn.Adam(_p(), beta1=1.0), ValueError, "beta1"),
        (lambda: nn.Adam(_p(), beta2=0.0), ValueError, "beta2"),
        (lambda: nn.Adam(_p(), eps=0.0), ValueError, "eps"),
        (lambda: nn.Adam(_p(), beta1=True), TypeError, "beta1"),
        (lambda: nn.Adam(_p(), use_amsgrad=True), ValueError, "amsgrad"),
        (lambda: nn.AdamWeightDecay(_p(), eps=-1e-6), ValueError, "eps"),
        (lambda: nn.AdamWeightDecay(_p(), beta2=1.5), ValueError, "beta2"),
        (lambda: nn.AdamWeightDecay(_p(), weight_decay=-0.1), ValueError, "weight_decay"),
    ],
)
def test_argument_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_optimizer_is_not_callable_in_construct():
    with pytest.raises(TypeError, match="after the backward pass"):
        nn.SGD(_p())(Tensor(np.zeros(2, np.float32)))
