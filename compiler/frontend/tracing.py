"""Tracing: running a model's Python code on symbolic tensors to build an `ir.Graph`.

While a `Tracer` is active, every primitive call appends a node through one `ir.Builder`,
with the current Cell scope (`Default/network-WithLossCell/_backbone-Net`), the primitive's
instance name and the user's source line. Python control flow runs at trace time, so loops
unroll and branches on Python values pick one side.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, SourceLoc, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType, TensorType

_COMPILER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE_DIRS = tuple(
    os.path.abspath(os.path.join(_COMPILER, *p)) + os.sep
    for p in ((), ("..", "ir"), ("..", "passes"), ("..", "backends"))
)
# Frames of these files call into user code; walking past them would leave the model.
_ENTRY_FILES = {
    os.path.join(_COMPILER, "driver", name)
    for name in ("trace_model.py", "driver.py", "front_passes.py")
} | {
    os.path.join(os.path.dirname(_COMPILER), "passes", name)
    for name in ("optimizer.py", "step_parallel.py", "autodiff.py")
}
_ASSIGN = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:,[^=]*)?=[^=]")


def _display_path(path: str) -> str:
    absolute = os.path.abspath(path)
    rel = os.path.relpath(absolute)
    return absolute if rel.startswith("..") else rel


def user_source() -> SourceLoc | None:
    """The innermost stack frame outside this package: the user's line that made the call."""
    frame = sys._getframe(1)
    while frame is not None:
        code_file = frame.f_code.co_filename
        kind = _FILE_KIND.get(code_file)
        if kind is None:
            kind = _FILE_KIND[code_file] = _file_kind(code_file)
        if kind == "entry":
            return None  # reached the compiler's own call of the model: no user line
        if kind != "internal":  # the user's file (its absolute path)
            text = _line_text(code_file, frame.f_lineno)
            key = (kind, os.getcwd())
            shown = _SHOWN.get(key)
            if shown is None:
                shown = _SHOWN[key] = _display_path(kind)
            return SourceLoc(shown, frame.f_lineno, text)
        frame = frame.f_back  # type: ignore[assignment]
    return None


# code filename -> "entry", "internal" or the user file's absolute path (one abspath per file,
# not per frame per traced op: tracing a 96-layer model walks ~100k frames)
_FILE_KIND: dict[str, str] = {}
_SHOWN: dict[tuple[str, str], str] = {}  # (absolute path, cwd) -> the path as displayed


def _file_kind(code_file: str) -> str:
    filename = os.path.abspath(code_file)
    if filename in _ENTRY_FILES:
        return "entry"
    if filename.startswith(_PACKAGE_DIRS) or "importlib" in filename:
        return "internal"
    return filename


_LINES: dict[str, list[str]] = {}


def _line_text(filename: str, lineno: int) -> str:
    lines = _LINES.get(filename)
    if lines is None:
        try:
            with open(filename, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        _LINES[filename] = lines
    return lines[lineno - 1].rstrip() if 0 < lineno <= len(lines) else ""


def name_hint(source: SourceLoc | None) -> str:
    """`out = self.matmul(x, w)` names its node `out`, as MindIR does."""
    if source is not None:
        m = _ASSIGN.match(source.text)
        if m:
            return m.group(1)
    return "CNode"


class Tracer:
    """The state of one trace: the graph, its builder, Cell scopes and known parameters."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.builder = Builder(graph)
        self.scopes: list[str] = ["Default"]
        self.params: dict[int, GraphParam] = {}
        self.op_counts: dict[str, int] = {}
        self.overrides: dict[int, Value] = {}
        # Parameters assigned in the forward computation (P.Assign / AssignAdd / AssignSub):
        # id(parameter) -> (its name, its newest value), in the order of their first
        # assignment; later reads get the newest value (compiler/frontend/assign.py)
        self.assigned: dict[int, tuple[str, Value]] = {}
        # calls of cells with their own bprop (compiler/frontend/custom_bprop.py `BpropCall`)
        self.custom_bprop: list[Any] = []
        # Cell.recompute(): whether the cells being traced are recomputed (innermost last), and
        # the results marked because of it (a cell's outputs are unmarked when it returns)
        self.recompute_stack: list[bool] = []
        self.recompute_marked: set[int] = set()
        # Cell.to_float / amp: the float type the ops of the cells being traced compute in
        # (innermost last; None: as the model wrote them)
        self.precision_stack: list[DType | None] = []

    @property
    def mixed_precision(self) -> DType | None:
        return self.precision_stack[-1] if self.precision_stack else None

    @property
    def recompute(self) -> bool:
        return bool(self.recompute_stack) and self.recompute_stack[-1]

    @property
    def scope(self) -> str:
        return self.scopes[-1]

    @contextlib.contextmanager
    def cell_scope(self, part: str) -> Iterator[None]:
        self.scopes.append(f"{self.scope}/{part}")
        try:
            yield
        finally:
            self.scopes.pop()

    @contextlib.contextmanager
    def absolute_scope(self, scope: str) -> Iterator[None]:
        self.scopes.append(scope)
        try:
            yield
        finally:
            self.scopes.pop()

    @contextlib.contextmanager
    def parameter_overrides(self, overrides: dict[int, Value]) -> Iterator[None]:
        """Inside the block, the given parameters are read as the given values (functional
        shard's parameter_plan)."""
        saved = dict(self.overrides)
        self.overrides.update(overrides)
        try:
            yield
        finally:
            self.overrides = saved

    def add_input(self, name: str, tensor_type: TensorType) -> Tensor:
        param = self.graph.add_param(GraphParam(tensor_type, name, "input"))
        return Tensor(_value=param)

    def add_parameter(self, param: Parameter, kind: str = "weight") -> GraphParam:
        key = id(param)
        if key not in self.params:
            assert param.name is not None
            tensor_type = TensorType(param.dtype, param.shape)
            self.params[key] = self.graph.add_param(
                GraphParam(tensor_type, param.name, kind, param.requires_grad)
            )
        return self.params[key]

    def next_instance_name(self, op: str) -> str:
        k = self.op_counts.get(op, 0)
        self.op_counts[op] = k + 1
        return f"{op}-op{k}"

    def to_value(self, arg: Any, like: DType | None) -> Value:
        """Turn an operand into an IR value: symbolic tensors as they are, parameters as graph
        parameters, concrete data as constants."""
        if isinstance(arg, Parameter):
            if id(arg) in self.assigned:
                return self.assigned[id(arg)][1]
            if id(arg) in self.overrides:
                return self.overrides[id(arg)]
            if arg.name is None:
                raise PcompileError(
                    "a Parameter without a name is used outside any Cell; give it a name"
                )
            return self.add_parameter(arg)
        if isinstance(arg, Tensor):
            if arg.is_symbolic:
                assert arg._value is not None
                return arg._value
            return Constant(arg.asnumpy(), arg.dtype)
        return python_constant(arg, like)


def python_constant(arg: Any, like: DType | None) -> Constant:
    if isinstance(arg, (bool, np.bool_)):
        return Constant(np.asarray(arg), DType.bool_)
    if isinstance(arg, (int, float, np.integer, np.floating)):
        if like is not None:
            return Constant(np.asarray(arg), like)
        return Constant(np.asarray(arg), DType.float32 if isinstance(arg, float) else DType.int32)
    arr = np.asarray(arg)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return Constant(arr, DType.from_any(arr.dtype))


_CURRENT: list[Tracer] = []
_CELL_LOGS: list[dict[str, Any]] = []


@contextlib.contextmanager
def recording_cells() -> Iterator[dict[str, Any]]:
    """Inside the block, every Cell call made while tracing is recorded as {its scope: the
    cell} (the pipeline passes read each op's stage from the cells around it)."""
    log: dict[str, Any] = {}
    _CELL_LOGS.append(log)
    try:
        yield log
    finally:
        _CELL_LOGS.remove(log)


def note_cell(scope: str, cell: Any) -> None:
    """A Cell was entered at `scope` (called by `Cell.__call__` while tracing)."""
    for log in _CELL_LOGS:
        log.setdefault(scope, cell)


def current_tracer() -> Tracer | None:
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def tracing(graph: Graph) -> Iterator[Tracer]:
    with tracing_with(Tracer(graph)) as tracer:
        yield tracer


@contextlib.contextmanager
def tracing_with(tracer: Tracer) -> Iterator[Tracer]:
    """Trace with a given tracer (a subclass with its own parameter handling)."""
    _CURRENT.append(tracer)
    try:
        yield tracer
    finally:
        _CURRENT.pop()
