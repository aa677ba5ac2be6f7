"""Tracing a model file into the forward(+loss) graph.

Inference: the network is the root cell (scope `Default`), its construct's arguments are the
graph inputs, its results the graph outputs. Training: the graph is one step of
`TrainOneStepCell(WithLossCell(net, loss))`, so the network's ops live in scope
`Default/network-WithLossCell/_backbone-<Net>` and the loss's in
`Default/network-WithLossCell/_loss_fn-<Loss>`, as in MindSpore; it returns the loss.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pcompile.compiler.model_file import ModelFile, as_input_list, call_user, iterate_user
from pcompile.compiler.nn.cell import Cell
from pcompile.compiler.tensor import Parameter, Tensor, TensorSpec
from pcompile.compiler.tracing import tracing
from pcompile.ir.core import Graph
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


def _spec_type(item: TensorSpec | np.ndarray) -> TensorType:
    if isinstance(item, TensorSpec):
        return item.type
    return TensorType(DType.from_any(item.dtype), tuple(int(d) for d in item.shape))


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


def _first_batch_labels(mf: ModelFile) -> list[TensorSpec | np.ndarray]:
    if mf.labels is not None:
        return as_input_list(call_user(mf.labels, "labels()", mf.path), "labels", mf.path)
    if mf.dataset is not None:
        data = call_user(mf.dataset, "dataset()", mf.path)
        batch = next(iterate_user(data, "dataset()", mf.path), None)
        if batch is None:
            raise PcompileError(f"dataset() in {mf.path} yields no batch")
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise PcompileError(
                f"dataset() in {mf.path} must yield (input, label) tuples, got "
                f"{type(batch).__name__}"
            )
        return as_input_list(tuple(batch[1:]), "dataset labels", mf.path)
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
    by it (the local batch of one rank in data_parallel mode). A model() that returns
    `nn.PipelineCell` is traced by `compiler.pipelining` (one micro-batch when
    `micro_batches`, else the whole batch)."""
    network = call_user(mf.model, "model()", mf.path)
    if not isinstance(network, Cell):
        raise PcompileError(f"model() in {mf.path} must return an nn.Cell, got {type(network)}")
    from pcompile.compiler.nn.pipeline import PipelineCell

    if isinstance(network, PipelineCell):
        if mf.loss is not None:
            raise PcompileError(
                f"model() in {mf.path} returns nn.PipelineCell, whose network computes its own "
                "loss (nn.WithLossCell), and the file also defines loss(); remove loss()")
        from pcompile.compiler.pipelining import trace_pipeline_cell

        return trace_pipeline_cell(mf, network, network.micro_size if micro_batches else 1)
    if mf.loss is None and mf.optimizer is not None:
        raise PcompileError(f"model file {mf.path} defines optimizer() but no loss()")
    network.finalize_parameter_names()
    example_inputs = as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path)
    input_names = _arg_names(network.construct, len(example_inputs), "input")

    loss_cell: Cell | None = None
    example_labels: list[TensorSpec | np.ndarray] = []
    label_names: list[str] = []
    if mf.loss is not None:
        loss_cell = call_user(mf.loss, "loss()", mf.path)
        if not isinstance(loss_cell, Cell):
            raise PcompileError(f"loss() in {mf.path} must return an nn.Cell")
        example_labels = _first_batch_labels(mf)
        label_names = ["label" if i == 0 else f"label{i}" for i in range(len(example_labels))]

    net_name = type(network).__name__
    graph = Graph("TrainOneStepCell_construct" if loss_cell else f"{net_name}_construct")
    graph.attrs["training"] = loss_cell is not None
    parameters: dict[str, Parameter] = {}
    with tracing(graph) as tracer:
        args = [tracer.add_input(n, _local(_spec_type(s), batch_split, n))
                for n, s in zip(input_names, example_inputs)]
        labels = [tracer.add_input(n, _local(_spec_type(s), batch_split, n))
                  for n, s in zip(label_names, example_labels)]
        for _, param in network.parameters_and_names():
            if param.name in parameters and parameters[param.name] is not param:
                raise PcompileError(
                    f"two different parameters are both named {param.name!r}; "
                    "give them distinct names"
                )
            parameters[param.name] = param
            tracer.add_parameter(param)
        if loss_cell is None:
            result = call_user(network.construct, f"{net_name}.construct()", mf.path, *args)
            outputs = list(result) if isinstance(result, (tuple, list)) else [result]
        else:
            with tracer.cell_scope("network-WithLossCell"):
                with tracer.cell_scope(f"_backbone-{net_name}"):
                    out = call_user(network.construct, f"{net_name}.construct()", mf.path,
                                    *args)
                with tracer.cell_scope(f"_loss_fn-{type(loss_cell).__name__}"):
                    loss = call_user(loss_cell.construct,
                                     f"{type(loss_cell).__name__}.construct()", mf.path, out,
                                     *labels)
            outputs = [loss]
        for i, value in enumerate(outputs):
            if not isinstance(value, Tensor) or not value.is_symbolic:
                raise PcompileError(
                    f"construct() of {net_name} returned {type(value).__name__} as output {i}; "
                    "it must return tensors computed from its inputs or parameters"
                )
        graph.outputs = [t._value for t in outputs]  # type: ignore[misc]
    if loss_cell is not None:
        loss_value = graph.outputs[0]
        if loss_value.shape != ():
            raise PcompileError(
                f"the loss returned by {type(loss_cell).__name__} has shape {loss_value.shape}; "
                "it must be a scalar (use a reduction such as 'mean')"
            )
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
