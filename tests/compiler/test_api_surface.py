"""MindSpore API surface seen while porting its parallel tests (issue 36 cause 7): what
MindSpore accepts is accepted, and what it refuses is refused with its exception class."""

from __future__ import annotations

import pytest

from pcompile import ops


def test_collectives_refuse_a_group_that_is_not_a_str() -> None:
    """MindSpore's test_alltoall: `AlltoAll(..., group=3)` is a TypeError (check_value_type of
    the group), as are non-int split arguments; every collective checks its group alike."""
    with pytest.raises(TypeError, match="'group' must be str"):
        ops.AlltoAll(split_count=8, split_dim=0, concat_dim=1, group=3)
    with pytest.raises(TypeError, match="'split_count' must be int"):
        ops.AlltoAll(split_count=8.0, split_dim=0, concat_dim=1)
    for make in (lambda: ops.AllReduce(group=1), lambda: ops.AllGather(group=None),
                 lambda: ops.ReduceScatter(group=2), lambda: ops.Broadcast(0, group=0)):
        with pytest.raises(TypeError, match="'group' must be str"):
            make()
