"""Pipeline parallelism in the driver: tracing `nn.PipelineCell`, the stage of every op, and
the settings the pipeline passes read.

`model()` may return `nn.PipelineCell(nn.WithLossCell(net, loss_fn), micro_size=m)` (no
`loss()` then). It is traced like `model()` + `loss()`: one step of the network and its loss,
in MindSpore's scopes (`Default/network-PipelineCell/network-WithLossCell/_backbone-Net/...`).
In a parallel compile the trace takes ONE micro-batch (every input's dim 0 divided by m), and
`passes/micro_batch.py` repeats its local program m times after the split; on one device the
cell is its network (the whole batch: the step equals what the micro-batches compute when the
loss averages over the batch, and the single-device program is the reference).

`PipelineSettings` carries what the passes need: the stage count, the micro size, the
scheduler, whether stages are interleaved (`pipeline_interleave`: cells also carry a
`pipeline_segment`, and each stage runs several chunks of the network), and the (virtual)
stage of every traced op (`passes/pipeline_stages.py`).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from pcompile.compiler.frontend.assign import finish_assignments
from pcompile.compiler.frontend.model_file import ModelFile, as_input_list, call_user
from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.nn.loss import WithLossCell
from pcompile.compiler.frontend.nn.pipeline import MicroBatchInterleaved, PipelineCell
from pcompile.compiler.frontend.random_state import random_parameters
from pcompile.compiler.frontend.tensor import Parameter, Tensor, TensorSpec
from pcompile.compiler.frontend.tracing import tracing
from pcompile.ir.core import Constant, Graph, NodeResult
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.pipeline_stages import PipelineSettings, ScopeCell, StageMap, assign_stages

#: pipeline_config pipeline_scheduler values pcompile implements.
SCHEDULERS = ("1f1b", "gpipe")


def settings_from_context(ctx: Any, devices: int, mode: str) -> PipelineSettings:
    """The context's pipeline options, checked (one message per mistake)."""
    stages = int(ctx.pipeline_stages)
    config = ctx.pipeline_config
    if mode == "stand_alone" or devices == 1:
        return PipelineSettings(1, 1, str(config.pipeline_scheduler))
    if stages > 1 and mode not in ("semi_auto_parallel", "auto_parallel"):
        raise PcompileError(
            f"pipeline_stages={stages} needs parallel_mode semi_auto_parallel or auto_parallel "
            f"(the stages split the devices and operator strategies apply inside each); this "
            f"compile uses {mode}")
    if devices % stages:
        divisors = [s for s in range(1, devices + 1) if devices % s == 0]
        raise PcompileError(
            f"pipeline_stages={stages} does not divide the {devices} devices (stage s owns "
            f"ranks [s*n, (s+1)*n), n = devices / pipeline_stages); use one of "
            f"{', '.join(map(str, divisors))}, or --devices a multiple of {stages}")
    if config.pipeline_scheduler not in SCHEDULERS:
        raise PcompileError(
            f"pipeline_config pipeline_scheduler={config.pipeline_scheduler!r} is not "
            f"implemented in this version of pcompile; use one of "
            f"{', '.join(repr(s) for s in SCHEDULERS)}")
    return PipelineSettings(stages, 1, str(config.pipeline_scheduler),
                            bool(config.pipeline_interleave))


# -- tracing nn.PipelineCell ---------------------------------------------------------------------


def _spec_type(item: TensorSpec | np.ndarray) -> TensorType:
    if isinstance(item, TensorSpec):
        return item.type
    return TensorType(DType.from_any(item.dtype), tuple(int(d) for d in item.shape))


def _arg_names(fn: Any, count: int, fallback: str) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = params[:count]
    while len(names) < count:
        names.append(f"{fallback}{len(names)}")
    return names


def _micro_type(t: TensorType, micro: int, name: str, path: str) -> TensorType:
    if micro == 1:
        return t
    if not t.shape:
        raise PcompileError(
            f"nn.PipelineCell(micro_size={micro}) in {path} cuts dim 0 of every input into "
            f"micro-batches, but {name} is a scalar; give it a batch dimension")
    if t.shape[0] % micro:
        ok = [m for m in range(1, t.shape[0] + 1) if t.shape[0] % m == 0]
        raise PcompileError(
            f"nn.PipelineCell(micro_size={micro}) in {path} cuts dim 0 of {name} {t.shape} into "
            f"{micro} micro-batches, but {t.shape[0]} is not divisible by {micro}; use a "
            f"micro_size among {', '.join(map(str, ok))} or a batch that divides")
    return t.with_shape((t.shape[0] // micro, *t.shape[1:]))


def _labels(mf: ModelFile) -> list[TensorSpec | np.ndarray]:
    from pcompile.compiler.driver.trace_model import _first_batch_labels

    if mf.labels is None and mf.dataset is None:
        raise PcompileError(
            f"model() in {mf.path} returns nn.PipelineCell, which trains its network's loss: "
            "define labels() or dataset(), or return the labels from inputs() after the "
            "network's inputs, so that the label shape is known")
    return _first_batch_labels(mf)


def _positional_count(fn: Any, required: bool = False) -> int | None:
    """How many positional arguments `fn` takes (None: any number); `required`: only those
    without a default (`construct(self, input_ids, labels=None)` needs 1)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               and (not required or p.default is p.empty))


def inner_network(cell: PipelineCell) -> tuple[Cell, Cell | None]:
    """(the network whose sub-cells carry the stages, its loss function or None) inside a
    PipelineCell (through MicroBatchInterleaved wrappers and WithLossCell)."""
    net = cell.network
    while isinstance(net, (MicroBatchInterleaved, PipelineCell)):
        net = net.network
    if isinstance(net, WithLossCell):
        return net.backbone_network, net._loss_fn
    return net, None


def _objective(tracer: Any, loss: Tensor, micro: int, path: str) -> Any:
    """The value the step differentiates and reports. A loss that is not a scalar is
    differentiated with a sensitivity of ones, as MindSpore does (nn.PipelineCell adds its
    micro-batches' losses; the gradient is that of the sum of all their elements): the step's
    objective is the sum of the loss over the whole batch, traced for one micro-batch as its
    sum times `micro` (the micro-batches' mean of which, `passes/micro_batch.py`, is the whole
    batch's sum)."""
    value = loss._value
    assert value is not None
    if value.shape == ():
        return value
    if not isinstance(value.type, TensorType) or not value.dtype.is_float:
        raise PcompileError(f"the loss returned inside nn.PipelineCell in {path} is "
                            f"{value.type}; a training objective must be a floating-point "
                            "tensor")
    node = value.node if isinstance(value, NodeResult) else None
    where = {"scope": node.scope if node else tracer.scope,
             "source": node.source if node else None}
    total = tracer.builder.emit("ReduceSum", [value], {"axis": (), "keep_dims": False},
                                instance_name="loss_sum", name_hint="loss", **where)
    if micro == 1:
        return total
    return tracer.builder.emit("Mul", [total, Constant(np.asarray(micro), total.dtype)],
                               instance_name="loss_micro_scale", name_hint="loss", **where)


def trace_pipeline_cell(mf: ModelFile, cell: PipelineCell, micro: int) -> Any:
    """The training step of a model() that returns `nn.PipelineCell(...)`: the loss of its
    network on one micro-batch (`micro` = micro_size), or on the whole batch (`micro` = 1).
    Graph inputs: the network's inputs (named after its backbone's construct arguments) then
    the labels (`label`, `label1`, ...), as `model()` + `loss()` names them."""
    from pcompile.compiler.driver.trace_model import TracedModel

    cell.finalize_parameter_names()
    backbone, loss_fn = inner_network(cell)
    example_inputs = as_input_list(call_user(mf.inputs, "inputs()", mf.path), "inputs", mf.path)
    taken = _positional_count(backbone.construct)
    needed = _positional_count(backbone.construct, required=True)
    if loss_fn is None and needed is not None and len(example_inputs) >= needed:
        # a network that computes its own loss from its inputs (a causal LM's input_ids, its
        # labels argument left to its default): the data set's batches are its inputs, with
        # no labels after them
        example_labels: list[TensorSpec | np.ndarray] = []
    elif mf.labels is None and mf.dataset is None:
        # As MindSpore's tests compile a PipelineCell on (data, label): the arrays after the
        # network's own arguments are the labels of its loss.
        if loss_fn is None:
            example_labels = []
        elif taken is not None and len(example_inputs) > taken:
            example_inputs, example_labels = example_inputs[:taken], example_inputs[taken:]
        else:
            example_labels = _labels(mf)
    else:
        example_labels = _labels(mf)
    input_names = _arg_names(backbone.construct, len(example_inputs), "input")
    label_names = ["label" if i == 0 else f"label{i}" for i in range(len(example_labels))]
    graph = Graph("TrainOneStepCell_construct")
    graph.attrs["training"] = True
    parameters: dict[str, Parameter] = {}
    with tracing(graph) as tracer:
        args = [tracer.add_input(n, _micro_type(_spec_type(s), micro, n, mf.path))
                for n, s in zip(input_names + label_names, example_inputs + example_labels)]
        for _, param in cell.parameters_and_names():
            assert param.name is not None  # a cell names the parameters it holds
            if param.name in parameters and parameters[param.name] is not param:
                raise PcompileError(f"two different parameters are both named {param.name!r}; "
                                    "give them distinct names")
            parameters[param.name] = param
            tracer.add_parameter(param)
        with tracer.cell_scope("network-PipelineCell"):
            loss = call_user(cell.construct, "PipelineCell.construct()", mf.path, *args)
        if not isinstance(loss, Tensor) or not loss.is_symbolic:
            raise PcompileError(
                f"the network inside nn.PipelineCell in {mf.path} returned "
                f"{type(loss).__name__}; it must return its loss (wrap the network and its loss "
                "function in nn.WithLossCell)")
        graph.outputs = [_objective(tracer, loss, micro, mf.path)]
        finish_assignments(tracer, graph)  # summed over micro-batches: passes/micro_batch.py
        parameters.update(random_parameters(tracer))  # ops.Dropout's step counter
        # cells with their own bprop: run per micro-batch in their forward's stage
        # (compiler/driver/front_passes.py bprop_vjps, passes/micro_batch.py)
        custom_bprops = list(tracer.custom_bprop)
    graph.dead_code_elimination()
    return TracedModel(
        graph=graph, network=cell, input_names=input_names, label_names=label_names,
        example_inputs=example_inputs, example_labels=example_labels, parameters=parameters,
        loss_cell=loss_fn if loss_fn is not None else cell, mode="train",
        custom_bprops=custom_bprops)


def check_micro_split(graph: Graph, micro: int, devices: int, dataset_strategy: Any) -> None:
    """With dataset_strategy "data_parallel" a micro-batch is split over a stage's devices:
    its rows must divide (one message naming the input, the micro size and what works)."""
    if dataset_strategy not in (None, "data_parallel") or devices == 1:
        return
    for p in graph.inputs:
        if p.shape and p.shape[0] % devices:
            whole = p.shape[0] * micro
            raise PcompileError(
                f"nn.PipelineCell(micro_size={micro}) cuts the batch of {p.name} "
                f"{(whole, *p.shape[1:])} into micro-batches of {p.shape[0]} rows, which "
                f"dataset_strategy 'data_parallel' splits over the {devices} devices of a "
                f"stage, but {p.shape[0]} is not divisible by {devices}; use a batch that is a "
                f"multiple of micro_size x {devices} = {micro * devices}, a smaller "
                "micro_size, or dataset_strategy='full_batch'")


def check_interleave(settings: PipelineSettings) -> None:
    """Interleaved 1F1B runs the micro-batches in groups of `stages` (Megatron-LM's order): a
    last, partial group would make the stages wait on each other, so m must be a multiple of
    S (or at most S, one group)."""
    stages, micro = settings.stages, settings.micro_size
    if settings.chunks == 1 or settings.scheduler != "1f1b":
        return
    if micro > stages and micro % stages:
        ok = [m for m in range(1, 4 * stages + 1) if m <= stages or m % stages == 0]
        raise PcompileError(
            f"pipeline_interleave with the 1f1b scheduler runs micro-batches in groups of "
            f"pipeline_stages={stages} through the {settings.chunks} chunks of every stage, so "
            f"nn.PipelineCell's micro_size must be a multiple of {stages} (or at most "
            f"{stages}); micro_size={micro} is neither: use one of "
            f"{', '.join(map(str, ok))}, ..., or pipeline_scheduler 'gpipe'")


# -- the stage of every op ----------------------------------------------------------------------


def scope_cells(log: dict[str, Any], traced: Any) -> dict[str, ScopeCell]:
    """The cells the trace entered, by scope, as `passes/pipeline_stages.py` sees them."""
    network = traced.network
    roots: set[int] = set()
    free: set[int] = set()
    if isinstance(network, PipelineCell):
        backbone, loss_fn = inner_network(network)
        wrapper: Any = network
        while isinstance(wrapper, (PipelineCell, MicroBatchInterleaved, WithLossCell)):
            roots.add(id(wrapper))
            wrapper = getattr(wrapper, "network", None) if not isinstance(
                wrapper, WithLossCell) else None
        inner = network.network
        while isinstance(inner, (PipelineCell, MicroBatchInterleaved)):
            inner = inner.network
        roots.add(id(inner))
    else:
        backbone, loss_fn = network, traced.loss_cell
        # model() + loss(): the backbone and the loss are called by the tracer itself.
        net_scope = f"Default/network-WithLossCell/_backbone-{type(network).__name__}"
        log.setdefault(net_scope, network)
        if loss_fn is not None:
            log.setdefault(f"Default/network-WithLossCell/_loss_fn-{type(loss_fn).__name__}",
                           loss_fn)
    roots.add(id(backbone))
    if loss_fn is not None:
        free.update(id(c) for _, c in loss_fn.cells_and_names())
    paths = {id(c): path for path, c in backbone.cells_and_names()}
    out: dict[str, ScopeCell] = {}
    for scope, cell in log.items():
        stage = cell.pipeline_stage if isinstance(cell, Cell) else -1
        kind = "root" if id(cell) in roots or id(cell) in free else "cell"
        segment = cell.pipeline_segment if isinstance(cell, Cell) else 0
        out[scope] = ScopeCell(stage if stage >= 0 else None, kind,
                               paths.get(id(cell), ""), type(cell).__name__, segment)
    return out


def stage_map(graph: Graph, log: dict[str, Any], traced: Any, stages: int,
              interleave: bool = False) -> StageMap:
    return assign_stages(graph, scope_cells(log, traced), stages, interleave)


def schedule_from_plan(info: Any) -> Any:
    """The schedule plan.json's `pipeline` section describes (to draw it: `.text()`)."""
    from pcompile.passes.pipeline_schedule import Schedule, StageUnits, parse_unit

    units = []
    for st in info.per_stage:
        seq = [parse_unit(u.unit) for u in st.units]
        units.append(StageUnits(st.stage, seq, [u.tick for u in st.units]))
    out = Schedule(info.scheduler, info.stages, info.micro_size, info.devices_per_stage, units,
                   chunks=info.chunks)
    for name in sorted(info.per_stage[0].activation_bytes):
        out.held_bytes[name] = [st.activation_bytes[name] for st in info.per_stage]
        out.in_flight[name] = [st.micro_batches_in_flight[name] for st in info.per_stage]
    return out
