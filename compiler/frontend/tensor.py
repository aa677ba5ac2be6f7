"""User-facing tensors: `Tensor`, `TensorSpec` and `Parameter`.

A `Tensor` is either concrete (it holds a numpy array; ops on it run eagerly through the numpy
reference implementation) or symbolic (it stands for an IR value while a model is traced).
Python operators (`+`, `*`, `@`, indexing, ...) map to the same primitives as `ops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.ir.core import Value
from pcompile.ir.types import DType, TensorType


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a model input, without data (`inputs()` may return these)."""

    shape: tuple[int, ...]
    dtype: Any = DType.float32

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape):
            raise ValueError(f"TensorSpec shape must be positive ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", DType.from_any(self.dtype))

    @property
    def type(self) -> TensorType:
        return TensorType(self.dtype, self.shape)


_OPS: Any = None


def _call(prim_name: str, *args: Any, **kwargs: Any) -> Any:
    global _OPS
    if _OPS is None:
        from pcompile.compiler.frontend import ops

        _OPS = ops
    return getattr(_OPS, prim_name)(**kwargs)(*args)


class Tensor:
    """A tensor value: concrete data, or a symbolic IR value during tracing."""

    def __init__(self, data: Any = None, dtype: Any = None, *, _value: Value | None = None):
        self._value = _value
        self._data: np.ndarray | None = None
        if _value is None:
            if data is None:
                raise ValueError("Tensor needs data")
            if isinstance(data, Tensor):
                data = data.asnumpy()
            arr = np.asarray(data)
            if dtype is not None:
                arr = arr.astype(DType.from_any(dtype).np)
            elif arr.dtype == np.float64:
                arr = arr.astype(np.float32)
            elif arr.dtype == np.int64 and not isinstance(data, np.ndarray):
                arr = arr.astype(np.int64)
            DType.from_any(arr.dtype)  # validate the element type
            self._data = arr

    # -- introspection ------------------------------------------------------------------------
    @property
    def is_symbolic(self) -> bool:
        return self._value is not None

    @property
    def shape(self) -> tuple[int, ...]:
        if self._value is not None:
            return self._value.shape
        if self._data is None:
            return self._lazy_data().shape
        return tuple(self._data.shape)

    @property
    def dtype(self) -> DType:
        if self._value is not None:
            return self._value.dtype
        if self._data is None:
            return self._lazy_data().dtype
        return DType.from_any(self._data.dtype)

    def _lazy_data(self) -> Any:
        raise AssertionError("tensor without data")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def asnumpy(self) -> np.ndarray:
        if self._data is None and self._value is None:
            self._data = self._lazy_data().to_numpy()  # materialised on first use
        if self._data is None:
            raise RuntimeError(
                "this tensor is symbolic (it is being traced); its value exists only when the "
                "compiled program runs"
            )
        return self._data

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.asnumpy()
        return arr.astype(dtype) if dtype is not None else arr

    def __repr__(self) -> str:
        if self._value is not None:
            return f"Tensor(symbolic, shape={self.shape}, dtype={self.dtype.value})"
        return f"Tensor(shape={self.shape}, dtype={self.dtype.value}, value={self._data!r})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self) -> bool:
        if self._value is not None:
            from pcompile.compiler.frontend.train_step import current_step

            hint = ("; compute both branches and choose element-wise with "
                    "ops.select(cond, x, y), or decide on shapes and Python values")
            if current_step() is not None:
                hint = ("; in a training step, skip the update on overflow with "
                        "`loss = ops.depend(loss, self.optimizer(grads, skip=overflow))` instead "
                        "of `if not overflow: ...`, and choose values with ops.select")
            raise TypeError(
                "the truth value of a traced tensor is unknown at compile time; Python control "
                "flow may depend only on shapes and Python values" + hint
            )
        return bool(self.asnumpy())

    def __float__(self) -> float:
        return float(self.asnumpy())

    # -- operators ----------------------------------------------------------------------------
    def __add__(self, other: Any) -> Tensor:
        return _call("Add", self, other)

    def __radd__(self, other: Any) -> Tensor:
        return _call("Add", other, self)

    def __sub__(self, other: Any) -> Tensor:
        return _call("Sub", self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return _call("Sub", other, self)

    def __mul__(self, other: Any) -> Tensor:
        return _call("Mul", self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return _call("Mul", other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return _call("RealDiv", self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _call("RealDiv", other, self)

    def __neg__(self) -> Tensor:
        return _call("Neg", self)

    # Comparisons give a Bool tensor (MindSpore's Tensor operators); == and != keep Python's
    # identity meaning, which the front end relies on (use ops.Equal / ops.NotEqual).
    def __gt__(self, other: Any) -> Tensor:
        return _call("Greater", self, other)

    def __ge__(self, other: Any) -> Tensor:
        return _call("GreaterEqual", self, other)

    def __lt__(self, other: Any) -> Tensor:
        return _call("Less", self, other)

    def __le__(self, other: Any) -> Tensor:
        return _call("LessEqual", self, other)

    def __invert__(self) -> Tensor:
        if self.dtype is not DType.bool_:
            raise TypeError(f"unary ~ on a Tensor is the logical not of a Bool tensor, got "
                            f"{self.dtype.value}; compare first (x > 0) or use ops.logical_not")
        return _call("LogicalNot", self)

    def __pow__(self, other: Any) -> Tensor:
        return _call("Pow", self, other)

    def __matmul__(self, other: Any) -> Tensor:
        if self.ndim == 2 and np.ndim(other) == 2 or (
            isinstance(other, Tensor) and self.ndim == 2 and other.ndim == 2
        ):
            return _call("MatMul", self, other)
        return _call("BatchMatMul", self, other)

    def __getitem__(self, index: Any) -> Tensor:
        from pcompile.compiler.frontend.ops import getitem

        return getitem(self, index)

    # -- methods ------------------------------------------------------------------------------
    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _call("Reshape", self, tuple(shape))

    def view(self, *shape: Any) -> Tensor:
        return self.reshape(*shape)

    def transpose(self, *perm: Any) -> Tensor:
        if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
            perm = tuple(perm[0])
        if not perm:
            perm = tuple(reversed(range(self.ndim)))
        return _call("Transpose", self, tuple(perm))

    @property
    def T(self) -> Tensor:  # noqa: N802  (numpy spelling)
        return self.transpose()

    def astype(self, dtype: Any) -> Tensor:
        return _call("Cast", self, DType.from_any(dtype))

    def sum(self, axis: Any = (), keepdims: bool = False) -> Tensor:
        return _call("ReduceSum", self, axis, keep_dims=keepdims)

    def mean(self, axis: Any = (), keep_dims: bool = False) -> Tensor:
        return _call("ReduceMean", self, axis, keep_dims=keep_dims)

    def max(self, axis: Any = (), keepdims: bool = False) -> Tensor:
        return _call("ReduceMax", self, axis, keep_dims=keepdims)

    def min(self, axis: Any = None, keepdims: bool = False, *, initial: Any = None,
            where: Any = None, return_indices: bool = False) -> Tensor:
        """The minimum over `axis` (all axes when None), MindSpore's `Tensor.min`."""
        if initial is not None or where is not None or return_indices:
            raise ValueError("Tensor.min: initial, where and return_indices are not supported; "
                             "reduce whole axes (ops.topk or ops.sort give positions)")
        axes = () if axis is None else axis
        return _call("ReduceMin", self, axes, keep_dims=bool(keepdims))

    def ge(self, other: Any) -> Tensor:
        return _call("GreaterEqual", self, other)

    def bool(self) -> Tensor:
        return _call("Cast", self, DType.bool_)

    def repeat_interleave(self, repeats: Any, dim: Any = None) -> Tensor:
        from pcompile.compiler.frontend.functional import repeat_interleave

        out: Tensor = repeat_interleave(self, repeats, dim)
        return out

    def repeat(self, repeats: Any, axis: Any = None) -> Tensor:
        """MindSpore's `Tensor.repeat` (numpy's): each element repeated along `axis`, as
        `repeat_interleave` (mindformers' group-limited routing repeats its group mask so)."""
        return self.repeat_interleave(repeats, axis)

    def expand_dims(self, axis: int) -> Tensor:
        return _call("ExpandDims", self, axis)

    def squeeze(self, axis: Any = ()) -> Tensor:
        return _call("Squeeze", self, axis=axis)

    def flatten(self) -> Tensor:
        return _call("Flatten", self)


class Parameter(Tensor):
    """A trainable (or frozen) stored tensor of a Cell.

    `name` defaults to the attribute path that holds it (`layer1.weight`); parameters of child
    cells are prefixed with the child's attribute path, as in MindSpore."""

    def __init__(
        self,
        default_input: Any,
        name: str | None = None,
        requires_grad: bool = True,
        layerwise_parallel: bool = False,
        parallel_optimizer: bool = True,
    ) -> None:
        from pcompile.compiler.frontend.initializer import InitializedData

        if isinstance(default_input, InitializedData):
            # Abstract: shape, dtype and how to generate it; nothing is allocated until a
            # value is asked for (compiling never does; each rank makes its own slice).
            self._value = None
            self._data = None
            self._init: InitializedData | None = default_input
        else:
            super().__init__(default_input)
            self._init = None
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"Parameter name must be a non-empty string, got {name!r}")
        self.name = name
        self._explicit_name = name is not None
        self.requires_grad = bool(requires_grad)
        self.layerwise_parallel = bool(layerwise_parallel)
        self.parallel_optimizer = bool(parallel_optimizer)
        self._comm_fusion = 1

    @property
    def comm_fusion(self) -> int:
        return self._comm_fusion

    @comm_fusion.setter
    def comm_fusion(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"comm_fusion must be an int >= 0, got {value!r}")
        self._comm_fusion = value

    @property
    def data(self) -> np.ndarray:
        return self.asnumpy()

    @property
    def source(self) -> Any:
        """The parameter's data as an `InitializedData` (its initializer, or its array), from
        which any block is generated without the rest."""
        from pcompile.compiler.frontend.initializer import InitializedData

        if self._data is not None or self._init is None:
            return InitializedData.of_array(self.asnumpy())
        return self._init

    def _lazy_data(self) -> Any:
        if self._init is None:
            raise AssertionError("tensor without data")
        return self._init

    def set_data(self, data: Any) -> None:
        from pcompile.compiler.frontend.initializer import InitializedData

        if isinstance(data, InitializedData):
            if data.shape != self.shape:
                raise ValueError(f"Parameter {self.name}: shape {data.shape} != {self.shape}")
            self._init, self._data = data, None
            return
        arr = np.asarray(data, dtype=self.dtype.np)
        if arr.shape != self.shape:
            raise ValueError(f"Parameter {self.name}: shape {arr.shape} != {self.shape}")
        self._data = arr
        self._init = None

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype.value})"
