"""`jax`, `jax.numpy` and `jax.lax` for the ops' JAX implementations, imported on first use.

Compiling never runs a JAX implementation (the numpy interpreter, the check and the rank
programs do), so the registry must not import JAX when it loads: importing JAX costs about a
second on every compile. The ops write `jnp.add(x, y)` as usual; the first attribute access
imports the module.
"""

from __future__ import annotations

import importlib
from typing import Any


class _LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Any = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name}>"


def deferred(module: Any, name: str) -> Any:
    """`module.name` as a function that looks it up when called (for tables built at import)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(module, name)(*args, **kwargs)

    call.__name__ = name
    return call


jax: Any = _LazyModule("jax")
jnp: Any = _LazyModule("jax.numpy")
lax: Any = _LazyModule("jax.lax")
