"""The strategy checkpoint files of `strategy_ckpt_config`, read by the driver before the passes
and written after the compile by `pcompile.tools.compile.compile` (the passes do no file I/O):
`read_checkpoint` gives the search the loaded file's contents, `save_checkpoint` writes the
compile's strategies and parameter layouts (the format and fields:
passes/search/strategy_checkpoint.py).

MindSpore writes the save file in the modes whose compile assigns strategies,
semi_auto_parallel and auto_parallel (its step_parallel); in stand_alone, data_parallel and
hybrid_parallel no file is written. The file is replaced atomically; a folder on its path is
made as MindSpore's `set_auto_parallel_context` makes it.
"""

from __future__ import annotations

import os
from typing import Any

from pcompile.compiler.driver.outdir import write_file_atomic
from pcompile.ir.core import Node
from pcompile.ir.errors import PcompileError
from pcompile.passes.search.strategy_checkpoint import checkpoint_data, decode, encode
from pcompile.passes.unit import CompileUnit

#: The parallel modes in which a strategy checkpoint is saved (MindSpore's step_parallel).
SAVING_MODES = ("semi_auto_parallel", "auto_parallel")


def read_checkpoint(path: str) -> dict[str, Any]:
    """The contents of strategy checkpoint `path` (JSON for a `.json` name, else MindSpore's
    protobuf); one PcompileError when it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise PcompileError(
            f"strategy_ckpt_config load_file {path!r} cannot be read: {exc.strerror or exc}"
        ) from None
    return decode(path, raw)


def opt_shard_fields(unit: CompileUnit) -> dict[str, tuple[int, int]]:
    """Parameter name -> (opt_weight_shard_size, opt_weight_shard_step) of every parameter the
    parallel optimizer stores split: the configured shard size (-1: the whole group of ranks
    holding the same slice) and the rank stride inside its shard group, as MindSpore records
    them unless `optimizer_weight_shard_aggregated_save`."""
    if unit.options.strategy_files.aggregated_save:
        return {}
    size = unit.options.optimizer_shard.shard_size
    out: dict[str, tuple[int, int]] = {}
    for name, shard in unit.opt_shard.items():
        group = shard.shard_group(0)
        if len(group) < 2:
            continue
        step = (group[-1] - group[0]) // (len(group) - 1)
        out[name] = (size if size > 1 else -1, step)
    return out


def _node_stages(unit: CompileUnit) -> dict[Node, int]:
    """Forward node -> the pipeline stage each forward op runs in (its virtual stage modulo the
    stages, as MindSpore's strategy items record it); empty without pipeline stages."""
    settings = unit.pipeline
    if settings is None or settings.stage_map is None:
        return {}
    stages = settings.stage_map.stages
    return {node: virtual % stages for node, virtual in settings.stage_map.node_stage.items()}


def save_checkpoint(unit: CompileUnit) -> str | None:
    """Write the strategy checkpoint `strategy_ckpt_config.save_file` asks for, if any, in a
    mode that saves one; returns its path (None when nothing was written)."""
    files = unit.options.strategy_files
    if not files.save_file or unit.parallel_mode not in SAVING_MODES:
        return None
    if unit.graph is None or unit.assignment is None:
        return None
    loaded = files.loaded or {}
    stage = int(loaded.get("current_stage", 0)) + 1
    data = checkpoint_data(unit.graph, unit.assignment,
                           only_trainable=files.only_trainable_params,
                           opt_shards=opt_shard_fields(unit),
                           model_layouts={name: shard.model or shard.use
                                          for name, shard in unit.opt_shard.items()},
                           current_stage=stage, node_stages=_node_stages(unit))
    path = files.save_file
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        write_file_atomic(path, encode(path, data))
    except OSError as exc:
        raise PcompileError(
            f"strategy_ckpt_config save_file {path!r} cannot be written: "
            f"{exc.strerror or exc}") from None
    return path
