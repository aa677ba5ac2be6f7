"""Errors a user sees. Every compile-time failure that the user can fix is a `PcompileError`
whose message names the op, its scope and source line, the shapes and the strategy, and what
would be valid; the CLI prints it as one paragraph and exits non-zero."""

from __future__ import annotations

from typing import Any


class PcompileError(Exception):
    """A problem in the user's model, options or input that the user can fix."""


class ShapeError(Exception):
    """Raised by an op's inference rule; the builder turns it into an `OpError`."""


class OpError(PcompileError):
    """An op rejected its operands, attributes or strategy."""

    def __init__(
        self,
        op: str,
        message: str,
        *,
        instance_name: str = "",
        scope: str = "",
        source: Any = None,
        shapes: list[Any] | None = None,
        strategy: Any = None,
        hint: str = "",
    ) -> None:
        parts = [f"{op}"]
        if instance_name:
            parts[0] += f" '{instance_name}'"
        if scope:
            parts.append(f"in scope {scope}")
        if source is not None:
            text = getattr(source, "text", "").strip()
            parts.append(f"at {source}" + (f" (`{text}`)" if text else ""))
        where = " ".join(parts)
        detail = message
        if shapes is not None:
            detail += f"; input shapes {', '.join(_fmt(s) for s in shapes)}"
        if strategy is not None:
            detail += f"; strategy {strategy}"
        if hint:
            detail += f". {hint}"
        super().__init__(f"{where}: {detail}")
        self.op = op
        self.instance_name = instance_name
        self.scope = scope
        self.source = source


def _fmt(shape: Any) -> str:
    if isinstance(shape, tuple):
        return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    return str(shape)
