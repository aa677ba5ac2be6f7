"""Strategy checkpoints (`strategy_ckpt_config`) as MindSpore writes them: in semi_auto_parallel
as in auto_parallel, as `.json` or protobuf (any other name), with the parallel optimizer's shard
group (`opt_weight_shard_size` / `_step`), written after the compile
(compiler/driver/strategy_files.py) and read back by a later compile."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from pcompile import (
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from pcompile.passes.search.strategy_checkpoint import decode, decode_protobuf, encode_protobuf
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
OPT = {"enable_parallel_optimizer": True,
       "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}}


def saved(tmp_path, name: str, mode: str = "semi_auto_parallel", **options) -> dict | None:
    path = str(tmp_path / name)
    compile_model(QUICKSTART, devices=8, parallel_mode=mode, dump=False,
                  overrides={**options, "strategy_ckpt_config": {"save_file": path}})
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return decode(path, f.read())


def test_semi_auto_parallel_saves_json_and_protobuf(tmp_path) -> None:
    as_json = saved(tmp_path, "s.json")
    as_proto = saved(tmp_path, "s.ckpt")
    assert as_json is not None and as_proto is not None
    assert as_json["current_stage"] == 1  # MindSpore counts saves: one more than loaded
    assert as_json["parallel_strategy_item"] == {
        "MatMul_w": {"stage": 0, "parallel_strategy": [[2, 4], [4, 1]]},
        "MatMul_w2": {"stage": 0, "parallel_strategy": [[8, 1], [1, 1]]}}
    w = as_json["parallel_layout_item"]["w"]
    assert w == {"dev_matrix": [2, 4, 1], "tensor_map": [1, -1], "tensor_shape": [32, 16],
                 "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    # the protobuf message has every field but the shape (node_strategy.proto has none)
    for name, item in as_json["parallel_layout_item"].items():
        assert as_proto["parallel_layout_item"][name] == {
            k: v for k, v in item.items() if k != "tensor_shape"}
    assert as_proto["parallel_strategy_item"] == as_json["parallel_strategy_item"]
    text = (tmp_path / "s.json").read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_no_file_where_mindspore_writes_none(tmp_path) -> None:
    assert saved(tmp_path, "d.json", mode="data_parallel") is None


def test_parallel_optimizer_shard_group_is_recorded(tmp_path) -> None:
    whole = saved(tmp_path, "a.json", **OPT)["parallel_layout_item"]
    # w: ((2, 4), (4, 1)) splits it over the 4-axis, ranks 0 and 4 hold the same slice
    assert (whole["w"]["opt_weight_shard_size"], whole["w"]["opt_weight_shard_step"]) == (-1, 4)
    assert (whole["w2"]["opt_weight_shard_size"], whole["w2"]["opt_weight_shard_step"]) == (-1, 1)
    assert whole["w"]["dev_matrix"] == [2, 4, 1]  # the model-parallel layout, not the stored one
    sized = saved(tmp_path, "b.json", optimizer_weight_shard_size=2, **OPT)
    assert sized["parallel_layout_item"]["w2"]["opt_weight_shard_size"] == 2
    aggregated = saved(tmp_path, "c.json", optimizer_weight_shard_aggregated_save=True, **OPT)
    assert aggregated["parallel_layout_item"]["w"]["opt_weight_shard_size"] == 0


def test_a_protobuf_checkpoint_loads_into_the_search(tmp_path) -> None:
    path = str(tmp_path / "s.ckpt")
    data = {"current_stage": 3, "parallel_strategy_item": {
        "MatMul_w2": {"stage": 0, "parallel_strategy": [[1, 8], [8, 1]]}},
        "parallel_layout_item": {}}
    (tmp_path / "s.ckpt").write_bytes(encode_protobuf(data))
    out = str(tmp_path / "out.ckpt")
    program = compile_model(QUICKSTART, devices=8, search_mode="dynamic_programming",
                            dump=False, overrides={"strategy_ckpt_config": {
                                "load_file": path, "save_file": out}})
    mm2 = next(n for n in program.graph.nodes if n.instance_name == "matmul2")
    assert program.state.assignment.sharding(mm2).strategy == ((1, 8), (8, 1))
    with open(out, "rb") as f:
        assert decode(out, f.read())["current_stage"] == 4


def test_protobuf_wire_format() -> None:
    data = {"current_stage": 1,
            "parallel_strategy_item": {"MatMul_w": {"stage": 0,
                                                    "parallel_strategy": [[2], [1]]}},
            "parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [-1], "field": 0,
                                           "opt_weight_shard_step": 0,
                                           "opt_weight_shard_size": 0}}}
    # by hand from node_strategy.proto: keys (number << 3 | wire type), unpacked repeated
    # scalars, an int32 -1 as ten varint bytes, empty ParamSplitShape / IndicesOffset
    expected = bytes.fromhex(
        "0801"
        "1216" "0a08" + b"MatMul_w".hex() + "120a" "0800" "12020802" "12020801"
        "1a20" "0a0177" "121b" "0a020802" "120b08ffffffffffffffffff01" "1a00" "2200"
        "2800" "3000" "3800")
    assert encode_protobuf(data) == expected
    assert decode_protobuf(expected) == data


def test_top_level_optimizer_weight_shard_size() -> None:
    reset_auto_parallel_context()
    try:
        set_auto_parallel_context(optimizer_weight_shard_size=4)
        assert get_auto_parallel_context("optimizer_weight_shard_size") == 4
        assert get_auto_parallel_context("parallel_optimizer_config")[
            "optimizer_weight_shard_size"] == 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_auto_parallel_context(optimizer_weight_shard_size=1)  # MindSpore: ignored
        assert caught and get_auto_parallel_context("optimizer_weight_shard_size") == 4
        with pytest.raises(TypeError, match="optimizer_weight_shard_size"):
            set_auto_parallel_context(optimizer_weight_shard_size="2")
    finally:
        reset_auto_parallel_context()


def test_communi_parallel_mode() -> None:
    reset_auto_parallel_context()
    try:
        assert get_auto_parallel_context("communi_parallel_mode") == "all_group_parallel"
        set_auto_parallel_context(communi_parallel_mode="same_server_group_parallel")
        assert get_auto_parallel_context("communi_parallel_mode") == "same_server_group_parallel"
        with pytest.raises(ValueError, match="no_group_parallel"):
            set_auto_parallel_context(communi_parallel_mode="some_group")
        with pytest.raises(TypeError):
            set_auto_parallel_context(communi_parallel_mode=1)
    finally:
        reset_auto_parallel_context()


# MindSpore's test_strategy_checkpoint.py: six MatMuls (and an Add of weight6), x1 (32, 32) and
# x6 (128, 32) on 8 devices, full batch.
SIX_MATMUL = """
import numpy as np
from pcompile import Parameter, Tensor, nn, ops, set_auto_parallel_context
set_auto_parallel_context(dataset_strategy="full_batch")
STRATEGIES = {strategies}
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        for i, s in enumerate(STRATEGIES, start=1):
            setattr(self, f"matmul{{i}}", ops.MatMul().shard(s) if s else ops.MatMul())
        shapes = [(32, 64), (64, 64), (64, 128), (128, 64), (64, 128), (32, 128)]
        for i, shape in enumerate(shapes, start=1):
            setattr(self, f"weight{{i}}", Parameter(Tensor(np.ones(shape, np.float32)),
                                                    f"weight{{i}}", requires_grad=i != 1))
    def construct(self, x1, x6):
        out = self.matmul1(x1, self.weight1)
        out = self.matmul2(out, self.weight2)
        out = self.matmul3(out, self.weight3)
        out = self.matmul4(out, self.weight4)
        out = self.matmul5(out, self.weight5)
        out = out + self.weight6
        return self.matmul6(out, x6)
def model():
    return Net()
def inputs():
    return [np.ones((32, 32), np.float32), np.ones((128, 32), np.float32)]
"""

SIX_STRATEGIES = [((8, 1), (1, 1)), ((1, 8), (8, 1)), ((2, 2), (2, 2)), ((1, 1), (1, 8)),
                  ((4, 2), (2, 1)), ((4, 1), (1, 2))]


def test_mindspore_six_matmul_save(tmp_path) -> None:
    """test_six_matmul_save (semi_auto_parallel, a .ckpt file): every op that reads a weight is
    saved under <Prim>_<weight> with its strategy (shard()'s, or the default); matmul6 reads
    only inputs and is not. test_six_matmul_save_auto (auto_parallel, a .json file, only trainable
    parameters): weight1 (requires_grad=False) has no layout item."""
    model = tmp_path / "six.py"
    model.write_text(SIX_MATMUL.format(strategies=SIX_STRATEGIES))
    path = str(tmp_path / "strategy_stage1.ckpt")
    compile_model(str(model), devices=8, parallel_mode="semi_auto_parallel", dump=False,
                  overrides={"strategy_ckpt_config": {"save_file": path}})
    with open(path, "rb") as f:
        data = decode(path, f.read())
    saved = {k: v["parallel_strategy"] for k, v in data["parallel_strategy_item"].items()}
    assert saved == {**{f"MatMul_weight{i}": [list(s) for s in SIX_STRATEGIES[i - 1]]
                        for i in range(1, 6)},
                     "Add_weight6": [[8, 1], [8, 1]]}  # the semi-auto default, saved too
    model.write_text(SIX_MATMUL.format(strategies=[None] * 6))
    path = str(tmp_path / "strategy_stage1_auto.json")
    compile_model(str(model), devices=8, search_mode="sharding_propagation", dump=False,
                  overrides={"strategy_ckpt_config": {"save_file": path,
                                                      "only_trainable_params": True}})
    with open(path, "rb") as f:
        data = decode(path, f.read())
    assert set(data["parallel_layout_item"]) == {f"weight{i}" for i in range(2, 7)}


def test_pipeline_stages_are_recorded(tmp_path) -> None:
    """Each strategy item carries the pipeline stage its op runs in (examples/pipeline_mlp.py:
    block s in stage s of 4)."""
    path = str(tmp_path / "pipeline.json")
    compile_model(os.path.join(ROOT, "examples", "pipeline_mlp.py"), devices=8, dump=False,
                  overrides={"strategy_ckpt_config": {"save_file": path}})
    with open(path, "rb") as f:
        items = decode(path, f.read())["parallel_strategy_item"]
    assert {k: v["stage"] for k, v in items.items()} == {
        f"MatMul_blocks.{s}.{w}": s for s in range(4) for w in ("w1", "w2")}


def test_semi_auto_parallel_loads_strategies_over_the_users(tmp_path) -> None:
    """MindSpore's load_strategy_from_ckpt: in semi_auto_parallel too, an op whose key the load
    file holds takes the file's strategy, over its shard() (quickstart's matmul ((2, 4), (4,
    1))) and over the default (matmul2); the plan still trains like one device."""
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"current_stage": 1, "parallel_strategy_item": {
        "MatMul_w": {"stage": 0, "parallel_strategy": [[4, 2], [2, 1]]},
        "MatMul_w2": {"stage": 0, "parallel_strategy": [[1, 8], [8, 1]]}},
        "parallel_layout_item": {}}))
    program = compile_model(QUICKSTART, devices=8, parallel_mode="semi_auto_parallel",
                            dump=False, overrides={"strategy_ckpt_config": {
                                "load_file": str(path)}})
    got = {n.instance_name: program.state.assignment.sharding(n).strategy
           for n in program.graph.nodes if n.op == "MatMul"}
    assert got == {"matmul": ((4, 2), (2, 1)), "matmul2": ((1, 8), (8, 1))}
    from pcompile.tools.oracle import check

    assert check(program, steps=1).ok()
