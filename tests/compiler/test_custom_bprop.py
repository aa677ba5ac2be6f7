"""Cells with their own `bprop(self, *inputs, out, dout)` (compiler/frontend/custom_bprop.py):
autodiff runs the bprop on each rank's local values instead of differentiating the cell's ops, as
MindSpore does after the split. mindformers' cross entropy (`_LogSoftmax` + `_NLLLoss`, whose
bprop multiplies by `repeat_loss` = mp to undo the loss's `_VirtualDiv`) must then train
exactly like the gradient of its construct: the float64 check of every compile compares the
plan (bprop included) with the single-device program differentiating construct."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check, single_device
from pcompile.tools.runners import StandAloneRunner

# mindformers' CrossEntropyLoss structure: _LogSoftmax and _NLLLoss with their bprops, the
# masked mean with replicated strategies ((1,),): REPEAT is the factor _NLLLoss.bprop applies
# (mindformers: mp under (semi-)auto parallel).
MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel")
dp, mp, REPEAT = {dp}, {mp}, {repeat}


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
        return {ret}


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 32]), "w")
        self.matmul = ops.MatMul().shard(((dp, 1), (1, mp)))
        self.log_softmax = LogSoftmax()
        self.nll = NLLLoss()
        self.sum2 = ops.ReduceSum().shard(((1,),))
        self.mul2 = ops.Mul().shard(((1,), (1,)))
        self.div2 = ops.RealDiv().shard(((), ()))

    def construct(self, x, label, mask):
        log_softmax, one_hot = self.log_softmax(self.matmul(x, self.w), label)
        loss = self.nll(log_softmax, one_hot)
        return self.div2(self.sum2(self.mul2(loss, mask)), self.sum2(mask))


def model():
    return Net()


def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((8, 16)).astype(np.float32),
            rng.integers(0, 32, (8,)).astype(np.int32),
            (rng.random(8) > 0.25).astype(np.float32)]


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""


def model_file(tmp_path: Any, dp: int, mp: int, repeat: int,
               ret: str = "grad, ops.zeros_like(one_hot)") -> str:
    path = tmp_path / f"ce_{dp}_{mp}_{repeat}.py"
    path.write_text(textwrap.dedent(MODEL.format(dp=dp, mp=mp, repeat=repeat, ret=ret)))
    return str(path)


def test_mindformers_cross_entropy_bprops_train_like_their_construct_at_dp2_mp4(
        tmp_path) -> None:
    out = tmp_path / "out"
    program = compile_model(model_file(tmp_path, 2, 4, 4), devices=8, out_dir=str(out))
    report = check(program, steps=2)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"
    step = next(out.glob("rank_0/*train_step*.ir")).read_text()
    # The backward of the two cells is their bprops' ops, on the rank's slices: an Exp and
    # the multiplication by REPEAT under Gradients/.../nll-NLLLoss, and no vjp of the cells'
    # ReduceSum/ReduceMax (no BroadcastTo of their cotangents, no ReduceMax gradient mask).
    nll = [line for line in step.splitlines() if "Gradients/Default" in line and "nll" in line]
    assert nll, "no backward node under the NLLLoss scope"
    grads = [line for line in step.splitlines() if line.strip().startswith("%")]
    assert sum("= Exp(" in line for line in grads) == 2  # the forward's and the bprop's
    assert not any("Equal(" in line for line in grads)  # ReduceMax's vjp compares with max


def test_without_the_repeat_factor_the_check_finds_the_gradient_mp_times_too_small(
        tmp_path) -> None:
    """The cotangent reaching the bprop carries the loss's _VirtualDiv (1/mp here, after the
    ReduceScatter of the replicated mean): a bprop that does not undo it is caught."""
    program = compile_model(model_file(tmp_path, 2, 4, 1), devices=8, dump=False)
    report = check(program, steps=1)
    assert not report.ok()
    assert report.worst[1] > 0.5, report.worst  # (1 - 1/mp) of the gradient is missing


def test_on_one_device_the_bprops_equal_autodiff_of_construct(tmp_path) -> None:
    program = compile_model(model_file(tmp_path, 1, 1, 1), devices=1, dump=False)
    reference = single_device(program)  # differentiates construct
    ours = StandAloneRunner(program, "numpy", float64=True)
    theirs = StandAloneRunner(reference, "numpy", float64=True)
    theirs.values["w"] = np.array(ours.values["w"])
    for _, _, arrays in batches(program, 2):
        assert abs(ours.step(arrays) - theirs.step(arrays)) <= 1e-12
    scale = float(np.max(np.abs(theirs.values["w"])))
    assert float(np.max(np.abs(ours.values["w"] - theirs.values["w"]))) <= 1e-12 * scale
    # and the bprop is what ran: its graph has no ReduceMax gradient
    assert not program.graph.find("Equal")


@pytest.mark.parametrize(("ret", "message"), [
    ("(grad,)", "bprop returned 1 gradients for 2 inputs"),
    ("grad[:, :1], ops.zeros_like(one_hot)", "bprop's gradient 0 is"),
    ("1.0, ops.zeros_like(one_hot)", "bprop's result 0 is float"),
])
def test_a_wrong_bprop_result_is_one_message(tmp_path, ret: str, message: str) -> None:
    with pytest.raises(PcompileError, match=message) as info:
        compile_model(model_file(tmp_path, 1, 1, 1, ret), devices=1, dump=False)
    assert "NLLLoss (scope Default/network-Net/nll-NLLLoss)" in str(info.value)
