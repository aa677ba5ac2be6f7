"""Options of a backend's lowering that an op's implementation reads while it is lowered.

The backend that lowers a graph (`backends/jax/lowering.py`) decides them and makes them
current while the op implementations run (`lowering(options)`); an op reads them with
`current_lowering()`. Ops read no environment or global context of their own.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class LoweringOptions:
    """`fused_attention`: attention may use a fused vendor kernel (cuDNN's on GPUs) where it
    applies; False keeps it on XLA's computation (a way out should the kernel reject a
    configuration)."""

    fused_attention: bool = True


_DEFAULT = LoweringOptions()
_CURRENT: contextvars.ContextVar[LoweringOptions | None] = contextvars.ContextVar(
    "pcompile_lowering", default=None)


def current_lowering() -> LoweringOptions:
    """The options of the lowering in progress (the defaults outside one)."""
    return _CURRENT.get() or _DEFAULT


@contextlib.contextmanager
def lowering(options: LoweringOptions) -> Iterator[LoweringOptions]:
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)
