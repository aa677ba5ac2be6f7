"""Short constructors for an op's block: `define` registers an `OpDef` with its `OpDoc`
fields given inline, `elementwise` an element-wise op (its section, its rule), `grad_helper`
the gradient-only op a vjp emits. What the op's block does not say takes the `OpDef` and
`OpDoc` defaults; anything else an `OpDef` takes (attrs, num_inputs, traits, ...) is passed
through."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from pcompile.ir.dims import DimRule, broadcast
from pcompile.ir.registry import InferFn, OpDef, OpDoc, VjpFn, register
from pcompile.ir.sharding import ELEMENTWISE
from pcompile.ir.types import DType


def _caller_module(depth: int) -> str:
    return str(sys._getframe(depth + 1).f_globals.get("__name__", ""))


def define(
    name: str,
    infer: InferFn,
    numpy: Callable[..., Any] | None = None,
    jax: Callable[..., Any] | None = None,
    *,
    doc: str,
    section: str,
    operands: str,
    dtypes: frozenset[DType],
    tests: tuple[str, ...],
    rule: str = "",
    grad_of: str = "",
    spelling: str = "",
    note: str = "",
    module: str = "",
    **fields: Any,
) -> OpDef:
    """Register the op `name`: `OpDef(name, infer, numpy=numpy, jax=jax, doc=doc, **fields)`
    with `page=OpDoc(section, operands, dtypes, rule=rule, tests=tests, ...)`."""
    page = OpDoc(section, operands, dtypes, rule=rule, tests=tests, grad_of=grad_of,
                 spelling=spelling, note=note)
    opdef = OpDef(name, infer, numpy=numpy, jax=jax, doc=doc, page=page,
                  module=module or _caller_module(1), **fields)
    return register(opdef)


def elementwise(
    name: str,
    infer: InferFn,
    numpy: Callable[..., Any],
    jax: Callable[..., Any],
    *,
    vjp: VjpFn | None = None,
    operands: str = "x",
    rule: str = "element-wise",
    **fields: Any,
) -> OpDef:
    """An element-wise op (numpy broadcasting): docs/ops.md's element-wise section, the
    element-wise sharding rule, the broadcast dimension relations, one operand unless
    `num_inputs` says otherwise."""
    fields.setdefault("num_inputs", 1)
    fields.setdefault("dims", DimRule(broadcast))
    return define(name, infer, numpy, jax, vjp=vjp, section="elementwise", operands=operands,
                  rule=rule, sharding=ELEMENTWISE, module=_caller_module(1), **fields)


def grad_helper(
    name: str,
    infer: InferFn,
    numpy: Callable[..., Any],
    jax: Callable[..., Any],
    *,
    grad_of: str,
    operands: str,
    section: str = "elementwise",
    **fields: Any,
) -> OpDef:
    """A gradient-only op emitted by `grad_of`'s vjp: no gradient of its own, no rule (its
    row on docs/ops.md follows its op's), two operands unless `num_inputs` says otherwise."""
    fields.setdefault("num_inputs", 2)
    fields.setdefault("differentiable", False)
    return define(name, infer, numpy, jax, section=section, operands=operands, grad_of=grad_of,
                  module=_caller_module(1), **fields)
