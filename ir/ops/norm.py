"""RmsNorm (MindSpore's `ops.RmsNorm`) with its gradient helper RmsNormGrad, and LpNorm
(MindSpore's `ops.LpNorm`).

`RmsNorm(x, gamma)` normalises over the trailing `gamma.ndim` dims of x:
rstd = 1 / sqrt(mean(x**2) + epsilon) (float32, shape x.shape[:-k] + (1,) * k) and
y = x * rstd * gamma (x's dtype). 16-bit inputs are computed in float32 and y is rounded once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Node, ParallelInfo, Value
from pcompile.ir.dims import DimRule, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define, grad_helper
from pcompile.ir.ops._jax import jnp, lax
from pcompile.ir.ops._util import is_zero, same_dtype, tensor, tuple_type
from pcompile.ir.ops.elementwise import sign_of
from pcompile.ir.ops.reduce import reduce_axes
from pcompile.ir.registry import FLOATS
from pcompile.ir.sharding import (
    ALPHA,
    Expansion,
    LabelRule,
    Labels,
    LocalLowering,
    OpContext,
    OpSharding,
    Strategy,
    fresh_labels,
    label_sharding,
    reduce_labels,
)
from pcompile.ir.types import DType, TensorType, ValueType

_DEFAULTS: dict[str, Any] = {"epsilon": 1e-6}


def _check_epsilon(attrs: dict[str, Any]) -> float:
    eps = attrs["epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps <= 1:
        raise ShapeError(f"epsilon must be a float in (0, 1], got {eps!r}")
    return float(eps)


def _check_operands(x: TensorType, gamma: TensorType) -> int:
    """The number k of normalised (trailing) dims; ShapeError when x and gamma do not fit."""
    if not x.dtype.is_float:
        raise ShapeError(f"x must be a floating-point tensor, got {x.dtype.value}")
    same_dtype([x, gamma])
    k = gamma.rank
    if k == 0 or k > x.rank or x.shape[x.rank - k:] != gamma.shape:
        raise ShapeError(
            f"gamma shape {gamma.shape} must equal the trailing dims of x {x.shape} (gamma "
            f"has rank 1..{x.rank}; it names the normalised dims)"
        )
    return k


def _rstd_shape(x: TensorType, k: int) -> tuple[int, ...]:
    return x.shape[: x.rank - k] + (1,) * k


def _infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x, gamma = tensor(types[0], "x"), tensor(types[1], "gamma")
    _check_epsilon(attrs)
    k = _check_operands(x, gamma)
    return tuple_type(x, TensorType(DType.float32, _rstd_shape(x, k)))


def _forward(xp: Any, x: Any, gamma: Any, eps: float) -> tuple[Any, Any]:
    """(y, rstd) with the array module `xp`; x and gamma already float32."""
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    rstd = 1.0 / xp.sqrt(xp.mean(x * x, axis=axes, keepdims=True) + eps)
    return x * rstd * gamma, rstd


def _wide(*arrays: np.ndarray) -> np.dtype:
    """At least float32 (16-bit inputs are computed in float32; float64, e.g. the oracle's
    float64 evaluation, stays float64)."""
    return np.result_type(np.float32, *(a.dtype for a in arrays))


def _rms_norm_np(x: np.ndarray, gamma: np.ndarray, epsilon: float) -> tuple[np.ndarray, ...]:
    wide = _wide(x, gamma)
    y, rstd = _forward(np, x.astype(wide), gamma.astype(wide), float(epsilon))
    return y.astype(x.dtype), rstd.astype(np.result_type(np.float32, x.dtype))


def _rms_norm_jax(x: Any, gamma: Any, epsilon: float) -> tuple[Any, Any]:
    xa, ga = (a.astype(jnp.result_type(jnp.float32, x, gamma)) for a in (x, gamma))
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    rstd = lax.rsqrt(jnp.mean(xa * xa, axis=axes, keepdims=True) + float(epsilon))
    return (xa * rstd * ga).astype(x.dtype), rstd


def _rms_norm_vjp(b: Builder, node: Node, cot: list[Value]) -> list[Value | None]:
    x, gamma = node.operands
    rstd = b("TupleGetItem", node.result, index=1)
    grads = b("RmsNormGrad", cot[0], x, rstd, gamma)
    dx = b("TupleGetItem", grads, index=0)
    dgamma = b("TupleGetItem", grads, index=1)
    if not is_zero(cot[1]):
        # rstd is used too: d rstd / dx = -rstd**3 * x / n (MindSpore's bprop drops this term;
        # it is zero unless the program reads rstd).
        n = int(np.prod(gamma.shape))
        x32 = b("Cast", x, dst_type=DType.float32)
        cube = b("Mul", rstd, b("Mul", rstd, rstd))
        extra = b("Mul", b("Mul", cot[1], cube), b("Mul", x32, -1.0 / n))
        dx = b("Add", dx, b("Cast", extra, dst_type=x.dtype))
    return [dx, dgamma]


_RMS_NORM_NOTE = """\
`RmsNorm` is MindSpore's: it normalises over the trailing `gamma.ndim` dims of x;
rstd = 1 / sqrt(mean(x**2) + epsilon) is Float32 with those dims kept as 1 (`(B, S, 1)` for x
`(B, S, H)`), y = x * rstd * gamma has x's dtype (x and gamma share a dtype). The strategy is
mindformers' `norm.shard(((dp, 1, 1), (1,)))`. Its gradient helper `RmsNormGrad(dy, x, rstd,
gamma) -> (dx, dgamma)` takes MindSpore's operands; when the program also reads rstd in a
differentiated computation, its contribution is added (MindSpore's bprop drops it)."""

def rms_norm_labels(ctx: OpContext) -> Labels:
    """x's trailing gamma.ndim dims are normalised (never split); gamma shares their labels;
    rstd keeps x's leading labels and size-1 normalised dims (MindSpore's rms_norm_info)."""
    x, gamma = ctx.in_types
    lab = ALPHA[: x.rank]
    begin = x.rank - gamma.rank
    fresh = "".join(fresh_labels(gamma.rank, set(lab)))
    return Labels([lab, lab[begin:]], [lab, lab[:begin] + fresh], set(lab[begin:]) | set(fresh))


def _rms_norm_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """y is x; rstd keeps x's leading dims; gamma is x's trailing dims."""
    x, gamma = ins[0][0], ins[1][0]
    lead = len(x) - len(gamma)
    for d in range(len(x)):
        yield Same(In(0, d), Out(d, 0))
        if d < lead:
            yield Same(In(0, d), Out(d, 1))
        else:
            yield Same(In(1, d - lead), In(0, d))


define("RmsNorm", _infer, _rms_norm_np, _rms_norm_jax, vjp=_rms_norm_vjp, attrs=dict(_DEFAULTS),
       num_inputs=2,
       sharding=LabelRule(rms_norm_labels, unsplittable="a normalised dim (one of gamma's dims; "
                          "gamma is never split)"),
       doc="(y, rstd): rstd = 1/sqrt(mean(x**2) + epsilon) over the trailing gamma.ndim dims "
           "(Float32, those dims kept as 1), y = x * rstd * gamma.", section="linalg",
       operands="x, gamma; `epsilon` (default 1e-6) -> (y, rstd)", dtypes=FLOATS,
       rule="x splits only before the normalised (gamma's) dims; gamma never",
       tests=("test_ops_nn.py::test_rms_norm",
              "test_ops_nn.py::test_rms_norm_default_epsilon_and_grad_op",
              "test_parallel_ops.py::test_rule_matches_the_oracle",
              "test_mindformers_ops.py::test_rms_norm_as_llama_calls_it_trains_like_one_device"),
       note=_RMS_NORM_NOTE, dims=DimRule(_rms_norm_dims))

# -- RmsNormGrad ----------------------------------------------------------------------------


def _grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    dy, x = tensor(types[0], "dy"), tensor(types[1], "x")
    rstd, gamma = tensor(types[2], "rstd"), tensor(types[3], "gamma")
    k = _check_operands(x, gamma)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ShapeError(f"dy {dy} must have the type of x {x}")
    want = TensorType(DType.float32, _rstd_shape(x, k))
    if rstd != want:
        raise ShapeError(f"rstd must be {want} (RmsNorm's second output), got {rstd}")
    return tuple_type(x, gamma)


def _grad(xp: Any, dy: Any, x: Any, rstd: Any, gamma: Any) -> tuple[Any, Any]:
    """(dx, dgamma) of y = x * rstd * gamma; every array float32."""
    k = gamma.ndim
    norm_axes = tuple(range(x.ndim - k, x.ndim))
    xhat = x * rstd
    g = dy * gamma
    dx = rstd * (g - xhat * xp.mean(g * xhat, axis=norm_axes, keepdims=True))
    dgamma = xp.sum(dy * xhat, axis=tuple(range(x.ndim - k)))
    return dx, dgamma


def _grad_np(dy: np.ndarray, x: np.ndarray, rstd: np.ndarray, gamma: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    wide = _wide(dy, x, rstd, gamma)
    dx, dgamma = _grad(np, *(a.astype(wide) for a in (dy, x, rstd, gamma)))
    return dx.astype(x.dtype), np.asarray(dgamma).astype(gamma.dtype)


def _grad_jax(dy: Any, x: Any, rstd: Any, gamma: Any) -> tuple[Any, Any]:
    dx, dgamma = _grad(jnp, *(a.astype(jnp.result_type(jnp.float32, dy, x, rstd, gamma))
                              for a in (dy, x, rstd, gamma)))
    return dx.astype(x.dtype), dgamma.astype(gamma.dtype)


grad_helper("RmsNormGrad", _grad_infer, _grad_np, _grad_jax, num_inputs=4,
            doc="RmsNormGrad(dy, x, rstd, gamma) -> (dx, dgamma): the vjp of RmsNorm's y "
                "(MindSpore operand order).", grad_of="RmsNorm",
            operands="dy, x, rstd, gamma -> (dx, dgamma)", dtypes=FLOATS, section="linalg",
            tests=("test_ops_nn.py::test_rms_norm_default_epsilon_and_grad_op",))

# -- LpNorm ---------------------------------------------------------------------------------

_LP_DEFAULTS: dict[str, Any] = {"axis": (), "p": 2, "keep_dims": False, "epsilon": 1e-12}


def lp_norm_attrs(attrs: dict[str, Any], rank: int) -> tuple[tuple[int, ...], int, bool, float]:
    """(axes, p, keep_dims, epsilon) of an LpNorm, checked; ShapeError names what is wrong."""
    axes = reduce_axes(attrs["axis"], rank)
    p = attrs["p"]
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ShapeError(f"p must be an int >= 1 (the order of the norm), got {p!r}")
    keep = attrs["keep_dims"]
    if not isinstance(keep, bool):
        raise ShapeError(f"keep_dims must be a bool, got {keep!r}")
    eps = attrs["epsilon"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ShapeError(f"epsilon must be a float >= 0 (the smallest norm returned), got {eps!r}")
    return axes, p, keep, float(eps)


def _lp_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    if not x.dtype.is_float:
        raise ShapeError(f"x must be a floating-point tensor, got {x.dtype.value}")
    axes, _, keep, _ = lp_norm_attrs(attrs, x.rank)
    if keep:
        return x.with_shape(tuple(1 if i in axes else d for i, d in enumerate(x.shape)))
    return x.with_shape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def _lp_norm(xp: Any, x: Any, axes: tuple[int, ...], p: int, keep: bool, eps: float) -> Any:
    """max((sum |x|**p)**(1/p), eps) with the array module `xp`."""
    total = xp.sum(xp.abs(x) ** p, axis=axes, keepdims=keep)
    norm = total if p == 1 else (xp.sqrt(total) if p == 2 else total ** (1.0 / p))
    return xp.maximum(norm, eps)


def _lp_np(x: np.ndarray, axis: Any, p: int, keep_dims: bool, epsilon: float) -> np.ndarray:
    axes = reduce_axes(axis, x.ndim)
    out = _lp_norm(np, x.astype(_wide(x)), axes, int(p), bool(keep_dims), float(epsilon))
    return np.asarray(out).astype(x.dtype)


def _lp_jax(x: Any, axis: Any, p: int, keep_dims: bool, epsilon: float) -> Any:
    axes = reduce_axes(axis, x.ndim)
    wide = x.astype(jnp.float32) if x.dtype.itemsize < 4 else x
    return _lp_norm(jnp, wide, axes, int(p), bool(keep_dims), float(epsilon)).astype(x.dtype)


def _lp_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    """d ||x||_p / dx = sign(x) |x|**(p-1) / ||x||**(p-1) where the norm exceeds epsilon (0
    where epsilon replaced it)."""
    (x,) = node.operands
    axes, p, keep, eps = lp_norm_attrs(node.attrs, len(x.shape))
    norm: Value
    norm, grad = node.result, cot
    if not keep:
        kept = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
        norm, grad = b("Reshape", norm, shape=kept), b("Reshape", grad, shape=kept)
    if p == 1:
        direction = sign_of(b, x, x.dtype)
    elif p == 2:
        direction = b("RealDiv", x, norm)
    else:
        power = b("Pow", b("Abs", x), float(p - 2))
        direction = b("RealDiv", b("Mul", x, power), b("Pow", norm, float(p - 1)))
    zero = Constant(np.asarray(0.0), x.dtype)
    live = b("Greater", norm, Constant(np.asarray(eps), x.dtype))
    return [b("Select", live, b("Mul", grad, direction), zero)]


class _LpNormPartial(Expansion):
    """LpNorm with a split normalised dim: each rank sums |x|**p over its slice (in float32
    for 16-bit inputs), the forward AllReduce adds the ranks' sums, and the p-th root is taken
    of the total."""

    def emit(self, lower: LocalLowering, node: Node, b: Builder, operands: list[Value],
             attrs: dict[str, Any], info: ParallelInfo, sharding: OpSharding) -> Value:
        x = operands[0]
        if x.dtype.itemsize < 4:
            x = b.emit("Cast", [x], {"dst_type": DType.float32})
        powered = b.emit("Pow", [b.emit("Abs", [x]),
                                 Constant(np.asarray(float(attrs["p"])), x.dtype)])
        return b.emit("ReduceSum", [powered],
                      {"axis": attrs["axis"], "keep_dims": attrs["keep_dims"]},
                      instance_name=node.instance_name, name_hint=node.result.name_hint,
                      parallel=ParallelInfo(
                          in_strategy=info.in_strategy,
                          reason=f"LpNorm '{node.instance_name}' splits a normalised dim: "
                                 "each rank sums |x|**p over its slice"))

    def finish(self, node: Node, b: Builder, out: Value, attrs: dict[str, Any]) -> Value:
        """The p-th root of the all-reduced sum, floored at epsilon, in the op's dtype. The
        root is taken of a positive sum only (Select), so that a zero norm gets a zero
        gradient, not 0 * inf; p > 2 takes exp(log(sum) / p): 1/p is not exact in the
        tensor's dtype, p is."""
        total = out
        p = int(attrs["p"])
        root = total
        if p > 1:
            zero = Constant(np.asarray(0.0), total.dtype)
            positive = b.emit("Greater", [total, zero])
            safe = b.emit("Select", [positive, total, Constant(np.asarray(1.0), total.dtype)])
            if p == 2:
                root = b.emit("Sqrt", [safe])
            else:
                scaled = b.emit("RealDiv", [b.emit("Log", [safe]),
                                            Constant(np.asarray(float(p)), total.dtype)])
                root = b.emit("Exp", [scaled])
            root = b.emit("Select", [positive, root, zero])
        result = b.emit("Maximum", [root, Constant(np.asarray(float(attrs["epsilon"])),
                                                   total.dtype)])
        dtype = node.result.dtype
        return result if result.dtype == dtype else b.emit("Cast", [result], {"dst_type": dtype})


LP_NORM_PARTIAL = _LpNormPartial()


class LpNormRule(LabelRule):
    """LpNorm: reduction labels (every dim may split). A split normalised dim leaves partial
    sums: each rank computes sum |x|**p over its slice, the forward AllReduce adds them and
    the root and the epsilon floor follow (expand "lp_norm_partial")."""

    def __init__(self) -> None:
        super().__init__(reduce_labels("sum"))

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        result = label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        if result.forward:
            result.expand = LP_NORM_PARTIAL
        return result


define("LpNorm", _lp_infer, _lp_np, _lp_jax, vjp=_lp_vjp, attrs=dict(_LP_DEFAULTS), num_inputs=1,
       sharding=LpNormRule(),
       doc="max((sum over `axis` of |x|**p)**(1/p), epsilon) (MindSpore `ops.LpNorm(axis, p=2, "
           "keep_dims=False, epsilon=1e-12)`; p an int >= 1; `axis` () = all). 16-bit inputs are "
           "computed in float32 and rounded once. The gradient is sign(x) |x|**(p-1) / "
           "norm**(p-1), 0 where epsilon replaced the norm.", section="linalg",
       operands="x; `axis`, `p`, `keep_dims`, `epsilon`", dtypes=FLOATS,
       rule="every dim may split; a split normalised dim sums |x|**p per rank, all-reduces, then "
            "takes the root",
       tests=("test_ops_lp_norm.py::test_lp_norm",
              "test_ops_lp_norm.py::test_lp_norm_mindspore_example",
              "test_ops_lp_norm.py::test_lp_norm_split_normalised_dims",
              "test_ops_lp_norm.py::test_lp_norm_split_emits_partial_sum_and_all_reduce",
              "test_parallel_ops.py::test_rule_matches_the_oracle"))
