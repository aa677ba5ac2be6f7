"""Pipeline stages around what DeepSeek-V3's decoder layers share (issue 35): a value no
micro-batch computes (the causal mask, tiled in the first stage and read by every layer)
crossing into a later stage, the element of a multi-output op (RmsNorm's rstd) that the
backward reads in a later unit than the forward that made it, and a network that computes its
own loss from its inputs (no WithLossCell, dataset() yields the inputs only). pcompile refused
the data set ("must yield (input, label) tuples"), then found a cycle between the stages (the
constant's Send ran in the sender's last unit, its Receive in the last micro-batch's forward),
then failed writing the rank programs (the tuple held between units)."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)


class First(nn.Cell):  # stage 0: Dense then RmsNorm, and the mask later layers read

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(16, 16)
        self.out = nn.Dense(16, 16)
        self.norm = ops.RmsNorm(1e-6)
        self.gamma = Parameter(initializer("ones", (16,)), "gamma")
        self.tile = ops.Tile()
        self.mask = Tensor(np.triu(np.ones((1, 16), np.float32)))

    def construct(self, x):
        h = self.out(self.norm(self.dense(x), self.gamma)[0])
        return h, self.tile(self.mask, (x.shape[0], 1))


class Second(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(16, 16)
        self.mul = ops.Mul()

    def construct(self, h, mask):
        return self.mul(self.dense(h), mask)


class Net(nn.Cell):  # returns its own loss, as a causal LM does from its input ids

    def __init__(self):
        super().__init__()
        self.first = First()
        self.second = Second()
        self.square = ops.Square()
        self.mean = ops.ReduceMean()
        self.pipeline_stage = 1  # the loss
        self.first.pipeline_stage = 0
        self.second.pipeline_stage = 1

    def construct(self, x):
        h, mask = self.first(x)
        return self.mean(self.square(self.second(h, mask)))


def model():
    set_seed(3)
    return nn.PipelineCell(Net(), micro_size={micro})


def dataset():
    rng = np.random.default_rng(0)
    for _ in range(4):
        yield (rng.standard_normal((8, 16)).astype(np.float32),)


def inputs():
    return next(iter(dataset()))


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
"""


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_stage_constants_and_tuple_elements_train_like_one_device(tmp_path: Any,
                                                                   micro: int) -> None:
    path = tmp_path / "pipe_stage_constants.py"
    path.write_text(textwrap.dedent(MODEL.format(micro=micro)))
    program = compile_model(str(path), devices=4, dump=True, out_dir=str(tmp_path / "out"))
    assert program.state.pipelined
    assert (tmp_path / "out" / "rank_0" / "program.py").exists()  # the rank programs written
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.worst)
