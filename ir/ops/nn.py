"""Neural-network primitives (MindSpore semantics and names) and the grad helpers their vjps use.

Forward ops: Softmax, LogSoftmax, LayerNorm, SoftmaxCrossEntropyWithLogits,
SparseSoftmaxCrossEntropyWithLogits, Conv2D, MaxPool, AvgPool.
Gradient helpers (`differentiable=False`): SoftmaxGrad, LogSoftmaxGrad, LayerNormGrad,
SoftmaxCrossEntropyWithLogitsGrad, Conv2DBackpropInput, Conv2DBackpropFilter, MaxPoolGrad,
AvgPoolGrad.

Layout is NCHW throughout (the only `data_format` supported). Float16/BFloat16 inputs of the
normalisation ops are computed in float32 and rounded back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, In, Index, Out, Same, broadcast
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.ops._define import define, grad_helper
from pcompile.ir.ops._jax import jax, jnp, lax
from pcompile.ir.ops._util import normalize_axis, same_dtype, tensor, tuple_type
from pcompile.ir.registry import FLOATS, Trait
from pcompile.ir.sharding import (
    ALPHA,
    LabelRule,
    Labels,
    OpContext,
    OpSharding,
    Strategy,
    identity_labels,
)
from pcompile.ir.types import DType, TensorType, ValueType

# -- shared helpers -------------------------------------------------------------------------


def _float_tensor(t: ValueType, what: str) -> TensorType:
    tt = tensor(t, what)
    if not tt.dtype.is_float:
        raise ShapeError(f"{what} must be a floating-point tensor, got {tt.dtype.value}")
    return tt


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _up_np(x: np.ndarray) -> np.ndarray:
    """Compute dtype of the numpy impls: float32 for 16-bit floats, else unchanged."""
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x


def _up_jax(x: Any) -> Any:
    return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x


def _softmax_axes(axis: Any, rank: int) -> tuple[int, ...]:
    """Normalise Softmax's `axis` attr (an int or a non-empty tuple of distinct ints)."""
    axes = (axis,) if _is_int(axis) else axis
    if not isinstance(axes, tuple) or not axes or not all(_is_int(a) for a in axes):
        raise ShapeError(f"axis must be an int or a non-empty tuple of ints, got {axis!r}")
    if rank == 0:
        raise ShapeError("needs an input of rank >= 1, got a scalar")
    out = tuple(normalize_axis(a, rank) for a in axes)
    if len(set(out)) != len(out):
        raise ShapeError(f"axis {axis!r} names the same dimension twice")
    return out


# -- Softmax / SoftmaxGrad ------------------------------------------------------------------


def _softmax_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = _float_tensor(types[0], "x")
    _softmax_axes(attrs["axis"], x.rank)
    return x


def _softmax_np(x: np.ndarray, axis: Any = (-1,)) -> np.ndarray:
    axes = _softmax_axes(axis, x.ndim)
    xa = _up_np(x)
    e = np.exp(xa - np.max(xa, axis=axes, keepdims=True))
    result: np.ndarray = (e / np.sum(e, axis=axes, keepdims=True)).astype(x.dtype)
    return result


def _softmax_jax(x: Any, axis: Any = (-1,)) -> Any:
    axes = _softmax_axes(axis, x.ndim)
    xa = _up_jax(x)
    e = jnp.exp(xa - lax.stop_gradient(jnp.max(xa, axis=axes, keepdims=True)))
    return (e / jnp.sum(e, axis=axes, keepdims=True)).astype(x.dtype)


def _softmax_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("SoftmaxGrad", node.result, cot, axis=node.attrs["axis"])]


def softmax_axes(ctx: OpContext) -> Sequence[int]:
    axis = ctx.attrs.get("axis", -1)
    return axis if isinstance(axis, tuple) else (axis,)


define("Softmax", _softmax_infer, _softmax_np, _softmax_jax, vjp=_softmax_vjp,
       attrs={"axis": (-1,)}, num_inputs=1,
       sharding=LabelRule(identity_labels(softmax_axes), unsplittable="the softmax axis"),
       doc="exp(x) / sum(exp(x), axis); axis is a tuple of ints (MindSpore) or an int.",
       section="linalg", operands="x; `axis` (tuple)", dtypes=FLOATS,
       rule="the softmax axis never splits",
       tests=("test_ops_nn.py::test_softmax",
              "test_ops_nn.py::test_softmax_default_axis_and_int_axis",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(broadcast))


def _grad_pair_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    y, dy = _float_tensor(types[0], "y"), _float_tensor(types[1], "dy")
    if y.shape != dy.shape:
        raise ShapeError(f"y {y.shape} and dy {dy.shape} must have the same shape")
    same_dtype([y, dy])
    _softmax_axes(attrs["axis"], y.rank)
    return y


def _softmax_grad_np(y: np.ndarray, dy: np.ndarray, axis: Any = (-1,)) -> np.ndarray:
    axes = _softmax_axes(axis, y.ndim)
    ya, dya = _up_np(y), _up_np(dy)
    result: np.ndarray = ((dya - np.sum(dya * ya, axis=axes, keepdims=True)) * ya).astype(y.dtype)
    return result


def _softmax_grad_jax(y: Any, dy: Any, axis: Any = (-1,)) -> Any:
    axes = _softmax_axes(axis, y.ndim)
    ya, dya = _up_jax(y), _up_jax(dy)
    return ((dya - jnp.sum(dya * ya, axis=axes, keepdims=True)) * ya).astype(y.dtype)


grad_helper("SoftmaxGrad", _grad_pair_infer, _softmax_grad_np, _softmax_grad_jax,
            attrs={"axis": (-1,)},
            doc="(dy - sum(dy * y, axis)) * y, where y = Softmax(x): the vjp of Softmax.",
            grad_of="Softmax", operands="y, dy; `axis`", dtypes=FLOATS, section="linalg",
            tests=("test_ops_nn.py::test_vjps_use_dedicated_grad_ops",), dims=DimRule(broadcast))

# -- LogSoftmax / LogSoftmaxGrad ------------------------------------------------------------


def _int_axis(axis: Any) -> int:
    if not _is_int(axis):
        raise ShapeError(f"axis must be an int, got {axis!r}")
    return int(axis)


def _log_softmax_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = _float_tensor(types[0], "x")
    _softmax_axes(_int_axis(attrs["axis"]), x.rank)
    return x


def _log_softmax_np(x: np.ndarray, axis: int = -1) -> np.ndarray:
    xa = _up_np(x)
    s = xa - np.max(xa, axis=axis, keepdims=True)
    result: np.ndarray = (s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))).astype(x.dtype)
    return result


def _log_softmax_jax(x: Any, axis: int = -1) -> Any:
    xa = _up_jax(x)
    s = xa - lax.stop_gradient(jnp.max(xa, axis=axis, keepdims=True))
    return (s - jnp.log(jnp.sum(jnp.exp(s), axis=axis, keepdims=True))).astype(x.dtype)


def _log_softmax_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("LogSoftmaxGrad", node.result, cot, axis=node.attrs["axis"])]


define("LogSoftmax", _log_softmax_infer, _log_softmax_np, _log_softmax_jax, vjp=_log_softmax_vjp,
       attrs={"axis": -1}, num_inputs=1,
       sharding=LabelRule(identity_labels(softmax_axes), unsplittable="the softmax axis"),
       doc="x - log(sum(exp(x), axis)); axis is an int.", section="linalg",
       operands="x; `axis` (int)", dtypes=FLOATS, rule="the softmax axis never splits",
       tests=("test_ops_nn.py::test_log_softmax",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(broadcast))


def _log_softmax_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    return _grad_pair_infer(types, {"axis": _int_axis(attrs["axis"])})


def _log_softmax_grad_np(y: np.ndarray, dy: np.ndarray, axis: int = -1) -> np.ndarray:
    ya, dya = _up_np(y), _up_np(dy)
    result: np.ndarray = (dya - np.exp(ya) * np.sum(dya, axis=axis, keepdims=True)).astype(y.dtype)
    return result


def _log_softmax_grad_jax(y: Any, dy: Any, axis: int = -1) -> Any:
    ya, dya = _up_jax(y), _up_jax(dy)
    return (dya - jnp.exp(ya) * jnp.sum(dya, axis=axis, keepdims=True)).astype(y.dtype)


grad_helper("LogSoftmaxGrad", _log_softmax_grad_infer, _log_softmax_grad_np, _log_softmax_grad_jax,
            attrs={"axis": -1},
            doc="dy - exp(y) * sum(dy, axis), where y = LogSoftmax(x): the vjp of LogSoftmax.",
            grad_of="LogSoftmax", operands="y, dy; `axis`", dtypes=FLOATS, section="linalg",
            tests=("test_ops_nn.py::test_vjps_use_dedicated_grad_ops",), dims=DimRule(broadcast))

# -- LayerNorm / LayerNormGrad --------------------------------------------------------------


def _layer_norm_axes(rank: int, attrs: dict[str, Any]) -> tuple[int, int]:
    """(begin_norm_axis, begin_params_axis) normalised to [0, rank)."""
    if rank == 0:
        raise ShapeError("needs an input of rank >= 1, got a scalar")
    bna, bpa = attrs["begin_norm_axis"], attrs["begin_params_axis"]
    if not _is_int(bna) or not _is_int(bpa):
        raise ShapeError(
            f"begin_norm_axis and begin_params_axis must be ints, got {bna!r} and {bpa!r}"
        )
    eps = attrs["epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ShapeError(f"epsilon must be a non-negative float, got {eps!r}")
    return (
        normalize_axis(bna, rank, "begin_norm_axis"),
        normalize_axis(bpa, rank, "begin_params_axis"),
    )


def _check_params(x: TensorType, gamma: TensorType, beta: TensorType, bpa: int) -> None:
    want = x.shape[bpa:]
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p.shape != want:
            raise ShapeError(
                f"{name} shape {p.shape} must equal x.shape[begin_params_axis:] = {want} "
                f"(x {x.shape}, begin_params_axis {bpa})"
            )
    same_dtype([x, gamma, beta])


def _layer_norm_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = _float_tensor(types[0], "x")
    gamma, beta = tensor(types[1], "gamma"), tensor(types[2], "beta")
    _, bpa = _layer_norm_axes(x.rank, attrs)
    _check_params(x, gamma, beta, bpa)
    return x


_LN_DEFAULTS: dict[str, Any] = {
    "begin_norm_axis": 1,
    "begin_params_axis": 1,
    "epsilon": 1e-7,
}


def _ln_stats(xp: Any, xa: Any, bna: int, eps: float) -> tuple[Any, Any]:
    """(x - mean, 1/sqrt(var + eps)) over axes bna.. with the array module `xp`."""
    axes = tuple(range(bna, xa.ndim))
    centred = xa - xp.mean(xa, axis=axes, keepdims=True)
    var = xp.mean(centred * centred, axis=axes, keepdims=True)
    return centred, 1.0 / xp.sqrt(var + eps)


def _layer_norm_np(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, **attrs: Any) -> np.ndarray:
    bna, _ = _layer_norm_axes(x.ndim, attrs)
    centred, rstd = _ln_stats(np, _up_np(x), bna, float(attrs["epsilon"]))
    y: np.ndarray = centred * rstd * _up_np(gamma) + _up_np(beta)
    return y.astype(x.dtype)


def _layer_norm_jax(x: Any, gamma: Any, beta: Any, **attrs: Any) -> Any:
    bna, _ = _layer_norm_axes(x.ndim, attrs)
    centred, rstd = _ln_stats(jnp, _up_jax(x), bna, float(attrs["epsilon"]))
    y = centred * rstd * _up_jax(gamma) + _up_jax(beta)
    return y.astype(x.dtype)


def _layer_norm_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, gamma, _ = node.operands
    attrs = {k: node.attrs[k] for k in _LN_DEFAULTS}
    grads = b("LayerNormGrad", cot, x, gamma, **attrs)
    return [b("TupleGetItem", grads, index=i) for i in range(3)]


def layer_norm_labels(ctx: OpContext) -> Labels:
    x = ctx.in_types[0]
    lab = ALPHA[: x.rank]
    norm = ctx.attrs.get("begin_norm_axis", 1) % max(x.rank, 1)
    params = ctx.attrs.get("begin_params_axis", 1) % max(x.rank, 1)
    unsplit = set(lab[norm:])
    plab = lab[params:]
    return Labels([lab, plab, plab], [lab], unsplit)


def _layer_norm_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    x = ins[0][0]
    _, bpa = _layer_norm_axes(len(x), attrs)
    for d in range(len(x)):
        yield Same(In(0, d), Out(d))
        if d >= bpa:
            yield Same(In(1, d - bpa), In(0, d))
            yield Same(In(2, d - bpa), In(0, d))


define("LayerNorm", _layer_norm_infer, _layer_norm_np, _layer_norm_jax, vjp=_layer_norm_vjp,
       attrs=dict(_LN_DEFAULTS), num_inputs=3,
       sharding=LabelRule(layer_norm_labels,
                          unsplittable="a normalised dim (from begin_norm_axis on)"),
       doc="(x - mean) / sqrt(var + epsilon) * gamma + beta; mean and (biased) var over axes "
           "begin_norm_axis.., gamma/beta of shape x.shape[begin_params_axis:]. Only y is returned "
           "(MindSpore also returns mean and variance).", section="linalg",
       operands="x, gamma, beta; `begin_norm_axis`, `begin_params_axis`, `epsilon` -> y",
       dtypes=FLOATS, rule="normalised dims never split",
       tests=("test_ops_nn.py::test_layer_norm", "test_ops_nn.py::test_layer_norm_defaults",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       note="`LayerNorm`'s IR op returns y; the Python op also gives mean and variance, as "
            "MindSpore's does.", dims=DimRule(_layer_norm_dims))


def _layer_norm_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dy, x = _float_tensor(types[0], "dy"), _float_tensor(types[1], "x")
    gamma = tensor(types[2], "gamma")
    if dy.shape != x.shape:
        raise ShapeError(f"dy {dy.shape} and x {x.shape} must have the same shape")
    _, bpa = _layer_norm_axes(x.rank, attrs)
    _check_params(x, gamma, gamma, bpa)
    same_dtype([dy, x])
    return tuple_type(x, gamma, gamma)


def _ln_grad(xp: Any, dy: Any, x: Any, gamma: Any, attrs: dict[str, Any]) -> tuple[Any, ...]:
    bna, bpa = _layer_norm_axes(x.ndim, attrs)
    centred, rstd = _ln_stats(xp, x, bna, float(attrs["epsilon"]))
    xhat = centred * rstd
    norm_axes = tuple(range(bna, x.ndim))
    g = dy * gamma
    dx = rstd * (
        g
        - xp.mean(g, axis=norm_axes, keepdims=True)
        - xhat * xp.mean(g * xhat, axis=norm_axes, keepdims=True)
    )
    lead = tuple(range(bpa))
    return dx, xp.sum(dy * xhat, axis=lead), xp.sum(dy, axis=lead)


def _layer_norm_grad_np(
    dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, **attrs: Any
) -> tuple[np.ndarray, ...]:
    dx, dg, db = _ln_grad(np, _up_np(dy), _up_np(x), _up_np(gamma), attrs)
    return dx.astype(x.dtype), dg.astype(gamma.dtype), db.astype(gamma.dtype)


def _layer_norm_grad_jax(dy: Any, x: Any, gamma: Any, **attrs: Any) -> tuple[Any, ...]:
    dx, dg, db = _ln_grad(jnp, _up_jax(dy), _up_jax(x), _up_jax(gamma), attrs)
    return dx.astype(x.dtype), dg.astype(gamma.dtype), db.astype(gamma.dtype)


grad_helper("LayerNormGrad", _layer_norm_grad_infer, _layer_norm_grad_np, _layer_norm_grad_jax,
            attrs=dict(_LN_DEFAULTS), num_inputs=3,
            doc="LayerNormGrad(dy, x, gamma) -> (dx, dgamma, dbeta); mean and variance are "
                "recomputed from x (the forward op does not return them).", grad_of="LayerNorm",
            operands="dy, x, gamma -> (dx, dgamma, dbeta)", dtypes=FLOATS, section="linalg",
            tests=("test_ops_nn.py::test_vjps_use_dedicated_grad_ops",))

# -- SoftmaxCrossEntropyWithLogits ----------------------------------------------------------


def _logits_labels(types: list[ValueType]) -> tuple[TensorType, TensorType]:
    logits, labels = _float_tensor(types[0], "logits"), _float_tensor(types[1], "labels")
    if logits.rank != 2:
        raise ShapeError(f"logits must have rank 2 (N, C), got shape {logits.shape}")
    if labels.shape != logits.shape:
        raise ShapeError(f"labels shape {labels.shape} must equal logits shape {logits.shape}")
    same_dtype([logits, labels])
    return logits, labels


def _sce_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    logits, _ = _logits_labels(types)
    return logits.with_shape(logits.shape[:1])


def _sce_np(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    ls = _log_softmax_np(_up_np(logits), -1)
    result: np.ndarray = (-np.sum(_up_np(labels) * ls, axis=-1)).astype(logits.dtype)
    return result


def _sce_jax(logits: Any, labels: Any) -> Any:
    ls = _log_softmax_jax(_up_jax(logits), -1)
    return (-jnp.sum(_up_jax(labels) * ls, axis=-1)).astype(logits.dtype)


def _sce_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    logits, labels = node.operands
    dlogits = b("SoftmaxCrossEntropyWithLogitsGrad", logits, labels, cot)
    n = logits.shape[0]
    neg_cot = b("Reshape", b("Neg", cot), shape=(n, 1))
    dlabels = b("Mul", b("LogSoftmax", logits, axis=-1), neg_cot)
    return [dlogits, dlabels]


def softmax_ce_labels(ctx: OpContext) -> Labels:
    return Labels(["nc", "nc"], ["n"], {"c"})


def _sce_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    yield Same(In(0, 0), In(1, 0))
    yield Same(In(0, 1), In(1, 1))
    yield Same(In(0, 0), Out(0))


define("SoftmaxCrossEntropyWithLogits", _sce_infer, _sce_np, _sce_jax, vjp=_sce_vjp, num_inputs=2,
       sharding=LabelRule(softmax_ce_labels, unsplittable="the class axis"),
       traits=frozenset({Trait.BATCH_ONLY}),
       doc="Per-sample loss -sum(labels * log_softmax(logits), -1) of shape (N,) for logits/labels "
           "(N, C). MindSpore also returns the backprop tensor; this op returns only the loss.",
       section="linalg", operands="logits, labels (N, C) -> (N,)", dtypes=FLOATS,
       rule="the class axis never splits",
       tests=("test_ops_nn.py::test_softmax_cross_entropy",
              "test_parallel.py::test_every_rule_matches_the_oracle"), dims=DimRule(_sce_dims))


def _sce_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    logits, _ = _logits_labels(types[:2])
    dloss = _float_tensor(types[2], "dloss")
    if dloss.shape != logits.shape[:1]:
        raise ShapeError(f"dloss shape {dloss.shape} must be (N,) = {logits.shape[:1]}")
    same_dtype([logits, dloss])
    return logits


def _sce_grad_np(logits: np.ndarray, labels: np.ndarray, dloss: np.ndarray) -> np.ndarray:
    la = _up_np(labels)
    p = _softmax_np(_up_np(logits), (-1,))
    g: np.ndarray = (p * np.sum(la, axis=-1, keepdims=True) - la) * _up_np(dloss)[:, None]
    return g.astype(logits.dtype)


def _sce_grad_jax(logits: Any, labels: Any, dloss: Any) -> Any:
    la = _up_jax(labels)
    p = _softmax_jax(_up_jax(logits), (-1,))
    g = (p * jnp.sum(la, axis=-1, keepdims=True) - la) * _up_jax(dloss)[:, None]
    return g.astype(logits.dtype)


grad_helper("SoftmaxCrossEntropyWithLogitsGrad", _sce_grad_infer, _sce_grad_np, _sce_grad_jax,
            num_inputs=3,
            doc="(softmax(logits) * sum(labels, -1) - labels) * dloss[:, None]: the logits vjp of "
                "SoftmaxCrossEntropyWithLogits (exact also when label rows do not sum to 1).",
            grad_of="SoftmaxCrossEntropyWithLogits", operands="logits, labels, dloss -> dlogits",
            dtypes=FLOATS, section="linalg",
            tests=("test_ops_nn.py::test_vjps_use_dedicated_grad_ops",))

# -- SparseSoftmaxCrossEntropyWithLogits ----------------------------------------------------


def _sparse_sce_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    logits = _float_tensor(types[0], "logits")
    labels = tensor(types[1], "labels")
    if logits.rank != 2:
        raise ShapeError(f"logits must have rank 2 (N, C), got shape {logits.shape}")
    if labels.dtype not in (DType.int32, DType.int64):
        raise ShapeError(f"labels must be Int32 or Int64, got {labels.dtype.value}")
    if labels.shape != logits.shape[:1]:
        raise ShapeError(
            f"labels shape {labels.shape} must be (N,) = {logits.shape[:1]} for logits "
            f"{logits.shape}"
        )
    if not isinstance(attrs["is_grad"], bool):
        raise ShapeError(f"is_grad must be a bool, got {attrs['is_grad']!r}")
    return logits if attrs["is_grad"] else logits.with_shape(())


def _check_labels_np(labels: np.ndarray, classes: int) -> None:
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(
            f"SparseSoftmaxCrossEntropyWithLogits: labels must lie in [0, {classes}), got "
            f"values in [{labels.min()}, {labels.max()}]"
        )


def _sparse_sce_np(logits: np.ndarray, labels: np.ndarray, is_grad: bool = False) -> np.ndarray:
    n, c = logits.shape
    _check_labels_np(labels, c)
    la = _up_np(logits)
    rows = np.arange(n)
    if is_grad:
        g = _softmax_np(la, (-1,))
        g[rows, labels] -= 1.0
        result: np.ndarray = (g / n).astype(logits.dtype)
        return result
    ls = _log_softmax_np(la, -1)
    return np.asarray(-np.mean(ls[rows, labels])).astype(logits.dtype)


def _sparse_sce_jax(logits: Any, labels: Any, is_grad: bool = False) -> Any:
    n, c = logits.shape
    la = _up_jax(logits)
    if is_grad:
        onehot = jax.nn.one_hot(labels, c, dtype=la.dtype)
        return ((_softmax_jax(la, (-1,)) - onehot) / n).astype(logits.dtype)
    ls = _log_softmax_jax(la, -1)
    picked = jnp.take_along_axis(ls, labels[:, None].astype(jnp.int32), axis=1)
    return (-jnp.mean(picked)).astype(logits.dtype)


def _sparse_sce_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    if node.attrs["is_grad"]:
        raise PcompileError(
            f"{node.where()}: SparseSoftmaxCrossEntropyWithLogits with is_grad=True (it "
            "returns a gradient) cannot be differentiated"
        )
    logits, labels = node.operands
    grad = b("SparseSoftmaxCrossEntropyWithLogits", logits, labels, is_grad=True)
    return [b("Mul", grad, cot), None]


def sparse_softmax_ce_labels(ctx: OpContext) -> Labels:
    return Labels(["nc", "n"], [""], {"c"}, mean=True)


def _sparse_sce_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    yield Same(In(0, 0), In(1, 0))
    yield Index(1, In(0, 1))
    for d in range(len(outs[0])):
        yield Same(In(0, d), Out(d))


define("SparseSoftmaxCrossEntropyWithLogits", _sparse_sce_infer, _sparse_sce_np, _sparse_sce_jax,
       vjp=_sparse_sce_vjp, attrs={"is_grad": False}, num_inputs=2,
       sharding=LabelRule(sparse_softmax_ce_labels, unsplittable="the class axis"),
       traits=frozenset({Trait.BATCH_ONLY}),
       doc="Mean over the batch of -log_softmax(logits)[i, labels[i]] (a scalar), for logits (N, "
           "C) and integer labels (N,) in [0, C). is_grad=True returns the gradient "
           "(softmax(logits) - one_hot(labels)) / N instead (MindSpore's bprop uses it). "
           "Out-of-range labels raise in the numpy impl and are unspecified under JAX.",
       section="linalg", operands="logits (N, C), int labels (N,) -> scalar mean", dtypes=FLOATS,
       rule="batch only",
       tests=("test_ops_nn.py::test_sparse_softmax_cross_entropy",
              "test_ops_nn.py::test_sparse_labels_out_of_range_rejected_by_numpy",
              "test_parallel.py::test_every_rule_matches_the_oracle"),
       dims=DimRule(_sparse_sce_dims))

# -- convolution / pooling geometry ---------------------------------------------------------


def _pair(value: Any, what: str) -> tuple[int, int]:
    """An int, a pair, or MindSpore's NCHW 4-tuple (1, 1, h, w) -> (h, w), all >= 1."""
    if _is_int(value):
        out = (int(value), int(value))
    elif isinstance(value, tuple) and len(value) == 2 and all(_is_int(v) for v in value):
        out = (int(value[0]), int(value[1]))
    elif (
        isinstance(value, tuple)
        and len(value) == 4
        and all(_is_int(v) for v in value)
        and value[:2] == (1, 1)
    ):
        out = (int(value[2]), int(value[3]))
    else:
        raise ShapeError(f"{what} must be an int or a tuple of 2 ints, got {value!r}")
    if min(out) < 1:
        raise ShapeError(f"{what} must be positive, got {value!r}")
    return out


def _pad4(value: Any) -> tuple[int, int, int, int]:
    if _is_int(value):
        value = (value,) * 4
    if not (isinstance(value, tuple) and len(value) == 4 and all(_is_int(v) for v in value)):
        raise ShapeError(
            f"pad must be an int or a tuple of 4 ints (top, bottom, left, right), got {value!r}"
        )
    if min(value) < 0:
        raise ShapeError(f"pad must be non-negative, got {value!r}")
    return (int(value[0]), int(value[1]), int(value[2]), int(value[3]))


def _check_nchw(data_format: Any) -> None:
    if data_format != "NCHW":
        raise ShapeError(
            f"data_format must be 'NCHW' (the only layout supported), got {data_format!r}"
        )


@dataclass(frozen=True)
class _Window:
    """Geometry of a 2-D sliding window over NCHW spatial dims."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    pads: tuple[tuple[int, int], tuple[int, int]]  # ((top, bottom), (left, right))
    out: tuple[int, int]

    @property
    def lax_padding(self) -> list[tuple[int, int]]:
        return [self.pads[0], self.pads[1]]


def _window(
    in_hw: tuple[int, ...],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    dilation: tuple[int, int],
    pad_mode: str,
    pad: tuple[int, int, int, int],
) -> _Window:
    pads: list[tuple[int, int]] = []
    out: list[int] = []
    for d in range(2):
        size, s = in_hw[d], stride[d]
        k_eff = dilation[d] * (kernel[d] - 1) + 1
        if pad_mode == "same":
            o = -(-size // s)
            need = max(0, (o - 1) * s + k_eff - size)
            lo, hi = need // 2, need - need // 2
        else:
            lo, hi = (pad[2 * d], pad[2 * d + 1]) if pad_mode == "pad" else (0, 0)
            if size + lo + hi < k_eff:
                which = "height" if d == 0 else "width"
                raise ShapeError(
                    f"the (dilated) kernel {which} {k_eff} exceeds the padded input {which} "
                    f"{size + lo + hi}"
                )
            o = (size + lo + hi - k_eff) // s + 1
        pads.append((lo, hi))
        out.append(o)
    return _Window(kernel, stride, dilation, (pads[0], pads[1]), (out[0], out[1]))


def _patches(xp: np.ndarray, win: _Window) -> np.ndarray:
    """(N, C, Hp, Wp) padded input -> (N, C, kh, kw, Ho, Wo) windows."""
    (kh, kw), (sh, sw), (dh, dw), (ho, wo) = win.kernel, win.stride, win.dilation, win.out
    n, c = xp.shape[:2]
    out = np.empty((n, c, kh, kw, ho, wo), xp.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            out[:, :, i, j] = xp[:, :, rows, cols]
    return out


def _unpatch(dpatch: np.ndarray, in_shape: tuple[int, ...], win: _Window) -> np.ndarray:
    """Transpose of `_patches` followed by cropping the padding: scatter-add windows back."""
    (kh, kw), (sh, sw), (dh, dw), (ho, wo) = win.kernel, win.stride, win.dilation, win.out
    (pt, pb), (pl, pr) = win.pads
    n, c, h, w = in_shape
    dxp = np.zeros((n, c, h + pt + pb, w + pl + pr), dpatch.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            dxp[:, :, rows, cols] += dpatch[:, :, i, j]
    return dxp[:, :, pt : pt + h, pl : pl + w]


def _pad_np(x: np.ndarray, win: _Window, value: float = 0.0) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, 0), win.pads[0], win.pads[1]), constant_values=value)


# -- Conv2D ---------------------------------------------------------------------------------

_CONV_DEFAULTS: dict[str, Any] = {
    "out_channel": 1,
    "kernel_size": (1, 1),
    "mode": 1,
    "pad_mode": "valid",
    "pad": (0, 0, 0, 0),
    "stride": (1, 1),
    "dilation": (1, 1),
    "group": 1,
    "data_format": "NCHW",
}


@dataclass(frozen=True)
class _ConvSpec:
    win: _Window
    group: int


def _conv_spec(
    x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]
) -> _ConvSpec:
    """Validate Conv2D's attrs and operand shapes (x NCHW, w OIHW); ShapeError when wrong."""
    _check_nchw(attrs["data_format"])
    if attrs["mode"] != 1:
        raise ShapeError(f"mode must be 1 (cross-correlation), got {attrs['mode']!r}")
    if len(x_shape) != 4:
        raise ShapeError(f"x must have rank 4 (N, C, H, W), got shape {x_shape}")
    if len(w_shape) != 4:
        raise ShapeError(f"weight must have rank 4 (out_c, in_c/group, kh, kw), got {w_shape}")
    kernel = _pair(attrs["kernel_size"], "kernel_size")
    stride = _pair(attrs["stride"], "stride")
    dilation = _pair(attrs["dilation"], "dilation")
    pad = _pad4(attrs["pad"])
    pad_mode = attrs["pad_mode"]
    if not isinstance(pad_mode, str) or pad_mode.lower() not in ("valid", "same", "pad"):
        raise ShapeError(f"pad_mode must be 'valid', 'same' or 'pad', got {pad_mode!r}")
    pad_mode = pad_mode.lower()
    if pad_mode != "pad" and pad != (0, 0, 0, 0):
        raise ShapeError(f"pad must be 0 when pad_mode is {pad_mode!r}, got {attrs['pad']!r}")
    group, out_c = attrs["group"], attrs["out_channel"]
    if not _is_int(group) or group < 1:
        raise ShapeError(f"group must be a positive int, got {group!r}")
    if not _is_int(out_c) or out_c < 1:
        raise ShapeError(f"out_channel must be a positive int, got {out_c!r}")
    c_in = x_shape[1]
    if c_in % group or out_c % group:
        raise ShapeError(
            f"input channels {c_in} and out_channel {out_c} must both divide by group {group}"
        )
    want_w = (out_c, c_in // group, kernel[0], kernel[1])
    if tuple(w_shape) != want_w:
        raise ShapeError(
            f"weight shape {w_shape} must be (out_channel, in_channels/group, kh, kw) = {want_w} "
            f"for x {x_shape}, out_channel {out_c}, group {group}, kernel_size {kernel}"
        )
    win = _window(x_shape[2:], kernel, stride, dilation, pad_mode, pad)
    return _ConvSpec(win, group)


def _conv_out_shape(x_shape: tuple[int, ...], spec: _ConvSpec, out_c: int) -> tuple[int, ...]:
    return (x_shape[0], out_c, spec.win.out[0], spec.win.out[1])


def _conv_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x, w = _float_tensor(types[0], "x"), _float_tensor(types[1], "weight")
    same_dtype([x, w])
    spec = _conv_spec(x.shape, w.shape, attrs)
    return x.with_shape(_conv_out_shape(x.shape, spec, attrs["out_channel"]))


def _grouped_patches(x: np.ndarray, spec: _ConvSpec) -> np.ndarray:
    """(N, G, C/G, kh, kw, Ho, Wo) windows of the zero-padded input."""
    p = _patches(_pad_np(x, spec.win), spec.win)
    n, c = p.shape[:2]
    return p.reshape((n, spec.group, c // spec.group) + p.shape[2:])


def _conv_np(x: np.ndarray, w: np.ndarray, **attrs: Any) -> np.ndarray:
    spec = _conv_spec(x.shape, w.shape, attrs)
    g = spec.group
    p = _grouped_patches(_up_np(x), spec)
    wg = _up_np(w).reshape((g, w.shape[0] // g) + w.shape[1:])
    y = np.einsum("ngckhxy,gockh->ngoxy", p, wg, optimize=True)
    result: np.ndarray = y.reshape((x.shape[0], w.shape[0]) + y.shape[3:]).astype(x.dtype)
    return result


def _conv_jax_fn(spec: _ConvSpec) -> Any:
    def conv(x: Any, w: Any) -> Any:
        # The padding is applied by jnp.pad, not by the convolution: JAX 0.10's transpose of a
        # padded convolution is wrong when a pad reaches the kernel size (pad (1, 1, 2, 0),
        # kernel 2x2: tests/ir/test_ops_nn.py), while the transpose of a pad is exact.
        xp = jnp.pad(x, ((0, 0), (0, 0), spec.win.pads[0], spec.win.pads[1]))
        return lax.conv_general_dilated(
            xp,
            w,
            window_strides=spec.win.stride,
            padding="VALID",
            rhs_dilation=spec.win.dilation,
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
            feature_group_count=spec.group,
            precision=lax.Precision.HIGHEST,
        )

    return conv


def _conv_jax(x: Any, w: Any, **attrs: Any) -> Any:
    return _conv_jax_fn(_conv_spec(x.shape, w.shape, attrs))(x, w)


def _conv_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: attrs[k] for k in _CONV_DEFAULTS}


def _conv_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, w = node.operands
    attrs = _conv_attrs(node.attrs)
    dx = b("Conv2DBackpropInput", cot, w, input_size=x.shape, **attrs)
    dw = b("Conv2DBackpropFilter", cot, x, filter_size=w.shape, **attrs)
    return [dx, dw]


def conv2d_labels(ctx: OpContext) -> Labels:
    # x: n c h w; w: o c p q -> out: n o y z (spatial and kernel dims are not split)
    return Labels(["nchw", "ocpq"], ["noyz"], {"h", "w", "p", "q", "y", "z"})


class Conv2DRule(LabelRule):
    """Conv2D's labels, and the local op's out_channel: the weight's output channels over
    their split."""

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        result = super().apply(ctx, strategy, out_strategy)
        result.local_attrs["out_channel"] = ctx.out_types[0].shape[1] // strategy[1][0]
        return result


define("Conv2D", _conv_infer, _conv_np, _conv_jax, vjp=_conv_vjp, attrs=dict(_CONV_DEFAULTS),
       num_inputs=2, sharding=Conv2DRule(conv2d_labels, unsplittable="a spatial or kernel dim"),
       doc="2-D cross-correlation, x (N, C, H, W), weight (out_channel, C/group, kh, kw). pad_mode "
           "'valid' | 'same' (TF-style, extra padding at the bottom/right) | 'pad' (explicit pad = "
           "(top, bottom, left, right)). stride/dilation: int, pair, or MindSpore's (1, 1, h, w).",
       section="conv",
       operands="x NCHW, weight; `out_channel`, `kernel_size`, `pad_mode`, `pad`, `stride`, "
                "`dilation`, `group`", dtypes=FLOATS,
       rule="batch, out channels and in channels (all-reduced) split; spatial dims never",
       tests=("test_ops_nn.py::test_conv2d", "test_ops_nn.py::test_conv2d_mindspore_style_attrs",
              "test_parallel.py::test_every_rule_matches_the_oracle"))


def _size4(value: Any, what: str) -> tuple[int, int, int, int]:
    if not (isinstance(value, tuple) and len(value) == 4 and all(_is_int(v) for v in value)):
        raise ShapeError(f"{what} must be a tuple of 4 ints, got {value!r}")
    return (int(value[0]), int(value[1]), int(value[2]), int(value[3]))


def _check_dout(dout: TensorType, want: tuple[int, ...]) -> None:
    if dout.shape != want:
        raise ShapeError(f"dout shape {dout.shape} must equal the Conv2D output shape {want}")


def _bp_input_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dout, w = _float_tensor(types[0], "dout"), _float_tensor(types[1], "weight")
    same_dtype([dout, w])
    x_shape = _size4(attrs["input_size"], "input_size")
    spec = _conv_spec(x_shape, w.shape, attrs)
    _check_dout(dout, _conv_out_shape(x_shape, spec, attrs["out_channel"]))
    return dout.with_shape(x_shape)


def _bp_input_np(dout: np.ndarray, w: np.ndarray, **attrs: Any) -> np.ndarray:
    x_shape = _size4(attrs["input_size"], "input_size")
    spec = _conv_spec(x_shape, w.shape, attrs)
    g, n = spec.group, dout.shape[0]
    dg = _up_np(dout).reshape((n, g, dout.shape[1] // g) + dout.shape[2:])
    wg = _up_np(w).reshape((g, w.shape[0] // g) + w.shape[1:])
    dp = np.einsum("ngoxy,gockh->ngckhxy", dg, wg, optimize=True)
    dp = dp.reshape((n, x_shape[1]) + dp.shape[3:])
    return _unpatch(dp, x_shape, spec.win).astype(dout.dtype)


def _bp_input_jax(dout: Any, w: Any, **attrs: Any) -> Any:
    x_shape = _size4(attrs["input_size"], "input_size")
    conv = _conv_jax_fn(_conv_spec(x_shape, w.shape, attrs))
    transpose = jax.linear_transpose(
        lambda x: conv(x, w), jax.ShapeDtypeStruct(x_shape, dout.dtype)
    )
    return transpose(dout)[0]


grad_helper("Conv2DBackpropInput", _bp_input_infer, _bp_input_np, _bp_input_jax,
            attrs={**_CONV_DEFAULTS, "input_size": (1, 1, 1, 1)},
            doc="Conv2DBackpropInput(dout, weight): d Conv2D / d x, x of shape input_size.",
            grad_of="Conv2D", operands="dy, weight; `input_size` and Conv2D's attributes",
            dtypes=FLOATS, section="conv", tests=("test_ops_nn.py::test_conv2d_backprop_ops",))


def _bp_filter_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dout, x = _float_tensor(types[0], "dout"), _float_tensor(types[1], "x")
    same_dtype([dout, x])
    w_shape = _size4(attrs["filter_size"], "filter_size")
    spec = _conv_spec(x.shape, w_shape, attrs)
    _check_dout(dout, _conv_out_shape(x.shape, spec, attrs["out_channel"]))
    return dout.with_shape(w_shape)


def _bp_filter_np(dout: np.ndarray, x: np.ndarray, **attrs: Any) -> np.ndarray:
    w_shape = _size4(attrs["filter_size"], "filter_size")
    spec = _conv_spec(x.shape, w_shape, attrs)
    g, n = spec.group, dout.shape[0]
    p = _grouped_patches(_up_np(x), spec)
    dg = _up_np(dout).reshape((n, g, dout.shape[1] // g) + dout.shape[2:])
    dw = np.einsum("ngoxy,ngckhxy->gockh", dg, p, optimize=True)
    result: np.ndarray = dw.reshape(w_shape).astype(dout.dtype)
    return result


def _bp_filter_jax(dout: Any, x: Any, **attrs: Any) -> Any:
    w_shape = _size4(attrs["filter_size"], "filter_size")
    conv = _conv_jax_fn(_conv_spec(x.shape, w_shape, attrs))
    transpose = jax.linear_transpose(
        lambda w: conv(x, w), jax.ShapeDtypeStruct(w_shape, dout.dtype)
    )
    return transpose(dout)[0]


grad_helper("Conv2DBackpropFilter", _bp_filter_infer, _bp_filter_np, _bp_filter_jax,
            attrs={**_CONV_DEFAULTS, "filter_size": (1, 1, 1, 1)},
            doc="Conv2DBackpropFilter(dout, x): d Conv2D / d weight, weight of shape filter_size.",
            grad_of="Conv2D", operands="dy, x; `filter_size` and Conv2D's attributes",
            dtypes=FLOATS, section="conv", tests=("test_ops_nn.py::test_conv2d_backprop_ops",))

# -- MaxPool / AvgPool ----------------------------------------------------------------------

_POOL_DEFAULTS: dict[str, Any] = {
    "kernel_size": (1, 1),
    "strides": (1, 1),
    "pad_mode": "VALID",
    "data_format": "NCHW",
}


def _pool_window(x_shape: tuple[int, ...], attrs: dict[str, Any]) -> _Window:
    _check_nchw(attrs["data_format"])
    if len(x_shape) != 4:
        raise ShapeError(f"x must have rank 4 (N, C, H, W), got shape {x_shape}")
    pad_mode = attrs["pad_mode"]
    if not isinstance(pad_mode, str) or pad_mode.upper() not in ("VALID", "SAME"):
        raise ShapeError(f"pad_mode must be 'VALID' or 'SAME', got {pad_mode!r}")
    kernel = _pair(attrs["kernel_size"], "kernel_size")
    strides = _pair(attrs["strides"], "strides")
    return _window(x_shape[2:], kernel, strides, (1, 1), pad_mode.lower(), (0, 0, 0, 0))


def _pool_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = _float_tensor(types[0], "x")
    win = _pool_window(x.shape, attrs)
    return x.with_shape(x.shape[:2] + win.out)


def _pool_grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = _float_tensor(types[0], "x")
    y, dy = _float_tensor(types[1], "y"), _float_tensor(types[2], "dy")
    same_dtype([x, y, dy])
    win = _pool_window(x.shape, attrs)
    want = x.shape[:2] + win.out
    for name, t in (("y", y), ("dy", dy)):
        if t.shape != want:
            raise ShapeError(f"{name} shape {t.shape} must equal the pooled shape {want}")
    return x


def _reduce_window_args(win: _Window) -> dict[str, Any]:
    return {
        "window_dimensions": (1, 1) + win.kernel,
        "window_strides": (1, 1) + win.stride,
        "padding": [(0, 0), (0, 0), win.pads[0], win.pads[1]],
    }


def _maxpool_np(x: np.ndarray, **attrs: Any) -> np.ndarray:
    win = _pool_window(x.shape, attrs)
    result: np.ndarray = _patches(_pad_np(x, win, -np.inf), win).max(axis=(2, 3))
    return result


def _maxpool_jax_fn(win: _Window) -> Any:
    def pool(x: Any) -> Any:
        # A concrete init value lets JAX recognise (and differentiate) the max monoid.
        init = np.array(-np.inf, x.dtype)
        return lax.reduce_window(x, init, lax.max, **_reduce_window_args(win))

    return pool


def _maxpool_jax(x: Any, **attrs: Any) -> Any:
    return _maxpool_jax_fn(_pool_window(x.shape, attrs))(x)


def _pool_vjp(grad_op: str) -> Any:
    def vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
        (x,) = node.operands
        attrs = {k: node.attrs[k] for k in _POOL_DEFAULTS}
        return [b(grad_op, x, node.result, cot, **attrs)]

    return vjp


def pool_labels(ctx: OpContext) -> Labels:
    return Labels(["nchw"], ["ncyz"], {"h", "w", "y", "z"})


define("MaxPool", _pool_infer, _maxpool_np, _maxpool_jax, vjp=_pool_vjp("MaxPoolGrad"),
       attrs=dict(_POOL_DEFAULTS), num_inputs=1,
       sharding=LabelRule(pool_labels, unsplittable="a spatial dim"),
       doc="2-D max pooling over NCHW; 'SAME' pads with -inf (TF-style placement).", section="conv",
       operands="x NCHW; `kernel_size`, `strides`, `pad_mode`", dtypes=FLOATS,
       rule="batch and channels",
       tests=("test_ops_nn.py::test_max_pool",
              "test_parallel.py::test_every_rule_matches_the_oracle"))


def _maxpool_grad_np(x: np.ndarray, y: np.ndarray, dy: np.ndarray, **attrs: Any) -> np.ndarray:
    win = _pool_window(x.shape, attrs)
    p = _patches(_pad_np(x, win, -np.inf), win)
    n, c, kh, kw, ho, wo = p.shape
    # First maximum in row-major window order, like XLA's select_and_scatter_add (ge).
    idx = np.argmax(p.reshape(n, c, kh * kw, ho, wo), axis=2)
    mask = np.arange(kh * kw)[None, None, :, None, None] == idx[:, :, None]
    dp = np.where(mask, dy[:, :, None], np.zeros((), dy.dtype)).reshape(p.shape)
    return _unpatch(dp, x.shape, win)


def _maxpool_grad_jax(x: Any, y: Any, dy: Any, **attrs: Any) -> Any:
    _, pullback = jax.vjp(_maxpool_jax_fn(_pool_window(x.shape, attrs)), x)
    return pullback(dy)[0]


grad_helper("MaxPoolGrad", _pool_grad_infer, _maxpool_grad_np, _maxpool_grad_jax,
            attrs=dict(_POOL_DEFAULTS), num_inputs=3,
            doc="MaxPoolGrad(x, y, dy): routes each dy to the first maximum of its window "
                "(row-major order), summing over overlapping windows.", grad_of="MaxPool",
            operands="x, y, dy", dtypes=FLOATS, section="conv",
            tests=("test_ops_nn.py::test_vjps_use_dedicated_grad_ops",))


def _avg_counts_np(x_shape: tuple[int, ...], win: _Window) -> np.ndarray:
    """(Ho, Wo) number of non-padding elements in each window."""
    ones = np.ones((1, 1) + tuple(x_shape[2:]), np.float32)
    result: np.ndarray = _patches(_pad_np(ones, win), win).sum(axis=(2, 3))[0, 0]
    return result


def _avgpool_np(x: np.ndarray, **attrs: Any) -> np.ndarray:
    win = _pool_window(x.shape, attrs)
    s = _patches(_pad_np(_up_np(x), win), win).sum(axis=(2, 3))
    result: np.ndarray = (s / _avg_counts_np(x.shape, win)).astype(x.dtype)
    return result


def _avgpool_jax_fn(win: _Window, x_shape: tuple[int, ...]) -> Any:
    counts = _avg_counts_np(x_shape, win)

    def pool(x: Any) -> Any:
        xa = _up_jax(x)
        s = lax.reduce_window(xa, np.array(0, xa.dtype), lax.add, **_reduce_window_args(win))
        return (s / jnp.asarray(counts, xa.dtype)).astype(x.dtype)

    return pool


def _avgpool_jax(x: Any, **attrs: Any) -> Any:
    return _avgpool_jax_fn(_pool_window(x.shape, attrs), x.shape)(x)


define("AvgPool", _pool_infer, _avgpool_np, _avgpool_jax, vjp=_pool_vjp("AvgPoolGrad"),
       attrs=dict(_POOL_DEFAULTS), num_inputs=1,
       sharding=LabelRule(pool_labels, unsplittable="a spatial dim"),
       doc="2-D average pooling over NCHW. With 'SAME' the divisor counts only the non-padding "
           "elements of each window (TF / cuDNN exclude-padding semantics).", section="conv",
       operands="x NCHW; `kernel_size`, `strides`, `pad_mode`", dtypes=FLOATS,
       rule="batch and channels",
       tests=("test_ops_nn.py::test_avg_pool",
              "test_parallel.py::test_every_rule_matches_the_oracle"))


def _avgpool_grad_np(x: np.ndarray, y: np.ndarray, dy: np.ndarray, **attrs: Any) -> np.ndarray:
    win = _pool_window(x.shape, attrs)
    per = _up_np(dy) / _avg_counts_np(x.shape, win)
    n, c, ho, wo = dy.shape
    dp = np.broadcast_to(per[:, :, None, None], (n, c) + win.kernel + (ho, wo))
    return _unpatch(np.ascontiguousarray(dp), x.shape, win).astype(x.dtype)


def _avgpool_grad_jax(x: Any, y: Any, dy: Any, **attrs: Any) -> Any:
    _, pullback = jax.vjp(_avgpool_jax_fn(_pool_window(x.shape, attrs), x.shape), x)
    return pullback(dy)[0]


grad_helper("AvgPoolGrad", _pool_grad_infer, _avgpool_grad_np, _avgpool_grad_jax,
            attrs=dict(_POOL_DEFAULTS), num_inputs=3,
            doc="AvgPoolGrad(x, y, dy): spreads dy / window count over each window (x, y: shapes).",
            grad_of="AvgPool", operands="x, y, dy", dtypes=FLOATS, section="conv",
            tests=("test_ops_nn.py::test_vjps_use_dedicated_grad_ops",))
