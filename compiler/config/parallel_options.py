"""The dict-valued options of `set_auto_parallel_context`: `strategy_ckpt_config`,
`parallel_optimizer_config`, `pipeline_config` and `comm_fusion` (with the exact
`TypeError` / `KeyError` of reference §6.1), one frozen pydantic model each; and the gradient
split indices of `all_reduce_fusion_config`. compiler/config/context.py holds them in
`AutoParallelContext`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from pcompile.compiler.config.context_checks import (
    FROZEN,
    Bool,
    Int,
    Str,
    check_dict_keys,
    describe,
    unnumpy,
)

_AP = "set_auto_parallel_context"  # the setter that error messages name


class StrategyCkptConfig(BaseModel):
    """`strategy_ckpt_config`: where to load/save per-op strategies and parameter layouts."""

    model_config = FROZEN

    load_file: Str = ""
    save_file: Str = ""
    only_trainable_params: Bool = True

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        return check_dict_keys(_AP, "strategy_ckpt_config", data, tuple(cls.model_fields))


class ParallelOptimizerConfig(BaseModel):
    """`parallel_optimizer_config`: details of the ZeRO-like optimizer sharding."""

    model_config = FROZEN

    gradient_accumulation_shard: Bool = False
    parallel_optimizer_threshold: Annotated[Int, Field(ge=0)] = 64
    optimizer_weight_shard_size: Int = -1
    optimizer_level: Literal["level1", "level2", "level3"] = "level1"

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        return check_dict_keys(_AP, "parallel_optimizer_config", data, tuple(cls.model_fields))

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

    model_config = FROZEN

    pipeline_interleave: Bool = False
    pipeline_scheduler: Literal["1f1b", "gpipe", "seqpipe", "seqvpp", "seqsmartvpp"] = "1f1b"

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        return check_dict_keys(_AP, "pipeline_config", data, tuple(cls.model_fields))


FUSION_THRESHOLD_AUTO_MB = 64
"""Bucket size of comm_fusion mode "auto" (reference §6.1)."""

FUSION_OPS = ("allreduce", "allgather", "reducescatter")
_FUSION_KEYS = ("openstate",) + FUSION_OPS
_FUSION_MODES = {
    "allreduce": ("auto", "size", "index"),
    "allgather": ("auto", "size"),
    "reducescatter": ("auto", "size"),
}


def check_split_indices(option: str, value: Any) -> tuple[int, ...]:
    """all_reduce_fusion_config / comm_fusion index config: strictly increasing ints > 0."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{_AP}: '{option}' must be a list of ints such as [20, 35], got {describe(value)}"
        )
    out = []
    for index in value:
        index = unnumpy(index)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(
                f"{_AP}: '{option}' must contain only ints, got {describe(index)} in {value!r}"
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
            f"{{'mode': 'auto', 'config': None}}, got {describe(value)}"
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
                f"got {describe(config)}"
            )
        return {"mode": mode, "config": None}
    if mode == "size":
        config = unnumpy(config)
        if isinstance(config, bool) or not isinstance(config, int):
            raise TypeError(
                f"For 'comm_fusion', the config of '{op}' in mode 'size' must be an int "
                f"(MB), got {describe(config)}"
            )
        if config <= 0:
            raise ValueError(
                f"For 'comm_fusion', the config of '{op}' in mode 'size' must be > 0 (MB), "
                f"got {config!r}"
            )
        return {"mode": mode, "config": config}
    return {"mode": mode, "config": check_split_indices(f"comm_fusion.{op}.config", config)}


def check_comm_fusion(value: Any) -> dict[str, Any]:
    """Validate a `comm_fusion` dict as MindSpore does; return the normalised partial dict.

    Raises TypeError for wrong types (non-dict, config "30.12", openstate "True") and KeyError
    for unknown / missing keys and unknown modes."""
    if not isinstance(value, Mapping):
        raise TypeError(
            "For 'comm_fusion', the value must be a dict with keys among "
            f"{list(_FUSION_KEYS)}, got {describe(value)}"
        )
    out: dict[str, Any] = {}
    for key, entry in value.items():
        if key not in _FUSION_KEYS:
            raise KeyError(
                f"For 'comm_fusion', unknown key {key!r}; valid keys: {list(_FUSION_KEYS)}"
            )
        if key == "openstate":
            entry = unnumpy(entry)
            if not isinstance(entry, bool):
                raise TypeError(
                    f"For 'comm_fusion', 'openstate' must be a bool, got {describe(entry)}"
                )
            out[key] = entry
        else:
            out[key] = _check_fusion_op(key, entry)
    return out


class FusionOpConfig(BaseModel):
    """One communication kind of comm_fusion: `mode` and its `config`."""

    model_config = FROZEN

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

    model_config = FROZEN

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
        for op in FUSION_OPS:
            entry = getattr(self, op)
            if entry is not None:
                out[op] = entry.as_dict()
        return out

    def displayed(self) -> dict[str, Any]:
        """The dict `get_auto_parallel_context("comm_fusion")` returns: as MindSpore, all four
        keys, a kind never set showing its default `{"mode": "auto", "config": None}` (its
        fusion stays off until it is set, as MindSpore's enable flags)."""
        out = self.as_dict()
        for op in FUSION_OPS:
            out.setdefault(op, {"mode": "auto", "config": None})
        return {key: out[key] for key in ("openstate", *FUSION_OPS)}
