"""A statistic accumulated in the forward under pipeline stages (issue 35 item 2): two stages
of a MatMul block, each counting its outputs' column sums into a Parameter with `AssignAdd`
(split 4 ways, as its MatMul's columns), inside `nn.PipelineCell` of PIPE_STATE_MICRO (4)
micro-batches. MindSpore runs the assignment once per micro-batch: the step's count is the sum
over the micro-batches, the whole batch's, as one device counts it."""

import os

import numpy as np

from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context, set_seed

MICRO = int(os.environ.get("PIPE_STATE_MICRO", "4"))
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2,
                          dataset_strategy="full_batch")


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 16]), "w")
        self.count = Parameter(Tensor(np.zeros((16,), np.float32)), "count", requires_grad=False)
        self.matmul = ops.MatMul().shard(((1, 1), (1, 4)))
        self.sum = ops.ReduceSum().shard(((1, 4),))
        self.assign_add = ops.AssignAdd().shard(((4,), (4,)))

    def construct(self, x):
        h = self.matmul(x, self.w)
        self.assign_add(self.count, self.sum(h, 0))
        return h


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(2)
        self.a = Block()
        self.b = Block()
        self.a.pipeline_stage = 0
        self.b.pipeline_stage = 1

    def construct(self, x):
        return self.b(self.a(x))


def model():
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)


def optimizer(params):
    return nn.SGD(params, learning_rate=0.05)


def inputs():
    return (np.zeros((16, 16), np.float32),)


def dataset():
    rng = np.random.default_rng(0)
    for _ in range(10):
        yield (rng.standard_normal((16, 16)).astype(np.float32),
               rng.standard_normal((16, 16)).astype(np.float32))
