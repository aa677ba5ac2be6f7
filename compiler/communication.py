"""`init`, `get_rank`, `get_group_size`: at compile time they answer from the parallel context
(`device_num`, `global_rank`); inside a generated rank program they answer from
`jax.distributed`."""

from __future__ import annotations

import sys

# MindSpore's `mindspore.communication.management` (where mindformers imports `get_group_size`
# from) is this module too; `__path__` lets `import pcompile.communication.management` resolve
# through the package's aliases (pcompile/__init__.py).
__path__: list[str] = []
management = sys.modules[__name__]

WORLD_GROUP = "nccl_world_group"
_RUNTIME: dict[str, int] = {}


def init(backend_name: str | None = None) -> None:
    """Accepted for compatibility (`init("nccl")`); the launcher sets the world up."""
    if backend_name not in (None, "nccl", "hccl", "gloo", "mccl"):
        raise ValueError(f"unknown communication backend {backend_name!r}")


def set_runtime(rank: int, size: int) -> None:
    """Used by rank programs: answer get_rank/get_group_size from the running world."""
    _RUNTIME["rank"] = rank
    _RUNTIME["size"] = size


def get_rank(group: str = WORLD_GROUP) -> int:
    if "rank" in _RUNTIME:
        return _RUNTIME["rank"]
    from pcompile.compiler.context import get_auto_parallel_context

    return int(get_auto_parallel_context("global_rank"))


def get_group_size(group: str = WORLD_GROUP) -> int:
    if "size" in _RUNTIME:
        return _RUNTIME["size"]
    from pcompile.compiler.context import get_auto_parallel_context

    return int(get_auto_parallel_context("device_num"))


def group_ranks(group: str) -> tuple[str, tuple[int, ...]]:
    """The name and members of a communication group known by name."""
    if group in (WORLD_GROUP, "hccl_world_group", "gloo_world_group"):
        return WORLD_GROUP, tuple(range(get_group_size()))
    raise ValueError(
        f"unknown communication group {group!r}; only the world group ({WORLD_GROUP}) can be "
        "named here"
    )


__all__ = ["init", "get_rank", "get_group_size", "WORLD_GROUP"]
