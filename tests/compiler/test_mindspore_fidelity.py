"""What MindSpore 2.10 gives for cases from its own parallel unit tests (tests/ut/python/parallel/)
and for values recorded from its Python binding: out_strategy forms, Layout forms, Gather modes,
context getters, parameter layouts, dumps (issues 14 and 17). Every compiled case is also checked
against the single-device program at the oracle's derived bound (`report.ok()`)."""

from __future__ import annotations

import os
import textwrap
from typing import Any

import pytest

from pcompile import (
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

HEADER = """\
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, Layout, set_auto_parallel_context, shard
"""


def compile_source(tmp_path: Any, body: str, **kwargs: Any) -> Any:
    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return compile_model(str(path), dump=False, **kwargs)


def model_path(name: str) -> str:
    return os.path.join(ROOT, "tests", "models", name)


def strategies(program: Any) -> dict[str, tuple]:
    assignment = program.state.assignment
    return {n.instance_name: assignment.sharding(n).strategy for n in program.graph.nodes
            if assignment.sharding(n) is not None}


def by_name(program: Any, name: str) -> Any:
    return next(n for n in program.graph.nodes if n.instance_name == name)


def rank_ops(program: Any, rank: int = 0) -> list[str]:
    return [n.op for n in program.rank_graph(rank).nodes]


# -- get_auto_parallel_context("comm_fusion") ---------------------------------------------------

#: MindSpore 2.10's `context.get_auto_parallel_context("comm_fusion")`, recorded.
MS_COMM_FUSION_DEFAULT = {
    "openstate": True,
    "allreduce": {"mode": "auto", "config": None},
    "allgather": {"mode": "auto", "config": None},
    "reducescatter": {"mode": "auto", "config": None},
}


def test_comm_fusion_getter_returns_all_four_keys() -> None:
    reset_auto_parallel_context()
    try:
        assert get_auto_parallel_context("comm_fusion") == MS_COMM_FUSION_DEFAULT
        set_auto_parallel_context(comm_fusion={"openstate": False,
                                               "reducescatter": {"mode": "size", "config": 16}})
        assert get_auto_parallel_context("comm_fusion") == {
            "openstate": False,
            "allreduce": {"mode": "auto", "config": None},
            "allgather": {"mode": "auto", "config": None},
            "reducescatter": {"mode": "size", "config": 16},
        }
        reset_auto_parallel_context()
        set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": [2, 4]}})
        got = get_auto_parallel_context("comm_fusion")
        assert got["allreduce"] == {"mode": "index", "config": [2, 4]}
        assert list(got) == ["openstate", "allreduce", "allgather", "reducescatter"]
        assert get_auto_parallel_context("all_reduce_fusion_config") == [2, 4]
        reset_auto_parallel_context()
        assert get_auto_parallel_context("comm_fusion") == MS_COMM_FUSION_DEFAULT
        # the displayed default of allgather does not turn its fusion on
        from pcompile.compiler.config.context import current_context
        assert not current_context().fusion_enabled("allgather")
    finally:
        reset_auto_parallel_context()


# -- out_strategy in MindSpore's AllReduce form -------------------------------------------------

OUT_STRATEGY_MODEL = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num={devices},
                          dataset_strategy="full_batch")
LAYOUT = Layout((2, 2, 2), ("dp", "sp", "mp"))
FORMS = {{
    "tuple": (((2, 2), (2, 2)), ((2, 2),)),
    "reduce_scatter": (((2, 2), (2, 2)), ((4, 2),)),
    "layout": ((LAYOUT("dp", "sp"), LAYOUT("sp", "mp")), (LAYOUT("dp", "mp"),)),
}}


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        in_strategy, out_strategy = FORMS["{form}"]
        if {transpose_b}:
            in_strategy = (in_strategy[0], in_strategy[1][::-1])
        self.matmul = ops.MatMul(transpose_b={transpose_b}).shard(in_strategy, out_strategy)
        self.mul = ops.Mul().shard(((4, 2), (4, 2)))

    def construct(self, x, y, b):
        return self.mul(self.matmul(x, y), b)


def model():
    return Net()


def inputs():
    r = np.random.default_rng(0)
    y = (64, 32) if {transpose_b} else (32, 64)
    return (r.standard_normal((128, 32)).astype(np.float32),
            r.standard_normal(y).astype(np.float32),
            r.standard_normal((128, 64)).astype(np.float32))
"""


@pytest.mark.parametrize("form,devices,transpose_b,kind,rank_list", [
    # test_matmul_output_strategy_all_reduce (and _transpose, _repeat_calc): MindSpore
    # accepts out_strategy == the output of in_strategy and all-reduces the partial sums
    # over the k axis of dev [2, 2, 2] (+ a repeat axis of 2 on the right for 16 devices).
    ("tuple", 8, False, "AllReduce", (0, 2)),
    ("tuple", 8, True, "AllReduce", (0, 2)),
    ("tuple", 16, False, "AllReduce", (0, 4)),
    # the same AllReduce form as a Layout: the output layout of the in_strategy layouts
    ("layout", 8, False, "AllReduce", (0, 2)),
    # test_matmul_output_strategy_reduce_scatter: the ReduceScatter form still scatters
    ("reduce_scatter", 8, False, "ReduceScatter", (0, 2)),
])
def test_out_strategy_allreduce_form(tmp_path: Any, form: str, devices: int, transpose_b: bool,
                                     kind: str, rank_list: tuple) -> None:
    program = compile_source(tmp_path, OUT_STRATEGY_MODEL.format(
        devices=devices, form=form, transpose_b=transpose_b))
    graph = program.rank_graph(0)
    matmul = next(n for n in graph.nodes if n.op == "MatMul")
    (forward,) = [u for u, _ in matmul.result.uses]
    assert forward.op == kind
    assert tuple(forward.attrs["rank_list"]) == rank_list
    report = check(program)
    assert report.ok(), report.errors


def test_out_strategy_neither_form_names_both(tmp_path: Any) -> None:
    body = OUT_STRATEGY_MODEL.format(devices=8, form="tuple", transpose_b=False).replace(
        '"tuple": (((2, 2), (2, 2)), ((2, 2),))', '"tuple": (((2, 2), (2, 2)), ((8, 1),))')
    with pytest.raises(PcompileError) as err:
        compile_source(tmp_path, body)
    text = str(err.value)
    assert "((4, 2),) (ReduceScatter) or ((2, 2),) (AllReduce)" in text
    assert "matmul" in text


# -- "None" inside a multi-axis Layout tuple ----------------------------------------------------

def test_none_inside_a_layout_tuple_is_an_axis_of_size_one() -> None:
    from pcompile import Layout

    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    # MindSpore 2.10's Layout(...)(...).to_dict()["tensor_map"], recorded
    assert layout("dp", ("sp", "None")).to_dict()["tensor_map"] == (2, (1, -1))
    assert layout(("sp", "None"), "mp").to_dict()["tensor_map"] == ((1, -1), 0)
    assert layout(("dp", "sp", "None"), "mp").to_dict()["tensor_map"] == ((2, 1, -1), 0)
    assert layout("dp", ("sp", "None")).shard_strategy == (2, 2)


LAYOUT_EXTEND_MODEL = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
CASES = {{
    # test_layout_extend.py, ..._including_reduce_axis_none
    "reduce_axis_none": (Layout((2, 2, 2), ("dp", "sp", "mp")),
                         lambda l: (l("dp", ("sp", "None")), l(("sp", "None"), "mp")),
                         lambda l: (l(("dp", "sp", "None"), "mp"),)),
    # ..._including_reduce_axis_none_and_not_full
    "not_full": (Layout((2, 2, 2), ("dp", "sp", "mp")),
                 lambda l: (l("dp", ("sp", "None")), l(("sp", "None"), "None")),
                 lambda l: (l(("dp", "sp", "None"), "None"),)),
    # ..._including_dev1: an axis of size 1 in the device matrix
    "dev1": (Layout((2, 2, 2, 1), ("dp", "sp", "vp", "mp")),
             lambda l: (l("dp", ("sp", "mp")), l(("sp", "mp"), "vp")),
             lambda l: (l(("dp", "sp", "mp"), "vp"),)),
}}


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        layout, ins, out = CASES["{case}"]
        self.matmul1 = ops.MatMul().shard(in_strategy=ins(layout), out_strategy=out(layout))
        self.relu = ops.ReLU()
        self.w = Parameter(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32),
                           "w1")

    def construct(self, y):
        out1 = self.matmul1(y, self.w)
        return out1 + self.relu(out1)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),)
"""


@pytest.mark.parametrize("case,w_slice", [
    # MindSpore's weight slices for its [1024, 1024] weight, here for a [64, 64] one:
    ("reduce_axis_none", (32, 32)),   # MindSpore: [512, 512]
    ("not_full", (32, 64)),           # MindSpore: [512, 1024]
    ("dev1", (32, 32)),               # MindSpore: [512, 512]
])
def test_layout_with_none_in_a_tuple_compiles_as_mindspore(tmp_path: Any, case: str,
                                                           w_slice: tuple) -> None:
    program = compile_source(tmp_path, LAYOUT_EXTEND_MODEL.format(case=case))
    assert program.state.assignment.param_layouts["w1"].slice_shape == w_slice
    graph = program.rank_graph(0)
    matmul = next(n for n in graph.nodes if n.op == "MatMul")
    assert [u.op for u, _ in matmul.result.uses] == ["ReduceScatter"]
    report = check(program)
    assert report.ok(), report.errors


# -- functional shard with a Layout; the interleaved_parallel axis ------------------------------

@pytest.mark.parametrize("case,matmul1", [
    # test_shard_layout.py: test_ms_shard_with_layout_be_set_and_propagate (and the Cell.shard
    # form with a parameter_plan): the next MatMul's in_strategy is ((2, 1), (1, 4))
    ("ms", ((2, 1), (1, 4))),
    ("cell_plan", ((2, 1), (1, 4))),
    # test_ms_shard_with_multi_dim_and_interleaved_parallel_layout, 16 devices: the
    # interleaved_parallel axis is no device axis, so ("dp", "interleaved_parallel", "mp")
    # splits by dp * mp = 8: ((8, 2), (2, 1))
    ("interleaved", ((8, 2), (2, 1))),
])
def test_functional_shard_with_a_layout(monkeypatch: Any, case: str, matmul1: tuple) -> None:
    monkeypatch.setenv("SHARD_CASE", case)
    program = compile_model(model_path("shard_net.py"), dump=False)
    got = strategies(program)
    assert got["matmul1"] == matmul1
    if case == "cell_plan":
        assert got["shard_param_subnet.w1"] == ((1, 4),)
    report = check(program)
    assert report.ok(), report.errors


INTERLEAVED_MODEL = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=16,
                          dataset_strategy="full_batch")
layout = Layout((2, 4, 2, 2), ("dp", "mp", "sp", "interleaved_parallel"))
layout1 = (layout(("dp", "interleaved_parallel"), "mp"), layout("mp", "sp"))
out_layout1 = (layout(("dp", "interleaved_parallel", "mp"), "sp"),)
layout2 = (layout(("dp", "interleaved_parallel", "mp"), "sp"), layout("sp", "None"))
out_layout2 = (layout(("dp", "interleaved_parallel", "mp", "sp"), "None"),)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(1)
        self.matmul1 = ops.MatMul().shard(in_strategy=layout1, out_strategy=out_layout1)
        self.matmul2 = ops.MatMul().shard(in_strategy=layout2, out_strategy=out_layout2)
        self.w1 = Parameter(r.standard_normal((64, 64)).astype(np.float32), "w1")
        self.w2 = Parameter(r.standard_normal((64, 64)).astype(np.float32), "w2")

    def construct(self, x):
        return self.matmul2(self.matmul1(x, self.w1), self.w2)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),)
"""


def test_interleaved_parallel_axis_is_not_a_device_axis(tmp_path: Any) -> None:
    """test_finegrain_micro_interleaved.py test_interleaved_two_matmul (16 devices, semi-auto):
    MindSpore compiles it; without nn.MicroBatchInterleaved the interleaved axis only orders
    the work inside a device, so the plan is the one of Layout((2, 4, 2), ("dp", "mp", "sp")):
    each MatMul reduce-scatters its partial sums over its reduced axis (mp: 4 ranks, sp: 2)."""
    program = compile_source(tmp_path, INTERLEAVED_MODEL)
    got = strategies(program)
    assert got["matmul1"] == ((2, 4), (4, 2))
    assert got["matmul2"] == ((8, 2), (2, 1))
    layouts = program.state.assignment.param_layouts
    assert layouts["w1"].slice_shape == (16, 32) and layouts["w2"].slice_shape == (32, 64)
    graph = program.rank_graph(0)
    scatters = [n for n in graph.nodes if n.op == "ReduceScatter"]
    assert [tuple(n.attrs["rank_list"]) for n in scatters] == [(0, 2, 4, 6), (0, 1)]
    report = check(program)
    assert report.ok(), report.errors


# -- Gather -------------------------------------------------------------------------------------

GATHER_MODEL = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.gatherv2 = ops.Gather().shard({gather}, out_strategy={out})
        self.mul = ops.Mul().shard({mul})
        self.relu = ops.ReLU(){relu}
        self.index = Tensor(np.arange({index_size}, dtype=np.int32).reshape({index_shape})
                            * 5 % 64)

    def construct(self, x, y):
        out = self.gatherv2(x, self.index, 0)
        out = self.relu(out)
        return self.mul(out, y)


def model():
    return Net()


def inputs():
    r = np.random.default_rng(0)
    return (r.standard_normal((64, 64)).astype(np.float32),
            r.standard_normal({y_shape}).astype(np.float32))
"""


def test_gather_device_matrix_puts_the_indices_first(tmp_path: Any) -> None:
    """test_dump_ir_parallel_detail.py (semi-auto): Gather ((1, 2), (4,)) with indices [8] has
    MindSpore's device matrix (4, 1, 2), table map (1, 0), indices (2), output ((2, 0)): the
    layout of the following ReLU ((4, 2),), so nothing is redistributed between them."""
    program = compile_source(tmp_path, GATHER_MODEL.format(
        gather="((1, 2), (4,))", out=None, mul="((4, 2), (4, 2))", relu=".shard(((4, 2),))",
        index_size=8, index_shape="(8,)", y_shape=(8, 64)))
    gather = by_name(program, "gatherv2")
    sharding = program.state.assignment.sharding(gather)
    assert sharding.dev_matrix == (4, 1, 2)
    assert sharding.out_layouts[0].tensor_map == (2, 0)
    relu = by_name(program, "relu")
    assert program.state.assignment.sharding(relu).in_layouts[0] == sharding.out_layouts[0]
    ops_0 = rank_ops(program)
    assert ops_0[ops_0.index("Gather") + 1] == "ReLU"
    report = check(program)
    assert report.ok(), report.errors


@pytest.mark.parametrize("out,batch,forward", [
    # test_gather.py test_gatherv2_shard_batch_and_axis (indices [2, 64]): dev (2, 4) =
    # (indices, table), table map (0, -1), indices (1, -1), a forward AllReduce over the
    # table's axis
    (None, 2, "AllReduce"),
    # ..._shard_batch_and_axis_out_strategy_allreduce / _reducescatter (indices [64, 64])
    ("((2, 1, 1),)", 64, "AllReduce"),
    ("((8, 1, 1),)", 64, "ReduceScatter"),
])
def test_gather_shard_batch_and_axis(tmp_path: Any, out: str | None, batch: int,
                                     forward: str) -> None:
    program = compile_source(tmp_path, GATHER_MODEL.format(
        gather="((4, 1), (2, 1))", out=out, mul="((2, 4, 1), (2, 4, 1))", relu="",
        index_size=batch * 64, index_shape=f"({batch}, 64)", y_shape=(batch, 64, 64)))
    sharding = program.state.assignment.sharding(by_name(program, "gatherv2"))
    table, idx = (lay.normalized() for lay in sharding.in_layouts)
    assert table.dev_matrix == (2, 4) and table.tensor_map == (0, -1)
    assert idx.tensor_map == (1, -1)
    graph = program.rank_graph(0)
    (comm,) = [n for n in graph.nodes if n.op in ("AllReduce", "ReduceScatter")]
    assert comm.op == forward
    assert tuple(comm.attrs["rank_list"]) == (0, 1, 2, 3)
    report = check(program)
    assert report.ok(), report.errors


def test_gather_split_axis_with_split_indices_outside_that_mode(tmp_path: Any) -> None:
    """((2, 1), (2, 1)) uses 4 of 8 devices: not MindSpore's shard-batch-and-axis mode, which
    refuses split indices when the table's axis is split."""
    with pytest.raises(PcompileError, match="shard-batch-and-axis"):
        compile_source(tmp_path, GATHER_MODEL.format(
            gather="((2, 1), (2, 1))", out=None, mul="((2, 4, 1), (2, 4, 1))", relu="",
            index_size=128, index_shape="(2, 64)", y_shape=(2, 64, 64)))


# -- the check models gradients_mean, loss_repeated_mean, cross_batch ---------------------------

OPTIONS_MODEL = """
set_auto_parallel_context(parallel_mode="{mode}", device_num=8, dataset_strategy="{dataset}",
                          gradients_mean={mean}, loss_repeated_mean={repeated})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(2)
        self.w = Parameter(r.standard_normal((32, 16)).astype(np.float32), "w")
        self.w2 = Parameter(r.standard_normal((16, 16)).astype(np.float32), "w2")
        self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU().shard(((2, 4),))
        self.matmul2 = ops.MatMul().shard(((8, 1), (1, 1)))

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul(x, self.w)), self.w2)


class Loss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.sub = ops.Sub().shard(((8, 1), (8, 1)))
        self.square = ops.Square().shard(((8, 1),))
        self.mean = ops.ReduceMean().shard(((8, 1),))
        if {cross_batch}:
            self.mean.add_prim_attr("cross_batch", True)

    def construct(self, pred, label):
        return self.mean(self.square(self.sub(pred, label)), ())


def model():
    return Net()


def loss():
    return Loss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)


def inputs():
    return (np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((16, 16)).astype(np.float32),)
"""


def options_model(tmp_path: Any, mode: str = "semi_auto_parallel", mean: bool = False,
                  repeated: bool = True, cross_batch: bool = False,
                  dataset: str = "full_batch") -> str:
    path = tmp_path / "options.py"
    path.write_text(HEADER + textwrap.dedent(OPTIONS_MODEL.format(
        mode=mode, mean=mean, repeated=repeated, cross_batch=cross_batch, dataset=dataset)))
    return str(path)


@pytest.mark.parametrize("mode,mean,repeated,want", [
    # MindSpore's mirror bprop (grad_comm_ops.py get_bprop_mirror_operator) multiplies the
    # all-reduced gradient by 1/dev_num under gradients_mean, and gradients_mean leaves the
    # loss's _VirtualDiv (as_loss_divisor, operator_info.cc InferAsLossDivisor) as it is: in
    # semi-auto the update of a parameter held by n ranks is 1/n of the single-device one
    # (w: 2 ranks hold each slice of its (4, 1) split; w2: all 8).
    ("semi_auto_parallel", True, True, {"w": 1 / 2, "w2": 1 / 8}),
    # without _VirtualDiv (loss_repeated_mean=False) every copy of the loss counts: 8 times
    ("semi_auto_parallel", False, False, {"w": 8.0, "w2": 8.0}),
    ("semi_auto_parallel", True, False, {"w": 4.0}),  # w2: 8 copies / 8 holders
    # data_parallel: every rank's loss is its own; the mirrors sum (8 times the gradient of
    # the mean loss), or average (the single-device gradient)
    ("data_parallel", False, True, {"w": 8.0, "w2": 8.0}),
    ("data_parallel", True, True, {}),
])
def test_check_models_gradient_options(tmp_path: Any, mode: str, mean: bool, repeated: bool,
                                       want: dict[str, float]) -> None:
    from pcompile.tools.oracle import gradient_scales

    dataset = "data_parallel" if mode == "data_parallel" else "full_batch"
    program = compile_model(options_model(tmp_path, mode, mean, repeated, dataset=dataset),
                            dump=False)
    assert gradient_scales(program) == want
    report = check(program, steps=2)
    assert report.ok(), report.errors


CROSS_BATCH_INFERENCE = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32),
                           "w")
        self.matmul = ops.MatMul().shard(((4, 1), (1, 2)))
        self.mean = ops.ReduceMean().shard(((4, 2),)).add_prim_attr("cross_batch", True)
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.relu(self.mean(self.matmul(x, self.w), 0))


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32),)
"""


@pytest.mark.parametrize("training", [True, False])
def test_check_models_cross_batch(tmp_path: Any, training: bool) -> None:
    """A cross_batch ReduceMean skips the forward AllReduce: each rank's result is the mean of
    its own rows (for a loss, the ranks disagree on it). The reference is the single-device
    program with that reduction restricted to each rank's rows: per rank for the outputs
    (rank r's slice of its reference), and for training the mean of the ranks' losses, whose
    gradient the parallel program computes (the sum of the ranks' gradients, each divided by
    the loss's 8 copies)."""
    if training:
        program = compile_model(options_model(tmp_path, cross_batch=True), dump=False)
    else:
        program = compile_source(tmp_path, CROSS_BATCH_INFERENCE)
    assert program.training == training
    graph = program.rank_graph(0)
    mean = next(n for n in graph.nodes if n.op == "ReduceMean")
    assert [u.op for u, _ in mean.result.uses] != ["AllReduce"]  # rank-local by definition
    report = check(program, steps=2)
    assert report.ok(), report.errors


# -- MindSpore's parameter_layout_dict, normalised layouts in plan.json --------------------------

LAYOUT_DICT_MODEL = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num={devices},
                          dataset_strategy="full_batch", enable_parallel_optimizer={opt},
                          parallel_optimizer_config={config})
CASES = {{
    # test_layout_extend.py, ..._reduce_scatter_opt_shard (16 devices)
    16: Layout((2, 2, 2, 2), ("dp", "sp", "vp", "mp")),
    # ..._reduce_scatter_opt_shard_not_full (32 devices, optimizer_weight_shard_size 2)
    32: Layout((4, 2, 2, 2), ("dp", "sp", "vp", "mp")),
}}
layout = CASES[{devices}]


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        ins = (layout("dp", ("sp", "mp")), layout(("sp", "mp"), "vp"))
        self.matmul1 = ops.MatMul().shard(in_strategy=ins,
                                          out_strategy=(layout(("dp", "sp", "mp"), "vp"),))
        self.w = Parameter(np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32),
                           "w")

    def construct(self, y):
        return self.matmul1(y, self.w)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),)


def labels():
    return (np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""


@pytest.mark.parametrize("devices,config", [
    (16, {"parallel_optimizer_threshold": 1}),
    (32, {"parallel_optimizer_threshold": 1, "optimizer_weight_shard_size": 2}),
])
def test_parameter_layout_dict_of_an_optimizer_sharded_weight(tmp_path: Any, devices: int,
                                                              config: dict) -> None:
    """MindSpore's recorded check_parameter_layout for its [1024, 1024] weight is
    ([d, 2, 2, 2], [2, 0, 1], [256, 512], 0, True, '2-16557109384257890687') (d = 2 or 4;
    the group {0, 8} of the optimizer shard): the use layout, the multi-axis entry flattened,
    the model-parallel slice, and the shard group. Here the weight is [64, 64] (slice
    [16, 32]) with a 1 KB threshold, the same plan at a smaller size."""
    program = compile_source(tmp_path, LAYOUT_DICT_MODEL.format(devices=devices, opt=True,
                                                                config=config))
    assert "w" in program.state.opt_shard
    dev = [devices // 8, 2, 2, 2]
    assert program.parameter_layout_dict["w"] == (dev, [2, 0, 1], [16, 32], 0, True,
                                                   "2-16557109384257890687")
    assert program.parameter_layout_dict["moments.w"] == program.parameter_layout_dict["w"]
    report = check(program)
    assert report.ok(), report.errors


PARAM_LAYOUT_MODEL = """
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(1)
        # test_stridedslice.py test_stridedslice_layout: Mul ((1, 4, 2), (1, 4, 2)) on w1
        self.mul = ops.Mul().shard(((1, 4, 2), (1, 4, 2)))
        self.w1 = Parameter(r.standard_normal((256, 64, 32)).astype(np.float32), "w1")
        # a (4, 1) ReLU-like use: dev [4, 1, 2] normalises to [4, 2]
        self.add = ops.Add().shard(((4, 1, 1), (4, 1, 1)))
        self.w2 = Parameter(r.standard_normal((256, 64, 32)).astype(np.float32), "w2")

    def construct(self, x):
        return self.add(self.mul(x, self.w1), self.w2)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((256, 64, 32)).astype(np.float32),)
"""


def test_parameter_layout_dict_is_normalised_and_lists_inputs(tmp_path: Any) -> None:
    """MindSpore's recorded layouts: test_stridedslice_layout's w1 ([4, 2], [-1, 1, 0],
    [256, 16, 16], 0, True, ''); test_roi_align_layout's full-batch input `features`
    ([8], [-1, -1, -1, -1], <its whole shape>, 0, True, ''): a full-batch input is
    replicated. plan.json holds the same dict and the normalised device matrices."""
    import json

    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent(PARAM_LAYOUT_MODEL))
    out = tmp_path / "out"
    program = compile_model(str(path), out_dir=str(out), dump_ranks="0")
    got = program.parameter_layout_dict
    assert got["w1"] == ([4, 2], [-1, 1, 0], [256, 16, 16], 0, True, "")
    assert got["w2"] == ([4, 2], [1, -1, -1], [64, 64, 32], 0, True, "")
    assert got["x"] == ([8], [-1, -1, -1], [256, 64, 32], 0, True, "")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["parameter_layout_dict"]["w1"] == [[4, 2], [-1, 1, 0], [256, 16, 16], 0, True,
                                                    ""]
    assert plan["parameters"]["w2"]["dev_matrix"] == [4, 2]
    assert plan["parameters"]["w2"]["tensor_map"] == [1, -1, -1]
    report = check(program)
    assert report.ok(), report.errors


# -- MindSpore's parallel detail in dumps (MS_DEV_DUMP_IR_PARALLEL_DETAIL=1) --------------------

def test_parallel_detail_semi_auto(tmp_path: Any, monkeypatch: Any) -> None:
    """test_dump_ir_parallel_detail.py test_dump_ir_parallel_detail_semi: the OperatorInfo's
    tensor maps and device matrix as primitive attributes, spelled as MindSpore checks them:
    Gather inputs_tensor_map ((1, 0), (2)), device_matrix (4, 1, 2), outputs_tensor_map
    ((2, 0)); ReLU ((1, 0)) on (4, 2); Mul ((1, 0), (1, 0)) on (4, 2). Every dump re-parses
    (the suite checks it as it writes them)."""
    monkeypatch.setenv("MS_DEV_DUMP_IR_PARALLEL_DETAIL", "1")
    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent(GATHER_MODEL.format(
        gather="((1, 2), (4,))", out=None, mul="((4, 2), (4, 2))", relu=".shard(((4, 2),))",
        index_size=8, index_shape="(8,)", y_shape=(8, 64))))
    program = compile_model(str(path), out_dir=str(tmp_path / "out"), dump_ranks="0")
    want = {
        "gatherv2": "inputs_tensor_map: ((1, 0), (2)), outputs_tensor_map: ((2, 0)), "
                    "device_matrix: (4, 1, 2)",
        "relu": "inputs_tensor_map: ((1, 0)), outputs_tensor_map: ((1, 0)), "
                "device_matrix: (4, 2)",
        "mul": "inputs_tensor_map: ((1, 0), (1, 0)), outputs_tensor_map: ((1, 0)), "
               "device_matrix: (4, 2)",
    }
    for dump in ("01_step_parallel_begin.ir", "03_execute.ir"):
        text = (tmp_path / "out" / "rank_0" / dump).read_text()
        for name, attrs in want.items():
            (line,) = [ln for ln in text.splitlines() if f"{{instance name: {name}}}" in ln]
            assert attrs in line, (dump, line)
    gather = by_name(program, "gatherv2")
    assert gather.attrs["inputs_tensor_map"] == ((1, 0), (2,))
    assert check(program).ok()


def test_parallel_detail_sharding_propagation(tmp_path: Any, monkeypatch: Any) -> None:
    """test_dump_ir_parallel_detail_auto: under sharding propagation the parallel-info group of
    every op holds `in_layout` and `out_layout` (MindSpore's test counts 4 `out_layout` in its
    dump of this network: ReLU, Sub, ReLU, Sub); a Layout-configured op shows its Layout's
    fields, as test_shard_layout.py checks them
    (`{'device_matrix': (8, 1), 'tensor_map': (1, 0), 'interleaved_parallel': false,
    'alias_name': (dp, mp)}`)."""
    monkeypatch.setenv("MS_DEV_DUMP_IR_PARALLEL_DETAIL", "1")
    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent("""
        set_auto_parallel_context(parallel_mode="auto_parallel", device_num=8,
                                  search_mode="sharding_propagation",
                                  dataset_strategy="full_batch")
        layout = Layout((8, 1), ("dp", "mp"))


        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.relu1 = ops.ReLU().shard((layout("dp", "mp"),))
                self.relu2 = ops.ReLU().shard(((2, 4),))

            def construct(self, x, y):
                out = self.relu1(x)
                out = out - x
                out = self.relu2(out)
                return out - y


        def model():
            return Net()


        def inputs():
            r = np.random.default_rng(0)
            return (r.standard_normal((32, 64)).astype(np.float32),
                    r.standard_normal((64,)).astype(np.float32))
    """))
    program = compile_model(str(path), out_dir=str(tmp_path / "out"), dump_ranks="0")
    text = (tmp_path / "out" / "rank_0" / "04_execute.ir").read_text()
    assert text.count("out_layout") == 4
    assert ("in_layout: ({'device_matrix': (8, 1), 'tensor_map': (1, 0), "
            "'interleaved_parallel': false, 'alias_name': (dp, mp)})") in text
    assert ("in_layout: ({'device_matrix': (2, 4), 'tensor_map': (1, 0)}, "
            "{'device_matrix': (2, 4), 'tensor_map': (0)})") in text
    assert check(program).ok()


def test_parallel_detail_off_by_default(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("MS_DEV_DUMP_IR_PARALLEL_DETAIL", raising=False)
    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent(GATHER_MODEL.format(
        gather="((1, 2), (4,))", out=None, mul="((4, 2), (4, 2))", relu=".shard(((4, 2),))",
        index_size=8, index_shape="(8,)", y_shape=(8, 64))))
    compile_model(str(path), out_dir=str(tmp_path / "out"), dump_ranks="0")
    for dump in (tmp_path / "out" / "rank_0").glob("*.ir"):
        text = dump.read_text()
        assert "tensor_map" not in text and "in_layout" not in text


def test_broadcast_dim_has_no_device_axis() -> None:
    """MindSpore's ArithmeticBase: Add x [8, 16] + b [1, 16] with ((4, 2), (1, 2)) has device
    matrix (4, 2) and b's tensor map (-1, 0): a broadcast dim gets no axis of its own."""
    from pcompile.ir.sharding import OpContext, rule_for
    from pcompile.ir.types import DType, TensorType

    f32 = DType.float32
    ctx = OpContext("Add", [TensorType(f32, (8, 16)), TensorType(f32, (1, 16))],
                    TensorType(f32, (8, 16)), {}, 8)
    sharding = rule_for("Add").apply(ctx, ((4, 2), (1, 2)))
    assert sharding.dev_matrix == (4, 2)
    assert sharding.mindspore_maps() == (((1, 0), (-1, 0)), ((1, 0),))


# -- candidates under a decided neighbour's device matrix (MindSpore 2.x's sharding
#    propagation: AddSwcUnderPrevOpDevMatrix / AddSwcUnderNextOpDevMatrix) --------------------

LAYOUT_3D_MODEL = """
set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          device_num=8, dataset_strategy="full_batch")
layout = Layout((2, 2, 2), ("dp", "sp", "mp"))


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(1)
        self.w = Parameter(r.standard_normal((32, 16)).astype(np.float32), "w")
        self.b = Parameter(r.standard_normal((16, 16)).astype(np.float32), "b")
        self.matmul = ops.MatMul()
        self.add = ops.Add()
        self.mul = ops.Mul()

    def construct(self, x, y):
        return self.mul(self.matmul(x, self.w), self.add(y, self.b))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.block = Block()
        ins = (layout("None", "sp"), layout("dp", "None"))
        plan = {{"self.block.w": layout("sp", "mp"), "self.block.b": layout("dp", "None")}}
        if "{form}" == "cell":
            self.block.shard(ins, parameter_plan=plan)
            self.block_fn = self.block
        else:
            self.block_fn = shard(self.block, ins, parameter_plan=plan)
        self.relu = ops.ReLU()

    def construct(self, x, y):
        return self.relu(self.block_fn(x, y))


def model():
    return Net()


def inputs():
    r = np.random.default_rng(0)
    return (r.standard_normal((16, 32)).astype(np.float32),
            r.standard_normal((16, 16)).astype(np.float32))
"""


@pytest.mark.parametrize("form", ["ms", "cell"])
def test_functional_shard_with_a_3d_layout_keeps_the_layouts(tmp_path: Any, form: str) -> None:
    """A functional shard (`shard(cell, ...)` or `Cell.shard`) with
    Layout((2, 2, 2), ("dp", "sp", "mp")): x ("None", "sp"), y ("dp", "None"), the weight
    ("sp", "mp") and the bias ("dp", "None") by parameter_plan. MindSpore's propagation builds
    each op's strategy under the device matrix of the layouts it reads: MatMul
    ((1, 2), (2, 2)) and Add ((2, 1), (2, 1)), both reading their operands with no
    redistribution. Before, only strategies using all 8 devices were candidates
    (fully_use_devices, the seeds' default), and pcompile printed MatMul ((2, 2), (2, 2)) and
    Add ((8, 1), (8, 1)), each slicing or gathering its inputs."""
    program = compile_source(tmp_path, LAYOUT_3D_MODEL.format(form=form))
    got = strategies(program)
    assert got["matmul"] == ((1, 2), (2, 2))
    assert got["add"] == ((2, 1), (2, 1))
    for name in ("matmul", "add"):
        info = program.state.search.explain[by_name(program, name)]
        assert info["decision"]["communication"] == 0.0
        assert info["decision"]["computation"] == 0.0
    # the layouts reach the plan as the search costed them: the MatMul reads the shard's
    # slices as they are and all-reduces its partial sums over sp (ranks 0 and 2)
    graph = program.rank_graph(0)
    matmul = next(n for n in graph.nodes if n.op == "MatMul")
    assert [v.node.op for v in matmul.operands] == ["Identity", "Identity"]
    (after,) = [u for u, _ in matmul.result.uses]
    assert after.op == "AllReduce" and tuple(after.attrs["rank_list"]) == (0, 2)
    report = check(program)
    assert report.ok(), report.errors


RELU_BEFORE_CONSUMER_MODEL = """
set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                          device_num=8, dataset_strategy="full_batch")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.relu = ops.ReLU()
        self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
        self.w = Parameter(np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32),
                           "w")

    def construct(self, x):
        return self.matmul(self.relu(x), self.w)


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32),)
"""


def test_propagation_back_to_a_producer_takes_the_consumers_layout(tmp_path: Any) -> None:
    """A ReLU whose only consumer, a MatMul, is configured ((2, 1), (1, 4)): propagation goes
    backwards from the MatMul and MindSpore prints the ReLU's strategy as ((2, 1),), the
    layout the MatMul reads (built under its device matrix). Under the default
    fully_use_devices=True (2, 1) is no candidate of the ReLU, and pcompile printed
    ((1, 1),), slicing the ReLU's output for the MatMul."""
    program = compile_source(tmp_path, RELU_BEFORE_CONSUMER_MODEL)
    got = strategies(program)
    assert got["relu"] == ((2, 1),)
    relu = by_name(program, "relu")
    info = program.state.search.explain[relu]
    assert info["via"] == "out-edge to matmul"
    assert info["decision"]["communication"] == info["decision"]["computation"] == 0.0
    graph = program.rank_graph(0)
    ops_before = [n.op for n in graph.nodes if not n.scope.startswith("Gradients")]
    assert ops_before[:3] == ["StridedSlice", "ReLU", "MatMul"]  # no slice between them
    report = check(program)
    assert report.ok(), report.errors
