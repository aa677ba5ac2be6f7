"""`pcompile.mint.nn`: `functional` (`mint.nn.functional.relu`, ...) and the activation cells
whose constructors MindSpore's `mint.nn` and `nn` share (`mint.nn.ReLU()`, ...: the `nn` cells)."""

from pcompile.compiler.frontend.mint.nn import functional
from pcompile.compiler.frontend.nn import ReLU, Sigmoid, SiLU, Tanh

__all__ = ["ReLU", "SiLU", "Sigmoid", "Tanh", "functional"]
