"""`micro_batch`: the local forward program repeated for each micro-batch of a step.

`nn.PipelineCell(network, micro_size=m)` runs each step as m micro-batches. The program was
traced and split for ONE micro-batch (passes/step_parallel.py); this pass, on the local graph
every rank runs:

* widens every graph input to the rank's whole share of the batch (dim 0 times m) and slices
  micro-batch k out of it: rows [k*b, (k+1)*b) of the local input (b: a micro-batch's local
  rows) -- MindSpore's `_MicroBatch` on what the rank reads;
* repeats every node that depends on an input once per micro-batch (its parallel annotation
  gets `micro: k`); nodes that do not (a weight's `_MirrorOperator`, its low-precision Cast, the
  parallel optimizer's AllGather) are computed once and shared by the copies. Sharing the
  mirror is MindSpore's `_MirrorMicroStepOperator`: autodiff sums the micro-batches' gradients
  into the mirror's cotangent, and its AllReduce runs once per step, on the accumulated
  gradient. With `gradient_accumulation_shard` the parallel optimizer's AllGather is repeated
  instead, so each micro-batch's gradient is reduce-scattered and only the shard accumulates;
* returns the mean of the micro-batches' losses (so that, for a loss averaged over the batch,
  loss and gradients equal the whole batch's);
* runs an `Assign` of a Parameter (BatchNorm's moving mean and variance) once per micro-batch,
  in micro-batch order, as MindSpore's PipelineCell does: micro-batch k's update reads the value
  micro-batch k-1 assigned (`_state_chain`), so BatchNorm normalises each micro-batch by its
  own statistics and moves its moving statistics once per micro-batch;
* gives each micro-batch's copy of a random op (`Dropout`, `DropoutMask`) its rows' place in
  the whole batch (`random_offsets`): the single-device program draws the whole batch's tensor,
  and micro-batch k's rows of a rank begin at `m * o + k * r` (o: the block's offset in the
  traced micro-batch, r: its local rows), so every micro-batch draws the single-device bits of
  its rows; the step counter's update reads no micro-batch and runs once a step, as on one
  device.

The copies are emitted last micro-batch first: autodiff sweeps the graph backwards, so it
meets micro-batch 0 first and accumulates each gradient in the order 0, 1, ..., m-1, the order
the schedules run the backward passes in (a stage then holds one running sum, not m parts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import (
    Constant,
    Graph,
    GraphParam,
    Node,
    NodeResult,
    OpaqueConstant,
    ParallelInfo,
    RankConstant,
    Value,
)
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops.random import COUNTER_NAME
from pcompile.ir.ops.state import ASSIGN_OPS, assigned_names, assignment_sites
from pcompile.ir.rank import RankOffsets, Term, layout_offsets
from pcompile.ir.types import TensorType
from pcompile.passes.unit import CompileUnit

#: A node label: ("F", k) forward of micro-batch k, ("B", k) its backward.
Label = tuple[str, int]


def with_micro(info: ParallelInfo | None, micro: int) -> ParallelInfo:
    """A copy of a parallel annotation with `micro: k` (MindSpore's cnode attr)."""
    out = ParallelInfo() if info is None else info.copy()
    out.micro = micro
    return out


def copy_constant(value: Constant) -> Constant:
    """A constant for another graph (constants keep their own use lists)."""
    if isinstance(value, RankConstant):
        return RankConstant(value.data, value.dtype)
    if isinstance(value, OpaqueConstant):
        return OpaqueConstant(value.tensor_type, value.digest)
    return Constant(value.array, value.dtype)


def copy_node(node: Node, operands: list[Value], parallel: ParallelInfo | None) -> Node:
    """A fresh node doing what `node` does on `operands` (its full name is assigned anew)."""
    return Node(node.op, operands, dict(node.attrs), node.result.type,
                instance_name=node.instance_name, scope=node.scope, source=node.source,
                name_hint=node.result.name_hint, parallel=parallel)


def replicate(graph: Graph, micro: int, *, loss_scope: str = "Default",
              labels: dict[Node, Label] | None = None,
              stages: dict[Node, int] | None = None,
              copy_also: Callable[[Node], bool] | None = None,
              batch_terms: tuple[Term, ...] | None = None,
              watch: dict[int, dict[int, Value]] | None = None,
              blocks: int = 1) -> Graph:
    """The graph of one step of `micro` micro-batches (see the module docstring).

    `labels` receives ("F", k) for every node of micro-batch k; `stages` (node -> stage) is
    extended to the copies; `copy_also(node)` marks nodes that are repeated although they
    read no input; `batch_terms` is the split of the inputs' dim 0 (their `RankOffsets`
    terms), which a random op's dim 0 must share. `watch` (the id of each value of `graph`
    a custom bprop reads -> {}) receives {k: micro-batch k's copy} for each (the shared value
    for every k where no micro-batch computes it; nothing for a value no longer in `graph`).
    `blocks` (a single-device reference of a plan whose ranks hold `blocks` blocks of the
    inputs' rows): micro-batch k is the k-th part of each block, as the plan's ranks cut it
    (`_micro_rows`), not the k-th rows of the whole input."""
    labels = labels if labels is not None else {}
    if not graph.attrs.get("training"):
        raise PcompileError("nn.PipelineCell trains: the program has no loss")
    names = assigned_names(graph)
    assigned = graph.outputs[len(graph.outputs) - len(names):] if names else []
    chain = _state_chain(graph, len(names))
    chained = {id(n.result) for n in chain}
    inputs = {id(p) for p in graph.inputs}
    per_micro: set[int] = set(inputs)
    for node in graph.nodes:
        if any(id(v) in per_micro for v in node.operands) or (copy_also and copy_also(node)):
            per_micro.add(id(node.result))
    out = Graph(graph.name)
    out.attrs = dict(graph.attrs)
    shared: dict[int, Value] = {}
    widened: dict[int, GraphParam] = {}
    for p in graph.params:
        if p.kind == "input":
            if not p.shape:
                raise PcompileError(f"nn.PipelineCell: input {p.name} is a scalar; micro-batches "
                                    "cut dim 0 of every input")
            wide_type = TensorType(p.dtype, (p.shape[0] * micro, *p.shape[1:]))
            widened[id(p)] = out.add_param(GraphParam(wide_type, p.name, "input"))
        else:
            shared[id(p)] = out.add_param(GraphParam(p.tensor_type, p.name, p.kind,
                                                     p.requires_grad))

    def fresh(value: Value) -> Value:
        if isinstance(value, Constant):
            return copy_constant(value)
        return shared[id(value)]

    stage_of = stages if stages is not None else {}
    for node in graph.nodes:  # computed once, before every micro-batch
        if id(node.result) in per_micro or id(node.result) in chained:
            continue
        copy = out.append(copy_node(node, [fresh(v) for v in node.operands], node.parallel))
        shared[id(node.result)] = copy.result
        if node in stage_of and not _advances_counter(node):
            # (the counter's advance has no stage: each stage that reads it computes it)
            stage_of[copy] = stage_of[node]
    losses: dict[int, Value] = {}
    # each micro-batch's value operand of the assignments whose variable is shared
    assigned_values: dict[int, list[Value]] = {}
    micro_locals: dict[int, dict[int, Value]] = {}
    for k in reversed(range(micro)):
        local: dict[int, Value] = {}
        micro_locals[k] = local
        for p in graph.inputs:
            wide = widened[id(p)]
            rows = p.shape[0]
            b = Builder(out, scope=loss_scope)
            if blocks > 1:
                local[id(p)] = _micro_rows(b, wide, p, k, micro, blocks, labels)
                continue
            sliced = b.emit(
                "StridedSlice", [wide],
                {"begin": (k * rows,) + (0,) * (len(p.shape) - 1),
                 "end": ((k + 1) * rows,) + tuple(p.shape[1:]),
                 "strides": (1,) * len(p.shape)},
                instance_name="micro_batch", name_hint=p.name,
                parallel=ParallelInfo(micro=k, reason=(
                    f"micro-batch {k} of {micro}: rows [{k * rows}, {(k + 1) * rows}) of the "
                    f"rank's {p.shape[0] * micro} rows of {p.name}")))
            assert isinstance(sliced, NodeResult)
            labels[sliced.node] = ("F", k)
            local[id(p)] = sliced

        for node in graph.nodes:
            if id(node.result) not in per_micro or id(node.result) in chained:
                continue
            operands = [_lookup(v, local, shared) for v in node.operands]
            copy = out.append(copy_node(node, operands, with_micro(node.parallel, k)))
            if node.op in RANDOM_OPS:
                random_offsets(copy, node, k, micro, batch_terms)
            elif node.op == "DropoutDoMask":
                raise PcompileError(
                    f"DropoutDoMask '{node.instance_name}' at {node.source or 'an unknown line'} "
                    f"(cell {node.scope}) inside nn.PipelineCell's micro-batches: its packed "
                    "mask is drawn once for the traced micro-batch's shape, so every micro-batch "
                    "would read the same bits; use ops.Dropout (or nn.Dropout), whose "
                    "micro-batch copies draw their rows' bits of the whole batch")
            local[id(node.result)] = copy.result
            labels[copy] = ("F", k)
            if node in stage_of:
                stage_of[copy] = stage_of[node]
        for key, copies in (watch or {}).items():
            found = local.get(key, shared.get(key))
            if found is not None:
                copies[k] = found
        losses[k] = _lookup(graph.outputs[0], local, shared)
        for i, value in enumerate(assigned):
            if id(value) in per_micro and id(value) not in chained and \
                    isinstance(value, NodeResult):
                assigned_values.setdefault(i, []).append(
                    _lookup(value.node.operands[1], local, shared))
    loss: Value = losses[0]
    b = Builder(out, scope=loss_scope)
    for k in range(1, micro):
        loss = b.emit("Add", [loss, losses[k]], instance_name="micro_loss_add",
                      name_hint="loss")
    if micro > 1:
        loss = b.emit("RealDiv", [loss, Constant(np.asarray(micro), loss.dtype)],
                      instance_name="micro_loss_mean", name_hint="loss",
                      parallel=ParallelInfo(
                          reason=f"the step's loss: the mean of its {micro} micro-batches'"))
    own = graph.outputs[1:len(graph.outputs) - len(names)]
    outputs = [loss] + [_lookup(v, local, shared) for v in own]
    newest = _run_chain(out, graph, chain, names, assigned, micro_locals, shared, labels,
                        stage_of)
    for i, value in enumerate(assigned):
        if id(value) in chained:
            outputs.append(newest[id(value)])
            continue
        outputs.append(_step_assignment(out, value, names[i], assigned_values.get(i, []),
                                        shared, per_micro, stage_of, micro))
    out.outputs = outputs
    return out


def _assigned_parameter(node: Node) -> GraphParam | None:
    """The Parameter an assignment sets (through an assignment of an assigned value)."""
    target: Value = node.operands[0]
    while isinstance(target, NodeResult) and target.node.op in ASSIGN_OPS:
        target = target.node.operands[0]
    return target if isinstance(target, GraphParam) else None


def _state_chain(graph: Graph, assigned_count: int) -> list[Node]:
    """The nodes of `graph` that read a Parameter some `Assign` sets (BatchNorm's moving
    statistics; not the random ops' counter), and the nodes that read those, in graph order:
    the update MindSpore's PipelineCell runs once per micro-batch, each micro-batch's reading
    the value the micro-batch before assigned (`_run_chain`). Refused with one message where
    the loss or another output of the step reads one of them: micro-batch k's forward would
    need micro-batch k-1's assigned value, and the copies are emitted last micro-batch first
    (for the order of the gradients' accumulation)."""
    variables: dict[int, GraphParam] = {}
    for node in graph.nodes:
        if node.op == "Assign":
            param = _assigned_parameter(node)
            if param is not None and param.name != COUNTER_NAME:
                variables[id(param)] = param
    if not variables:
        return []
    reached: dict[int, GraphParam] = dict(variables)  # value id -> the Parameter it reads
    chain: list[Node] = []
    for node in graph.nodes:
        read = next((reached[id(v)] for v in node.operands if id(v) in reached), None)
        if read is not None:
            reached[id(node.result)] = read
            chain.append(node)
    own = graph.outputs[:len(graph.outputs) - assigned_count]
    needed: set[int] = {id(v) for v in own}
    for node in reversed(graph.nodes):  # the nodes the loss and the step's outputs read
        if id(node.result) in needed:
            needed.update(id(v) for v in node.operands)
    reader = next((n for n in chain if id(n.result) in needed), None)
    if reader is not None:
        param = reached[id(reader.result)]
        raise PcompileError(
            f"{reader.op} '{reader.instance_name}' at {reader.source or 'an unknown line'} "
            f"(cell {reader.scope}) inside nn.PipelineCell's micro-batches reads Parameter "
            f"{param.name!r}, which {'; '.join(assignment_sites(graph, (param.name,)))} "
            "sets: MindSpore's micro-batch k "
            "reads the value micro-batch k-1 assigned, and pipeline stages run a Parameter's "
            "Assign once per micro-batch, in order, only where the loss does not read it "
            "(BatchNorm's moving statistics); read the Parameter only in its own update, or "
            "train it outside nn.PipelineCell")
    return chain


def _run_chain(out: Graph, graph: Graph, chain: list[Node], names: tuple[str, ...],
               assigned: Sequence[Value], micro_locals: dict[int, dict[int, Value]],
               shared: dict[int, Value], labels: dict[Node, Label],
               stage_of: dict[Node, int]) -> dict[int, Value]:
    """The `_state_chain` nodes once per micro-batch, in order 0, 1, ..., m-1 (emitted after
    every micro-batch's forward, which they read): micro-batch k's reads of an assigned
    Parameter take the value micro-batch k-1 assigned (micro-batch 0's the stored one), the
    batch statistics micro-batch k's. Each copy is labelled ("F", k) in its node's stage. Returns
    the id of each chained assigned output of `graph` -> its value after the last micro-batch."""
    if not chain:
        return {}
    chained = {id(n.result) for n in chain}
    params = {p.name: p for p in graph.params}
    current: dict[int, Value] = {}  # a Parameter's id -> its value before the micro-batch
    for name, value in zip(names, assigned):
        if id(value) in chained:
            current[id(params[name])] = shared[id(params[name])]
    env: dict[int, Value] = {}
    for k in range(len(micro_locals)):
        env = dict(current)
        for node in chain:
            operands = [env[id(v)] if id(v) in env else _lookup(v, micro_locals[k], shared)
                        for v in node.operands]
            copy = out.append(copy_node(node, operands, with_micro(node.parallel, k)))
            env[id(node.result)] = copy.result
            labels[copy] = ("F", k)
            if node in stage_of:
                stage_of[copy] = stage_of[node]
        for name, value in zip(names, assigned):
            if id(value) in chained:
                current[id(params[name])] = env[id(value)]
    return {id(v): env[id(v)] for v in assigned if id(v) in chained}


def _micro_rows(b: Builder, wide: Value, p: GraphParam, k: int, micro: int, blocks: int,
                labels: dict[Node, Label]) -> Value:
    """Micro-batch k of the whole input `wide` where a plan's ranks hold `blocks` blocks of its
    rows and cut micro-batch k out of each: the k-th part of every block, in block order."""
    rows = p.shape[0] // blocks  # a block's rows of one micro-batch
    rest = tuple(p.shape[1:])
    reason = (f"micro-batch {k} of {micro}: rows [{k * rows}, {(k + 1) * rows}) of each of the "
              f"{blocks} blocks of {p.name}'s {p.shape[0] * micro} rows")
    parts = b.emit("Reshape", [wide], {"shape": (blocks, micro, rows, *rest)},
                   instance_name="micro_batch", name_hint=p.name,
                   parallel=ParallelInfo(micro=k, reason=reason))
    parts = b.emit("StridedSlice", [parts],
                   {"begin": (0, k) + (0,) * (len(rest) + 1),
                    "end": (blocks, k + 1, rows, *rest),
                    "strides": (1,) * (len(rest) + 3)},
                   instance_name="micro_batch", name_hint=p.name,
                   parallel=ParallelInfo(micro=k, reason=reason))
    sliced = b.emit("Reshape", [parts], {"shape": tuple(p.shape)},
                    instance_name="micro_batch", name_hint=p.name,
                    parallel=ParallelInfo(micro=k, reason=reason))
    for value in (parts, sliced):
        assert isinstance(value, NodeResult)
    assert isinstance(sliced, NodeResult)
    labels[sliced.node] = ("F", k)
    return sliced


def _advances_counter(node: Node) -> bool:
    """An AssignAdd of the random ops' step counter (through the chain of its advances)."""
    target: Value = node.result
    while isinstance(target, NodeResult) and target.node.op == "AssignAdd":
        target = target.node.operands[0]
    return node.op == "AssignAdd" and isinstance(target, GraphParam) and \
        target.name == COUNTER_NAME


#: the random ops whose micro-batch copies take their rows' place in the whole batch
RANDOM_OPS = ("Dropout", "DropoutMask")


def _split(terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """The terms of a dim's offsets that move it (a device axis of size 1 does not)."""
    return tuple(t for t in terms if t[1] > 1)


def random_offsets(copy: Node, node: Node, k: int, micro: int,
                   batch_terms: tuple[Term, ...] | None) -> None:
    """Micro-batch k's copy of the random op `node`: its offsets operand and whole shape as the
    whole batch has them (module docstring). Refused where the op's dim 0 is not the batch's
    split as the inputs' are: a rank's rows of a micro-batch are then not one block of the
    whole batch's tensor."""
    offsets = node.operands[2]
    whole = tuple(node.attrs["global_shape"])
    rows = node.operands[0].shape[0] if node.operands[0].shape else 0
    if isinstance(offsets, RankConstant) and isinstance(offsets.data, RankOffsets):
        base, terms = offsets.data.base, offsets.data.terms
    elif isinstance(offsets, Constant) and not isinstance(offsets, (RankConstant,
                                                                    OpaqueConstant)):
        base = tuple(int(v) for v in np.asarray(offsets.array).reshape(-1))
        terms = ((),) * len(base)
    else:
        base, terms = (), ()
    if not base or batch_terms is None or _split(terms[0]) != _split(batch_terms):
        raise PcompileError(
            f"{node.op} '{node.instance_name}' at {node.source or 'an unknown line'} (cell "
            f"{node.scope}) inside nn.PipelineCell's micro-batches: its input's dim 0 must be "
            "the batch's, split as the inputs' dim 0 is, so that a rank's rows of micro-batch "
            "k are one block of the whole batch's tensor (their random bits the single-device "
            f"program's); its input {node.operands[0].shape} of the whole {whole} is split "
            "otherwise; give the dropout's input the inputs' dim-0 split")
    shifted = RankOffsets((base[0] * micro + k * rows, *base[1:]),
                          (tuple((st, c, u * micro) for st, c, u in terms[0]), *terms[1:]))
    if any(terms):
        copy.set_operand(2, RankConstant(shifted, offsets.dtype))
    else:
        copy.set_operand(2, Constant(np.asarray(shifted.base, np.int32), offsets.dtype))
    copy.attrs["global_shape"] = (whole[0] * micro, *whole[1:])


def _step_assignment(out: Graph, value: Value, name: str, per_micro_values: list[Value],
                     shared: dict[int, Value], per_micro: set[int], stage_of: dict[Node, int],
                     micro: int) -> Value:
    """The step's new value of Parameter `name`, assigned in the forward by `value`. MindSpore
    runs the forward once per micro-batch, each assignment with it: an `AssignAdd` /
    `AssignSub` of the Parameter by a micro-batch's value adds up every micro-batch's (emitted
    here once, after them; an `Assign` runs per micro-batch in order, `_run_chain`). Refused
    with one message: an assignment that reads no micro-batch's data (it would run once per
    micro-batch, each reading the last's result: the copies are emitted last micro-batch
    first), an assignment of an assigned value, and one whose new value the forward reads
    again (each micro-batch would read its partial sum)."""
    assert isinstance(value, NodeResult)
    node = value.node
    variable = node.operands[0]
    if name == COUNTER_NAME and id(value) not in per_micro:
        return shared[id(value)]  # the random ops' counter: advanced once a step, as on one device
    why = None
    if id(value) not in per_micro:
        why = ("it reads no micro-batch's data, so it would run once per micro-batch, each "
               "time on the one before's result")
    elif node.op not in ("AssignAdd", "AssignSub") or not isinstance(variable, GraphParam):
        why = ("only an AssignAdd or AssignSub of the Parameter itself by a micro-batch's "
               "value adds up over the micro-batches")
    elif value.users:
        why = ("the forward reads the new value again, and each micro-batch would read its "
               "own partial sum")
    if why is not None:
        raise PcompileError(
            f"{node.op} '{node.instance_name}' of Parameter {name!r} at "
            f"{node.source or 'an unknown line'} (cell {node.scope}) inside nn.PipelineCell's "
            f"micro-batches: {why}; pipeline stages support the accumulation of a statistic "
            "(AssignAdd(parameter, value computed from the batch), not read again in the step)")
    b = Builder(out, scope=node.scope, source=node.source)
    total = per_micro_values[-1]  # micro-batch 0's (emitted last), then 1, 2, ...
    for v in reversed(per_micro_values[:-1]):
        total = b.emit("Add", [total, v], instance_name=f"{node.instance_name}_micro_sum",
                       name_hint=name.rsplit(".", 1)[-1],
                       parallel=ParallelInfo(reason=(
                           f"{node.op} '{node.instance_name}' runs once per micro-batch: the "
                           f"step adds the {micro} micro-batches' values")))
        assert isinstance(total, NodeResult)
        if node in stage_of:
            stage_of[total.node] = stage_of[node]
    result = b.emit(node.op, [shared[id(variable)], total], dict(node.attrs),
                    instance_name=node.instance_name, name_hint=node.result.name_hint,
                    parallel=node.parallel)
    assert isinstance(result, NodeResult)
    if node in stage_of:
        stage_of[result.node] = stage_of[node]
    return result


def _lookup(value: Value, local: dict[int, Value], shared: dict[int, Value]) -> Value:
    """`value` in the copy of one micro-batch (`local`) or among the shared values."""
    if isinstance(value, Constant):
        return copy_constant(value)
    return local[id(value)] if id(value) in local else shared[id(value)]


@dataclass(frozen=True)
class MicroBatchOptions:
    """`loss_scope`: the scope of the loss (nn.PipelineCell's, or the top level's);
    `shard_accumulation`: `gradient_accumulation_shard` of the parallel optimizer (its
    AllGather then repeats per micro-batch)."""

    loss_scope: str = "Default"
    shard_accumulation: bool = False


class MicroBatchPass:
    """`micro_batch` (after step_parallel_end): the local forward program once per micro-batch
    of nn.PipelineCell; every graph input becomes the rank's whole share of the batch."""

    name = "micro_batch"
    appends_only = False

    def __init__(self, options: MicroBatchOptions) -> None:
        self.options = options

    def apply(self, unit: CompileUnit) -> None:
        settings = unit.pipeline
        assert settings is not None and unit.assignment is not None and unit.graph is not None
        micro = settings.micro_size
        layouts = unit.assignment.param_layouts
        splits = {p.name: layouts[p.name].splits[0] for p in unit.graph.inputs if p.shape}
        if len(set(splits.values())) > 1:
            shown = ", ".join(f"{name} {ways} ways" for name, ways in splits.items())
            raise PcompileError(
                f"nn.PipelineCell: micro-batch k is the k-th block of each rank's rows of every "
                f"input, so every input must split dim 0 the same number of ways, but the "
                f"layouts split it {shown}; give them one dim-0 split (dataset_strategy)")
        shard_acc = self.options.shard_accumulation

        def per_micro(node: Node) -> bool:  # gradient_accumulation_shard: the AllGather repeats
            return shard_acc and node.op == "AllGather" and node.instance_name.startswith(
                "parallel_optimizer_allgather")

        graph = unit.rank_graphs[0]
        first = next((p for p in unit.graph.inputs if p.shape), None)
        batch_terms = (None if first is None else
                       tuple(layout_offsets(layouts[first.name]).terms[0]))
        # the values the custom bprops read, followed into each micro-batch's copy
        before = unit.bprop_locals or {}
        watch: dict[int, dict[int, Value]] = {id(v): {} for v in before.values()
                                              if v is not None}
        out = replicate(graph, micro, loss_scope=self.options.loss_scope, labels=settings.labels,
                        stages=settings.local_stage, copy_also=per_micro,
                        batch_terms=batch_terms, watch=watch)
        if unit.bprop_locals is not None:
            unit.bprop_micro = [{key: watch[id(v)].get(k) if v is not None else None
                                 for key, v in before.items()} for k in range(micro)]
        alive = set(out.nodes)
        settings.local_stage = {k: v for k, v in settings.local_stage.items() if k in alive}
        settings.labels = {k: v for k, v in settings.labels.items() if k in alive}
        unit.rank_graphs = [out] * unit.devices
        for p in unit.graph.inputs:
            lay = layouts[p.name]
            if p.shape:
                layouts[p.name] = TensorLayout(lay.dev_matrix, lay.tensor_map,
                                               (lay.shape[0] * micro, *lay.shape[1:]))
