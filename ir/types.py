"""Element types and value types of the IR.

A value is either a tensor (`TensorType`: dtype + static shape) or a tuple of tensors
(`TupleType`, produced by multi-output ops such as Split and read with TupleGetItem).
Their text forms follow MindIR: `<Tensor[Float32], (16, 32)>` and
`<Tuple[Tensor[Float32]*2], TupleShape((8, 4), (8, 4))>`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    """Element type of a tensor; the value is the MindIR spelling."""

    float32 = "Float32"
    float64 = "Float64"
    float16 = "Float16"
    bfloat16 = "BFloat16"
    int32 = "Int32"
    int64 = "Int64"
    uint8 = "UInt8"
    bool_ = "Bool"

    # Members are singletons compared by identity: hash them by identity too (Enum's own
    # __hash__ is Python code hashing the name, called for every type and memo key).
    __hash__ = object.__hash__

    @property
    def np(self) -> np.dtype:
        """The numpy dtype used by the reference interpreter."""
        return _NP[self]

    @property
    def itemsize(self) -> int:
        return int(self.np.itemsize)

    @property
    def is_float(self) -> bool:
        return self in (DType.float32, DType.float64, DType.float16, DType.bfloat16)

    @staticmethod
    def from_any(value: object) -> DType:
        """Accept a DType, its MindIR or Python name, or anything numpy understands."""
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            for member in DType:
                if value in (member.value, member.name, member.name.rstrip("_")):
                    return member
        try:
            # numpy's stubs take dtype-likes only; anything else raises TypeError, caught here
            npd = np.dtype(value)  # type: ignore[call-overload]
        except TypeError as exc:
            raise TypeError(f"unsupported dtype {value!r}") from exc
        for member, candidate in _NP.items():
            if candidate == npd:
                return member
        raise TypeError(
            f"unsupported dtype {value!r}; supported: {', '.join(m.name for m in DType)}"
        )


_NP: dict[DType, np.dtype] = {
    DType.float32: np.dtype(np.float32),
    DType.float64: np.dtype(np.float64),
    DType.float16: np.dtype(np.float16),
    DType.bfloat16: np.dtype(ml_dtypes.bfloat16),
    DType.int32: np.dtype(np.int32),
    DType.int64: np.dtype(np.int64),
    DType.uint8: np.dtype(np.uint8),
    DType.bool_: np.dtype(np.bool_),
}

float32 = DType.float32
float64 = DType.float64
float16 = DType.float16
bfloat16 = DType.bfloat16
int32 = DType.int32
int64 = DType.int64
uint8 = DType.uint8
bool_ = DType.bool_


def format_shape(shape: tuple[int, ...]) -> str:
    """Python-tuple spelling with MindIR spacing: (16, 32), (8,), ()."""
    if len(shape) == 1:
        return f"({shape[0]},)"
    return "(" + ", ".join(str(d) for d in shape) + ")"


@dataclass(frozen=True)
class TensorType:
    """A tensor of static shape."""

    dtype: DType
    shape: tuple[int, ...]

    def __hash__(self) -> int:
        # Types key every memo (inference, printing): hash once per instance.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.dtype, self.shape))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict[str, object]:
        # Not the cached hash: a DType's hash differs between processes.
        return {"dtype": self.dtype, "shape": self.shape}

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def with_shape(self, shape: tuple[int, ...]) -> TensorType:
        return TensorType(self.dtype, tuple(int(d) for d in shape))

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"<Tensor[{self.dtype.value}], {format_shape(self.shape)}>"


@dataclass(frozen=True)
class TupleType:
    """The result type of a multi-output op."""

    elements: tuple[TensorType, ...]

    def __str__(self) -> str:
        dtypes = [e.dtype.value for e in self.elements]
        if dtypes and all(d == dtypes[0] for d in dtypes):
            inner = f"Tensor[{dtypes[0]}]*{len(dtypes)}"
        else:
            inner = ",".join(f"Tensor[{d}]" for d in dtypes)
        shapes = ", ".join(format_shape(e.shape) for e in self.elements)
        return f"<Tuple[{inner}], TupleShape({shapes})>"


ValueType = TensorType | TupleType
