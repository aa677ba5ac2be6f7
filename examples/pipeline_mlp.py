"""Pipeline parallelism: a 4-stage MLP, each stage a 2-way model-parallel block, on 8 devices.

Stage s owns ranks [2s, 2s+2); inside a stage each block splits its first weight by columns
and its second by rows (one AllReduce per block), as Megatron's MLP. `model()` returns
`nn.PipelineCell(nn.WithLossCell(net, loss_fn), micro_size)`: every step runs MICRO
micro-batches through the 4 stages in the 1F1B order (`pipeline_config`), and the loss is the
mean of the micro-batches' losses. The loss function has no stage: it follows its data into
the last stage.

    pcompile examples/pipeline_mlp.py --devices 8
    PIPE_MICRO=8 PIPE_SCHEDULER=gpipe pcompile examples/pipeline_mlp.py --devices 8 --run

PIPE_STAGES (default 4), PIPE_MICRO (4), PIPE_SCHEDULER (1f1b) and PIPE_MP (2, the
model-parallel ways inside a stage) change the plan; PIPE_BATCH (16), PIPE_HIDDEN (32) and
PIPE_BLOCKS (per stage, 1) the model. PIPE_CHUNKS=v > 1 interleaves the stages: the network
gets v times the blocks, block i goes to chunk c = i // PIPE_BLOCKS, which runs on stage
c % STAGES as segment c // STAGES (`pipeline_segment`), and `pipeline_interleave` is set:

    PIPE_CHUNKS=2 PIPE_MICRO=4 pcompile examples/pipeline_mlp.py --devices 8
"""

import os

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

STAGES = int(os.environ.get("PIPE_STAGES", "4"))
MICRO = int(os.environ.get("PIPE_MICRO", "4"))
MP = int(os.environ.get("PIPE_MP", "2"))
BATCH = int(os.environ.get("PIPE_BATCH", "16"))
HIDDEN = int(os.environ.get("PIPE_HIDDEN", "32"))
BLOCKS = int(os.environ.get("PIPE_BLOCKS", "1"))
CHUNKS = int(os.environ.get("PIPE_CHUNKS", "1"))

set_auto_parallel_context(
    parallel_mode="semi_auto_parallel", pipeline_stages=STAGES, dataset_strategy="full_batch",
    pipeline_config={"pipeline_scheduler": os.environ.get("PIPE_SCHEDULER", "1f1b"),
                     "pipeline_interleave": CHUNKS > 1},
)


class Block(nn.Cell):
    """relu(x @ w1) @ w2: w1 split by columns, w2 by rows over the stage's MP devices."""

    def __init__(self, hidden):
        super().__init__()
        self.w1 = Parameter(initializer("normal", [hidden, 2 * hidden]), "w1")
        self.w2 = Parameter(initializer("normal", [2 * hidden, hidden]), "w2")
        self.matmul1 = ops.MatMul().shard(((1, 1), (1, MP)))
        self.relu = ops.ReLU().shard(((1, MP),))
        self.matmul2 = ops.MatMul().shard(((1, MP), (MP, 1)))
        self.add = ops.Add()

    def construct(self, x):
        h = self.relu(self.matmul1(x, self.w1))
        return self.add(x, self.matmul2(h, self.w2))


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([Block(HIDDEN) for _ in range(STAGES * CHUNKS * BLOCKS)])
        for i, block in enumerate(self.blocks):
            block.pipeline_stage = i // BLOCKS % STAGES
            block.pipeline_segment = i // BLOCKS // STAGES

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def model():
    set_seed(1)
    return nn.PipelineCell(nn.WithLossCell(MLP(), nn.MSELoss()), micro_size=MICRO)


def inputs():
    return (np.zeros((BATCH, HIDDEN), np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.05, momentum=0.9)


def dataset():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32) / 4)
    for _ in range(1000):
        yield x, y.astype(np.float32)
