"""The parallel optimizer: parameters and optimizer state stored split over their data-parallel
group, gathered for use, gradients reduce-scattered; training unchanged (oracle)."""

from __future__ import annotations

import os

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

MLP = os.path.join(ROOT, "examples", "manual_parallel.py")
QUICK = os.path.join(ROOT, "examples", "quickstart.py")


def state_bytes(graph) -> dict[str, int]:
    return {p.name: p.tensor_type.nbytes for p in graph.params if p.kind != "input"}


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "data_parallel"])
def test_data_parallel_mlp_memory_drops_8x(mode, tmp_path) -> None:
    mlp = tmp_path / "mlp.py"
    mlp.write_text(open(os.path.join(ROOT, "examples", "layout_mlp.py")).read().replace(
        "    net.matmul1.shard", "    # net.matmul1.shard").replace(
        "    net.relu1.shard", "    # net.relu1.shard").replace(
        "    net.matmul2.shard", "    # net.matmul2.shard").replace(
        "    net.relu2.shard", "    # net.relu2.shard").replace(
        "nn.SGD(params, 1e-2)", "nn.Momentum(params, 1e-2, 0.9)"))
    base = compile_model(str(mlp), devices=8, parallel_mode=mode, dump=False,
                         overrides={"gradients_mean": mode == "data_parallel"})
    sharded = compile_model(str(mlp), devices=8, parallel_mode=mode, dump=False,
                            overrides={"enable_parallel_optimizer": True,
                                       "gradients_mean": mode == "data_parallel"})
    before, after = state_bytes(base.rank_graph(0)), state_bytes(sharded.rank_graph(0))
    for name in ("fc1_weight", "fc2_weight", "moments.fc1_weight", "moments.fc2_weight"):
        assert after[name] * 8 == before[name], name
    assert after["fc3_weight"] == before["fc3_weight"]  # 20 KB < 64 KB threshold
    nodes = sharded.rank_graph(0).nodes
    gathers = [n for n in nodes if n.op == "AllGather" and "parallel_optimizer" in n.instance_name]
    assert len(gathers) == 2 and all(len(n.attrs["rank_list"]) == 8 for n in gathers)
    assert sum(n.op == "ReduceScatter" for n in nodes) == 2
    assert check(sharded, steps=2).ok()


def test_shard_size_keeps_a_mirror_over_the_rest() -> None:
    program = compile_model(QUICK, devices=8, parallel_mode="data_parallel", dump=False,
                            overrides={"enable_parallel_optimizer": True, "gradients_mean": True,
                                       "parallel_optimizer_config": {
                                           "parallel_optimizer_threshold": 0,
                                           "optimizer_weight_shard_size": 2}})
    nodes = program.rank_graph(0).nodes
    gather = next(n for n in nodes if n.op == "AllGather")
    mirror = next(n for n in nodes if n.op == "_MirrorOperator")
    assert gather.attrs["rank_list"] == (0, 1)
    assert mirror.attrs["rank_list"] == (0, 2, 4, 6)
    assert program.rank_graph(0).param("w").shape == (16, 16)
    assert check(program, steps=2).ok()


def test_parameter_opt_out(tmp_path) -> None:
    src = open(QUICK).read().replace('"w")', '"w", parallel_optimizer=False)')
    path = tmp_path / "q.py"
    path.write_text(src)
    program = compile_model(str(path), devices=8, parallel_mode="data_parallel", dump=False,
                            overrides={"enable_parallel_optimizer": True,
                                       "parallel_optimizer_config": {
                                           "parallel_optimizer_threshold": 0}})
    g = program.rank_graph(0)
    assert g.param("w").shape == (32, 16) and g.param("w2").shape == (2, 16)


@pytest.mark.parametrize("parallel_optimizer", [False, True])
def test_lamb_norms_are_of_whole_parameters(parallel_optimizer, tmp_path) -> None:
    """nn.Lamb's trust ratio uses the norm of each whole parameter: with the weights split by
    their MatMuls (and further by the parallel optimizer) each rank's partial sums are added
    over the slices (an AllReduce per norm); the oracle compares two steps with one device."""
    mlp = tmp_path / "mlp.py"
    mlp.write_text(open(os.path.join(ROOT, "examples", "layout_mlp.py")).read().replace(
        "nn.SGD(params, 1e-2)", "nn.Lamb(params, 1e-2, weight_decay=0.01)"))
    program = compile_model(str(mlp), devices=8, dump=False, overrides={
        "enable_parallel_optimizer": parallel_optimizer,
        "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}})
    graph = program.rank_graph(0)
    names = {p.name for p in graph.params}
    assert {"lamb_m.fc1_weight", "lamb_v.fc1_weight", "beta1_power"} <= names
    sums = [n for n in graph.nodes if n.op == "AllReduce"
            and n.instance_name.startswith("optimizer_sum_")]
    assert len(sums) == 2 * sum(1 for p in graph.params if p.name.startswith("lamb_m."))
    assert check(program, steps=2).ok()


@pytest.mark.parametrize("parallel_optimizer", [False, True])
def test_adafactor_factored_states_follow_the_split_dims(parallel_optimizer, tmp_path) -> None:
    """nn.AdaFactor's row statistics (32,) of w (32, 16) follow w's row split and its column
    statistics (16,) the column split; the row means are completed over the ranks splitting the
    columns only, the column means over those splitting the rows (with the parallel optimizer
    the rows are split further over the data-parallel ranks). Three steps against one device."""
    model = tmp_path / "q.py"
    model.write_text(open(QUICK).read().replace("((2, 4), (4, 1))", "((2, 2), (2, 2))").replace(
        "nn.Momentum(params, learning_rate=0.2, momentum=0.1)",
        "nn.AdaFactor(params, weight_decay=0.01)"))
    program = compile_model(str(model), devices=8, parallel_mode="semi_auto_parallel",
                            dump=False, overrides={
                                "enable_parallel_optimizer": parallel_optimizer,
                                "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}})
    layouts = program.state.assignment.param_layouts
    w = layouts["w"]
    row, col = layouts["exp_avg_sq_row.w"], layouts["exp_avg_sq_col.w"]
    assert row.shape == (32,) and row.tensor_map == (w.tensor_map[0],)
    assert col.shape == (16,) and col.tensor_map == (w.tensor_map[1],)
    graph = program.rank_graph(0)
    assert graph.param("exp_avg_sq_row.w").shape == (w.slice_shape[0],)
    assert graph.param("exp_avg_sq_col.w").shape == (w.slice_shape[1],)
    groups = {n.instance_name: n.attrs["rank_list"] for n in graph.nodes
              if n.op == "AllReduce" and n.instance_name.startswith("optimizer_sum_w_dims")}
    # dev matrix (2, 2, 2): the columns are split over ranks 0/1, the rows over 0/2 (and 4/6
    # with the parallel optimizer)
    assert tuple(groups["optimizer_sum_w_dims_1"]) == (0, 1)
    assert tuple(groups["optimizer_sum_w_dims_0"]) == ((0, 2, 4, 6) if parallel_optimizer
                                                       else (0, 2))
    report = check(program, steps=3)
    assert report.ok(), report


BIASED = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [32, 16]), "w")
        self.b = Parameter(initializer("normal", [16]), "b")
        self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))
        self.add = ops.Add().shard(((8, 1), (1,)))

    def construct(self, x):
        return self.add(self.matmul(x, self.w), self.b)


def model():
    set_seed(1)
    return Net()


def inputs():
    return (np.random.default_rng(0).random((16, 32)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).random((16, 16)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.AdaFactor(params, compression=True)
"""


def test_adafactor_compressed_statistics_split_by_the_parallel_optimizer(tmp_path) -> None:
    """nn.AdaFactor(compression=True): the bias's float16 second-moment statistic is stored
    split over the data-parallel ranks like the bias itself, and three steps train as on one
    device."""
    model = tmp_path / "biased.py"
    model.write_text(BIASED)
    program = compile_model(str(model), devices=8, dump=False, overrides={
        "enable_parallel_optimizer": True,
        "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}})
    graph = program.rank_graph(0)
    stat, bias = graph.param("exp_avg_sq.b"), graph.param("b")
    assert stat.dtype.value == "Float16" and bias.dtype.value == "Float32"
    assert stat.shape == bias.shape and stat.shape[0] < 16
    assert graph.param("exp_avg_sq_row.w").dtype.value == "Float32"
    report = check(program, steps=3)
    assert report.ok(), report
