"""`GradOperation` and `ParameterTuple`, as MindSpore training cells use them.

`ops.GradOperation(get_all=False, get_by_list=False, sens_param=False)(network, weights)` is a
function of the network's inputs (and, with `sens_param`, a last argument: the sensitivity, the
cotangent the backward pass starts from; without it, ones) that returns the gradients:

* neither flag: the gradient of the first input;
* `get_all`: a tuple with the gradient of every input;
* `get_by_list`: a tuple with the gradient of every weight of `weights`;
* both: `(input gradients, weight gradients)`.

pcompile differentiates on the IR after the parallel passes, so a gradient exists only inside
a training step that pcompile traces twice (`compiler.train_step`): once for the forward graph,
once, after the split, for everything the step does with the gradients. Calling the function
outside such a step is an error with one message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pcompile.compiler.frontend.tensor import Parameter, Tensor


class ParameterTuple(tuple):  # type: ignore[type-arg]
    """A tuple of Parameters (`ParameterTuple(net.trainable_params())`)."""

    def __new__(cls, iterable: Iterable[Any]) -> ParameterTuple:
        items = tuple(iterable)
        for i, p in enumerate(items):
            if not isinstance(p, Parameter):
                raise TypeError(
                    f"ParameterTuple: element {i} is {type(p).__name__}, not a Parameter")
        return super().__new__(cls, items)


class GradOperation:
    """MindSpore's `ops.GradOperation` (see the module docstring)."""

    def __init__(self, get_all: bool = False, get_by_list: bool = False,
                 sens_param: bool = False) -> None:
        for name, value in (("get_all", get_all), ("get_by_list", get_by_list),
                            ("sens_param", sens_param)):
            if not isinstance(value, bool):
                raise TypeError(f"GradOperation: {name} must be a bool, got {value!r}")
        self.get_all = get_all
        self.get_by_list = get_by_list
        self.sens_param = sens_param

    def __call__(self, fn: Any, weights: Any = None) -> GradFunction:
        from pcompile.compiler.frontend.nn.cell import Cell

        if not isinstance(fn, Cell):
            raise TypeError(
                f"GradOperation differentiates a Cell (the network with its loss), got "
                f"{type(fn).__name__}")
        if self.get_by_list:
            if isinstance(weights, Parameter):
                weights = (weights,)
            if weights is None or not all(isinstance(w, Parameter) for w in weights):
                raise TypeError(
                    "GradOperation(get_by_list=True) needs the weights to differentiate for: "
                    "a ParameterTuple such as ParameterTuple(network.trainable_params())")
            weights = tuple(weights)
        return GradFunction(self, fn, weights)

    def split(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        """(the network's arguments, the sensitivity or None)."""
        if self.sens_param:
            if not args:
                raise TypeError("GradOperation(sens_param=True): the last argument must be the "
                                "sensitivity (the cotangent of the network's output)")
            return tuple(args[:-1]), args[-1]
        return tuple(args), None

    def package(self, input_grads: list[Tensor], weight_grads: list[Tensor]) -> Any:
        """The gradients in MindSpore's return form."""
        if self.get_all and self.get_by_list:
            return tuple(input_grads), tuple(weight_grads)
        if self.get_by_list:
            return tuple(weight_grads)
        if self.get_all:
            return tuple(input_grads)
        return input_grads[0]


class GradFunction:
    """`GradOperation(...)(network, weights)`: call it on the network's inputs."""

    def __init__(self, op: GradOperation, fn: Any, weights: tuple[Parameter, ...] | None):
        self.op = op
        self.fn = fn
        self.weights = weights

    def __call__(self, *args: Any) -> Any:
        from pcompile.compiler.frontend.train_step import current_step
        from pcompile.ir.errors import PcompileError

        step = current_step()
        if step is None:
            raise PcompileError(
                "GradOperation: gradients exist only inside a training step that pcompile "
                "compiles: return the cell that calls it from model() (nn.TrainOneStepCell, "
                "nn.WithGradCell or your own cell), or let pcompile differentiate the loss "
                "(docs/user-guide.md, 'Training')")
        return step.grad(self, args)
