"""A dropless mixture of experts written as mindformers' MoEV3 computes its experts
(`ffn_forward_func`), in hybrid_parallel: each rank routes its own tokens, sorts its choices by
expert, tells every rank how many it sends (an AlltoAll of the per-expert counts), sends them
with `ops.AlltoAllV`, sorts what it received by expert, runs its experts with `GroupedMatmul`
over the received counts, and sends the results back with the AlltoAllV the other way. The
experts are split over the ranks (expert parallelism: ep = the world); a world of one is the
single-device program. No capacity: every choice is computed.

The router is set so that every token chooses experts 0 and 1 first: experts 2..7 get no
tokens and experts 0 and 1 get every token, more than a capacity-based plan (capacity factor
1.5: ceil(2 * 32 * 1.5 / 8) = 12 of the 32 tokens) would keep.
"""

import numpy as np

from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context, set_seed
from pcompile.communication import get_group_size, get_rank, init

set_auto_parallel_context(parallel_mode="hybrid_parallel", gradients_mean=True)

BATCH, SEQ, HIDDEN, FFN, EXPERTS, TOP_K = 4, 8, 8, 16, 8, 2
STEPS = 3


def router_init():
    """Column 0 and 1 read feature 0 (every token's feature 0 is large), the others little."""
    w = np.random.default_rng(5).standard_normal((HIDDEN, EXPERTS)) * 0.1
    w[0, 0], w[0, 1] = 3.0, 2.0
    return w.astype(np.float32)


class DroplessMoE(nn.Cell):
    def __init__(self):
        super().__init__()
        self.router = Parameter(Tensor(router_init()), "router")
        self.w1 = Parameter(initializer("normal", [EXPERTS, HIDDEN, FFN]), "w1")
        self.w2 = Parameter(initializer("normal", [EXPERTS, FFN, HIDDEN]), "w2")
        self.matmul = ops.MatMul()
        self.softmax = ops.Softmax()
        self.topk = ops.TopK()
        self.sort = ops.Sort()
        self.gather = ops.Gather()
        self.onehot = ops.OneHot()
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.gmm = ops.GroupedMatmul(split_item=3, group_type=0)
        self.silu = ops.SiLU()
        self.move_to = ops.MoveTo()
        self.on, self.off = Tensor(1.0, np.float32), Tensor(0.0, np.float32)

    def construct(self, x):
        ep, rank = get_group_size(), get_rank()
        local = EXPERTS // ep
        tokens = self.reshape(x, (-1, HIDDEN))
        n = tokens.shape[0] // ep
        tokens = tokens[rank * n:(rank + 1) * n]                            # (N, h)
        probs = self.softmax(self.matmul(tokens, self.router))
        gate, expert = self.topk(probs, TOP_K)                               # (N, k)
        flat = self.reshape(self.transpose(expert, (1, 0)), (-1,))           # (kN,)
        _, sort_map = self.sort(self.cast(flat, "float32"))
        sorted_ids, _ = self.sort(self.cast(flat, "float32"))
        expert_input = self.gather(tokens, ops.Mod()(sort_map, n), 0)        # (kN, h)
        counter = self.onehot(flat, EXPERTS, self.on, self.off).sum(axis=0)  # (E,)
        counter = self.reshape(self.cast(counter, "int32"), (1, EXPERTS))
        local_counter = ops.AlltoAll(ep, -1, -2)(counter)                    # (ep, E / ep)
        send = self.move_to(self.reshape(counter, (ep, local)).sum(axis=-1), "CPU")
        recv = self.move_to(local_counter.sum(axis=-1), "CPU")
        group_list = ops.CumSum()(local_counter.sum(axis=0), 0)
        received = ops.AlltoAllV(block_size=HIDDEN)(self.reshape(expert_input, (-1,)), send,
                                                    recv)
        received = self.reshape(received, (-1, HIDDEN))
        ids = ops.AlltoAllV(block_size=1)(sorted_ids, send, recv)
        # the rows past the received ones (the static bound's padding) sort last
        valid = self.cast(Tensor(np.arange(ids.shape[0], dtype=np.int32)) < recv.sum(), "float32")
        ids = ids * valid + EXPERTS * (1 - valid)
        _, resort = self.sort(ids)
        _, unresort = self.sort(self.cast(resort, "float32"))
        hidden = self.gather(received, resort, 0)
        w1 = self.w1[rank * local:(rank + 1) * local]
        w2 = self.w2[rank * local:(rank + 1) * local]
        hidden = self.silu(self.gmm([hidden], [w1], None, None, None, None, None, group_list)[0])
        out = self.gmm([hidden], [w2], None, None, None, None, None, group_list)[0]
        out = self.gather(out, unresort, 0)
        back = ops.AlltoAllV(block_size=HIDDEN)(self.reshape(out, (-1,)), recv, send)
        back = self.reshape(back, (-1, HIDDEN))                              # (kN, h)
        _, unsort = self.sort(self.cast(sort_map, "float32"))
        back = self.reshape(self.gather(back, unsort, 0), (TOP_K, n, HIDDEN))
        back = self.transpose(back, (1, 0, 2))                                # (N, k, h)
        return (back * self.reshape(gate, (n, TOP_K, 1))).sum(axis=1)         # (N, h)


class ReduceLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, out, label):
        ep, rank = get_group_size(), get_rank()
        label = self.reshape_rows(label)
        n = label.shape[0] // ep
        diff = out - label[rank * n:(rank + 1) * n]
        return self.all_reduce((diff * diff).mean()) / ep

    def reshape_rows(self, label):
        return ops.Reshape()(label, (-1, HIDDEN))


def model():
    init()
    set_seed(1)
    return DroplessMoE()


def loss():
    return ReduceLoss()


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
