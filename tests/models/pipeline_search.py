"""An MLP of PIPE_SEARCH_BLOCKS (4) residual blocks in PIPE_SEARCH_STAGES (2) pipeline stages
(blocks [0, B/2) on stage 0, the rest on stage 1; one stage: gradient accumulation over the
micro-batches), no strategy given: `--search ilp` lays every op
out inside a stage's devices and costs each stage (passes/search/stages.py). The scheduler
is PIPE_SEARCH_SCHEDULER (1f1b), NN.PipelineCell's micro size PIPE_SEARCH_MICRO (4)."""

import os

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

BLOCKS = int(os.environ.get("PIPE_SEARCH_BLOCKS", "4"))
MICRO = int(os.environ.get("PIPE_SEARCH_MICRO", "4"))
STAGES = int(os.environ.get("PIPE_SEARCH_STAGES", "2"))
HIDDEN = 64
set_auto_parallel_context(
    parallel_mode="auto_parallel", search_mode="ilp", pipeline_stages=STAGES,
    dataset_strategy="full_batch",
    pipeline_config={"pipeline_scheduler": os.environ.get("PIPE_SEARCH_SCHEDULER", "1f1b")})


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = Parameter(initializer("normal", [HIDDEN, 4 * HIDDEN]), "w1")
        self.w2 = Parameter(initializer("normal", [4 * HIDDEN, HIDDEN]), "w2")
        self.matmul1 = ops.MatMul()
        self.matmul2 = ops.MatMul()
        self.relu = ops.ReLU()

    def construct(self, x):
        return x + self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(3)
        self.blocks = nn.CellList([Block() for _ in range(BLOCKS)])
        for i, block in enumerate(self.blocks):
            block.pipeline_stage = STAGES * i // BLOCKS

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def model():
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)


def optimizer(params):
    return nn.Adam(params, learning_rate=1e-3)


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((32, HIDDEN)).astype(np.float32),
            rng.standard_normal((32, HIDDEN)).astype(np.float32))
