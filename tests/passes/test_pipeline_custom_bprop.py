"""Cells with their own bprop inside nn.PipelineCell (compiler/frontend/custom_bprop.py):
mindformers' cross entropy (`_LogSoftmax` and `_NLLLoss`, whose bprop multiplies by `repeat_loss` =
mp) in the last of two pipeline stages, and in a PipelineCell without stages. The bprop runs
once per micro-batch on that micro-batch's slices, in the stage of its cell; the float64
check compares the step with the single-device program differentiating construct. pcompile
refused these ("defines its own bprop inside nn.PipelineCell")."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages={stages})
dp, mp, REPEAT = 2, 2, {repeat}


class LogSoftmax(nn.Cell):
    def __init__(self):
        super().__init__()
        self.on_value, self.off_value = Tensor(1.0), Tensor(0.0)
        self.sum = ops.ReduceSum(keep_dims=True).shard(((dp, mp),))
        self.max = ops.ReduceMax(keep_dims=True).shard(((dp, mp),))
        self.sub = ops.Sub().shard(((dp, mp), (dp, 1)))
        self.exp = ops.Exp().shard(((dp, mp),))
        self.log = ops.Log().shard(((dp, 1),))
        self.onehot = ops.OneHot().shard(((dp, mp), (), ()))

    def construct(self, logits, label):
        logit_sub = self.sub(logits, self.max(logits, 1))
        log_exp_sum = self.log(self.sum(self.exp(logit_sub), -1))
        one_hot = self.onehot(label, logits.shape[-1], self.on_value, self.off_value)
        return self.sub(logit_sub, log_exp_sum), one_hot

    def bprop(self, logits, label, _, dout):
        return ops.cast(dout[0], logits.dtype), ops.zeros_like(label)


class NLLLoss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.sum = ops.ReduceSum().shard(((dp, mp),))
        self.mul = ops.Mul().shard(((dp, mp), (dp, mp)))
        self.neg = ops.Neg().shard(((dp, mp),))

    def construct(self, log_softmax, one_hot):
        return self.sum(self.neg(self.mul(log_softmax, one_hot)), -1)

    def bprop(self, log_softmax, one_hot, _, dout):
        grad = (ops.Exp()(log_softmax) - one_hot) * ops.ExpandDims()(dout, -1) * REPEAT
        return grad, ops.zeros_like(one_hot)


class First(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 16]), "w")
        self.matmul = ops.MatMul().shard(((dp, 1), (1, mp)))
        self.relu = ops.ReLU().shard(((dp, mp),))

    def construct(self, x):
        return self.relu(self.matmul(x, self.w))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.first = First()
        self.w2 = Parameter(initializer("normal", [16, 32]), "w2")
        self.matmul = ops.MatMul().shard(((dp, 1), (1, mp)))
        self.log_softmax = LogSoftmax()
        self.nll = NLLLoss()
        self.sum2 = ops.ReduceSum().shard(((1,),))
        self.mul2 = ops.Mul().shard(((1,), (1,)))
        self.div2 = ops.RealDiv().shard(((), ()))
        self.first.pipeline_stage = 0
        self.pipeline_stage = {last}  # the head and the loss

    def construct(self, x, label, mask):
        logits = self.matmul(self.first(x), self.w2)
        log_softmax, one_hot = self.log_softmax(logits, label)
        loss = self.nll(log_softmax, one_hot)
        return self.div2(self.sum2(self.mul2(loss, mask)), self.sum2(mask))


def model():
    set_seed(2)
    return nn.PipelineCell(Net(), micro_size={micro})


def dataset():
    rng = np.random.default_rng(0)
    # every micro-batch of 4 rows has 3 counted rows: its masked mean's weight is the batch's
    mask = np.array([1, 1, 0, 1, 1, 0, 1, 1], np.float32)
    for _ in range(3):
        yield (rng.standard_normal((8, 16)).astype(np.float32),
               rng.integers(0, 32, (8,)).astype(np.int32), mask)


def inputs():
    return next(iter(dataset()))


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""


def compiled(tmp_path: Any, stages: int, micro: int, repeat: int = 2) -> Any:
    path = tmp_path / f"pipe_bprop_{stages}_{micro}_{repeat}.py"
    path.write_text(textwrap.dedent(MODEL.format(stages=stages, micro=micro, repeat=repeat,
                                                 last=stages - 1)))
    out = tmp_path / "out"
    return compile_model(str(path), devices=4 * stages, out_dir=str(out)), out


@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (1, 2)])
def test_bprops_run_per_micro_batch_in_their_stage(tmp_path: Any, stages: int,
                                                   micro: int) -> None:
    program, out = compiled(tmp_path, stages, micro)
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.worst)
    last = out / f"rank_{4 * (stages - 1)}"
    step = next(last.glob("*autodiff*.ir")).read_text()
    bprop = [line for line in step.splitlines() if re.search(r"= Exp\(", line)
             and "Gradients/" in step.splitlines()[step.splitlines().index(line) + 2]]
    # NLLLoss.bprop's Exp, once per micro-batch (the forward's Exps are LogSoftmax's)
    assert len(bprop) == micro, bprop
    if stages > 1:  # stage 0 runs none of the loss's backward
        first = next((out / "rank_0").glob("*pipeline_split*.ir")).read_text()
        assert "nll-NLLLoss" not in first


@pytest.mark.slow
def test_the_bprop_is_what_runs(tmp_path: Any) -> None:
    """Without the repeat factor the check finds the gradient of the logits mp times too
    small: the bprop ran (autodiff of construct would be right)."""
    program, _ = compiled(tmp_path, 2, 2, repeat=1)
    assert not check(program, steps=1).ok()
