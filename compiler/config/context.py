"""User-facing configuration, MindSpore's `mindspore.context` (`pcompile.context`): the
auto-parallel options here, and the other families of options re-exported from their modules.

Each family of options is one frozen pydantic v2 model:

* `AutoParallelContext`  - `set_auto_parallel_context` / `get_auto_parallel_context` /
  `reset_auto_parallel_context`; the compiler reads it through `current_context()`. Its
  dict-valued options are in compiler/config/parallel_options.py.
* `GeneralContext`       - `set_context` / `get_context` (compiler/config/general_context.py).
* `CostModelContext`     - `set_cost_model_context` / `get_cost_model_context` /
  `reset_cost_model_context` (constants of the strategy-search cost model, reference §4.1;
  compiler/config/search_context.py).
* `AlgoParameters`       - `set_algo_parameters` / `get_algo_parameters` /
  `reset_algo_parameters` (compiler/config/search_context.py).

`context_override` (the command line) fixes auto-parallel options for a `with` block and
restores every family on exit.

Setting is atomic: the new state is validated as a whole and swapped in only when every
argument is valid. Errors are plain Python exceptions, never `pydantic.ValidationError`
(compiler/config/context_checks.py): an unknown option name is a `ValueError` that suggests the
closest name; a value of the wrong type is a `TypeError`, a value out of range a `ValueError`,
and both name the option, the value and what would be valid. Unknown keys inside dict options
raise `ContextKeyError` (a `KeyError` that is also a `ValueError`). `comm_fusion` raises
exactly the `TypeError` / `KeyError` of the reference (§6.1).

All stored values are immutable (tuples, frozen models), so `current_context()` can hand out
the live object; getters return fresh lists and dicts in MindSpore's spelling.

See docs/context-options.md for every option, its default, and which pass uses it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    model_validator,
)

from pcompile.compiler.config.context_checks import (
    CONTEXT_LOCK,
    FROZEN,
    Bool,
    ContextKeyError,
    Int,
    Str,
    check_dict_keys,
    describe,
    raise_clear,
    unknown_name,
    unnumpy,
)
from pcompile.compiler.config.general_context import (
    GRAPH_MODE,
    PYNATIVE_MODE,
    GeneralContext,
    current_general_context,
    get_context,
    reset_context,
    restore_general_context,
    save_graphs_level,
    set_context,
)
from pcompile.compiler.config.layout import LayoutSpec
from pcompile.compiler.config.parallel_options import (
    FUSION_OPS,
    PIPELINE_SCHEDULERS,
    CommFusionConfig,
    FusionOpConfig,
    ParallelOptimizerConfig,
    PipelineConfig,
    StrategyCkptConfig,
    check_comm_fusion,
    check_split_indices,
)
from pcompile.compiler.config.search_context import (
    AlgoParameters,
    CostModelContext,
    current_algo_parameters,
    current_cost_model_context,
    get_algo_parameters,
    get_cost_model_context,
    reset_algo_parameters,
    reset_cost_model_context,
    restore_algo_parameters,
    restore_cost_model_context,
    set_algo_parameters,
    set_cost_model_context,
)

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
    "reset_context",
    "reset_cost_model_context",
    "save_graphs_level",
    "set_algo_parameters",
    "set_auto_parallel_context",
    "set_context",
    "set_cost_model_context",
]

_log = logging.getLogger(__name__)
_AP = "set_auto_parallel_context"  # the setter that error messages name


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


# --------------------------------------------------------------------------------------------
# set_auto_parallel_context
# --------------------------------------------------------------------------------------------

SEARCH_MODES = ("recursive_programming", "sharding_propagation", "dynamic_programming", "ilp")


def _check_dataset_strategy(value: Any) -> Any:
    value = unnumpy(value)
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
            f"per-input strategies or a tuple of Layout(...) results, got {describe(value)}"
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
                f"result, got {describe(entry)}"
            )
        dims = []
        for dim in entry:
            dim = unnumpy(dim)
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(
                    f"{_AP}: 'dataset_strategy'[{i}] must contain only ints, got "
                    f"{describe(dim)} in {entry!r}"
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

#: `communi_parallel_mode`'s values (MindSpore's; how communication groups run in parallel on
#: Ascend, which pcompile's backends do not distinguish).
COMMUNI_PARALLEL_MODES = ("all_group_parallel", "same_server_group_parallel",
                          "no_group_parallel")


def _check_communi_mode(value: str) -> str:
    if value not in COMMUNI_PARALLEL_MODES:
        raise ValueError(
            f"{_AP}: invalid value {value!r} for 'communi_parallel_mode'; expected one of "
            + ", ".join(repr(m) for m in COMMUNI_PARALLEL_MODES))
    return value


CommuniParallelMode = Annotated[Str, AfterValidator(_check_communi_mode)]
SplitIndices = Annotated[
    tuple[int, ...],
    BeforeValidator(lambda v: check_split_indices("all_reduce_fusion_config", v)),
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
    "communi_parallel_mode": "one of " + ", ".join(repr(m) for m in COMMUNI_PARALLEL_MODES),
    "optimizer_weight_shard_aggregated_save": "a bool",
}


class AutoParallelContext(BaseModel):
    """Every option of `set_auto_parallel_context`, validated; immutable.

    Canonical fields only; the MindSpore spellings that are views of another field are
    accepted as input and readable as properties: `full_batch` (<=> dataset_strategy
    "full_batch"), `strategy_ckpt_load_file` / `strategy_ckpt_save_file` (<=>
    strategy_ckpt_config.load_file / .save_file), `optimizer_weight_shard_size` (<=>
    parallel_optimizer_config.optimizer_weight_shard_size, MindSpore's older top-level
    spelling) and `auto_parallel_search_mode` (deprecated name of search_mode)."""

    model_config = FROZEN

    device_num: Annotated[Int, Field(ge=1, le=4096)] = 1
    global_rank: Annotated[Int, Field(ge=0, le=4095)] = 0
    gradients_mean: Bool = False
    gradient_fp32_sync: Bool = True
    loss_repeated_mean: Bool = True
    parallel_mode: Literal[
        "stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel", "auto_parallel"
    ] = "stand_alone"
    search_mode: Literal["recursive_programming", "sharding_propagation", "dynamic_programming",
                         "ilp"] = (
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
    communi_parallel_mode: CommuniParallelMode = "all_group_parallel"
    # False (MindSpore's default): the strategy checkpoint records each parameter's optimizer
    # shard group (opt_weight_shard_size / _step); True: 0 for both (saved whole)
    optimizer_weight_shard_aggregated_save: Bool = False

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

    @property
    def optimizer_weight_shard_size(self) -> int:
        return self.parallel_optimizer_config.optimizer_weight_shard_size

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
            raise unknown_name("get_auto_parallel_context", key, sorted(_AP_GETTABLE))
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
    "optimizer_weight_shard_size",
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
        full = unnumpy(data.pop("full_batch"))
        if not isinstance(full, bool):
            raise TypeError(
                f"{_AP}: invalid value {describe(full)} for 'full_batch'; expected a bool"
            )
        if "dataset_strategy" in data:
            given = unnumpy(data["dataset_strategy"])
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
    if "optimizer_weight_shard_size" in data:
        _fold_shard_size(data, data.pop("optimizer_weight_shard_size"))
    for view, key in (
        ("strategy_ckpt_load_file", "load_file"),
        ("strategy_ckpt_save_file", "save_file"),
    ):
        if view not in data:
            continue
        path = data.pop(view)
        if not isinstance(path, str):
            raise TypeError(
                f"{_AP}: invalid value {describe(path)} for '{view}'; expected a str (file path)"
            )
        ckpt = data.get("strategy_ckpt_config")
        if isinstance(ckpt, StrategyCkptConfig):
            ckpt = ckpt.model_dump()
        ckpt = (
            {}
            if ckpt is None
            else check_dict_keys(
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


def _fold_shard_size(data: dict[str, Any], size: Any) -> None:
    """The top-level `optimizer_weight_shard_size` (MindSpore's older spelling of
    parallel_optimizer_config's key): an int; MindSpore warns about a value <= 1 and keeps the
    current one."""
    size = unnumpy(size)
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(
            f"{_AP}: invalid value {describe(size)} for 'optimizer_weight_shard_size'; expected "
            "an int > 1 (the parallel optimizer's shard group size)")
    if size <= 1:
        warnings.warn(
            f"{_AP}: optimizer_weight_shard_size={size} is ignored (MindSpore keeps the current "
            "value); use an int > 1", UserWarning, stacklevel=5)
        return
    config = data.get("parallel_optimizer_config")
    if isinstance(config, BaseModel):
        config = config.model_dump()
    config = ({} if config is None else check_dict_keys(
        _AP, "parallel_optimizer_config", config, tuple(ParallelOptimizerConfig.model_fields)))
    given = config.get("optimizer_weight_shard_size")
    if given is not None and given != size:
        raise ValueError(
            f"{_AP}: optimizer_weight_shard_size={size!r} and parallel_optimizer_config"
            f"['optimizer_weight_shard_size']={given!r} disagree; give only one")
    config["optimizer_weight_shard_size"] = size
    data["parallel_optimizer_config"] = config


def _partial_updates(kwargs: dict[str, Any], current: AutoParallelContext) -> dict[str, Any]:
    """Canonical updates for `kwargs`; dict options stay partial (only the keys given)."""
    for name in kwargs:
        if name not in _AP_GETTABLE:
            raise unknown_name(_AP, name, sorted(_AP_GETTABLE))
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
            data[name] = check_dict_keys(_AP, name, data[name], tuple(model.model_fields))
    if "comm_fusion" in data:
        fusion = check_comm_fusion(data["comm_fusion"])
        allreduce = fusion.get("allreduce")
        if allreduce is not None and allreduce["mode"] == "index":
            # MindSpore applies an index config through the all_reduce_fusion_config setter.
            indices = allreduce["config"]
            if "all_reduce_fusion_config" in data:
                given = check_split_indices(
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
            for op in FUSION_OPS:
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
        raise_clear(exc, _AP, _AP_HINTS)
        raise  # unreachable


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set auto-parallel options (MindSpore's names and semantics; see docs/context-options.md).

    Atomic: if any argument is invalid, nothing changes. Dict options (comm_fusion,
    parallel_optimizer_config, strategy_ckpt_config, pipeline_config) update only the keys
    given. Options fixed by an enclosing `context_override` keep their value.
    """
    global _state
    with CONTEXT_LOCK:
        updates = _drop_pinned(_partial_updates(kwargs, _state))
        if not updates:
            return
        _state = _validated(_merge(_state, updates))


def get_auto_parallel_context(key: str) -> Any:
    """The value of one option; dicts and lists are fresh copies."""
    with CONTEXT_LOCK:
        return _state.get(key)


def reset_auto_parallel_context() -> None:
    """Back to the defaults (options fixed by an enclosing `context_override` are kept)."""
    global _state
    with CONTEXT_LOCK:
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
    with CONTEXT_LOCK:
        return _state


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
    global _state, _pins
    given = {k: v for k, v in kwargs.items() if v is not None}
    with CONTEXT_LOCK:
        saved = (_state, _pins)
        others = (current_general_context(), current_cost_model_context(),
                  current_algo_parameters())
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
        with CONTEXT_LOCK:
            _state, _pins = saved
            general, cost_model, algo = others
            restore_general_context(general)
            restore_cost_model_context(cost_model)
            restore_algo_parameters(algo)
