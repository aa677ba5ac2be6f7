"""Batch normalisation in training under pipeline stages (issue 36): two stages, BatchNorm1d
in the first, inside `nn.PipelineCell` of PIPE_BN_MICRO (4) micro-batches, the batch split over
a stage's devices. As MindSpore's PipelineCell, each micro-batch is normalised by its own
statistics and the moving mean and variance move once per micro-batch, in order; the check's
single-device program runs the micro-batches in turn."""

import os

import numpy as np

from pcompile import nn, set_auto_parallel_context, set_seed

MICRO = int(os.environ.get("PIPE_BN_MICRO", "4"))
set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.l2 = nn.Dense(16, 8)
        for cell, stage in ((self.l1, 0), (self.bn, 0), (self.l2, 1)):
            cell.pipeline_stage = stage

    def construct(self, x):
        return self.l2(self.bn(self.l1(x)))


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)


def inputs():
    return (np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32) * 2 + 1,)


def labels():
    return (np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.05, momentum=0.9)
