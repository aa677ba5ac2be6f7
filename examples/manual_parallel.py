"""Seed `manual-parallel.md`: the user slices the batch by rank and all-reduces the loss.

The network reads `get_rank()` / `get_group_size()` at trace time, so each rank's graph is
traced separately (hybrid_parallel); every rank receives the whole batch and takes its part.
Parameter gradients are all-reduced over the ranks and averaged (`gradients_mean=True`), so 8
ranks train exactly like one device on the whole batch.

    pcompile examples/manual_parallel.py --devices 8
"""

import numpy as np

from pcompile import nn, ops, set_auto_parallel_context, set_seed
from pcompile.communication import get_group_size, get_rank, init

set_auto_parallel_context(parallel_mode="hybrid_parallel", gradients_mean=True)

BATCH_SIZE = 32
STEPS = 10


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense(28 * 28, 512)
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense(512, 512)
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense(512, 10)

    def construct(self, x):
        cur_rank, shard_size = get_rank(), BATCH_SIZE // get_group_size()
        x = x[cur_rank * shard_size:cur_rank * shard_size + shard_size]
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
        cur_rank, device_num = get_rank(), get_group_size()
        shard_size = BATCH_SIZE // device_num
        label = label[cur_rank * shard_size:cur_rank * shard_size + shard_size]
        loss_value = self.loss(data, label)
        loss_value = self.all_reduce(loss_value) / device_num
        return loss_value


def model():
    init()
    set_seed(1)
    return Network()


def inputs():
    return (np.zeros((BATCH_SIZE, 1, 28, 28), np.float32),)


def loss():
    return ReduceLoss()


def optimizer(params):
    return nn.SGD(params, 1e-2)


def dataset():
    rng = np.random.default_rng(0)
    means = rng.standard_normal((10, 1, 28, 28)).astype(np.float32)
    for _ in range(STEPS):
        labels = rng.integers(0, 10, BATCH_SIZE).astype(np.int32)
        images = means[labels] + 0.5 * rng.standard_normal((BATCH_SIZE, 1, 28, 28))
        yield images.astype(np.float32), labels
