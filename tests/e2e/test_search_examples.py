"""auto_parallel end to end: every example under each search compiles and one training step
matches the single-device program; the quickstart seed; dumps and plan.json carry the search's
explanation; strategy checkpoints round-trip; recursive programming's device-count error."""

from __future__ import annotations

import json
import os

import pytest

from pcompile import reset_algo_parameters, set_algo_parameters
from pcompile.compiler.driver.trace_model import trace_model
from pcompile.compiler.frontend.model_file import load_model_file
from pcompile.ir.errors import PcompileError
from pcompile.ir.parser import parse_graph
from pcompile.ir.printer import print_graph
from pcompile.passes.search import search
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

MODES = ["sharding_propagation", "dynamic_programming", "recursive_programming"]
EXAMPLES = ["quickstart.py", "layout_mlp.py", "dense_gelu_blocks.py", "gpt_block.py"]


def example(name: str) -> str:
    return os.path.join(ROOT, "examples", name)


def strategies(program) -> dict[str, tuple]:
    assignment = program.state.assignment
    return {n.fullname: assignment.sharding(n).strategy for n in program.graph.nodes
            if assignment.sharding(n) is not None}


def cell_shard_only_with_propagation(name: str, mode: str) -> bool:
    # Cell.shard (dense_gelu_blocks) is a sharding-propagation feature, as in MindSpore.
    return name == "dense_gelu_blocks.py" and mode != "sharding_propagation"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_train_like_one_device(name: str, mode: str) -> None:
    if cell_shard_only_with_propagation(name, mode):
        with pytest.raises(PcompileError, match="sharding_propagation"):
            compile_model(example(name), devices=8, search_mode=mode, dump=False)
        return
    program = compile_model(example(name), devices=8, search_mode=mode, dump=False)
    assert program.state.parallel_mode == "auto_parallel"
    assert program.state.search.strategies
    report = check(program, steps=1)
    assert report.ok(), (report.losses, report.worst)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["dense_gelu_blocks.py", "gpt_block.py"])
def test_larger_examples_on_16_devices(name: str, mode: str, monkeypatch) -> None:
    if cell_shard_only_with_propagation(name, mode):
        return
    monkeypatch.setenv("GPT_BATCH", "16")
    program = compile_model(example(name), devices=16, search_mode=mode, dump=False)
    report = check(program, steps=1)
    assert report.ok(), (report.losses, report.worst)


def test_quickstart_seed_strategies_and_rank0_dump(tmp_path) -> None:
    """Seed auto-parallel-quickstart.md, its code unchanged: only `matmul` is configured; the
    default fully_use_devices=True (the seeds' MindSpore r2.0) gives the seed's strategies."""
    program = compile_model(example("quickstart.py"), devices=8,
                            search_mode="sharding_propagation", out_dir=str(tmp_path / "o"))
    text = (tmp_path / "o" / "rank_0" / "02_step_parallel_begin.ir").read_text()
    relu = next(line for line in text.splitlines() if "{instance name: relu}" in line)
    assert "{in_strategy: ((2, 4)), cost: " in relu
    matmul2 = next(line for line in text.splitlines() if "{instance name: matmul2}" in line)
    assert "{in_strategy: ((2, 4), (4, 1)), cost: " in matmul2
    rank0 = program.rank_graph(0)
    fwd = [n for n in rank0.nodes if not n.scope.startswith(("Gradients", "Default/optimizer"))]
    matmul = next(n for n in fwd if n.instance_name == "matmul")
    assert [v.shape for v in matmul.operands] == [(8, 8), (8, 16)]
    after = fwd[fwd.index(matmul) + 1]
    assert after.op == "AllReduce" and after.attrs["rank_list"] == (0, 1, 2, 3)
    sliced = fwd[fwd.index(matmul) + 2]
    assert sliced.op == "StridedSlice" and sliced.result.shape == (8, 4)
    relu_node = next(n for n in fwd if n.instance_name == "relu")
    assert relu_node.operands[0] is sliced.result and relu_node.result.shape == (8, 4)
    assert rank0.param("w2").shape == (4, 16)
    mm2 = next(n for n in fwd if n.instance_name == "matmul2")
    assert [v.shape for v in mm2.operands] == [(8, 4), (4, 16)]
    assert check(program, steps=2).ok()


def test_quickstart_with_todays_default_prefers_the_cheaper_relu() -> None:
    """fully_use_devices=False (MindSpore's default since 2.1): relu keeps matmul's row split
    with no redistribution at all, and matmul2 follows it (ties broken by Strategy::Compare)."""
    graph = trace_model(load_model_file(example("quickstart.py"))).graph
    set_algo_parameters(fully_use_devices=False)
    try:
        result = search(graph, 8, "sharding_propagation", dataset_strategy="data_parallel")
    finally:
        reset_algo_parameters()
    by_name = {n.instance_name: result.strategies.get(n) for n in graph.nodes}
    assert by_name["relu"] == ((2, 1),)
    assert by_name["matmul2"] == ((2, 1), (1, 4))


@pytest.mark.slow
def test_dumps_and_plan_explain_the_search(tmp_path) -> None:
    out = tmp_path / "o"
    compile_model(example("gpt_block.py"), devices=8, search_mode="dynamic_programming",
                  out_dir=str(out))
    files = sorted(os.listdir(out / "rank_0"))
    assert files[:3] == ["00_trace.ir", "01_step_auto_parallel_begin.ir",
                         "02_step_parallel_begin.ir"]
    for name in files[:3]:
        text = (out / "rank_0" / name).read_text()
        assert print_graph(parse_graph(text, name)) == text
    begin = (out / "rank_0" / "02_step_parallel_begin.ir").read_text()
    assert "cost: {local: " in begin and "runner_up: {strategy: " in begin
    plan = json.loads((out / "plan.json").read_text())
    assert plan["search_mode"] == "dynamic_programming"
    info = plan["search"]
    assert info["mode"] == "dynamic_programming" and info["objective"] > 0
    entry = next(iter(info["ops"].values()))
    assert {"strategy", "cost", "redistribution", "local_objective"} <= set(entry)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["quickstart.py", "gpt_block.py"])
def test_strategy_checkpoint_round_trip(name: str, mode: str, tmp_path) -> None:
    path = str(tmp_path / "strategy.json")
    first = compile_model(example(name), devices=8, search_mode=mode, dump=False,
                          overrides={"strategy_ckpt_config": {"save_file": path}})
    data = json.loads(open(path).read())
    assert data["current_stage"] == 1  # MindSpore's count of saves
    items = data["parallel_strategy_item"]
    assert all("_" in key and item["stage"] == 0 for key, item in items.items())
    if name == "quickstart.py":
        assert items["MatMul_w"]["parallel_strategy"] == [[2, 4], [4, 1]]
        assert set(data["parallel_layout_item"]) == {"w", "w2"}
    second = compile_model(example(name), devices=8, search_mode=mode, dump=False,
                           overrides={"strategy_ckpt_config": {"load_file": path}})
    assert strategies(second) == strategies(first)
    assert second.state.assignment.param_layouts == first.state.assignment.param_layouts


def test_old_checkpoint_option_names(tmp_path) -> None:
    path = str(tmp_path / "s.json")
    compile_model(example("quickstart.py"), devices=8, search_mode="recursive_programming",
                  dump=False, overrides={"strategy_ckpt_save_file": path})
    assert "MatMul_w2" in json.loads(open(path).read())["parallel_strategy_item"]


def test_loaded_strategies_override_the_search(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"current_stage": 0, "parallel_strategy_item": {
        "MatMul_w2": {"stage": 0, "parallel_strategy": [[1, 8], [8, 1]]}}}))
    program = compile_model(example("quickstart.py"), devices=8,
                            search_mode="dynamic_programming", dump=False,
                            overrides={"strategy_ckpt_config": {"load_file": str(path)}})
    mm2 = next(n for n in program.graph.nodes if n.instance_name == "matmul2")
    assert program.state.assignment.sharding(mm2).strategy == ((1, 8), (8, 1))
    assert check(program, steps=1).ok()


def test_a_load_file_that_is_no_checkpoint_is_refused(tmp_path) -> None:
    path = tmp_path / "s.ckpt"  # not .json: MindSpore's protobuf
    path.write_bytes(b"{not protobuf")
    with pytest.raises(PcompileError, match="not a ParallelStrategyMap protobuf message"):
        compile_model(example("quickstart.py"), devices=8, search_mode="sharding_propagation",
                      dump=False, overrides={"strategy_ckpt_config": {"load_file": str(path)}})


def test_recursive_programming_needs_a_power_of_two() -> None:
    with pytest.raises(PcompileError, match="requires the device num be the power of 2"):
        compile_model(example("quickstart.py"), devices=12, search_mode="recursive_programming",
                      dump=False)


SIX_DEVICE_MODEL = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(dataset_strategy="full_batch")
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = Parameter(initializer("normal", [12, 24]), "w1")
        self.w2 = Parameter(initializer("normal", [24, 6]), "w2")
        self.matmul1 = ops.MatMul()
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul()
    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)
def model():
    set_seed(3)
    return Net()
def inputs():
    return (np.random.default_rng(0).random((12, 12)).astype(np.float32),)
def labels():
    return (np.random.default_rng(1).random((12, 6)).astype(np.float32),)
def loss():
    return nn.MSELoss()
def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming"])
def test_non_power_of_two_devices(mode: str, tmp_path) -> None:
    path = tmp_path / "six.py"
    path.write_text(SIX_DEVICE_MODEL)
    program = compile_model(str(path), devices=6, search_mode=mode, dump=False)
    assert any(3 in s or 6 in s for strategy in program.state.search.strategies.values()
               for s in strategy)
    assert check(program, steps=1).ok()


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming"])
def test_gpt_block_on_64_devices_matches_single_device(mode, monkeypatch) -> None:
    monkeypatch.setenv("GPT_BATCH", "64")
    program = compile_model(os.path.join(ROOT, "examples", "gpt_block.py"), devices=64,
                            search_mode=mode, dump=False)
    # AdamWeightDecay parameters: see tools.oracle.OracleReport.ok on param_rtol.
    assert check(program, steps=1).ok()
