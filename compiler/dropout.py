"""`ops.Dropout(keep_prob=0.5, Seed0=0, Seed1=0)`: MindSpore's dropout primitive, traced.

`dropout(x)` returns `(output, mask)`: `output` is x / keep_prob where an element is kept
(probability keep_prob), 0 elsewhere; `mask` is 1 where kept, 0 elsewhere, in x's dtype. Each
call draws new bits (the program's step counter, compiler/random_state.py), and which elements
are kept depends only on the seeds, the step and each element's place in the whole tensor
(ir/ops/random.py), so a parallel plan keeps exactly the elements the single-device program
keeps.

Its strategy is MindSpore's, one tuple for x (`ops.Dropout(0.9).shard(((dp, mp),))`); the
output and the mask are split alike. In the IR the op has two more operands, the step and the
block's offsets, which are never split (the strategy the node records names them: `((dp, mp),
(), (1,))`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.compiler.primitive import Primitive
from pcompile.compiler.random_state import next_step, op_seeds
from pcompile.compiler.tensor import Tensor
from pcompile.compiler.tracing import current_tracer
from pcompile.ir.core import Constant
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType


def _check_mode() -> None:
    """data_parallel traces each rank's own batch: every rank would draw the bits of the
    batch's first rows (its block's offsets are not known), unlike the single-device program."""
    from pcompile.compiler.context import current_context
    from pcompile.compiler.tracing import user_source

    ctx = current_context()
    if ctx.parallel_mode == "data_parallel" and ctx.device_num > 1:
        source = user_source()
        where = f" at {source.file}:{source.line}" if source is not None else ""
        raise PcompileError(
            f"Dropout{where} in data_parallel mode: each rank traces only its own batch, so "
            "every rank would drop the elements the single-device program drops in the first "
            "rows; compile in semi_auto_parallel (the default strategies split the batch as "
            "data_parallel does) or auto_parallel, where each rank draws its rows' bits")


def dropout(prim: Primitive, x: Any) -> tuple[Any, Any]:
    """`prim(x)` for an `ops.Dropout` primitive `prim`: (output, mask)."""
    keep = float(prim.attrs["keep_prob"])
    tracer = current_tracer()
    if tracer is None:  # eager: the first step's bits
        from pcompile.compiler.primitive import _eager

        arr = x.asnumpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
        attrs = {"keep_prob": keep, "seed0": prim.attrs["seed0"], "seed1": prim.attrs["seed1"],
                 "global_shape": tuple(arr.shape)}
        args = [Tensor(arr), Tensor(np.ones((), np.int32)),
                Tensor(np.zeros((arr.ndim,), np.int32))]
        return (_eager("Dropout", args, attrs, prim), _eager("DropoutMask", args, attrs, prim))
    _check_mode()
    value = tracer.to_value(x, None)
    seed0, seed1 = op_seeds(tracer, int(prim.attrs["seed0"]), int(prim.attrs["seed1"]))
    step = Tensor(_value=next_step(tracer))
    offset = Tensor(_value=Constant(np.zeros(len(value.shape), np.int32), DType.int32))
    call: dict[str, Any] = {"seed0": seed0, "seed1": seed1, "global_shape": tuple(value.shape)}
    given = prim.in_strategy
    if given is not None and len(given) == 1:  # MindSpore's form: x's split only
        prim.in_strategy = (given[0], (), (1,))
    try:
        out = prim._apply([Tensor(_value=value), step, offset], **call)
        mask = prim._apply([Tensor(_value=value), step, offset], op="DropoutMask", **call)
    finally:
        prim.in_strategy = given
    return out, mask
