"""The MindSpore training form: a training step written as a Cell.

MindSpore scripts train with a Cell whose `construct` runs the network (which computes its own
loss), asks `GradOperation` for the gradients, processes them (loss-scale unscaling, overflow
check, global-norm clipping) and calls the optimizer: `nn.TrainOneStepCell`,
`nn.TrainOneStepWithLossScaleCell`, `nn.WithGradCell`, or a user's GradWrap-style cell.
pcompile differentiates on the IR *after* the parallel passes (the backward of an inserted
collective is its transpose), so such a construct is traced twice:

1. **Capture** (`trace_model`, on global shapes): the construct runs until it asks for
   gradients. The network it differentiates has then been traced: its output (the objective)
   is the forward graph's output, and tracing stops there (`Captured`). A call of a sub-cell of
   the step cell on the step's own inputs is traced once however often the construct repeats
   it (`loss = self.network(*inputs)` and the gradient call share one forward).
2. **Replay** (`replay_step`, on each rank's local graph after the split): the construct runs
   again, on the local graph. The network's call returns the local objective; the gradient
   call appends the backward pass seeded with the sensitivity the construct passes (MindSpore's
   `sens`; ones without one) and returns the local gradients; everything else (unscaling,
   overflow checks, clipping, the loss-scale update, the optimizer, `ops.assign`) is traced on
   local tensors. The optimizer call appends the update; `ops.assign(param, value)` stores a new
   value. The graph then returns the loss, every stored value that changed, and the rest of what
   construct returned.

Local tensors are slices: a computation that reduces a gradient across its elements must count
every rank's slice once. `clip_by_global_norm` does (each square sum divided by the number of
ranks holding the same slice, then one AllReduce over all ranks, as MindSpore's parallel pass
does for its `grad_scale` norm), and the overflow flag is all-reduced (MindSpore's
`TrainOneStepWithLossScaleCell`). A user's own reduction of a split gradient is refused with
one message rather than computed on one slice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pcompile.compiler.frontend.tensor import Parameter, Tensor
from pcompile.compiler.frontend.tracing import Tracer, current_tracer, tracing_with
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, NodeResult, ParallelInfo, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout, group_name
from pcompile.ir.ops.state import assigned_names, split_assigned
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.types import DType, TensorType

if TYPE_CHECKING:  # imported where it is used: optimizer_update imports the front end
    from pcompile.compiler.frontend.optimizer_update import StateSlicer


_STACK: list[StepContext] = []


def current_step() -> StepContext | None:
    """The training step being traced, if any (façade hooks consult it)."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def active(step: StepContext) -> Iterator[StepContext]:
    _STACK.append(step)
    try:
        yield step
    finally:
        _STACK.pop()


class StepContext:
    """Hooks the façade calls while a step cell's construct is traced."""

    def __init__(self, top: Any, inputs: list[Tensor]) -> None:
        self.top = top
        self.inputs = inputs
        self.depth = 0

    def call_cell(self, cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  run: Callable[[], Any]) -> Any:
        """`Cell.__call__` delegates here; `run()` traces the call."""
        self.depth += 1
        try:
            return self._call(cell, args, kwargs, run)
        finally:
            self.depth -= 1

    def _call(self, cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              run: Callable[[], Any]) -> Any:
        return run()

    def positions(self, args: tuple[Any, ...]) -> tuple[int, ...] | None:
        """Which of the step's inputs `args` are (None if any is something else)."""
        out = []
        for arg in args:
            index = next((i for i, t in enumerate(self.inputs) if t is arg), None)
            if index is None:
                return None
            out.append(index)
        return tuple(out)

    def grad(self, fn: Any, args: tuple[Any, ...]) -> Any:
        raise NotImplementedError

    def optimizer_step(self, optimizer: Any, grads: Any, skip: Any) -> Any:
        raise PcompileError(
            f"{type(optimizer).__name__} is called before the gradients exist: call it on the "
            "gradients GradOperation returns")

    def after_op(self, op: str, operands: list[Value], result: Value) -> None:
        pass

    def global_norm(self, tensors: list[Tensor]) -> Tensor:
        raise PcompileError("clip_by_global_norm needs the gradients: call it on what "
                            "GradOperation returns")

    def overflow(self, grads: list[Any]) -> Tensor:
        raise PcompileError("the overflow check needs the gradients: call it on what "
                            "GradOperation returns")


# -- 1. capture -----------------------------------------------------------------------------------


@dataclass
class CapturedGrad:
    """What the first trace learned: which network is differentiated, on which inputs."""

    network: Any
    positions: tuple[int, ...]
    objective: Value


class Captured(BaseException):
    """Stops the first trace at the gradient call (a BaseException, so that the user's own
    `except Exception` and pcompile's error wrapping let it through)."""

    def __init__(self, info: CapturedGrad) -> None:
        super().__init__("gradient call reached")
        self.info = info


class Capture(StepContext):
    """The first trace: forward of the differentiated network, on global shapes."""

    def __init__(self, top: Any, inputs: list[Tensor]) -> None:
        super().__init__(top, inputs)
        self.memo: dict[tuple[int, tuple[int, ...]], Any] = {}

    def _call(self, cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              run: Callable[[], Any]) -> Any:
        positions = self.positions(args)
        if self.depth != 1 or kwargs or positions is None:
            return run()
        key = (id(cell), positions)
        if key not in self.memo:
            self.memo[key] = run()
        return self.memo[key]

    def grad(self, fn: Any, args: tuple[Any, ...]) -> Any:
        net_args, _ = fn.op.split(args)
        positions = self.positions(net_args)
        if positions is None:
            raise PcompileError(
                f"GradOperation differentiates {type(fn.fn).__name__} on arguments that are not "
                "the training step's own inputs; pcompile differentiates the network on the "
                "step's inputs (call it as grad(self.network, weights)(*inputs[, sens]))")
        out = fn.fn(*net_args)
        if not isinstance(out, Tensor) or not out.is_symbolic:
            raise PcompileError(
                f"GradOperation: {type(fn.fn).__name__} returns "
                f"{type(out).__name__}; the network differentiated in a training step must "
                "return one tensor computed from its inputs (its loss)")
        assert out._value is not None
        raise Captured(CapturedGrad(fn.fn, positions, out._value))


# -- 2. replay ------------------------------------------------------------------------------------


@dataclass
class ReplayEnv:
    """What the replay needs from the compile: the ranks, each stored tensor's layout (empty
    on one device), where new stored tensors' initial values go, and how a per-parameter
    optimizer state is laid out in a local graph (`passes.optimizer.state_slicer`)."""

    devices: int
    layouts: dict[str, TensorLayout]
    initial_values: MutableMapping[str, Any]
    slicer: StateSlicer | None = None
    network_params: dict[str, Parameter] = field(default_factory=dict)
    # cells with their own bprop (compiler/frontend/custom_bprop.py), as passes.autodiff.CustomVjp
    custom: list[Any] = field(default_factory=list)

    @property
    def parallel(self) -> bool:
        return self.devices > 1


@dataclass
class ReplayResult:
    """The step's outputs: names and values, and each output's layout (None: replicated)."""

    names: list[str]
    values: list[Value]
    layouts: list[TensorLayout | None]
    trains: bool


class ReplayTracer(Tracer):
    """A tracer on a local graph whose network parameters already exist; any other Parameter
    the step reads (a loss scale, a step counter) becomes a stored state of the graph."""

    def __init__(self, graph: Graph, env: ReplayEnv) -> None:
        super().__init__(graph)
        self.env = env
        for name, param in env.network_params.items():
            self.params[id(param)] = graph.param(name)

    def add_parameter(self, param: Parameter, kind: str = "weight") -> GraphParam:
        key = id(param)
        if key not in self.params:
            assert param.name is not None
            if param.name in {p.name for p in self.graph.params}:
                raise PcompileError(
                    f"two different parameters are both named {param.name!r}; give them "
                    "distinct names")
            gp = GraphParam(TensorType(param.dtype, param.shape), param.name, "state")
            self.params[key] = self.graph.add_param(gp)
            self.env.initial_values[param.name] = param.source
            if self.env.parallel:
                self.env.layouts.setdefault(param.name, _replicated(param.shape,
                                                                    self.env.devices))
        return self.params[key]


def _replicated(shape: tuple[int, ...], devices: int) -> TensorLayout:
    return TensorLayout((devices,), tuple(-1 for _ in shape), shape)


class Replay(StepContext):
    """The second trace: the step's construct on one local graph."""

    def __init__(self, top: Any, captured: CapturedGrad, graph: Graph, tracer: ReplayTracer,
                 env: ReplayEnv) -> None:
        inputs = [Tensor(_value=p) for p in graph.inputs]
        super().__init__(top, inputs)
        self.captured = captured
        self.graph = graph
        self.tracer = tracer
        self.env = env
        own, assigned = split_assigned(graph)
        self.objective = own[0]
        self.report = own[1] if len(own) > 1 else own[0]
        # the Parameters the network's forward assigned, and their new values
        self.assigned = list(zip(assigned_names(graph), assigned))
        self.tags: dict[int, str] = {}  # id(value) -> name of the stored tensor / input
        self.updates: list[tuple[str, Value]] = []
        self._updated: set[str] = set()  # the names in `updates` (one look-up per record)
        self.trusted = 0

    # -- the network and its gradients ------------------------------------------------------------
    def _call(self, cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              run: Callable[[], Any]) -> Any:
        if cell is not self.captured.network:
            return run()
        self._check_inputs(cell, args, kwargs)
        return Tensor(_value=self.objective)

    def _check_inputs(self, cell: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs or self.positions(args) != self.captured.positions:
            raise PcompileError(
                f"the training step calls {type(cell).__name__} on other arguments than when it "
                "asked for its gradients; call the network on the step's inputs, the same way "
                "every time")

    def grad(self, fn: Any, args: tuple[Any, ...]) -> Any:
        net_args, sens = fn.op.split(args)
        if fn.fn is not self.captured.network:
            raise PcompileError(
                f"the training step differentiates {type(fn.fn).__name__} and "
                f"{type(self.captured.network).__name__}; pcompile differentiates one network "
                "per step")
        self._check_inputs(fn.fn, net_args, {})
        from pcompile.passes.autodiff import append_gradients

        seed = self._seed(sens)
        inputs = [self.graph.inputs[i] for i in self.captured.positions]
        weights = [self._weight(p) for p in (fn.weights or ())]
        wrt = (inputs if fn.op.get_all or not fn.op.get_by_list else []) + weights
        grads = append_gradients(self.graph, self.objective, wrt, [seed],
                                 custom=self.env.custom) if wrt else []
        tensors = []
        for value, of in zip(grads, wrt):
            self.tags[id(value)] = of.name  # type: ignore[attr-defined]
            tensors.append(Tensor(_value=value))
        n_in = len(wrt) - len(weights)
        return fn.op.package(tensors[:n_in], tensors[n_in:])

    def _weight(self, param: Parameter) -> GraphParam:
        if param.name not in self.env.network_params:
            raise PcompileError(
                f"GradOperation: weight {param.name!r} is not a parameter of the network it "
                "differentiates")
        return self.graph.param(param.name)

    def _seed(self, sens: Any) -> Value:
        objective = self.objective
        if sens is None:
            ones = np.ones((), objective.dtype.np)
            return Constant(np.broadcast_to(ones, objective.shape), objective.dtype)
        value = self.tracer.to_value(sens, objective.dtype)
        b = Builder(self.graph, scope=self.tracer.scope)
        if isinstance(value.type, TensorType) and value.dtype != objective.dtype and \
                value.dtype.is_float:
            value = b.emit("Cast", [value], {"dst_type": objective.dtype})
        if isinstance(value.type, TensorType) and value.shape != objective.shape and \
                value.tensor_type.size == objective.tensor_type.size:
            # a (1,) sensitivity for a scalar loss (a (1,) loss scale), as MindSpore accepts
            value = b.emit("Reshape", [value], {"shape": objective.shape})
        if value.type != objective.type:
            raise PcompileError(
                f"GradOperation: the sensitivity is {value.type}, the network's output is "
                f"{objective.type} on each rank; build it from the output (ops.ones_like(loss) "
                "* scale, ops.fill(loss.dtype, loss.shape, value))")
        return value

    # -- stored state ---------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Any, grads: Any, skip: Any) -> Any:
        from pcompile.compiler.frontend.optimizer_update import rank_sum, trace_update

        grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
        params = [p for p in optimizer.parameters]
        if len(grads) != len(params):
            raise PcompileError(
                f"{type(optimizer).__name__} updates {len(params)} parameters but was given "
                f"{len(grads)} gradients")
        by_name: dict[str, Value] = {}
        for p, g in zip(params, grads):
            value = self.tracer.to_value(g, p.dtype)
            local = self._weight(p)
            if value.type != local.type:
                raise PcompileError(
                    f"{type(optimizer).__name__}: the gradient given for {p.name!r} is "
                    f"{value.type}, the parameter is {local.type} on each rank")
            by_name[p.name] = value  # type: ignore[index]
        skip_value = None if skip is None else self.tracer.to_value(skip, DType.bool_)
        if skip_value is not None and skip_value.dtype is not DType.bool_:
            raise PcompileError(f"{type(optimizer).__name__}(grads, skip=...): skip must be a "
                                f"Bool tensor, got {skip_value.dtype.value}")
        # The optimizer's reductions of gradient slices (Lamb's norms, AdaFactor's means) are
        # completed over the slices by `rank_sum`: not the local reductions `after_op` refuses.
        self.trusted += 1
        try:
            init, updates = trace_update(
                self.graph, optimizer, self.env.network_params, by_name,
                self.env.slicer if self.env.parallel else None, skip_value,
                rank_sum(self.graph, self.env.devices, self.env.layouts)
                if self.env.parallel else None)
        finally:
            self.trusted -= 1
        if not self.env.parallel:
            for name, value in init.items():
                self.env.initial_values[name] = value
        for name, value in updates:
            self._record(name, value)
        return Tensor(_value=updates[0][1]) if updates else Tensor(np.asarray(True))

    def assign(self, param: Any, value: Any) -> Any:
        if not isinstance(param, Parameter):
            raise PcompileError(f"ops.assign: the variable must be a Parameter, got "
                                f"{type(param).__name__}")
        target = self.tracer.to_value(param, None)
        new = self.tracer.to_value(value, param.dtype)
        if new.type != target.type:
            if new.dtype == target.dtype and new.shape != target.shape and \
                    int(np.prod(new.shape)) == int(np.prod(target.shape)):
                new = Builder(self.graph, scope=self.tracer.scope).emit(
                    "Reshape", [new], {"shape": target.shape})
            else:
                raise PcompileError(f"ops.assign({param.name}, ...): the value is {new.type}, "
                                    f"the parameter is {target.type}")
        assert param.name is not None
        self._record(param.name, new)
        return Tensor(_value=new)

    def _record(self, name: str, value: Value) -> None:
        if name in self._updated:
            raise PcompileError(f"the training step assigns {name!r} twice")
        self._updated.add(name)
        self.updates.append((name, value))

    # -- reductions of gradients -------------------------------------------------------------------
    def after_op(self, op: str, operands: list[Value], result: Value) -> None:
        tagged = [(v, self.tags[id(v)]) for v in operands if id(v) in self.tags]
        if not tagged:
            return
        # An op that combines the elements of an operand: on a split gradient each rank
        # sees a slice.
        if has_trait(op, Trait.REDUCTION) and not self.trusted:
            for _, name in tagged:
                layout = self.env.layouts.get(name)
                if layout is not None and any(e != -1 for e in layout.tensor_map):
                    raise PcompileError(
                        f"{op} in the training step reduces the gradient of {name!r}, which is "
                        f"split over the ranks ({layout}): each rank holds a slice, so a local "
                        "reduction is not the whole gradient's; use ops.clip_by_global_norm / "
                        "nn.ClipByGlobalNorm (which count every slice once)")
        if isinstance(result.type, TensorType):
            for value, name in tagged:
                if value.type == result.type or value.shape == result.shape:
                    self.tags[id(result)] = name
                    break

    def global_norm(self, tensors: list[Tensor]) -> Tensor:
        """sqrt(sum of squares of every element of every tensor), each tensor counted once
        over the ranks (float32)."""
        from pcompile.compiler.frontend import ops

        self.trusted += 1
        try:
            total: Tensor | None = None
            for i, t in enumerate(tensors):
                if not isinstance(t, Tensor) or not t.is_symbolic:
                    t = Tensor(np.asarray(t, np.float32))
                copies = self._copies(t, i)
                # mypy#5345 (ops.__getattr__ in an import cycle): ops.* is `Any? not callable`
                x = ops.cast(t, DType.float32)  # type: ignore[misc]
                term = ops.reduce_sum(ops.square(x), ())  # type: ignore[misc]
                if copies > 1:
                    term = term * (1.0 / copies)
                total = term if total is None else total + term
            assert total is not None
            if self.env.parallel and total.is_symbolic:
                total = Tensor(_value=self._all_reduce(total._value,  # type: ignore[arg-type]
                                                       "global_norm_allreduce"))
            return ops.sqrt(total)  # type: ignore[misc]
        finally:
            self.trusted -= 1

    def _copies(self, t: Tensor, index: int) -> int:
        """How many ranks hold the same slice of `t` (its gradient's parameter layout)."""
        if not self.env.parallel:
            return 1
        name = self.tags.get(id(t._value)) if t.is_symbolic else None
        if name is None:
            if not t.is_symbolic:
                return self.env.devices  # a constant: the same on every rank
            raise PcompileError(
                f"clip_by_global_norm: tensor {index} is not a gradient, so how it is split "
                "over the ranks is unknown; pass the gradients (or tensors computed from them "
                "element-wise)")
        layout = self.env.layouts.get(name)
        return layout.repeat_count if layout is not None else self.env.devices

    def _all_reduce(self, value: Value, name: str) -> Value:
        ranks = tuple(range(self.env.devices))
        b = Builder(self.graph, scope=self.tracer.scope)
        reason = ("global norm of the gradients: each rank's square sums of its slices (each "
                  "divided by the number of ranks holding that slice), summed over all ranks"
                  if name.startswith("global_norm") else
                  "gradient overflow: every rank's count of gradients with an inf or NaN, "
                  "summed over all ranks")
        return b.emit("AllReduce", [value],
                      {"op": "sum", "group": group_name(ranks, self.env.devices),
                       "rank_list": ranks, "fusion": 0},
                      instance_name=name, name_hint=name.split("_allreduce")[0],
                      parallel=ParallelInfo(reason=reason, bytes=value.tensor_type.nbytes))

    def overflow(self, grads: list[Any]) -> Tensor:
        """True when an element of any gradient on any rank is inf or NaN (MindSpore's GPU
        check: a flag per gradient, summed over the gradients and over all ranks)."""
        from pcompile.compiler.frontend import ops

        self.trusted += 1
        try:
            total: Tensor | None = None
            for g in grads:
                # mypy#5345 (ops.__getattr__ in an import cycle): ops.* is `Any? not callable`
                finite = ops.isfinite(g)  # type: ignore[misc]
                bad = ops.cast(ops.logical_not(finite), DType.float32)  # type: ignore[misc]
                flag = ops.reduce_max(bad, ())  # type: ignore[misc]
                total = flag if total is None else total + flag
            if total is None:
                total = Tensor(np.zeros((), np.float32))
            if self.env.parallel and total.is_symbolic:
                total = Tensor(_value=self._all_reduce(total._value,  # type: ignore[arg-type]
                                                       "overflow_allreduce"))
            return ops.less_equal(Tensor(np.ones((), np.float32)), total)  # type: ignore[misc]
        finally:
            self.trusted -= 1

    # -- the result -------------------------------------------------------------------------------
    def finish(self, returned: Any) -> ReplayResult:
        items = _flatten(returned)
        values = [self.tracer.to_value(x, None) if not isinstance(x, Value) else x
                  for x in items]
        if self.updates:
            for name, value in self.assigned:
                self._record(name, value)
            if not values:
                raise PcompileError("the training step must return its loss")
            first = _strip_depend(values[0])
            if first is self.objective or first is self.report:
                loss = self.report
            elif isinstance(first.type, TensorType) and first.shape in ((), (1,)) and \
                    first.dtype.is_float:
                loss = first
            else:
                raise PcompileError(
                    f"the training step returns {first.type} first; it must return the loss "
                    "first (MindSpore's training cells return loss, ...)")
            if loss.shape != ():
                loss = Builder(self.graph).emit("Reshape", [loss], {"shape": ()})
            # the network's parameters first, then the other stored values in the order the
            # step assigned them (the optimizer's state, loss-scale state)
            order = {name: i for i, name in enumerate(self.env.network_params)}
            updates = sorted(self.updates, key=lambda u: order.get(u[0], len(order)))
            names = ["loss", *(n for n, _ in updates)]
            outs = [loss, *(v for _, v in updates)]
            layouts: list[TensorLayout | None] = [None] * len(outs)
            for i, value in enumerate(values[1:], start=1):
                names.append(f"output{i}")
                outs.append(value)
                layouts.append(self._layout(value))
            return ReplayResult(names, outs, layouts, True)
        if not values:
            raise PcompileError("the training step returns nothing")
        names = [f"output{i}" for i in range(len(values))]
        layouts = [self._layout(v) for v in values]
        for name, value in self.assigned:  # stored under the Parameter's name
            names.append(name)
            values.append(value)
            layouts.append(self.env.layouts.get(name))
        return ReplayResult(names, values, layouts, False)

    def _layout(self, value: Value) -> TensorLayout | None:
        name = self.tags.get(id(value))
        layout = self.env.layouts.get(name) if name is not None else None
        if layout is not None and isinstance(value.type, TensorType) and \
                layout.slice_shape == value.shape:
            return layout
        return None


def _flatten(returned: Any) -> list[Any]:
    if isinstance(returned, (tuple, list)):
        out: list[Any] = []
        for item in returned:
            out.extend(_flatten(item))
        return out
    return [] if returned is None else [returned]


def _strip_depend(value: Value) -> Value:
    while isinstance(value, NodeResult) and value.node.op == "Depend":
        value = value.node.operands[0]
    return value


def replay_step(top: Any, captured: CapturedGrad, graph: Graph, env: ReplayEnv,
                path: str) -> ReplayResult:
    """Run the step cell's construct on the local `graph` (see the module docstring); sets the
    graph's outputs and their names, and returns them."""
    from pcompile.compiler.frontend.model_file import call_user

    tracer = ReplayTracer(graph, env)
    with tracing_with(tracer):
        replay = Replay(top, captured, graph, tracer, env)
        with active(replay):
            returned = call_user(top.construct, f"{type(top).__name__}.construct()", path,
                                 *replay.inputs)
            result = replay.finish(returned)
    graph.outputs = list(result.values)
    graph.attrs["outputs"] = tuple(result.names)
    graph.dead_code_elimination()
    return result


def trace_hook(op: str, operands: list[Value], result: Value) -> None:
    """Called by `Primitive` after each node it emits while tracing."""
    step = current_step()
    if step is not None and current_tracer() is not None:
        step.after_op(op, operands, result)
