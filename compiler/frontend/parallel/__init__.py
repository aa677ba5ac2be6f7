"""`pcompile.parallel` (MindSpore's `mindspore.parallel`): the strategy-search parameters and
`Layout`, and, as `pcompile.parallel._utils`, the readers of the parallel context that
MindSpore model code calls by their private names (`_get_parallel_mode()`,
`_is_sharding_propagation()`, `_get_device_num()`, `_get_pipeline_stages()`), so that a model
written for `from mindspore.parallel._utils import _get_parallel_mode` needs only its import
changed. They read the context the compile runs under (the model file's settings with the
command line's overrides), as MindSpore's read the context when a cell is built."""

from __future__ import annotations

from pcompile.compiler.config.context import get_auto_parallel_context
from pcompile.compiler.config.layout import Layout
from pcompile.compiler.config.search_context import (
    get_algo_parameters,
    reset_algo_parameters,
    set_algo_parameters,
)


def _get_parallel_mode() -> str:
    """The parallel mode (a `ParallelMode` string: "stand_alone", "semi_auto_parallel", ...)."""
    return str(get_auto_parallel_context("parallel_mode"))


def _is_sharding_propagation() -> bool:
    """Whether the strategy search is sharding propagation (meaningful under auto_parallel)."""
    return get_auto_parallel_context("search_mode") == "sharding_propagation"


def _get_device_num() -> int:
    return int(get_auto_parallel_context("device_num"))


def _get_pipeline_stages() -> int:
    return int(get_auto_parallel_context("pipeline_stages"))


__all__ = ["Layout", "get_algo_parameters", "reset_algo_parameters", "set_algo_parameters"]
