"""`create_group` and the group queries of `pcompile.communication` (MindSpore's
`mindspore.communication`, as mindformers' MoEV3 builds its expert-parallel groups): the
compiling rank's view, each rank's own group of the like groups, and MindSpore's refusals
(a name created twice, ranks out of range or repeated, a rank creating a group it is not in),
plus pcompile's own (ranks no axes of the rank space give)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import pcompile.compiler.frontend.communication as comm
from pcompile import ops
from pcompile.compiler.config.context import context_override
from pcompile.ir.rank import GroupName, RankGroup


@pytest.fixture(autouse=True)
def fresh_groups() -> Iterator[None]:
    saved = dict(comm._GROUPS)
    comm.new_load()
    yield
    comm._GROUPS.clear()
    comm._GROUPS.update(saved)


def test_group_queries_answer_the_compiling_ranks_view() -> None:
    with context_override(device_num=8, global_rank=6):
        comm.create_group("ep", [7, 4, 6, 5])  # any order; members by rank, as MindSpore's
        assert comm.get_group_size("ep") == 4
        assert comm.get_rank("ep") == 2
        assert comm.get_rank() == 6 and comm.get_group_size() == 8
        assert comm.get_world_rank_from_group_rank("ep", 0) == 4
        assert comm.get_group_rank_from_world_rank(5, "ep") == 1
        assert comm.get_local_rank("ep") == 2 and comm.get_local_rank_size("ep") == 4
        assert ops.AlltoAll(4, 0, 0, "ep").attrs["rank_list"] == (4, 5, 6, 7)


def test_inside_a_region_a_group_is_every_ranks_own() -> None:
    """In a Morph body a created group is the RankGroup whose member at the compiling rank is
    the group: consecutive ranks ([0..3] -> [4..7] on rank 5), strided ones ([0, 2, 4, 6] ->
    [1, 3, 5, 7]); a program written for one rank gets that rank's list."""
    with context_override(device_num=8, global_rank=0):
        comm.create_group("ep", [0, 1, 2, 3])
        comm.create_group("oep", [0, 2, 4, 6])
        with comm.every_rank(lambda v: v):
            name, ranks = comm.group_ranks("ep", "AlltoAll")
            assert ranks == RankGroup(8, ((1, 4),)) and name == GroupName(ranks)
            assert ranks.at(5) == (4, 5, 6, 7)
            _, strided = comm.group_ranks("oep", "AlltoAll")
            assert strided.at(5) == (1, 3, 5, 7)
            prim = ops.AlltoAll(4, 0, 0, "ep")
            assert prim.attrs["rank_list"] == ranks
        with comm.every_rank(lambda v: v.at(6)):
            assert comm.group_ranks("ep", "AlltoAll")[1] == (4, 5, 6, 7)


@pytest.mark.parametrize("ranks, message", [
    ([0, 8], "out of range"),
    ([0, 0, 1], "duplicate"),
    ([1, 2], "without being a member"),
    ([0, 1, 3], "not the ranks along some axes"),
    ([0, 1, 2], "not the ranks along some axes"),  # 3 does not divide 8: [6, 7, 8] on rank 7
    ([], "non-empty"),
])
def test_refusals(ranks: list[int], message: str) -> None:
    with context_override(device_num=8, global_rank=0), pytest.raises(ValueError, match=message):
        comm.create_group("g", ranks)


def test_a_name_is_created_once_per_load() -> None:
    with context_override(device_num=8, global_rank=0):
        comm.create_group("g", [0, 1])
        with pytest.raises(ValueError, match="created already"):
            comm.create_group("g", [0, 1])
        comm.new_load()  # the next compile loads the model file again
        comm.create_group("g", [0, 1])


def test_an_unknown_group_is_refused_by_name() -> None:
    with context_override(device_num=8), pytest.raises(ValueError, match="has not been created"):
        ops.AllGather("nope")


def test_each_rank_its_own_group_of_one_name() -> None:
    """hybrid_parallel traces each rank with its own get_rank(): two ranks may give one name
    different ranks (as two MindSpore processes may), and each rank's collectives take its own."""
    with context_override(device_num=8, global_rank=1):
        comm.create_group("ep", [0, 1, 2, 3])
    with context_override(device_num=8, global_rank=5):
        comm.create_group("ep", [4, 5, 6, 7])
        assert ops.AlltoAll(4, 0, 0, "ep").attrs["rank_list"] == (4, 5, 6, 7)
    with context_override(device_num=8, global_rank=1):
        assert ops.AlltoAll(4, 0, 0, "ep").attrs["rank_list"] == (0, 1, 2, 3)
        assert comm.get_rank("ep") == 1
