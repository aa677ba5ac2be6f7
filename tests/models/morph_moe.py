"""mindformers' MoEV3 (`use_gmm`) in semi_auto_parallel: the routing and the sort of each
group's choices by expert in the global view with data-parallel strategies, the experts in a
`Morph` region (self_define_shard) that runs on each rank's slices as mindformers'
`ffn_forward_func`: an AlltoAll of the per-expert counts, `AlltoAllV` of the tokens and their
expert ids, a sort by expert, `GroupedMatmul` with the rank's experts over the received counts
(`Swiglu` between), the sort undone and the `AlltoAllV` back; then each token's k outputs
weighed and summed. The experts are split over the ranks (ep = the devices; one device runs the
region on the whole tensors).

MORPH_MOE_EP=n (n dividing the devices) makes expert parallelism smaller than the world, as
mindformers' FFN does: Layout (devices / n, n, 1, 1, 1), the experts split n ways, and the
region's collectives over each rank's expert-parallel group of n ranks (create_group, named
after its ranks as mindformers names them).

The router makes every token choose experts 0 and 1: experts 2..7 get no tokens and 0 and 1
every one, more than a capacity factor of 1.5 keeps (ceil(2 * 32 * 1.5 / 8) = 12 of 32).
"""

import hashlib
import os

import numpy as np

from pcompile import (
    Layout,
    Parameter,
    Tensor,
    get_auto_parallel_context,
    initializer,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)
from pcompile.communication import create_group, get_rank

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")

BATCH, SEQ, HIDDEN, FFN, EXPERTS, TOP_K = 4, 8, 8, 8, 8, 2
STEPS = 3


def router_init():
    """Experts 0 and 1 read feature 0 (large in every token), the others little."""
    w = np.random.default_rng(5).standard_normal((EXPERTS, HIDDEN)) * 0.1
    w[0, 0], w[1, 0] = 3.0, 2.0
    return w.astype(np.float32)


_EP_GROUP_NAME = {}


def ep_group_name(ep):
    """mindformers' FFN._get_ep_group_name: the ep consecutive ranks of this rank, named by a
    hash of their list, created once."""
    start = get_rank() // ep * ep
    ranks = list(range(start, start + ep))
    key = "-".join(str(r) for r in ranks)
    if key not in _EP_GROUP_NAME:
        name = hashlib.sha256(key.encode()).hexdigest()[:48]
        create_group(name, ranks)
        _EP_GROUP_NAME[key] = name
    return _EP_GROUP_NAME[key]


def ffn_forward(x, expert_id, counter, w1, w2, ep_group, hidden_size, ep):
    """mindformers' ffn_forward_func on one rank's slices: x (1, kN, h) sorted by expert,
    expert_id (1, kN), counter (1, E); w1 (E / ep, h, 2 F), w2 (E / ep, F, h)."""
    x_shape = x.shape
    local_counter = ops.AlltoAll(ep, -1, -2, ep_group)(counter)        # (ep, E / ep)
    send = ops.MoveTo()(ops.cast(counter.reshape(ep, -1).sum(-1), "int32"), "CPU")
    recv = ops.MoveTo()(ops.cast(local_counter.sum(-1), "int32"), "CPU")
    group_list = ops.cumsum(ops.cast(local_counter.sum(0), "int32"), 0)
    x = ops.AlltoAllV(ep_group, hidden_size)(x.reshape(-1), send, recv).reshape(1, -1,
                                                                                 hidden_size)
    ids = ops.AlltoAllV(ep_group, 1)(expert_id.reshape(-1), send, recv).reshape(1, -1)
    # the rows past the received ones (AlltoAllV's static bound, zeros) sort last
    rows = Tensor(np.arange(ids.shape[1], dtype=np.int32).reshape(1, -1))
    valid = ops.cast(rows < recv.sum(), "float32")
    ids = ids * valid + EXPERTS * (1 - valid)
    _, sort_map = ops.sort(ids)
    _, unsort_map = ops.sort(ops.cast(sort_map, "float32"))
    x = ops.gather(x, sort_map, 1, 1).reshape(-1, hidden_size)
    gmm = ops.GroupedMatmul(split_item=3, group_type=0)
    gate = gmm([x], [w1], None, None, None, None, None, group_list)[0]
    hidden = ops.Swiglu()(gate, -1)
    y = gmm([hidden], [w2], None, None, None, None, None, group_list)[0]
    y = ops.gather(y.reshape(1, -1, hidden_size), unsort_map, 1, 1)
    y = ops.AlltoAllV(ep_group, hidden_size)(y.reshape(-1), recv, send)
    return y.reshape(x_shape)


def infer_shape(*shapes):
    return shapes[0]


def infer_dtype(*dtypes):
    return dtypes[0]


class MoEV3(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dp = dp = int(get_auto_parallel_context("device_num"))
        self.ep = int(os.environ.get("MORPH_MOE_EP", dp)) if dp > 1 else 1
        if dp % self.ep or EXPERTS % self.ep:
            raise ValueError(f"MORPH_MOE_EP={self.ep} must divide the {dp} devices and the "
                             f"{EXPERTS} experts")
        self.ep_group = ep_group_name(self.ep)
        self.router = Parameter(Tensor(router_init()), "router")
        self.w1 = Parameter(initializer("normal", [EXPERTS, HIDDEN, 2 * FFN]), "w1")
        self.w2 = Parameter(initializer("normal", [EXPERTS, FFN, HIDDEN]), "w2")
        self.router_dense = ops.MatMul(transpose_b=True).shard(((dp, 1), (1, 1)))
        self.softmax = ops.Softmax().shard(((dp, 1, 1),))
        self.topk = ops.TopK().shard(((dp, 1, 1),))
        self.transpose_3d = ops.Transpose().shard(((dp, 1, 1),))
        self.sort = ops.Sort(1).shard(((dp, 1),))
        self.mod = ops.Mod().shard(((dp, 1), ()))
        self.gather_sort = ops.Gather(batch_dims=1).shard(((dp, 1, 1), (dp, 1)))
        self.onehot = ops.OneHot().shard(((dp, 1, 1), (), ()))
        self.reduce_cnt = ops.ReduceSum(keep_dims=False).shard(((dp, 1, 1),))
        self.transpose_unsort = ops.Transpose().shard(((dp, 1, 1),))
        self.gather_unsort = ops.Gather(batch_dims=1).shard(((dp, 1, 1), (dp, 1, 1)))
        self.mul_coeff = ops.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.sum_coeff = ops.ReduceSum(keep_dims=False).shard(((dp, 1, 1, 1),))
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.on, self.off = Tensor(1.0, np.float32), Tensor(0.0, np.float32)
        layout = Layout((dp // self.ep, self.ep, 1, 1, 1),
                        ("outer_dp", "inner_dp", "sp", "mp0", "mp1"))
        self.hook_ffn_forward = ops.Morph(ffn_forward, infer_shape, infer_dtype)
        self.hook_ffn_forward.add_prim_attr("self_define_shard", True)
        self.hook_ffn_forward.shard(
            in_strategy=(layout(("outer_dp", "inner_dp"), "sp", "mp0"),
                         layout(("outer_dp", "inner_dp"), "sp"),
                         layout(("outer_dp", "inner_dp"), "sp"),
                         layout("inner_dp", "mp0", "mp1"),
                         layout("inner_dp", "mp1", "mp0")),
            out_strategy=(layout(("outer_dp", "inner_dp"), "sp", "mp0"),))

    def construct(self, x):
        shape = x.shape
        dp = self.dp
        tokens = self.reshape(x, (dp, -1, HIDDEN))                            # (dp, N, h)
        n = tokens.shape[1]
        logits = self.router_dense(self.reshape(tokens, (-1, HIDDEN)), self.router)
        probs = self.softmax(self.reshape(logits, (dp, n, EXPERTS)))
        gate, expert_index = self.topk(probs, TOP_K)                          # (dp, N, k)
        # mindformers' _tensor_sort
        index = self.reshape(self.transpose_3d(expert_index, (0, 2, 1)), (dp, -1))
        sorted_index, sort_map = self.sort(self.cast(index, "float32"))
        expert_input = self.gather_sort(tokens, self.mod(sort_map, n), 1)     # (dp, kN, h)
        counter = self.reduce_cnt(self.onehot(index, EXPERTS, self.on, self.off), 1)
        _, unsort_map = self.sort(self.cast(sort_map, "float32"))
        unsort_map = self.transpose_unsort(self.reshape(unsort_map, (dp, TOP_K, n)), (0, 2, 1))
        out = self.hook_ffn_forward(expert_input, sorted_index, counter, self.w1, self.w2,
                                    self.ep_group, HIDDEN, self.ep)
        # mindformers' _tensor_unsort
        out = self.gather_unsort(out, unsort_map, 1)                          # (dp, N, k, h)
        out = self.mul_coeff(out, self.reshape(gate, (dp, n, TOP_K, 1)))
        return self.reshape(self.sum_coeff(out, 2), shape)


def model():
    set_seed(1)
    return MoEV3()


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, 1e-1)


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)
    x[..., 0] = 2.0 + np.abs(x[..., 0])
    return x, rng.standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)


def inputs():
    return (data(0)[0],)


def dataset():
    for step in range(STEPS):
        yield data(step)
