"""A network whose forward computation updates Parameters (issue 35 item 2), as aux-loss-free
MoE routing does: the router adds a bias to its scores; each step accumulates the expert load
(`AssignAdd` of the tokens' routing weights summed over the batch) and moves the bias towards
the less loaded experts (`AssignSub` of a signed step, read after the load's update). Neither
is trained (requires_grad=False); both are stored between steps.

FORWARD_STATE_LAYOUT: `sharded` (default: the state split over the experts, 8 ways, by the
assignments' strategies) or `replicated` (no strategy on the assignments: every rank holds the
whole state). FORWARD_STATE_FORM: `loss` (model() + loss() + optimizer()) or `own` (default:
the network computes its own loss, trained as TrainOneStepCell(network, optimizer), as
mindformers does).
"""

import os

import numpy as np

from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context, set_seed

LAYOUT = os.environ.get("FORWARD_STATE_LAYOUT", "sharded")
FORM = os.environ.get("FORWARD_STATE_FORM", "own")
EXPERTS, HIDDEN, TOKENS = 8, 16, 32

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Router(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(5)
        self.w = Parameter(initializer("normal", [HIDDEN, EXPERTS]), "w")
        self.expert_load = Parameter(Tensor(np.zeros((EXPERTS,), np.float32)), "expert_load",
                                     requires_grad=False)
        self.expert_bias = Parameter(Tensor(np.zeros((EXPERTS,), np.float32)), "expert_bias",
                                     requires_grad=False)
        self.matmul = ops.MatMul().shard(((8, 1), (1, 1)))
        self.softmax = ops.Softmax().shard(((8, 1),))
        self.add_bias = ops.Add().shard(((8, 1), (1,)))
        self.sum = ops.ReduceSum().shard(((8, 1),))
        self.mean = ops.ReduceMean()
        self.sign = ops.Sign()
        self.assign_add = ops.AssignAdd()
        self.assign_sub = ops.AssignSub()
        if LAYOUT == "sharded":  # every user of the bias splits it over the experts
            self.add_bias.shard(((1, 8), (8,)))
            self.assign_add.shard(((8,), (8,)))
            self.assign_sub.shard(((8,), (8,)))

    def construct(self, x):
        scores = self.softmax(self.matmul(x, self.w))
        gates = self.add_bias(scores, self.expert_bias)
        load = self.assign_add(self.expert_load, self.sum(scores, 0))
        # the bias moves towards the less loaded experts (reads the load just accumulated)
        self.assign_sub(self.expert_bias, 0.001 * self.sign(load - self.mean(load)))
        return gates


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(7)
        self.router = Router()
        self.w_out = Parameter(initializer("normal", [EXPERTS, HIDDEN]), "w_out")
        self.matmul = ops.MatMul().shard(((8, 1), (1, 1)))
        self.square = ops.Square().shard(((8, 1),))
        self.mean = ops.ReduceMean().shard(((8, 1),))

    def construct(self, x, label=None):
        out = self.matmul(self.router(x), self.w_out)
        if label is None:
            return out
        return self.mean(self.square(out - label), ())


def model():
    return Net()


if FORM == "loss":
    def loss():
        return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)


def inputs():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    return (x,) if FORM == "loss" else (x, x)


def dataset():
    rng = np.random.default_rng(1)
    for _ in range(4):
        x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
        yield x, rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
