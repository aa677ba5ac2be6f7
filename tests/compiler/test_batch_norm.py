"""Batch normalisation (compiler/frontend/batch_norm.py): `P.BatchNorm` and `nn.BatchNorm1d/2d` with
MindSpore's arguments and strategies, the batch statistics and the moving ones against numpy,
and MindSpore's parallel cases (tests/ut/python/parallel/test_batchnorm.py) training exactly like
one device: a split N, H or W dim is normalised by the whole batch's statistics (MindSpore's
SyncBatchNorm), and the moving statistics are the same stored state."""

from __future__ import annotations

import numpy as np
import pytest

from pcompile import Parameter, Tensor, nn, ops
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check


def test_training_and_inference_values() -> None:
    """Eagerly: y from the batch's statistics, the moving ones updated with MindSpore's
    momentum (the op's: the weight of the batch; the unbiased variance), inference from the
    moving ones."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 2, 2)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 3).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)
    mean = Parameter(Tensor(np.zeros(3, np.float32)), "mean", requires_grad=False)
    var = Parameter(Tensor(np.ones(3, np.float32)), "variance", requires_grad=False)
    y, batch_mean, batch_var, _, _ = ops.BatchNorm(True, 1e-5, 0.1)(
        x, Tensor(scale), Tensor(bias), mean, var)
    m = x.mean(axis=(0, 2, 3))
    v = x.var(axis=(0, 2, 3))
    want = (x - m[None, :, None, None]) / np.sqrt(v[None, :, None, None] + 1e-5)
    want = want * scale[None, :, None, None] + bias[None, :, None, None]
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch_mean.asnumpy(), m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch_var.asnumpy(), v, rtol=1e-5)
    n = 6 * 2 * 2
    np.testing.assert_allclose(mean.asnumpy(), 0.1 * m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(var.asnumpy(), 0.9 + 0.1 * v * n / (n - 1), rtol=1e-5)
    y, *_ = ops.BatchNorm(False, 1e-5, 0.1)(x, Tensor(scale), Tensor(bias), mean, var)
    want = (x - mean.asnumpy()[None, :, None, None]) / np.sqrt(
        var.asnumpy()[None, :, None, None] + 1e-5) * scale[None, :, None, None] + bias[
        None, :, None, None]
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_arguments_as_mindspore_checks_them() -> None:
    with pytest.raises(TypeError, match="is_training"):
        ops.BatchNorm(is_training=1)
    with pytest.raises(ValueError, match="momentum"):
        ops.BatchNorm(momentum=1.5)
    with pytest.raises(ValueError, match="NCHW"):
        ops.BatchNorm(data_format="NHWC")
    with pytest.raises(ValueError, match="momentum"):
        nn.BatchNorm2d(4, momentum=2.0)
    x = Tensor(np.ones((2, 4), np.float32))
    one = Parameter(Tensor(np.ones(4, np.float32)), "one", requires_grad=False)
    grouped = ops.BatchNorm(True).add_prim_attr("group_size", 8)
    with pytest.raises(ValueError, match="group_size"):
        grouped(x, one, one, one, one)
    bn = nn.BatchNorm2d(4)
    assert [p.name for p in bn.get_parameters()] == ["gamma", "beta", "moving_mean",
                                                     "moving_variance"]
    assert not bn.moving_mean.requires_grad and bn.gamma.requires_grad


MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(dataset_strategy="full_batch")
S1, S2 = {s1}, {s2}
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        {body}
def model():
    return Net()
def inputs():
    return [np.random.default_rng(0).standard_normal({x}).astype(np.float32)]
def labels():
    return [np.random.default_rng(1).standard_normal({y}).astype(np.float32)]
def loss():
    return nn.MSELoss()
def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""

CONV = """self.conv2d = ops.Conv2D(out_channel=8, kernel_size=2, pad_mode="same", stride=1)
        if S1:
            self.conv2d.shard(S1)
        w = np.random.default_rng(2).standard_normal((8, 16, 2, 2)).astype(np.float32)
        self.conv2d_weight = Parameter(Tensor(w * 0.1), "w1")
        self.bn = nn.BatchNorm2d(8)
        self.bn.bn_train.shard(S2)
    def construct(self, x):
        return self.bn(self.conv2d(x, self.conv2d_weight))"""

DENSE = """self.bn = nn.BatchNorm1d(8)
        self.bn.bn_train.shard(S1)
        self.relu = ops.ReLU().shard(S2)
    def construct(self, x):
        return self.relu(self.bn(x))"""

# MindSpore's cases: name -> (devices, network, strategy1, strategy2)
CASES = {
    "batchnorm_data_parallel": (8, CONV, ((8, 1, 1, 1), (1, 1, 1, 1)),
                                ((8, 1, 1, 1), (1,), (1,), (1,), (1,))),
    "batchnorm_model_parallel1": (8, CONV, ((2, 2, 1, 1), (2, 2, 1, 1)),
                                  ((2, 1, 2, 2), (1,), (1,), (1,), (1,))),
    "batchnorm1d_data_parallel": (8, DENSE, ((8, 1), (1,), (1,), (1,), (1,)), ((8, 1),)),
    "batchnorm1d_model_parallel1": (8, DENSE, ((1, 8), (8,), (8,), (8,), (8,)), ((1, 8),)),
    "batchnorm1d_model_parallel2": (32, DENSE, ((2, 4), (4,), (4,), (4,), (4,)), ((2, 4),)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_mindspore_batchnorm_cases_train_like_one_device(tmp_path, name: str) -> None:
    devices, body, s1, s2 = CASES[name]
    conv = body is CONV
    path = tmp_path / f"{name}.py"
    path.write_text(MODEL.format(s1=s1, s2=s2, body=body,
                                 x=(32, 16, 4, 4) if conv else (32, 8),
                                 y=(32, 8, 4, 4) if conv else (32, 8)))
    program = compile_model(str(path), devices=devices, parallel_mode="semi_auto_parallel",
                            dump=False)
    report = check(program, steps=2)
    assert report.ok(), report
    assert {"bn.moving_mean", "bn.moving_variance"} <= report.params


@pytest.mark.parametrize("body", ["conv", "dense"])
def test_data_parallel_mode_normalises_by_the_whole_batch(tmp_path, body: str) -> None:
    """parallel_mode="data_parallel" traces each rank's rows: BatchNorm sums its statistics
    over every rank (an AllReduce of the world group, MindSpore's SyncBatchNorm), so each rank
    normalises by the whole batch and updates the moving statistics alike; the assignments are
    then the same on every rank and not refused (they were), and two steps on 8 ranks equal one
    device's, the moving statistics included."""
    conv = body == "conv"
    path = tmp_path / f"dp_{body}.py"
    path.write_text(MODEL.replace('set_auto_parallel_context(dataset_strategy="full_batch")',
                                  "").format(s1=None, s2=None, body=CONV if conv else DENSE,
                                             x=(32, 16, 4, 4) if conv else (32, 8),
                                             y=(32, 8, 4, 4) if conv else (32, 8)))
    program = compile_model(str(path), devices=8, parallel_mode="data_parallel", dump=False)
    reduces = [n for n in program.graph.nodes if n.op == "AllReduce"]
    assert len(reduces) == 2  # the batch's sum and its sum of squares
    report = check(program, steps=2)
    assert report.ok(), report
    assert {"bn.moving_mean", "bn.moving_variance"} <= report.params
