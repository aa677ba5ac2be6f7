"""MindSpore-style layers: `Dense`, `Embedding`, `LayerNorm`, `Conv2d`, activations,
`Flatten`, `Dropout` and `SequentialCell`.

Each layer holds its primitives as attributes, so the IR nodes it emits carry readable instance
names (`matmul`, `bias_add`, `gather`, ...), and its parameters as `weight`, `bias`,
`embedding_table`, `gamma`, `beta`, which the Cell machinery prefixes with the attribute path
(`layer1.weight`, `blocks.0.ln1.gamma`), as in MindSpore.

Constructor arguments are checked when the layer is built (`TypeError` / `ValueError`); inputs
that do not fit a layer raise `LayerInputError` while the model is traced, naming the layer,
its scope and what it expected.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pcompile.compiler.frontend import ops
from pcompile.compiler.frontend.initializer import initializer
from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.primitive import Primitive
from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.compiler.frontend.tracing import current_tracer
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType

__all__ = [
    "GELU",
    "BatchNorm1d",
    "BatchNorm2d",
    "Conv2d",
    "Dense",
    "Dropout",
    "Embedding",
    "Flatten",
    "LayerInputError",
    "LayerNorm",
    "LogSoftmax",
    "ReLU",
    "SequentialCell",
    "Sigmoid",
    "Softmax",
    "Tanh",
    "get_activation",
]


class LayerInputError(PcompileError, ValueError):
    """A layer was called on an input it cannot take (wrong rank, size or dtype)."""


# -- argument checks ----------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_positive_int(value: Any, name: str, owner: str) -> int:
    """`value` as an int > 0, else TypeError / ValueError naming `owner` and `name`."""
    if not _is_int(value):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{owner}: {name} must be > 0, got {value!r}")
    return int(value)


def check_bool(value: Any, name: str, owner: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_number(value: Any, name: str, owner: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _int_tuple(value: Any, length: int, name: str, owner: str, minimum: int) -> tuple[int, ...]:
    """An int (repeated `length` times) or a tuple of `length` ints, each >= `minimum`."""
    items = (value,) * length if _is_int(value) else value
    if not isinstance(items, (tuple, list)) or len(items) != length or not all(
        _is_int(v) for v in items
    ):
        raise TypeError(
            f"{owner}: {name} must be an int or a tuple of {length} ints, got {value!r}"
        )
    if min(items) < minimum:
        raise ValueError(f"{owner}: every value of {name} must be >= {minimum}, got {value!r}")
    return tuple(int(v) for v in items)


def _dtype(value: Any, name: str, owner: str) -> DType:
    try:
        return DType.from_any(value)
    except TypeError as exc:
        raise TypeError(f"{owner}: {name}: {exc}") from None


def make_parameter(
    init: Any, shape: tuple[int, ...], dtype: DType, name: str, owner: str
) -> Parameter:
    """`Parameter(initializer(init, shape, dtype), name=name)`, with `owner` in errors."""
    if isinstance(init, Tensor):
        init = init.asnumpy()
    try:
        data = initializer(init, shape, dtype)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{owner}: {name}: {exc}") from None
    return Parameter(data, name=name)


def _input_error(cell: Cell, message: str) -> LayerInputError:
    tracer = current_tracer()
    where = f" in scope {tracer.scope}" if tracer is not None else ""
    return LayerInputError(f"{cell!r}{where}: {message}")


# -- activations --------------------------------------------------------------------------------


class ReLU(Cell):
    """max(x, 0), element-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = ops.ReLU()

    def construct(self, x: Tensor) -> Tensor:
        return self.relu(x)


class GELU(Cell):
    """GeLU with the tanh approximation (MindSpore's default, `approximate=True`).

    The exact (erf) form is not available yet; `approximate=False` raises ValueError."""

    def __init__(self, approximate: bool = True) -> None:
        super().__init__()
        if not check_bool(approximate, "approximate", "GELU"):
            raise ValueError(
                "GELU: approximate=False (the erf form) is not supported yet; use the default "
                "tanh approximation (approximate=True)"
            )
        self.approximate = True
        self.gelu = ops.GeLU()

    def construct(self, x: Tensor) -> Tensor:
        return self.gelu(x)


class Tanh(Cell):
    """tanh(x), element-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.tanh = ops.Tanh()

    def construct(self, x: Tensor) -> Tensor:
        return self.tanh(x)


class Sigmoid(Cell):
    """1 / (1 + exp(-x)), element-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, x: Tensor) -> Tensor:
        return self.sigmoid(x)


class SiLU(Cell):
    """x * sigmoid(x), element-wise (also called swish)."""

    def __init__(self) -> None:
        super().__init__()
        self.silu = ops.SiLU()

    def construct(self, x: Tensor) -> Tensor:
        return self.silu(x)


def _axis_arg(axis: Any, owner: str) -> int | tuple[int, ...]:
    if _is_int(axis):
        return int(axis)
    if isinstance(axis, (tuple, list)) and axis and all(_is_int(a) for a in axis):
        return tuple(int(a) for a in axis)
    raise TypeError(f"{owner}: axis must be an int or a non-empty tuple of ints, got {axis!r}")


class Softmax(Cell):
    """exp(x) / sum(exp(x)) over `axis` (an int or a tuple of ints; default -1)."""

    def __init__(self, axis: int | tuple[int, ...] = -1) -> None:
        super().__init__()
        self.axis = _axis_arg(axis, "Softmax")
        self.softmax = ops.Softmax(self.axis)

    def construct(self, x: Tensor) -> Tensor:
        return self.softmax(x)


class LogSoftmax(Cell):
    """log(softmax(x)) over `axis` (default -1)."""

    def __init__(self, axis: int = -1) -> None:
        super().__init__()
        if not _is_int(axis):
            raise TypeError(f"LogSoftmax: axis must be an int, got {axis!r}")
        self.axis = int(axis)
        self.log_softmax = ops.LogSoftmax(self.axis)

    def construct(self, x: Tensor) -> Tensor:
        return self.log_softmax(x)


_ACTIVATIONS: dict[str, type[Cell]] = {
    "relu": ReLU,
    "gelu": GELU,
    "tanh": Tanh,
    "sigmoid": Sigmoid,
    "silu": SiLU,
    "softmax": Softmax,
    "logsoftmax": LogSoftmax,
}


class _PrimitiveActivation(Cell):
    """Wraps a user primitive given as `activation=ops.ReLU()`."""

    def __init__(self, prim: Primitive) -> None:
        super().__init__()
        self.prim = prim

    def construct(self, x: Tensor) -> Tensor:
        return self.prim(x)


def get_activation(activation: Any, owner: str = "get_activation") -> Cell | None:
    """An activation Cell from a name ('relu', 'gelu', 'tanh', 'sigmoid', 'silu', 'softmax',
    'logsoftmax'), a Cell, a primitive, or None."""
    if activation is None or isinstance(activation, Cell):
        return activation
    if isinstance(activation, Primitive):
        return _PrimitiveActivation(activation)
    if isinstance(activation, str):
        cls = _ACTIVATIONS.get(activation.lower())
        if cls is None:
            raise ValueError(
                f"{owner}: unknown activation {activation!r}; supported: "
                f"{', '.join(_ACTIVATIONS)}, a Cell, a primitive or None"
            )
        return cls()
    raise TypeError(
        f"{owner}: activation must be a str, a Cell, a primitive or None, got "
        f"{type(activation).__name__} {activation!r}"
    )


# -- Dense ----------------------------------------------------------------------------------------


class Dense(Cell):
    """Fully connected layer: `activation(x @ weight^T + bias)`.

    `weight` has shape (out_channels, in_channels) and `bias` (out_channels,), as in MindSpore.
    Inputs of any rank >= 1 with last dim `in_channels` are accepted: they are reshaped to 2-D,
    multiplied, and reshaped back to `x.shape[:-1] + (out_channels,)`.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        weight_init: Any = "normal",
        bias_init: Any = "zeros",
        has_bias: bool = True,
        activation: Any = None,
        dtype: Any = DType.float32,
    ) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels", "Dense")
        self.out_channels = check_positive_int(out_channels, "out_channels", "Dense")
        self.has_bias = check_bool(has_bias, "has_bias", "Dense")
        param_dtype = _dtype(dtype, "dtype", "Dense")
        self.weight = make_parameter(
            weight_init, (self.out_channels, self.in_channels), param_dtype, "weight", "Dense"
        )
        self.bias = (
            make_parameter(bias_init, (self.out_channels,), param_dtype, "bias", "Dense")
            if self.has_bias
            else None
        )
        self.reshape = ops.Reshape()
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.BiasAdd()
        self.activation = get_activation(activation, "Dense")
        self.activation_flag = self.activation is not None

    def construct(self, x: Tensor) -> Tensor:
        shape = tuple(x.shape)
        if not shape or shape[-1] != self.in_channels:
            raise _input_error(
                self,
                f"the input's last dim must be in_channels={self.in_channels}, got an input of "
                f"shape {shape}",
            )
        if len(shape) != 2:
            x = self.reshape(x, (math.prod(shape[:-1]), self.in_channels))
        x = self.matmul(x, self.weight)
        if self.bias is not None:
            x = self.bias_add(x, self.bias)
        if self.activation is not None:
            x = self.activation(x)
        if len(shape) != 2:
            x = self.reshape(x, shape[:-1] + (self.out_channels,))
        return x

    def __repr__(self) -> str:
        return (
            f"Dense(in_channels={self.in_channels}, out_channels={self.out_channels}, "
            f"has_bias={self.has_bias})"
        )


# -- Embedding -------------------------------------------------------------------------------------


class Embedding(Cell):
    """A lookup table: `embedding_table[ids]`, output shape `ids.shape + (embedding_size,)`.

    `dtype` is the dtype of the ids (int32 or int64). With `use_one_hot=True` the lookup is
    `one_hot(ids) @ embedding_table` (a MatMul, which some parallel strategies prefer); otherwise
    a Gather. `padding_idx`, when given, zeroes that row of the initial table (as MindSpore)."""

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        use_one_hot: bool = False,
        embedding_table: Any = "normal",
        dtype: Any = DType.int32,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = check_positive_int(vocab_size, "vocab_size", "Embedding")
        self.embedding_size = check_positive_int(embedding_size, "embedding_size", "Embedding")
        self.use_one_hot = check_bool(use_one_hot, "use_one_hot", "Embedding")
        self.dtype = _dtype(dtype, "dtype", "Embedding")
        if self.dtype not in (DType.int32, DType.int64):
            raise TypeError(f"Embedding: dtype (of the ids) must be int32 or int64, got {dtype!r}")
        if padding_idx is not None:
            if not _is_int(padding_idx):
                raise TypeError(
                    f"Embedding: padding_idx must be an int or None, got {padding_idx!r}"
                )
            if not -self.vocab_size <= padding_idx < self.vocab_size:
                raise ValueError(
                    f"Embedding: padding_idx must be in [{-self.vocab_size}, {self.vocab_size}), "
                    f"got {padding_idx}"
                )
            padding_idx = int(padding_idx) % self.vocab_size
        self.padding_idx = padding_idx
        table = make_parameter(
            embedding_table,
            (self.vocab_size, self.embedding_size),
            DType.float32,
            "embedding_table",
            "Embedding",
        )
        if padding_idx is not None:
            table.set_data(table.source.with_zero_rows([padding_idx]))
        self.embedding_table = table
        self.gather = ops.Gather()
        self.reshape = ops.Reshape()
        self.one_hot = ops.OneHot()
        self.array_mul = ops.MatMul()

    def construct(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (DType.int32, DType.int64):
            raise _input_error(
                self, f"the ids must be int32 or int64, got {ids.dtype.value} of shape {ids.shape}"
            )
        if not self.use_one_hot:
            return self.gather(self.embedding_table, ids, 0)
        shape = tuple(ids.shape)
        flat = self.reshape(ids, (math.prod(shape),))
        on = Tensor(np.ones((), self.embedding_table.dtype.np))
        off = Tensor(np.zeros((), self.embedding_table.dtype.np))
        hot = self.one_hot(flat, self.vocab_size, on, off)
        out = self.array_mul(hot, self.embedding_table)
        return self.reshape(out, shape + (self.embedding_size,))

    def __repr__(self) -> str:
        return (
            f"Embedding(vocab_size={self.vocab_size}, embedding_size={self.embedding_size}, "
            f"use_one_hot={self.use_one_hot})"
        )


# -- LayerNorm -------------------------------------------------------------------------------------


class LayerNorm(Cell):
    """Layer normalisation over the dims from `begin_norm_axis` on:
    `(x - mean) / sqrt(var + epsilon) * gamma + beta`; `gamma` and `beta` have shape
    `normalized_shape`, which must equal `x.shape[begin_params_axis:]`."""

    def __init__(
        self,
        normalized_shape: Sequence[int],
        begin_norm_axis: int = -1,
        begin_params_axis: int = -1,
        gamma_init: Any = "ones",
        beta_init: Any = "zeros",
        epsilon: float = 1e-7,
        dtype: Any = DType.float32,
    ) -> None:
        super().__init__()
        if not isinstance(normalized_shape, (tuple, list)):
            raise TypeError(
                "LayerNorm: normalized_shape must be a tuple or list of ints such as (hidden,), "
                f"got {type(normalized_shape).__name__} {normalized_shape!r}"
            )
        self.normalized_shape = tuple(
            check_positive_int(d, "normalized_shape", "LayerNorm") for d in normalized_shape
        )
        for name, value in (("begin_norm_axis", begin_norm_axis),
                            ("begin_params_axis", begin_params_axis)):
            if not _is_int(value):
                raise TypeError(f"LayerNorm: {name} must be an int, got {value!r}")
        self.begin_norm_axis = int(begin_norm_axis)
        self.begin_params_axis = int(begin_params_axis)
        self.epsilon = check_number(epsilon, "epsilon", "LayerNorm")
        if self.epsilon <= 0:
            raise ValueError(f"LayerNorm: epsilon must be > 0, got {epsilon!r}")
        param_dtype = _dtype(dtype, "dtype", "LayerNorm")
        self.gamma = make_parameter(
            gamma_init, self.normalized_shape, param_dtype, "gamma", "LayerNorm"
        )
        self.beta = make_parameter(
            beta_init, self.normalized_shape, param_dtype, "beta", "LayerNorm"
        )
        self.layer_norm = ops.LayerNorm(
            self.begin_norm_axis, self.begin_params_axis, self.epsilon
        )

    def construct(self, x: Tensor) -> Tensor:
        rank = len(x.shape)
        for name, axis in (("begin_norm_axis", self.begin_norm_axis),
                           ("begin_params_axis", self.begin_params_axis)):
            if not -rank <= axis < rank:
                raise _input_error(
                    self, f"{name}={axis} is out of range for an input of shape {x.shape}"
                )
        want = tuple(x.shape[self.begin_params_axis % rank:])
        if want != self.normalized_shape:
            raise _input_error(
                self,
                f"normalized_shape {self.normalized_shape} must equal the input's dims from "
                f"begin_params_axis={self.begin_params_axis} on, {want} (input shape {x.shape})",
            )
        return self.layer_norm(x, self.gamma, self.beta)[0]

    def __repr__(self) -> str:
        return (
            f"LayerNorm(normalized_shape={self.normalized_shape}, "
            f"begin_norm_axis={self.begin_norm_axis}, "
            f"begin_params_axis={self.begin_params_axis}, epsilon={self.epsilon})"
        )


# -- Conv2d ----------------------------------------------------------------------------------------


class Conv2d(Cell):
    """2-D convolution (cross-correlation) over NCHW inputs, MindSpore's `nn.Conv2d`.

    `weight` has shape (out_channels, in_channels / group, kh, kw). `pad_mode` is 'same'
    (output size ceil(in / stride), extra padding at the bottom and right), 'valid' (no
    padding) or 'pad' (explicit `padding`: an int or (top, bottom, left, right))."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        pad_mode: str = "same",
        padding: int | tuple[int, int, int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        group: int = 1,
        has_bias: bool = False,
        weight_init: Any = "normal",
        bias_init: Any = "zeros",
        data_format: str = "NCHW",
        dtype: Any = DType.float32,
    ) -> None:
        super().__init__()
        owner = "Conv2d"
        self.in_channels = check_positive_int(in_channels, "in_channels", owner)
        self.out_channels = check_positive_int(out_channels, "out_channels", owner)
        self.kernel_size = _int_tuple(kernel_size, 2, "kernel_size", owner, 1)
        self.stride = _int_tuple(stride, 2, "stride", owner, 1)
        self.dilation = _int_tuple(dilation, 2, "dilation", owner, 1)
        self.padding = _int_tuple(padding, 4, "padding", owner, 0)
        if not isinstance(pad_mode, str) or pad_mode.lower() not in ("same", "valid", "pad"):
            raise ValueError(
                f"{owner}: pad_mode must be 'same', 'valid' or 'pad', got {pad_mode!r}"
            )
        self.pad_mode = pad_mode.lower()
        if self.pad_mode != "pad" and any(self.padding):
            raise ValueError(
                f"{owner}: padding must be 0 when pad_mode is {self.pad_mode!r}, got {padding!r}; "
                "use pad_mode='pad' for explicit padding"
            )
        self.group = check_positive_int(group, "group", owner)
        if self.in_channels % self.group or self.out_channels % self.group:
            raise ValueError(
                f"{owner}: in_channels ({self.in_channels}) and out_channels "
                f"({self.out_channels}) must both be divisible by group ({self.group})"
            )
        if data_format != "NCHW":
            raise ValueError(f"{owner}: only data_format='NCHW' is supported, got {data_format!r}")
        self.data_format = data_format
        self.has_bias = check_bool(has_bias, "has_bias", owner)
        param_dtype = _dtype(dtype, "dtype", owner)
        shape = (self.out_channels, self.in_channels // self.group) + self.kernel_size
        self.weight = make_parameter(weight_init, shape, param_dtype, "weight", owner)
        self.bias = (
            make_parameter(bias_init, (self.out_channels,), param_dtype, "bias", owner)
            if self.has_bias
            else None
        )
        self.conv2d = ops.Conv2D(
            out_channel=self.out_channels,
            kernel_size=self.kernel_size,
            mode=1,
            pad_mode=self.pad_mode,
            pad=self.padding,
            stride=self.stride,
            dilation=self.dilation,
            group=self.group,
        )
        self.bias_add = ops.BiasAdd()

    def construct(self, x: Tensor) -> Tensor:
        if len(x.shape) != 4 or x.shape[1] != self.in_channels:
            raise _input_error(
                self,
                f"expects an NCHW input with C = in_channels = {self.in_channels}, got shape "
                f"{x.shape}",
            )
        out = self.conv2d(x, self.weight)
        if self.bias is not None:
            out = self.bias_add(out, self.bias)
        return out

    def __repr__(self) -> str:
        return (
            f"Conv2d(in_channels={self.in_channels}, out_channels={self.out_channels}, "
            f"kernel_size={self.kernel_size}, stride={self.stride}, pad_mode={self.pad_mode!r})"
        )


# -- shape and regularisation layers ---------------------------------------------------------------


class Flatten(Cell):
    """Flattens dims `start_dim..end_dim` into one (default: all but the batch dim, giving
    (N, prod(rest)), as MindSpore's `nn.Flatten()`)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        for name, value in (("start_dim", start_dim), ("end_dim", end_dim)):
            if not _is_int(value):
                raise TypeError(f"Flatten: {name} must be an int, got {value!r}")
        self.start_dim = int(start_dim)
        self.end_dim = int(end_dim)
        self.flatten = ops.Flatten()
        self.reshape = ops.Reshape()

    def construct(self, x: Tensor) -> Tensor:
        shape = tuple(x.shape)
        rank = max(len(shape), 1)
        if not (-rank <= self.start_dim < rank and -rank <= self.end_dim < rank):
            raise _input_error(
                self,
                f"start_dim={self.start_dim} and end_dim={self.end_dim} must lie in "
                f"[{-rank}, {rank}) for an input of shape {shape}",
            )
        start, end = self.start_dim % rank, self.end_dim % rank
        if start > end:
            raise _input_error(
                self, f"start_dim={self.start_dim} comes after end_dim={self.end_dim}"
            )
        if start == 1 and end == len(shape) - 1 and len(shape) >= 2:
            return self.flatten(x)
        new = shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]
        return self.reshape(x, new)


class Dropout(Cell):
    """MindSpore's `nn.Dropout(keep_prob=None, p=None, dtype=float32)`: while training, each
    element is kept with probability `keep_prob` (or `1 - p`; p=0.5 when neither is given) and
    scaled by 1 / keep_prob, the others are 0; outside training (and with nothing to drop) the
    input passes through. The mask is `ops.Dropout`'s (compiler/frontend/dropout.py): drawn anew
    every step, and the same for every parallel plan as for one device. The seeds are MindSpore's
    `_get_graph_seed(0, "dropout")`: 0 and 0, so the op takes the global seed and its place
    among the program's random ops (compiler/frontend/random_state.py)."""

    def __init__(
        self, keep_prob: float | None = None, p: float | None = None,
        dtype: Any = DType.float32
    ) -> None:
        super().__init__()
        if keep_prob is None and p is None:
            p = 0.5
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise TypeError(f"Dropout: p must be a float or int, got {type(p).__name__} "
                                f"{p!r}")
            if not 0.0 <= p < 1.0:
                raise ValueError(f"Dropout: p must be in [0, 1), got {p!r}")
            keep = 1.0 - float(p)
        else:
            if isinstance(keep_prob, bool) or not isinstance(keep_prob, float):
                raise TypeError(f"Dropout: keep_prob must be a float, got "
                                f"{type(keep_prob).__name__} {keep_prob!r}")
            if not 0.0 < keep_prob <= 1.0:
                raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob!r}")
            keep = float(keep_prob)
        self.keep_prob = keep
        self.p = 1.0 - keep
        self.dtype = _dtype(dtype, "dtype", "Dropout")
        from pcompile.compiler.frontend.ops import Dropout as DropoutOp

        self.dropout = DropoutOp(keep, 0, 0)

    def construct(self, x: Tensor) -> Tensor:
        if not self.training or self.keep_prob == 1.0:
            return x
        out, _ = self.dropout(x)
        return out


# -- containers ------------------------------------------------------------------------------------


class SequentialCell(Cell):
    """Calls its cells in order. Built from cells (`SequentialCell(a, b)`), a list of cells
    (`SequentialCell([a, b])`), or an OrderedDict of named cells. Children are named "0", "1",
    ... (or by the dict's keys), so their parameters are `0.weight`, `1.weight`, ..."""

    def __init__(self, *args: Any) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], (dict, OrderedDict)):
            items = list(args[0].items())
        else:
            single = len(args) == 1 and isinstance(args[0], (list, tuple))
            cells = list(args[0]) if single else list(args)
            items = [(str(i), c) for i, c in enumerate(cells)]
        for name, cell in items:
            self._add(name, cell)

    def _add(self, name: Any, cell: Any) -> None:
        if not isinstance(cell, Cell):
            raise TypeError(
                f"SequentialCell: every item must be a Cell, got {type(cell).__name__} {cell!r} "
                f"for {name!r}"
            )
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"SequentialCell: cell names must be non-empty strings without '.', "
                             f"got {name!r}")
        if name in self.name_cells():
            raise ValueError(f"SequentialCell: duplicate cell name {name!r}")
        setattr(self, name, cell)

    def append(self, cell: Cell) -> SequentialCell:
        """Add `cell` at the end (named by its position)."""
        self._add(str(len(self.name_cells())), cell)
        return self

    def __len__(self) -> int:
        return len(self.name_cells())

    def __iter__(self) -> Iterator[Cell]:
        return iter(self.name_cells().values())

    def __getitem__(self, index: int | slice) -> Cell:
        cells = list(self.name_cells().values())
        if isinstance(index, slice):
            return SequentialCell(cells[index])
        if not _is_int(index):
            raise TypeError(f"SequentialCell indices must be ints or slices, got {index!r}")
        if not -len(cells) <= index < len(cells):
            raise IndexError(f"SequentialCell index {index} out of range for {len(cells)} cells")
        return cells[index]

    def construct(self, x: Any) -> Any:
        for cell in self.name_cells().values():
            x = cell(x)
        return x


class CellList(Cell):
    """A list of cells, as MindSpore's `nn.CellList`: the network calls its cells itself
    (`for layer in self.layers: x = layer(x)` or `self.layers[i](x)`); the list is never called.
    Children are named "0", "1", ... so their parameters are `layers.0.weight`, ..., and their
    scopes `.../layers-CellList/0-Block/...`, as in MindSpore's dumps."""

    def __init__(self, args: Any = None, auto_prefix: bool = True) -> None:
        super().__init__(auto_prefix=auto_prefix)
        if args is not None:
            self.extend(args)

    def _check(self, cell: Any, where: str) -> Cell:
        if not isinstance(cell, Cell):
            raise TypeError(f"CellList{where}: every item must be a Cell, got "
                            f"{type(cell).__name__} {cell!r}")
        return cell

    def _reset(self, cells: list[Cell]) -> None:
        """Rename the children to their positions after an insert or delete."""
        for name in list(self._cells):
            delattr(self, name)
        for i, cell in enumerate(cells):
            object.__setattr__(cell, "_attr_name", "")
            self._put(str(i), cell)

    def _put(self, name: str, cell: Cell) -> None:
        setattr(self, name, cell)
        object.__setattr__(cell, "_container", self)

    def _index(self, index: Any) -> int:
        if not _is_int(index):
            raise TypeError(f"CellList indices must be ints or slices, got {index!r}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"CellList index {index} out of range for {n} cells")
        return int(index) % n

    def append(self, cell: Cell) -> CellList:
        self._put(str(len(self)), self._check(cell, ".append"))
        return self

    def extend(self, cells: Any) -> CellList:
        if isinstance(cells, Cell) or not hasattr(cells, "__iter__"):
            raise TypeError(f"CellList.extend: expected a list of cells, got "
                            f"{type(cells).__name__}")
        for cell in cells:
            self.append(cell)
        return self

    def insert(self, index: int, cell: Cell) -> None:
        cells = list(self)
        if not _is_int(index):
            raise TypeError(f"CellList indices must be ints, got {index!r}")
        cells.insert(index, self._check(cell, ".insert"))
        self._reset(cells)

    def __len__(self) -> int:
        return len(self._cells)

    def __iter__(self) -> Iterator[Cell]:
        return iter(list(self._cells.values()))

    def __getitem__(self, index: int | slice) -> Any:
        cells = list(self._cells.values())
        if isinstance(index, slice):
            # A view: the cells keep their names and scopes in this list.
            view = CellList()
            for i, cell in enumerate(cells[index]):
                setattr(view, str(i), cell)
            return view
        return cells[self._index(index)]

    def __setitem__(self, index: int, cell: Cell) -> None:
        cells = list(self)
        cells[self._index(index)] = self._check(cell, "[...] =")
        self._reset(cells)

    def __delitem__(self, index: int | slice) -> None:
        cells = list(self)
        if isinstance(index, slice):
            del cells[index]
        else:
            del cells[self._index(index)]
        self._reset(cells)

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a CellList is a container and cannot be called; call its cells instead "
            "(for cell in self.layers: x = cell(x))"
        )


# -- batch normalisation --------------------------------------------------------------------------


class _BatchNorm(Cell):
    """MindSpore's `nn.BatchNorm1d` / `nn.BatchNorm2d(num_features, eps=1e-5, momentum=0.9,
    affine=True, gamma_init="ones", beta_init="zeros", moving_mean_init="zeros",
    moving_var_init="ones", use_batch_statistics=None, data_format="NCHW", dtype=float32)`:
    per-channel normalisation by the batch's statistics while training (updating
    `moving_mean` / `moving_variance`: moving = momentum * moving + (1 - momentum) * batch), by
    the moving ones otherwise (`use_batch_statistics` True / False forces one); `gamma` and
    `beta` trained when `affine`. The op is `ops.BatchNorm` (compiler/frontend/batch_norm.py)."""

    RANK = 4

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.9,
                 affine: bool = True, gamma_init: Any = "ones", beta_init: Any = "zeros",
                 moving_mean_init: Any = "zeros", moving_var_init: Any = "ones",
                 use_batch_statistics: bool | None = None, data_format: str = "NCHW",
                 dtype: Any = DType.float32) -> None:
        super().__init__()
        owner = type(self).__name__
        channels = check_positive_int(num_features, "num_features", owner)
        eps = check_number(eps, "eps", owner)
        momentum = check_number(momentum, "momentum", owner)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{owner}: momentum must be in [0, 1], got {momentum!r}")
        if eps <= 0:
            raise ValueError(f"{owner}: eps must be > 0, got {eps!r}")
        if not isinstance(affine, bool):
            raise TypeError(f"{owner}: affine must be a bool, got {affine!r}")
        if use_batch_statistics is not None and not isinstance(use_batch_statistics, bool):
            raise TypeError(f"{owner}: use_batch_statistics must be None or a bool, got "
                            f"{use_batch_statistics!r}")
        if data_format != "NCHW":
            raise ValueError(f"{owner}: data_format must be 'NCHW' (pcompile has no NHWC "
                             f"layout), got {data_format!r}")
        param_dtype = _dtype(dtype, "dtype", owner)
        self.num_features = channels
        self.eps = eps
        self.momentum = momentum
        self.use_batch_statistics = use_batch_statistics
        self.gamma = make_parameter(gamma_init, (channels,), param_dtype, "gamma", owner)
        self.beta = make_parameter(beta_init, (channels,), param_dtype, "beta", owner)
        self.gamma.requires_grad = self.beta.requires_grad = affine
        self.moving_mean = make_parameter(moving_mean_init, (channels,), param_dtype,
                                          "moving_mean", owner)
        self.moving_variance = make_parameter(moving_var_init, (channels,), param_dtype,
                                              "moving_variance", owner)
        for p in (self.moving_mean, self.moving_variance):
            p.requires_grad = False
            p.parallel_optimizer = False
        # MindSpore's op momentum is the weight of the batch: 1 - the cell's
        self.bn_train = ops.BatchNorm(True, eps, 1.0 - momentum)
        self.bn_infer = ops.BatchNorm(False, eps, 1.0 - momentum)

    def construct(self, x: Tensor) -> Tensor:
        if len(x.shape) != self.RANK:
            dims = "(N, C, H, W)" if self.RANK == 4 else "(N, C)"
            raise _input_error(self, f"expects a {self.RANK}-D input {dims}, got shape "
                                     f"{tuple(x.shape)}")
        training = (self.training if self.use_batch_statistics is None
                    else self.use_batch_statistics)
        bn = self.bn_train if training else self.bn_infer
        return bn(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)[0]


class BatchNorm2d(_BatchNorm):
    """`nn.BatchNorm2d`: x (N, C, H, W), statistics over N, H and W (see `_BatchNorm`)."""

    RANK = 4


class BatchNorm1d(_BatchNorm):
    """`nn.BatchNorm1d`: x (N, C), statistics over N (see `_BatchNorm`)."""

    RANK = 2
