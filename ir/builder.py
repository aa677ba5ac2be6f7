"""`Builder`: the one way nodes are created, by tracing, vjp rules and passes alike.

It fills attribute defaults, checks arity, runs shape inference, and turns an inference failure
into an `OpError` naming the op, its scope, source line and shapes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.ir.core import Constant, Graph, Node, ParallelInfo, SourceLoc, Value
from pcompile.ir.errors import OpError, ShapeError
from pcompile.ir.registry import get_op
from pcompile.ir.types import DType, TensorType


class Builder:
    """Emits nodes into `graph`, at the end or after `cursor` (which then advances)."""

    def __init__(
        self,
        graph: Graph,
        *,
        scope: str = "Default",
        source: SourceLoc | None = None,
        cursor: Node | None = None,
        instance_name: str = "",
    ) -> None:
        self.graph = graph
        self.scope = scope
        self.source = source
        self.cursor = cursor
        self.instance_name = instance_name
        self.created: list[Node] = []

    def __call__(self, op: str, /, *operands: Any, name_hint: str = "", **attrs: Any) -> Value:
        """`b("Mul", x, 2.0)`: emit `op` on `operands`; Python numbers become scalar constants
        of the first tensor operand's dtype."""
        dtype = next(
            (v.dtype for v in operands if isinstance(v, Value) and isinstance(v.type, TensorType)),
            DType.float32,
        )
        values = [v if isinstance(v, Value) else self.const(v, dtype) for v in operands]
        return self.emit(op, values, attrs, name_hint=name_hint)

    def const(self, value: Any, dtype: DType = DType.float32) -> Constant:
        return Constant(np.asarray(value), dtype)

    def emit(
        self,
        op: str,
        operands: list[Value],
        attrs: dict[str, Any] | None = None,
        *,
        instance_name: str | None = None,
        scope: str | None = None,
        source: SourceLoc | None = None,
        name_hint: str = "",
        parallel: ParallelInfo | None = None,
        user_attrs: dict[str, Any] | None = None,
    ) -> Value:
        """Emit one node. `user_attrs` are attributes the user set with `add_prim_attr`;
        unlike `attrs` they may name keys the op does not declare."""
        opdef = get_op(op)
        scope = self.scope if scope is None else scope
        source = self.source if source is None else source
        instance_name = self.instance_name if instance_name is None else instance_name
        try:
            full = opdef.full_attrs(attrs or {})
            if user_attrs:
                full.update(opdef.full_attrs(user_attrs, allow_extra=True))
                full.update(attrs or {})
        except TypeError as exc:
            raise OpError(
                op, str(exc), instance_name=instance_name, scope=scope, source=source
            ) from None
        types = [v.type for v in operands]
        try:
            opdef.check_arity(len(operands))
            # Rank-dependent attributes (ir.rank) give the same type on every rank: infer at 0.
            result_type = opdef.infer_type(types, opdef.impl_attrs(full))
        except ShapeError as exc:
            shapes = [getattr(t, "shape", str(t)) for t in types]
            hint = ""
            if "operands must have one dtype" in str(exc):
                hint = ("Cast one operand to the other's dtype with ops.Cast() (MindSpore "
                        "converts dtypes implicitly only in arithmetic and comparisons), or "
                        "give inputs() arrays of the parameters' dtype")
            raise OpError(
                op,
                str(exc),
                instance_name=instance_name,
                scope=scope,
                source=source,
                shapes=shapes,
                hint=hint,
            ) from None
        node = Node(
            op,
            operands,
            full,
            result_type,
            instance_name=instance_name,
            scope=scope,
            source=source,
            name_hint=name_hint,
            parallel=parallel,
        )
        if self.cursor is None:
            self.graph.append(node)
        else:
            self.graph.insert_after(self.cursor, node)
            self.cursor = node
        self.created.append(node)
        return node.result
