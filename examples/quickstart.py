"""Seed `auto-parallel-quickstart.md`: one hidden layer, MSE loss, Momentum, 8 devices.

Only `matmul` is configured (((2, 4), (4, 1))); with `--search sharding_propagation` the search
derives relu's and matmul2's strategies. The global batch is 16 (2 per device on 8 devices,
`dataset_strategy="data_parallel"`).

    pcompile examples/quickstart.py --devices 8 --search sharding_propagation
"""

import numpy as np

from pcompile import (
    Parameter,
    initializer,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)

set_auto_parallel_context(
    parallel_mode="auto_parallel", search_mode="sharding_propagation",
    dataset_strategy="data_parallel",
)

STEP_PER_EPOCH = 4
BATCH_SIZE = 16  # global: 2 per device on 8 devices
IN_DIM, HIDDEN_DIM, OUT_DIM = 32, 16, 16


def get_dataset(batch_size, in_dim, out_dim, step_per_epoch):
    np.random.seed(1)
    input_data = np.random.rand(batch_size, in_dim).astype(np.float32)
    label_data = np.random.rand(batch_size, out_dim).astype(np.float32)

    def generate():
        for _ in range(step_per_epoch):
            yield (input_data, label_data)

    return generate


class Net(nn.Cell):
    """define net"""

    def __init__(self, in_dim, hidden_dim, out_dim):
        super().__init__()
        self.in_dim = in_dim
        self.hidden_dim = hidden_dim
        self.out_dim = out_dim
        self.weight = Parameter(initializer("normal", [self.in_dim, self.hidden_dim]), "w")
        self.weight2 = Parameter(initializer("normal", [self.hidden_dim, self.out_dim]), "w2")
        self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        out = self.matmul(x, self.weight)
        out = self.relu(out)
        out = self.matmul2(out, self.weight2)
        return out


def model():
    set_seed(1)
    return Net(IN_DIM, HIDDEN_DIM, OUT_DIM)


def inputs():
    return (np.zeros((BATCH_SIZE, IN_DIM), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.2, momentum=0.1)


def dataset():
    return get_dataset(BATCH_SIZE, IN_DIM, OUT_DIM, STEP_PER_EPOCH)()
