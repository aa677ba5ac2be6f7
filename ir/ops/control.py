"""`Depend(value, expr)`: `value`, once `expr` has been computed (MindSpore's Depend).

MindSpore scripts use it to order side effects (`loss = F.depend(loss, self.optimizer(grads))`)
and to keep a computation alive; the recompute pass uses it to hold a recomputed region back
until the backward pass reaches it. The numpy implementation returns `value`. The JAX one must
make XLA see a real data dependency, which neither its simplifier nor its common-subexpression
elimination can remove: a float `value` becomes `value - 0 * |s|`, s one element of `expr` (0
where it is not finite), which is `value` exactly (x - (+0) = x for every x, -0 included);
other dtypes go through `lax.optimization_barrier`. (An optimization barrier alone is what
`jax.checkpoint` uses, but XLA's CPU pipeline expands barriers before it eliminates common
subexpressions, so a recomputation would be merged back into the forward pass there.)

Gradient: `value`'s cotangent passes through, `expr` gets none (MindSpore's bprop gives it
zeros). Sharding: no strategy of its own (MindSpore has no operator info for Depend); the
output takes `value`'s layout and `expr` is never redistributed (`passes.step_parallel`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, In, Out, Same
from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define
from pcompile.ir.ops._jax import jnp, lax
from pcompile.ir.registry import ALL, Trait
from pcompile.ir.types import TensorType, ValueType


def _depend_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    if not isinstance(types[0], TensorType):
        raise ShapeError(f"value (operand 0) must be a tensor, got {types[0]}")
    return types[0]


def _depend_np(value: Any, expr: Any) -> Any:
    return np.array(value, copy=True)


def _depend_jax(value: Any, expr: Any) -> Any:
    leaves = [e for e in (expr if isinstance(expr, (tuple, list)) else (expr,))
              if getattr(e, "size", 0)]
    if not jnp.issubdtype(value.dtype, jnp.floating) or not leaves:
        return lax.optimization_barrier((value, expr))[0]
    s = jnp.ravel(leaves[0])[0].astype(value.dtype)
    zero = jnp.abs(jnp.where(jnp.isfinite(s), s, jnp.zeros_like(s))) * 0
    return value - zero


def _depend_vjp(b: Builder, node: Node, cot: Any) -> list[Value | None]:
    return [cot, None]


_DEPEND_NOTE = """\
`Depend` (`ops.depend(value, expr)`) returns value, computed after expr. It takes no
strategy: the result has value's layout and expr is never redistributed. In JAX a float value
is computed as value minus an exact zero derived from expr, which XLA can neither drop nor
merge; other dtypes use an optimization barrier."""

define("Depend", _depend_infer, _depend_np, _depend_jax, vjp=_depend_vjp, num_inputs=2,
       traits=frozenset({Trait.FIRST_OPERAND}),
       doc="value, computed after expr (an ordering edge; no strategy, value's layout).",
       section="elementwise", operands="value, expr -> value", dtypes=ALL,
       rule="*no strategy*: value's layout; expr is never redistributed",
       tests=("test_ops_arith.py::test_depend_matches_jax",
              "test_ops_arith.py::test_depend_needs_a_tensor_value",
              "test_ops_arith.py::test_depend_in_the_forward_graph_trains_like_one_device",
              "test_ops_arith.py::test_depend_skips_python_values"), note=_DEPEND_NOTE,
       dims=DimRule(lambda ins, outs, attrs: (Same(In(0, d), Out(d)) for d in range(len(outs[0]))),
                    preserves_values=True))
