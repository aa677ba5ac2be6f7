"""set_auto_parallel_context / set_context / cost model / algo parameters: every option valid
and invalid, the exact comm_fusion exceptions of reference §6.1, atomicity, reset, overrides."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pcompile.compiler.config.context import (
    GRAPH_MODE,
    PYNATIVE_MODE,
    AutoParallelContext,
    ContextKeyError,
    ParallelMode,
    context_override,
    current_algo_parameters,
    current_context,
    current_cost_model_context,
    current_general_context,
    get_algo_parameters,
    get_auto_parallel_context,
    get_context,
    get_cost_model_context,
    reset_algo_parameters,
    reset_auto_parallel_context,
    reset_context,
    reset_cost_model_context,
    set_algo_parameters,
    set_auto_parallel_context,
    set_context,
    set_cost_model_context,
)
from pcompile.compiler.config.layout import Layout


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    reset_auto_parallel_context()
    reset_context()
    reset_cost_model_context()
    reset_algo_parameters()
    yield
    reset_auto_parallel_context()
    reset_context()
    reset_cost_model_context()
    reset_algo_parameters()


# --------------------------------------------------------------------------------------------
# defaults
# --------------------------------------------------------------------------------------------

AP_DEFAULTS: dict[str, Any] = {
    "device_num": 1,
    "global_rank": 0,
    "gradients_mean": False,
    "gradient_fp32_sync": True,
    "loss_repeated_mean": True,
    "parallel_mode": "stand_alone",
    "search_mode": "recursive_programming",
    "auto_parallel_search_mode": "recursive_programming",
    "parameter_broadcast": False,
    "strategy_ckpt_load_file": "",
    "strategy_ckpt_save_file": "",
    "strategy_ckpt_config": {"load_file": "", "save_file": "", "only_trainable_params": True},
    "full_batch": False,
    "dataset_strategy": "data_parallel",
    "enable_parallel_optimizer": False,
    "parallel_optimizer_config": {
        "gradient_accumulation_shard": False,
        "parallel_optimizer_threshold": 64,
        "optimizer_weight_shard_size": -1,
        "optimizer_level": "level1",
    },
    "enable_alltoall": False,
    "all_reduce_fusion_config": [],
    "comm_fusion": {"openstate": True, "allreduce": {"mode": "auto", "config": None},
                    "allgather": {"mode": "auto", "config": None},
                    "reducescatter": {"mode": "auto", "config": None}},
    "pipeline_stages": 1,
    "pipeline_config": {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"},
    "grad_accumulation_step": 1,
    "force_fp32_communication": False,
    "group_ckpt_save_file": "",
    "communi_parallel_mode": "all_group_parallel",
    "optimizer_weight_shard_aggregated_save": False,
    "optimizer_weight_shard_size": -1,
}


@pytest.mark.parametrize("key", sorted(AP_DEFAULTS))
def test_auto_parallel_defaults(key: str) -> None:
    assert get_auto_parallel_context(key) == AP_DEFAULTS[key]


def test_every_option_has_a_default_in_this_test() -> None:
    fields = set(AutoParallelContext.model_fields)
    assert fields <= set(AP_DEFAULTS)


# --------------------------------------------------------------------------------------------
# valid values round-trip
# --------------------------------------------------------------------------------------------

VALID: list[tuple[str, Any, Any]] = [
    ("device_num", 8, 8),
    ("device_num", 4096, 4096),
    ("device_num", np.int64(16), 16),
    ("global_rank", 0, 0),
    ("global_rank", 4095, 4095),
    ("gradients_mean", True, True),
    ("gradient_fp32_sync", False, False),
    ("loss_repeated_mean", False, False),
    ("parallel_mode", "data_parallel", "data_parallel"),
    ("parallel_mode", ParallelMode.SEMI_AUTO_PARALLEL, "semi_auto_parallel"),
    ("parallel_mode", ParallelMode.AUTO_PARALLEL, "auto_parallel"),
    ("parallel_mode", ParallelMode.HYBRID_PARALLEL, "hybrid_parallel"),
    ("parallel_mode", ParallelMode.STAND_ALONE, "stand_alone"),
    ("parallel_mode", ParallelMode.DATA_PARALLEL, "data_parallel"),
    ("search_mode", "sharding_propagation", "sharding_propagation"),
    ("search_mode", "dynamic_programming", "dynamic_programming"),
    ("search_mode", "recursive_programming", "recursive_programming"),
    ("parameter_broadcast", True, True),
    ("strategy_ckpt_load_file", "./a.ckpt", "./a.ckpt"),
    ("strategy_ckpt_save_file", "./b.json", "./b.json"),
    ("full_batch", True, True),
    ("dataset_strategy", "full_batch", "full_batch"),
    ("dataset_strategy", "data_parallel", "data_parallel"),
    ("dataset_strategy", ((1, 8), (1, 8)), ((1, 8), (1, 8))),
    ("dataset_strategy", [[4, 2]], ((4, 2),)),
    ("enable_parallel_optimizer", True, True),
    ("enable_alltoall", True, True),
    ("all_reduce_fusion_config", [20, 35], [20, 35]),
    ("all_reduce_fusion_config", (1,), [1]),
    ("all_reduce_fusion_config", [], []),
    ("pipeline_stages", 4, 4),
    ("grad_accumulation_step", 8, 8),
    ("force_fp32_communication", True, True),
    ("group_ckpt_save_file", "groups.json", "groups.json"),
]


@pytest.mark.parametrize(("key", "value", "expected"), VALID)
def test_valid_values(key: str, value: Any, expected: Any) -> None:
    set_auto_parallel_context(**{key: value})
    got = get_auto_parallel_context(key)
    assert got == expected
    assert type(got) is type(expected)


def test_dataset_strategy_accepts_layouts() -> None:
    layout = Layout((4, 2), ("dp", "mp"))
    strategy = (layout("dp", "mp"), layout("dp", "None"))
    set_auto_parallel_context(dataset_strategy=strategy)
    assert get_auto_parallel_context("dataset_strategy") == strategy
    assert get_auto_parallel_context("full_batch") is False


def test_seed_quickstart_call() -> None:
    set_auto_parallel_context(
        parallel_mode=ParallelMode.AUTO_PARALLEL,
        search_mode="sharding_propagation",
        dataset_strategy="data_parallel",
    )
    ctx = current_context()
    assert (ctx.parallel_mode, ctx.search_mode, ctx.full_batch) == (
        "auto_parallel",
        "sharding_propagation",
        False,
    )


# --------------------------------------------------------------------------------------------
# invalid values: type -> TypeError, range -> ValueError, message names option and value
# --------------------------------------------------------------------------------------------

INVALID: list[tuple[str, Any, type[Exception]]] = [
    ("device_num", 0, ValueError),
    ("device_num", 4097, ValueError),
    ("device_num", -1, ValueError),
    ("device_num", "8", TypeError),
    ("device_num", 8.0, TypeError),
    ("device_num", True, TypeError),
    ("global_rank", -1, ValueError),
    ("global_rank", 4096, ValueError),
    ("global_rank", "0", TypeError),
    ("gradients_mean", 1, TypeError),
    ("gradients_mean", "True", TypeError),
    ("gradient_fp32_sync", None, TypeError),
    ("loss_repeated_mean", 0, TypeError),
    ("parallel_mode", "semi_auto", ValueError),
    ("parallel_mode", "AUTO_PARALLEL", ValueError),
    ("parallel_mode", 1, ValueError),
    ("search_mode", "dp", ValueError),
    ("auto_parallel_search_mode", "rp", ValueError),
    ("parameter_broadcast", "yes", TypeError),
    ("strategy_ckpt_load_file", 3, TypeError),
    ("strategy_ckpt_save_file", None, TypeError),
    ("full_batch", 1, TypeError),
    ("dataset_strategy", "model_parallel", ValueError),
    ("dataset_strategy", 8, TypeError),
    ("dataset_strategy", (), ValueError),
    ("dataset_strategy", ((8, 0),), ValueError),
    ("dataset_strategy", ((8, 1.5),), TypeError),
    ("dataset_strategy", (8, 1), TypeError),
    ("dataset_strategy", (Layout((2,), ("dp",)),), TypeError),
    ("enable_parallel_optimizer", "True", TypeError),
    ("enable_alltoall", 1, TypeError),
    ("all_reduce_fusion_config", [35, 20], ValueError),
    ("all_reduce_fusion_config", [20, 20], ValueError),
    ("all_reduce_fusion_config", [0, 5], ValueError),
    ("all_reduce_fusion_config", [1.5], TypeError),
    ("all_reduce_fusion_config", 20, TypeError),
    ("pipeline_stages", 0, ValueError),
    ("pipeline_stages", "2", TypeError),
    ("grad_accumulation_step", 0, ValueError),
    ("force_fp32_communication", "no", TypeError),
    ("group_ckpt_save_file", 1, TypeError),
    ("strategy_ckpt_config", "a.json", TypeError),
    ("parallel_optimizer_config", [1], TypeError),
    ("pipeline_config", 4, TypeError),
]


@pytest.mark.parametrize(("key", "value", "exc"), INVALID)
def test_invalid_values(key: str, value: Any, exc: type[Exception]) -> None:
    before = current_context()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(exc) as info:
            set_auto_parallel_context(**{key: value})
    assert not isinstance(info.value, ValidationError)
    message = str(info.value)
    assert key.replace("auto_parallel_search_mode", "search_mode") in message
    assert current_context() is before


def test_message_names_value_and_what_is_valid() -> None:
    with pytest.raises(ValueError) as info:
        set_auto_parallel_context(device_num=5000)
    assert "5000" in str(info.value) and "[1, 4096]" in str(info.value)
    with pytest.raises(ValueError) as info:
        set_auto_parallel_context(parallel_mode="semi_auto")
    assert "'semi_auto_parallel'" in str(info.value) and "did you mean" in str(info.value)


def test_unknown_option_suggests_closest() -> None:
    with pytest.raises(ValueError) as info:
        set_auto_parallel_context(devices_num=8)
    assert "devices_num" in str(info.value)
    assert "Did you mean 'device_num'" in str(info.value)
    assert "global_rank" in str(info.value)  # lists the valid names


def test_get_unknown_key() -> None:
    with pytest.raises(ValueError, match="serch_mode"):
        get_auto_parallel_context("serch_mode")


# --------------------------------------------------------------------------------------------
# dict options
# --------------------------------------------------------------------------------------------


def test_parallel_optimizer_config_valid_and_merged() -> None:
    set_auto_parallel_context(
        enable_parallel_optimizer=True,
        parallel_optimizer_config={"gradient_accumulation_shard": True},
    )
    set_auto_parallel_context(
        parallel_optimizer_config={
            "parallel_optimizer_threshold": 0,
            "optimizer_weight_shard_size": 2,
            "optimizer_level": "level3",
        }
    )
    assert get_auto_parallel_context("parallel_optimizer_config") == {
        "gradient_accumulation_shard": True,
        "parallel_optimizer_threshold": 0,
        "optimizer_weight_shard_size": 2,
        "optimizer_level": "level3",
    }


@pytest.mark.parametrize(
    ("config", "exc"),
    [
        ({"gradient_accumulation_shard": "yes"}, TypeError),
        ({"parallel_optimizer_threshold": -1}, ValueError),
        ({"parallel_optimizer_threshold": 1.5}, TypeError),
        ({"optimizer_weight_shard_size": 1}, ValueError),
        ({"optimizer_weight_shard_size": 0}, ValueError),
        ({"optimizer_weight_shard_size": -2}, ValueError),
        ({"optimizer_level": "level4"}, ValueError),
        ({"optimizer_levl": "level2"}, KeyError),
    ],
)
def test_parallel_optimizer_config_invalid(config: dict[str, Any], exc: type) -> None:
    before = current_context()
    with pytest.raises(exc) as info:
        set_auto_parallel_context(parallel_optimizer_config=config)
    assert next(iter(config)) in str(info.value)
    assert current_context() is before


def test_unknown_dict_key_is_key_error_and_value_error() -> None:
    with pytest.raises(ContextKeyError) as info:
        set_auto_parallel_context(strategy_ckpt_config={"load_fil": "x"})
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    assert "Did you mean 'load_file'" in str(info.value)
    with pytest.raises(KeyError):
        set_auto_parallel_context(pipeline_config={"scheduler": "gpipe"})


def test_strategy_ckpt_config_and_old_spelling_are_one_setting() -> None:
    set_auto_parallel_context(strategy_ckpt_config={"load_file": "in.json", "save_file": "o.ckpt"})
    assert get_auto_parallel_context("strategy_ckpt_load_file") == "in.json"
    assert get_auto_parallel_context("strategy_ckpt_save_file") == "o.ckpt"
    set_auto_parallel_context(strategy_ckpt_save_file="new.json")
    assert get_auto_parallel_context("strategy_ckpt_config") == {
        "load_file": "in.json",
        "save_file": "new.json",
        "only_trainable_params": True,
    }
    set_auto_parallel_context(strategy_ckpt_config={"only_trainable_params": False})
    assert get_auto_parallel_context("strategy_ckpt_config")["only_trainable_params"] is False
    with pytest.raises(TypeError):
        set_auto_parallel_context(strategy_ckpt_config={"only_trainable_params": "no"})
    with pytest.raises(ValueError, match="disagree"):
        set_auto_parallel_context(
            strategy_ckpt_load_file="a", strategy_ckpt_config={"load_file": "b"}
        )


def test_pipeline_config() -> None:
    set_auto_parallel_context(
        pipeline_stages=2,
        pipeline_config={"pipeline_interleave": True, "pipeline_scheduler": "gpipe"},
    )
    assert get_auto_parallel_context("pipeline_config") == {
        "pipeline_interleave": True,
        "pipeline_scheduler": "gpipe",
    }
    with pytest.raises(ValueError, match="gpipe"):
        set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "gpip"})
    with pytest.raises(TypeError):
        set_auto_parallel_context(pipeline_config={"pipeline_interleave": 1})


# --------------------------------------------------------------------------------------------
# comm_fusion (reference §6.1): exact exception classes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"allreduce": {"mode": "auto", "config": None}},
        {"allreduce": {"mode": "size", "config": 32}},
        {"allreduce": {"mode": "index", "config": [20, 35]}},
        {
            "allgather": {"mode": "size", "config": 16},
            "reducescatter": {"mode": "size", "config": 32},
        },
        {"allgather": {"mode": "auto", "config": None}},
        {"reducescatter": {"mode": "auto", "config": None}},
        {"openstate": False},
        {"openstate": True, "allreduce": {"mode": "size", "config": 1}},
    ],
)
def test_comm_fusion_valid(config: dict[str, Any]) -> None:
    set_auto_parallel_context(comm_fusion=config)
    got = get_auto_parallel_context("comm_fusion")
    for key, value in config.items():
        assert got[key] == value


def test_comm_fusion_merges_and_feeds_passes() -> None:
    set_auto_parallel_context(comm_fusion={"allgather": {"mode": "size", "config": 16}})
    set_auto_parallel_context(comm_fusion={"reducescatter": {"mode": "auto", "config": None}})
    ctx = current_context()
    assert ctx.fusion_threshold_mb("allreduce") == 64
    assert ctx.fusion_threshold_mb("allgather") == 16
    assert ctx.fusion_threshold_mb("reducescatter") == 64
    set_auto_parallel_context(comm_fusion={"allreduce": {"mode": "index", "config": [2, 5]}})
    ctx = current_context()
    assert ctx.fusion_threshold_mb("allreduce") is None
    assert ctx.allreduce_split_indices() == (2, 5)
    assert get_auto_parallel_context("all_reduce_fusion_config") == [2, 5]
    set_auto_parallel_context(comm_fusion={"openstate": False})
    assert not current_context().fusion_enabled("allgather")


def test_allgather_fusion_off_by_default() -> None:
    ctx = current_context()
    assert ctx.fusion_enabled("allreduce")
    assert not ctx.fusion_enabled("allgather")
    assert not ctx.fusion_enabled("reducescatter")
    set_auto_parallel_context(all_reduce_fusion_config=[3])
    assert current_context().allreduce_split_indices() == (3,)


@pytest.mark.parametrize(
    ("config", "exc"),
    [
        # reference §6.1: TypeError
        ("allreduce", TypeError),
        ([("allreduce", {"mode": "auto", "config": None})], TypeError),
        ({"allreduce": "auto"}, TypeError),
        ({"allreduce": {"mode": "size", "config": "30.12"}}, TypeError),
        ({"allgather": {"mode": "size", "config": "30.12"}}, TypeError),
        ({"openstate": "True"}, TypeError),
        ({"allreduce": {"mode": "size", "config": 30.12}}, TypeError),
        ({"allreduce": {"mode": "size", "config": True}}, TypeError),
        ({"allreduce": {"mode": "index", "config": 20}}, TypeError),
        ({"allreduce": {"mode": "index", "config": ["20"]}}, TypeError),
        ({"allreduce": {"mode": "auto", "config": 64}}, TypeError),
        # reference §6.1: KeyError
        ({"all": {"mode": "auto", "config": None}}, KeyError),
        ({"allreduce": {"config": None}}, KeyError),
        ({"allreduce": {"mode": "auto"}}, KeyError),
        ({"allreduce": {"modes": "size", "config": 32}}, KeyError),
        ({"allreduce": {"mode": "size", "config": 32, "extra": 1}}, KeyError),
        ({"allreduce": {"mode": "sizes", "config": 32}}, KeyError),
        ({"allgather": {"mode": "index", "config": [1]}}, KeyError),
        ({"reducescatter": {"mode": "index", "config": [1]}}, KeyError),
        # values out of range
        ({"allreduce": {"mode": "size", "config": 0}}, ValueError),
        ({"allreduce": {"mode": "index", "config": [35, 20]}}, ValueError),
    ],
)
def test_comm_fusion_errors(config: Any, exc: type[Exception]) -> None:
    before = current_context()
    with pytest.raises(exc) as info:
        set_auto_parallel_context(comm_fusion=config)
    assert not isinstance(info.value, ValidationError)
    assert current_context() is before


def test_comm_fusion_exception_class_is_the_builtin() -> None:
    with pytest.raises(TypeError) as info:
        set_auto_parallel_context(comm_fusion={"openstate": "True"})
    assert type(info.value) is TypeError
    with pytest.raises(KeyError) as kinfo:
        set_auto_parallel_context(comm_fusion={"all": {"mode": "auto", "config": None}})
    assert type(kinfo.value) is KeyError


# --------------------------------------------------------------------------------------------
# full_batch <=> dataset_strategy, aliases
# --------------------------------------------------------------------------------------------


def test_full_batch_and_dataset_strategy_stay_consistent() -> None:
    set_auto_parallel_context(full_batch=True)
    assert get_auto_parallel_context("dataset_strategy") == "full_batch"
    set_auto_parallel_context(full_batch=False)
    assert get_auto_parallel_context("dataset_strategy") == "data_parallel"
    set_auto_parallel_context(dataset_strategy="full_batch")
    assert get_auto_parallel_context("full_batch") is True
    set_auto_parallel_context(dataset_strategy="data_parallel")
    assert get_auto_parallel_context("full_batch") is False
    set_auto_parallel_context(dataset_strategy=((2, 1),))
    set_auto_parallel_context(full_batch=False)  # keeps the explicit strategy
    assert get_auto_parallel_context("dataset_strategy") == ((2, 1),)
    set_auto_parallel_context(full_batch=True, dataset_strategy="full_batch")
    with pytest.raises(ValueError, match="disagree"):
        set_auto_parallel_context(full_batch=True, dataset_strategy="data_parallel")
    with pytest.raises(ValueError, match="disagree"):
        set_auto_parallel_context(full_batch=False, dataset_strategy="full_batch")


def test_model_accepts_mindspore_spellings() -> None:
    ctx = AutoParallelContext(full_batch=True, strategy_ckpt_save_file="s.json")
    assert ctx.dataset_strategy == "full_batch" and ctx.full_batch
    assert ctx.strategy_ckpt_save_file == "s.json"
    assert AutoParallelContext.model_validate(dict(ctx)) == ctx


def test_deprecated_search_mode_alias() -> None:
    with pytest.warns(DeprecationWarning):
        set_auto_parallel_context(auto_parallel_search_mode="dynamic_programming")
    assert get_auto_parallel_context("search_mode") == "dynamic_programming"
    assert get_auto_parallel_context("auto_parallel_search_mode") == "dynamic_programming"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match="disagree"):
            set_auto_parallel_context(
                auto_parallel_search_mode="dynamic_programming", search_mode="sharding_propagation"
            )


# --------------------------------------------------------------------------------------------
# atomicity, reset, accessors, overrides
# --------------------------------------------------------------------------------------------


def test_setting_is_atomic() -> None:
    set_auto_parallel_context(device_num=4)
    before = current_context()
    with pytest.raises(ValueError):
        set_auto_parallel_context(device_num=8, global_rank=3, parallel_mode="nonsense")
    with pytest.raises(KeyError):
        set_auto_parallel_context(device_num=8, comm_fusion={"all": {}})
    with pytest.raises(ValueError):
        set_auto_parallel_context(device_num=8, wrong_name=1)
    assert current_context() is before
    assert get_auto_parallel_context("device_num") == 4
    assert get_auto_parallel_context("global_rank") == 0


OPTION_VALUES = st.sampled_from(
    [
        ("device_num", 8),
        ("device_num", 0),
        ("global_rank", 3),
        ("global_rank", "x"),
        ("parallel_mode", "auto_parallel"),
        ("parallel_mode", "auto"),
        ("gradients_mean", True),
        ("gradients_mean", 2),
        ("comm_fusion", {"allgather": {"mode": "size", "config": 4}}),
        ("comm_fusion", {"allgather": {"mode": "index", "config": [1]}}),
        ("pipeline_stages", 2),
        ("pipeline_stages", -2),
        ("all_reduce_fusion_config", [4, 8]),
        ("all_reduce_fusion_config", [8, 4]),
    ]
)


@settings(max_examples=60, deadline=None)
@given(st.lists(OPTION_VALUES, min_size=1, max_size=5))
def test_atomicity_property(options: list[tuple[str, Any]]) -> None:
    reset_auto_parallel_context()
    kwargs = dict(options)
    before = current_context()
    try:
        set_auto_parallel_context(**kwargs)
    except (TypeError, ValueError, KeyError):
        assert current_context() is before
    else:
        after = current_context()
        for key, value in kwargs.items():
            got = get_auto_parallel_context(key)
            if key == "comm_fusion":
                assert all(got[k] == v for k, v in value.items())
            else:
                assert got == value
        assert after is not before


def test_reset() -> None:
    set_auto_parallel_context(
        device_num=8,
        parallel_mode="semi_auto_parallel",
        comm_fusion={"allgather": {"mode": "size", "config": 4}},
        full_batch=True,
    )
    reset_auto_parallel_context()
    assert current_context() == AutoParallelContext()
    for key, value in AP_DEFAULTS.items():
        assert get_auto_parallel_context(key) == value


def test_current_context_is_an_immutable_snapshot() -> None:
    set_auto_parallel_context(device_num=8, all_reduce_fusion_config=[1, 2])
    ctx = current_context()
    with pytest.raises(ValidationError):
        ctx.device_num = 2  # type: ignore[misc]
    got = get_auto_parallel_context("all_reduce_fusion_config")
    got.append(99)
    fusion = get_auto_parallel_context("comm_fusion")
    fusion["openstate"] = False
    assert get_auto_parallel_context("all_reduce_fusion_config") == [1, 2]
    assert get_auto_parallel_context("comm_fusion")["openstate"] is True
    set_auto_parallel_context(device_num=16)
    assert ctx.device_num == 8


def test_check_for_compile() -> None:
    AutoParallelContext(device_num=8, global_rank=7, pipeline_stages=2).check_for_compile()
    with pytest.raises(ValueError, match="global_rank"):
        AutoParallelContext(device_num=8, global_rank=8).check_for_compile()
    with pytest.raises(ValueError, match="pipeline_stages"):
        AutoParallelContext(device_num=8, pipeline_stages=3).check_for_compile()
    assert AutoParallelContext(device_num=8, pipeline_stages=2).stage_device_num == 4


def test_context_override_fixes_flags_then_restores() -> None:
    set_auto_parallel_context(device_num=2, gradients_mean=True)
    set_context(save_graphs=1)
    outside = current_context()
    with context_override(device_num=8, search_mode="dynamic_programming", full_batch=None) as ctx:
        assert ctx.device_num == 8 and ctx.search_mode == "dynamic_programming"
        assert ctx.gradients_mean is True  # not overridden: kept
        # a model file setting options inside the block: flags win, the rest applies
        set_auto_parallel_context(device_num=4, global_rank=1, search_mode="sharding_propagation")
        set_context(save_graphs=3)
        assert get_auto_parallel_context("device_num") == 8
        assert get_auto_parallel_context("search_mode") == "dynamic_programming"
        assert get_auto_parallel_context("global_rank") == 1
        reset_auto_parallel_context()
        assert get_auto_parallel_context("device_num") == 8
        assert get_auto_parallel_context("global_rank") == 0
    assert current_context() is outside
    assert get_context("save_graphs") == 1
    set_auto_parallel_context(device_num=4)
    assert get_auto_parallel_context("device_num") == 4


def test_context_override_pins_dict_keys_and_views() -> None:
    with context_override(
        comm_fusion={"allreduce": {"mode": "size", "config": 8}}, dataset_strategy="full_batch"
    ):
        set_auto_parallel_context(
            comm_fusion={
                "allreduce": {"mode": "auto", "config": None},
                "allgather": {"mode": "size", "config": 2},
            },
            full_batch=False,
        )
        fusion = get_auto_parallel_context("comm_fusion")
        assert fusion["allreduce"] == {"mode": "size", "config": 8}
        assert fusion["allgather"] == {"mode": "size", "config": 2}
        assert get_auto_parallel_context("full_batch") is True
    assert current_context() == AutoParallelContext()


def test_context_override_validates() -> None:
    with pytest.raises(ValueError):
        with context_override(device_num=0):
            pass  # pragma: no cover
    assert current_context() == AutoParallelContext()


def test_context_override_restores_after_error() -> None:
    with pytest.raises(RuntimeError):
        with context_override(device_num=8):
            set_cost_model_context(costmodel_beta=50.0)
            raise RuntimeError("boom")
    assert get_auto_parallel_context("device_num") == 1
    assert get_cost_model_context("costmodel_beta") == 400.0


# --------------------------------------------------------------------------------------------
# set_context
# --------------------------------------------------------------------------------------------


def test_set_context_defaults_and_seed_calls() -> None:
    assert get_context("mode") == GRAPH_MODE
    assert get_context("save_graphs") == 0
    set_context(mode=GRAPH_MODE, device_target="GPU", save_graphs=2, save_graphs_path="../g")
    set_context(max_device_memory="28GB")
    assert get_context("device_target") == "GPU"
    assert get_context("save_graphs") == 2
    assert get_context("save_graphs_path") == "../g"
    assert current_general_context().max_device_memory_bytes == 28 * 1024**3
    set_context(mode=PYNATIVE_MODE)
    assert get_context("mode") == 1
    set_context(mode="GRAPH_MODE", device_target="cpu")
    assert (get_context("mode"), get_context("device_target")) == (0, "CPU")


@pytest.mark.parametrize(("value", "stored"), [(True, 2), (False, 0), (0, 0), (1, 1), (3, 3)])
def test_save_graphs_values(value: Any, stored: int) -> None:
    set_context(save_graphs=value)
    assert get_context("save_graphs") == stored


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"mode": 2}, ValueError),
        ({"mode": True}, TypeError),
        ({"device_target": "TPU"}, ValueError),
        ({"save_graphs": 4}, ValueError),
        ({"save_graphs": "2"}, TypeError),
        ({"save_graphs_path": 3}, TypeError),
        ({"max_device_memory": "28"}, ValueError),
        ({"max_device_memory": "0GB"}, ValueError),
        ({"max_device_memory": 28}, TypeError),
        ({"save_graph": 2}, ValueError),
    ],
)
def test_set_context_invalid(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    before = current_general_context()
    with pytest.raises(exc) as info:
        set_context(**{"save_graphs_path": "x", **kwargs})
    assert next(iter(kwargs)) in str(info.value)
    assert current_general_context() is before


def test_set_context_other_mindspore_keys() -> None:
    set_context(device_id=3, jit_config={"jit_level": "O1"})
    assert get_context("device_id") == 3
    assert get_context("runtime_num_threads") is None
    with pytest.raises(ValueError, match="Did you mean 'save_graphs'"):
        get_context("save_graph")


# --------------------------------------------------------------------------------------------
# cost model and algorithm parameters
# --------------------------------------------------------------------------------------------

COST_DEFAULTS = {
    "device_memory_capacity": 16.0 * 1024**3,
    "costmodel_alpha": 1.0,
    "costmodel_beta": 400.0,
    "costmodel_gamma": 0.001,
    "costmodel_communi_threshold": 2048.0,
    "costmodel_communi_const": 3072.0,
    "costmodel_communi_bias": 1024.0,
    "costmodel_simplify_cal": True,
    "triangle_star_strategy_overwrite": True,
    "dp_algo_enable_approxi": False,
    "dp_algo_approxi_epsilon": 0.1,
    "rp_matmul_mem_coef": 0.1,
}


def test_cost_model_defaults_set_reset() -> None:
    for key, value in COST_DEFAULTS.items():
        assert get_cost_model_context(key) == value
    set_cost_model_context(costmodel_beta=50, device_memory_capacity=32.0 * 1024**3)
    assert get_cost_model_context("costmodel_beta") == 50.0
    assert isinstance(get_cost_model_context("costmodel_beta"), float)
    assert current_cost_model_context().device_memory_capacity == 32.0 * 1024**3
    set_cost_model_context(costmodel_simplify_cal=False, dp_algo_enable_approxi=True)
    reset_cost_model_context()
    for key, value in COST_DEFAULTS.items():
        assert get_cost_model_context(key) == value


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"device_memory_capacity": 0}, ValueError),
        ({"costmodel_alpha": -1.0}, ValueError),
        ({"costmodel_beta": "400"}, TypeError),
        ({"costmodel_gamma": 1.5}, ValueError),
        ({"costmodel_communi_threshold": -1}, ValueError),
        ({"costmodel_simplify_cal": 1}, TypeError),
        ({"dp_algo_approxi_epsilon": 0}, ValueError),
        ({"rp_matmul_mem_coef": True}, TypeError),
        ({"costmodel_alfa": 1.0}, ValueError),
    ],
)
def test_cost_model_invalid(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    before = current_cost_model_context()
    with pytest.raises(exc) as info:
        set_cost_model_context(costmodel_beta=1.0, **kwargs)
    assert next(iter(kwargs)) in str(info.value)
    assert current_cost_model_context() is before
    with pytest.raises(ValueError):
        get_cost_model_context("nope")


def test_algo_parameters() -> None:
    assert get_algo_parameters("fully_use_devices") is True  # the seeds' (r2.0) default
    assert get_algo_parameters("elementwise_op_strategy_follow") is False
    assert get_algo_parameters("enable_algo_approxi") is False
    assert get_algo_parameters("algo_approxi_epsilon") == 0.1
    assert get_algo_parameters("tensor_slice_align_enable") is False
    assert get_algo_parameters("tensor_slice_align_size") == 16
    set_algo_parameters(fully_use_devices=False, tensor_slice_align_size=1)
    assert current_algo_parameters().fully_use_devices is False
    set_algo_parameters(tensor_slice_align_size=1024)
    reset_algo_parameters()
    assert get_algo_parameters("fully_use_devices") is True
    assert get_algo_parameters("tensor_slice_align_size") == 16


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"tensor_slice_align_size": 48}, ValueError),
        ({"tensor_slice_align_size": 2048}, ValueError),
        ({"tensor_slice_align_size": 0}, ValueError),
        ({"tensor_slice_align_size": 16.0}, TypeError),
        ({"fully_use_devices": 1}, TypeError),
        ({"algo_approxi_epsilon": -0.1}, ValueError),
        ({"enable_algo_aproxi": True}, ValueError),
    ],
)
def test_algo_parameters_invalid(kwargs: dict[str, Any], exc: type[Exception]) -> None:
    before = current_algo_parameters()
    with pytest.raises(exc) as info:
        set_algo_parameters(fully_use_devices=True, **kwargs)
    assert next(iter(kwargs)) in str(info.value)
    assert current_algo_parameters() is before
    with pytest.raises(ValueError):
        get_algo_parameters("nope")


def test_dict_options_accept_their_models() -> None:
    from pcompile.compiler.config.context import CommFusionConfig, ParallelOptimizerConfig

    set_auto_parallel_context(
        parallel_optimizer_config=ParallelOptimizerConfig(optimizer_level="level2"),
        comm_fusion=CommFusionConfig(allgather={"mode": "size", "config": 3}),
    )
    assert get_auto_parallel_context("parallel_optimizer_config")["optimizer_level"] == "level2"
    assert current_context().fusion_threshold_mb("allgather") == 3
