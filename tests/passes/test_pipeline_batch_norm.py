"""BatchNorm training inside nn.PipelineCell, with MindSpore's semantics (it was refused): each
micro-batch is normalised by its own statistics and the moving mean and variance move once per
micro-batch, in micro-batch order (passes/micro_batch.py `_state_chain`). The oracle's
single-device reference of a PipelineCell program runs its micro-batches in turn, as
MindSpore's PipelineCell does on one device (tools/oracle.py `reference_micro_batches`)."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, check, relative_error, single_device
from pcompile.tools.runners import StandAloneRunner

MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages={stages})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(16, 16)
        self.bn = {norm}
        self.l2 = nn.Dense(16, 8)
        for cell, stage in ((self.l1, 0), (self.bn, 0), (self.l2, {stages} - 1)):
            cell.pipeline_stage = stage

    def construct(self, x):
        return self.l2(self.bn(self.l1(x)))


def _sharded(bn):  # the batch and the channels split over the 4 devices of a stage
    bn.bn_train.shard(((2, 2), (2,), (2,), (2,), (2,)))
    return bn


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size={micro})


def inputs():
    return (np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32) * 2 + 1,)


def labels():
    return (np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.05, momentum=0.9)
"""
BN = "nn.BatchNorm1d(16)"
SHARDED = "_sharded(nn.BatchNorm1d(16))"


def _write(tmp_path: Any, stages: int, micro: int, norm: str = BN) -> str:
    path = tmp_path / f"pipe_bn_{stages}_{micro}_{abs(hash(norm))}.py"
    path.write_text(textwrap.dedent(MODEL.format(stages=stages, micro=micro, norm=norm)))
    return str(path)


def _mindspore_step(values: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                    micro: int) -> tuple[float, np.ndarray, np.ndarray]:
    """MindSpore's PipelineCell on one device, forward only: micro-batch k (the k-th rows) is
    normalised by its own statistics and moves the moving statistics (momentum 0.1 of the op,
    the unbiased variance), one micro-batch after the other; the loss is the micro-batches'
    mean (pcompile's PipelineCell loss). The network's constants are float32 values."""
    def f32(value: float) -> float:
        return float(np.float32(value))

    mean = values["bn.moving_mean"].copy()
    var = values["bn.moving_variance"].copy()
    losses = []
    for xk, yk in zip(np.split(x, micro), np.split(y, micro)):
        h = xk @ values["l1.weight"].T + values["l1.bias"]
        m, v = h.mean(0), h.var(0)
        n = h.shape[0]
        z = (h - m) / np.sqrt(v + f32(1e-5)) * values["bn.gamma"] + values["bn.beta"]
        out = z @ values["l2.weight"].T + values["l2.bias"]
        losses.append(float(np.mean((out - yk) ** 2)))
        mean = mean * f32(1 - 0.1) + m * f32(0.1)
        var = var * f32(1 - 0.1) + v * f32(n / (n - 1)) * f32(0.1)
    return float(np.mean(losses)), mean, var


def test_the_reference_runs_the_micro_batches_in_turn(tmp_path: Any) -> None:
    """The single-device reference of a PipelineCell program is MindSpore's PipelineCell on one
    device: loss and moving statistics after a step equal a numpy run of the micro-batches one
    after the other (each normalised by its own statistics), and not the whole batch's."""
    program = compile_model(_write(tmp_path, 2, 4), devices=2, dump=False)
    ref = single_device(program)
    runner = StandAloneRunner(ref, "numpy", float64=True)
    start = {k: np.asarray(v, np.float64) for k, v in runner.values.items()}
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32) * 2 + 1
    y = np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32)
    loss = runner.step([x, y])
    x, y = x.astype(np.float64), y.astype(np.float64)
    want_loss, want_mean, want_var = _mindspore_step(start, x, y, 4)
    assert abs(loss - want_loss) <= FLOAT64_RTOL * max(1.0, abs(want_loss))
    assert relative_error(runner.values["bn.moving_mean"], want_mean) <= FLOAT64_RTOL
    assert relative_error(runner.values["bn.moving_variance"], want_var) <= FLOAT64_RTOL
    whole_loss, whole_mean, _ = _mindspore_step(start, x, y, 1)
    assert abs(loss - whole_loss) > 1e-6  # the micro-batches' own statistics, not the batch's
    assert relative_error(runner.values["bn.moving_mean"], whole_mean) > 1e-3


@pytest.mark.parametrize("stages,micro,devices,norm", [
    (2, 2, 4, BN), (2, 4, 8, BN), (1, 2, 4, BN), (2, 2, 8, SHARDED)])
def test_batch_norm_in_a_pipeline_cell_trains_like_the_reference(
        tmp_path: Any, stages: int, micro: int, devices: int, norm: str) -> None:
    """With and without pipeline stages, the batch split over 2 or 4 devices of a stage (and
    the channels too, the moving statistics then split): two steps equal the reference's in
    float64, the moving statistics included (each micro-batch's rows are the k-th part of
    every rank's rows, and so are the reference's)."""
    program = compile_model(_write(tmp_path, stages, micro, norm), devices=devices, dump=False)
    report = check(program, steps=2)
    assert report.ok(), report
    assert {"bn.moving_mean", "bn.moving_variance"} <= report.params


def test_the_moving_statistics_move_once_per_micro_batch_in_order(tmp_path: Any) -> None:
    """Stage 0's local program updates each moving statistic once per micro-batch: micro-batch
    0's Assign reads the stored Parameter, micro-batch k's the value micro-batch k-1 assigned,
    and the step stores micro-batch m-1's."""
    program = compile_model(_write(tmp_path, 2, 4), devices=4, dump=False)
    graph = program.state.rank_graphs[0]
    for name in ("bn.moving_mean", "bn.moving_variance"):
        value: Any = next(p for p in graph.params if p.name == name)
        order = []
        for _ in range(4):
            (assign,) = [u for u in value.users if u.op == "Assign" and u.operands[0] is value]
            order.append(assign.parallel.micro)
            value = assign.result
        assert order == [0, 1, 2, 3]
        assert not any(u.op == "Assign" for u in value.users)
        assert value in graph.outputs


def test_without_per_micro_batch_statistics_both_references_agree(tmp_path: Any) -> None:
    """A PipelineCell without per-micro-batch statistics: its micro-batches run in turn (the
    loss their mean, the gradients accumulated) give the whole batch's step, so the reference
    that runs them and the whole-batch single-device program agree within float64 rounding."""
    path = _write(tmp_path, 2, 4, norm="nn.ReLU()")
    program = compile_model(path, devices=8, dump=False)
    micro = StandAloneRunner(single_device(program), "numpy", float64=True)
    whole = StandAloneRunner(compile_model(path, devices=1, dump=False), "numpy",
                             float64=True)
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32) * 2 + 1
    y = np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32)
    for _ in range(2):
        a, b = micro.step([x, y]), whole.step([x, y])
        assert abs(a - b) <= FLOAT64_RTOL * max(1.0, abs(b))
    assert micro.values.keys() == whole.values.keys()
    for name, value in whole.values.items():
        assert relative_error(micro.values[name], value) <= FLOAT64_RTOL, name


def test_a_loss_reading_an_assigned_parameter_is_refused(tmp_path: Any) -> None:
    """Micro-batch k would read the value micro-batch k-1 assigned, which the micro-batch
    copies (emitted last micro-batch first) cannot give: one message naming the reader."""
    source = textwrap.dedent(MODEL.format(stages=2, micro=2, norm="Scaled()")).replace(
        "class Net(nn.Cell):", textwrap.dedent("""
        class Scaled(nn.Cell):
            def __init__(self):
                super().__init__()
                self.s = Parameter(Tensor(np.ones(16, np.float32)), "s", requires_grad=False)

            def construct(self, x):
                y = x * self.s
                ops.assign(self.s, x.mean(0))
                return y


        class Net(nn.Cell):"""))
    path = tmp_path / "reads_assigned.py"
    path.write_text(source)
    with pytest.raises(PcompileError, match=r"Mul .* inside nn.PipelineCell's micro-batches "
                                            r"reads Parameter 'bn.s', which Assign '[\w-]+' of "
                                            r"Parameter 'bn.s' at .*reads_assigned.py:\d+"):
        compile_model(str(path), devices=4, dump=False)


ASSIGN_MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 16]), "w")
        self.last = Parameter(Tensor(np.zeros((16,), np.float32)), "last", requires_grad=False)

    def construct(self, x):
        h = ops.matmul(x, self.w)
        ops.assign(self.last, ops.reduce_sum(h, 0))
        return h


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()
        self.a.pipeline_stage, self.b.pipeline_stage = 0, 1

    def construct(self, x):
        return self.b(self.a(x))


def model():
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=2)


def inputs():
    return (np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
"""


def test_an_assign_keeps_the_last_micro_batch_value(tmp_path: Any) -> None:
    """ops.assign inside nn.PipelineCell (it was refused) runs once per micro-batch, in order,
    so the step stores the last micro-batch's value: here the column sums of x @ w over the
    rows of micro-batch 1, the second half of each of the 4 blocks of rows the ranks of a stage
    hold (against numpy, and the float64 check)."""
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.runners import ParallelRunner

    path = tmp_path / "assign_last.py"
    path.write_text(ASSIGN_MODEL)
    program = compile_model(str(path), devices=8, dump=False)
    report = check(program, steps=2)
    assert report.ok(), report
    parallel = ParallelRunner(program, float64=True)
    _, _, arrays = next(batches(program, 1))
    w = np.asarray(program.initial_values["a.w"], np.float64)
    parallel.step(arrays)
    x = np.asarray(arrays[0], np.float64)
    rows = np.concatenate([x[j * 8 + 4:(j + 1) * 8] for j in range(4)])
    np.testing.assert_allclose(parallel.global_value("a.last"), (rows @ w).sum(0),
                               rtol=1e-12, atol=1e-12)


def test_the_check_refuses_batch_norm_with_dropout_over_split_rows(tmp_path: Any) -> None:
    """BatchNorm and a dropout with the batch split inside a stage compile, but no
    single-device program draws a micro-batch gathered from several ranks' rows in one piece:
    the check says so in one message (one device a stage checks it)."""
    norm = "nn.SequentialCell(nn.BatchNorm1d(16), nn.Dropout(p=0.5))"
    program = compile_model(_write(tmp_path, 2, 2, norm), devices=4, dump=False)
    with pytest.raises(PcompileError, match=r"the check cannot compare this plan: Dropout .*"
                                            r"2 blocks the ranks of a stage hold"):
        check(program, steps=1)
    program = compile_model(_write(tmp_path, 2, 2, norm), devices=2, dump=False)
    report = check(program, steps=2)
    assert report.ok(), report
