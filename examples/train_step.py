"""MindSpore's training form, as mindformers trains: the network computes its own loss from
(x, labels), and model() returns the training step cell: dynamic loss scaling
(`nn.TrainOneStepWithLossScaleCell` + `nn.DynamicLossScaleUpdateCell`), global-norm gradient
clipping (mindformers' `ClipGradNorm`), AdamWeightDecay with a warm-up + cosine learning-rate
schedule. Data parallel 2 x model parallel 4 on 8 devices.

    pcompile examples/train_step.py --devices 8 --run --steps 20 --no-fail-on-nan

`TRAIN_STEP_INF_AT=k` puts an inf into the input of step k: that step overflows, is skipped on
every rank (the parameters and the optimizer state stay as they were) and the loss scale is
halved. (`--no-fail-on-nan`: the loss of an overflowing step is not finite by design.)
"""

import os

import numpy as np

from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)

DP, MP = 2, 4
BATCH, HIDDEN, FFN, CLASSES = 16, 32, 64, 8


class FeedForward(nn.Cell):
    """Dense (split by columns) -> GELU -> dense (split by rows: its output is all-reduced)."""

    def __init__(self):
        super().__init__()
        self.w1 = Parameter(initializer("xavier_uniform", [HIDDEN, FFN]), "w1")
        self.w2 = Parameter(initializer("xavier_uniform", [FFN, HIDDEN]), "w2")
        self.up = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.act = ops.GeLU().shard(((DP, MP),))
        self.down = ops.MatMul().shard(((DP, MP), (MP, 1)))
        self.add = ops.Add().shard(((DP, 1), (DP, 1)))

    def construct(self, x):
        return self.add(x, self.down(self.act(self.up(x, self.w1)), self.w2))


class NetWithLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(1)
        self.block1 = FeedForward()
        self.block2 = FeedForward()
        self.head = Parameter(initializer("xavier_uniform", [HIDDEN, CLASSES]), "head")
        self.logits = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.loss = nn.CrossEntropyLoss()

    def construct(self, x, labels):
        h = self.block2(self.block1(x))
        return self.loss(self.logits(h, self.head), labels)


class WarmUpCosine(nn.LearningRateSchedule):
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to 0 over `decay`."""

    def __init__(self, peak, warmup, decay):
        super().__init__()
        self.warmup = nn.WarmUpLR(peak, warmup)
        self.cosine = nn.CosineDecayLR(0.0, peak, decay)
        self.steps = warmup

    def construct(self, global_step):
        warm = self.warmup(global_step)
        cool = self.cosine(global_step - self.steps)
        return ops.select(ops.less(global_step, self.steps), warm, cool)


class TrainStep(nn.TrainOneStepWithLossScaleCell):
    """mindformers' training step: unscale, check for overflow, clip, update unless overflow."""

    def __init__(self, network, optimizer, scale_sense, max_grad_norm=1.0):
        super().__init__(network, optimizer, scale_sense)
        self.clip = nn.ClipGradNorm(max_norm=max_grad_norm)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        scaling_sens = self.scale_sense
        sens = ops.ones_like(loss) * ops.cast(scaling_sens, loss.dtype)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        inverse = ops.reciprocal(scaling_sens)
        grads = tuple(g * ops.cast(inverse, g.dtype) for g in grads)
        overflow = self.process_loss_scale(self.get_overflow_status(False, grads))
        grads, global_norm = self.clip(grads)
        loss = ops.depend(loss, self.optimizer(grads, skip=overflow))
        return loss, overflow, scaling_sens, global_norm


def model():
    net = NetWithLoss()
    lr = WarmUpCosine(3e-3, 3, 50)
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=lr, weight_decay=0.01)
    return TrainStep(net, opt, nn.DynamicLossScaleUpdateCell(2.0 ** 12, 2, 4))


TEACHER = np.random.default_rng(7).standard_normal((HIDDEN, CLASSES))


def inputs():
    return next(iter(dataset()))


def dataset():
    """Inputs and the class a fixed linear teacher gives them (a learnable task)."""
    bad = int(os.environ.get("TRAIN_STEP_INF_AT", "0"))
    rng = np.random.default_rng(0)
    for step in range(1, 1001):
        x = rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)
        labels = np.argmax(x @ TEACHER, axis=1).astype(np.int32)
        if step == bad:
            x[0, 0] = np.inf
        yield x, labels
