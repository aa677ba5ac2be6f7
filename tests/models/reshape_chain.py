"""A Reshape chain between a configured op and an unconfigured one (after MindSpore's
test_auto_parallel_reshape.py, test_reshape_depend_reshape, without its Depend): Mul ((8, 1),
(8, 1)) of y [256, 48] by a weight, Reshape to (96, 32, 4), Reshape to (128, 96), then an
unconfigured ReLU and the loss."""

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = Parameter(initializer("normal", [256, 48]), "w")
        self.mul = ops.Mul().shard(((8, 1), (8, 1)))
        self.reshape1 = ops.Reshape()
        self.reshape2 = ops.Reshape()
        self.relu2 = ops.ReLU()

    def construct(self, y):
        out = self.mul(y, self.weight)
        out = self.reshape1(out, (96, 32, 4))
        out = self.reshape2(out, (128, 96))
        return self.relu2(out)


def model():
    set_seed(3)
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((256, 48)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((128, 96)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, 1e-2)
