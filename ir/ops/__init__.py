"""Primitive definitions. Importing this package registers every op."""

from pcompile.ir.ops import comm, elementwise, linalg, nn, norm, reduce, shape  # noqa: F401
