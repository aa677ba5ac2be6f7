"""MindSpore's test_shard_layout.py ShardNet (tests/ut/python/parallel/), ported by imports:
`ms.shard(subnet, in_layout)` (or `Cell.shard` with a parameter_plan) around MatMul -> Add ->
MatMul, then a ReLU; sharding propagation from the shard's Identity. SHARD_CASE picks the case:
"ms" (Layout((2, 4, 1), ("dp", "sp", "mp")), in_layout ("dp", "mp"), 8 devices), "cell_plan"
(the same through Cell.shard with parameter_plan {"self.subnet.w1": ("mp", "sp")}) or
"interleaved" (Layout((2, 4, 2, 2), ("dp", "mp", "sp", "interleaved_parallel")), in_layout
(("dp", "interleaved_parallel", "mp"), "sp"), 16 devices)."""

import os

import numpy as np

from pcompile import Layout, Parameter, nn, ops, set_auto_parallel_context, shard

CASE = os.environ.get("SHARD_CASE", "ms")
set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          device_num=16 if CASE == "interleaved" else 8,
                          dataset_strategy="full_batch")
if CASE == "interleaved":
    LAYOUT = Layout((2, 4, 2, 2), ("dp", "mp", "sp", "interleaved_parallel"))
    IN_LAYOUT = (LAYOUT(("dp", "interleaved_parallel", "mp"), "sp"),)
else:
    LAYOUT = Layout((2, 4, 1), ("dp", "sp", "mp"))
    IN_LAYOUT = (LAYOUT("dp", "mp"),)
N = 64


class ShardSubNet(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(1)
        self.w1 = Parameter(r.standard_normal((N, N)).astype(np.float32), "w1")
        self.w2 = Parameter(r.standard_normal((N, N)).astype(np.float32), "w2")
        self.b = Parameter(r.standard_normal((N,)).astype(np.float32), "bias")
        self.matmul1 = ops.MatMul()
        self.add = ops.Add()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        y = self.matmul1(x, self.w1)
        y = self.add(y, self.b)
        return self.matmul2(y, self.w2)


class ShardNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.subnet = ShardSubNet()
        if CASE == "cell_plan":
            self.subnet.shard(IN_LAYOUT, parameter_plan={"self.subnet.w1": LAYOUT("mp", "sp")})
            self.subnet_shard = self.subnet
        else:
            self.subnet_shard = shard(self.subnet, IN_LAYOUT)
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.relu(self.subnet_shard(x))


def model():
    return ShardNet()


def inputs():
    return (np.random.default_rng(0).standard_normal((N, N)).astype(np.float32),)
