"""The MindSpore training form (issues 14, 16 and 17): a network that computes its own loss
(scalar, (1,)-shaped or a vector, back-propagated with a sensitivity of ones), training step
cells returned by model() (`nn.TrainOneStepCell`, `nn.TrainOneStepWithLossScaleCell` with fixed
and dynamic loss scales, `nn.WithGradCell`, a GradWrap cell calling `ops.GradOperation`, a
TrainOneStepCell subclass that clips gradients), learning-rate schedules, `Cell.set_train` and
custom `bprop`.

Every parallel program is checked against the single-device program (the float64 oracle,
`report.ok()` at its derived bound); MindSpore's semantics are checked against independent
references: the gradient of a vector objective is the gradient of its sum, a loss scale that is
a power of two changes nothing, an overflowing step leaves every parameter as it was and moves
the dynamic scale as MindSpore's update cell does, clipping makes the SGD step's global norm
lr * clip_norm, scheduled rates follow MindSpore's formulas on a linear model whose gradient is
written by hand."""

from __future__ import annotations

import math
import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, check, relative_error, single_device
from pcompile.tools.runners import ParallelRunner, StandAloneRunner

HEADER = """\
import numpy as np
from pcompile import nn, ops, Parameter, ParameterTuple, Tensor, initializer, set_seed
from pcompile import set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    # Both weights split 4 ways and replicated over 2 ranks (dev matrix [2, 4, 1]).
    def __init__(self):
        super().__init__()
        set_seed(3)
        self.w1 = Parameter(initializer("normal", [16, 32]), "w1")
        self.w2 = Parameter(initializer("normal", [32, 16]), "w2")
        self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.matmul2 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)


class NetWithLoss(nn.Cell):
    # The network computes its own loss from (x, label): mean squared error, or per sample
    # ("vector"), their sum ("sum"), or the mean as a (1,) tensor ("one"), as mindformers does.
    def __init__(self, form="scalar"):
        super().__init__()
        self.net = Net()
        self.square = ops.Square().shard(((8, 1),))
        self.mean = ops.ReduceMean().shard(((8, 1),))
        self.form = form

    def construct(self, x, label):
        per_sample = self.mean(self.square(self.net(x) - label), 1)
        if self.form == "vector":
            return per_sample
        if self.form == "sum":
            return ops.reduce_sum(per_sample)
        loss = ops.reduce_mean(per_sample)
        return ops.reshape(loss, (1,)) if self.form == "one" else loss


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 16)).astype(np.float32),
            rng.standard_normal((16, 16)).astype(np.float32))
"""


def write(tmp_path: Any, body: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body))
    return str(path)


def compile_source(tmp_path: Any, body: str, name: str = "model.py", **kwargs: Any) -> Any:
    kwargs.setdefault("dump", False)
    return compile_model(write(tmp_path, body, name), **kwargs)


def single(program: Any, steps: int) -> StandAloneRunner:
    """The single-device program of the same file, run `steps` steps in float64."""
    one = compile_model(program.state.model_file.path, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    for _, _, arrays in batches(one, steps):
        runner.step(arrays)
    return runner


def assert_oracle(program: Any, steps: int = 2) -> Any:
    report = check(program, steps=steps)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"
    return report


# -- a network that computes its own loss ------------------------------------------------------

OWN_LOSS = """
def model():
    return NetWithLoss("{form}")


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel", "data_parallel"])
def test_network_with_its_own_loss_trains_like_one_device(tmp_path: Any, mode: str) -> None:
    kwargs: dict[str, Any] = {"devices": 8, "dump": True, "out_dir": str(tmp_path / "out")}
    if mode == "auto_parallel":
        kwargs["search_mode"] = "sharding_propagation"
    else:
        kwargs["parallel_mode"] = mode
    if mode == "data_parallel":
        kwargs["overrides"] = {"gradients_mean": True}  # the loss is a mean over the batch
    program = compile_source(tmp_path, OWN_LOSS.format(form="scalar"), **kwargs)
    assert [name for name, _ in program.timings][-3:] == ["train_step", "comm_fusion", "execute"]
    assert program.output_names == ["loss", "net.w1", "net.w2", "moments.net.w1",
                                    "moments.net.w2"]
    # MindSpore's scope for the network of TrainOneStepCell(network, optimizer)
    matmul = program.graph.find(instance_name="matmul1")[0]
    assert matmul.scope == "Default/network-NetWithLoss/net-Net"
    assert program.graph.attrs["training"] is True
    assert_oracle(program, steps=3)


@pytest.mark.parametrize("form", ["one", "vector"])
def test_objective_shapes_train_like_one_device(tmp_path: Any, form: str) -> None:
    program = compile_source(tmp_path, OWN_LOSS.format(form=form), devices=8)
    assert_oracle(program)


def test_vector_objective_is_differentiated_with_a_sensitivity_of_ones(tmp_path: Any) -> None:
    """MindSpore seeds the backward of a non-scalar objective with ones: the update is the
    gradient of its sum; the reported loss is its mean (as LossMonitor prints)."""
    vector = single(compile_source(tmp_path, OWN_LOSS.format(form="vector"), "vector.py",
                                   devices=8), 2)
    total = single(compile_source(tmp_path, OWN_LOSS.format(form="sum"), "sum.py",
                                  devices=8), 2)
    for name in ("net.w1", "net.w2", "moments.net.w1"):
        assert relative_error(vector.values[name], total.values[name]) <= FLOAT64_RTOL, name
    one = compile_model(str(tmp_path / "vector.py"), devices=1, dump=False)
    _, _, arrays = next(batches(one, 1))
    loss_vector = StandAloneRunner(one, "numpy", float64=True).step(arrays)
    one_sum = compile_model(str(tmp_path / "sum.py"), devices=1, dump=False)
    loss_sum = StandAloneRunner(one_sum, "numpy", float64=True).step(arrays)
    assert abs(loss_vector * 16 - loss_sum) <= FLOAT64_RTOL * abs(loss_sum)


LOSS_CELL = """
def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32),)


def loss():
    return nn.MSELoss(reduction="{reduction}")


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_a_loss_cell_without_reduction_is_differentiated_like_its_sum(tmp_path: Any) -> None:
    """loss() with reduction='none' (a (16, 16) objective): the backward starts from ones, so
    the step equals reduction='sum'; 8 devices equal one."""
    program = compile_source(tmp_path, LOSS_CELL.format(reduction="none"), "none.py",
                             devices=8)
    assert_oracle(program)
    none = single(program, 2)
    total = single(compile_source(tmp_path, LOSS_CELL.format(reduction="sum"), "sum.py",
                                  devices=8), 2)
    for name in ("w1", "w2"):
        assert relative_error(none.values[name], total.values[name]) <= FLOAT64_RTOL


# -- nn.TrainOneStepCell -----------------------------------------------------------------------

TRAIN_ONE_STEP = """
def model():
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate={lr})
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt{sens})
"""


def test_train_one_step_cell_trains_like_one_device(tmp_path: Any) -> None:
    program = compile_source(tmp_path, TRAIN_ONE_STEP.format(lr=0.1, sens=""), devices=8)
    assert program.output_names == ["loss", "w1", "w2"]
    matmul = program.graph.find(instance_name="matmul1")[0]
    assert matmul.scope == "Default/network-WithLossCell/_backbone-Net"
    assert_oracle(program, steps=3)


def test_train_one_step_cell_sens_scales_the_gradient(tmp_path: Any) -> None:
    """sens=2 seeds the backward with 2: with SGD the step equals twice the learning rate."""
    doubled = single(compile_source(tmp_path, TRAIN_ONE_STEP.format(lr=0.1, sens=", sens=2.0"),
                                    "sens.py", devices=8), 2)
    fast = single(compile_source(tmp_path, TRAIN_ONE_STEP.format(lr=0.2, sens=""), "lr.py",
                                 devices=8), 2)
    for name in ("w1", "w2"):
        assert relative_error(doubled.values[name], fast.values[name]) <= FLOAT64_RTOL


# -- gradients as outputs: nn.WithGradCell and GradWrap ----------------------------------------

GRAD_WRAP = """
class GradWrap(nn.Cell):
    def __init__(self, network):
        super().__init__()
        self.network = network
        self.weights = ParameterTuple(network.trainable_params())
        self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param={sens_param})

    def construct(self, x, label):
        return self.grad(self.network, self.weights)(x, label{sens})


def model():
    return GradWrap(nn.WithLossCell(Net(), nn.MSELoss()))
"""


def test_grad_wrap_returns_input_and_weight_gradients_like_one_device(tmp_path: Any) -> None:
    program = compile_source(tmp_path, GRAD_WRAP.format(sens_param=False, sens=""), devices=8)
    assert not program.training
    assert program.output_names == ["output0", "output1", "output2", "output3"]
    shapes = [layout.shape for layout in program.state.output_layouts]
    assert shapes == [(16, 16), (16, 16), (16, 32), (32, 16)]  # d x, d label, d w1, d w2
    report = assert_oracle(program)
    assert set(report.errors) == {"output0", "output1", "output2", "output3"}


def test_grad_wrap_with_a_sensitivity(tmp_path: Any) -> None:
    """sens_param=True: the last argument seeds the backward (here 3, so 3x the gradients)."""
    body = GRAD_WRAP.format(sens_param=True, sens=", ops.fill(ops.float32, (), 3.0)")
    body = body.replace("ops.float32", "np.float32")
    program = compile_source(tmp_path, body, "sens.py", devices=8)
    assert_oracle(program)
    plain = compile_source(tmp_path, GRAD_WRAP.format(sens_param=False, sens=""), "plain.py",
                           devices=1)
    scaled = compile_model(str(tmp_path / "sens.py"), devices=1, dump=False)
    _, _, arrays = next(batches(plain, 1))
    want = StandAloneRunner(plain, "numpy", float64=True).run(arrays)
    got = StandAloneRunner(scaled, "numpy", float64=True).run(arrays)
    for g, w in zip(got, want):
        assert relative_error(g, 3.0 * w) <= FLOAT64_RTOL


def test_grad_wrap_as_mindspore_parallel_tests_write_it(tmp_path: Any) -> None:
    """MindSpore's parallel unit tests: a module-level `grad_all = GradOperation(get_all=True)`,
    GradWrap(NetWithLoss(net)) over three inputs, `set_auto_parallel()` and `set_train()`."""
    body = """
    grad_all = ops.GradOperation(get_all=True)


    class MatMulNet(nn.Cell):
        def __init__(self):
            super().__init__()
            self.matmul1 = ops.MatMul().shard(((2, 2), (2, 2)))
            self.matmul2 = ops.MatMul().shard(((2, 2), (2, 2)))

        def construct(self, x, y, b):
            return self.matmul2(self.matmul1(x, y), b)


    class NetWithLoss(nn.Cell):
        def __init__(self, network):
            super().__init__()
            self.network = network
            self.loss = ops.ReduceSum()

        def construct(self, x, y, b):
            return self.loss(self.network(x, y, b))


    class GradWrap(nn.Cell):
        def __init__(self, network):
            super().__init__()
            self.network = network

        def construct(self, x, y, b):
            return grad_all(self.network)(x, y, b)


    def model():
        net = GradWrap(NetWithLoss(MatMulNet()))
        net.set_auto_parallel()
        net.set_train()
        return net


    def inputs():
        rng = np.random.default_rng(0)
        return tuple(rng.standard_normal(s).astype(np.float32)
                     for s in ((64, 32), (32, 64), (64, 64)))
    """
    program = compile_source(tmp_path, body, devices=8)
    assert program.output_names == ["output0", "output1", "output2"]
    assert [layout.shape for layout in program.state.output_layouts] == [
        (64, 32), (32, 64), (64, 64)]
    assert_oracle(program)
    # d sum(x y b) / dx = 1 b^T y^T, written directly
    one = compile_model(program.state.model_file.path, devices=1, dump=False)
    arrays = next(batches(one, 1))[2]
    x, y, b = (a.astype(np.float64) for a in arrays)
    dx = StandAloneRunner(one, "numpy", float64=True).run(arrays)[0]
    assert relative_error(dx, np.ones((64, 64)) @ b.T @ y.T) <= FLOAT64_RTOL


def test_with_grad_cell_matches_the_analytic_gradient(tmp_path: Any) -> None:
    """nn.WithGradCell(net, loss_fn) on y = x W with MSE: dL/dW = 2 x^T (x W - y) / (N M)."""
    body = """
    class Linear(nn.Cell):
        def __init__(self):
            super().__init__()
            set_seed(5)
            self.w = Parameter(initializer("normal", [16, 8]), "w")
            self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))

        def construct(self, x):
            return self.matmul(x, self.w)


    def model():
        return nn.WithGradCell(Linear(), nn.MSELoss())


    def inputs():
        rng = np.random.default_rng(1)
        return (rng.standard_normal((16, 16)).astype(np.float32),
                rng.standard_normal((16, 8)).astype(np.float32))
    """
    program = compile_source(tmp_path, body, devices=8)
    assert_oracle(program)
    one = compile_model(program.state.model_file.path, devices=1, dump=False)
    _, _, (x, y) = next(batches(one, 1))
    w = np.asarray(one.initial_values["w"], np.float64)
    (got,) = StandAloneRunner(one, "numpy", float64=True).run([x, y])
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    want = 2.0 * x64.T @ (x64 @ w - y64) / y.size
    assert relative_error(got, want) <= FLOAT64_RTOL


# -- loss scaling ------------------------------------------------------------------------------

LOSS_SCALE = """
import os

def model():
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    return nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, nn.MSELoss()), opt,
                                            scale_sense={scale})


def dataset():
    # Step {bad} (1-based) has an inf input: every gradient is NaN in any precision.
    rng = np.random.default_rng(0)
    for step in range(6):
        x = rng.standard_normal((16, 16)).astype(np.float32)
        if step + 1 == {bad}:
            x[3, 5] = np.inf
        yield x, rng.standard_normal((16, 16)).astype(np.float32)
"""

PLAIN_MOMENTUM = """
def model():
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
"""


def dynamic_scale_reference(init: float, factor: float, window: int,
                            overflows: list[bool]) -> list[float]:
    """MindSpore's DynamicLossScaleUpdateCell, step by step (the scale after each step)."""
    scale, cur, last, out = init, 1, 0, []
    for overflow in overflows:
        on_overflow = max(scale / factor, 1.0) if overflow else scale
        should_inc = cur - last >= window
        if overflow or should_inc:
            last = cur
        scale = on_overflow * factor if should_inc and not overflow else on_overflow
        cur += 1
        out.append(scale)
    return out


def test_fixed_power_of_two_scale_changes_nothing(tmp_path: Any) -> None:
    # a (1,) scale for a scalar loss, as MindSpore's examples write it
    scaled = compile_source(tmp_path, LOSS_SCALE.format(
        scale="Tensor(np.array([1024.0], np.float32))", bad=0), "scaled.py", devices=8)
    assert scaled.output_names[:3] == ["loss", "w1", "w2"]
    assert_oracle(scaled, steps=3)
    plain = compile_source(tmp_path, PLAIN_MOMENTUM + LOSS_SCALE.split("def dataset")[0]
                           .replace("def model", "def unused") + "def dataset" +
                           LOSS_SCALE.split("def dataset")[1].format(bad=0), "plain.py",
                           devices=8)
    a, b = single(scaled, 3), single(plain, 3)
    for name in ("w1", "w2", "moments.w1", "moments.w2"):
        assert relative_error(a.values[name], b.values[name]) <= FLOAT64_RTOL, name
    assert a.values["scale_sense"].tolist() == [1024.0]


@pytest.mark.parametrize("parallel", ["semi_auto_parallel", "data_parallel",
                                      "hybrid_parallel"])
def test_dynamic_loss_scale_skips_an_overflowing_step_like_one_device(tmp_path: Any,
                                                                      parallel: str) -> None:
    body = LOSS_SCALE.format(scale="nn.DynamicLossScaleUpdateCell(2.0 ** 10, 2, 2)", bad=2)
    program = compile_source(tmp_path, body, devices=8, parallel_mode=parallel,
                             overrides={"gradients_mean": parallel != "semi_auto_parallel"})
    assert_oracle(program, steps=6)
    # MindSpore's semantics, on the parallel program's own values, step by step.
    runner = ParallelRunner(program, float64=True)
    one = compile_model(program.state.model_file.path, devices=1, dump=False)
    before = {n: runner.global_value(n) for n in ("w1", "w2", "moments.w1")}
    scales, overflows = [], []
    for step, (_, _, arrays) in enumerate(batches(one, 6), start=1):
        loss = runner.step(arrays)
        overflow = bool(runner.values[0]["output1"])
        overflows.append(overflow)
        scales.append(float(runner.values[0]["scale_sense"]))
        after = {n: runner.global_value(n) for n in before}
        assert overflow == (step == 2) and math.isnan(loss) == (step == 2)
        for name in before:  # skipped: every parameter and state exactly as before
            assert np.array_equal(after[name], before[name]) == overflow, (step, name)
        before = after
    assert scales == dynamic_scale_reference(2.0 ** 10, 2.0, 2, overflows)
    assert int(runner.values[0]["current_iterator_step"]) == 7


def test_fixed_scale_update_cell_keeps_the_scale_and_skips(tmp_path: Any) -> None:
    body = LOSS_SCALE.format(scale="nn.FixedLossScaleUpdateCell(128.0)", bad=1)
    program = compile_source(tmp_path, body, devices=8)
    assert_oracle(program, steps=3)
    runner = single(program, 1)
    one = compile_model(program.state.model_file.path, devices=1, dump=False)
    for name in ("w1", "w2"):
        assert np.array_equal(runner.values[name],
                              np.asarray(one.initial_values[name], np.float64))
    assert float(runner.values["scale_sense"]) == 128.0


def test_a_scale_that_overflows_float32_is_lowered(tmp_path: Any) -> None:
    """In float32 a scale of 2^127 overflows the scaled gradients (labels of size 1000 make
    the loss gradient > 2): the step is skipped and the scale halved, as MindSpore's dynamic
    loss scale does."""
    body = LOSS_SCALE.format(scale="nn.DynamicLossScaleUpdateCell(2.0 ** 127, 2, 1000)",
                             bad=0).replace("np.float32)\n\"\"\"", "")
    body = body.replace("yield x, rng.standard_normal((16, 16)).astype(np.float32)",
                        "yield x, 1000 * rng.standard_normal((16, 16)).astype(np.float32)")
    program = compile_source(tmp_path, body, devices=1)
    runner = StandAloneRunner(program, "numpy")  # float32, as it runs
    start = {n: np.array(runner.values[n]) for n in ("w1", "w2")}
    _, _, arrays = next(batches(program, 1))
    with np.errstate(all="ignore"):
        runner.step(arrays)
    assert bool(runner.values["output1"]) is True
    assert float(runner.values["scale_sense"]) == 2.0 ** 126
    for name, value in start.items():
        assert np.array_equal(runner.values[name], value)


# -- ops.assign in a training step cell ---------------------------------------------------------

ASSIGN = """
class SmoothedLossStep(nn.TrainOneStepCell):
    def __init__(self, network, optimizer):
        super().__init__(network, optimizer)
        self.smooth = Parameter(Tensor(np.zeros((), np.float32)), "smooth", requires_grad=False)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        grads = self.grad(self.network, self.weights)(*inputs)
        loss = ops.depend(loss, self.optimizer(grads))
        ops.assign(self.smooth, self.smooth * 0.5 + loss * 0.5)
        return loss


def model():
    net = Net()
    return SmoothedLossStep(nn.WithLossCell(net, nn.MSELoss()),
                            nn.SGD(net.trainable_params(), learning_rate=0.1))
"""


def test_assign_stores_a_new_value_of_a_step_parameter(tmp_path: Any) -> None:
    """ops.assign keeps a smoothed loss in the step cell's own Parameter: the step returns it
    as a stored value, every step reads the previous one, and the plan trains like one
    device."""
    program = compile_source(tmp_path, ASSIGN, devices=8)
    assert program.output_names == ["loss", "w1", "w2", "smooth"]
    assert_oracle(program, steps=3)
    runner = ParallelRunner(program, float64=True)
    want = 0.0
    for _, _, arrays in batches(program, 3):
        want = 0.5 * want + 0.5 * runner.step(arrays)
        assert abs(float(runner.global_value("smooth")) - want) <= FLOAT64_RTOL * want


# -- global-norm clipping ----------------------------------------------------------------------

CLIP = """
class ClipStep(nn.TrainOneStepCell):
    def construct(self, *inputs):
        loss = self.network(*inputs)
        grads = self.grad(self.network, self.weights)(*inputs)
        grads = {clip}
        return ops.depend(loss, self.optimizer(grads))


def model():
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    return ClipStep(nn.WithLossCell(net, nn.MSELoss()), opt)
"""


@pytest.mark.parametrize("overrides", [
    None,
    {"enable_parallel_optimizer": True,
     "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}},
])
def test_active_clipping_under_model_parallelism_trains_like_one_device(
        tmp_path: Any, overrides: Any) -> None:
    program = compile_source(tmp_path, CLIP.format(clip="ops.clip_by_global_norm(grads, 0.01)"),
                             devices=8, overrides=overrides)
    assert_oracle(program, steps=3)
    # Active: with SGD the clipped step has global norm lr * clip_norm over the whole (gathered)
    # parameters (an unclipped step would be shorter: the gradient's norm is larger than 0.01).
    runner = ParallelRunner(program, float64=True)
    start = {n: runner.global_value(n) for n in ("w1", "w2")}
    _, _, arrays = next(batches(program, 1))
    runner.step(arrays)
    step = math.sqrt(sum(float(np.sum((runner.global_value(n) - w) ** 2))
                         for n, w in start.items()))
    want = float(np.float32(0.1)) * float(np.float32(0.01))  # the program's float32 constants
    assert abs(step - want) <= FLOAT64_RTOL * want


def test_clip_grad_norm_returns_the_global_norm_like_one_device(tmp_path: Any) -> None:
    """mindformers' ClipGradNorm: (clipped gradients, global norm); the step returns the
    norm, which every rank computes over the whole gradients."""
    body = CLIP.replace("        return ops.depend(loss, self.optimizer(grads))",
                        "        return ops.depend(loss, self.optimizer(grads)), norm")
    body = body.format(clip="self.clip(grads)\n        grads, norm = grads")
    body = body.replace("    return ClipStep(", "    step = ClipStep(")
    body += "    step.clip = nn.ClipGradNorm(max_norm=0.01)\n    return step\n"
    program = compile_source(tmp_path, body, devices=8)
    assert program.output_names[-1] == "output1"
    report = assert_oracle(program, steps=2)
    assert "output1" in report.errors
    runner = ParallelRunner(program, float64=True)
    _, _, arrays = next(batches(program, 1))
    runner.step(arrays)
    norms = {float(runner.values[r]["output1"]) for r in range(8)}
    assert len(norms) == 1 and norms.pop() > 0.01


def test_a_local_reduction_of_a_split_gradient_is_refused(tmp_path: Any) -> None:
    body = CLIP.format(clip="tuple(g / ops.reduce_sum(ops.square(g)) for g in grads)")
    with pytest.raises(PcompileError, match=r"reduces the gradient of 'w1'.*split.*"
                       r"clip_by_global_norm"):
        compile_source(tmp_path, body, devices=8)
    compile_source(tmp_path, body, "one.py", devices=1)  # one device: the slice is the whole


# -- learning-rate schedules -------------------------------------------------------------------

SCHEDULE = """
class Halving(nn.LearningRateSchedule):
    # A user schedule: 0.2 / 2^step
    def construct(self, global_step):
        step = ops.cast(global_step, ops.float32)
        return ops.pow(Tensor(np.array([0.5], np.float32)), step) * 0.2


class Linear(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(5)
        self.w = Parameter(initializer("normal", [16, 8]), "w")
        self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))

    def construct(self, x):
        return self.matmul(x, self.w)


def model():
    return Linear()


def inputs():
    rng = np.random.default_rng(1)
    return (rng.standard_normal((16, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate={schedule})
"""

def f32(value: float) -> float:
    """A Python number as the program holds it: a float32 constant (as in MindSpore)."""
    return float(np.float32(value))


# MindSpore's formulas, with the constants the program holds (evaluated in float64).
SCHEDULES = {
    "nn.WarmUpLR(0.1, 3)": lambda t: min(t, 3) / 3 * f32(0.1),
    "nn.CosineDecayLR(0.01, 0.1, 3)":
        lambda t: ((math.cos(min(t, 3) * f32(math.pi) / 3) + 1) * f32(0.5 * (0.1 - 0.01))
                   + f32(0.01)),
    "Halving()": lambda t: f32(0.5) ** t * f32(0.2),
    "nn.PolynomialDecayLR(0.1, 0.01, 3, 2.0)":
        lambda t: (1 - min(t, 3) / 3) ** f32(2.0) * f32(0.1 - 0.01) + f32(0.01),
    "nn.ExponentialDecayLR(0.1, 0.5, 2, is_stair=True)":
        lambda t: f32(0.5) ** math.floor(t / 2) * f32(0.1),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_learning_rate_schedules_follow_mindspore(tmp_path: Any, schedule: str) -> None:
    body = SCHEDULE.format(schedule=schedule.replace("ops.float32", "np.float32"))
    body = body.replace("ops.cast(global_step, ops.float32)",
                        "ops.cast(global_step, np.float32)")
    program = compile_source(tmp_path, body, devices=8)
    assert "global_step" in program.output_names
    assert_oracle(program, steps=4)
    one = compile_model(program.state.model_file.path, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    w = np.asarray(one.initial_values["w"], np.float64)
    rate = SCHEDULES[schedule]
    for t, (_, _, (x, y)) in enumerate(batches(one, 4)):
        runner.step([x, y])
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        w = w - rate(t) * 2.0 * x64.T @ (x64 @ w - y64) / y.size
        assert relative_error(runner.values["w"], w) <= FLOAT64_RTOL, t
        assert int(np.asarray(runner.values["global_step"]).reshape(-1)[0]) == t + 1


def test_a_schedule_in_a_training_step_cell(tmp_path: Any) -> None:
    body = """
    def model():
        net = Net()
        lr = nn.CosineDecayLR(0.001, 0.1, 4)
        opt = nn.Adam(net.trainable_params(), learning_rate=lr)
        return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    """
    assert_oracle(compile_source(tmp_path, body, devices=8), steps=3)



def test_adafactor_and_lamb_in_a_training_step_cell(tmp_path: Any) -> None:
    """nn.AdaFactor (relative step, and a schedule without parameter scaling) and nn.Lamb
    replayed by a training step cell: their sums over the split weights' slices (factored
    statistics, whole-parameter norms) are not refused as local reductions of a gradient and
    train as on one device."""
    for make in ("nn.AdaFactor(net.trainable_params(), beta1=None, weight_decay=0.01)",
                 "nn.AdaFactor(net.trainable_params(), learning_rate=nn.CosineDecayLR(0.001, "
                 "0.1, 4), relative_step=False)",
                 "nn.Lamb(net.trainable_params(), 0.01, weight_decay=0.01)"):
        body = f"""
        def model():
            net = Net()
            return nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), {make})
        """
        program = compile_source(tmp_path, body, devices=8)
        if "AdaFactor" in make:  # w1 (16, 32): rows split 4 ways
            assert program.rank_graph(0).param("exp_avg_sq_row.w1").shape == (4,)
        assert_oracle(program, steps=3)

# -- set_train, bprop, misuse ------------------------------------------------------------------

def test_training_compiles_take_the_training_branch(tmp_path: Any) -> None:
    body = """
    class Branchy(nn.Cell):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.tanh = ops.Tanh()

        def construct(self, x):
            out = self.net(x)
            if self.training:
                out = self.tanh(out)
            return out


    def model():
        return Branchy()


    def inputs():
        return (np.ones((16, 16), np.float32),)


    def labels():
        return (np.zeros((16, 16), np.float32),)


    def loss():
        return nn.MSELoss()


    def optimizer(params):
        return nn.SGD(params, learning_rate=0.1)
    """
    trained = compile_source(tmp_path, body, "train.py", devices=1)
    assert trained.graph.find("Tanh")
    inference = compile_source(tmp_path, body.split("def labels")[0], "infer.py", devices=1)
    assert not inference.graph.find("Tanh")


def test_a_custom_bprop_is_used_when_differentiated(tmp_path: Any) -> None:
    """Clamp's bprop halves the cotangent where its construct passes it on: training uses the
    bprop (tests/compiler/test_custom_bprop.py checks it against autodiff where they agree)."""
    body = """
    class Clamp(nn.Cell):
        def construct(self, x):
            return x * 1.0

        def bprop(self, x, out, dout):
            return (dout * 0.5,)


    class WithClamp(nn.Cell):
        def __init__(self):
            super().__init__()
            self.net = NetWithLoss()
            self.clamp = Clamp()

        def construct(self, x, label):
            return self.clamp(self.net(x, label))


    def model():
        return WithClamp()
    """
    body = textwrap.dedent(body)
    trained = compile_source(tmp_path, body + "\n\ndef optimizer(params):\n"
                             "    return nn.SGD(params)\n", devices=1)
    halves = [n for n in trained.graph.nodes if n.op == "Mul"
              and n.scope.startswith("Gradients/Default/network-WithClamp/clamp-Clamp")]
    assert halves, "the bprop's Mul is not in the backward"
    reference = single_device(trained)  # differentiates construct: twice the gradient
    ours = StandAloneRunner(trained, "numpy", float64=True)
    theirs = StandAloneRunner(reference, "numpy", float64=True)
    before = {k: np.array(v) for k, v in ours.values.items()}
    for name in before:
        theirs.values[name] = np.array(before[name])
    _, _, arrays = next(iter(batches(trained, 1)))
    ours.step(arrays)
    theirs.step(arrays)
    for name, start in before.items():
        if name in {p.name for p in trained.graph.weights}:
            np.testing.assert_allclose(ours.values[name] - start,
                                       0.5 * (theirs.values[name] - start), rtol=1e-9,
                                       atol=1e-15)
    compile_source(tmp_path, body, "infer.py", devices=1)  # inference: bprop is not needed


@pytest.mark.parametrize("body,message", [
    ("""
     class Step(nn.TrainOneStepWithLossScaleCell):
         def construct(self, *inputs):
             loss = self.network(*inputs)
             sens = ops.ones_like(loss) * self.scale_sense
             grads = self.grad(self.network, self.weights)(*inputs, sens)
             overflow = self.get_overflow_status(False, grads)
             if not overflow:
                 loss = ops.depend(loss, self.optimizer(grads))
             return loss


     def model():
         net = NetWithLoss()
         opt = nn.SGD(net.trainable_params())
         return Step(net, opt, Tensor(np.array(4.0, np.float32)))
     """, r"Step.construct\(\) .*failed: TypeError: the truth value of a traced tensor.*"
          r"skip=overflow"),
    ("""
     def model():
         net = NetWithLoss()
         return nn.TrainOneStepCell(net, nn.SGD(net.trainable_params()))


     def optimizer(params):
         return nn.SGD(params)
     """, r"returns TrainOneStepCell, a training step cell .* remove optimizer\(\)"),
    ("""
     class Wrap(nn.Cell):
         def __init__(self, net):
             super().__init__()
             self.net = net
             self.grad = ops.GradOperation()

         def construct(self, x, label):
             return self.grad(self.net)(x * 2.0, label)


     def model():
         return Wrap(NetWithLoss())
     """, r"not the training step's own inputs"),
    ("""
     class Forgets(nn.TrainOneStepCell):
         def construct(self, *inputs):
             return self.grad(self.network, self.weights)(*inputs)


     def model():
         net = NetWithLoss()
         return Forgets(net, nn.SGD(net.trainable_params()))
     """, r"holds an optimizer but its construct never calls it"),
])
def test_misuse_gives_one_message(tmp_path: Any, body: str, message: str) -> None:
    with pytest.raises(PcompileError, match=message):
        compile_source(tmp_path, body, devices=8)


def test_grad_operation_outside_a_compiled_step() -> None:
    from pcompile import Tensor, nn, ops

    net = nn.Dense(2, 2)
    with pytest.raises(PcompileError, match="gradients exist only inside a training step"):
        ops.GradOperation()(net)(Tensor(np.ones((1, 2), np.float32)))
