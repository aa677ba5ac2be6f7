"""`pcompile.common`, MindSpore's `mindspore.common` spelling: `pcompile.common.initializer` is
the initializer module (`initializer`, `Initializer`, `Normal`, `Uniform`, `TruncatedNormal`,
`Zero`, `One`, `Constant`, `XavierUniform`, `HeUniform`), so a model written for
`from mindspore.common.initializer import Normal, initializer` needs only its import changed."""

from __future__ import annotations

import importlib

# The module, not the function of the same name that `pcompile.compiler` re-exports.
initializer = importlib.import_module("pcompile.compiler.frontend.initializer")

__all__ = ["initializer"]
