"""Gather with the table's gathered axis split and the indices split as well (issue 36 cause 5):
MindSpore compiles `((2, 1), (2, 2))` with the masked local lookup and an AllReduce (or a
ReduceScatter with an `out_strategy`) over the ranks that hold the same index block; pcompile
refused any split of the indices but MindSpore's shard-batch-and-axis mode. A 1-D table with
its axis split gave the mask one dim too many (the lookup's result has no row dim to expand
into). Every case is checked against the single-device program."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.gather = ops.Gather().shard({strategy}{out})
        self.mul = ops.Mul()
        table = np.random.default_rng(1).standard_normal({table}).astype(np.float32)
        self.w = Parameter(table, "w")
        index = np.random.default_rng(3).integers(0, {rows}, {indices}).astype(np.int32)
        self.index = Tensor(index)

    def construct(self, y):
        return self.mul(self.gather(self.w, self.index, 0), y)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal({result}).astype(np.float32),)
"""


def compile_gather(tmp_path: Any, strategy: tuple, table: tuple, indices: tuple,
                   out: tuple | None = None) -> Any:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL.format(
        strategy=strategy, out="" if out is None else f", out_strategy={out!r}", table=table,
        rows=table[0], indices=indices, result=tuple(indices) + tuple(table[1:]))))
    return compile_model(str(path), dump=False)


def forward_comm(program: Any, rank: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    return [(n.op, tuple(n.attrs["rank_list"])) for n in program.rank_graph(rank).nodes
            if n.op in ("AllReduce", "ReduceScatter") and not n.scope.startswith("Gradients")]


@pytest.mark.parametrize("out,kind", [(None, "AllReduce"), (((4, 2, 1),), "ReduceScatter")],
                         ids=["allreduce", "reducescatter"])
def test_split_axis_and_split_indices(tmp_path: Any, out: tuple | None, kind: str) -> None:
    """((2, 1), (2, 2)) on 8 devices: the device matrix is [2, 2, 2, 1] (the indices' splits
    first); ranks 0 and 1 hold the same index block and the two halves of the table, so the
    partial lookups are summed over (0, 1), (2, 3), ..."""
    program = compile_gather(tmp_path, ((2, 1), (2, 2)), (16, 8), (4, 8), out)
    assert forward_comm(program, 0)[0] == (kind, (0, 1))
    assert forward_comm(program, 6)[0] == (kind, (6, 7))
    report = check(program)
    assert report.ok(), report.errors


@pytest.mark.parametrize("strategy,indices,group", [
    (((2,), (4,)), (8,), (0, 1)),
    (((8,), (1,)), (8,), tuple(range(8))),
], ids=["split_indices", "whole_indices"])
def test_one_dim_table_with_its_axis_split(tmp_path: Any, strategy: tuple, indices: tuple,
                                           group: tuple) -> None:
    program = compile_gather(tmp_path, strategy, (16,), indices)
    assert forward_comm(program)[0] == ("AllReduce", group)
    report = check(program)
    assert report.ok(), report.errors


def test_the_searches_enumerate_what_mindspore_generates() -> None:
    """MindSpore's auto-parallel strategy generation filters out a split gathered axis with
    split indices but for the shard-batch-and-axis mode; the searches keep doing so."""
    from pcompile.ir.sharding import OpContext
    from pcompile.ir.types import DType, TensorType
    from pcompile.passes.search.candidates import candidate_strategies

    ctx = OpContext("Gather", [TensorType(DType.float32, (16, 8)),
                               TensorType(DType.int32, (4, 8))],
                    TensorType(DType.float32, (4, 8, 8)), {"axis": 0, "batch_dims": 0}, 8)
    got = [s.strategy for s in candidate_strategies(ctx)]
    assert ((4, 1), (2, 1)) in got
    assert ((2, 1), (4, 1)) in got
    assert ((2, 1), (2, 2)) not in got and ((2, 1), (2, 1)) not in got


def test_split_indices_with_repeated_calculation_are_refused(tmp_path: Any) -> None:
    """((2, 1), (2, 1)) uses 4 of 8 devices: refused with one message, as MindSpore does."""
    from pcompile.ir.errors import PcompileError

    with pytest.raises(PcompileError, match="must use every device"):
        compile_gather(tmp_path, ((2, 1), (2, 1)), (16, 8), (4, 8))


def test_split_axis_and_split_indices_train_like_one_device(tmp_path: Any) -> None:
    """The same Gather trained two steps: the table's gradient (GatherGrad of the ranks'
    index blocks) and its update equal the single-device program's."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(MODEL.format(
        strategy=((2, 1), (2, 2)), out="", table=(16, 8), rows=16, indices=(4, 8),
        result=(4, 8, 8))) + textwrap.dedent("""

        def loss():
            return nn.MSELoss()


        def labels():
            return (np.random.default_rng(7).standard_normal((4, 8, 8)).astype(np.float32),)


        def optimizer(params):
            return nn.SGD(params, 0.1)
        """))
    program = compile_model(str(path), dump=False)
    assert program.training
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.errors)
