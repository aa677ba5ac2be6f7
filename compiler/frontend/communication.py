"""`init`, `get_rank`, `get_group_size`, `create_group` and the group queries of MindSpore's
`mindspore.communication`: at compile time they answer from the parallel context
(`device_num`, `global_rank`); inside a generated rank program they answer from
`jax.distributed`.

**Groups.** `create_group(name, rank_ids)` names a group of ranks as MindSpore's does (each
process creates the groups it belongs to; mindformers' MoEV3 names each expert-parallel group
after its ranks). pcompile traces the model once, as the compiling rank (`global_rank`), so a
group it creates is that rank's; it stands for the like group of every rank: its ranks, sorted,
must be the ranks that share the compiling rank's coordinates but along some axes of the rank
space (evenly spaced runs: `[0, 1, 2, 3]` of 8 ranks stands for `[4, 5, 6, 7]` on rank 5;
`[0, 2, 4, 6]` for `[1, 3, 5, 7]`), which every group mindformers makes is. A collective named
with such a group inside a `Morph` region (the code written into every rank's program) runs on
each rank over that rank's own group (`ir.rank.RankGroup`); elsewhere (a rank's own trace,
hybrid_parallel) over the ranks given. As in MindSpore, members are ordered by rank, a group's
name is created once, its ranks must be distinct, within the world, and include the creating
rank; a group of ranks no axes give is refused (pcompile could not tell the other ranks' groups).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# MindSpore's `mindspore.communication.management` (where mindformers imports `get_group_size`
# from) is this module too; `__path__` lets `import pcompile.communication.management` resolve
# through the package's aliases (pcompile/__init__.py).
__path__: list[str] = []
management = sys.modules[__name__]

WORLD_GROUP = "nccl_world_group"
_WORLD_NAMES = (WORLD_GROUP, "hccl_world_group", "gloo_world_group", "mccl_world_group")
DEVICES_PER_SERVER = 8  # get_local_rank's server (MindSpore's Ascend server of 8 devices)
_RUNTIME: dict[str, int] = {}


@dataclass(frozen=True)
class _Group:
    ranks: tuple[int, ...]  # sorted
    creator: int  # the rank whose trace created it
    world: int
    load: int  # the model file load that created it (a name is created once per load)


# (the creating rank, the name) -> the group: in hybrid_parallel each rank's trace creates its
# own groups, and two ranks may give one name different ranks, as two MindSpore processes may
_GROUPS: dict[tuple[int, str], _Group] = {}
_LOADS = [0]
# Set while a Morph body is traced into the SPMD program: rank_value(RankValue) -> the value
# for every rank (symbolic) or for the builder's one rank.
_RANK_VALUE: list[Callable[[Any], Any]] = []


def init(backend_name: str | None = None) -> None:
    """Accepted for compatibility (`init("nccl")`); the launcher sets the world up."""
    if backend_name not in (None, "nccl", "hccl", "gloo", "mccl"):
        raise ValueError(f"unknown communication backend {backend_name!r}")


def set_runtime(rank: int, size: int) -> None:
    """Used by rank programs: answer get_rank/get_group_size from the running world."""
    _RUNTIME["rank"] = rank
    _RUNTIME["size"] = size


def new_load() -> None:
    """A model file is being loaded (as a process starting): its groups may be created anew."""
    _LOADS[0] += 1


def _find(group: str) -> _Group | None:
    """`group` as this rank created it, else as the compiling rank did (the one trace)."""
    found = _GROUPS.get((_world_rank(), group))
    if found is not None:
        return found
    return next((g for (_, name), g in _GROUPS.items() if name == group), None)


def _world_rank() -> int:
    if "rank" in _RUNTIME:
        return _RUNTIME["rank"]
    from pcompile.compiler.config.context import get_auto_parallel_context

    return int(get_auto_parallel_context("global_rank"))


def _world_size() -> int:
    if "size" in _RUNTIME:
        return _RUNTIME["size"]
    from pcompile.compiler.config.context import get_auto_parallel_context

    return int(get_auto_parallel_context("device_num"))


def _members(group: str, what: str) -> tuple[int, ...]:
    """The ranks of `group` as the calling rank sees it."""
    if not isinstance(group, str):
        raise TypeError(f"For '{what}', the 'group' must be str, but got "
                        f"{type(group).__name__} {group!r}")
    if group in _WORLD_NAMES:
        return tuple(range(_world_size()))
    found = _find(group)
    if found is None:
        raise ValueError(f"For '{what}', the group {group!r} has not been created; create it "
                         f"with create_group({group!r}, rank_ids) or use the world group "
                         f"({WORLD_GROUP})")
    if "rank" in _RUNTIME:  # a rank program: this rank's own group
        return _rank_group(group, found).at(_world_rank())
    return found.ranks


def get_rank(group: str = WORLD_GROUP) -> int:
    """This rank's index in `group` (its world rank for the world group)."""
    members = _members(group, "get_rank")
    rank = _world_rank()
    if rank not in members:
        raise ValueError(f"For 'get_rank', rank {rank} is not a member of the group {group!r} "
                         f"{list(members)}")
    return members.index(rank)


def get_group_size(group: str = WORLD_GROUP) -> int:
    return len(_members(group, "get_group_size"))


def get_local_rank(group: str = WORLD_GROUP) -> int:
    """This rank's index among the members of `group` on its server (DEVICES_PER_SERVER
    devices a server)."""
    members = _members(group, "get_local_rank")
    rank = _world_rank()
    if rank not in members:
        raise ValueError(f"For 'get_local_rank', rank {rank} is not a member of the group "
                         f"{group!r} {list(members)}")
    server = rank // DEVICES_PER_SERVER
    return [m for m in members if m // DEVICES_PER_SERVER == server].index(rank)


def get_local_rank_size(group: str = WORLD_GROUP) -> int:
    """The members of `group` on this rank's server."""
    members = _members(group, "get_local_rank_size")
    server = _world_rank() // DEVICES_PER_SERVER
    return sum(m // DEVICES_PER_SERVER == server for m in members)


def get_world_rank_from_group_rank(group: str, group_rank_id: int) -> int:
    members = _members(group, "get_world_rank_from_group_rank")
    if not 0 <= group_rank_id < len(members):
        raise ValueError(f"For 'get_world_rank_from_group_rank', group_rank_id {group_rank_id} "
                         f"is out of range for the {len(members)} ranks of group {group!r}")
    return members[group_rank_id]


def get_group_rank_from_world_rank(world_rank_id: int, group: str) -> int:
    members = _members(group, "get_group_rank_from_world_rank")
    if world_rank_id not in members:
        raise ValueError(f"For 'get_group_rank_from_world_rank', rank {world_rank_id} is not a "
                         f"member of the group {group!r} {list(members)}")
    return members.index(world_rank_id)


def create_group(group: str, rank_ids: Sequence[int], options: Any = None) -> None:
    """MindSpore's `create_group(group, rank_ids)` (module docstring)."""
    if not isinstance(group, str) or not isinstance(rank_ids, (list, tuple)):
        raise TypeError(f"For 'create_group', the group must be a str and rank_ids a list, got "
                        f"{type(group).__name__} {group!r} and {type(rank_ids).__name__}")
    world, rank = _world_size(), _world_rank()
    if group in _WORLD_NAMES:
        raise ValueError(f"For 'create_group', {group!r} is the world group's name, which "
                         "exists already")
    ranks = list(rank_ids)
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise ValueError(f"For 'create_group', rank_ids must be a non-empty list of ints, got "
                         f"{ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"For 'create_group', rank_ids {ranks} has duplicate data")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"For 'create_group', rank_ids {ranks} names ranks {bad} out of range: "
                         f"the world has ranks 0..{world - 1} (device_num {world})")
    if rank not in ranks:
        raise ValueError(f"For 'create_group', rank {rank} creates the group {group!r} of ranks "
                         f"{ranks} without being a member: a rank creates only the groups it "
                         "belongs to (`if get_rank() in rank_ids: create_group(...)`)")
    old = _GROUPS.get((rank, group))
    if old is not None and old.load == _LOADS[0]:
        raise ValueError(f"For 'create_group', the group {group!r} has been created already "
                         f"(ranks {list(old.ranks)}); a name is created once")
    made = _Group(tuple(sorted(ranks)), rank, world, _LOADS[0])
    _rank_group(group, made)  # refuses ranks no axes give
    _GROUPS[(rank, group)] = made


def destroy_group(group: str) -> None:
    if group in _WORLD_NAMES:
        raise ValueError("For 'destroy_group', the world group cannot be destroyed")
    if _GROUPS.pop((_world_rank(), group), None) is None:
        raise ValueError(f"For 'destroy_group', the group {group!r} has not been created")


def _rank_group(name: str, group: _Group) -> Any:
    """The `RankGroup` whose member at the creating rank is `group`'s ranks."""
    from pcompile.ir.rank import RankGroup

    ranks, world = group.ranks, group.world
    offsets = {r - ranks[0] for r in ranks}
    span, digits = {0}, []
    while len(span) < len(offsets):  # each step: the next axis, its stride and length
        stride = min(o for o in offsets if o not in span)
        count = 1
        while all(o + count * stride in offsets for o in span):
            count += 1
        if count == 1:  # the ranks are no product of axes
            break
        span = {o + k * stride for o in span for k in range(count)}
        digits.append((stride, count))
    made = RankGroup(world, tuple(digits))
    ok = span == offsets and made.at(group.creator) == ranks
    if ok and not made.is_world:
        seen: dict[int, tuple[int, ...]] = {}
        for r in range(world):
            members = made.at(r)
            if members[-1] >= world or seen.setdefault(members[0], members) != members:
                ok = False
                break
    if not ok:
        raise ValueError(
            f"For 'create_group', the ranks {list(ranks)} of group {name!r} are not the ranks "
            f"along some axes of the {world} ranks (evenly spaced runs, e.g. [0, 1, 2, 3] or "
            "[0, 2, 4, 6] of 8): pcompile traces the model once, as rank "
            f"{group.creator}, and takes each rank's own group to be its like group; give "
            "the ranks that share this rank's coordinates but along the group's axes")
    return made


def group_ranks(group: str, what: str = "") -> tuple[Any, Any]:
    """The group name and members a collective named with `group` runs over: for a created
    group inside a Morph region, every rank's own group (`GroupName`, `RankGroup`, or their
    values at the program's one rank)."""
    if not isinstance(group, str):
        raise TypeError(f"For '{what}', the 'group' must be str, but got "
                        f"{type(group).__name__} {group!r}")
    if group in _WORLD_NAMES:
        return WORLD_GROUP, tuple(range(_world_size()))
    found = _find(group)
    if found is None or not _RANK_VALUE:
        return group, _members(group, what)
    from pcompile.ir.rank import GroupName

    ranks = _rank_group(group, found)
    if ranks.is_world:
        return WORLD_GROUP, tuple(range(found.world))
    resolve = _RANK_VALUE[-1]
    return resolve(GroupName(ranks)), resolve(ranks)


@contextlib.contextmanager
def every_rank(rank_value: Callable[[Any], Any]) -> Iterator[None]:
    """While a Morph body is traced into the SPMD program: created groups are each rank's."""
    _RANK_VALUE.append(rank_value)
    try:
        yield
    finally:
        _RANK_VALUE.pop()


__all__ = ["init", "get_rank", "get_group_size", "get_local_rank", "get_local_rank_size",
           "create_group", "destroy_group", "get_world_rank_from_group_rank",
           "get_group_rank_from_world_rank", "WORLD_GROUP"]
