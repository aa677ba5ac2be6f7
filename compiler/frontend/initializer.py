"""`initializer(init, shape, dtype)`: reproducible, lazily evaluated parameter data.

MindSpore's ``initializer("normal", [784, 512], ms.float32)`` returns a tensor whose data is
generated on first use. Here it returns an `InitializedData`: it knows its shape and dtype at
once and produces its numpy array on demand (``np.asarray(x)``, ``x.asnumpy()``,
``x.init_data()``), so compiling a large model never materialises weights it does not need.

Reproducibility: every random initializer call draws a ticket ``(seed, counter)`` at call time
(the global seed of `set_seed`, default 1, and a counter that `set_seed` resets to 0). The
values depend only on that ticket, the init, the shape and the dtype - never on when or how
often they are materialised. Constant inits (zeros, ones, numbers, arrays) take no ticket.

Any block of a tensor is generated on its own, equal to the same block of the whole tensor
(`InitializedData.block(bounds)`): element i (its flat C-order index in the whole tensor) takes
its random bits from a counter-based generator, Philox4x32-10 (Salmon et al., SC 2011) keyed by
the ticket, at counter (i, draw). So a rank materialises only its own slice of a parameter at
run time, and the slices of all ranks put together are the single-device initialisation
exactly. Uniforms take 53 bits; normals use the Box-Muller transform of two uniforms;
truncated normals redraw (the next `draw`) what falls outside [a, b]. The float64 arithmetic
from bits to values is program/init_math.py's: IEEE basic operations only (its own log and cos,
not a math library's), so the values are the same on every machine, and the device generator
(backends/jax/param_init.py) makes the same bits at device speed.

Supported inits: ``"normal"`` (sigma 0.01), ``"zeros"``, ``"ones"``, ``"uniform"`` (scale
0.07), ``"xavier_uniform"``, ``"he_uniform"``, ``"truncatednormal"`` (sigma 0.01), a number
(constant fill), a numpy array (its shape must match), or an instance of `Normal`, `Uniform`,
`XavierUniform`, `HeUniform`, `TruncatedNormal`, `Zero`, `One`, `Constant`.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from pcompile.ir.types import DType
from pcompile.program.initializers import (
    INIT_NAMES,
    NAMED_INITIALIZERS,
    Constant,
    HeUniform,
    InitializedData,
    Initializer,
    Normal,
    One,
    TruncatedNormal,
    Uniform,
    XavierUniform,
    Zero,
)

__all__ = [
    "Constant",
    "HeUniform",
    "InitializedData",
    "Initializer",
    "Normal",
    "One",
    "TruncatedNormal",
    "Uniform",
    "XavierUniform",
    "Zero",
    "get_seed",
    "initializer",
    "set_seed",
]

DEFAULT_SEED = 1

_lock = threading.Lock()
_seed = DEFAULT_SEED
_counter = 0


def set_seed(seed: int) -> None:
    """Set the global seed and restart the per-call counter (same seed -> same weights)."""
    global _seed, _counter
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"set_seed: seed must be an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"set_seed: seed must be in [0, 2**64), got {seed!r}")
    with _lock:
        _seed = int(seed)
        _counter = 0


def get_seed() -> int:
    """The global seed (1 unless `set_seed` was called)."""
    return _seed


def _next_ticket() -> tuple[int, int]:
    global _counter
    with _lock:
        ticket = (_seed, _counter)
        _counter += 1
    return ticket


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(
            f"initializer: shape must be a list or tuple of ints, got {type(shape).__name__} "
            f"{shape!r}"
        )
    for dim in shape:
        if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
            raise TypeError(f"initializer: shape must contain only ints, got {shape!r}")
        if dim <= 0:
            raise ValueError(f"initializer: every dim of shape must be > 0, got {shape!r}")
    return tuple(int(d) for d in shape)


def initializer(
    init: Any,
    shape: int | Sequence[int] | None = None,
    dtype: Any = DType.float32,
) -> InitializedData:
    """Data for a Parameter: `init` (a name, number, array or Initializer) of `shape`, `dtype`.

    Args:
        init: ``"normal"``, ``"zeros"``, ``"ones"``, ``"uniform"``, ``"xavier_uniform"``,
            ``"he_uniform"``, ``"truncatednormal"`` (case-insensitive), a number, a numpy array
            (or anything with ``asnumpy()``), or an `Initializer` instance.
        shape: the tensor shape; may be omitted for an array init (its own shape is used).
        dtype: an `ir.types.DType`, its name, or a numpy dtype. Default float32.
    """
    dtype = DType.from_any(dtype)
    if isinstance(init, InitializedData):
        init = init.to_numpy()
    elif hasattr(init, "asnumpy") and not isinstance(init, np.ndarray):
        init = init.asnumpy()
    if isinstance(init, np.ndarray):
        if shape is not None and tuple(init.shape) != _check_shape(shape):
            raise ValueError(
                f"initializer: the array has shape {tuple(init.shape)} but shape "
                f"{tuple(shape) if not isinstance(shape, int) else (shape,)} was requested"
            )
        array = np.array(init, copy=True)
        return InitializedData(None, tuple(array.shape), dtype, None, array)
    if shape is None:
        raise ValueError(f"initializer: shape is required for init {init!r}")
    dims = _check_shape(shape)
    if isinstance(init, str):
        cls = NAMED_INITIALIZERS.get(init.lower())
        if cls is None:
            raise ValueError(
                f"initializer: unknown init {init!r}; valid names: {', '.join(INIT_NAMES)}, "
                "or a number, a numpy array, or an Initializer such as Normal(sigma=0.02)"
            )
        init = cls()
    elif isinstance(init, (numbers.Number, np.bool_)) and not isinstance(init, complex):
        init = Constant(init)
    elif isinstance(init, type) and issubclass(init, Initializer):
        init = init()
    elif not isinstance(init, Initializer):
        raise TypeError(
            f"initializer: init must be a name ({', '.join(INIT_NAMES)}), a number, a numpy "
            f"array or an Initializer, got {type(init).__name__} {init!r}"
        )
    init.check(dims)  # fail now, not on first use
    ticket = _next_ticket() if init.random else None
    return InitializedData(init, dims, dtype, ticket)
