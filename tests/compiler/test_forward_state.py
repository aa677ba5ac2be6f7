"""State updated by the step (issue 35 item 2): a Parameter assigned in the network's forward
computation (`P.AssignAdd`, `P.AssignSub`, `P.Assign`; the expert load and bias of
aux-loss-free routing, tests/models/forward_state.py) is an output of the step stored under
the Parameter's name, in the Parameter's layout, read by the next step: the parallel plan
trains like the single-device program (float64 oracle) with the state split over the ranks
and replicated, in both training forms; the numpy and JAX backends keep it between steps; what
cannot hold it (a trained Parameter, data_parallel, pipeline stages) is one message naming the
file, line and cell."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, check
from pcompile.tools.runners import ParallelRunner, StandAloneRunner
from tests import ROOT
from tests.multiprocess import clean_env

MODEL = os.path.join(ROOT, "tests", "models", "forward_state.py")
LOAD, BIAS = "router.expert_load", "router.expert_bias"
TOKENS = 32  # the model's batch: each token's routing weights sum to one


def _compile(monkeypatch: Any, layout: str, form: str, **kwargs: Any) -> Any:
    monkeypatch.setenv("FORWARD_STATE_LAYOUT", layout)
    monkeypatch.setenv("FORWARD_STATE_FORM", form)
    kwargs.setdefault("devices", 8)
    return compile_model(MODEL, dump=False, **kwargs)


@pytest.mark.parametrize("layout, form", [("sharded", "own"), ("replicated", "own"),
                                          ("sharded", "loss"), ("replicated", "loss")])
def test_state_assigned_in_the_forward_trains_like_one_device(monkeypatch: Any, layout: str,
                                                              form: str) -> None:
    program = _compile(monkeypatch, layout, form)
    names = program.output_names
    assert names[0] == "loss" and LOAD in names and BIAS in names
    assert program.graph.attrs["assigned"] == (LOAD, BIAS)
    split = layout == "sharded"
    for name in (LOAD, BIAS):  # stored as the Parameter is laid out: 8 ways, or whole
        want = TensorLayout((8,), (0,) if split else (-1,), (8,))
        assert program.state.assignment.param_layouts[name] == want, name
    report = check(program, steps=3)
    assert report.ok(), f"worst {report.worst}"
    assert report.errors[LOAD] <= FLOAT64_RTOL and report.errors[BIAS] <= FLOAT64_RTOL
    # independent of the oracle: the load accumulates every step's routing weights, one per
    # token, and the bias moved by 0.001 a step towards the less loaded experts
    runner = ParallelRunner(program, float64=True)
    for step, (_, _, arrays) in enumerate(batches(program, 3), start=1):
        runner.step(arrays)
        load = runner.global_value(LOAD)
        assert abs(float(load.sum()) - TOKENS * step) <= FLOAT64_RTOL * TOKENS * step
    bias = runner.global_value(BIAS)
    assert np.all(np.isin(np.round(bias / 0.001), [-3, -1, 1, 3])), bias
    assert float(bias.sum()) != 0 or np.any(bias != 0)


@pytest.mark.parametrize("layout, kwargs", [
    ("sharded", {"overrides": {"enable_parallel_optimizer": True,
                               "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}}}),
    ("replicated", {"search_mode": "sharding_propagation"}),
    ("replicated", {"search_mode": "ilp"}),
])
def test_state_under_the_parallel_optimizer_and_the_searches(monkeypatch: Any, layout: str,
                                                             kwargs: Any) -> None:
    """The parallel optimizer shards the trained weights only (the state keeps its layout);
    the searches lay out the assignments like any element-wise op; the shrunk check's copy
    carries the state too."""
    from pcompile.tools.shrink import shrunk_check

    program = _compile(monkeypatch, layout, "own", **kwargs)
    if "overrides" in kwargs:
        assert "w_out" in program.state.opt_shard and LOAD not in program.state.opt_shard
    report = check(program, steps=2)
    assert report.ok() and report.errors[LOAD] <= FLOAT64_RTOL, report.worst
    if "overrides" in kwargs:
        shrunk = shrunk_check(program, factor=2)
        assert shrunk.report.ok() and LOAD in shrunk.report.errors, shrunk.report.worst


def test_the_jax_step_keeps_the_state_on_the_device(monkeypatch: Any) -> None:
    """One device, float32: the jitted step donates the state and returns the new values,
    the numpy interpreter's bit for bit up to float32 rounding of the sums."""
    program = _compile(monkeypatch, "replicated", "own", devices=1)
    on_device = StandAloneRunner(program, "jax")
    numpy = StandAloneRunner(program, "numpy")
    for _, _, arrays in batches(program, 3):
        on_device.step(arrays)
        numpy.step(arrays)
    # a sum of 32 float32 routing weights per expert and step, 3 steps
    bound = 2.0 ** -24 * TOKENS * 3
    for name in (LOAD, BIAS):
        got, want = np.asarray(on_device.values[name]), np.asarray(numpy.values[name])
        np.testing.assert_allclose(got, want, rtol=bound, atol=bound, err_msg=name)
    assert float(np.asarray(numpy.values[LOAD]).sum()) == pytest.approx(TOKENS * 3, rel=bound)


def test_the_dump_names_the_assignments_and_their_redistribution(monkeypatch: Any,
                                                                 tmp_path: Any) -> None:
    program = compile_model(MODEL, devices=8, out_dir=str(tmp_path / "out"))
    assert program.output_names.index(LOAD) > 0
    text = (tmp_path / "out" / "rank_0" / "05_execute.ir").read_text()
    assert "assigned: (router.expert_load, router.expert_bias)" in text
    assert "= AssignAdd(%para" in text and "{instance name: assign_add}" in text
    assert "= AssignSub(%para" in text


BASE = '''
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, initializer, set_auto_parallel_context

set_auto_parallel_context({context})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 16]), "w")
        self.count = Parameter(Tensor(np.zeros((16,), np.float32)), "count",
                               requires_grad={trained})
        self.matmul = ops.MatMul()
        self.sum = ops.ReduceSum()

    def construct(self, x):
        h = self.matmul(x, self.w)
        ops.assign_add(self.count, self.sum(h, 0))
        return h


def model():
    return {model}
{loss}

def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)


def inputs():
    return (np.ones((16, 16), np.float32),)


def labels():
    return (np.ones((16, 16), np.float32),)
'''


LOSS = """

def loss():
    return nn.MSELoss()
"""


def _write(tmp_path: Any, context: str = 'parallel_mode="semi_auto_parallel", device_num=8',
           trained: bool = False, model: str = "Net()", loss: str = LOSS) -> str:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(BASE.format(context=context, trained=trained,
                                                model=model, loss=loss)))
    return str(path)


def test_a_trained_parameter_assigned_in_the_forward_is_one_message(tmp_path: Any) -> None:
    path = _write(tmp_path, trained=True)
    with pytest.raises(PcompileError) as info:
        compile_model(path, devices=8, dump=False)
    message = str(info.value)
    assert "AssignAdd updates Parameter 'count' at " in message
    assert "model.py:19 (cell Default/network-WithLossCell/_backbone-Net)" in message
    assert "create it with requires_grad=False" in message


def test_data_parallel_refuses_a_forward_assignment_naming_it(tmp_path: Any) -> None:
    path = _write(tmp_path, context='parallel_mode="data_parallel", device_num=8')
    with pytest.raises(PcompileError) as info:
        compile_model(path, devices=8, dump=False)
    message = str(info.value)
    assert message.startswith("AssignAdd 'AssignAdd-op0' of Parameter 'count' at ")
    assert "model.py:19 (cell Default/network-WithLossCell/_backbone-Net)" in message
    assert "in data_parallel mode every rank would update it from its own batch" in message


@pytest.mark.parametrize("micro", ["1", "4"])
def test_pipeline_micro_batches_add_up_the_statistic(monkeypatch: Any, micro: str) -> None:
    """Two stages, each counting its outputs' column sums with AssignAdd inside
    nn.PipelineCell: MindSpore runs the assignment once per micro-batch, so the step's count
    is the sum over the micro-batches: the whole batch's, as one device counts it (float64
    oracle; and against numpy)."""
    from pcompile.tools.oracle import single_device

    monkeypatch.setenv("PIPE_STATE_MICRO", micro)
    program = compile_model(os.path.join(ROOT, "tests", "models", "pipeline_state.py"),
                            devices=8, dump=False)
    assert program.state.pipelined
    report = check(program, steps=2)
    assert report.ok(), report.worst
    assert report.errors["a.count"] <= FLOAT64_RTOL and report.errors["b.count"] <= FLOAT64_RTOL
    # independent of the oracle: block a's count is the column sums of x @ w over the batch
    one = single_device(program)
    w = np.asarray(one.initial_values["a.w"], np.float64)
    parallel = ParallelRunner(program, float64=True)
    _, _, arrays = next(batches(program, 1))
    parallel.step(arrays)
    want = (np.asarray(arrays[0], np.float64) @ w).sum(axis=0)
    np.testing.assert_allclose(parallel.global_value("a.count"), want, rtol=1e-12, atol=1e-12)


PIPELINE_BODY = """
class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 16]), "w")
        self.count = Parameter(Tensor(np.zeros((16,), np.float32)), "count", requires_grad=False)
        self.matmul = ops.MatMul()

    def construct(self, x):
        h = self.matmul(x, self.w)
        {assignment}
        return h


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()
        self.a.pipeline_stage, self.b.pipeline_stage = 0, 1

    def construct(self, x):
        return self.b(self.a(x))
"""


@pytest.mark.parametrize("assignment, why", [
    ("ops.assign_add(self.count, 1.0)", "it reads no micro-batch's data"),
    ("h = h * self.count\n        ops.assign(self.count, ops.reduce_sum(h, 0))",
     "micro-batch k reads the value micro-batch k-1 assigned"),
    ("h = h + ops.assign_add(self.count, ops.reduce_sum(h, 0))",
     "the forward reads the new value again"),
])
def test_pipeline_assignments_micro_batches_cannot_add_up_are_one_message(
        tmp_path: Any, assignment: str, why: str) -> None:
    body = PIPELINE_BODY.format(assignment=assignment)
    path = _write(tmp_path, context='parallel_mode="semi_auto_parallel", device_num=8, '
                                    'pipeline_stages=2',
                  model="nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), 2)", loss="")
    source = open(path).read()
    cut = source.index("class Net(nn.Cell):")
    end = source.index("def model():")
    open(path, "w").write(source[:cut] + textwrap.dedent(body) + "\n\n" + source[end:])
    with pytest.raises(PcompileError) as info:
        compile_model(path, devices=8, dump=False)
    message = str(info.value)
    assert "of Parameter 'a.count' at " in message and "model.py:" in message, message
    assert "(cell Default/network-PipelineCell" in message and why in message, message


@pytest.mark.slow  # three runs of 8 rank processes (~60 s of CPU)
def test_the_state_is_checkpointed_and_resumed_bit_exactly(tmp_path: Any) -> None:
    """4 steps straight, and 2 steps then --resume to 4: the same checkpoint of step 4 on
    every rank, bit for bit (the state split over the ranks included), the same train.log."""
    from safetensors.numpy import load_file

    def run(out: str, *extra: str) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "pcompile", MODEL, "--devices", "8", "--out", out,
             "--no-check", "--run", "--checkpoint-every", "2", *extra],
            capture_output=True, text=True, env=clean_env(), timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    run("straight", "--steps", "4")
    run("resumed", "--steps", "2")
    run("resumed", "--steps", "4", "--resume")
    for rank in range(8):
        step = f"checkpoints/rank_{rank}/step_00000004.safetensors"
        want = load_file(str(tmp_path / "straight" / step))
        got = load_file(str(tmp_path / "resumed" / step))
        assert sorted(got) == sorted(want) and LOAD in want and want[LOAD].shape == (1,)
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), (rank, name)
    log = "rank_0/train.log"
    assert (tmp_path / "resumed" / log).read_text() == (tmp_path / "straight" / log).read_text()


TWICE = '''
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, initializer, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [16, 8]), "w")
        self.count = Parameter(Tensor(np.zeros((8,), np.float32)), "count", requires_grad=False)
        self.matmul = ops.MatMul().shard(((8, 1), (1, 1)))
        self.sum = ops.ReduceSum().shard(((8, 1),))
        self.first = ops.AssignAdd().shard(((8,), (8,)))
        self.second = ops.AssignAdd().shard(((1,), (1,)))

    def construct(self, x):
        h = self.matmul(x, self.w)
        self.first(self.count, self.sum(h, 0))
        self.second(self.count, self.sum(h * h, 0))
        return h


def model():
    return Net()


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)


def inputs():
    return (np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32),)


def labels():
    return (np.ones((16, 8), np.float32),)
'''


def test_a_value_assigned_in_another_layout_is_stored_in_the_parameters(tmp_path: Any) -> None:
    """The second AssignAdd of `count` (split 8 ways by the first) computes it whole: the new
    value is sliced back to the Parameter's layout at the step's end, the reason naming it."""
    path = tmp_path / "model.py"
    path.write_text(TWICE)
    program = compile_model(str(path), devices=8, dump=False)
    assert program.state.assignment.param_layouts["count"] == TensorLayout((8,), (0,), (8,))
    reasons = [n.parallel.reason for n in program.rank_graphs[0].nodes
               if n.parallel is not None and n.parallel.reason]
    assert any("the new value of Parameter 'count' (AssignAdd 'second') is stored in the "
               "Parameter's layout" in r for r in reasons), reasons
    report = check(program, steps=2)
    assert report.ok() and report.errors["count"] <= FLOAT64_RTOL, report.errors


def test_a_cell_returning_gradients_returns_the_state_after_them(tmp_path: Any) -> None:
    """A GradWrap cell (GradOperation(get_all=True, get_by_list=True), no optimizer) over a
    network that accumulates a statistic: the program returns the gradients, then the
    statistic's new value under its name, checked against one device."""
    source = open(os.path.join(ROOT, "tests", "models", "grad_wrap.py")).read()
    source = source.replace(
        "        self.relu = ops.ReLU()\n",
        "        self.relu = ops.ReLU()\n"
        "        self.count = Parameter(initializer('zeros', [32]), 'count', requires_grad=False)\n"
        "        self.sum = ops.ReduceSum().shard(((8, 1),))\n")
    source = source.replace(
        "        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)\n",
        "        h = self.relu(self.matmul1(x, self.w1))\n"
        "        ops.assign_add(self.count, self.sum(h, 0))\n"
        "        return self.matmul2(h, self.w2)\n")
    path = tmp_path / "grad_wrap_state.py"
    path.write_text(source)
    program = compile_model(str(path), devices=8, dump=False)
    assert program.output_names == [*(f"output{i}" for i in range(4)),
                                    "network._backbone.count"]
    report = check(program)
    assert report.ok() and report.errors["output4"] <= FLOAT64_RTOL, report.errors
