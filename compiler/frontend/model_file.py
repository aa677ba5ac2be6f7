"""Loading a user's model file (the contract of DESIGN.md §2 "Model file").

A model file defines `model()`, `inputs()` and optionally `loss()`, `optimizer(params)`,
`dataset()`, `labels()` and `callbacks()` (MindSpore's training callbacks, which the rank
programs call: compiler/frontend/callbacks.py). `optimizer()` without `loss()`: the network computes
its own loss (MindSpore's training form); `model()` may also return a training step cell
(`nn.TrainOneStepCell`, ...), see `compiler.trace_model`. Every way this can go wrong becomes
one clear `PcompileError`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from pcompile.compiler.frontend.tensor import Tensor, TensorSpec
from pcompile.ir.errors import PcompileError


@dataclass
class ModelFile:
    """The callables a model file provides."""

    path: str
    module: ModuleType
    model: Callable[[], Any]
    inputs: Callable[[], Any]
    loss: Callable[[], Any] | None
    optimizer: Callable[[Any], Any] | None
    dataset: Callable[[], Iterable[Any]] | None
    labels: Callable[[], Any] | None
    callbacks: Callable[[], Any] | None = None

    @property
    def training(self) -> bool:
        """Trains with loss() or optimizer() (a network that returns its own loss); a model()
        that returns a training step cell is known to train only once traced."""
        return self.loss is not None or self.optimizer is not None


def _where(exc: BaseException, path: str) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    absolute = os.path.abspath(path)
    for frame in reversed(frames):
        if os.path.abspath(frame.filename) == absolute:
            return f" (at {path}:{frame.lineno}: `{(frame.line or '').strip()}`)"
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f" (at {path}:{exc.lineno})"
    return ""


def load_model_file(path: str) -> ModelFile:
    if not os.path.isfile(path):
        raise PcompileError(f"model file {path!r} does not exist")
    name = "pcompile_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PcompileError(f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(os.path.abspath(path))
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    from pcompile.compiler.frontend.communication import new_load

    new_load()  # as a process starting: the groups it creates are its own (create_group)
    try:
        spec.loader.exec_module(module)
    except PcompileError:
        raise
    except BaseException as exc:  # the user's module may raise anything
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise PcompileError(
            f"model file {path} failed to import: {type(exc).__name__}: {exc}{_where(exc, path)}"
        ) from exc
    finally:
        if added:
            sys.path.remove(directory)

    def get(attr: str, required: bool) -> Any:
        fn = getattr(module, attr, None)
        if fn is None and required:
            raise PcompileError(
                f"model file {path} must define {attr}() (see docs/user-guide.md, "
                "'The model file')"
            )
        if fn is not None and not callable(fn):
            raise PcompileError(f"model file {path}: {attr} must be a function")
        return fn

    loss = get("loss", False)
    optimizer = get("optimizer", False)
    return ModelFile(
        path=path,
        module=module,
        model=get("model", True),
        inputs=get("inputs", True),
        loss=loss,
        optimizer=optimizer,
        dataset=get("dataset", False),
        labels=get("labels", False),
        callbacks=get("callbacks", False),
    )


def _user_error(exc: BaseException, what: str, path: str) -> PcompileError:
    if isinstance(exc, SystemExit):
        return PcompileError(
            f"{what} in {path} called sys.exit({exc.code!r}){_where(exc, path)}; pcompile "
            "needs it to return, not to end the process")
    return PcompileError(f"{what} in {path} failed: {type(exc).__name__}: {exc}"
                         f"{_where(exc, path)}")


def call_user(fn: Callable[..., Any], what: str, path: str, *args: Any) -> Any:
    """Call a model-file function, turning its exceptions (and `sys.exit()`) into one clear
    message."""
    try:
        return fn(*args)
    except PcompileError:
        raise
    except (Exception, SystemExit) as exc:
        raise _user_error(exc, what, path) from exc


def iterate_user(iterable: Iterable[Any], what: str, path: str) -> Iterator[Any]:
    """Iterate what a model-file function returned (a generator runs the user's code on every
    `next`), with `call_user`'s error handling."""
    iterator = call_user(iter, what, path, iterable)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except PcompileError:
            raise
        except (Exception, SystemExit) as exc:
            raise _user_error(exc, what, path) from exc
        yield item


def as_input_list(value: Any, what: str, path: str) -> list[TensorSpec | np.ndarray]:
    """`inputs()`/`labels()` may return one item or a tuple/list of arrays, Tensors or
    TensorSpecs."""
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    out: list[TensorSpec | np.ndarray] = []
    for i, item in enumerate(items):
        if isinstance(item, TensorSpec):
            out.append(item)
        elif isinstance(item, Tensor):
            out.append(item.asnumpy())
        elif isinstance(item, np.ndarray):
            out.append(item.astype(np.float32) if item.dtype == np.float64 else item)
        else:
            raise PcompileError(
                f"{what}() in {path} returned {type(item).__name__} at position {i}; expected "
                "numpy arrays or TensorSpec(shape, dtype)"
            )
    return out
