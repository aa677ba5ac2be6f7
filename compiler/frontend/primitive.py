"""`Primitive`: the user-facing op object (`ops.MatMul(transpose_b=True).shard(...)`).

Calling a primitive while a model is traced appends one IR node (see `compiler.tracing`);
calling it on concrete tensors outside a trace runs the op eagerly on the numpy reference
implementation, with the same shape checks and errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.compiler.frontend.tensor import Tensor
from pcompile.compiler.frontend.tracing import (
    current_tracer,
    name_hint,
    python_constant,
    user_source,
)
from pcompile.compiler.frontend.train_step import trace_hook
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Value
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType, TupleType


def normalize_strategy(strategy: Any, what: str) -> tuple[Any, ...]:
    """Validate a `shard()` strategy: a tuple with one entry per input, each a tuple of
    positive ints, a `Layout(...)` result, or None (derived by the search)."""
    from pcompile.compiler.config.layout import LayoutSpec

    if not isinstance(strategy, (tuple, list)):
        raise TypeError(
            f"{what} must be a tuple of per-input strategies such as ((2, 4), (4, 1)), "
            f"got {type(strategy).__name__} {strategy!r}"
        )
    out: list[Any] = []
    for i, entry in enumerate(strategy):
        if entry is None or isinstance(entry, LayoutSpec):
            out.append(entry)
            continue
        if not isinstance(entry, (tuple, list)):
            raise TypeError(
                f"{what}[{i}] must be a tuple of ints or a Layout, got "
                f"{type(entry).__name__} {entry!r}"
            )
        dims: list[int] = []
        for d in entry:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
                raise TypeError(
                    f"{what}[{i}] must contain only ints, got {type(d).__name__} {d!r} in {entry!r}"
                )
            if d < 1:
                raise ValueError(f"{what}[{i}] values must be >= 1, got {entry!r}")
            dims.append(int(d))
        out.append(tuple(dims))
    return tuple(out)


_PLAIN_INTS = frozenset({int})


def attr_value(value: Any) -> Any:
    """Plain, printable attribute values: lists become tuples, layouts become their dicts."""
    from pcompile.compiler.config.layout import LayoutSpec

    if isinstance(value, LayoutSpec):
        return attr_value(value.to_dict())
    if isinstance(value, dict):
        return {str(k): attr_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if _PLAIN_INTS.issuperset(map(type, value)):  # a shape or a rank list of 2048 ranks
            return tuple(value)
        return tuple(attr_value(v) for v in value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


class _HybridShard:
    """`prim.shard(...)` on an instance; `ops.MatMul.shard(...)` on the class (a form the
    seeds use) makes a default instance first."""

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return lambda *a, **k: owner()._shard(*a, **k)
        return obj._shard


class Primitive:
    """Base of all user-facing primitives. Subclasses set `op` (the registry name) and pass
    their constructor arguments to `__init__` as IR attributes."""

    op: str = ""
    # amp O1 (compiler/frontend/amp.py) sets it on the primitives it runs in low precision
    _amp_dtype: DType | None

    def __init__(self, **attrs: Any) -> None:
        self.attrs: dict[str, Any] = {k: attr_value(v) for k, v in attrs.items()}
        self.user_attrs: dict[str, Any] = {}
        self.in_strategy: tuple[Any, ...] | None = None
        self.out_strategy: tuple[Any, ...] | None = None
        self.instance_name = ""
        self.device_target: str | None = None

    @property
    def name(self) -> str:
        return self.op

    shard = _HybridShard()

    def _shard(self, in_strategy: Any = None, out_strategy: Any = None) -> Primitive:
        if in_strategy is None and out_strategy is not None:
            raise ValueError(
                f"{self.op}.shard(): out_strategy was given without in_strategy; "
                "set in_strategy too"
            )
        if in_strategy is not None:
            self.in_strategy = normalize_strategy(in_strategy, "in_strategy")
        if out_strategy is not None:
            self.out_strategy = normalize_strategy(out_strategy, "out_strategy")
        return self

    def add_prim_attr(self, name: str, value: Any) -> Primitive:
        if not isinstance(name, str):
            raise TypeError(f"attribute name must be a str, got {name!r}")
        self.user_attrs[name] = attr_value(value)
        return self

    def recompute(self, mode: bool = True) -> Primitive:
        """MindSpore's `Primitive.recompute()`: the op's output is not kept for the backward
        pass but computed again there (`passes.recompute`; the dumps show `recompute: true`).
        `recompute(False)` keeps it even inside a recomputed Cell."""
        if not isinstance(mode, bool):
            raise TypeError(f"{self.op}.recompute(): mode must be a bool, got {mode!r}")
        self.user_attrs["recompute"] = mode
        return self

    def set_prim_instance_name(self, name: str) -> Primitive:
        self.instance_name = name
        return self

    def set_device(self, device_target: str) -> Primitive:
        """MindSpore's `set_device("CPU")` (run this op on another device type; "" keeps the
        context's target): accepted and recorded; pcompile's plan and rank programs are the same
        for every target."""
        if device_target not in ("", "Ascend", "GPU", "CPU"):
            raise ValueError(
                f"{self.op}.set_device(): device_target must be 'Ascend', 'GPU', 'CPU' or '' (the "
                f"context's), got {device_target!r}"
            )
        self.device_target = device_target
        return self

    def __call__(self, *args: Any) -> Any:
        return self._apply(list(args))

    def __repr__(self) -> str:
        return f"Prim[{self.op}]"

    def _check_strategy(self, op: str, values: list[Value], scope: str, source: Any) -> None:
        """Check `in_strategy` against the operands (one entry per operand, one value per
        dim); primitives whose MindSpore strategy has another form override this."""
        _check_strategy_arity(self, op, values, scope, source)

    # -- application --------------------------------------------------------------------------
    def _apply(self, args: list[Any], op: str | None = None, **call_attrs: Any) -> Any:
        """Apply the op to tensor operands `args`; `call_attrs` are attributes that MindSpore
        passes as call arguments (Reshape's shape, ReduceSum's axis, ...)."""
        op = op or self.op
        attrs = dict(self.attrs)
        attrs.update({k: attr_value(v) for k, v in call_attrs.items()})
        tracer = current_tracer()
        if tracer is None:
            return _eager(op, args, attrs, self)
        like = _float_like(args)
        promoted = implicit_dtype(op, args)
        values = [python_constant(a, promoted) if promoted is not None and _is_scalar(a)
                  else tracer.to_value(a, like) for a in args]
        source = user_source()
        amp = getattr(self, "_amp_dtype", None)  # amp O1: this primitive in low precision
        target = amp or tracer.mixed_precision
        if target is not None and op != "Cast":
            values = [cast_float(tracer, v, target, source) for v in values]
        if promoted is not None:
            values = promote_values(tracer, op, values, source)
        user_attrs = dict(self.user_attrs)
        if self.in_strategy is not None:
            self._check_strategy(op, values, tracer.scope, source)
            user_attrs["in_strategy"] = attr_value(self.in_strategy)
        if self.out_strategy is not None:
            user_attrs["out_strategy"] = attr_value(self.out_strategy)
        if tracer.recompute and "recompute" not in user_attrs:
            user_attrs["recompute"] = True  # inside a Cell.recompute() cell
        instance = self.instance_name or tracer.next_instance_name(op)
        result = tracer.builder.emit(
            op,
            values,
            attrs,
            instance_name=instance,
            scope=tracer.scope,
            source=source,
            name_hint=name_hint(source),
            user_attrs=user_attrs or None,
        )
        trace_hook(op, values, result)
        if tracer.recompute and user_attrs.get("recompute") is True and \
                "recompute" not in self.user_attrs:
            tracer.recompute_marked.add(id(result))
        if amp is not None:  # amp O1: the result goes back to float32
            result = cast_float(tracer, result, DType.float32, source)
        return _wrap(result, tracer.builder)


def cast_float(tracer: Any, value: Value, dtype: DType, source: Any = None) -> Value:
    """`value` in float type `dtype` (mixed precision): a float tensor of another float type
    gets a Cast (a constant is converted as it is built); anything else is returned as is."""
    from pcompile.ir.core import Constant

    vtype = value.type
    if not isinstance(vtype, TensorType) or not vtype.dtype.is_float or vtype.dtype == dtype:
        return value
    if isinstance(value, Constant):
        return Constant(np.asarray(value.array).astype(dtype.np), dtype)
    return tracer.builder.emit("Cast", [value], {"dst_type": dtype},
                               instance_name=tracer.next_instance_name("Cast"),
                               scope=tracer.scope, source=source,
                               name_hint=name_hint(source) if source is not None else "")


# MindSpore's implicit type conversion (its "Implicit Type Conversion" list; ops whose
# signature has one dtype group): the operands of these ops are converted to one dtype before
# the op, and the IR shows the Casts.
IMPLICIT_CONVERSION = frozenset({
    "Add", "Sub", "Mul", "Div", "RealDiv", "FloorDiv", "FloorMod", "Mod", "TruncateDiv",
    "TruncateMod", "Maximum", "Minimum", "Pow", "SquaredDifference", "DivNoNan", "Atan2",
    "Xdivy", "Xlogy", "Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual",
    "ApproximateEqual", "BitwiseAnd", "BitwiseOr", "BitwiseXor",
})
# bool < uint8 < int32 < int64 < float16, bfloat16 < float32 < float64 (MindSpore's priority
# over the dtypes pcompile has); float16 with bfloat16 is float32, as neither holds the other.
_PRIORITY = {DType.bool_: 0, DType.uint8: 1, DType.int32: 2, DType.int64: 3,
             DType.float16: 4, DType.bfloat16: 4, DType.float32: 5, DType.float64: 6}


def _highest(dtypes: list[DType]) -> DType:
    best = max(dtypes, key=lambda d: _PRIORITY[d])
    if _PRIORITY[best] == 4 and {DType.float16, DType.bfloat16} <= set(dtypes):
        return DType.float32
    return best


def _is_scalar(a: Any) -> bool:
    return isinstance(a, (bool, int, float, np.bool_, np.integer, np.floating))


def implicit_dtype(op: str, args: list[Any]) -> DType | None:
    """The dtype MindSpore converts the operands of `op` to, where `op` converts implicitly and
    at least one operand is a tensor (None: nothing to convert). Tensors of different dtypes
    go to the highest of them; a Python scalar takes the tensors' dtype, except that a float
    scalar makes bool and integer tensors float32 and an int scalar makes a bool tensor
    int32."""
    if op not in IMPLICIT_CONVERSION:
        return None
    tensors = [a.dtype for a in args if isinstance(a, Tensor) and a.dtype in _PRIORITY]
    if not tensors:
        return None
    best = _highest(tensors)
    scalars = [a for a in args if _is_scalar(a)]
    if not best.is_float and any(isinstance(a, (float, np.floating)) for a in scalars):
        best = DType.float32
    elif best is DType.bool_ and any(not isinstance(a, (bool, np.bool_)) for a in scalars):
        best = DType.int32
    if not scalars and len(set(tensors)) == 1:
        return None
    return best


def promote_values(tracer: Any, op: str, values: list[Value], source: Any) -> list[Value]:
    """The operands of `op` in one dtype (`implicit_dtype` of their types): a Cast for each
    tensor of another dtype, constants converted as they are built."""
    from pcompile.ir.core import Constant

    ranked = [v.type.dtype for v in values
              if isinstance(v.type, TensorType) and v.type.dtype in _PRIORITY]
    if len(set(ranked)) <= 1:
        return values
    target = _highest(ranked)
    out = []
    for v in values:
        vtype = v.type
        if not isinstance(vtype, TensorType) or vtype.dtype is target:
            out.append(v)
        elif isinstance(v, Constant):
            out.append(Constant(np.asarray(v.array).astype(target.np), target))
        else:
            out.append(tracer.builder.emit(
                "Cast", [v], {"dst_type": target}, instance_name=tracer.next_instance_name("Cast"),
                scope=tracer.scope, source=source,
                name_hint=name_hint(source) if source is not None else ""))
    return out


def _float_like(args: list[Any]) -> DType | None:
    for a in args:
        if isinstance(a, Tensor):
            return a.dtype
    return None


def _check_strategy_arity(prim: Primitive, op: str, values: list[Value], scope: str, source: Any):
    assert prim.in_strategy is not None
    if len(prim.in_strategy) != len(values):
        shapes = [getattr(v.type, "shape", None) for v in values]
        example = tuple(tuple(1 for _ in (s or ())) for s in shapes)
        raise OpError(
            op,
            f"in_strategy has {len(prim.in_strategy)} entries but the op has "
            f"{len(values)} inputs",
            instance_name=prim.instance_name,
            scope=scope,
            source=source,
            shapes=shapes,
            strategy=prim.in_strategy,
            hint=f"give one tuple per input, e.g. {example}",
        )
    for i, (entry, value) in enumerate(zip(prim.in_strategy, values)):
        if isinstance(entry, tuple) and isinstance(value.type, TensorType):
            if len(entry) != value.type.rank:
                raise OpError(
                    op,
                    f"in_strategy[{i}] has {len(entry)} values but input {i} has rank "
                    f"{value.type.rank}",
                    instance_name=prim.instance_name,
                    scope=scope,
                    source=source,
                    shapes=[getattr(v.type, "shape", None) for v in values],
                    strategy=prim.in_strategy,
                    hint="give one split count per dimension",
                )


def _wrap(result: Value, builder: Builder) -> Any:
    if isinstance(result.type, TupleType):
        return tuple(
            Tensor(_value=builder("TupleGetItem", result, index=i))
            for i in range(len(result.type.elements))
        )
    return Tensor(_value=result)


def _eager(op: str, args: list[Any], attrs: dict[str, Any], prim: Primitive) -> Any:
    """Run one op on concrete data through the numpy reference implementation."""
    from pcompile.ir.interpret import run_graph

    graph = Graph(f"eager_{op}")
    like = _float_like(args)
    promoted = implicit_dtype(op, args)
    if promoted is not None:
        like = promoted
    arrays: list[np.ndarray] = []
    for a in args:
        arrays.append(a.asnumpy() if isinstance(a, Tensor) else python_constant(a, like).array)
    if promoted is not None:  # the operands in one dtype, as `promote_values` does in a trace
        ranked = [d for d in (DType.from_any(x.dtype) for x in arrays) if d in _PRIORITY]
        if len(set(ranked)) > 1:
            target = _highest(ranked)
            arrays = [x.astype(target.np) if DType.from_any(x.dtype) in _PRIORITY else x
                      for x in arrays]
    params: list[Value] = []
    for i, arr in enumerate(arrays):
        dtype = DType.from_any(arr.dtype)
        params.append(graph.add_param(GraphParam(TensorType(dtype, arr.shape), f"x{i}")))
    b = Builder(graph, source=user_source(), instance_name=prim.instance_name)
    result = b.emit(op, params, attrs)
    outs = [b("TupleGetItem", result, index=i) for i in range(len(result.type.elements))] if (
        isinstance(result.type, TupleType)
    ) else [result]
    graph.outputs = outs
    values = run_graph(graph, arrays)
    wrapped = [Tensor(v) for v in values]
    for t, v in zip(wrapped, values):
        t._data = np.asarray(v)  # keep the exact dtype (Tensor() would widen float64 inputs)
    return tuple(wrapped) if isinstance(result.type, TupleType) else wrapped[0]

