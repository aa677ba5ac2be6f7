"""Comm-fusion test model (reference §6.2 UT): two backbones of six bias-free
Dense(WIDTH, WIDTH) + ReLU layers, i.e. 12 weights of WIDTH x WIDTH elements, MSE loss and
Momentum, data parallel in semi_auto_parallel (no strategies: every weight is replicated and
its gradient all-reduced over all devices).

Environment (read when the model is built):
* FUSION_WIDTH: layer width (default 128, i.e. 16384 elements per weight);
* FUSION_IDS: per-cell `set_comm_fusion` ids, e.g. "backbone2=2;backbone1.fc3=0".
"""

import os

import numpy as np

from pcompile import nn, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")

WIDTH = int(os.environ.get("FUSION_WIDTH", "128"))
BATCH = 16


class Backbone(nn.Cell):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Dense(width, width, "he_uniform", has_bias=False, activation="relu")
        self.fc2 = nn.Dense(width, width, "he_uniform", has_bias=False, activation="relu")
        self.fc3 = nn.Dense(width, width, "he_uniform", has_bias=False, activation="relu")
        self.fc4 = nn.Dense(width, width, "he_uniform", has_bias=False, activation="relu")
        self.fc5 = nn.Dense(width, width, "he_uniform", has_bias=False, activation="relu")
        self.fc6 = nn.Dense(width, width, "he_uniform", has_bias=False)

    def construct(self, x):
        x = self.fc3(self.fc2(self.fc1(x)))
        return self.fc6(self.fc5(self.fc4(x)))


class Net(nn.Cell):
    def __init__(self, width):
        super().__init__()
        self.backbone1 = Backbone(width)
        self.backbone2 = Backbone(width)

    def construct(self, x):
        return self.backbone2(self.backbone1(x))


def _apply_ids(net, spec):
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        path, value = item.split("=")
        cell = net
        for attr in path.split("."):
            cell = getattr(cell, attr)
        cell.set_comm_fusion(int(value))


def model():
    set_seed(1)
    net = Net(WIDTH)
    _apply_ids(net, os.environ.get("FUSION_IDS", ""))
    return net


def inputs():
    return (np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype(np.float32) * 0.5,)


def labels():
    return (np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.05, momentum=0.9)
