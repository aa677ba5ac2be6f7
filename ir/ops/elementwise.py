"""Element-wise primitives (numpy broadcasting) and the small ops their vjps need."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ir.builder import Builder
from ir.core import Node, Value
from ir.ops._util import infer_binary, infer_unary, unbroadcast
from ir.registry import OpDef, register

# -- Add ------------------------------------------------------------------------------------


def _add_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    return [unbroadcast(b, cot, x.shape), unbroadcast(b, cot, y.shape)]


register(
    OpDef(
        "Add",
        infer_binary,
        numpy=lambda x, y: np.add(x, y),
        jax=lambda x, y: jnp.add(x, y),
        vjp=_add_vjp,
        num_inputs=2,
        doc="x + y with broadcasting.",
    )
)

# -- Mul ------------------------------------------------------------------------------------


def _mul_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    x, y = node.operands
    return [unbroadcast(b, b("Mul", cot, y), x.shape), unbroadcast(b, b("Mul", cot, x), y.shape)]


register(
    OpDef(
        "Mul",
        infer_binary,
        numpy=lambda x, y: np.multiply(x, y),
        jax=lambda x, y: jnp.multiply(x, y),
        vjp=_mul_vjp,
        num_inputs=2,
        doc="x * y with broadcasting.",
    )
)

# -- ReLU -----------------------------------------------------------------------------------


def _relu_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("ReluGrad", cot, node.result)]


register(
    OpDef(
        "ReLU",
        infer_unary,
        numpy=lambda x: np.maximum(x, np.zeros((), x.dtype)),
        jax=lambda x: jnp.maximum(x, jnp.zeros((), x.dtype)),
        vjp=_relu_vjp,
        num_inputs=1,
        doc="max(x, 0).",
    )
)


def _relu_grad_np(dy: Any, y: Any) -> Any:
    return np.where(y > 0, dy, np.zeros((), dy.dtype))


def _relu_grad_jax(dy: Any, y: Any) -> Any:
    return jnp.where(y > 0, dy, jnp.zeros((), dy.dtype))


register(
    OpDef(
        "ReluGrad",
        infer_binary,
        numpy=_relu_grad_np,
        jax=_relu_grad_jax,
        num_inputs=2,
        differentiable=False,
        doc="dy where y > 0 else 0 (y is ReLU's output).",
    )
)
