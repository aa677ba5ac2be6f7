"""Lowering of IR graphs to JAX."""

from backends.jax.lowering import lower_graph

__all__ = ["lower_graph"]
