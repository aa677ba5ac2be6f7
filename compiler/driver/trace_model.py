"""Tracing a model file into the forward(+loss) graph.

Inference: the network is the root cell (scope `Default`), its construct's arguments are the
graph inputs, its results the graph outputs. Training with `loss()`: the graph is one step of
`TrainOneStepCell(WithLossCell(net, loss))`, so the network's ops live in scope
`Default/network-WithLossCell/_backbone-<Net>` and the loss's in
`Default/network-WithLossCell/_loss_fn-<Loss>`, as in MindSpore; it returns the loss. Training
with a step cell (or a network that computes its own loss, traced as `TrainOneStepCell(net,
opt)`): the graph is the differentiated network's forward (scope `Default/network-<Net>`),
returning its output; `compiler.train_step` replays the rest after the split. A non-scalar
objective is returned with its mean (the loss a run reports).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.compiler.frontend.assign import finish_assignments
from pcompile.compiler.frontend.model_file import ModelFile, as_input_list, call_user, iterate_user
from pcompile.compiler.frontend.nn.cell import Cell, call_top
from pcompile.compiler.frontend.nn.optim_base import Optimizer
from pcompile.compiler.frontend.nn.wrap import TrainOneStepCell
from pcompile.compiler.frontend.nn.wrap import _StepCell as StepCellBase
from pcompile.compiler.frontend.random_state import random_parameters
from pcompile.compiler.frontend.tensor import Parameter, Tensor, TensorSpec
from pcompile.compiler.frontend.tracing import tracing
from pcompile.compiler.frontend.train_model import Model
from pcompile.compiler.frontend.train_step import Capture, Captured, CapturedGrad, active
from pcompile.ir.core import Graph, NodeResult, Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType, TensorType


@dataclass
class TracedModel:
    """The forward graph plus what is needed to run and train it."""

    graph: Graph
    network: Cell
    input_names: list[str]
    label_names: list[str]
    example_inputs: list[TensorSpec | np.ndarray]
    example_labels: list[TensorSpec | np.ndarray]
    parameters: dict[str, Parameter] = field(default_factory=dict)
    loss_cell: Cell | None = None
    # "inference"; "train" (loss, updated parameters and state); "grad" (a step cell that
    # returns gradients and updates nothing)
    mode: str = "inference"
    step: StepTrace | None = None  # a training step cell, replayed after the split
    # calls of cells with their own bprop (compiler/frontend/custom_bprop.py), which autodiff uses
    custom_bprops: list[Any] = field(default_factory=list)

    @property
    def differentiates(self) -> bool:
        return self.mode != "inference"


@dataclass
class StepTrace:
    """A training step cell and what its first trace captured (`compiler.train_step`)."""

    top: Cell
    captured: CapturedGrad


def _spec_type(item: TensorSpec | np.ndarray) -> TensorType:
    if isinstance(item, TensorSpec):
        return item.type
    return TensorType(DType.from_any(item.dtype), tuple(int(d) for d in item.shape))


def _shapes(value: Any) -> str:
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    shapes = [str(tuple(getattr(t, "shape", ()))) for t in items]
    return shapes[0] if len(shapes) == 1 else "(" + ", ".join(shapes) + ")"


def _check_arity(network: Cell, given: int, path: str) -> None:
    """inputs() gives one array per positional argument of the network's construct (with
    loss(), the labels go to the loss, not the network)."""
    try:
        params = list(inspect.signature(network.construct).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) <= given <= len(positional):
        return
    names = ", ".join(p.name for p in positional) or "nothing"
    raise PcompileError(
        f"inputs() in {path} returns {given} array(s), but {type(network).__name__}.construct "
        f"takes {len(required)}"
        + (f" to {len(positional)}" if len(positional) != len(required) else "")
        + f" ({names}); return one array per argument of construct (the labels come from "
        "labels() or the rest of each dataset() batch and go to loss())")


def _arg_names(fn: Any, count: int, fallback: str) -> list[str]:
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = params[:count]
    while len(names) < count:
        names.append(f"{fallback}{len(names)}")
    return names


def _first_batch_labels(mf: ModelFile, skip: int = 1) -> list[TensorSpec | np.ndarray]:
    """labels(), or the items after the first `skip` of the first dataset() batch."""
    if mf.labels is not None:
        return as_input_list(call_user(mf.labels, "labels()", mf.path), "labels", mf.path)
    if mf.dataset is not None:
        data = call_user(mf.dataset, "dataset()", mf.path)
        batch = next(iterate_user(data, "dataset()", mf.path), None)
        if batch is None:
            raise PcompileError(f"dataset() in {mf.path} yields no batch")
        if not isinstance(batch, (tuple, list)) or len(batch) <= skip:
            raise PcompileError(
                f"dataset() in {mf.path} must yield (input, label) tuples, got "
                f"{type(batch).__name__}"
            )
        return as_input_list(tuple(batch[skip:]), "dataset labels", mf.path)
    raise PcompileError(
        f"model file {mf.path} defines loss() but neither dataset() nor labels(); "
        "the label shape is unknown"
    )


def _local(t: TensorType, batch_split: int, name: str) -> TensorType:
    """The per-rank type of a data-parallel input: dim 0 divided by the number of ranks."""
    if batch_split == 1 or not t.shape:
        return t
    if t.shape[0] % batch_split:
        raise PcompileError(
            f"data_parallel splits dim 0 of {name} {t.shape} over {batch_split} ranks, but "
            f"{t.shape[0]} is not divisible by {batch_split}"
        )
    return t.with_shape((t.shape[0] // batch_split, *t.shape[1:]))


def trace_model(mf: ModelFile, batch_split: int = 1, micro_batches: bool = False
                ) -> TracedModel:
    """Trace the model file. `batch_split` > 1 traces each input and label with dim 0 divided
    by it (the local batch of one rank in data_parallel mode).

    Training forms: `loss()` + `optimizer()` (the network's output goes to the loss); a
    network that returns its own loss + `optimizer()` (traced as `nn.TrainOneStepCell(network,
    optimizer)`); `model()` returning a training step cell (`nn.TrainOneStepCell`,
    `nn.WithGradCell`, your own cell calling `ops.GradOperation`), traced in two parts by
    `compiler.train_step` (a `Model(...)` stands for its `train_network`, the step cell
    `amp.build_train_network` builds); or `model()` returning `nn.PipelineCell`, traced by
    `compiler.pipelining` (one micro-batch when `micro_batches`, else the whole batch)."""
    network = call_user(mf.model, "model()", mf.path)
    if isinstance(network, Model):
        network = network.train_network
    if not isinstance(network, Cell):
        raise PcompileError(f"model() in {mf.path} must return an nn.Cell, got {type(network)}")
    from pcompile.compiler.frontend.nn.pipeline import PipelineCell

    if isinstance(network, PipelineCell):
        if mf.loss is not None:
            raise PcompileError(
                f"model() in {mf.path} returns nn.PipelineCell, whose network computes its own "
                "loss (nn.WithLossCell), and the file also defines loss(); remove loss()")
        from pcompile.compiler.driver.pipelining import trace_pipeline_cell

        network.set_train(True)
        return trace_pipeline_cell(mf, network, network.micro_size if micro_batches else 1)
    step_cell = isinstance(network, StepCellBase)
    if step_cell and (mf.loss is not None or mf.optimizer is not None):
        defined = " and ".join(f"{n}()" for n, f in (("loss", mf.loss),
                                                     ("optimizer", mf.optimizer)) if f)
        raise PcompileError(
            f"model() in {mf.path} returns {type(network).__name__}, a training step cell with "
            f"its own loss and optimizer, and the file also defines {defined}; remove "
            f"{defined} (or return the bare network)")
    if mf.loss is None and mf.optimizer is not None and not step_cell:
        opt = call_user(mf.optimizer, "optimizer(params)", mf.path, network.trainable_params())
        check_optimizer(opt, mf.path)
        network = TrainOneStepCell(network, opt)  # the network computes its own loss
        step_cell = True
    if mf.loss is not None or step_cell:
        network.set_train(True)  # as MindSpore's Model.train: self.training branches train
    network.finalize_parameter_names()
    if mf.loss is None:
        return _trace_network(mf, network, batch_split)
    example_inputs = as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path)
    _check_arity(network, len(example_inputs), mf.path)
    input_names = _arg_names(network.construct, len(example_inputs), "input")

    loss_cell = call_user(mf.loss, "loss()", mf.path)
    if not isinstance(loss_cell, Cell):
        raise PcompileError(f"loss() in {mf.path} must return an nn.Cell")
    loss_cell.set_train(True)
    example_labels = _first_batch_labels(mf)
    label_names = ["label" if i == 0 else f"label{i}" for i in range(len(example_labels))]

    net_name = type(network).__name__
    graph = Graph("TrainOneStepCell_construct")
    graph.attrs["training"] = True
    parameters: dict[str, Parameter] = {}
    with tracing(graph) as tracer:
        args = [tracer.add_input(n, _local(_spec_type(s), batch_split, n))
                for n, s in zip(input_names, example_inputs)]
        labels = [tracer.add_input(n, _local(_spec_type(s), batch_split, n))
                  for n, s in zip(label_names, example_labels)]
        _add_parameters(tracer, network, parameters)
        with tracer.cell_scope("network-WithLossCell"):
            with tracer.cell_scope(f"_backbone-{net_name}"):
                out = call_top(network, tracer, lambda: call_user(
                    network.construct, f"{net_name}.construct()", mf.path, *args))
            with tracer.cell_scope(f"_loss_fn-{type(loss_cell).__name__}"):
                try:
                    loss = call_user(loss_cell.construct,
                                     f"{type(loss_cell).__name__}.construct()", mf.path, out,
                                     *labels)
                except PcompileError as exc:
                    source = ("labels()" if mf.labels is not None
                              else "dataset()'s first batch")
                    exc.args = (
                        f"{exc}\n(in loss() of {mf.path}: it takes the network's output "
                        f"{_shapes(out)} and the labels "
                        + ", ".join(f"{n} {_shapes(t)}" for n, t in zip(label_names, labels))
                        + f" from {source}; where they do not fit, make the labels match the "
                        "output)",)
                    raise
        _check_outputs([loss], net_name)
        graph.outputs = _objective_outputs(tracer, loss, f"the loss of "
                                           f"{type(loss_cell).__name__}")
        finish_assignments(tracer, graph)
        parameters.update(random_parameters(tracer))  # ops.Dropout's step counter
        custom_bprops = list(tracer.custom_bprop)
    graph.dead_code_elimination()
    return TracedModel(
        graph=graph,
        network=network,
        input_names=input_names,
        label_names=label_names,
        example_inputs=example_inputs,
        example_labels=example_labels,
        parameters=parameters,
        loss_cell=loss_cell,
        mode="train",
        custom_bprops=custom_bprops,
    )


def check_optimizer(opt: Any, path: str) -> Optimizer:
    if not isinstance(opt, Optimizer):
        raise PcompileError(
            f"optimizer(params) in {path} must return an nn optimizer (nn.SGD, nn.Momentum, "
            f"nn.Adam, ...), got {type(opt).__name__}"
        )
    return opt


def _add_parameters(tracer: Any, cell: Cell, parameters: dict[str, Parameter]) -> None:
    for _, param in cell.parameters_and_names():
        if param.name in parameters and parameters[param.name] is not param:
            raise PcompileError(
                f"two different parameters are both named {param.name!r}; "
                "give them distinct names"
            )
        parameters[param.name] = param  # type: ignore[index]
        tracer.add_parameter(param)


def _check_outputs(outputs: list[Any], net_name: str) -> None:
    for i, value in enumerate(outputs):
        if not isinstance(value, Tensor) or not value.is_symbolic:
            raise PcompileError(
                f"construct() of {net_name} returned {type(value).__name__} as output {i}; "
                "it must return tensors computed from its inputs or parameters"
            )


def _objective_outputs(tracer: Any, objective: Tensor, what: str) -> list[Value]:
    """The graph outputs of a training objective: the objective (differentiated with a
    sensitivity of ones, as MindSpore does) and, when it is not a scalar, its mean (the loss a
    run reports, as MindSpore's LossMonitor prints the mean of a non-scalar loss)."""
    value = objective._value
    assert value is not None
    if not isinstance(value.type, TensorType) or not value.dtype.is_float:
        raise PcompileError(f"{what} is {value.type}; a training objective must be a "
                            "floating-point tensor")
    if value.shape == ():
        return [value]
    node = value.node if isinstance(value, NodeResult) else None
    mean = tracer.builder.emit("ReduceMean", [value], {"axis": (), "keep_dims": False},
                               instance_name="loss_mean", name_hint="loss",
                               scope=node.scope if node else tracer.scope,
                               source=node.source if node else None)
    return [value, mean]


def _input_signature(cell: Cell) -> tuple[list[str], int | None]:
    """The names of the positional arguments the step's inputs go to, and how many of them
    are required (None: unknown). A wrapper's `construct(*inputs)` is looked through to the
    network it wraps (`self.network`, `self.network_with_loss`, `self._backbone`...)."""
    seen: set[int] = set()
    while id(cell) not in seen:
        seen.add(id(cell))
        try:
            params = list(inspect.signature(cell.construct).parameters.values())
        except (TypeError, ValueError):
            return [], None
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
        if positional or not any(p.kind == p.VAR_POSITIONAL for p in params):
            required = sum(1 for p in positional if p.default is p.empty)
            return [p.name for p in positional], required
        inner = next((getattr(cell, a) for a in ("network_with_loss", "network", "_backbone")
                      if isinstance(getattr(cell, a, None), Cell)), None)
        if inner is None:
            return [], None
        cell = inner
    return [], None


def _step_examples(mf: ModelFile, required: int | None) -> list[TensorSpec | np.ndarray]:
    """inputs(); when the network takes more arguments (its labels), labels() or the rest of
    the first dataset() batch."""
    examples = as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path)
    if required is None or len(examples) >= required:
        return examples
    if mf.labels is not None or mf.dataset is not None:
        extra = _first_batch_labels(mf, skip=len(examples))
        examples = examples + extra
    if len(examples) < required:
        raise PcompileError(
            f"the network takes {required} inputs but inputs() in {mf.path} gives "
            f"{len(examples)}; return every input the network's construct takes (its labels "
            "too), or give them with labels()")
    return examples


def _trace_network(mf: ModelFile, top: Cell, batch_split: int) -> TracedModel:
    """A network (inference), or a training step cell (`compiler.train_step`): the first
    trace."""
    names, required = _input_signature(top)
    examples = _step_examples(mf, required)
    input_names = list(names[:len(examples)])
    while len(input_names) < len(examples):
        input_names.append(f"input{len(input_names)}")
    net_name = type(top).__name__
    graph = Graph(f"{net_name}_construct")
    parameters: dict[str, Parameter] = {}
    captured: CapturedGrad | None = None
    with tracing(graph) as tracer:
        args = [tracer.add_input(n, _local(_spec_type(s), batch_split, n))
                for n, s in zip(input_names, examples)]
        _add_parameters(tracer, top, parameters)
        try:
            with active(Capture(top, args)):
                result = call_top(top, tracer, lambda: call_user(
                    top.construct, f"{net_name}.construct()", mf.path, *args))
        except Captured as stop:
            captured = stop.info
        if captured is None:
            outputs = list(result) if isinstance(result, (tuple, list)) else [result]
            _check_outputs(outputs, net_name)
            graph.outputs = [t._value for t in outputs]  # type: ignore[misc]
        else:
            objective = Tensor(_value=captured.objective)
            what = f"the output of {type(captured.network).__name__}"
            graph.outputs = _objective_outputs(tracer, objective, what)
        finish_assignments(tracer, graph)
        parameters.update(random_parameters(tracer))  # ops.Dropout's step counter
        custom_bprops = list(tracer.custom_bprop) if captured is not None else []
    graph.dead_code_elimination()
    if captured is not None:
        # The step cell's own parameters (a loss scale, counters) are read after the
        # gradients: the replay makes them stored state of the local graphs.
        network_params = {p.name: p for _, p in captured.network.parameters_and_names()}
        graph.params = [p for p in graph.params if p.kind == "input" or p.name in network_params
                        or p.uses]
        parameters = {n: p for n, p in parameters.items()
                      if n in network_params or any(q.name == n for q in graph.params)}
        graph.attrs["training"] = True
    trains = captured is not None and any(isinstance(c, Optimizer)
                                          for _, c in top.cells_and_names())
    return TracedModel(
        graph=graph,
        network=top,
        input_names=input_names,
        label_names=[],
        example_inputs=examples,
        example_labels=[],
        parameters=parameters,
        mode="inference" if captured is None else ("train" if trains else "grad"),
        step=None if captured is None else StepTrace(top, captured),
        custom_bprops=custom_bprops,
    )


def trace_cell(
    cell: Cell, *examples: np.ndarray | TensorSpec, name: str = "cell"
) -> tuple[Graph, dict[str, np.ndarray]]:
    """Trace one Cell on example inputs (for tests and tools): returns the graph (inputs
    `x0, x1, ...`, then the cell's parameters) and the parameters' values by name."""
    cell.finalize_parameter_names()
    graph = Graph(f"{type(cell).__name__}_construct")
    values: dict[str, np.ndarray] = {}
    with tracing(graph) as tracer:
        args = [tracer.add_input(f"x{i}", _spec_type(e)) for i, e in enumerate(examples)]
        for _, param in cell.parameters_and_names():
            tracer.add_parameter(param)
            assert param.name is not None
            values[param.name] = param.asnumpy()
        result = cell.construct(*args)
        outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        graph.outputs = [t._value for t in outputs]  # type: ignore[misc]
    graph.dead_code_elimination()
    return graph, values
