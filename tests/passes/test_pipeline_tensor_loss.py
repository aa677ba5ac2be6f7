"""nn.PipelineCell around a network whose loss is not reduced to a scalar (MindSpore's
comm-fusion-with-pipeline test compiles one, twice). As MindSpore does, the step is
differentiated with a sensitivity of ones: its objective is the sum of the loss over the whole
batch (each micro-batch's sum, the micro-batches together). pcompile refused it ("the loss
returned inside nn.PipelineCell ... must be a scalar")."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                          comm_fusion={{"allreduce": {{"mode": "size", "config": 32}}}})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(16, 16)
        self.l2 = nn.Dense(16, 8)
        self.l1.pipeline_stage = 0
        self.l2.pipeline_stage = 1

    def construct(self, x):
        return self.l2(self.l1(x))


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss(reduction="none")),
                           micro_size={micro})


def inputs():
    return (np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
"""


@pytest.mark.parametrize("micro", [1, 2])
def test_a_pipeline_trains_a_loss_that_is_not_a_scalar(tmp_path: Any, micro: int) -> None:
    path = tmp_path / "pipe_tensor_loss.py"
    path.write_text(textwrap.dedent(MODEL.format(micro=micro)))
    first = compile_model(str(path), devices=4, dump=False)
    again = compile_model(str(path), devices=4, dump=False)  # MindSpore's test compiles twice
    assert first.state.pipelined and again.state.pipelined
    report = check(first, steps=2)
    assert report.ok(), (report.losses, report.worst)
