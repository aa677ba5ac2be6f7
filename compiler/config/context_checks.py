"""How a context option's value is checked, and how a bad one is reported: the field types
every family of options uses (numpy scalars accepted as the Python scalars they hold), the
conversion of a pydantic `ValidationError` into a `TypeError` / `ValueError` that names the
option, the value and what would be valid, unknown-name suggestions, and the lock that every
family of options (compiler/config/context.py, general_context.py, search_context.py) is set under.
"""

from __future__ import annotations

import difflib
import re
import threading
from collections.abc import Mapping
from typing import Annotated, Any

import numpy as np
from pydantic import (
    BeforeValidator,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

# One lock for every family of options, so that `context_override` saves and restores them
# together.
CONTEXT_LOCK = threading.RLock()


class ContextKeyError(KeyError, ValueError):
    """An unknown or missing key inside a dict-valued option.

    A `KeyError` (as MindSpore's comm_fusion) and a `ValueError` (as MindSpore's
    parallel_optimizer_config / strategy_ckpt_config), with a readable `str()`."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------------------------
# Field types
# --------------------------------------------------------------------------------------------


def unnumpy(value: Any) -> Any:
    """numpy scalars behave like the Python scalars they hold."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def to_float(value: Any) -> Any:
    value = unnumpy(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


Int = Annotated[StrictInt, BeforeValidator(unnumpy)]
Bool = Annotated[StrictBool, BeforeValidator(unnumpy)]
Float = Annotated[StrictFloat, BeforeValidator(to_float)]
Str = StrictStr

FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)

# Error types whose cause is the Python type of the value (-> TypeError).
_TYPE_ERRORS = frozenset(
    {
        "int_type",
        "bool_type",
        "float_type",
        "string_type",
        "dict_type",
        "list_type",
        "tuple_type",
        "model_type",
        "model_attributes_type",
        "dataclass_type",
        "is_instance_of",
        "none_required",
        "int_from_float",
        "int_parsing",
        "float_parsing",
        "bool_parsing",
    }
)


def describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def raise_clear(
    exc: ValidationError,
    where: str,
    hints: Mapping[str, str],
) -> None:
    """Turn a pydantic ValidationError into a TypeError/ValueError naming option and value."""
    lines = []
    all_type = True
    for error in exc.errors():
        path = ".".join(str(p) for p in error["loc"]) or "(options)"
        hint = hints.get(path) or hints.get(str(error["loc"][0]) if error["loc"] else "")
        msg = str(error.get("msg", ""))
        if msg.startswith("Value error, "):
            # Raised by our own validators: the message already says what is valid.
            msg = msg[len("Value error, ") :]
            lines.append(msg if msg.startswith(f"{where}:") else f"{where}: {msg}")
            all_type = False
            continue
        if error["type"] not in _TYPE_ERRORS:
            all_type = False
        expected = hint or msg
        if error["type"] == "missing":
            lines.append(f"{where}: option '{path}' is required; expected {expected}")
            continue
        if error["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown option '{path}'")
            continue
        suggestion = ""
        value = error.get("input")
        if error["type"] == "literal_error" and isinstance(value, str):
            choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
            close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
            suggestion = f" (did you mean {close[0]!r}?)" if close else ""
        lines.append(
            f"{where}: invalid value {describe(value)} for '{path}'; "
            f"expected {expected}{suggestion}"
        )
    message = "\n".join(lines)
    if all_type:
        raise TypeError(message) from None
    raise ValueError(message) from None


def unknown_name(where: str, name: str, valid: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ValueError(
        f"{where}: unknown option '{name}'.{hint} Valid options: {', '.join(sorted(valid))}"
    )


def check_dict_keys(where: str, option: str, value: Any, valid: tuple[str, ...]) -> dict:
    """A dict-valued option: the value must be a dict whose keys are all known."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where}: option '{option}' must be a dict with keys among {list(valid)}, got "
            f"{describe(value)}"
        )
    unknown = [k for k in value if k not in valid]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ContextKeyError(
            f"{where}: unknown key {key!r} in '{option}'.{hint} Valid keys: {list(valid)}"
        )
    return dict(value)
