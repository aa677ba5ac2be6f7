"""Cells with their own backward function, `def bprop(self, *inputs, out, dout)`, as MindSpore
runs them.

At trace time `record_call` notes each call of such a cell: its tensor inputs and outputs
(values of the forward graph). The split maps them to the values the rank graph made for them
(`passes/step_parallel.py`, `build_spmd_graph(watch=...)`), and `custom_vjps` turns each call
into a `passes.autodiff.CustomVjp`: autodiff takes the cotangents of the cell's outputs, calls
the cell's `bprop` on the rank's local values (inputs, `out`, `dout`), traced into the rank
graph under `Gradients/<cell scope>`, and gives its results to the inputs instead of
differentiating the cell's ops. This is MindSpore's semantics: after the split, a custom bprop
runs on each device's slices, and the cotangent reaching it already carries the loss's
`_VirtualDiv` (a loss held by k ranks seeds 1/k), which is why mindformers' `_NLLLoss` multiplies
its gradient by `repeat_loss` = mp under (semi-)auto parallel.

The single-device program of the check (`tools/oracle.py`) differentiates `construct`
instead: the check compares the plan, bprop included, with the gradient of the cells' forward.
A bprop that is not that gradient (a straight-through estimator) fails the check; compile such
a model with `--no-check`.

Limits (each refused with a message): keyword arguments in the call, outputs that are not
tensors or that are one of the inputs, trainable parameters passed in as inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.compiler.frontend.tracing import current_tracer, tracing
from pcompile.ir.core import Graph, Value
from pcompile.ir.errors import PcompileError


@dataclass
class BpropCall:
    """One call of a cell with its own bprop, in the forward graph."""

    cell: Any
    scope: str
    args: list[Any]  # the call's arguments as given (tensors are replaced at bprop time)
    inputs: list[Value | None]  # each argument's value (None: not a traced tensor)
    outputs: list[Value]
    tuple_out: bool  # construct returned a tuple (bprop's `out` and `dout` are tuples)

    @property
    def name(self) -> str:
        return f"{type(self.cell).__name__} (scope {self.scope})"


def record_call(cell: Any, scope: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                result: Any) -> BpropCall:
    """Note a call of `cell`, which defines `bprop`, that returned `result`."""
    name = f"{type(cell).__name__} (scope {scope})"
    if kwargs:
        raise PcompileError(f"{name} defines its own bprop and is called with keyword "
                            f"arguments {sorted(kwargs)}; pass its inputs by position, as "
                            "bprop receives them")
    tracer = current_tracer()
    assert tracer is not None
    inputs: list[Value | None] = []
    for i, a in enumerate(args):
        if isinstance(a, Parameter) and a.requires_grad:
            raise PcompileError(
                f"{name} defines its own bprop and input {i} is the trainable parameter "
                f"{a.name!r}; pcompile gives a custom bprop activations only (use the "
                "parameter inside the cell, where its gradient follows construct, or drop "
                "bprop)")
        inputs.append(a._value if isinstance(a, Tensor) and a.is_symbolic else None)
    items = list(result) if isinstance(result, (tuple, list)) else [result]
    outputs: list[Value] = []
    for i, item in enumerate(items):
        if not isinstance(item, Tensor) or not item.is_symbolic:
            raise PcompileError(f"{name} defines its own bprop, and output {i} of its "
                                f"construct is {type(item).__name__}, not a traced tensor; "
                                "return tensors computed from the inputs")
        if any(item._value is v for v in inputs):
            raise PcompileError(f"{name} defines its own bprop and returns its input as "
                                f"output {i}; return a computed tensor (an ops.Identity of it)")
        assert item._value is not None  # is_symbolic
        outputs.append(item._value)
    return BpropCall(cell, scope, list(args), inputs, outputs,
                     isinstance(result, (tuple, list)))


def custom_vjps(calls: list[BpropCall], local: Callable[[Value], Value | None]) -> list[Any]:
    """The `CustomVjp`s of a rank graph: `local(value)` is the rank graph's value for a value
    of the forward graph (None: it was removed as dead code)."""
    from pcompile.passes.autodiff import CustomVjp

    out = []
    for call in calls:
        outputs = [local(v) for v in call.outputs]
        if any(v is None for v in outputs):
            continue  # no output reaches the objective: nothing to differentiate
        inputs = [local(v) if v is not None else None for v in call.inputs]
        out.append(CustomVjp(call.name, inputs, outputs,  # type: ignore[arg-type]
                             _builder(call, inputs, outputs)))  # type: ignore[arg-type]
    return out


def _builder(call: BpropCall, inputs: list[Value | None], outputs: list[Value]
             ) -> Callable[[Graph, list[Value]], list[Value | None]]:
    def build(graph: Graph, douts: list[Value]) -> list[Value | None]:
        from pcompile.compiler.frontend.model_file import call_user

        with tracing(graph) as tracer, tracer.absolute_scope(f"Gradients/{call.scope}"):
            args = [Tensor(_value=v) if v is not None else a
                    for a, v in zip(call.args, inputs)]
            outs = [Tensor(_value=v) for v in outputs]
            dout = [Tensor(_value=d) for d in douts]
            out: Any = tuple(outs) if call.tuple_out else outs[0]
            grads = call_user(call.cell.bprop, f"{type(call.cell).__name__}.bprop()",
                              _source(call.cell), *args, out,
                              tuple(dout) if call.tuple_out else dout[0])
        items = list(grads) if isinstance(grads, (tuple, list)) else [grads]
        result: list[Value | None] = []
        for i, g in enumerate(items):
            if isinstance(g, Tensor) and g.is_symbolic:
                result.append(g._value)
            elif isinstance(g, Tensor) or g is None:
                result.append(None)  # a constant gradient (zeros_like of an integer input)
            else:
                raise PcompileError(f"{call.name}: bprop's result {i} is "
                                    f"{type(g).__name__}; return one tensor per input")
        return result

    return build


def _source(cell: Any) -> str:
    import inspect

    try:
        return inspect.getsourcefile(type(cell)) or "<model file>"
    except TypeError:
        return "<model file>"


__all__ = ["BpropCall", "custom_vjps", "record_call"]
