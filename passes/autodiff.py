"""Reverse-mode automatic differentiation on the IR.

`append_gradients(graph, loss, wrt)` appends, after the forward nodes, the backward nodes that
compute d loss / d p for every p in `wrt`, using each op's vjp rule (written in IR ops). The
backward nodes get scope `Gradients/<forward scope>` and the forward node's source line, so a
dump shows which forward op each gradient node comes from.

Rules:
* only nodes on a path from some `wrt` parameter to `loss` are differentiated;
* integer and bool values carry no gradient; ops with `differentiable=False` stop it;
* cotangents reaching one value from several users are summed with `Add`;
* a tuple-typed result collects one cotangent per element; unused elements get zeros;
* the collectives a communication op's vjp emits say why they exist and what they move
  (`reason`, `bytes`; passes/comm_info.py), as the forward ones do;
* a region with a given backward (`CustomVjp`: a cell's own `bprop`,
  compiler/frontend/custom_bprop.py) takes the cotangents of its outputs once every user of them is
  differentiated, and its `build` gives the cotangents of its inputs; the region's own ops are not
  differentiated (their results get no cotangent).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Node, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.ops.state import assigned_names, split_assigned
from pcompile.ir.registry import get_op
from pcompile.ir.types import TensorType, TupleType
from pcompile.passes.comm_info import backward_annotation
from pcompile.passes.unit import CompileUnit


@dataclass
class CustomVjp:
    """A region of the graph whose backward is given: `build(graph, douts)` appends the nodes
    that turn the cotangents of `outputs` (zeros for an output nothing differentiates) into
    one cotangent per entry of `inputs` (None: none, or an input that is not a value)."""

    name: str  # what the messages call it
    inputs: list[Value | None]
    outputs: list[Value]
    build: Callable[[Graph, list[Value]], list[Value | None]]


def zeros_like(value_type: TensorType) -> Constant:
    zero = np.zeros((), value_type.dtype.np)
    return Constant(np.broadcast_to(zero, value_type.shape), value_type.dtype)


def _differentiable(value: Value) -> bool:
    t = value.type
    if isinstance(t, TupleType):
        return any(e.dtype.is_float for e in t.elements)
    return t.dtype.is_float


def append_gradients(
    graph: Graph,
    loss: Value | Sequence[Value],
    wrt: Sequence[GraphParam],
    seeds: Sequence[Value] | None = None,
    origins: dict[Node, Node] | None = None,
    custom: Sequence[CustomVjp] = (),
) -> list[Value]:
    """Append the backward graph; returns one gradient value per entry of `wrt`.

    `loss` is usually one scalar, seeded with 1. Several values with explicit `seeds`
    (cotangents of their types) compute a vector-Jacobian product instead. `origins`, when
    given, receives backward node -> the forward node whose vjp made it (the pipeline
    passes run a backward node in its forward node's stage and micro-batch). `custom`: regions
    whose backward is given (`CustomVjp`)."""
    losses = [loss] if isinstance(loss, Value) else list(loss)
    for value in losses:
        if not isinstance(value.type, TensorType) or not value.dtype.is_float:
            raise PcompileError(f"the loss must be a floating-point tensor, got {value.type}")
    if seeds is None:
        seeds = [
            Constant(np.broadcast_to(np.ones((), v.dtype.np), v.shape), v.dtype) for v in losses
        ]
    if len(seeds) != len(losses):
        raise ValueError("one seed per loss value is needed")

    # Forward activity: which values depend on a parameter we differentiate for.
    active: set[int] = {id(p) for p in wrt}
    for node in graph.nodes:
        if get_op(node.op).differentiable and any(id(v) in active for v in node.operands):
            if _differentiable(node.result):
                active.add(id(node.result))

    cot: dict[int, Value] = {}
    tuple_cot: dict[int, list[Value | None]] = {}
    for value, seed in zip(losses, seeds):
        if seed.type != value.type:
            raise ValueError(f"seed type {seed.type} does not match {value.type}")
        cot[id(value)] = seed

    def accumulate(b: Builder, value: Value, contribution: Value) -> None:
        if contribution.type != value.type:
            raise AssertionError(
                f"vjp produced {contribution.type} for a value of type {value.type}"
            )
        key = id(value)
        cot[key] = contribution if key not in cot else b("Add", cot[key], contribution)

    # A custom region runs when its last output (in graph order) is reached: every user of
    # its outputs lies after the region, so their cotangents are complete by then.
    trigger = {id(out): k for k, region in enumerate(custom) for out in region.outputs}
    applied: set[int] = set()

    def run_custom(region: CustomVjp) -> None:
        douts = []
        for out in region.outputs:
            given = cot.pop(id(out), None)
            douts.append(given if given is not None else zeros_like(out.tensor_type))
        grads = region.build(graph, douts)
        if len(grads) != len(region.inputs):
            raise PcompileError(f"{region.name}: bprop returned {len(grads)} gradients for "
                                f"{len(region.inputs)} inputs; return one per input")
        b = Builder(graph, scope=f"Gradients/{region.name}")
        for i, (value, grad) in enumerate(zip(region.inputs, grads)):
            if value is None or grad is None or id(value) not in active:
                continue
            if grad.type != value.type:
                raise PcompileError(
                    f"{region.name}: bprop's gradient {i} is {grad.type}, but input {i} is "
                    f"{value.type} (on this rank); return a gradient of the input's shape and "
                    "dtype")
            accumulate(b, value, grad)

    made, previous = len(graph.nodes), None
    for node in reversed(list(graph.nodes)):
        if origins is not None:
            _note_origins(graph, made, previous, origins)
            made, previous = len(graph.nodes), node
        k = trigger.get(id(node.result))
        if k is not None and k not in applied:
            applied.add(k)
            run_custom(custom[k])
        result = node.result
        if id(result) not in active:
            continue
        if isinstance(result.type, TupleType):
            parts = tuple_cot.get(id(result))
            if parts is None:
                continue
            incoming: object = [
                p if p is not None else zeros_like(t)
                for p, t in zip(parts, result.type.elements)
            ]
        else:
            if id(result) not in cot:
                continue
            incoming = cot[id(result)]
        opdef = get_op(node.op)
        if opdef.vjp is None:
            raise PcompileError(f"{node.where()}: {node.op} cannot be differentiated")
        b = Builder(graph, scope=f"Gradients/{node.scope}", source=node.source)
        if node.op == "TupleGetItem":
            # Route the element's cotangent into the producer's per-element slots.
            (tup,) = node.operands
            assert isinstance(tup.type, TupleType) and isinstance(incoming, Value)
            slots = tuple_cot.setdefault(id(tup), [None] * len(tup.type.elements))
            index = int(node.attrs["index"])
            prev = slots[index]
            slots[index] = incoming if prev is None else b("Add", prev, incoming)
            continue
        grads = opdef.vjp(b, node, incoming)
        if opdef.collective or node.op == "_MirrorOperator":
            backward_annotation(node, b.created)
        if len(grads) != len(node.operands):
            raise AssertionError(f"vjp of {node.op} returned {len(grads)} cotangents")
        for operand, grad in zip(node.operands, grads):
            if grad is None or id(operand) not in active:
                continue
            accumulate(b, operand, grad)

    if origins is not None:
        _note_origins(graph, made, previous, origins)
    out: list[Value] = []
    for param in wrt:
        g = cot.get(id(param))
        out.append(g if g is not None else zeros_like(param.tensor_type))
    return out


def _note_origins(graph: Graph, made: int, forward: Node | None,
                  origins: dict[Node, Node]) -> None:
    """The nodes appended since `made` were made by `forward`'s vjp."""
    if forward is not None:
        for node in graph.nodes[made:]:
            origins[node] = forward


__all__ = ["CustomVjp", "append_gradients", "zeros_like"]


@dataclass(frozen=True)
class AutodiffOptions:
    """`custom(graph)`: the vjps of the cells with their own bprop, on that graph (the front
    end traced them; none: every op's own vjp); `gradient_scales`: each parameter's gradient
    multiplied by this before the optimizer (the single-device reference's model of a parallel
    program's gradient scaling; 1 when absent)."""

    custom: Callable[[Graph], list[Any]] | None = None
    gradient_scales: Mapping[str, float] = field(default_factory=dict)


class AutodiffPass:
    """`autodiff`: reverse-mode autodiff on the IR: append d loss / d w for every trainable
    weight; the graph's outputs become the loss and the gradients."""

    name = "autodiff"
    appends_only = True  # existing nodes are left as they are (their dump text is reused)

    def __init__(self, options: AutodiffOptions | None = None) -> None:
        self.options = options or AutodiffOptions()

    def apply(self, unit: CompileUnit) -> None:
        scales = self.options.gradient_scales
        for graph in unit.graphs:
            # The objective, seeded with ones (MindSpore's sens); a non-scalar objective comes
            # with its mean, the loss the step reports.
            own, assigned = split_assigned(graph)
            objective, loss = own[0], own[-1]
            wrt = [p for p in graph.weights if p.requires_grad]
            if not wrt:
                raise PcompileError("the network has no trainable parameters to train")
            origins: dict[Node, Node] | None = {} if unit.micro_batched else None
            custom = self.options.custom(graph) if self.options.custom is not None else []
            grads = append_gradients(graph, objective, wrt, origins=origins, custom=custom)
            if origins is not None:  # backward nodes run in their forward node's stage
                from pcompile.passes.pipeline_split import inherit

                assert unit.pipeline is not None
                inherit(origins, unit.pipeline.local_stage, unit.pipeline.labels)
            if scales:
                grads = [_scaled(graph, g, scales.get(p.name, 1.0)) for p, g in zip(wrt, grads)]
            # the Parameters the forward assigned keep their new values, after the gradients
            graph.outputs = [loss, *grads, *assigned]
            graph.attrs["outputs"] = ("loss", *(f"grad.{p.name}" for p in wrt),
                                      *assigned_names(graph))


def _scaled(graph: Graph, grad: Value, scale: float) -> Value:
    """`grad * scale` appended to `graph`."""
    if scale == 1.0:
        return grad
    return Builder(graph)("Mul", grad, scale, name_hint="scaled_grad")
