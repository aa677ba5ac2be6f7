"""`Depend(value, expr)`: `value`, once `expr` has been computed (MindSpore's Depend).

MindSpore scripts use it to order side effects (`loss = F.depend(loss, self.optimizer(grads))`)
and to keep a computation alive; the recompute pass uses it to hold a recomputed region back
until the backward pass reaches it. The numpy implementation returns `value`; the JAX one passes
both through `lax.optimization_barrier`, which is how XLA is told that `value` is used only after
`expr` exists (and that the two may not be merged with an identical computation elsewhere).

Gradient: `value`'s cotangent passes through, `expr` gets none (MindSpore's bprop gives it
zeros). Sharding: no strategy of its own (MindSpore has no operator info for Depend); the
output takes `value`'s layout and `expr` is never redistributed (`passes.step_parallel`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax import lax

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.errors import ShapeError
from pcompile.ir.registry import OpDef, register
from pcompile.ir.types import TensorType, ValueType


def _depend_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    if not isinstance(types[0], TensorType):
        raise ShapeError(f"value (operand 0) must be a tensor, got {types[0]}")
    return types[0]


def _depend_np(value: Any, expr: Any) -> Any:
    return np.array(value, copy=True)


def _depend_jax(value: Any, expr: Any) -> Any:
    return lax.optimization_barrier((value, expr))[0]


def _depend_vjp(b: Builder, node: Node, cot: Any) -> list[Value | None]:
    return [cot, None]


register(
    OpDef(
        "Depend",
        _depend_infer,
        numpy=_depend_np,
        jax=_depend_jax,
        vjp=_depend_vjp,
        num_inputs=2,
        doc="value, computed after expr (an ordering edge; no strategy, value's layout).",
    )
)
