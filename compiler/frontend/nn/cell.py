"""`Cell`: the MindSpore-style module.

Attributes are sorted as they are assigned: sub-cells, parameters and primitives are kept in
order. A primitive takes its instance name from the attribute that holds it (`self.matmul2 =
ops.MatMul()` -> `matmul2`); a sub-cell takes its scope part from it (`layer1-Dense`), and its
parameters are named by their attribute path (`layer1.weight`), as in MindSpore.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pcompile.compiler.frontend.primitive import Primitive, normalize_strategy
from pcompile.compiler.frontend.tensor import Parameter
from pcompile.compiler.frontend.tracing import current_tracer, note_cell

if TYPE_CHECKING:
    from pcompile.ir.types import DType


def _keep_outputs(result: Any, tracer: Any) -> None:
    """The outputs of the cell `recompute()` was called on are kept (MindSpore: "all the
    primitives in the cell except the outputs"): unmark the ones the cell's scope marked."""
    items = result if isinstance(result, (tuple, list)) else [result]
    for item in items:
        node = getattr(getattr(item, "_value", None), "node", None)
        if node is not None and node.op == "TupleGetItem":
            node = getattr(node.operands[0], "node", None)
        if node is None or id(node.result) not in tracer.recompute_marked:
            continue
        node.attrs = {k: v for k, v in node.attrs.items() if k != "recompute"}
        tracer.recompute_marked.discard(id(node.result))


def _cast_outputs(result: Any, dtype: Any, tracer: Any) -> Any:
    """amp: a cell's float outputs in `dtype` (MindSpore's _OutputTo32 / _OutputTo16)."""
    from pcompile.compiler.frontend.primitive import _wrap, cast_float
    from pcompile.compiler.frontend.tensor import Tensor

    if isinstance(result, (tuple, list)):
        return type(result)(_cast_outputs(r, dtype, tracer) for r in result)
    if isinstance(result, Tensor) and result.is_symbolic:
        assert result._value is not None
        return _wrap(cast_float(tracer, result._value, dtype), tracer.builder)
    return result


def call_top(cell: Cell, tracer: Any, call: Any) -> Any:
    """Trace `call()`, the construct of a top cell that the compiler calls directly (not through
    `Cell.__call__`), with the cell's mixed precision (to_float, amp) applied as a call would."""
    if cell._mixed_precision is not None:
        tracer.precision_stack.append(cell._mixed_precision)
    try:
        result = call()
    finally:
        if cell._mixed_precision is not None:
            tracer.precision_stack.pop()
    if cell._output_dtype is not None:
        result = _cast_outputs(result, cell._output_dtype, tracer)
    return result


def has_custom_bprop(cell: Cell) -> bool:
    """Whether the cell defines its own backward (`def bprop(self, *inputs, out, dout)`)."""
    return callable(getattr(type(cell), "bprop", None))


class Cell:
    """Base class of networks, layers, losses and optimizers."""

    # Set by __init__ with object.__setattr__ (this class's __setattr__ files attributes).
    _cells: OrderedDict[str, Cell]
    _params: OrderedDict[str, Parameter]
    _primitives: OrderedDict[str, Primitive]
    _attr_name: str
    _auto_prefix: bool
    training: bool
    shard_config: dict[str, Any] | None
    _pipeline_stage: int
    _pipeline_segment: int
    _recompute: bool | None
    _mixed_precision: DType | None
    _output_dtype: DType | None

    def __init__(self, auto_prefix: bool = True, flags: Any = None) -> None:
        object.__setattr__(self, "_cells", OrderedDict())
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_primitives", OrderedDict())
        object.__setattr__(self, "_attr_name", "")
        object.__setattr__(self, "_auto_prefix", auto_prefix)
        object.__setattr__(self, "training", False)
        object.__setattr__(self, "shard_config", None)
        object.__setattr__(self, "_pipeline_stage", -1)
        object.__setattr__(self, "_pipeline_segment", 0)
        object.__setattr__(self, "_recompute", None)
        object.__setattr__(self, "_mixed_precision", None)  # to_float's type
        object.__setattr__(self, "_output_dtype", None)  # amp: the outputs' float type

    # -- attribute bookkeeping ----------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_cells" not in self.__dict__:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ must call super().__init__() before setting "
                f"attribute {name!r}"
            )
        if getattr(value, "_pcompile_sharded_fn", False) and name in self.__dict__["_cells"]:
            raise TypeError(
                f"For 'Cell', the type of {name} should be cell, but got function."
            )
        for table in ("_cells", "_params", "_primitives"):
            self.__dict__[table].pop(name, None)
        if isinstance(value, Cell):
            self._cells[name] = value
            if not value._attr_name:
                object.__setattr__(value, "_attr_name", name)
        elif isinstance(value, Parameter):
            if value.name is None:
                value.name = name
            self._params[name] = value
        elif isinstance(value, Primitive):
            if not value.instance_name:
                value.instance_name = name
            self._primitives[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for table in ("_cells", "_params", "_primitives"):
            self.__dict__[table].pop(name, None)
        object.__delattr__(self, name)

    def insert_child_to_cell(self, name: str, cell: Cell) -> None:
        setattr(self, name, cell)

    # -- structure ----------------------------------------------------------------------------
    def cells_and_names(self, prefix: str = "") -> Iterator[tuple[str, Cell]]:
        seen: set[int] = set()

        def walk(cell: Cell, path: str) -> Iterator[tuple[str, Cell]]:
            if id(cell) in seen:
                return
            seen.add(id(cell))
            yield path, cell
            for name, child in cell._cells.items():
                yield from walk(child, f"{path}.{name}" if path else name)

        yield from walk(self, prefix)

    def name_cells(self) -> OrderedDict[str, Cell]:
        return OrderedDict(self._cells)

    def cells(self) -> list[Cell]:
        return list(self._cells.values())

    def parameters_and_names(self, name_prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Every parameter once, depth first in assignment order, with its attribute path."""
        seen: set[int] = set()
        for path, cell in self.cells_and_names(name_prefix):
            for attr, param in cell._params.items():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                yield (f"{path}.{attr}" if path else attr), param

    def get_parameters(self) -> Iterator[Parameter]:
        for _, p in self.parameters_and_names():
            yield p

    def trainable_params(self) -> list[Parameter]:
        return [p for p in self.get_parameters() if p.requires_grad]

    def untrainable_params(self) -> list[Parameter]:
        return [p for p in self.get_parameters() if not p.requires_grad]

    def finalize_parameter_names(self) -> None:
        """Name parameters as MindSpore does: a parameter of a sub-cell is prefixed with the
        sub-cell's attribute path (`layer1.weight`); names given at the top cell stay."""
        for path, cell in self.cells_and_names():
            for attr, param in cell._params.items():
                if getattr(param, "_final", False):
                    continue
                base = param.name if param._explicit_name else attr
                param.name = f"{path}.{base}" if path and cell._auto_prefix else base
                param._final = True  # type: ignore[attr-defined]

    # -- pipeline parallelism (compiler/frontend/nn/pipeline.py) -----------------------------------
    @property
    def pipeline_stage(self) -> int:
        """The pipeline stage this cell (and every sub-cell without its own) runs in; -1: not
        set. Stage s owns ranks [s*n, (s+1)*n) of `pipeline_stages` stages of n devices."""
        return int(self.__dict__.get("_pipeline_stage", -1))

    @pipeline_stage.setter
    def pipeline_stage(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError("For 'Cell', the property 'pipeline_stage' must be int type, but "
                            f"got type : {type(value).__name__}")
        if value < 0:
            raise ValueError("For 'Cell', the property 'pipeline_stage' can not be less than "
                             f"0, but got {value}")
        object.__setattr__(self, "_pipeline_stage", value)

    @property
    def pipeline_segment(self) -> int:
        """The pipeline segment (virtual stage) of this cell; 0 unless interleaved."""
        return int(self.__dict__.get("_pipeline_segment", 0))

    @pipeline_segment.setter
    def pipeline_segment(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError("For 'Cell', the property 'pipeline_segment' must be int type, "
                            f"but got type : {type(value).__name__}")
        if value < 0:
            raise ValueError("For 'Cell', the property 'pipeline_segment' can not be less "
                             f"than 0, but got {value}")
        object.__setattr__(self, "_pipeline_segment", value)

    def set_comm_fusion(self, fusion_type: int, recurse: bool = True) -> Cell:
        if isinstance(fusion_type, bool) or not isinstance(fusion_type, int) or fusion_type < 0:
            raise TypeError(f"fusion_type must be an int >= 0, got {fusion_type!r}")
        params = self.get_parameters() if recurse else iter(self._params.values())
        for p in params:
            p.comm_fusion = fusion_type
        return self

    @property
    def cls_name(self) -> str:
        """The cell's class name (MindSpore's `Cell.cls_name`, used in error messages)."""
        return type(self).__name__

    def add_flags(self, **flags: Any) -> Cell:
        """MindSpore's `Cell.add_flags`: each flag becomes an attribute of this cell
        (`add_flags(is_first_iteration=False)` -> `self.is_first_iteration`)."""
        for name, value in flags.items():
            setattr(self, name, value)
        return self

    def add_flags_recursive(self, **flags: Any) -> Cell:
        """`add_flags` on this cell and every sub-cell."""
        for _, cell in self.cells_and_names():
            cell.add_flags(**flags)
        return self

    def set_train(self, mode: bool = True) -> Cell:
        """Training or inference behaviour for this cell and every sub-cell (`self.training`);
        pcompile calls `set_train(True)` on the network of a training compile, as MindSpore's
        `Model.train` does."""
        for _, cell in self.cells_and_names():
            object.__setattr__(cell, "training", mode)
        return self

    def recompute(self, mode: bool = True, **kwargs: Any) -> Cell:
        """MindSpore's `Cell.recompute()`: every primitive in this cell and its sub-cells,
        except the cell's outputs, is recomputed in the backward pass instead of kept
        (`passes.recompute`); a primitive's own `recompute(False)` wins. MindSpore's keyword
        options (`mp_comm_recompute`, `parallel_optimizer_comm_recompute`,
        `recompute_slice_activation`) are accepted; communication inserted for a recomputed op
        is recomputed with it."""
        if not isinstance(mode, bool):
            raise TypeError(f"{type(self).__name__}.recompute(): mode must be a bool, got "
                            f"{mode!r}")
        known = {"mp_comm_recompute", "parallel_optimizer_comm_recompute",
                 "recompute_slice_activation"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"{type(self).__name__}.recompute() got unexpected keyword "
                            f"argument(s) {', '.join(unknown)}")
        for _, cell in self.cells_and_names():
            object.__setattr__(cell, "_recompute", mode)
            object.__setattr__(cell, "_recompute_root", cell is self)
        return self

    def to_float(self, dst_type: Any) -> Cell:
        """MindSpore's `Cell.to_float`: the ops of this cell and of its sub-cells compute in
        `dst_type` (float16, bfloat16 or float32): every float operand of another float type
        (inputs, parameters, constants) is cast to it first, with a Cast in the graph. The
        parameters themselves keep their type (float32 master weights: the Cast's gradient
        brings the gradient back to it)."""
        from pcompile.ir.types import DType

        try:
            dtype = DType.from_any(dst_type)
        except (TypeError, ValueError, KeyError):
            dtype = None
        if dtype not in (DType.float16, DType.bfloat16, DType.float32):
            raise ValueError(f"For 'to_float', the argument 'dst_type' must be float16, "
                             f"bfloat16 or float32, but got {dst_type!r}")
        for _, cell in self.cells_and_names():
            object.__setattr__(cell, "_mixed_precision", dtype)
        return self

    def set_auto_parallel(self) -> Cell:
        """Accepted for MindSpore scripts (`net.set_auto_parallel()`): the parallel mode comes
        from the context."""
        return self

    def set_grad(self, requires_grad: bool = True) -> Cell:
        """Accepted for MindSpore scripts (`network.set_grad()`): pcompile knows from the
        compile which cells are differentiated."""
        return self

    def shard(
        self,
        in_strategy: Any,
        out_strategy: Any = None,
        parameter_plan: dict[str, Any] | None = None,
        device: str = "Ascend",
        level: int = 0,
    ) -> Cell:
        """Record a functional-shard request for this cell (used by the parallel passes)."""
        config = {
            "in_strategy": normalize_strategy(in_strategy, "in_strategy"),
            "out_strategy": None
            if out_strategy is None
            else normalize_strategy(out_strategy, "out_strategy"),
            "parameter_plan": dict(parameter_plan or {}),
        }
        object.__setattr__(self, "shard_config", config)
        return self

    # -- calling ------------------------------------------------------------------------------
    def construct(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define construct()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = current_tracer()
        if tracer is None:
            return self.construct(*args, **kwargs)
        from pcompile.compiler.frontend.train_step import current_step

        step = current_step()
        if step is not None:
            return step.call_cell(self, args, kwargs, lambda: self._traced_call(args, kwargs))
        return self._traced_call(args, kwargs)

    def _traced_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tracer = current_tracer()
        assert tracer is not None
        part = f"{self._attr_name or 'cell'}-{type(self).__name__}"
        with contextlib.ExitStack() as scopes:
            # A cell held by a CellList (which is never called itself) has the list in its
            # scope, as in MindSpore: .../layers-CellList/0-Block.
            container = self.__dict__.get("_container")
            if container is not None and container._cells.get(self._attr_name) is self:
                scopes.enter_context(tracer.cell_scope(
                    f"{container._attr_name or 'cell'}-{type(container).__name__}"))
            scopes.enter_context(tracer.cell_scope(part))
            note_cell(tracer.scope, self)  # pipeline stages are looked up by scope
            bprop_scope = tracer.scope if has_custom_bprop(self) else None
            if self._recompute is not None:
                tracer.recompute_stack.append(self._recompute)
                scopes.callback(tracer.recompute_stack.pop)
            if self._mixed_precision is not None:
                tracer.precision_stack.append(self._mixed_precision)
                scopes.callback(tracer.precision_stack.pop)
            if self.shard_config is not None:
                from pcompile.compiler.frontend.functional_shard import call_sharded

                result = call_sharded(self.construct, self.shard_config, args, cell=self)
            else:
                result = self.construct(*args, **kwargs)
            if self._recompute and self.__dict__.get("_recompute_root"):
                _keep_outputs(result, tracer)
            if self._output_dtype is not None:
                result = _cast_outputs(result, self._output_dtype, tracer)
            if bprop_scope is not None:
                from pcompile.compiler.frontend.custom_bprop import record_call

                tracer.custom_bprop.append(record_call(self, bprop_scope, args, kwargs, result))
            return result

    def __repr__(self) -> str:
        return f"{type(self).__name__}<{', '.join(self._cells)}>"
