"""Seed `advanced-operator-parallel-layout.md`: the 784-512-512-10 MLP with Layout strategies,
SGD and cross-entropy, on synthetic MNIST-shaped data (28x28 images, 10 classes).

    pcompile examples/layout_mlp.py --devices 8 --parallel-mode semi_auto_parallel
"""

import numpy as np

from pcompile import (
    Layout,
    Parameter,
    float32,
    initializer,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")

BATCH_SIZE = 32
STEPS = 10


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = ops.Flatten()
        self.fc1_weight = Parameter(initializer("normal", [28 * 28, 512], float32), "fc1_weight")
        self.fc2_weight = Parameter(initializer("normal", [512, 512], float32), "fc2_weight")
        self.fc3_weight = Parameter(initializer("normal", [512, 10], float32), "fc3_weight")
        self.matmul1 = ops.MatMul()
        self.relu1 = ops.ReLU()
        self.matmul2 = ops.MatMul()
        self.relu2 = ops.ReLU()
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.flatten(x)
        x = self.matmul1(x, self.fc1_weight)
        x = self.relu1(x)
        x = self.matmul2(x, self.fc2_weight)
        x = self.relu2(x)
        logits = self.matmul3(x, self.fc3_weight)
        return logits


def model():
    set_seed(1)
    net = Network()
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    net.matmul1.shard((layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None")))
    net.relu1.shard(((4, 1),))
    layout2 = Layout((8,), ("tp",))
    net.matmul2.shard((layout2("None", "tp"), layout2("tp", "None")))
    net.relu2.shard(((8, 1),))
    return net


def inputs():
    return (np.zeros((BATCH_SIZE, 1, 28, 28), np.float32),)


def loss():
    return nn.CrossEntropyLoss()


def optimizer(params):
    return nn.SGD(params, 1e-2)


def dataset():
    """Synthetic MNIST-shaped data: each class has its own mean image, so the loss can fall."""
    rng = np.random.default_rng(0)
    means = rng.standard_normal((10, 1, 28, 28)).astype(np.float32)
    for _ in range(STEPS):
        labels = rng.integers(0, 10, BATCH_SIZE).astype(np.int32)
        images = means[labels] + 0.5 * rng.standard_normal((BATCH_SIZE, 1, 28, 28))
        yield images.astype(np.float32), labels
