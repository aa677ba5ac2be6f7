"""Point-to-point transfers between pipeline stages (MindSpore's `Send` / `Receive`).

`passes/pipeline_split.py` cuts a training step at the stage boundaries and puts a `Send` in
the producing stage and a `Receive` in the consuming one for every value that crosses. Both
carry MindSpore's attributes: `sr_tag` (the same number on both sides of one transfer),
`dest_rank` / `src_rank` (the peer; in a stage's rank-parametric graph an
`ir.rank.RankShift`: the rank at the same position of the other stage), `shape` and `dtype`
of the tensor, and `group` (the world group, as MindSpore's default).

`Send(x)` returns `x` (MindSpore's Send infers its input's shape), so that a graph can order
work after it; `Receive()` has no operand and returns a tensor of `shape` and `dtype`. Like
the collectives they have no numpy/JAX callables: the pipeline runtimes move the data
(`backends/numpy/pipeline.py`, `backends/jax/pipeline.py`). They are not differentiated: the
cut happens after autodiff, on the whole step.
"""

from __future__ import annotations

from typing import Any

from pcompile.ir.errors import ShapeError
from pcompile.ir.ops._define import define
from pcompile.ir.ops._util import tensor
from pcompile.ir.registry import ALL, CommFacts, Trait
from pcompile.ir.types import DType, TensorType, ValueType

_P2P_DEFAULTS: dict[str, Any] = {"sr_tag": 0, "group": "", "shape": (),
                                 "dtype": DType.float32}


def _check_common(attrs: dict[str, Any], peer: str) -> tuple[tuple[int, ...], DType]:
    tag, rank, group = attrs["sr_tag"], attrs[peer], attrs["group"]
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ShapeError(f"sr_tag must be a non-negative int, got {tag!r}")
    # (a stage's graph is inferred at rank 0, where the peer of a later stage is negative)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise ShapeError(f"{peer} must be an int, got {rank!r}")
    if not isinstance(group, str):
        raise ShapeError(f"group must be a str, got {group!r}")
    shape, dtype = attrs["shape"], attrs["dtype"]
    if not isinstance(shape, tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ShapeError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    if not isinstance(dtype, DType):
        raise ShapeError(f"dtype must be a DType, got {dtype!r}")
    return shape, dtype


# -- Send -----------------------------------------------------------------------------------


def _send_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    shape, dtype = _check_common(attrs, "dest_rank")
    if (shape, dtype) != (x.shape, x.dtype):
        raise ShapeError(f"shape {shape} and dtype {dtype.value} must describe x {x}")
    return x


def _nothing(*sizes: int) -> int:
    """What a Send receives and a Receive sends."""
    return 0


def _send_ring(size: int, n: int) -> int:
    """The tensor it sends."""
    return size


define("Send", _send_infer,
       attrs={"sr_tag": 0, "dest_rank": 0, **{k: v for k, v in _P2P_DEFAULTS.items()
                                               if k != "sr_tag"}}, num_inputs=1,
       differentiable=False, collective=True, traits=frozenset({Trait.POINT_TO_POINT}),
       comm=CommFacts(_nothing, _send_ring),
       doc="Sends x to rank dest_rank (the Receive with the same sr_tag there); returns x. shape "
           "and dtype describe x. Not differentiated (the pipeline cut follows autodiff).",
       section="compiler", operands="x; `dest_rank`, `sr_tag`, `shape`, `dtype` -> x", dtypes=ALL,
       rule="*no strategy*: between pipeline stages; sent to the Receive of the same `sr_tag`",
       tests=("test_pipeline.py::test_dumps_show_send_receive_pairs_and_micro_batches",
              "test_pipeline.py::test_mlp_four_stages_two_way_model_parallel_trains_like_"
              "one_device"),
       spelling="inserted by the compiler")

# -- Receive --------------------------------------------------------------------------------


def _receive_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    shape, dtype = _check_common(attrs, "src_rank")
    return TensorType(dtype, shape)


def _receive_received(operand: int, result: int, n: int) -> int:
    """The tensor it receives."""
    return result


define("Receive", _receive_infer,
       attrs={"sr_tag": 0, "src_rank": 0, **{k: v for k, v in _P2P_DEFAULTS.items()
                                              if k != "sr_tag"}}, num_inputs=0,
       differentiable=False, collective=True, traits=frozenset({Trait.POINT_TO_POINT}),
       comm=CommFacts(_receive_received, _nothing),
       doc="Receives the tensor (shape, dtype) that rank src_rank sends with the same sr_tag.",
       section="compiler", operands="`src_rank`, `sr_tag`, `shape`, `dtype` -> tensor", dtypes=ALL,
       rule="*no strategy*: between pipeline stages; receives the Send of the same `sr_tag`",
       tests=("test_pipeline.py::test_dumps_show_send_receive_pairs_and_micro_batches",
              "test_pipeline.py::test_mlp_four_stages_two_way_model_parallel_trains_like_"
              "one_device"),
       spelling="inserted by the compiler")
