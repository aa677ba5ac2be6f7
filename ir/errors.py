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
            detail += f"; strategy {format_strategy(strategy)}"
        if hint:
            detail += f". {hint}"
        super().__init__(f"{where}: {detail}")
        self.op = op
        self.instance_name = instance_name
        self.scope = scope
        self.source = source


def format_strategy(strategy: Any) -> str:
    """A strategy as the user wrote it: tuples of splits, or a Layout (its dict form) as
    `Layout(device_matrix, alias_name)(tensor map by alias)`."""
    if isinstance(strategy, tuple) and any(_is_layout(s) for s in strategy):
        items = [_fmt_layout(s) if _is_layout(s) else str(s) for s in strategy]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return _fmt_layout(strategy) if _is_layout(strategy) else str(strategy)


def _is_layout(value: Any) -> bool:
    return isinstance(value, dict) and "device_matrix" in value and "tensor_map" in value


def _fmt_layout(spec: dict[str, Any]) -> str:
    dev = tuple(spec["device_matrix"])
    alias = tuple(spec.get("alias_name") or (f"axis{i}" for i in range(len(dev))))

    def name(v: Any) -> str:
        if isinstance(v, tuple):
            return "(" + ", ".join(name(x) for x in v) + ")"
        return '"None"' if v == -1 else f'"{alias[len(dev) - 1 - v]}"'

    entries = ", ".join(name(v) for v in spec["tensor_map"])
    names = ", ".join(f'"{a}"' for a in alias) + ("," if len(alias) == 1 else "")
    return f"Layout({_fmt(dev)}, ({names}))({entries})"


def _fmt(shape: Any) -> str:
    if isinstance(shape, tuple):
        return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    return str(shape)
