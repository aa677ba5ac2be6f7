"""Seed `functional-operator-sharding.md`, `Net2`: ms.shard on a Cell under a new attribute name,
Cell.shard on another block, and a sharded function (dense + bias + relu) with None entries.
The strategies of every other op come from sharding propagation.

    pcompile examples/functional_shard.py --devices 8
"""

import numpy as np

import pcompile as ms
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          dataset_strategy="full_batch")


class BasicBlock(nn.Cell):
    def __init__(self):
        super(BasicBlock, self).__init__()
        self.dense1 = nn.Dense(32, 32)
        self.gelu = nn.GELU()
        self.dense2 = nn.Dense(32, 32)

    def construct(self, x):
        x = self.dense1(x)
        x = self.gelu(x)
        x = self.dense2(x)
        return x


def dense_relu(x, weight, bias):
    x = ops.matmul(x, weight)
    x = ops.bias_add(x, bias)
    x = ops.relu(x)
    return x


class Net2(nn.Cell):
    def __init__(self):
        super(Net2, self).__init__()
        self.block1 = BasicBlock()
        self.block2 = BasicBlock()
        self.block3 = BasicBlock()
        # set the return function of shard a different name with the Cell instance
        self.block1_graph = ms.shard(self.block1, in_strategy=((8, 1),),
                                     parameter_plan={'self.block1.dense2.weight': (8, 1)})
        self.block2.shard(in_strategy=((1, 8),))
        self.weight = Parameter(initializer("normal", [32, 16]), "weight")
        self.bias = Parameter(initializer("zeros", [16]), "bias")
        self.dense_relu = ms.shard(dense_relu, in_strategy=((4, 2), None, None))

    def construct(self, x):
        x = self.block1_graph(x)
        x = self.block2(x)
        x = self.block3(x)
        return self.dense_relu(x, self.weight, self.bias)


def model():
    set_seed(2)
    return Net2()


def inputs():
    return (np.random.default_rng(0).uniform(0, 1, (32, 32)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).uniform(0, 1, (32, 16)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, 1e-2)
