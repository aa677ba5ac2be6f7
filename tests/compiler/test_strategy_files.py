"""Strategy checkpoints (`strategy_ckpt_config`) as MindSpore writes them: in semi_auto_parallel
as in auto_parallel, as `.json` or protobuf (any other name), with the parallel optimizer's shard
group (`opt_weight_shard_size` / `_step`), written after the compile (compiler/strategy_files.py)
and read back by a later compile."""

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
