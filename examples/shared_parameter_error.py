"""Seed `parallel-context-interfaces.md`, parallel_mode: mul1 splits the shared weight into 8
slices by row, mul2 by column. The layouts of the weight in the two operators differ, so
compilation fails (parameters are stored sliced and never redistributed):

    pcompile examples/shared_parameter_error.py --devices 8
    pcompile: error: The parameter: weight1 has multiple users, but the TensorInfo are different...
"""

import numpy as np

from pcompile import Parameter, Tensor, float32, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")


class Net(nn.Cell):
    """Net definition"""

    def __init__(self):
        super(Net, self).__init__()
        self.mul1 = ops.Mul().shard(((8, 1), (8, 1)))
        self.mul2 = ops.Mul().shard(((1, 8), (1, 8)))
        self.weight = Parameter(Tensor(np.ones([16, 32]), dtype=float32), "weight1")

    def construct(self, x):
        out = self.mul1(x, self.weight)
        out = self.mul2(out, self.weight)
        return out


def model():
    return Net()


def inputs():
    return (np.ones((16, 32), np.float32),)
