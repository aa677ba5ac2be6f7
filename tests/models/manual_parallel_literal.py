"""Seed `manual-parallel.md` ported by changing imports only: `init()`, `cur_rank = get_rank()`
and the shard size at module level, as every MindSpore process runs the script as its own rank
(the model-file functions at the end replace the seed's training tail)."""

import numpy as np

from pcompile import nn, ops, set_auto_parallel_context
from pcompile.communication import get_group_size, get_rank, init

set_auto_parallel_context(parallel_mode="hybrid_parallel")
init()
cur_rank = get_rank()
batch_size = 32
device_num = get_group_size()
shard_size = batch_size // device_num


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense(28*28, 512)
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense(512, 512)
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense(512, 10)

    def construct(self, x):
        x = x[cur_rank*shard_size:cur_rank*shard_size + shard_size]
        x = self.flatten(x)
        x = self.layer1(x)
        x = self.relu1(x)
        x = self.layer2(x)
        x = self.relu2(x)
        logits = self.layer3(x)
        return logits


class ReduceLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.loss = nn.CrossEntropyLoss()
        self.all_reduce = ops.AllReduce()

    def construct(self, data, label):
        label = label[cur_rank*shard_size:cur_rank*shard_size + shard_size]
        loss_value = self.loss(data, label)
        loss_value = self.all_reduce(loss_value) / device_num
        return loss_value


def model():
    return Network()


def inputs():
    return (np.zeros((batch_size, 1, 28, 28), np.float32),)


def loss():
    return ReduceLoss()


def optimizer(params):
    return nn.SGD(params, 1e-2)


def dataset():
    rng = np.random.default_rng(0)
    means = rng.standard_normal((10, 1, 28, 28)).astype(np.float32)
    for _ in range(4):
        labels = rng.integers(0, 10, batch_size).astype(np.int32)
        images = means[labels] + 0.5 * rng.standard_normal((batch_size, 1, 28, 28))
        yield images.astype(np.float32), labels
