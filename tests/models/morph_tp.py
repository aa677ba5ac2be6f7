"""A Morph region whose collectives run over a strided group that create_group made, as
mindformers' 3-D tensor-parallel expert function names its groups (`_get_group_name_list_by_
dev_matrix`: the ranks along one device-matrix axis, named by a hash of their list).

Layout (tp, dp) = (2, devices / 2): rank = t * dp + d, so a rank's tp group is the 2 ranks
d and dp + d (strided: [0, 4] of 8 on rank 0, [3, 7] on rank 7). The region computes x @ w for
the rank's rows: an AllGather of the group's rows, the product with the rank's columns of w,
and an AlltoAll that gives each rank its own rows with every column back; autodiff runs the
AllGather's ReduceScatter (x is scaled by a weight first) and the AlltoAll back over the
same group. One device runs the
function on the whole tensors (a group of one).
"""

import hashlib

import numpy as np

from pcompile import (
    Layout,
    Parameter,
    Tensor,
    get_auto_parallel_context,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)
from pcompile.communication import create_group, get_rank

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")

ROWS, HIDDEN, OUT = 16, 4, 6
STEPS = 2


def tp_group(tp, dp):
    """The ranks along the tp axis of dev matrix (tp, dp) through this rank."""
    rank = get_rank()
    ranks = [t * dp + rank % dp for t in range(tp)]
    name = hashlib.sha256("-".join(map(str, ranks)).encode()).hexdigest()[:48]
    create_group(name, ranks)
    return name


def matmul_over_tp(x, w, group, tp):
    rows = ops.AllGather(group)(x)                             # (tp * r, h), members in order
    y = ops.matmul(rows, w)                                    # (tp * r, OUT / tp)
    return ops.AlltoAll(tp, 0, 1, group)(y)                    # (r, OUT)


def infer_shape(x, w, *_):
    return (x[0], w[1])


def infer_dtype(x, *_):
    return x


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        devices = int(get_auto_parallel_context("device_num"))
        self.tp = 2 if devices > 1 else 1
        dp = devices // self.tp
        self.group = tp_group(self.tp, dp)
        rng = np.random.default_rng(3)
        self.w = Parameter(Tensor(rng.standard_normal((HIDDEN, OUT)).astype(np.float32)), "w")
        layout = Layout((self.tp, dp), ("tp", "dp"))
        self.region = ops.Morph(matmul_over_tp, infer_shape, infer_dtype)
        self.region.add_prim_attr("self_define_shard", True)
        self.region.shard(in_strategy=(layout(("tp", "dp"), "None"), layout("None", "tp")),
                          out_strategy=(layout(("tp", "dp"), "None"),))
        self.tanh = ops.Tanh()
        # a weight before the region: the AllGather's gradient (a ReduceScatter) is computed
        self.scale = Parameter(Tensor(np.linspace(0.5, 1.5, HIDDEN).astype(np.float32)), "scale")
        self.mul = ops.Mul().shard(((devices, 1), (1,)))

    def construct(self, x):
        return self.tanh(self.region(self.mul(x, self.scale), self.w, self.group, self.tp))


def model():
    set_seed(1)
    return Net()


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, 1e-1)


def data(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((ROWS, HIDDEN)).astype(np.float32),
            rng.standard_normal((ROWS, OUT)).astype(np.float32))


def inputs():
    return (data(0)[0],)


def dataset():
    for step in range(STEPS):
        yield data(step)
