"""Functional shard (seed functional-operator-sharding.md): `shard(fn, in_strategy, ...)` and
`Cell.shard(in_strategy, parameter_plan=...)`.

While tracing, every input with a strategy passes through an `Identity` node configured with
that strategy, and every parameter named in `parameter_plan` is read through one too; the ops
inside get their strategies from sharding propagation, which starts from these configured
nodes. `None` entries are left to the search. Valid only with `auto_parallel` and
`search_mode="sharding_propagation"`, as the seed says; the driver checks that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pcompile.compiler.config.layout import LayoutSpec
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.compiler.frontend.tracing import current_tracer
from pcompile.ir.errors import PcompileError

MARK = "functional_shard"


def _constrain(value: Any, strategy: tuple[int, ...] | LayoutSpec, what: str) -> Any:
    """`value` read through an Identity configured with `strategy` (a tuple of split counts,
    or a `Layout(...)` result, as MindSpore's functional shard takes both)."""
    from pcompile.compiler.frontend import ops

    if not isinstance(value, Tensor):
        return value
    count = strategy.ndim if isinstance(strategy, LayoutSpec) else len(strategy)
    if count != value.ndim:
        kind = "layout" if isinstance(strategy, LayoutSpec) else "strategy"
        raise PcompileError(
            f"functional shard: the {kind} {strategy} of {what} has {count} entries but "
            f"the tensor has shape {value.shape}"
        )
    prim = ops.Identity().shard((strategy,)).add_prim_attr(MARK, True)
    prim.instance_name = f"shard_{what.replace(' ', '_')}"
    return prim(value)


def _resolve_plan(cell: Any, plan: dict[str, Any]
                  ) -> dict[int, tuple[Parameter, LayoutSpec | tuple[Any, ...]]]:
    """Map `parameter_plan` keys ('self.block1.dense2.weight') to the cell's parameters: a key
    names a parameter when a suffix of its path is the parameter's path inside the cell.
    Unknown names are skipped, as the seed documents."""
    out: dict[int, tuple[Parameter, LayoutSpec | tuple[Any, ...]]] = {}
    params = dict(cell.parameters_and_names())
    for key, strategy in plan.items():
        parts = key.split(".")
        if parts and parts[0] == "self":
            parts = parts[1:]
        for start in range(len(parts)):
            path = ".".join(parts[start:])
            if path in params:
                out[id(params[path])] = (params[path], strategy if isinstance(
                    strategy, LayoutSpec) else tuple(strategy))
                break
    return out


def call_sharded(fn: Callable[..., Any], config: dict[str, Any], args: tuple[Any, ...],
                 cell: Any = None) -> Any:
    tracer = current_tracer()
    if tracer is None:
        return fn(*args)
    in_strategy = config["in_strategy"]
    if len(in_strategy) != len(args):
        raise PcompileError(
            f"functional shard: in_strategy has {len(in_strategy)} entries but the function is "
            f"called with {len(args)} inputs"
        )
    new_args = [a if s is None else _constrain(a, s, f"input {i}")
                for i, (a, s) in enumerate(zip(args, in_strategy))]
    overrides = {}
    if cell is not None and config.get("parameter_plan"):
        for key, (param, strategy) in _resolve_plan(cell, config["parameter_plan"]).items():
            overrides[key] = _constrain(param, strategy, f"param {param.name}")._value
    with tracer.parameter_overrides(overrides):
        out = fn(*new_args)
    out_strategy = config.get("out_strategy")
    if out_strategy:
        outs = out if isinstance(out, tuple) else (out,)
        wrapped = tuple(o if s is None else _constrain(o, s, f"output {i}")
                        for i, (o, s) in enumerate(zip(outs, out_strategy)))
        out = wrapped if isinstance(out, tuple) else wrapped[0]
    return out
