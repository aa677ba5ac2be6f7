"""Lowering of IR graphs to JAX.

`lower_graph` (one graph, one device) is imported lazily, so that the JAX-free parts of this
package (`backends.jax.plan`, `backends.jax.codegen`) load without importing JAX.
"""

from __future__ import annotations

from typing import Any

__all__ = ["lower_graph"]


def __getattr__(name: str) -> Any:
    if name == "lower_graph":
        from pcompile.backends.jax.lowering import lower_graph

        return lower_graph
    raise AttributeError(f"module 'backends.jax' has no attribute {name!r}")
