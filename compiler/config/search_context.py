"""`set_cost_model_context` and `set_algo_parameters`: the constants of the strategy-search
cost model (reference §4.1) and the parameters of the search algorithms, one frozen pydantic
model each (`CostModelContext`, `AlgoParameters`), with MindSpore's names, defaults and
errors. Setting is atomic. The driver hands them to the search as typed options
(compiler/config/pass_options.py). See docs/context-options.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, Field, ValidationError, field_validator

from pcompile.compiler.config.context_checks import (
    CONTEXT_LOCK,
    FROZEN,
    Bool,
    Float,
    Int,
    raise_clear,
    unknown_name,
)

_M = TypeVar("_M", bound=BaseModel)

PositiveFloat = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]


class CostModelContext(BaseModel):
    """Constants of the operator / redistribution cost model (reference §4.1).

    The search minimises ``alpha * computation + beta * communication_with_partial_para``
    where gradient communication is weighted by ``gamma``, under ``device_memory_capacity``.
    beta is 400 as on Ascend (MindSpore uses 50 on GPU)."""

    model_config = FROZEN

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
    # pcompile's: the device the ilp search's cost model (seconds) describes, a built-in
    # profile (h100, h200, cpu) or a JSON file (docs/search.md)
    device_profile: str = "h100"

    @field_validator("device_profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        from pcompile.passes.search.time_model import load_profile

        load_profile(value)  # ProfileError (a ValueError) names what is wrong
        return value


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
    "device_profile": "h100, h200, cpu or the path of a device profile JSON file",
}


def _check_align_size(value: int) -> int:
    if 1 <= value <= 1024 and value & (value - 1) == 0:
        return value
    raise ValueError(
        f"invalid value {value!r} for 'tensor_slice_align_size'; expected a power of 2 in [1, 1024]"
    )


class AlgoParameters(BaseModel):
    """Parameters of the strategy-search algorithms (`set_algo_parameters`)."""

    model_config = FROZEN

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
            raise unknown_name(where, name, fields)
    # only the fields set so far and the new ones count as set (`model_fields_set`: the ilp
    # search takes the profile's memory unless device_memory_capacity was set)
    values = {name: getattr(model, name) for name in model.model_fields_set}
    values.update(kwargs)
    try:
        return type(model).model_validate(values)
    except ValidationError as exc:
        raise_clear(exc, where, hints)
        raise  # unreachable


def _get(model: BaseModel, key: str, where: str) -> Any:
    if key not in type(model).model_fields:
        raise unknown_name(where, key, list(type(model).model_fields))
    return getattr(model, key)


def set_cost_model_context(**kwargs: Any) -> None:
    """Set cost-model constants (reference §4.1). Atomic."""
    global _cost_model
    with CONTEXT_LOCK:
        _cost_model = _updated(_cost_model, kwargs, "set_cost_model_context", _CM_HINTS)


@contextlib.contextmanager
def cost_model_override(**kwargs: Any) -> Iterator[None]:
    """`set_cost_model_context(**kwargs)` for the duration (the command line's
    --device-profile / --device-memory for one compile), then the constants as they were."""
    global _cost_model
    with CONTEXT_LOCK:
        saved = _cost_model
    set_cost_model_context(**kwargs)
    try:
        yield
    finally:
        with CONTEXT_LOCK:
            _cost_model = saved


def get_cost_model_context(key: str) -> Any:
    """The value of one cost-model constant."""
    with CONTEXT_LOCK:
        return _get(_cost_model, key, "get_cost_model_context")


def reset_cost_model_context() -> None:
    """Back to the default cost-model constants."""
    global _cost_model
    with CONTEXT_LOCK:
        _cost_model = CostModelContext()


def current_cost_model_context() -> CostModelContext:
    """The current cost-model constants (immutable)."""
    with CONTEXT_LOCK:
        return _cost_model


def set_algo_parameters(**kwargs: Any) -> None:
    """Set strategy-search algorithm parameters. Atomic."""
    global _algo
    with CONTEXT_LOCK:
        _algo = _updated(_algo, kwargs, "set_algo_parameters", _ALGO_HINTS)


def get_algo_parameters(key: str) -> Any:
    """The value of one algorithm parameter."""
    with CONTEXT_LOCK:
        return _get(_algo, key, "get_algo_parameters")


def reset_algo_parameters() -> None:
    """Back to the default algorithm parameters."""
    global _algo
    with CONTEXT_LOCK:
        _algo = AlgoParameters()


def current_algo_parameters() -> AlgoParameters:
    """The current algorithm parameters (immutable)."""
    with CONTEXT_LOCK:
        return _algo


def restore_cost_model_context(saved: CostModelContext) -> None:
    """Put back constants saved from `current_cost_model_context()` (`context_override`'s
    exit)."""
    global _cost_model
    with CONTEXT_LOCK:
        _cost_model = saved


def restore_algo_parameters(saved: AlgoParameters) -> None:
    """Put back parameters saved from `current_algo_parameters()` (`context_override`'s
    exit)."""
    global _algo
    with CONTEXT_LOCK:
        _algo = saved
