"""The user-facing façade, re-exported by `pcompile`: `from pcompile import nn, ops, ...`.

Model files import only from `pcompile` (and `pcompile.communication`, `pcompile.dataset`);
internal module paths may change, this list does not.

Every name is loaded on first use (`__getattr__` below): `import pcompile.compiler.driver.runtime`
(a rank program's data) imports what that module needs, not the whole front end, its pydantic
models and the op tables; `pcompile --version` loads none of it.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

GRAPH_MODE = 0
PYNATIVE_MODE = 1

_SUBMODULES = ("amp", "communication", "mint", "nn", "ops")

# name -> the module that defines it
_NAMES = {
    "ParallelMode": "config.context",
    "get_auto_parallel_context": "config.context",
    "reset_auto_parallel_context": "config.context",
    "set_auto_parallel_context": "config.context",
    "get_context": "config.general_context",
    "set_context": "config.general_context",
    "ParameterTuple": "frontend.grad",
    "initializer": "frontend.initializer",
    "set_seed": "frontend.initializer",
    "Layout": "config.layout",
    "get_algo_parameters": "config.search_context",
    "get_cost_model_context": "config.search_context",
    "reset_algo_parameters": "config.search_context",
    "reset_cost_model_context": "config.search_context",
    "set_algo_parameters": "config.search_context",
    "set_cost_model_context": "config.search_context",
    "load_checkpoint": "frontend.serialization",
    "load_param_into_net": "frontend.serialization",
    "save_checkpoint": "frontend.serialization",
    "Callback": "frontend.callbacks",
    "LossMonitor": "frontend.callbacks",
    "TimeMonitor": "frontend.callbacks",
    "CheckpointConfig": "frontend.callbacks",
    "ModelCheckpoint": "frontend.callbacks",
    "Parameter": "frontend.tensor",
    "Tensor": "frontend.tensor",
    "TensorSpec": "frontend.tensor",
    "Model": "frontend.train_model",
    "bfloat16": "pcompile.ir.types",
    "bool_": "pcompile.ir.types",
    "float16": "pcompile.ir.types",
    "float32": "pcompile.ir.types",
    "int32": "pcompile.ir.types",
    "int64": "pcompile.ir.types",
    "uint8": "pcompile.ir.types",
}


class _Facade(types.ModuleType):
    """This package's module type. Importing a submodule binds its name on its package; a
    module named like a façade name (compiler/frontend/initializer.py, under compiler/ before
    issue 37 move 5) never replaces it here: the façade's `initializer` is the function
    (MindSpore's `initializer(init, shape, dtype)`), whichever loads first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"pcompile.compiler.frontend.{name}")
    elif name in _NAMES:
        where = _NAMES[name]
        module = importlib.import_module(where if where.startswith("pcompile.")
                                         else f"pcompile.compiler.{where}")
        value = getattr(module, name)
    else:
        raise AttributeError(f"module 'pcompile.compiler' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device="Ascend", level=0):
    """Functional shard (seed functional-operator-sharding.md): returns a function that calls
    `fn` (a function or a Cell) with its inputs constrained to `in_strategy` (None entries are
    derived by the search) and, for a Cell, its parameters to `parameter_plan`. Valid only with
    auto_parallel and sharding_propagation."""
    from pcompile.compiler.frontend.functional_shard import call_sharded
    from pcompile.compiler.frontend.nn.cell import Cell
    from pcompile.compiler.frontend.primitive import normalize_strategy

    config = {
        "in_strategy": normalize_strategy(in_strategy, "in_strategy"),
        "out_strategy": None if out_strategy is None else normalize_strategy(
            out_strategy, "out_strategy"
        ),
        "parameter_plan": dict(parameter_plan or {}),
    }
    cell = fn if isinstance(fn, Cell) else None

    def sharded(*args):
        return call_sharded(fn, config, args, cell=cell)

    sharded._pcompile_sharded_fn = True  # type: ignore[attr-defined]
    sharded.shard_config = config  # type: ignore[attr-defined]
    return sharded


__all__ = [
    "Model",
    "nn",
    "ops",
    "mint",
    "communication",
    "amp",
    "Parameter",
    "ParameterTuple",
    "Tensor",
    "TensorSpec",
    "Layout",
    "load_checkpoint",
    "load_param_into_net",
    "save_checkpoint",
    "Callback",
    "LossMonitor",
    "TimeMonitor",
    "CheckpointConfig",
    "ModelCheckpoint",
    "initializer",
    "set_seed",
    "set_auto_parallel_context",
    "get_auto_parallel_context",
    "reset_auto_parallel_context",
    "set_context",
    "get_context",
    "set_cost_model_context",
    "get_cost_model_context",
    "reset_cost_model_context",
    "set_algo_parameters",
    "get_algo_parameters",
    "reset_algo_parameters",
    "ParallelMode",
    "shard",
    "GRAPH_MODE",
    "PYNATIVE_MODE",
    "float32",
    "float16",
    "bfloat16",
    "int32",
    "int64",
    "uint8",
    "bool_",
]
