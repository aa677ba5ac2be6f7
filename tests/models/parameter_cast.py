"""MindSpore's test_auto_parallel_parameter_cast.py (test_common_parameter): one float16
parameter cast twice to float32, two MatMuls with it and a third of their results;
dynamic programming on 8 devices, full batch. MindSpore 2.10 names these MatMul-op1 (matmul1),
MatMul-op0 (matmul2) and MatMul-op2 (matmul3), in topological order. The network's output is
matmul3 itself (MindSpore's test adds only a virtual loss)."""

import numpy as np

from pcompile import (
    Parameter,
    Tensor,
    float32,
    nn,
    ops,
    set_algo_parameters,
    set_auto_parallel_context,
)

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="dynamic_programming",
                          dataset_strategy="full_batch")
set_algo_parameters(elementwise_op_strategy_follow=True)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.matmul1 = ops.MatMul()
        self.matmul2 = ops.MatMul()
        self.matmul3 = ops.MatMul()
        self.weight1 = Parameter(Tensor(np.ones([64, 64]).astype(np.float16) * 0.01), "w",
                                 requires_grad=True)
        self.cast1 = ops.Cast()
        self.cast2 = ops.Cast()

    def construct(self, x, y):
        m1 = self.matmul1(x, self.cast1(self.weight1, float32))
        m2 = self.matmul2(y, self.cast2(self.weight1, float32))
        return self.matmul3(m2, m1)


def model():
    return Net()


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((64, 64)).astype(np.float32),
            rng.standard_normal((64, 64)).astype(np.float32))


