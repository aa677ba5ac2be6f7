"""How the JAX backend runs each collective: one row per collective that runs over a group
(`ir.registry.group_collectives`; tests/backends/test_collective_tables.py checks the two agree,
so a collective added to `ir/ops/comm.py` without its row here fails a test).

A row names the functions of `backends/jax/spmd.py` that run the collective: `over_axes` over
the mesh axes whose variation gives the node's groups (the in-process lowering calls it; a
generated rank program calls `spmd.<over_axes>`), and `over_group`, the exact fallback for
groups no mesh axes give (`spmd.group_collective` calls it on every member's operand). `attrs`
are the node attributes the plan keeps (`CollectivePlan.attrs`, in the node's order), and
`keywords` maps them to `over_axes`'s keyword arguments.

This module does not import JAX (the code generator reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JaxCollective:
    """One collective's row (module docstring)."""

    over_axes: str  # spmd.<over_axes>(*xs, axes=..., **keywords(attrs))
    over_group: str  # spmd.<over_group>(parts, x, position, **attrs): the exact fallback
    attrs: tuple[str, ...] = ()  # the node attributes the lowering reads
    keywords: Callable[[dict[str, Any]], dict[str, Any]] = lambda attrs: {}


def _reduce_op(attrs: dict[str, Any]) -> dict[str, Any]:
    return {"op": attrs.get("op", "sum")}


def _dims(attrs: dict[str, Any]) -> dict[str, Any]:
    return {"split_dim": attrs["split_dim"], "concat_dim": attrs["concat_dim"]}


def _root(attrs: dict[str, Any]) -> dict[str, Any]:
    return {"root": attrs.get("root_rank", 0)}


COLLECTIVES: dict[str, JaxCollective] = {
    "AllReduce": JaxCollective("all_reduce", "group_all_reduce", ("op",), _reduce_op),
    "AllGather": JaxCollective("all_gather", "group_all_gather"),
    "ReduceScatter": JaxCollective("reduce_scatter", "group_reduce_scatter", ("op",),
                                   _reduce_op),
    "AlltoAll": JaxCollective("all_to_all", "group_all_to_all",
                              ("split_count", "split_dim", "concat_dim"), _dims),
    "Broadcast": JaxCollective("broadcast", "group_broadcast", ("root_rank",), _root),
}
