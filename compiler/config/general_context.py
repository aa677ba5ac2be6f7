"""`set_context` / `get_context` / `reset_context`: the general options (mode,
device_target, save_graphs, save_graphs_path, max_device_memory; other MindSpore keys are
accepted and stored as given), one frozen pydantic model, `GeneralContext`, with MindSpore's
names, defaults and errors. Setting is atomic. See docs/context-options.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, field_validator

from pcompile.compiler.config.context_checks import (
    CONTEXT_LOCK,
    FROZEN,
    Int,
    Str,
    describe,
    raise_clear,
    unknown_name,
    unnumpy,
)

GRAPH_MODE: Final = 0
"""`set_context(mode=GRAPH_MODE)`: whole-graph compilation (the only mode this compiler has)."""
PYNATIVE_MODE: Final = 1
"""`set_context(mode=PYNATIVE_MODE)`: accepted and stored; compilation is the same."""

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
    value = unnumpy(value)
    if isinstance(value, bool):
        raise TypeError(
            f"{_GC}: invalid value {describe(value)} for 'mode'; expected GRAPH_MODE (0) or "
            "PYNATIVE_MODE (1)"
        )
    if value in ("GRAPH_MODE", "graph_mode"):
        return GRAPH_MODE
    if value in ("PYNATIVE_MODE", "pynative_mode"):
        return PYNATIVE_MODE
    return value


def _check_save_graphs(value: Any) -> Any:
    value = unnumpy(value)
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

    model_config = FROZEN

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
        raise unknown_name("get_context", key, sorted(_GC_FIELDS | _OTHER_CONTEXT_KEYS))


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
    with CONTEXT_LOCK:
        for name in kwargs:
            if name not in _GC_FIELDS and name not in _OTHER_CONTEXT_KEYS:
                raise unknown_name(_GC, name, sorted(_GC_FIELDS | _OTHER_CONTEXT_KEYS))
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
            raise_clear(exc, _GC, _GC_HINTS)


def get_context(key: str) -> Any:
    """The value of one `set_context` option (None for an unset MindSpore-only key)."""
    with CONTEXT_LOCK:
        return _general.get(key)


def reset_context() -> None:
    """Back to the defaults of `set_context`."""
    global _general
    with CONTEXT_LOCK:
        _general = GeneralContext()


def save_graphs_level(override: int | None = None) -> int:
    """The dump level in force: `override` (the command line), else `save_graphs` when the
    model file set it, else 2 (every pass)."""
    if override is not None:
        return int(override)
    with CONTEXT_LOCK:
        if "save_graphs" in _general.model_fields_set:
            return int(_general.save_graphs)
    return 2


def current_general_context() -> GeneralContext:
    """The current `set_context` options (immutable)."""
    with CONTEXT_LOCK:
        return _general


def restore_general_context(saved: GeneralContext) -> None:
    """Put back options saved from `current_general_context()` (`context_override`'s exit)."""
    global _general
    with CONTEXT_LOCK:
        _general = saved
