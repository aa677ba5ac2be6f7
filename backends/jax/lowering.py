"""Lowers an `ir.Graph` to a JAX function through each op's `jax` implementation.

`lower_graph(graph)` returns `fn(*arrays) -> list[outputs]`, arrays in graph-parameter order;
wrap it in `jax.jit`. Collectives go through a `comm` callable (node, inputs) -> output, so the
same per-op table serves the single-device lowering (groups of one: identity) and the multi-rank
lowering, which supplies axis-name collectives.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from pcompile.ir.core import Constant, Graph, Node, Value
from pcompile.ir.lowering import LoweringOptions, lowering
from pcompile.ir.registry import get_op
from pcompile.ir.types import DType

CommFn = Callable[[Node, list[Any]], Any]


def x64() -> Any:
    """A context in which JAX computes in 64-bit (float64 evaluation)."""
    import jax

    enable: Callable[[bool], Any] | None = getattr(jax, "enable_x64", None)
    if enable is None:  # older JAX
        from jax.experimental import enable_x64  # type: ignore[attr-defined]  # older JAX only

        enable = enable_x64
    return enable(True)


def single_device_comm(node: Node, inputs: list[Any]) -> Any:
    ranks = tuple(node.attrs.get("rank_list") or (0,))
    if len(ranks) != 1:
        raise RuntimeError(f"{node.where()} needs ranks {ranks}; use the multi-rank lowering")
    return inputs[0] if len(inputs) == 1 else tuple(inputs)


def default_lowering() -> LoweringOptions:
    """The lowering's options for this process: `PCOMPILE_ATTENTION=xla` keeps attention off
    fused vendor kernels (cuDNN on GPUs)."""
    return LoweringOptions(fused_attention=os.environ.get("PCOMPILE_ATTENTION", "") != "xla")


def within_lowering(fn: Callable[..., Any], options: LoweringOptions | None = None
                    ) -> Callable[..., Any]:
    """`fn` made to run inside `lowering(options)` (default: `default_lowering()`, read once,
    here): a fresh lowering, with its memo, for each trace of a graph's ops."""
    current = options if options is not None else default_lowering()

    def traced(*args: Any) -> Any:
        with lowering(current):
            return fn(*args)

    return traced


def lower_graph(graph: Graph, comm: CommFn = single_device_comm,
                float64: bool = False, options: LoweringOptions | None = None
                ) -> Callable[..., list[Any]]:
    """`float64`: every float computed in float64 (run it under `x64()`), as the numpy
    interpreter's float64 mode does. `options`: what the op implementations may use
    (default: `default_lowering()`), current while they run."""
    nodes = list(graph.nodes)
    params = list(graph.params)
    outputs = list(graph.outputs)
    impls = []
    for node in nodes:
        opdef = get_op(node.op)
        if not opdef.collective and opdef.jax is None:
            raise NotImplementedError(f"{node.op} has no JAX implementation")
        attrs = opdef.jax_attrs(node)
        if float64:
            attrs = {k: DType.float64 if isinstance(v, DType) and v.is_float else v
                     for k, v in attrs.items()}
        impls.append((opdef, attrs))

    def run(*arrays: Any) -> list[Any]:
        env: dict[int, Any] = {id(p): a for p, a in zip(params, arrays)}

        def read(value: Value) -> Any:
            if isinstance(value, Constant):
                if float64 and value.dtype.is_float:
                    return jnp.asarray(value.array.astype("float64"))
                return jnp.asarray(value.array)
            return env[id(value)]

        for node, (opdef, attrs) in zip(nodes, impls):
            args = [read(v) for v in node.operands]
            if opdef.collective:
                env[id(node.result)] = comm(node, args)
            else:
                env[id(node.result)] = opdef.jax(*args, **attrs)  # type: ignore[misc]
        return [read(v) for v in outputs]

    return within_lowering(run, options)
