"""`pcompile.mint.nn`: `functional` (`mint.nn.functional.relu`, ...)."""

from pcompile.compiler.mint.nn import functional

__all__ = ["functional"]
