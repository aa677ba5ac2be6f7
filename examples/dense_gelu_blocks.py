"""Seed `functional-operator-sharding.md`: three Dense/GELU/Dense blocks; block1 is sharded
with `Cell.shard` (input split on its second axis, dense2's weight split by rows).

    pcompile examples/dense_gelu_blocks.py --devices 8 --search sharding_propagation
"""

import numpy as np

from pcompile import nn, set_auto_parallel_context, set_seed

set_auto_parallel_context(
    parallel_mode="auto_parallel", search_mode="sharding_propagation", dataset_strategy="full_batch"
)


class BasicBlock(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(32, 32)
        self.gelu = nn.GELU()
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        # two dimensional input x
        x = self.dense1(x)
        x = self.gelu(x)
        x = self.dense2(x)
        return x


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.block1 = BasicBlock()
        self.block2 = BasicBlock()
        self.block3 = BasicBlock()

    def construct(self, x):
        x = self.block1(x)
        x = self.block2(x)
        x = self.block3(x)
        return x


class Net1(Net):
    def __init__(self):
        super().__init__()
        # slice input along the second axis and make output as data-parallel layout
        self.block1.shard(in_strategy=((1, 8),),
                          parameter_plan={'self.block1.dense2.weight': (8, 1)})


def model():
    set_seed(1)
    return Net1()


def inputs():
    return (np.random.default_rng(0).uniform(0, 1, (32, 32)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).uniform(0, 1, (32, 32)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, 1e-2)
