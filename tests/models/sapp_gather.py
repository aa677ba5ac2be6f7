"""MindSpore's test_auto_parallel_sapp_gather.py: recursive programming on 8 devices, full
batch. SAPP_GATHER picks the case: "1" a table x [64, 64] gathered by constant indices
[64, 64], then Reshape (128, 2048) and a MatMul with y [2048, 64]; "2" the same with x
[1024, 128] and indices [2, 1024]; "3" a 1-D table [128] gathered by indices [4]. The
indices are ones, as in MindSpore's test."""

import os

import numpy as np

from pcompile import Tensor, int32, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="recursive_programming",
                          device_num=8, dataset_strategy="full_batch")

CASE = os.environ.get("SAPP_GATHER", "1")
TABLE, INDICES = {"1": ((64, 64), (64, 64)), "2": ((1024, 128), (2, 1024)),
                  "3": ((128,), (4,))}[CASE]


class GatherNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul()
        self.reshape = ops.Reshape()
        self.gatherv2 = ops.Gather()
        self.index = Tensor(np.ones(INDICES), dtype=int32)

    def construct(self, x, *y):
        out = self.gatherv2(x, self.index, 0)
        if y:
            out = self.matmul(self.reshape(out, (128, 2048)), y[0])
        return out


def model():
    return GatherNet()


def inputs():
    r = np.random.default_rng(0)
    x = r.standard_normal(TABLE).astype(np.float32)
    return (x,) if CASE == "3" else (x, r.standard_normal((2048, 64)).astype(np.float32))
