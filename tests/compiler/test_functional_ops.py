"""MindSpore's functional ops (`pcompile.ops.matmul`, ...) and `pcompile.mint`: every name
runs (eagerly, on the numpy reference implementation) and gives what numpy computes with
MindSpore's / PyTorch's semantics; `CASES` must cover every exported name (a new name needs a
case). A model written with them compiles for 8 devices and trains as on one device."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pcompile.mint as mint
from pcompile import Parameter, Tensor, ops
from pcompile.compiler.frontend import functional
from pcompile.ir.errors import PcompileError
from pcompile.mint.nn import functional as mf

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4)).astype(np.float32)
Y = RNG.standard_normal((2, 3, 4)).astype(np.float32)
M = RNG.standard_normal((3, 4)).astype(np.float32)
N = RNG.standard_normal((4, 5)).astype(np.float32)
V = RNG.standard_normal((4,)).astype(np.float32)
POS = np.abs(X) + 0.5
IMG = RNG.standard_normal((2, 3, 6, 6)).astype(np.float32)
KER = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
IDX = np.array([[2, 0], [1, 1]], np.int32)
BIDX = np.array([[0, 2, 2], [1, 0, 1]], np.int32)
LABELS = np.array([0, 3, 1], np.int32)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x.astype(np.float64))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(x: np.ndarray, axes: tuple[int, ...], eps: float = 1e-5) -> np.ndarray:
    mean = x.mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(x.var(axis=axes, keepdims=True) + eps)


def _conv(x: np.ndarray, w: np.ndarray, pad: int = 0) -> np.ndarray:
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    k = w.shape[-1]
    h = x.shape[2] - k + 1
    out = np.zeros((x.shape[0], w.shape[0], h, h))
    for i in range(h):
        for j in range(h):
            out[:, :, i, j] = np.einsum("nchw,ochw->no", x[:, :, i:i + k, j:j + k], w)
    return out


def _pool(x: np.ndarray, reduce: Callable[..., Any]) -> np.ndarray:
    n, c, h, w = x.shape
    return reduce(x.reshape(n, c, h // 2, 2, w // 2, 2), axis=(3, 5))


def _batch_gather(p: np.ndarray, i: np.ndarray) -> np.ndarray:
    return np.stack([np.take(p[b], i[b], axis=1) for b in range(p.shape[0])])


# name -> (call with Tensors, numpy reference, arrays). Names of `ops.*` and `mint.*` share
# the table by prefix: "ops.x", "mint.x", "F.x" (mint.nn.functional).
CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], tuple[np.ndarray, ...]]] = {}


def case(name: str, call: Callable[..., Any], ref: Callable[..., Any],
         *arrays: np.ndarray) -> None:
    CASES[name] = (call, ref, arrays)


UNARY = {"abs": np.abs, "absolute": np.abs, "neg": np.negative, "negative": np.negative,
         "square": np.square, "exp": np.exp, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0),
         "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "silu": lambda x: x / (1 + np.exp(-x)),
         "erf": _erf}
for _name, _ref in UNARY.items():
    case(f"ops.{_name}", getattr(ops, _name), _ref, X)
for _name in ("abs", "neg", "negative", "square", "exp", "tanh", "sigmoid", "erf"):
    case(f"mint.{_name}", getattr(mint, _name), UNARY[_name], X)
for _name in ("relu", "silu", "sigmoid", "tanh"):
    case(f"F.{_name}", getattr(mf, _name), UNARY[_name], X)
for _mod, _prefix in ((ops, "ops"), (mint, "mint")):
    case(f"{_prefix}.log", _mod.log, np.log, POS)
    case(f"{_prefix}.sqrt", _mod.sqrt, np.sqrt, POS)
    case(f"{_prefix}.rsqrt", _mod.rsqrt, lambda x: 1 / np.sqrt(x), POS)
    case(f"{_prefix}.pow", _mod.pow, np.power, POS, Y)
    case(f"{_prefix}.mul", _mod.mul, np.multiply, X, Y)
    case(f"{_prefix}.maximum", _mod.maximum, np.maximum, X, Y)
    case(f"{_prefix}.minimum", _mod.minimum, np.minimum, X, Y)
    case(f"{_prefix}.matmul", _mod.matmul, np.matmul, X, N)
    case(f"{_prefix}.bmm", _mod.bmm, np.matmul, X, RNG.standard_normal((2, 4, 2)).astype(
        np.float32))
    case(f"{_prefix}.where", _mod.where, np.where, X > 0, X, Y)
    case(f"{_prefix}.reshape", lambda x, m=_mod: m.reshape(x, (4, -1)), lambda x: x.reshape(4, -1),
         X)
    case(f"{_prefix}.tile", lambda x, m=_mod: m.tile(x, (1, 2, 1)), lambda x: np.tile(x, (1, 2, 1)),
         X)
    case(f"{_prefix}.zeros_like", _mod.zeros_like, np.zeros_like, X)
    case(f"{_prefix}.ones_like", _mod.ones_like, np.ones_like, X)
    case(f"{_prefix}.narrow", lambda x, m=_mod: m.narrow(x, 2, 1, 2), lambda x: x[:, :, 1:3], X)
    for _name, _ref in (("ne", np.not_equal), ("not_equal", np.not_equal), ("gt", np.greater),
                        ("greater", np.greater), ("ge", np.greater_equal),
                        ("greater_equal", np.greater_equal), ("lt", np.less), ("less", np.less),
                        ("le", np.less_equal), ("less_equal", np.less_equal)):
        case(f"{_prefix}.{_name}", getattr(_mod, _name), _ref, X, Y)
    for _name, _ref in (("logical_and", np.logical_and), ("logical_or", np.logical_or)):
        case(f"{_prefix}.{_name}", getattr(_mod, _name), _ref, X > 0, Y > 0)
    case(f"{_prefix}.logical_not", _mod.logical_not, np.logical_not, X > 0)

case("ops.add", ops.add, np.add, X, V)
case("ops.sub", ops.sub, np.subtract, X, V)
case("ops.subtract", ops.subtract, np.subtract, X, Y)
case("ops.multiply", ops.multiply, np.multiply, X, Y)
case("ops.div", ops.div, np.divide, X, POS)
case("ops.true_divide", ops.true_divide, np.divide, X, POS)
case("ops.divide", ops.divide, np.divide, X, POS)
case("mint.add", lambda x, y: mint.add(x, y, alpha=2.0), lambda x, y: x + 2 * y, X, Y)
case("mint.sub", lambda x, y: mint.sub(x, y, alpha=3.0), lambda x, y: x - 3 * y, X, Y)
case("mint.div", mint.div, np.divide, X, POS)
case("ops.equal", ops.equal, np.equal, X, X * (X > 0))
case("mint.eq", mint.eq, np.equal, X, X * (X > 0))
case("ops.select", ops.select, np.where, X > 0, X, Y)
case("ops.gelu", ops.gelu, _gelu, X)
case("ops.gelu.tanh", lambda x: ops.gelu(x, "tanh"), _gelu_tanh, X)
case("F.gelu", mf.gelu, _gelu, X)
case("ops.cast", lambda x: ops.cast(x, np.int32), lambda x: x.astype(np.int32), X * 4)
case("ops.bias_add", ops.bias_add, lambda x, b: x + b[None, :, None], X, M[:, 0])
case("ops.matmul.vector", ops.matmul, np.matmul, V, N)
case("ops.matmul.vectors", ops.matmul, np.matmul, V, V)
case("ops.matmul.batch_vector", ops.matmul, np.matmul, X, V)
case("ops.mm", ops.mm, np.matmul, M, N)
case("ops.dense", ops.dense, lambda x, w, b: x @ w.T + b, X, N.T.copy(), N[0])
case("F.linear", mf.linear, lambda x, w: x @ w.T, X, N.T.copy())
case("ops.sum", lambda x: ops.sum(x, 1, True), lambda x: x.sum(1, keepdims=True), X)
case("ops.mean", lambda x: ops.mean(x, (0, 2)), lambda x: x.mean((0, 2)), X)
case("ops.amax", lambda x: ops.amax(x, -1), lambda x: x.max(-1), X)
case("ops.reduce_sum", lambda x: ops.reduce_sum(x, (1,)), lambda x: x.sum(1), X)
case("ops.reduce_mean", lambda x: ops.reduce_mean(x, (1,)), lambda x: x.mean(1), X)
case("ops.reduce_max", lambda x: ops.reduce_max(x, (1,)), lambda x: x.max(1), X)
case("ops.reduce_min", lambda x: ops.reduce_min(x, (1,), True), lambda x: x.min(1, keepdims=True),
     X)
case("ops.amin", lambda x: ops.amin(x, -1), lambda x: x.min(-1), X)
case("ops.sign", ops.sign, np.sign, X)
case("ops.masked_fill", lambda x: ops.masked_fill(x, x > 0, -1.0), lambda x: np.where(x > 0, -1, x),
     X)
case("ops.repeat_interleave", lambda x: ops.repeat_interleave(x, 2, 1),
     lambda x: np.repeat(x, 2, 1), X)
case("ops.swiglu", ops.swiglu,
     lambda x: x[..., :2] / (1 + np.exp(-x[..., :2])) * x[..., 2:], X)


def _rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


case("ops.rotary_position_embedding", ops.rotary_position_embedding, _rope_reference,
     X.reshape(1, 2, 3, 4), np.cos(V).reshape(1, 1, 1, 4), np.sin(V).reshape(1, 1, 1, 4))
case("mint.sum", lambda x: mint.sum(x, (0, 1)), lambda x: x.sum((0, 1)), X)
case("mint.mean", lambda x: mint.mean(x, -1, True), lambda x: x.mean(-1, keepdims=True), X)
case("mint.amax", lambda x: mint.amax(x, 1), lambda x: x.max(1), X)
case("ops.lp_norm", lambda x: ops.lp_norm(x, [0, 1]), lambda x: np.sqrt((x * x).sum((0, 1))), X)
case("ops.norm", ops.norm, lambda x: np.sqrt((x * x).sum()), X)
case("ops.norm.ord", lambda x: ops.norm(x, 3, -1, True),
     lambda x: (np.abs(x) ** 3).sum(-1, keepdims=True) ** (1 / 3), X)
case("mint.norm", lambda x: mint.norm(x, 1, 1), lambda x: np.abs(x).sum(1), X)
case("F.normalize", mf.normalize, lambda x: x / np.sqrt((x * x).sum(1, keepdims=True)), X)
case("ops.softmax", ops.softmax, _softmax, X)
case("ops.log_softmax", lambda x: ops.log_softmax(x, 1), lambda x: np.log(_softmax(x, 1)), X)
case("F.softmax", lambda x: mf.softmax(x, 0), lambda x: _softmax(x, 0), X)
case("F.log_softmax", mf.log_softmax, lambda x: np.log(_softmax(x)), X)
case("ops.layer_norm", lambda x: ops.layer_norm(x, (3, 4)), lambda x: _layer_norm(x, (1, 2)), X)
case("ops.layer_norm.legacy", lambda x, g, b: ops.layer_norm(x, g, b),
     lambda x, g, b: _layer_norm(x, (2,)) * g + b, X, V, V[::-1].copy())
case("F.layer_norm", lambda x, g: mf.layer_norm(x, [4], g), lambda x, g: _layer_norm(x, (2,)) * g,
     X, V)
case("ops.rms_norm", lambda x, g: ops.rms_norm(x, g)[0],
     lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g, X, V)
case("ops.shape", lambda x: Tensor(np.array(ops.shape(x))), lambda x: np.array(x.shape), X)
case("ops.transpose", lambda x: ops.transpose(x, (2, 0, 1)), lambda x: x.transpose(2, 0, 1), X)
case("ops.permute", lambda x: ops.permute(x, (1, 2, 0)), lambda x: x.transpose(1, 2, 0), X)
case("mint.permute", lambda x: mint.permute(x, (1, 2, 0)), lambda x: x.transpose(1, 2, 0), X)
case("mint.transpose", lambda x: mint.transpose(x, 0, -1), lambda x: x.swapaxes(0, -1), X)
case("mint.swapaxes", lambda x: mint.swapaxes(x, 1, 2), lambda x: x.swapaxes(1, 2), X)
case("ops.expand_dims", lambda x: ops.expand_dims(x, 1), lambda x: x[:, None], X)
case("ops.unsqueeze", lambda x: ops.unsqueeze(x, -1), lambda x: x[..., None], X)
case("mint.unsqueeze", lambda x: mint.unsqueeze(x, 0), lambda x: x[None], X)
case("ops.squeeze", ops.squeeze, np.squeeze, X[:, :1])
case("mint.squeeze", lambda x: mint.squeeze(x, 1), lambda x: x.squeeze(1), X[:, :1])
case("ops.flatten", ops.flatten, lambda x: x.reshape(2, -1), X)
case("ops.flatten.dims", lambda x: ops.flatten(x, start_dim=0, end_dim=1),
     lambda x: x.reshape(6, 4), X)
case("mint.flatten", mint.flatten, lambda x: x.reshape(-1), X)
case("ops.broadcast_to", lambda x: ops.broadcast_to(x, (2, 3, 4)),
     lambda x: np.broadcast_to(x, (2, 3, 4)), V)
case("mint.broadcast_to", lambda x: mint.broadcast_to(x, (3, 4)),
     lambda x: np.broadcast_to(x, (3, 4)), V)
case("ops.concat", lambda x, y: ops.concat((x, y), 1), lambda x, y: np.concatenate((x, y), 1),
     X, Y)
case("ops.cat", lambda x, y: ops.cat([x, y]), lambda x, y: np.concatenate((x, y)), X, Y)
case("mint.cat", lambda x, y: mint.cat([x, y], 2), lambda x, y: np.concatenate((x, y), 2), X, Y)
case("mint.concat", lambda x, y: mint.concat([x, y]), lambda x, y: np.concatenate((x, y)), X, Y)
case("ops.stack", lambda x, y: ops.stack([x, y], -1), lambda x, y: np.stack((x, y), -1), X, Y)
case("mint.stack", lambda x, y: mint.stack([x, y]), lambda x, y: np.stack((x, y)), X, Y)
case("ops.split", lambda x: ops.split(x, 3, 2), lambda x: (x[..., :3], x[..., 3:]), X)
case("ops.split.sections", lambda x: ops.split(x, [1, 3], -1), lambda x: (x[..., :1], x[..., 1:]),
     X)
case("ops.split.equal", lambda x: ops.split(x, 2, 2), lambda x: (x[..., :2], x[..., 2:]), X)
case("ops.split.output_num", lambda x: ops.split(x, axis=1, output_num=3),
     lambda x: tuple(np.split(x, 3, 1)), X)
case("mint.split", lambda x: mint.split(x, [2, 1], 1), lambda x: (x[:, :2], x[:, 2:]), X)
case("ops.strided_slice", lambda x: ops.strided_slice(x, (0, 1, 0), (2, 3, 4), (1, 1, 2)),
     lambda x: x[:, 1:3, ::2], X)
case("ops.gather", lambda x, i: ops.gather(x, i, 2), lambda x, i: np.take(x, i, 2), X, IDX)
case("ops.gather.batch", lambda x, i: ops.gather(x, i, 2, batch_dims=1), _batch_gather, X, BIDX)
case("mint.index_select", lambda x, i: mint.index_select(x, 1, i), lambda x, i: x[:, i], X,
     np.array([2, 0], np.int32))
case("F.embedding", mf.embedding, lambda i, w: w[i], IDX, M)
def _top(x: np.ndarray, k: int, axis: int, largest: bool = True) -> tuple[np.ndarray, ...]:
    order = np.argsort(-x if largest else x, axis=axis, kind="stable")
    idx = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, idx, axis), idx.astype(np.int32)


case("ops.topk", lambda x: ops.topk(x, 2), lambda x: _top(x, 2, -1), X)
case("ops.topk.dim_smallest", lambda x: ops.topk(x, 2, dim=1, largest=False),
     lambda x: _top(x, 2, 1, largest=False), X)
case("ops.sort", ops.sort, lambda x: _top(x, x.shape[-1], -1, largest=False), X)
case("ops.sort.descending", lambda x: ops.sort(x, axis=1, descending=True),
     lambda x: _top(x, x.shape[1], 1), X)
case("ops.cumsum", lambda x: ops.cumsum(x, 1), lambda x: np.cumsum(x, 1), X)
case("ops.cumsum.dtype", lambda i: ops.cumsum(i, 0, dtype=np.float32),
     lambda i: np.cumsum(i, 0).astype(np.float32), LABELS)

case("ops.one_hot", lambda i: ops.one_hot(i, 5, 1.0, 0.0), lambda i: np.eye(5)[i], LABELS)
case("F.one_hot", lambda i: mf.one_hot(i, 4), lambda i: np.eye(4, dtype=np.int64)[i], LABELS)
case("ops.conv2d", lambda x, w: ops.conv2d(x, w, padding=1), lambda x, w: _conv(x, w, 1), IMG,
     KER)
case("F.conv2d", lambda x, w, b: mf.conv2d(x, w, b),
     lambda x, w, b: _conv(x, w) + b[None, :, None, None], IMG, KER, V)
case("ops.max_pool2d", lambda x: ops.max_pool2d(x, 2), lambda x: _pool(x, np.max), IMG)
case("F.max_pool2d", lambda x: mf.max_pool2d(x, 2, 2), lambda x: _pool(x, np.max), IMG)
case("ops.avg_pool2d", lambda x: ops.avg_pool2d(x, 2, 2), lambda x: _pool(x, np.mean), IMG)
case("F.avg_pool2d", lambda x: mf.avg_pool2d(x, 2), lambda x: _pool(x, np.mean), IMG)
case("ops.flash_attention_score",
     lambda q, k, v: ops.flash_attention_score(q, k, v, 1, input_layout="BSH"),
     lambda q, k, v: _softmax(q @ k.swapaxes(1, 2)) @ v, X, Y, X)

case("ops.cos", ops.cos, np.cos, X)
case("ops.sin", ops.sin, np.sin, X)
case("ops.floor_div", ops.floor_div, lambda x, y: np.floor(x / y), X, POS)
case("ops.floor_mod", ops.floor_mod, lambda x, y: x - np.floor(x / y) * y, X * 3, POS)
case("ops.trunc", ops.trunc, np.trunc, X * 3)
case("ops.atan2", ops.atan2, np.arctan2, X, Y)
case("ops.div.floor", lambda x, y: ops.div(x, y, rounding_mode="floor"),
     lambda x, y: np.floor(x / y), X * 3, POS)
case("ops.div.trunc", lambda x, y: ops.div(x, y, rounding_mode="trunc"),
     lambda x, y: np.trunc(x / y), X * 3, POS)
for _name, _ref in (("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or),
                    ("bitwise_xor", np.bitwise_xor)):
    case(f"ops.{_name}", getattr(ops, _name), _ref, (X * 9).astype(np.int32),
         (Y * 9).astype(np.int32))
case("ops.floor_divide", ops.floor_divide, lambda x, y: np.floor(x / y), X * 3, POS)
case("ops.isfinite", ops.isfinite, np.isfinite, np.where(X > 0, X, np.inf).astype(np.float32))
for _name, _ref in (("cos", np.cos), ("sin", np.sin)):
    case(f"mint.{_name}", getattr(mint, _name), _ref, X)
case("mint.floor_divide", mint.floor_divide, lambda x, y: np.floor(x / y), X * 3, POS)
case("mint.isfinite", mint.isfinite, np.isfinite, np.where(X > 0, X, np.nan).astype(np.float32))


def _cross_entropy(x: np.ndarray, t: np.ndarray, weight: np.ndarray | None = None,
                   ignore: int = -100, reduction: str = "mean", smoothing: float = 0.0) -> Any:
    """PyTorch's documented formula (MindSpore 2.x's `ops.cross_entropy`), in float64."""
    x = x.astype(np.float64)
    n, c = x.shape
    logp = x - x.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    w = np.ones(c) if weight is None else weight.astype(np.float64)
    if t.dtype.kind in "iu":
        keep = (t != ignore) & (t >= 0) & (t < c)
        hot = np.zeros((n, c))
        hot[np.arange(n)[keep], t[keep]] = 1.0
        target = w * ((1 - smoothing) * hot + smoothing / c * keep[:, None])
        losses = -(target * logp).sum(1)
        if reduction == "mean":
            return losses.sum() / (hot * w).sum()
    else:
        losses = -(w * ((1 - smoothing) * t + smoothing / c) * logp).sum(1)
        if reduction == "mean":
            return losses.mean()
    return losses.sum() if reduction == "sum" else losses


CE_W = np.array([0.5, 1.0, 2.0, 1.5], np.float32)
CE_IDS = np.array([0, 3, 2], np.int32)
CE_PROBS = _softmax(RNG.standard_normal((3, 4))).astype(np.float32)
case("ops.cross_entropy", ops.cross_entropy, _cross_entropy, M, CE_IDS)
case("ops.cross_entropy.weighted_ignored_smoothed",
     lambda x, t: ops.cross_entropy(x, t, Tensor(CE_W), ignore_index=2, label_smoothing=0.1),
     lambda x, t: _cross_entropy(x, t, CE_W, 2, "mean", 0.1), M, CE_IDS)
case("ops.cross_entropy.probabilities_sum",
     lambda x, t: ops.cross_entropy(x, t, reduction="sum", label_smoothing=0.2),
     lambda x, t: _cross_entropy(x, t, None, -100, "sum", 0.2), M, CE_PROBS)
case("F.cross_entropy", lambda x, t: mf.cross_entropy(x, t, reduction="none"),
     lambda x, t: _cross_entropy(x, t, reduction="none"), M, CE_IDS)
case("ops.reciprocal", ops.reciprocal, lambda x: 1 / x, POS)
case("ops.depend", ops.depend, lambda x, y: x, X, Y)
case("ops.fill", lambda: ops.fill(np.float32, (2, 3), 1.5), lambda: np.full((2, 3), 1.5))
case("ops.tuple_to_array", lambda: ops.tuple_to_array((1, 2.5)),
     lambda: np.array([1.0, 2.5], np.float32))
case("ops.dtype", lambda x: Tensor(np.array(ops.dtype(x).np.itemsize)),
     lambda x: np.array(x.dtype.itemsize), X)
case("ops.global_norm", lambda x, y: ops.global_norm([x, y]),
     lambda x, y: np.sqrt((x.astype(np.float64) ** 2).sum() + (y.astype(np.float64) ** 2).sum()),
     X, M)
case("ops.clip_by_global_norm", lambda x, y: ops.clip_by_global_norm((x, y), 1.0),
     lambda x, y: tuple(t / np.sqrt((x * x).sum() + (y * y).sum()) for t in (x, y)), X, M)
# Eager, an assignment updates the Parameter's data and returns the Parameter; traced, see
# tests/compiler/test_forward_state.py and tests/compiler/test_training_forms.py.
case("ops.assign", lambda x, y: ops.assign(_state(x), y), lambda x, y: x * 0 + y, X, Y)
case("ops.assign_add", lambda x, y: ops.assign_add(_state(x), y), lambda x, y: x + y, X, Y)
case("ops.assign_sub", lambda x, y: ops.assign_sub(_state(x), y), lambda x, y: x - y, X, Y)
NOT_EAGER: set[str] = set()


def _names(module: Any) -> set[str]:
    return set(module.__all__) - {"nn"}


EXPORTED = ({f"ops.{n}" for n in _names(functional)} | {f"mint.{n}" for n in _names(mint)}
            | {f"F.{n}" for n in _names(mf)})


def test_every_functional_name_has_a_case() -> None:
    covered = {".".join(name.split(".")[:2]) for name in CASES}
    missing = sorted(EXPORTED - covered - NOT_EAGER)
    assert not missing, f"add a case for {missing}"


def _tensor(a: np.ndarray) -> Tensor:
    t = Tensor(a)
    t._data = np.asarray(a)  # keep the exact dtype
    return t


@pytest.mark.parametrize("name", sorted(CASES))
def test_functional_matches_numpy(name: str) -> None:
    call, ref, arrays = CASES[name]
    got = call(*[_tensor(a) for a in arrays])
    want = ref(*[np.asarray(a) for a in arrays])
    got_list = list(got) if isinstance(got, tuple) else [got]
    want_list = list(want) if isinstance(want, tuple) else [want]
    assert len(got_list) == len(want_list)
    for g, w in zip(got_list, want_list):
        g, w = g.asnumpy(), np.asarray(w)
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
        if w.dtype == bool or w.dtype.kind in "iu":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            # float32 results of float64 references: a few ulps per accumulated term
            terms = max([a.size for a in arrays] + [1])
            np.testing.assert_allclose(g.astype(np.float64), w, rtol=4e-7 * terms,
                                       atol=4e-7 * terms * max(1.0, np.abs(w).max()),
                                       err_msg=name)


@pytest.mark.parametrize("call, message", [
    (lambda: ops.div(_tensor(X), _tensor(POS), rounding_mode="round"), "rounding_mode"),
    (lambda: ops.gelu(_tensor(X), "erf"), "approximate"),
    (lambda: ops.norm(_tensor(M), "nuc"), "matrix norms"),
    (lambda: ops.max_pool2d(_tensor(IMG), 2, padding=1), "padding=1"),
    (lambda: mf.one_hot(_tensor(LABELS)), "num_classes"),
    (lambda: mf.embedding(_tensor(IDX), _tensor(M), padding_idx=0), "padding_idx"),
    (lambda: ops.split(_tensor(X), [1, 1], -1), "must add up to the size 4"),
])
def test_unsupported_arguments_are_named(call: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_module_aliases() -> None:
    import importlib

    import pcompile
    import pcompile.compiler.frontend.mint

    assert importlib.import_module("pcompile.mint") is pcompile.compiler.frontend.mint
    assert pcompile.mint is mint
    assert importlib.import_module("pcompile.mint.nn.functional") is mf
    assert mint.nn.functional is mf
    from pcompile.ops import matmul, relu

    assert relu is functional.relu and matmul is functional.matmul
    assert "matmul" in dir(ops)
    # mindformers imports its fused ops by module path
    from pcompile.ops.auto_generate import gen_ops_prim
    from pcompile.ops.auto_generate.gen_ops_prim import Swiglu

    assert gen_ops_prim.Swiglu is Swiglu is ops.auto_generate.gen_ops_prim.Swiglu


def _state(a: Any) -> Parameter:
    return Parameter(Tensor(np.array(a.asnumpy())), "state", requires_grad=False)


def test_assign_updates_a_parameter_and_refuses_a_tensor() -> None:
    state = _state(_tensor(X))
    assert ops.assign_add(state, _tensor(Y)) is state
    np.testing.assert_array_equal(state.asnumpy(), X + Y)
    with pytest.raises(PcompileError, match="AssignAdd: the variable must be a Parameter, got "
                                            "Tensor.*a plain tensor has no value to update"):
        ops.assign_add(_tensor(X), _tensor(Y))


FUNCTIONAL_MODEL = '''
import numpy as np

import pcompile.mint as mint
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context
from pcompile.mint.nn import functional as F

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 32]), "w")
        self.w2 = Parameter(initializer("normal", [8, 32]), "w2")
        self.table = Parameter(initializer("normal", [4, 6, 8]), "table")
        self.add = ops.TensorAdd().shard(((2, 4), (2, 4)))
        self.add.set_device("CPU")
        self.gather = ops.Gather(batch_dims=1).shard(((2, 1, 4), (2, 1)))
        self.norm = ops.LpNorm(axis=1, p=2, keep_dims=True).shard(((2, 4),))

    def construct(self, x, idx, labels):
        h = mint.matmul(x, self.w)                       # MatMul
        h = F.gelu(self.add(h, ops.abs(h)))             # TensorAdd, Abs, exact GeLU (Erf)
        h = F.linear(h, self.w2)                         # MatMul, transpose_b
        rows = self.gather(self.table, idx, 1)           # (4, 2, 8): batch_dims=1
        h = mint.add(h, mint.sum(rows, dim=1), alpha=0.5)
        h = h / self.norm(h)
        ce = F.cross_entropy(mint.sin(h) + mint.cos(h), labels, np.linspace(0.5, 1.5, 8),
                             label_smoothing=0.1)
        return ops.mean(mint.square(h)) + ce


def model():
    return Net()


def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((4, 16)).astype(np.float32),
            rng.integers(0, 6, (4, 2)).astype(np.int32),
            rng.integers(0, 8, (4,)).astype(np.int32)]


def optimizer(params):
    return nn.SGD(params, 0.1)
'''


def test_functional_model_trains_as_on_one_device(tmp_path: Any) -> None:
    """ops / mint / mint.nn.functional, TensorAdd with set_device, Gather(batch_dims) and
    LpNorm sharded by the user on 8 devices: the oracle holds (float64, derived bound)."""
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.oracle import check

    path = tmp_path / "functional_model.py"
    path.write_text(FUNCTIONAL_MODEL)
    program = compile_model(str(path), devices=8, dump=False)
    ops_used = {n.op for n in program.graph.nodes}
    assert {"Abs", "Erf", "Gather", "LpNorm", "Add", "MatMul", "Sin", "Cos",
            "SoftmaxCrossEntropyWithLogits"} <= ops_used
    gather = next(n for n in program.graph.nodes if n.op == "Gather")
    assert gather.attrs["batch_dims"] == 1
    report = check(program, steps=2)
    assert report.ok(), report.errors


def test_ops_page_lists_every_functional_name() -> None:
    """docs/ops.md is, byte for byte, what `python -m pcompile.tools.ops_doc` generates now
    from the op registry's doc records and the functional namespaces (regenerate it after
    adding an op or a name, or changing a record)."""
    from pcompile.tools import ops_doc

    assert ops_doc.current() == ops_doc.generated(), (
        "docs/ops.md is stale: run `python -m pcompile.tools.ops_doc`")
    for name in ops_doc.all_ops():
        if not name.startswith("TestOnly_"):
            assert f"| `{name}` |" in ops_doc.current(), name
    for name in EXPORTED:
        prefix, short = name.split(".", 1)
        spelled = {"ops": "ops", "mint": "mint", "F": "mint.nn.functional"}[prefix]
        assert f"| `{spelled}.{short}` |" in ops_doc.current(), name


def test_set_device_is_accepted_and_checked() -> None:
    add = ops.TensorAdd()
    assert ops.TensorAdd is ops.Add
    assert add.set_device("CPU") is add and add.device_target == "CPU"
    assert add.set_device("") is add  # MindSpore accepts "" (the context's target)
    with pytest.raises(ValueError, match="device_target must be 'Ascend', 'GPU', 'CPU' or ''"):
        ops.MatMul().set_device("TPU")


def test_mint_nn_has_the_activation_cells() -> None:
    """mint.nn.ReLU() and the other argument-less activations are the nn cells (MindSpore's
    parallel tests build networks from them)."""
    import numpy as np

    from pcompile import Tensor, mint, nn

    x = Tensor(np.array([-1.0, 0.5], np.float32))
    for name in ("ReLU", "Sigmoid", "SiLU", "Tanh"):
        cell = getattr(mint.nn, name)()
        assert isinstance(cell, getattr(nn, name))
        np.testing.assert_array_equal(cell(x).asnumpy(), getattr(nn, name)()(x).asnumpy())


def test_cross_entropy_weight_must_be_a_constant(tmp_path: Any) -> None:
    """Class weights become constants of the loss; a traced weight (a Parameter) is refused
    with one message naming the argument."""
    from pcompile.ir.errors import PcompileError
    from pcompile.tools.compile import compile as compile_model

    path = tmp_path / "ce_model.py"
    path.write_text(FUNCTIONAL_MODEL.replace(
        "np.linspace(0.5, 1.5, 8)", "self.class_weight").replace(
        '        self.w = Parameter(', '        self.class_weight = Parameter(initializer("ones", '
        '[8]), "class_weight")\n        self.w = Parameter('))
    with pytest.raises(PcompileError, match="cross_entropy: weight=.*must be a constant"):
        compile_model(str(path), devices=8, dump=False)


SORTING_MODEL = '''
import numpy as np
from pcompile import nn, ops, Parameter, set_auto_parallel_context
from pcompile.common.initializer import initializer

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 12]), "w")
        self.matmul = ops.MatMul().shard(((4, 1), (1, 2)))

    def construct(self, x):
        h = self.matmul(x, self.w)                                   # (8, 12)
        small, _ = ops.topk(h, 3, dim=0, largest=False)              # (3, 12): dim 0 moved last
        big, _ = ops.topk(h, 4)                                      # (8, 4)
        ordered, _ = ops.sort(h, axis=1, descending=True)            # (8, 12)
        scan = ops.cumsum(ordered, 1)
        return ops.mean(small) + ops.mean(big * big) + ops.mean(scan)


def model():
    return Net()


def inputs():
    return [np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)]


def optimizer(params):
    return nn.SGD(params, 0.1)
'''


def test_topk_sort_cumsum_functional_forms_train_as_on_one_device(tmp_path: Any) -> None:
    """ops.topk (another dim, the smallest), ops.sort and ops.cumsum behind a sharded MatMul
    on 8 devices, sharding propagation: each takes a strategy that leaves its sorted or summed
    axis whole, and a training step matches the single-device one."""
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.oracle import check

    path = tmp_path / "sorting_model.py"
    path.write_text(SORTING_MODEL)
    program = compile_model(str(path), devices=8, dump=False)
    ops_seen = {n.op for n in program.graph.nodes}
    assert {"TopK", "Sort", "CumSum", "Neg", "Transpose"} <= ops_seen
    assignment = program.state.assignment
    for node in program.graph.nodes:
        if node.op in ("TopK", "Sort", "CumSum"):
            axis = -1 if node.op == "TopK" else node.attrs["axis"]
            assert assignment.sharding(node).strategy[0][axis] == 1, node.op
    report = check(program, steps=2)
    assert report.ok(), report.errors
