"""A strategy-less Cast of a constant (a rotary table, a swap matrix) keeps the constant whole
on every rank, as MindSpore folds it into a new constant: no split and no AllGather back."""

from __future__ import annotations

from typing import Any

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, initializer, set_auto_parallel_context
import pcompile as ms

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 16]))
        self.swap = Tensor(np.eye(16)[::-1].copy(), ms.float32)
        self.cast = ops.Cast()
        self.rotate = ops.MatMul().shard(((8, 1), (1, 1)))
        self.mm = ops.MatMul().shard(((8, 1), (1, 1)))
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        h = self.rotate(x, self.cast(self.swap, ms.float16).astype(ms.float32))
        return self.loss(self.mm(h, self.w), y)


def model():
    return Net()


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 16)).astype(np.float32),
            rng.standard_normal((16, 16)).astype(np.float32))
"""


def test_a_constants_cast_stays_whole(tmp_path: Any) -> None:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    program = compile_model(str(path), devices=8, out_dir=str(tmp_path / "out"))
    casts = [n for n in program.state.graph.nodes if n.op == "Cast"]
    assert casts and all(n.parallel.in_strategy == ((1, 1),) for n in casts)
    moved = [n.op for n in program.state.rank_graphs[0].nodes
             if n.op in ("AllGather", "AllReduce", "AlltoAll", "ReduceScatter")]
    assert moved == ["AllReduce"]  # the mean of the loss only
    assert check(program).ok()
