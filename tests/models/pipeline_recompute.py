"""Recompute under pipeline stages (issue 35): four blocks (Dense, GeLU, Dense, times the
block's input), two a stage, and a head in stage 1, inside `nn.PipelineCell` of PIPE_RC_MICRO
(4) micro-batches under PIPE_RC_SCHEDULER (1f1b). PIPE_RC_MARK: `full` (the default,
`Cell.recompute()` on every block), `selective` (`Primitive.recompute()` on each GeLU) or `none`.
PIPE_RC_CHUNKS=2: interleaved stages, block i on stage i % 2 and segment i // 2, the head on
stage 1 of segment 1.
Each recomputed op is computed again in its stage, in the backward unit of its micro-batch; the
step equals the single-device program's."""

import os

import numpy as np

from pcompile import nn, ops, set_auto_parallel_context, set_seed

MICRO = int(os.environ.get("PIPE_RC_MICRO", "4"))
MARK = os.environ.get("PIPE_RC_MARK", "full")
CHUNKS = int(os.environ.get("PIPE_RC_CHUNKS", "1"))
set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                          pipeline_config={"pipeline_scheduler":
                                           os.environ.get("PIPE_RC_SCHEDULER", "1f1b"),
                                           "pipeline_interleave": CHUNKS > 1})


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.up = nn.Dense(16, 32)
        self.act = ops.GeLU()
        self.down = nn.Dense(32, 16)
        self.mul = ops.Mul()

    def construct(self, x):
        return self.mul(self.down(self.act(self.up(x))), x)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([Block() for _ in range(4)])
        self.head = nn.Dense(16, 8)
        for i, block in enumerate(self.blocks):
            block.pipeline_stage = i % 2 if CHUNKS > 1 else i // 2
            if CHUNKS > 1:
                block.pipeline_segment = i // 2
            if MARK == "full":
                block.recompute()
            elif MARK == "selective":
                block.act.recompute()
        self.head.pipeline_stage = 1
        if CHUNKS > 1:
            self.head.pipeline_segment = 1

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)


def inputs():
    return (np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
