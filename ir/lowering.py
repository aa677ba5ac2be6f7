"""Options of a backend's lowering that an op's implementation reads while it is lowered, and a
memo that lives as long as one lowering.

The backend that lowers a graph (`backends/jax/lowering.py`, `backends/jax/spmd.py`) decides the
options and makes them current while the op implementations run (`lowering(options)`, entered
once per trace of a graph); an op reads them with `current_lowering()`. Ops read no environment
or global context of their own.

`lowering_memo()` is a dict made fresh by each `lowering(...)` and dropped when it ends: what one
op's implementation leaves there, a later op of the same trace may reuse (FlashAttentionScore
leaves its pullback, FlashAttentionScoreGrad runs it instead of computing the forward again).
Whatever an op stores must check, when it is read, that it belongs to the values it is given
(the same traced arrays): a graph's ops also run inside inner traces (`lax.switch` branches).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LoweringOptions:
    """`fused_attention`: attention may use a fused vendor kernel (cuDNN's on GPUs) where it
    applies; False keeps it on XLA's computation (a way out should the kernel reject a
    configuration)."""

    fused_attention: bool = True


@dataclass
class _Scope:
    options: LoweringOptions
    memo: dict[Any, Any] = field(default_factory=dict)


_DEFAULT = LoweringOptions()
_CURRENT: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "pcompile_lowering", default=None)


def current_lowering() -> LoweringOptions:
    """The options of the lowering in progress (the defaults outside one)."""
    scope = _CURRENT.get()
    return _DEFAULT if scope is None else scope.options


def lowering_memo() -> dict[Any, Any] | None:
    """The memo of the lowering in progress; None outside one (nothing is kept)."""
    scope = _CURRENT.get()
    return None if scope is None else scope.memo


@contextlib.contextmanager
def lowering(options: LoweringOptions) -> Iterator[LoweringOptions]:
    token = _CURRENT.set(_Scope(options))
    try:
        yield options
    finally:
        _CURRENT.reset(token)
