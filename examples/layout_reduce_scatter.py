"""Seed `advanced-operator-parallel-layout.md`, first example: `Y = X * W` on 8 devices laid out
as (2, 2, 2) = ("dp", "sp", "mp"). X is split like the seed's tensor `a` (rows on "mp", columns
on ("sp", "dp")), W's rows like X's columns, and `out_strategy` puts the reduce axes on the
output's rows, so the partial products are combined by a ReduceScatter instead of an AllReduce.

    pcompile examples/layout_reduce_scatter.py --devices 8
"""

import numpy as np

from pcompile import Layout, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")


class DenseMatMulNet(nn.Cell):
    def __init__(self):
        super(DenseMatMulNet, self).__init__()
        layout = Layout((2, 2, 2), name=("dp", "sp", "mp"))
        in_strategy = (layout("mp", ("sp", "dp")), layout(("sp", "dp"), "None"))
        out_strategy = (layout(("mp", "sp", "dp"), "None"),)
        self.matmul1 = ops.MatMul.shard(in_strategy, out_strategy)

    def construct(self, x, w):
        y = self.matmul1(x, w)
        return y


def model():
    return DenseMatMulNet()


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 32)).astype(np.float32),
            rng.standard_normal((32, 16)).astype(np.float32))
