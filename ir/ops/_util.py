"""Small helpers shared by op definitions: shape checks and vjp building blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pcompile.ir.errors import ShapeError
from pcompile.ir.types import DType, TensorType, TupleType, ValueType

if TYPE_CHECKING:
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Value


def tensor(t: ValueType, what: str = "input") -> TensorType:
    if not isinstance(t, TensorType):
        raise ShapeError(f"{what} must be a tensor, got {t}")
    return t


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{what} {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def broadcast_shapes(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy broadcasting; ShapeError when the shapes do not broadcast."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and da != 1 and db != 1:
            raise ShapeError(f"shapes {a} and {b} cannot be broadcast (dim -{i}: {da} vs {db})")
        out.append(max(da, db) if da != 1 and db != 1 else da * db)
    return tuple(reversed(out))


def same_dtype(types: list[TensorType]) -> DType:
    dtypes = {t.dtype for t in types}
    if len(dtypes) != 1:
        names = ", ".join(sorted(d.value for d in dtypes))
        raise ShapeError(f"operands must have one dtype, got {names}")
    return types[0].dtype


def infer_unary(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    return tensor(types[0])


def infer_unary_float(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    t = tensor(types[0])
    if not t.dtype.is_float:
        raise ShapeError(f"needs a floating-point input, got {t.dtype.value}")
    return t


def infer_binary(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    a, b = tensor(types[0], "x"), tensor(types[1], "y")
    return TensorType(same_dtype([a, b]), broadcast_shapes(a.shape, b.shape))


def infer_compare(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    a, b = tensor(types[0], "x"), tensor(types[1], "y")
    same_dtype([a, b])
    return TensorType(DType.bool_, broadcast_shapes(a.shape, b.shape))


def is_zero(value: Value) -> bool:
    """Whether `value` is a constant of zeros (autodiff's cotangent of an unused tuple
    element), so a vjp can skip the work it would feed."""
    from pcompile.ir.core import Constant

    return isinstance(value, Constant) and not value.array.any()


def tuple_type(*elements: TensorType) -> TupleType:
    return TupleType(tuple(elements))


def unbroadcast(b: Builder, cot: Value, shape: tuple[int, ...]) -> Value:
    """Sum `cot` down to `shape` (the vjp of numpy broadcasting)."""
    if cot.shape == shape:
        return cot
    lead = len(cot.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and cot.shape[lead + i] != 1
    )
    if axes:
        cot = b("ReduceSum", cot, axis=axes, keep_dims=True)
    if cot.shape != shape:
        cot = b("Reshape", cot, shape=shape)
    return cot
