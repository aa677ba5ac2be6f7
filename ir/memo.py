"""Keys for memoising functions of attribute values.

Python's equality conflates values that print and infer differently (`True == 1 == 1.0`,
`0.0 == -0.0`), so a memo keyed by the values themselves would hand one of them the other's
result. `typed_key(value)` keys by type as well, recursively through tuples; it raises
TypeError for values that cannot be keys (lists, dicts, arrays), and callers then skip the memo.
"""

from __future__ import annotations

from typing import Any

_PLAIN_INTS = frozenset({int})


def typed_key(value: Any) -> Any:
    """A hashable key that is equal only for values of the same types and the same values."""
    if isinstance(value, tuple):
        if _PLAIN_INTS.issuperset(map(type, value)):  # shapes, axes, rank lists: the common case
            return (tuple, int, value)
        return (tuple, tuple(typed_key(v) for v in value))
    if isinstance(value, float):
        return (float, value.hex())  # tells 0.0 from -0.0; nan keys equal each other
    hash(value)
    return (type(value), value)


def items_key(mapping: dict[str, Any]) -> tuple[Any, ...]:
    """`typed_key` of a dict's items, in order."""
    return tuple((k, typed_key(v)) for k, v in mapping.items())
