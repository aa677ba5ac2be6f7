"""MindSpore's test_auto_parallel_sapp_strided_slice.py: a parameter w1 [256, 64, 32] sliced to
[128, 64, 32], reshaped to (128, 2048) and used as the right operand of a MatMul with x
[128, 128]; recursive programming on 8 devices, full batch. With STRIDED_SLICE_LOSS=0 the
network output is the MatMul itself, as in MindSpore's test (no loss, nothing to train)."""

import os

import numpy as np

from pcompile import Parameter, Tensor, float32, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="recursive_programming",
                          dataset_strategy="full_batch")


class StridedSliceNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul()
        self.reshape = ops.Reshape()
        self.strided_slice = ops.StridedSlice()
        rng = np.random.default_rng(5)
        self.weight = Parameter(Tensor(rng.standard_normal((256, 64, 32)), dtype=float32), "w1")

    def construct(self, x):
        out = self.strided_slice(self.weight, (0, 0, 0), (128, 64, 32), (1, 1, 1))
        out = self.reshape(out, (128, 2048))
        return self.matmul(x, out)


def model():
    return StridedSliceNet()


def inputs():
    return (np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32),)


if os.environ.get("STRIDED_SLICE_LOSS", "1") == "1":
    def labels():
        return (np.random.default_rng(1).standard_normal((128, 2048)).astype(np.float32),)

    def loss():
        return nn.MSELoss()

    def optimizer(params):
        return nn.SGD(params, 1e-2)
