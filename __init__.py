"""pcompile: an ahead-of-time auto-parallel compiler.

The user-facing façade, MindSpore-style::

    from pcompile import nn, ops, Parameter, Tensor, Layout, set_auto_parallel_context
    from pcompile.communication import init, get_rank, get_group_size
    import pcompile.dataset as ds  # GeneratorDataset, NumpySlicesDataset, TokenFileDataset

Everything of the project lives under this one import package (`pcompile.compiler`,
`pcompile.ir`, `pcompile.passes`, `pcompile.backends`, `pcompile.tools`, `pcompile.cli`). The
façade names are loaded on first use, so `import pcompile.ir.core` does not import the compiler.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from pcompile._version import __version__

# Submodules a model file imports by MindSpore's spelling (`import pcompile.nn as nn`,
# `from pcompile.communication import init`, `import pcompile.dataset as ds`): aliases of the
# façade's modules. `dataset` stays out of `__all__`: `from pcompile import *` must not bind
# the name a model file's dataset() function has.
_MODULE_ALIASES = {
    "pcompile.nn": "pcompile.compiler.frontend.nn",
    "pcompile.ops": "pcompile.compiler.frontend.ops",
    "pcompile.communication": "pcompile.compiler.frontend.communication",
    "pcompile.communication.management": "pcompile.compiler.frontend.communication",
    "pcompile.mint": "pcompile.compiler.frontend.mint",
    "pcompile.mint.nn": "pcompile.compiler.frontend.mint.nn",
    "pcompile.mint.nn.functional": "pcompile.compiler.frontend.mint.nn.functional",
    "pcompile.amp": "pcompile.compiler.frontend.amp",
    "pcompile.dataset": "pcompile.compiler.frontend.dataset",
    "pcompile.common": "pcompile.compiler.frontend.common",
    "pcompile.common.initializer": "pcompile.compiler.frontend.initializer",
    # MindSpore's module paths that model code imports by name (`from mindspore.ops import
    # operations as P`, `import mindspore.common.dtype as mstype`, ...): each is one of ours.
    "pcompile.ops.operations": "pcompile.compiler.frontend.ops",
    "pcompile.ops.operations.nn_ops": "pcompile.compiler.frontend.ops",
    "pcompile.ops.operations._inner_ops": "pcompile.compiler.frontend.ops",
    "pcompile.ops.operations._sequence_ops": "pcompile.compiler.frontend.ops",
    "pcompile.ops.functional": "pcompile.compiler.frontend.ops",
    # mindformers' fused ops: `from mindspore.ops.auto_generate import gen_ops_prim`
    "pcompile.ops.auto_generate": "pcompile.compiler.frontend.ops",
    "pcompile.ops.auto_generate.gen_ops_prim": "pcompile.compiler.frontend.ops",
    "pcompile.ops.primitive": "pcompile.compiler.frontend.ops",
    "pcompile.common.dtype": "pcompile.compiler.frontend.common.dtype",
    "pcompile.common.tensor": "pcompile.compiler.frontend.tensor",
    "pcompile.common.parameter": "pcompile.compiler.frontend.tensor",
    "pcompile.context": "pcompile.compiler.config.context",
    "pcompile.parallel": "pcompile.compiler.frontend.parallel",
    "pcompile.parallel.shard": "pcompile.compiler.config.layout",
    "pcompile.parallel._utils": "pcompile.compiler.frontend.parallel",
    "pcompile.nn.layer": "pcompile.compiler.frontend.nn",
    "pcompile.nn.cell": "pcompile.compiler.frontend.nn.cell",
    # mindspore.train: Model, the callbacks, the checkpoint functions
    "pcompile.train": "pcompile.compiler.frontend.callbacks",
    "pcompile.train.callback": "pcompile.compiler.frontend.callbacks",
    "pcompile.train.serialization": "pcompile.compiler.frontend.serialization",
    "pcompile.train.model": "pcompile.compiler.frontend.train_model",
}

_FACADE = (
    "nn", "ops", "mint", "communication", "amp", "Parameter", "ParameterTuple", "Tensor",
    "TensorSpec", "Layout", "initializer", "set_seed", "set_auto_parallel_context",
    "get_auto_parallel_context",
    "reset_auto_parallel_context", "set_context", "get_context", "set_cost_model_context",
    "get_cost_model_context", "reset_cost_model_context", "set_algo_parameters",
    "get_algo_parameters", "reset_algo_parameters", "ParallelMode", "shard", "compile",
    "GRAPH_MODE", "PYNATIVE_MODE", "float32", "float16", "bfloat16", "int32", "int64", "uint8",
    "bool_", "Model", "load_checkpoint", "load_param_into_net", "save_checkpoint", "Callback",
    "LossMonitor", "TimeMonitor", "CheckpointConfig", "ModelCheckpoint",
)

__all__ = [*_FACADE, "__version__"]


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `pcompile.nn` (etc.) to the module that implements it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in _MODULE_ALIASES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(_MODULE_ALIASES[spec.name])

    def exec_module(self, module: Any) -> None:
        return None


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    # First: `pcompile.mint.nn` must resolve to the aliased module, not be found again under
    # the real package's path (a second copy of the module).
    sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str) -> Any:
    if name == "train":  # `import mindspore as ms; ms.train.Model(...)`
        return importlib.import_module("pcompile.train")
    if name in _FACADE:
        # `compile` compiles and writes the outputs (pcompile.tools, above the backends); the
        # other names are the front end's (pcompile.compiler)
        facade = importlib.import_module("pcompile.tools.compile" if name == "compile"
                                         else "pcompile.compiler")
        value = getattr(facade, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pcompile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACADE))
