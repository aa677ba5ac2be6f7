"""The user-facing façade, re-exported by `pcompile`: `from pcompile import nn, ops, ...`.

Model files import only from `pcompile` (and `pcompile.communication`, `pcompile.dataset`);
internal module paths may change, this list does not."""

from pcompile.compiler import amp, communication, mint, nn, ops
from pcompile.compiler.context import (
    ParallelMode,
    get_auto_parallel_context,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from pcompile.compiler.general_context import get_context, set_context
from pcompile.compiler.grad import ParameterTuple
from pcompile.compiler.initializer import initializer, set_seed
from pcompile.compiler.layout import Layout
from pcompile.compiler.search_context import (
    get_algo_parameters,
    get_cost_model_context,
    reset_algo_parameters,
    reset_cost_model_context,
    set_algo_parameters,
    set_cost_model_context,
)
from pcompile.compiler.serialization import load_checkpoint, load_param_into_net
from pcompile.compiler.tensor import Parameter, Tensor, TensorSpec
from pcompile.compiler.train_model import Model
from pcompile.ir.types import bfloat16, bool_, float16, float32, int32, int64, uint8

GRAPH_MODE = 0
PYNATIVE_MODE = 1


def shard(fn, in_strategy, out_strategy=None, parameter_plan=None, device="Ascend", level=0):
    """Functional shard (seed functional-operator-sharding.md): returns a function that calls
    `fn` (a function or a Cell) with its inputs constrained to `in_strategy` (None entries are
    derived by the search) and, for a Cell, its parameters to `parameter_plan`. Valid only with
    auto_parallel and sharding_propagation."""
    from pcompile.compiler.functional_shard import call_sharded
    from pcompile.compiler.nn.cell import Cell
    from pcompile.compiler.primitive import normalize_strategy

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
