"""A strategy-less op whose first operand is a scalar gets MindSpore's batch-parallel default
on its first operand that has dims: `ops.mul(2.5, x)` splits x's batch as `ops.mul(x, 2.5)`
does (MindSpore's batch strategy is empty for a scalar and dim 0 split for the others). It was
left whole, x gathered onto every rank (issue 35: DeepSeek's routed_scaling_factor)."""

from __future__ import annotations

from typing import Any

from pcompile.compiler.driver.plan import read_plan
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, initializer, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [8, 8]), "w")
        self.mm = ops.MatMul().shard(((8, 1), (1, 1)))
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        return self.loss(ops.mul(2.5, self.mm(x, self.w)), y)


def model():
    return Net()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 8)).astype(np.float32),
            rng.standard_normal((16, 8)).astype(np.float32))
"""


def test_a_scalar_first_operand_keeps_the_batch_split(tmp_path: Any) -> None:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    program = compile_model(str(path), devices=8, out_dir=str(tmp_path / "out"), save_graphs=0)
    muls = [n for n in program.state.graph.nodes if n.op == "Mul"]
    assert [n.parallel.in_strategy for n in muls] == [((), (8, 1))]
    moved = [r.op for r in read_plan(str(tmp_path / "out")).collectives["0"]
             if r.op in ("AllGather", "ReduceScatter", "AlltoAll")]
    assert moved == []  # the product stays split by the batch
    assert check(program).ok()
