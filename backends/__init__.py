"""Execution backends: the numpy reference interpreter and the JAX lowering."""
