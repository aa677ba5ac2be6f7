"""A model whose one weight would take 4 GB ([320, 3200000] float32): compiling it must not
allocate it (tests/e2e/test_scale.py)."""

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")

IN, OUT = 320, 3_200_000


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [IN, OUT]), "w")
        self.matmul = ops.MatMul().shard(((1, 1), (1, 8)))
        self.reduce = ops.ReduceMean(keep_dims=False)

    def construct(self, x):
        return self.reduce(self.matmul(x, self.w))


def model():
    return Net()


def inputs():
    return (np.ones((8, IN), np.float32),)


def loss():
    return nn.MSELoss()


def labels():
    return (np.zeros((), np.float32),)


def optimizer(params):
    return nn.Adam(params, learning_rate=1e-3)
