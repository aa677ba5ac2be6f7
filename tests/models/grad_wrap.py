"""A GradWrap cell as MindSpore's parallel tests write it: the gradients of a network with its
loss with respect to its inputs and weights (`GradOperation(get_all=True, get_by_list=True)`),
under model-parallel strategies."""

import numpy as np

from pcompile import (
    Parameter,
    ParameterTuple,
    initializer,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(3)
        self.w1 = Parameter(initializer("normal", [16, 32]), "w1")
        self.w2 = Parameter(initializer("normal", [32, 16]), "w2")
        self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.matmul2 = ops.MatMul().shard(((4, 2), (2, 1)))
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)


class GradWrap(nn.Cell):
    def __init__(self, network):
        super().__init__()
        self.network = network
        self.weights = ParameterTuple(network.trainable_params())
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)

    def construct(self, x, y):
        return self.grad(self.network, self.weights)(x, y)


def model():
    return GradWrap(nn.WithLossCell(Net(), nn.MSELoss()))


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 16)).astype(np.float32),
            rng.standard_normal((16, 16)).astype(np.float32))
