"""Seed `parallel-context-interfaces.md`, fusion: parameters carry a fusion id (`comm_fusion`,
set per parameter or for a whole Cell with `set_comm_fusion`); the gradient AllReduces of
parameters with the same id (and group and dtype) are fused into one collective per bucket.

    pcompile examples/comm_fusion.py --devices 8

Look at `saved_graph/rank_0/*comm_fusion*.ir`: one AllReduce named `allreduce_fusion` carries
both weights' gradients (`members: (weight2, weight1)`); buckets are numbered from 1.
"""

import numpy as np

from pcompile import Parameter, Tensor, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel",
                          comm_fusion={"allreduce": {"mode": "auto", "config": None}})


class Net(nn.Cell):
    """Net definition"""

    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = ops.MatMul()
        self.fc2 = ops.MatMul()
        self.p1 = Parameter(Tensor(np.ones([48, 64]).astype(np.float32)), name="weight1")
        self.p1.comm_fusion = 2
        self.p2 = Parameter(Tensor(np.ones([64, 16]).astype(np.float32)), name="weight2")

    def construct(self, x, y):
        x = self.fc1(x, self.p1)
        x = self.fc2(x, self.p2)
        return x - y


class Square(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mean = ops.ReduceMean()

    def construct(self, diff):
        return self.mean(diff * diff)


def model():
    return Net().set_comm_fusion(2)


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 48)).astype(np.float32) / 48,
            rng.standard_normal((16, 16)).astype(np.float32))


def loss():
    return Square()


def labels():
    return ()


def optimizer(params):
    return nn.SGD(params, 1e-3)
