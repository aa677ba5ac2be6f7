"""User-facing configuration: `set_auto_parallel_context`, `set_context`, cost-model and
algorithm parameters, with MindSpore's names, defaults and errors.

Each family of options is one frozen pydantic v2 model:

* `AutoParallelContext`  - `set_auto_parallel_context` / `get_auto_parallel_context` /
  `reset_auto_parallel_context`; the compiler reads it through `current_context()`.
* `GeneralContext`       - `set_context` / `get_context`.
* `CostModelContext`     - `set_cost_model_context` / `get_cost_model_context` /
  `reset_cost_model_context` (constants of the strategy-search cost model, reference §4.1).
* `AlgoParameters`       - `set_algo_parameters` / `get_algo_parameters` /
  `reset_algo_parameters`.

Setting is atomic: the new state is validated as a whole and swapped in only when every
argument is valid. Errors are plain Python exceptions, never `pydantic.ValidationError`: an
unknown option name is a `ValueError` that suggests the closest name; a value of the wrong type
is a `TypeError`, a value out of range a `ValueError`, and both name the option, the value and
what would be valid. Unknown keys inside dict options raise `ContextKeyError` (a `KeyError`
that is also a `ValueError`). `comm_fusion` raises exactly the `TypeError` / `KeyError` of the
reference (§6.1).

All stored values are immutable (tuples, frozen models), so `current_context()` can hand out
the live object; getters return fresh lists and dicts in MindSpore's spelling.

See docs/context-options.md for every option, its default, and which pass uses it.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Final, Literal, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from pcompile.compiler.layout import LayoutSpec

__all__ = [
    "GRAPH_MODE",
    "PYNATIVE_MODE",
    "AlgoParameters",
    "AutoParallelContext",
    "CommFusionConfig",
    "ContextKeyError",
    "CostModelContext",
    "FusionOpConfig",
    "GeneralContext",
    "ParallelMode",
    "ParallelOptimizerConfig",
    "PipelineConfig",
    "StrategyCkptConfig",
    "context_override",
    "current_algo_parameters",
    "current_context",
    "current_cost_model_context",
    "current_general_context",
    "get_algo_parameters",
    "get_auto_parallel_context",
    "get_context",
    "get_cost_model_context",
    "reset_algo_parameters",
    "reset_auto_parallel_context",
    "reset_cost_model_context",
    "set_algo_parameters",
    "set_auto_parallel_context",
    "set_context",
    "set_cost_model_context",
]

_log = logging.getLogger(__name__)
_LOCK = threading.RLock()

GRAPH_MODE: Final = 0
"""`set_context(mode=GRAPH_MODE)`: whole-graph compilation (the only mode this compiler has)."""
PYNATIVE_MODE: Final = 1
"""`set_context(mode=PYNATIVE_MODE)`: accepted and stored; compilation is the same."""


class ParallelMode:
    """MindSpore's `ParallelMode` constants (plain strings)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODE_LIST = (
        STAND_ALONE,
        DATA_PARALLEL,
        HYBRID_PARALLEL,
        SEMI_AUTO_PARALLEL,
        AUTO_PARALLEL,
    )


class ContextKeyError(KeyError, ValueError):
    """An unknown or missing key inside a dict-valued option.

    A `KeyError` (as MindSpore's comm_fusion) and a `ValueError` (as MindSpore's
    parallel_optimizer_config / strategy_ckpt_config), with a readable `str()`."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------


def _unnumpy(value: Any) -> Any:
    """numpy scalars behave like the Python scalars they hold."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _to_float(value: Any) -> Any:
    value = _unnumpy(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(_unnumpy)]
Bool = Annotated[StrictBool, BeforeValidator(_unnumpy)]
Float = Annotated[StrictFloat, BeforeValidator(_to_float)]
Str = StrictStr

_FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)

# Error types whose cause is the Python type of the value (-> TypeError).
_TYPE_ERRORS = frozenset(
    {
        "int_type",
        "bool_type",
        "float_type",
        "string_type",
        "dict_type",
        "list_type",
        "tuple_type",
        "model_type",
        "model_attributes_type",
        "dataclass_type",
        "is_instance_of",
        "none_required",
        "int_from_float",
        "int_parsing",
        "float_parsing",
        "bool_parsing",
    }
)


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _raise_clear(
    exc: ValidationError,
    where: str,
    hints: Mapping[str, str],
) -> None:
    """Turn a pydantic ValidationError into a TypeError/ValueError naming option and value."""
    lines = []
    all_type = True
    for error in exc.errors():
        path = ".".join(str(p) for p in error["loc"]) or "(options)"
        hint = hints.get(path) or hints.get(str(error["loc"][0]) if error["loc"] else "")
        msg = str(error.get("msg", ""))
        if msg.startswith("Value error, "):
            # Raised by our own validators: the message already says what is valid.
            msg = msg[len("Value error, ") :]
            lines.append(msg if msg.startswith(f"{where}:") else f"{where}: {msg}")
            all_type = False
            continue
        if error["type"] not in _TYPE_ERRORS:
            all_type = False
        expected = hint or msg
        if error["type"] == "missing":
            lines.append(f"{where}: option '{path}' is required; expected {expected}")
            continue
        if error["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown option '{path}'")
            continue
        suggestion = ""
        value = error.get("input")
        if error["type"] == "literal_error" and isinstance(value, str):
            choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
            close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
            suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        lines.append(
            f"{where}: invalid value {_describe(value)} for '{path}'; "
            f"expected {expected}{suggestion}"
        )
    message = "\n".join(lines)
    if all_type:
        raise TypeError(message) from None
    raise ValueError(message) from None


def _unknown_name(where: str, name: str, valid: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ValueError(
        f"{where}: unknown option '{name}'.{hint} Valid options: {', '.join(sorted(valid))}"
    )


def _check_dict_keys(where: str, option: str, value: Any, valid: tuple[str, ...]) -> dict:
    """A dict-valued option: the value must be a dict whose keys are all known."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where}: option '{option}' must be a dict with keys among {list(valid)}, got "
            f"{_describe(value)}"
        )
    unknown = [k for k in value if k not in valid]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ContextKeyError(
            f"{where}: unknown key {key!r} in '{option}'.{hint} Valid keys: {list(valid)}"
        )
    return dict(value)


# --------------------------------------------------------------------------------------------
# Nested option models
# --------------------------------------------------------------------------------------------

_AP = "set_auto_parallel_context"


class StrategyCkptConfig(BaseModel):
    """`strategy_ckpt_config`: where to load/save per-op strategies and parameter layouts."""

    model_config = _FROZEN

    load_file: Str = ""
    save_file: Str = ""
    only_trainable_params: Bool = True

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        return _check_dict_keys(_AP, "strategy_ckpt_config", data, tuple(cls.model_fields))


class ParallelOptimizerConfig(BaseModel):
    """`parallel_optimizer_config`: details of the ZeRO-like optimizer sharding."""

    model_config = _FROZEN

    gradient_accumulation_shard: Bool = False
    parallel_optimizer_threshold: Annotated[Int, Field(ge=0)] = 64
    optimizer_weight_shard_size: Int = -1
    optimizer_level: Literal["level1", "level2", "level3"] = "level1"

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        return _check_dict_keys(_AP, "parallel_optimizer_config", data, tuple(cls.model_fields))

    @field_validator("optimizer_weight_shard_size")
    @classmethod
    def _shard_size(cls, value: int) -> int:
        if value == -1 or value > 1:
            return value
        raise ValueError(
            f"invalid value {value!r} for 'parallel_optimizer_config.optimizer_weight_shard_size'"
            "; expected -1 (the whole data-parallel group) or an int > 1"
        )


PIPELINE_SCHEDULERS = ("1f1b", "gpipe", "seqpipe", "seqvpp", "seqsmartvpp")


class PipelineConfig(BaseModel):
    """`pipeline_config`: pipeline interleaving and schedule."""

    model_config = _FROZEN

    pipeline_interleave: Bool = False
    pipeline_scheduler: Literal["1f1b", "gpipe", "seqpipe", "seqvpp", "seqsmartvpp"] = "1f1b"

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        return _check_dict_keys(_AP, "pipeline_config", data, tuple(cls.model_fields))


FUSION_THRESHOLD_AUTO_MB = 64
"""Bucket size of comm_fusion mode "auto" (reference §6.1)."""

_FUSION_OPS = ("allreduce", "allgather", "reducescatter")
_FUSION_KEYS = ("openstate",) + _FUSION_OPS
_FUSION_MODES = {
    "allreduce": ("auto", "size", "index"),
    "allgather": ("auto", "size"),
    "reducescatter": ("auto", "size"),
}


def _check_split_indices(option: str, value: Any) -> tuple[int, ...]:
    """all_reduce_fusion_config / comm_fusion index config: strictly increasing ints > 0."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{_AP}: '{option}' must be a list of ints such as [20, 35], got {_describe(value)}"
        )
    out = []
    for index in value:
        index = _unnumpy(index)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(
                f"{_AP}: '{option}' must contain only ints, got {_describe(index)} in {value!r}"
            )
        out.append(index)
    if any(i <= 0 for i in out) or any(a >= b for a, b in zip(out, out[1:])):
        raise ValueError(
            f"{_AP}: invalid value {value!r} for '{option}'; expected strictly increasing "
            "ints > 0 (gradient split indices), e.g. [20, 35]"
        )
    return tuple(out)


def _check_fusion_op(op: str, value: Any) -> dict[str, Any]:
    """One op entry of comm_fusion, with the exact exception classes of reference §6.1."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"For 'comm_fusion', the value of '{op}' must be a dict such as "
            f"{{'mode': 'auto', 'config': None}}, got {_describe(value)}"
        )
    for key in ("mode", "config"):
        if key not in value:
            raise KeyError(f"For 'comm_fusion', the '{op}' dict must contain the key '{key}'")
    extra = [k for k in value if k not in ("mode", "config")]
    if extra:
        raise KeyError(
            f"For 'comm_fusion', unknown key {extra[0]!r} in '{op}'; it takes exactly "
            "'mode' and 'config'"
        )
    mode, config = value["mode"], value["config"]
    modes = _FUSION_MODES[op]
    if not isinstance(mode, str) or mode not in modes:
        raise KeyError(
            f"For 'comm_fusion', the mode of '{op}' must be one of {list(modes)}, got {mode!r}"
        )
    if mode == "auto":
        if config is not None:
            raise TypeError(
                f"For 'comm_fusion', the config of '{op}' in mode 'auto' must be None, "
                f"got {_describe(config)}"
            )
        return {"mode": mode, "config": None}
    if mode == "size":
        config = _unnumpy(config)
        if isinstance(config, bool) or not isinstance(config, int):
            raise TypeError(
                f"For 'comm_fusion', the config of '{op}' in mode 'size' must be an int "
                f"(MB), got {_describe(config)}"
            )
        if config <= 0:
            raise ValueError(
                f"For 'comm_fusion', the config of '{op}' in mode 'size' must be > 0 (MB), "
                f"got {config!r}"
            )
        return {"mode": mode, "config": config}
    return {"mode": mode, "config": _check_split_indices(f"comm_fusion.{op}.config", config)}


def check_comm_fusion(value: Any) -> dict[str, Any]:
    """Validate a `comm_fusion` dict as MindSpore does; return the normalised partial dict.

    Raises TypeError for wrong types (non-dict, config "30.12", openstate "True") and KeyError
    for unknown / missing keys and unknown modes."""
    if not isinstance(value, Mapping):
        raise TypeError(
            "For 'comm_fusion', the value must be a dict with keys among "
            f"{list(_FUSION_KEYS)}, got {_describe(value)}"
        )
    out: dict[str, Any] = {}
    for key, entry in value.items():
        if key not in _FUSION_KEYS:
            raise KeyError(
                f"For 'comm_fusion', unknown key {key!r}; valid keys: {list(_FUSION_KEYS)}"
            )
        if key == "openstate":
            entry = _unnumpy(entry)
            if not isinstance(entry, bool):
                raise TypeError(
                    f"For 'comm_fusion', 'openstate' must be a bool, got {_describe(entry)}"
                )
            out[key] = entry
        else:
            out[key] = _check_fusion_op(key, entry)
    return out


class FusionOpConfig(BaseModel):
    """One communication kind of comm_fusion: `mode` and its `config`."""

    model_config = _FROZEN

    mode: Literal["auto", "size", "index"]
    config: int | tuple[int, ...] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> FusionOpConfig:
        ok = {
            "auto": self.config is None,
            "size": isinstance(self.config, int) and self.config > 0,
            "index": isinstance(self.config, tuple),
        }[self.mode]
        if not ok:
            raise ValueError(
                f"invalid comm_fusion config {self.config!r} for mode {self.mode!r}; expected "
                "None for auto, an int > 0 (MB) for size, a list of split indices for index"
            )
        return self

    def threshold_mb(self) -> int | None:
        """Bucket size in MB: 64 for auto, `config` for size, None for index mode."""
        if self.mode == "auto":
            return FUSION_THRESHOLD_AUTO_MB
        if self.mode == "size":
            assert isinstance(self.config, int)
            return self.config
        return None

    def as_dict(self) -> dict[str, Any]:
        config = list(self.config) if isinstance(self.config, tuple) else self.config
        return {"mode": self.mode, "config": config}


class CommFusionConfig(BaseModel):
    """`comm_fusion`: on/off switch and per-kind bucketing. A kind left None is not fused
    (AllReduce fusion is on by default, AllGather / ReduceScatter fusion are off)."""

    model_config = _FROZEN

    openstate: Bool = True
    allreduce: FusionOpConfig | None = FusionOpConfig(mode="auto")
    allgather: FusionOpConfig | None = None
    reducescatter: FusionOpConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _check(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        if isinstance(data, Mapping):
            plain = {k: v for k, v in data.items() if not isinstance(v, FusionOpConfig)}
            plain = {k: v for k, v in plain.items() if v is not None}
            checked = check_comm_fusion(plain)
            return {**dict(data), **checked}
        return check_comm_fusion(data)

    def as_dict(self) -> dict[str, Any]:
        """The kinds that were set (what `set_auto_parallel_context(comm_fusion=...)` takes
        back unchanged: a kind left out stays unfused)."""
        out: dict[str, Any] = {"openstate": self.openstate}
        for op in _FUSION_OPS:
            entry = getattr(self, op)
            if entry is not None:
                out[op] = entry.as_dict()
        return out

    def displayed(self) -> dict[str, Any]:
        """The dict `get_auto_parallel_context("comm_fusion")` returns: as MindSpore, all four
        keys, a kind never set showing its default `{"mode": "auto", "config": None}` (its
        fusion stays off until it is set, as MindSpore's enable flags)."""
        out = self.as_dict()
        for op in _FUSION_OPS:
            out.setdefault(op, {"mode": "auto", "config": None})
        return {key: out[key] for key in ("openstate", *_FUSION_OPS)}


# --------------------------------------------------------------------------------------------
# set_auto_parallel_context
# --------------------------------------------------------------------------------------------

SEARCH_MODES = ("recursive_programming", "sharding_propagation", "dynamic_programming")


def _check_dataset_strategy(value: Any) -> Any:
    value = _unnumpy(value)
    if isinstance(value, str):
        if value in ("data_parallel", "full_batch"):
            return value
        raise ValueError(
            f"invalid value {value!r} for 'dataset_strategy'; expected \"data_parallel\", "
            '"full_batch", a tuple of per-input strategies such as ((8, 1), (8, 1)), or a '
            "tuple of Layout(...) results"
        )
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f'{_AP}: \'dataset_strategy\' must be "data_parallel", "full_batch", a tuple of '
            f"per-input strategies or a tuple of Layout(...) results, got {_describe(value)}"
        )
    if not value:
        raise ValueError("invalid value () for 'dataset_strategy'; give one strategy per input")
    out: list[Any] = []
    for i, entry in enumerate(value):
        if isinstance(entry, LayoutSpec):
            out.append(entry)
            continue
        if not isinstance(entry, (tuple, list)):
            raise TypeError(
                f"{_AP}: 'dataset_strategy'[{i}] must be a tuple of ints or a Layout(...) "
                f"result, got {_describe(entry)}"
            )
        dims = []
        for dim in entry:
            dim = _unnumpy(dim)
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"{_AP}: 'dataset_strategy'[{i}] must contain only ints, got "
                    f"{_describe(dim)} in {entry!r}"
                )
            if dim <= 0:
                raise ValueError(
                    f"invalid value {tuple(entry)!r} for 'dataset_strategy'[{i}]; the "
                    "number of slices of every dim must be an int > 0"
                )
            dims.append(dim)
        out.append(tuple(dims))
    return tuple(out)


DatasetStrategy = Annotated[Any, BeforeValidator(_check_dataset_strategy)]
SplitIndices = Annotated[
    tuple[int, ...],
    BeforeValidator(lambda v: _check_split_indices("all_reduce_fusion_config", v)),
]

_AP_HINTS: dict[str, str] = {
    "device_num": "an int in [1, 4096]",
    "global_rank": "an int in [0, 4095]",
    "gradients_mean": "a bool",
    "gradient_fp32_sync": "a bool",
    "loss_repeated_mean": "a bool",
    "parallel_mode": "one of " + ", ".join(repr(m) for m in ParallelMode.MODE_LIST),
    "search_mode": "one of " + ", ".join(repr(m) for m in SEARCH_MODES),
    "parameter_broadcast": "a bool",
    "strategy_ckpt_config": "a dict with keys load_file (str), save_file (str), "
    "only_trainable_params (bool)",
    "strategy_ckpt_config.load_file": "a str (file path)",
    "strategy_ckpt_config.save_file": "a str (file path)",
    "strategy_ckpt_config.only_trainable_params": "a bool",
    "enable_parallel_optimizer": "a bool",
    "parallel_optimizer_config.gradient_accumulation_shard": "a bool",
    "parallel_optimizer_config.parallel_optimizer_threshold": "an int >= 0 (KB)",
    "parallel_optimizer_config.optimizer_weight_shard_size": "-1 or an int > 1",
    "parallel_optimizer_config.optimizer_level": "one of 'level1', 'level2', 'level3'",
    "enable_alltoall": "a bool",
    "pipeline_stages": "an int >= 1",
    "pipeline_config.pipeline_interleave": "a bool",
    "pipeline_config.pipeline_scheduler": "one of "
    + ", ".join(repr(s) for s in PIPELINE_SCHEDULERS),
    "grad_accumulation_step": "an int >= 1",
    "force_fp32_communication": "a bool",
    "group_ckpt_save_file": "a str (file path)",
}


class AutoParallelContext(BaseModel):
    """Every option of `set_auto_parallel_context`, validated; immutable.

    Canonical fields only; the MindSpore spellings that are views of another field are
    accepted as input and readable as properties: `full_batch` (<=> dataset_strategy
    "full_batch"), `strategy_ckpt_load_file` / `strategy_ckpt_save_file` (<=>
    strategy_ckpt_config.load_file / .save_file) and `auto_parallel_search_mode` (deprecated
    name of search_mode)."""

    model_config = _FROZEN

    device_num: Annotated[Int, Field(ge=1, le=4096)] = 1
    global_rank: Annotated[Int, Field(ge=0, le=4095)] = 0
    gradients_mean: Bool = False
    gradient_fp32_sync: Bool = True
    loss_repeated_mean: Bool = True
    parallel_mode: Literal[
        "stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel", "auto_parallel"
    ] = "stand_alone"
    search_mode: Literal["recursive_programming", "sharding_propagation", "dynamic_programming"] = (
        "recursive_programming"
    )
    parameter_broadcast: Bool = False
    strategy_ckpt_config: StrategyCkptConfig = StrategyCkptConfig()
    dataset_strategy: DatasetStrategy = "data_parallel"
    enable_parallel_optimizer: Bool = False
    parallel_optimizer_config: ParallelOptimizerConfig = ParallelOptimizerConfig()
    enable_alltoall: Bool = False
    all_reduce_fusion_config: SplitIndices = ()
    comm_fusion: CommFusionConfig = CommFusionConfig()
    pipeline_stages: Annotated[Int, Field(ge=1)] = 1
    pipeline_config: PipelineConfig = PipelineConfig()
    grad_accumulation_step: Annotated[Int, Field(ge=1)] = 1
    force_fp32_communication: Bool = False
    group_ckpt_save_file: Str = ""

    @model_validator(mode="before")
    @classmethod
    def _views(cls, data: Any) -> Any:
        """Accept full_batch, strategy_ckpt_*_file and auto_parallel_search_mode as input."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        _fold_views(data, None)
        return data

    # -- views with MindSpore's other spellings ----------------------------------------------
    @property
    def full_batch(self) -> bool:
        """True when every rank reads the whole batch (dataset_strategy "full_batch")."""
        return self.dataset_strategy == "full_batch"

    @property
    def strategy_ckpt_load_file(self) -> str:
        return self.strategy_ckpt_config.load_file

    @property
    def strategy_ckpt_save_file(self) -> str:
        return self.strategy_ckpt_config.save_file

    @property
    def auto_parallel_search_mode(self) -> str:
        return self.search_mode

    # -- helpers for the passes ---------------------------------------------------------------
    @property
    def stage_device_num(self) -> int:
        """Devices per pipeline stage."""
        return self.device_num // self.pipeline_stages

    def fusion_enabled(self, kind: str) -> bool:
        """Whether comm_fusion buckets `kind` ("allreduce" | "allgather" | "reducescatter")."""
        return self.comm_fusion.openstate and getattr(self.comm_fusion, kind) is not None

    def fusion_threshold_mb(self, kind: str) -> int | None:
        """Bucket size in MB for `kind`, or None when not fused by size."""
        if not self.fusion_enabled(kind):
            return None
        entry: FusionOpConfig = getattr(self.comm_fusion, kind)
        return entry.threshold_mb()

    def allreduce_split_indices(self) -> tuple[int, ...]:
        """Gradient split indices: comm_fusion allreduce "index" config, else
        all_reduce_fusion_config."""
        entry = self.comm_fusion.allreduce
        if entry is not None and entry.mode == "index":
            assert isinstance(entry.config, tuple)
            return entry.config
        return self.all_reduce_fusion_config

    def check_for_compile(self) -> None:
        """Cross-option checks that only make sense once all options are set."""
        if self.global_rank >= self.device_num:
            raise ValueError(
                f"global_rank {self.global_rank} must be < device_num {self.device_num}"
            )
        if self.device_num % self.pipeline_stages:
            raise ValueError(
                f"device_num {self.device_num} must be divisible by pipeline_stages "
                f"{self.pipeline_stages}"
            )

    def get(self, key: str) -> Any:
        """The value `get_auto_parallel_context(key)` returns (fresh lists / dicts)."""
        if key not in _AP_GETTABLE:
            raise _unknown_name("get_auto_parallel_context", key, sorted(_AP_GETTABLE))
        if key in _DICT_FIELDS:
            sub = getattr(self, key)
            return sub.displayed() if isinstance(sub, CommFusionConfig) else sub.model_dump()
        if key == "all_reduce_fusion_config":
            return list(self.all_reduce_fusion_config)
        return getattr(self, key)


_AP_FIELDS: tuple[str, ...] = tuple(AutoParallelContext.model_fields)
_AP_VIEWS = (
    "full_batch",
    "strategy_ckpt_load_file",
    "strategy_ckpt_save_file",
    "auto_parallel_search_mode",
)
_AP_GETTABLE = frozenset(_AP_FIELDS + _AP_VIEWS)
_DICT_FIELDS = (
    "strategy_ckpt_config",
    "parallel_optimizer_config",
    "pipeline_config",
    "comm_fusion",
)


def _fold_views(data: dict[str, Any], current: AutoParallelContext | None) -> None:
    """Rewrite the alias spellings in `data` into canonical fields, in place.

    `current` (when setting) decides what full_batch=False means: the dataset goes back to
    data parallel only if it was "full_batch"; an explicit tuple strategy is kept."""
    if "auto_parallel_search_mode" in data:
        old = data.pop("auto_parallel_search_mode")
        warnings.warn(
            "'auto_parallel_search_mode' is deprecated, use 'search_mode'",
            DeprecationWarning,
            stacklevel=4,
        )
        if "search_mode" in data and data["search_mode"] != old:
            raise ValueError(
                f"{_AP}: search_mode={data['search_mode']!r} and its deprecated alias "
                f"auto_parallel_search_mode={old!r} disagree; give only search_mode"
            )
        data["search_mode"] = old
    if "full_batch" in data:
        full = _unnumpy(data.pop("full_batch"))
        if not isinstance(full, bool):
            raise TypeError(
                f"{_AP}: invalid value {_describe(full)} for 'full_batch'; expected a bool"
            )
        if "dataset_strategy" in data:
            given = _unnumpy(data["dataset_strategy"])
            if full != (given == "full_batch"):
                raise ValueError(
                    f"{_AP}: full_batch={full!r} and dataset_strategy={given!r} disagree; "
                    'full_batch=True means dataset_strategy="full_batch". Give only '
                    "dataset_strategy"
                )
        elif full:
            data["dataset_strategy"] = "full_batch"
        elif current is None or current.dataset_strategy == "full_batch":
            data["dataset_strategy"] = "data_parallel"
        else:
            data["dataset_strategy"] = current.dataset_strategy
    for view, key in (
        ("strategy_ckpt_load_file", "load_file"),
        ("strategy_ckpt_save_file", "save_file"),
    ):
        if view not in data:
            continue
        path = data.pop(view)
        if not isinstance(path, str):
            raise TypeError(
                f"{_AP}: invalid value {_describe(path)} for '{view}'; expected a str (file path)"
            )
        ckpt = data.get("strategy_ckpt_config")
        if isinstance(ckpt, StrategyCkptConfig):
            ckpt = ckpt.model_dump()
        ckpt = (
            {}
            if ckpt is None
            else _check_dict_keys(
                _AP, "strategy_ckpt_config", ckpt, tuple(StrategyCkptConfig.model_fields)
            )
        )
        if key in ckpt and ckpt[key] != path:
            raise ValueError(
                f"{_AP}: {view}={path!r} and strategy_ckpt_config['{key}']={ckpt[key]!r} "
                "disagree; give only strategy_ckpt_config"
            )
        ckpt[key] = path
        data["strategy_ckpt_config"] = ckpt


def _partial_updates(kwargs: dict[str, Any], current: AutoParallelContext) -> dict[str, Any]:
    """Canonical updates for `kwargs`; dict options stay partial (only the keys given)."""
    for name in kwargs:
        if name not in _AP_GETTABLE:
            raise _unknown_name(_AP, name, sorted(_AP_GETTABLE))
    data = dict(kwargs)
    for name in _DICT_FIELDS:
        value = data.get(name)
        if isinstance(value, CommFusionConfig):
            data[name] = value.as_dict()
        elif isinstance(value, BaseModel):
            data[name] = value.model_dump()
    _fold_views(data, current)
    for name in ("strategy_ckpt_config", "parallel_optimizer_config", "pipeline_config"):
        if name in data:
            model = type(getattr(current, name))
            data[name] = _check_dict_keys(_AP, name, data[name], tuple(model.model_fields))
    if "comm_fusion" in data:
        fusion = check_comm_fusion(data["comm_fusion"])
        allreduce = fusion.get("allreduce")
        if allreduce is not None and allreduce["mode"] == "index":
            # MindSpore applies an index config through the all_reduce_fusion_config setter.
            indices = allreduce["config"]
            if "all_reduce_fusion_config" in data:
                given = _check_split_indices(
                    "all_reduce_fusion_config", data["all_reduce_fusion_config"]
                )
                if given != indices:
                    raise ValueError(
                        f"{_AP}: all_reduce_fusion_config={list(given)!r} and comm_fusion "
                        f"allreduce index config {list(indices)!r} disagree"
                    )
            data["all_reduce_fusion_config"] = indices
        data["comm_fusion"] = fusion
    return data


def _merge(current: AutoParallelContext, updates: dict[str, Any]) -> dict[str, Any]:
    """Full field values: current values, overwritten by updates; dict options merge by key."""
    values: dict[str, Any] = {name: getattr(current, name) for name in _AP_FIELDS}
    for name, value in updates.items():
        if name == "comm_fusion":
            merged = {"openstate": current.comm_fusion.openstate}
            for op in _FUSION_OPS:
                entry = getattr(current.comm_fusion, op)
                if entry is not None:
                    merged[op] = entry
            merged.update(value)
            values[name] = merged
        elif name in _DICT_FIELDS:
            values[name] = {**getattr(current, name).model_dump(), **value}
        else:
            values[name] = value
    return values


_state = AutoParallelContext()
_pins: dict[str, Any] = {}  # canonical field -> True (whole field) or set of pinned sub-keys


def _drop_pinned(updates: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in updates.items():
        pin = _pins.get(name)
        if pin is True:
            _log.info("%s: %s is fixed by the command line; ignoring %r", _AP, name, value)
            continue
        if pin and isinstance(value, dict):
            kept = {k: v for k, v in value.items() if k not in pin}
            if len(kept) != len(value):
                _log.info("%s: %s keys %s are fixed by the command line", _AP, name, sorted(pin))
            if not kept:
                continue
            value = kept
        out[name] = value
    return out


def _validated(values: dict[str, Any]) -> AutoParallelContext:
    try:
        return AutoParallelContext.model_validate(values)
    except ValidationError as exc:
        _raise_clear(exc, _AP, _AP_HINTS)
        raise  # unreachable


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set auto-parallel options (MindSpore's names and semantics; see docs/context-options.md).

    Atomic: if any argument is invalid, nothing changes. Dict options (comm_fusion,
    parallel_optimizer_config, strategy_ckpt_config, pipeline_config) update only the keys
    given. Options fixed by an enclosing `context_override` keep their value.
    """
    global _state
    with _LOCK:
        updates = _drop_pinned(_partial_updates(kwargs, _state))
        if not updates:
            return
        _state = _validated(_merge(_state, updates))


def get_auto_parallel_context(key: str) -> Any:
    """The value of one option; dicts and lists are fresh copies."""
    with _LOCK:
        return _state.get(key)


def reset_auto_parallel_context() -> None:
    """Back to the defaults (options fixed by an enclosing `context_override` are kept)."""
    global _state
    with _LOCK:
        fresh = AutoParallelContext()
        if _pins:
            updates: dict[str, Any] = {}
            for name, pin in _pins.items():
                value = getattr(_state, name)
                if pin is True:
                    updates[name] = value
                else:
                    updates[name] = {k: getattr(value, k) for k in pin}
            fresh = _validated(_merge(fresh, updates))
        _state = fresh


def current_context() -> AutoParallelContext:
    """The current auto-parallel options, for the compiler. The object is immutable; later
    `set_auto_parallel_context` calls replace the global state and do not change it."""
    with _LOCK:
        return _state


# --------------------------------------------------------------------------------------------
# set_context
# --------------------------------------------------------------------------------------------

_GC = "set_context"

# Other MindSpore `set_context` keys: accepted and stored as given, without further checks.
_OTHER_CONTEXT_KEYS = frozenset(
    {
        "aoe_config",
        "aoe_tune_mode",
        "ascend_config",
        "auto_tune_mode",
        "check_bprop",
        "compile_cache_path",
        "debug_level",
        "deterministic",
        "device_id",
        "disable_format_transform",
        "enable_compile_cache",
        "enable_dump",
        "enable_graph_kernel",
        "enable_profiling",
        "enable_reduce_precision",
        "env_config_path",
        "gpu_config",
        "grad_for_scalar",
        "graph_kernel_flags",
        "inter_op_parallel_num",
        "jit_config",
        "jit_level",
        "jit_syntax_level",
        "max_call_depth",
        "memory_offload",
        "memory_optimize_level",
        "mempool_block_size",
        "op_timeout",
        "precompile_only",
        "print_file_path",
        "profiling_options",
        "pynative_synchronize",
        "reserve_class_name_in_scope",
        "runtime_num_threads",
        "save_dump_path",
        "support_binary",
        "variable_memory_max_size",
    }
)

_MEMORY_RE = re.compile(r"^\d+(\.\d+)?GB$")


def _check_mode(value: Any) -> Any:
    value = _unnumpy(value)
    if isinstance(value, bool):
        raise TypeError(
            f"{_GC}: invalid value {_describe(value)} for 'mode'; expected GRAPH_MODE (0) or "
            "PYNATIVE_MODE (1)"
        )
    if value in ("GRAPH_MODE", "graph_mode"):
        return GRAPH_MODE
    if value in ("PYNATIVE_MODE", "pynative_mode"):
        return PYNATIVE_MODE
    return value


def _check_save_graphs(value: Any) -> Any:
    value = _unnumpy(value)
    if value is True:
        return 2  # MindSpore: True means level 2
    if value is False:
        return 0
    return value


def _check_device_target(value: Any) -> Any:
    if isinstance(value, str):
        for target in ("CPU", "GPU", "Ascend"):
            if value.lower() == target.lower():
                return target
    return value


class GeneralContext(BaseModel):
    """Options of `set_context`. Other MindSpore keys are accepted and kept in `others`."""

    model_config = _FROZEN

    mode: Annotated[Literal[0, 1], BeforeValidator(_check_mode)] = GRAPH_MODE
    device_target: Annotated[
        Literal["CPU", "GPU", "Ascend"], BeforeValidator(_check_device_target)
    ] = "CPU"
    save_graphs: Annotated[Int, Field(ge=0, le=3), BeforeValidator(_check_save_graphs)] = 0
    save_graphs_path: Str = ""  # unset: the driver dumps to ./saved_graph
    max_device_memory: Str = "1024GB"
    others: tuple[tuple[str, Any], ...] = ()

    @field_validator("max_device_memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        if not _MEMORY_RE.match(value) or float(value[:-2]) <= 0:
            raise ValueError(
                f"invalid value {value!r} for 'max_device_memory'; expected a size in GB "
                'such as "28GB" or "3.5GB" (> 0)'
            )
        return value

    @property
    def max_device_memory_bytes(self) -> int:
        """max_device_memory in bytes."""
        return int(float(self.max_device_memory[:-2]) * 1024**3)

    def get(self, key: str) -> Any:
        if key in _GC_FIELDS:
            return getattr(self, key)
        if key in _OTHER_CONTEXT_KEYS:
            return dict(self.others).get(key)
        raise _unknown_name("get_context", key, sorted(_GC_FIELDS | _OTHER_CONTEXT_KEYS))


_GC_FIELDS = frozenset(GeneralContext.model_fields) - {"others"}
_GC_HINTS = {
    "mode": "GRAPH_MODE (0) or PYNATIVE_MODE (1)",
    "device_target": "one of 'CPU', 'GPU', 'Ascend'",
    "save_graphs": "a bool or an int in [0, 3]",
    "save_graphs_path": "a str (directory)",
    "max_device_memory": 'a str such as "28GB"',
}
_general = GeneralContext()


def set_context(**kwargs: Any) -> None:
    """Set general options (mode, device_target, save_graphs, save_graphs_path,
    max_device_memory and other MindSpore keys, stored as given). Atomic."""
    global _general
    with _LOCK:
        for name in kwargs:
            if name not in _GC_FIELDS and name not in _OTHER_CONTEXT_KEYS:
                raise _unknown_name(_GC, name, sorted(_GC_FIELDS | _OTHER_CONTEXT_KEYS))
        # only what was set so far: `model_fields_set` tells a chosen value from a default
        values = {name: getattr(_general, name) for name in _GC_FIELDS & _general.model_fields_set}
        others = dict(_general.others)
        for name, value in kwargs.items():
            if name in _GC_FIELDS:
                values[name] = value
            else:
                others[name] = value
        values["others"] = tuple(sorted(others.items()))
        try:
            _general = GeneralContext.model_validate(values)
        except ValidationError as exc:
            _raise_clear(exc, _GC, _GC_HINTS)


def get_context(key: str) -> Any:
    """The value of one `set_context` option (None for an unset MindSpore-only key)."""
    with _LOCK:
        return _general.get(key)


def reset_context() -> None:
    """Back to the defaults of `set_context`."""
    global _general
    with _LOCK:
        _general = GeneralContext()


def save_graphs_level(override: int | None = None) -> int:
    """The dump level in force: `override` (the command line), else `save_graphs` when the
    model file set it, else 2 (every pass)."""
    if override is not None:
        return int(override)
    with _LOCK:
        if "save_graphs" in _general.model_fields_set:
            return int(_general.save_graphs)
    return 2


def current_general_context() -> GeneralContext:
    """The current `set_context` options (immutable)."""
    with _LOCK:
        return _general


# --------------------------------------------------------------------------------------------
# Cost model and algorithm parameters (used by the strategy search)
# --------------------------------------------------------------------------------------------

_M = TypeVar("_M", bound=BaseModel)

PositiveFloat = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]


class CostModelContext(BaseModel):
    """Constants of the operator / redistribution cost model (reference §4.1).

    The search minimises ``alpha * computation + beta * communication_with_partial_para``
    where gradient communication is weighted by ``gamma``, under ``device_memory_capacity``.
    beta is 400 as on Ascend (MindSpore uses 50 on GPU)."""

    model_config = _FROZEN

    device_memory_capacity: PositiveFloat = float(16 * 1024**3)
    costmodel_alpha: PositiveFloat = 1.0
    costmodel_beta: PositiveFloat = 400.0
    costmodel_gamma: Annotated[Float, Field(ge=0, le=1)] = 0.001
    costmodel_communi_threshold: NonNegativeFloat = 2048.0
    costmodel_communi_const: NonNegativeFloat = 3072.0
    costmodel_communi_bias: NonNegativeFloat = 1024.0
    costmodel_simplify_cal: Bool = True
    triangle_star_strategy_overwrite: Bool = True
    dp_algo_enable_approxi: Bool = False
    dp_algo_approxi_epsilon: PositiveFloat = 0.1
    rp_matmul_mem_coef: PositiveFloat = 0.1


_CM_HINTS = {
    "device_memory_capacity": "a number > 0 (bytes)",
    "costmodel_alpha": "a number > 0",
    "costmodel_beta": "a number > 0",
    "costmodel_gamma": "a number in [0, 1]",
    "costmodel_communi_threshold": "a number >= 0 (bytes)",
    "costmodel_communi_const": "a number >= 0",
    "costmodel_communi_bias": "a number >= 0",
    "costmodel_simplify_cal": "a bool",
    "triangle_star_strategy_overwrite": "a bool",
    "dp_algo_enable_approxi": "a bool",
    "dp_algo_approxi_epsilon": "a number > 0",
    "rp_matmul_mem_coef": "a number > 0",
}


def _check_align_size(value: int) -> int:
    if 1 <= value <= 1024 and value & (value - 1) == 0:
        return value
    raise ValueError(
        f"invalid value {value!r} for 'tensor_slice_align_size'; expected a power of 2 in [1, 1024]"
    )


class AlgoParameters(BaseModel):
    """Parameters of the strategy-search algorithms (`set_algo_parameters`)."""

    model_config = _FROZEN

    # The seeds' (MindSpore r2.0) default; later MindSpore: False (docs/context-options.md).
    fully_use_devices: Bool = True
    elementwise_op_strategy_follow: Bool = False
    enable_algo_approxi: Bool = False
    algo_approxi_epsilon: PositiveFloat = 0.1
    tensor_slice_align_enable: Bool = False
    tensor_slice_align_size: Int = 16

    @field_validator("tensor_slice_align_size")
    @classmethod
    def _align(cls, value: int) -> int:
        return _check_align_size(value)


_ALGO_HINTS = {
    "fully_use_devices": "a bool",
    "elementwise_op_strategy_follow": "a bool",
    "enable_algo_approxi": "a bool",
    "algo_approxi_epsilon": "a number > 0",
    "tensor_slice_align_enable": "a bool",
    "tensor_slice_align_size": "a power of 2 in [1, 1024]",
}

_cost_model = CostModelContext()
_algo = AlgoParameters()


def _updated(model: _M, kwargs: dict[str, Any], where: str, hints: Mapping[str, str]) -> _M:
    fields = list(type(model).model_fields)
    for name in kwargs:
        if name not in fields:
            raise _unknown_name(where, name, fields)
    values = {name: getattr(model, name) for name in fields}
    values.update(kwargs)
    try:
        return type(model).model_validate(values)
    except ValidationError as exc:
        _raise_clear(exc, where, hints)
        raise  # unreachable


def _get(model: BaseModel, key: str, where: str) -> Any:
    if key not in type(model).model_fields:
        raise _unknown_name(where, key, list(type(model).model_fields))
    return getattr(model, key)


def set_cost_model_context(**kwargs: Any) -> None:
    """Set cost-model constants (reference §4.1). Atomic."""
    global _cost_model
    with _LOCK:
        _cost_model = _updated(_cost_model, kwargs, "set_cost_model_context", _CM_HINTS)


def get_cost_model_context(key: str) -> Any:
    """The value of one cost-model constant."""
    with _LOCK:
        return _get(_cost_model, key, "get_cost_model_context")


def reset_cost_model_context() -> None:
    """Back to the default cost-model constants."""
    global _cost_model
    with _LOCK:
        _cost_model = CostModelContext()


def current_cost_model_context() -> CostModelContext:
    """The current cost-model constants (immutable)."""
    with _LOCK:
        return _cost_model


def set_algo_parameters(**kwargs: Any) -> None:
    """Set strategy-search algorithm parameters. Atomic."""
    global _algo
    with _LOCK:
        _algo = _updated(_algo, kwargs, "set_algo_parameters", _ALGO_HINTS)


def get_algo_parameters(key: str) -> Any:
    """The value of one algorithm parameter."""
    with _LOCK:
        return _get(_algo, key, "get_algo_parameters")


def reset_algo_parameters() -> None:
    """Back to the default algorithm parameters."""
    global _algo
    with _LOCK:
        _algo = AlgoParameters()


def current_algo_parameters() -> AlgoParameters:
    """The current algorithm parameters (immutable)."""
    with _LOCK:
        return _algo


# --------------------------------------------------------------------------------------------
# Temporary overrides (command line)
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def context_override(**kwargs: Any) -> Iterator[AutoParallelContext]:
    """Apply auto-parallel options for the duration of a `with` block, then restore.

    Meant for the command line: the options given here are *fixed* inside the block, so a
    model file that calls `set_auto_parallel_context(...)` while being imported or traced
    cannot change them (its other options still apply). Arguments whose value is None are
    skipped (flags the user did not give). On exit every context (auto-parallel, set_context,
    cost model, algorithm parameters) is restored to what it was on entry, including what the
    model file set inside the block. Yields the context in force after the overrides.
    """
    global _state, _general, _cost_model, _algo, _pins
    given = {k: v for k, v in kwargs.items() if v is not None}
    with _LOCK:
        saved = (_state, _general, _cost_model, _algo, _pins)
        updates = _partial_updates(given, _state)
        pins = {k: (set(v) if v is not True else True) for k, v in _pins.items()}
        for name, value in updates.items():
            if name in _DICT_FIELDS and isinstance(value, dict):
                old = pins.get(name)
                if old is not True:
                    pins[name] = (old or set()) | set(value)
            else:
                pins[name] = True
        _state = _validated(_merge(_state, updates))
        _pins = pins
    try:
        yield _state
    finally:
        with _LOCK:
            _state, _general, _cost_model, _algo, _pins = saved
