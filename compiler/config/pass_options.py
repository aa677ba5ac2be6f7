"""Typed options for the passes, built by the front end from MindSpore's global contexts.

The passes (passes/) never read `compiler.context` or the environment: the driver builds their
options here when it assembles a compile and hands them over (`CommFusionPass(fusion_config())`,
`StepAutoParallelPass(AutoParallelOptions(search_options(), cost_constants()))`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pcompile.compiler.config.context import AutoParallelContext, current_context
from pcompile.compiler.config.search_context import (
    current_algo_parameters,
    current_cost_model_context,
)
from pcompile.passes.comm_fusion import FUSIBLE_OPS, FusionConfig, KindConfig
from pcompile.passes.search import SearchOptions
from pcompile.passes.search.cost_model import CostConstants


def fusion_config(ctx: AutoParallelContext | None = None) -> FusionConfig:
    """`comm_fusion` and `all_reduce_fusion_config` of the auto-parallel context (the current
    one by default). A non-empty split-index list (comm_fusion allreduce "index", or the old
    all_reduce_fusion_config) puts AllReduce in index mode."""
    if ctx is None:
        ctx = current_context()
    kinds: dict[str, KindConfig] = {}
    for op, key in FUSIBLE_OPS.items():
        if not ctx.fusion_enabled(key):
            continue
        entry = getattr(ctx.comm_fusion, key)
        if op == "AllReduce":
            indices = ctx.allreduce_split_indices()
            if entry.mode == "index" or indices:
                kinds[op] = KindConfig("index", None, tuple(indices))
                continue
        kinds[op] = KindConfig(entry.mode, ctx.fusion_threshold_mb(key))
    return FusionConfig(bool(ctx.comm_fusion.openstate), kinds, int(ctx.device_num))


def fusion_config_from_dict(comm_fusion: dict[str, Any] | None = None,
                            all_reduce_fusion_config: Sequence[int] = (),
                            world_size: int | None = None) -> FusionConfig:
    """A config from a `comm_fusion` dict in MindSpore's spelling (validated by the context
    model, so errors are the reference's TypeError / KeyError)."""
    values: dict[str, Any] = {"all_reduce_fusion_config": list(all_reduce_fusion_config)}
    if comm_fusion is not None:
        values["comm_fusion"] = comm_fusion
    if world_size is not None:
        values["device_num"] = world_size
    config = fusion_config(AutoParallelContext.model_validate(values))
    return replace(config, world_size=world_size)


def search_options() -> SearchOptions:
    """The search's options from `set_algo_parameters`, `set_cost_model_context` and
    MindSpore's `MS_INTERFERED_SAPP` environment variable."""
    algo = current_algo_parameters()
    cm = current_cost_model_context()
    approx = bool(algo.enable_algo_approxi or cm.dp_algo_enable_approxi)
    eps = float(algo.algo_approxi_epsilon if algo.enable_algo_approxi
                else cm.dp_algo_approxi_epsilon)
    return SearchOptions(
        fully_use_devices=bool(algo.fully_use_devices),
        interfered_sapp=os.environ.get("MS_INTERFERED_SAPP", "0") == "1",
        approximate=approx,
        epsilon=eps,
        device_profile=str(cm.device_profile),
        device_memory=(float(cm.device_memory_capacity)
                       if "device_memory_capacity" in cm.model_fields_set else None),
    )


def cost_constants(training: bool = True, enable_alltoall: bool = False) -> CostConstants:
    """The cost model's constants from `set_cost_model_context`."""
    cm = current_cost_model_context()
    return CostConstants(
        alpha=float(cm.costmodel_alpha),
        beta=float(cm.costmodel_beta),
        gamma=float(cm.costmodel_gamma),
        communi_threshold=float(cm.costmodel_communi_threshold),
        communi_const=float(cm.costmodel_communi_const),
        communi_bias=float(cm.costmodel_communi_bias),
        memory_capacity=float(cm.device_memory_capacity),
        training=training,
        enable_alltoall=enable_alltoall,
        rp_matmul_mem_coef=float(cm.rp_matmul_mem_coef),
    )


__all__ = ["cost_constants", "fusion_config", "fusion_config_from_dict", "search_options"]
