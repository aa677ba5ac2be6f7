"""`ops.Morph(fn, infer_shape, infer_dtype)`: MindSpore's region of user code that runs on each
rank's slices (with `add_prim_attr("self_define_shard", True)` and `shard(in_strategy=Layouts,
out_strategy=Layouts)`; mindformers' MoEV3 runs its experts in one: AlltoAllV, GroupedMatmul,
AlltoAllV back).

On one device (or outside a semi-auto / auto parallel compile) the call is `fn(*args)` on the
whole tensors, as MindSpore runs it stand-alone. In a parallel compile the call is one `Morph`
node (`ir/ops/morph.py`) over the tensor arguments, its result type from the user's
`infer_shape` / `infer_dtype` (called with the arguments' shapes / dtypes, other arguments as
they are); the planner lays the operands out as the in_strategy Layouts say, and step_parallel
traces `fn` on the rank's local operands into its program (the other arguments as given), so
`fn`'s collectives and shapes are the local ones it was written for.

`fn`'s collectives run over the world group or a group `create_group` made: each rank over its
own group of the like groups (compiler/frontend/communication.py; mindformers' expert-parallel
groups).

Limits, each refused with a message: the Layouts are required (`self_define_shard` has no
default), and one tensor result.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from pcompile.compiler.config.context import get_auto_parallel_context
from pcompile.compiler.frontend.communication import every_rank
from pcompile.compiler.frontend.primitive import Primitive
from pcompile.compiler.frontend.tensor import Tensor
from pcompile.compiler.frontend.tracing import current_tracer, tracing, user_source
from pcompile.ir.core import Graph, Value
from pcompile.ir.errors import OpError
from pcompile.ir.ops.morph import register_body
from pcompile.ir.types import DType

_BODY_COUNTS: weakref.WeakKeyDictionary[Graph, int] = weakref.WeakKeyDictionary()


def _parallel() -> bool:
    mode = get_auto_parallel_context("parallel_mode")
    return mode in ("semi_auto_parallel", "auto_parallel") and \
        int(get_auto_parallel_context("device_num")) > 1


class Morph(Primitive):
    """`Morph(fn, infer_shape, infer_dtype)(*args)`: module docstring."""

    op = "Morph"

    def __init__(self, fn: Callable[..., Any], infer_shape: Callable[..., Any],
                 infer_dtype: Callable[..., Any]) -> None:
        for name, value in (("fn", fn), ("infer_shape", infer_shape),
                            ("infer_dtype", infer_dtype)):
            if not callable(value):
                raise TypeError(f"Morph: {name} must be a function, got {value!r}")
        super().__init__()
        self.fn, self.infer_shape, self.infer_dtype = fn, infer_shape, infer_dtype

    def __call__(self, *args: Any) -> Any:
        tracer = current_tracer()
        if tracer is None or not _parallel():
            return self.fn(*args)
        tensors = [a for a in args if isinstance(a, Tensor)]
        where = getattr(self.fn, "__name__", "fn")
        if self.in_strategy is None or self.out_strategy is None:
            raise OpError("Morph", f"the region {where} runs on each rank's slices "
                          "(self_define_shard), so its layouts must be given",
                          instance_name=self.instance_name, scope=tracer.scope,
                          source=user_source(),
                          hint="call .shard(in_strategy=(Layout..., one per tensor argument),"
                               " out_strategy=(Layout for the result,))")
        shape = self.infer_shape(*[tuple(a.shape) if isinstance(a, Tensor) else a
                                   for a in args])
        dtype = self.infer_dtype(*[a.dtype if isinstance(a, Tensor) else a for a in args])
        # each call's body has its own name, numbered in its graph (the same dumps every time)
        count = _BODY_COUNTS.get(tracer.builder.graph, 0) + 1
        _BODY_COUNTS[tracer.builder.graph] = count
        body = f"{where}.{count}"
        register_body(body, _body(self.fn, args, tracer.scope, where))
        return self._apply(tensors, body=body, out_shape=tuple(int(d) for d in shape),
                           out_dtype=DType.from_any(dtype))


def _body(fn: Callable[..., Any], args: tuple[Any, ...], scope: str, where: str
          ) -> Callable[[Graph, list[Value], Callable[[Any], Any]], Value]:
    """fn traced on a rank's local operands into its program (the other arguments as given;
    a collective over a created group runs over each rank's own group)."""

    def build(graph: Graph, operands: list[Value], rank_value: Callable[[Any], Any]) -> Value:
        local = iter(operands)
        with tracing(graph) as tracer, tracer.absolute_scope(scope), every_rank(rank_value):
            call = [Tensor(_value=next(local)) if isinstance(a, Tensor) else a for a in args]
            out = fn(*call)
        value = out._value if isinstance(out, Tensor) and out.is_symbolic else None
        if value is None:
            raise OpError("Morph", f"the region {where} must return one traced tensor, got "
                          f"{type(out).__name__}", scope=scope)
        return value

    return build
