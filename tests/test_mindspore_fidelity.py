"""What MindSpore 2.10 gives for cases from its own parallel unit tests (tests/ut/python/parallel/)
and for values recorded from its Python binding: out_strategy forms, Layout forms, Gather modes,
context getters, parameter layouts, dumps (issues 14 and 17). Every compiled case is also checked
against the single-device program at the oracle's derived bound (`report.ok()`)."""

from __future__ import annotations

import textwrap
from typing import Any

from pcompile import (
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from pcompile.compiler.driver import compile as compile_model

HEADER = """\
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, Layout, set_auto_parallel_context, shard
"""


def compile_source(tmp_path: Any, body: str, **kwargs: Any) -> Any:
    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return compile_model(str(path), dump=False, **kwargs)


def by_name(program: Any, name: str) -> Any:
    return next(n for n in program.graph.nodes if n.instance_name == name)


def rank_ops(program: Any, rank: int = 0) -> list[str]:
    return [n.op for n in program.rank_graph(rank).nodes]


# -- issue 17, plan difference 2: get_auto_parallel_context("comm_fusion") ----------------------

#: MindSpore 2.10's `context.get_auto_parallel_context("comm_fusion")`, recorded.
MS_COMM_FUSION_DEFAULT = {
    "openstate": True,
    "allreduce": {"mode": "auto", "config": None},
    "allgather": {"mode": "auto", "config": None},
    "reducescatter": {"mode": "auto", "config": None},
}


def test_comm_fusion_getter_returns_all_four_keys() -> None:
    reset_auto_parallel_context()
    try:
        assert get_auto_parallel_context("comm_fusion") == MS_COMM_FUSION_DEFAULT
        set_auto_parallel_context(comm_fusion={"openstate": False,
                                               "reducescatter": {"mode": "size", "config": 16}})
        assert get_auto_parallel_context("comm_fusion") == {
            "openstate": False,
            "allreduce": {"mode": "auto", "config": None},
            "allgather": {"mode": "auto", "config": None},
            "reducescatter": {"mode": "size", "config": 16},
        }
        reset_auto_parallel_context()
        set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": [2, 4]}})
        got = get_auto_parallel_context("comm_fusion")
        assert got["allreduce"] == {"mode": "index", "config": [2, 4]}
        assert list(got) == ["openstate", "allreduce", "allgather", "reducescatter"]
        assert get_auto_parallel_context("all_reduce_fusion_config") == [2, 4]
        reset_auto_parallel_context()
        assert get_auto_parallel_context("comm_fusion") == MS_COMM_FUSION_DEFAULT
        # the displayed default of allgather does not turn its fusion on
        from pcompile.compiler.context import current_context
        assert not current_context().fusion_enabled("allgather")
    finally:
        reset_auto_parallel_context()
