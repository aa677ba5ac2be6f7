"""A weight cast to bfloat16 before its MatMul (mixed precision as mindformers writes it): the
weight is stored split by the MatMul strategy and the program runs in bfloat16."""

import numpy as np

from pcompile import Parameter, bfloat16, float32, initializer, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [64, 128]), "w")
        self.cast = ops.Cast()
        self.cast2 = ops.Cast()
        self.mm = ops.MatMul().shard(((2, 1), (1, 4)))
        self.mean = ops.ReduceMean()
    def construct(self, x):
        y = self.mm(self.cast(x, bfloat16), self.cast(self.w, bfloat16))
        return self.mean(self.cast2(y, float32))
def model(): return Net()
def inputs(): return (np.ones((16, 64), np.float32),)
def loss(): return nn.MSELoss()
def labels(): return (np.zeros((), np.float32),)
def optimizer(params): return nn.SGD(params, 0.1)
