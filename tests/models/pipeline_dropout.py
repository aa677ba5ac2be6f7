"""Dropout under pipeline stages (issue 36): two stages of Dense then Dropout inside
`nn.PipelineCell` of PIPE_DROPOUT_MICRO (4) micro-batches, the batch split over a stage's
devices. Each micro-batch's copy of a Dropout draws its rows' bits of the whole batch, and the
step counter advances once a step, so the step equals the whole-batch single-device program."""

import os

import numpy as np

from pcompile import nn, set_auto_parallel_context, set_seed

MICRO = int(os.environ.get("PIPE_DROPOUT_MICRO", "4"))
set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(16, 16)
        self.d1 = nn.Dropout(p=0.3)
        self.l2 = nn.Dense(16, 8)
        self.d2 = nn.Dropout(p=0.5)
        for cell, stage in ((self.l1, 0), (self.d1, 0), (self.l2, 1), (self.d2, 1)):
            cell.pipeline_stage = stage

    def construct(self, x):
        return self.d2(self.l2(self.d1(self.l1(x))))


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)


def inputs():
    return (np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
