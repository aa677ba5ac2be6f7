"""MindSpore's test_auto_parallel_out_strategy_propagation.py, test_out_strategy_propagate1:
a MatMul ((4, 2), (1, 2)) with transpose_b, then an Add of an input and a ReLU, on 8 devices
under sharding propagation with fully_use_devices=True (set by the test that compiles it).
MindSpore's test asserts the Add ((4, 2), (4, 2))."""

import numpy as np

from pcompile import Parameter, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          device_num=8, dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)))
        self.add = ops.Add()
        self.relu = ops.ReLU()
        w = np.random.default_rng(2).standard_normal((8, 32)).astype(np.float32)
        self.mul_weight = Parameter(w, "w")

    def construct(self, x, b):
        return self.relu(self.add(self.matmul(x, self.mul_weight), b))


def model():
    return Net()


def inputs():
    r = np.random.default_rng(0)
    return (r.standard_normal((64, 32)).astype(np.float32),
            r.standard_normal((64, 8)).astype(np.float32))
