"""`ops.Dropout(keep_prob=0.5, Seed0=0, Seed1=0)`: MindSpore's dropout primitive, traced.

`dropout(x)` returns `(output, mask)`: `output` is x / keep_prob where an element is kept
(probability keep_prob), 0 elsewhere; `mask` is 1 where kept, 0 elsewhere, in x's dtype. Each
call draws new bits (the program's step counter, compiler/frontend/random_state.py), and which
elements are kept depends only on the seeds, the step and each element's place in the whole tensor
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

from pcompile.compiler.frontend.primitive import Primitive
from pcompile.compiler.frontend.random_state import next_step, op_seeds
from pcompile.compiler.frontend.tensor import Tensor
from pcompile.compiler.frontend.tracing import current_tracer
from pcompile.ir.core import Constant
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType


def _data_parallel_ranks() -> int:
    """The ranks data_parallel splits the batch over (1 outside that mode)."""
    from pcompile.compiler.config.context import current_context

    ctx = current_context()
    if ctx.parallel_mode == "data_parallel" and ctx.device_num > 1:
        return int(ctx.device_num)
    return 1


def _place(tracer: Any, shape: tuple[int, ...], op: str) -> tuple[Any, tuple[int, ...]]:
    """The offsets operand of a random op's tensor of (traced) `shape` and the whole tensor's
    shape. data_parallel traces each rank's own rows: the tensor's dim 0 is then the batch's
    (the local rows of the inputs), rank r's rows begin at r * rows and the whole tensor has
    rows * ranks, so each rank draws its rows' bits of the single-device program's tensor."""
    ranks = _data_parallel_ranks()
    zeros = Constant(np.zeros(len(shape), np.int32), DType.int32)
    if ranks == 1:
        return Tensor(_value=zeros), shape
    from pcompile.compiler.frontend.tracing import user_source
    from pcompile.ir.core import RankConstant
    from pcompile.ir.rank import RankOffsets

    rows = {p.shape[0] for p in tracer.graph.inputs if p.shape}
    if not shape or rows != {shape[0]}:
        source = user_source()
        where = f" at {source.file}:{source.line}" if source is not None else ""
        raise PcompileError(
            f"{op}{where} in data_parallel mode: each rank traces its own rows of the batch, "
            f"so a random op's dim 0 must be the batch's ({sorted(rows)} rows a rank), but its "
            f"input has shape {shape}; compile in semi_auto_parallel (the default strategies "
            "split the batch as data_parallel does), where the plan knows every tensor's "
            "layout")
    terms = (((1, ranks, shape[0]),),) + ((),) * (len(shape) - 1)
    offsets = RankOffsets((0,) * len(shape), terms)
    return (Tensor(_value=RankConstant(offsets, DType.int32)),
            (shape[0] * ranks, *shape[1:]))


def dropout(prim: Primitive, x: Any) -> tuple[Any, Any]:
    """`prim(x)` for an `ops.Dropout` primitive `prim`: (output, mask)."""
    keep = float(prim.attrs["keep_prob"])
    tracer = current_tracer()
    if tracer is None:  # eager: the first step's bits
        from pcompile.compiler.frontend.primitive import _eager

        arr = x.asnumpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
        attrs = {"keep_prob": keep, "seed0": prim.attrs["seed0"], "seed1": prim.attrs["seed1"],
                 "global_shape": tuple(arr.shape)}
        args = [Tensor(arr), Tensor(np.ones((), np.int32)),
                Tensor(np.zeros((arr.ndim,), np.int32))]
        return (_eager("Dropout", args, attrs, prim), _eager("DropoutMask", args, attrs, prim))
    value = tracer.to_value(x, None)
    offset, whole = _place(tracer, tuple(value.shape), "Dropout")
    seed0, seed1 = op_seeds(tracer, int(prim.attrs["seed0"]), int(prim.attrs["seed1"]))
    step = Tensor(_value=next_step(tracer))
    call: dict[str, Any] = {"seed0": seed0, "seed1": seed1, "global_shape": whole}
    given = prim.in_strategy
    if given is not None and len(given) == 1:  # MindSpore's form: x's split only
        prim.in_strategy = (given[0], (), (1,))
    try:
        out = prim._apply([Tensor(_value=value), step, offset], **call)
        mask = prim._apply([Tensor(_value=value), step, offset], op="DropoutMask", **call)
    finally:
        prim.in_strategy = given
    return out, mask


# -- MindSpore's two-op dropout ------------------------------------------------------------------


def _keep_prob(value: Any, op: str) -> float:
    """The constant keep_prob of a DropoutGenMask / DropoutDoMask call: a float, or a 0-d
    float tensor known when the program is traced (through Casts, as MindSpore folds them;
    its parallel rule needs the value too)."""
    from pcompile.ir.core import NodeResult

    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        raise TypeError(f"For '{op}', the keep_prob input type must be float, but got "
                        f"{type(value).__name__} {value!r}")
    if isinstance(value, (float, np.floating)):
        number = float(value)
    elif isinstance(value, Tensor):
        if not value.dtype.is_float:
            raise TypeError(f"For '{op}', the keep_prob must be a float tensor (Float16, "
                            f"Float32 or Float64), but got {value.dtype.value}")
        if tuple(value.shape) != ():
            raise ValueError(f"For '{op}', the keep_prob's dim must be 0 (scalar), but got "
                             f"shape {tuple(value.shape)}")
        v = value._value
        while isinstance(v, NodeResult) and v.node.op == "Cast":
            v = v.node.operands[0]
        if v is None:
            number = float(value.asnumpy())
        elif isinstance(v, Constant) and type(v) is Constant:
            number = float(np.asarray(v.array))
        else:
            raise ValueError(
                f"For '{op}', the keep_prob must be a constant (a float or a Tensor built from "
                "one, cast or not); a computed keep_prob is not supported (MindSpore's parallel "
                "rule also needs it as a value node)")
    else:
        raise TypeError(f"For '{op}', the keep_prob input must be a float number or tensor, "
                        f"but got {type(value).__name__}")
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"For '{op}', the 'keep_prob' input value must in the range [0, 1], "
                         f"but got {number}")
    return number


def _shape_arg(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, Tensor) and not shape.is_symbolic:
        shape = tuple(int(d) for d in np.asarray(shape.asnumpy()).reshape(-1))
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in shape):
        raise TypeError("For 'DropoutGenMask', the 'shape' must be a tuple of ints (e.g. "
                        f"ops.Shape()(x)), but got {type(shape).__name__} {shape!r}")
    out = tuple(int(d) for d in shape)
    if any(d <= 0 for d in out):
        raise ValueError(f"For 'DropoutGenMask', every value of 'shape' must be > 0, but got "
                         f"{out}")
    return out


def gen_mask(prim: Primitive, shape: Any, keep_prob: Any) -> Any:
    """`prim(shape, keep_prob)` for a `P.DropoutGenMask(Seed0, Seed1)` primitive: the packed
    UInt8 mask (ir/ops/random.py) of the bits ops.Dropout draws for a tensor of `shape`."""
    dims = _shape_arg(shape)
    keep = _keep_prob(keep_prob, "DropoutGenMask")
    tracer = current_tracer()
    attrs: dict[str, Any] = {"shape": dims, "keep_prob": keep}
    if tracer is None:  # eager: the first step's bits
        from pcompile.compiler.frontend.primitive import _eager

        return _eager("DropoutGenMask", [Tensor(np.ones((), np.int32))],
                      {**attrs, "seed0": prim.attrs["seed0"], "seed1": prim.attrs["seed1"]},
                      prim)
    if _data_parallel_ranks() > 1:
        from pcompile.compiler.frontend.tracing import user_source

        source = user_source()
        where = f" at {source.file}:{source.line}" if source is not None else ""
        raise PcompileError(
            f"DropoutGenMask{where} in data_parallel mode: each rank traces its own rows, and "
            "the packed mask of its shape would hold the first rows' bits on every rank; use "
            "ops.Dropout (which draws each rank's rows' bits in data_parallel), or compile in "
            "semi_auto_parallel (the default strategies split the batch alike)")
    seed0, seed1 = op_seeds(tracer, int(prim.attrs["seed0"]), int(prim.attrs["seed1"]))
    step = Tensor(_value=next_step(tracer))
    given = prim.in_strategy
    prim.in_strategy = None  # its output is whole: DropoutDoMask's strategy says the split
    try:
        return prim._apply([step], seed0=seed0, seed1=seed1, **attrs)
    finally:
        prim.in_strategy = given


def _mask_source_error(prim: Primitive, what: str) -> PcompileError:
    from pcompile.compiler.frontend.tracing import user_source

    source = user_source()
    where = f" at {source.file}:{source.line}" if source is not None else ""
    return PcompileError(
        f"DropoutDoMask{where}: in a parallel plan its mask must be the output of a "
        f"DropoutGenMask (MindSpore's DropoutDoMaskInfo rewrites that op's shape to the "
        f"input's slice), but it is {what}; pass DropoutGenMask()(ops.Shape()(x), keep_prob) "
        "directly, or use ops.Dropout, which returns (output, mask)")


def do_mask(prim: Primitive, x: Any, mask: Any, keep_prob: Any) -> Any:
    """`prim(x, mask, keep_prob)` for a `P.DropoutDoMask()` primitive: x / keep_prob where the
    mask's bit of the element is set, else 0 (any plan reads the single-device bits)."""
    from pcompile.compiler.config.context import current_context
    from pcompile.ir.core import NodeResult

    keep = _keep_prob(keep_prob, "DropoutDoMask")
    tracer = current_tracer()
    if tracer is None:
        from pcompile.compiler.frontend.primitive import _eager

        arr = x.asnumpy() if isinstance(x, Tensor) else np.asarray(x, np.float32)
        packed = mask.asnumpy() if isinstance(mask, Tensor) else np.asarray(mask)
        return _eager("DropoutDoMask", [Tensor(arr), Tensor(np.asarray(packed, np.uint8)),
                                        Tensor(np.zeros((arr.ndim,), np.int32))],
                      {"keep_prob": keep, "global_shape": tuple(arr.shape)}, prim)
    value = tracer.to_value(x, None)
    bits = tracer.to_value(mask, None)
    ctx = current_context()
    if ctx.parallel_mode in ("semi_auto_parallel", "auto_parallel") and ctx.device_num > 1:
        if not (isinstance(bits, NodeResult) and bits.node.op == "DropoutGenMask"):
            producer = bits.node.op if isinstance(bits, NodeResult) else type(bits).__name__
            raise _mask_source_error(prim, f"a {producer}")
    offset = Tensor(_value=Constant(np.zeros(len(value.shape), np.int32), DType.int32))
    given = prim.in_strategy
    if given is not None:
        if len(given) != 1:
            from pcompile.compiler.frontend.tracing import user_source

            source = user_source()
            where = f" at {source.file}:{source.line}" if source is not None else ""
            raise PcompileError(
                f"DropoutDoMask{where}: invalid strategy size {len(given)}, it must be 1 (one "
                f"tuple for x {tuple(value.shape)}; the mask and keep_prob take none), got "
                f"{given}")
        prim.in_strategy = (given[0], (1,), (1,))
    try:
        return prim._apply([Tensor(_value=value), Tensor(_value=bits), offset],
                           keep_prob=keep, global_shape=tuple(value.shape))
    finally:
        prim.in_strategy = given
