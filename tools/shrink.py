"""The shrunk check: the oracle check of a plan on a shrunk copy of its model.

A plan too large for the float64 simulator (`oracle.check_cost` above `CHECK_BUDGET_BYTES`)
is checked on a copy of the traced model with the same graph, the same strategies and the same
layouts, whose dims are divided by up to a factor (`ir.dims.shrink_graph`): every split dim
stays a multiple of its split count with at least two elements per slice, and every op's
dimension relations hold (Reshape's blocks, contractions, broadcasting, slices, index ranges).
The copy is compiled by the same passes, with each op's strategy (and each searched Reshape
layout) pinned to the plan's, and checked op by op against the single-device program of the
same copy (`oracle.check`).

data_parallel and pipeline plans trace one rank's part of the batch or one micro-batch; their
single-device program is the whole-batch trace shrunk alike (`whole_batch_shrink`). The copy's
communication (each rank program's ops, collectives' groups and attrs, before communication
fusion) must be the plan's (`same_communication`), so that the verdict is about the plan.

Parameters keep their initializer (generated at the shrunk shape) or the leading block of the
user's array; input batches and constants keep their leading block, and integer values that
index a shrunk dim (token ids, labels) are taken modulo its new size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pcompile.compiler.driver.compiled import CompiledProgram
from pcompile.compiler.driver.driver import compile_program
from pcompile.compiler.driver.pinned_plan import PinnedPlan
from pcompile.ir.core import Graph, GraphParam, Node, Value
from pcompile.ir.dims import Shrink, shapes_of, shrinker
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.tools.oracle import CHECK_BUDGET_BYTES, check, check_cost

#: Modes whose plans the shrunk check reproduces (one strategy per op).
SHRINKABLE_MODES = ("semi_auto_parallel", "auto_parallel", "data_parallel")

#: What the automatically chosen shrunk check aims to hold (`oracle.check_cost`): a check of
#: seconds; a plan whose dims cannot shrink that far is checked within the full budget.
SHRUNK_CHECK_BYTES = 1 << 26

#: Factors the automatic choice tries, smallest first.
FACTORS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)




def _refuse_mode(program: CompiledProgram) -> None:
    state = program.state
    # pipelines (stages, nn.PipelineCell) are reproduced: the stage of each op follows the
    # traced graph, and the micro-batch keeps its size (`plan_splits`)
    if state.parallel_mode not in SHRINKABLE_MODES:
        raise PcompileError(
            f"the shrunk check reproduces semi_auto_parallel, auto_parallel and data_parallel "
            f"plans; this "
            f"program is {state.parallel_mode}; --force-check checks it at full size")
    region = next((n for n in program.graph.nodes if n.op == "Morph"), None)
    if region is not None:
        # one device runs a Morph's function on the whole tensors, so its single-device copy
        # is not the plan's graph, and a region's shapes are its own code's
        raise PcompileError(
            f"the shrunk check does not reproduce a Morph region (self_define_shard: "
            f"{region.instance_name} at {region.source or region.scope}) in this version of "
            "pcompile; --force-check checks it at full size")


def plan_splits(program: CompiledProgram) -> list[tuple[Value, int, int, int]]:
    """(value, tuple element, dim, split count) of every split dim the plan lays out: each
    op's operands and results, each graph parameter, each searched Reshape layout."""
    state = program.state
    graph: Graph = program.graph
    assignment = state.assignment
    assert assignment is not None  # _refuse_mode: a parallel plan
    out: list[tuple[Value, int, int, int]] = []

    def add(value: Value, elem: int, layout: TensorLayout | None) -> None:
        if layout is None or value is None:
            return
        shapes = shapes_of(value.type)
        if elem >= len(shapes) or tuple(layout.shape) != shapes[elem]:
            return
        for d, (n, s) in enumerate(zip(layout.shape, layout.slice_shape)):
            if s and n // s > 1:
                out.append((value, elem, d, n // s))

    for node in graph.nodes:
        sharding = assignment.shardings.get(node)
        if sharding is not None:
            for operand, layout in zip(node.operands, sharding.in_layouts):
                add(operand, 0, layout)
            for k, layout in enumerate(sharding.out_layouts):
                add(node.result, k, layout)
        reshaped = assignment.reshape_layouts.get(node)
        if reshaped is not None:
            add(node.result, 0, reshaped)
    for p in graph.params:
        add(p, 0, assignment.param_layouts.get(p.name))
    if state.micro_batched:  # the micro-batch keeps its size: the same micro-batches, splits
        out += [(p, 0, 0, p.shape[0]) for p in graph.inputs if p.shape]
    return out


def choose_shrink(program: CompiledProgram, factor: int | None = None,
                  budget: int | None = None) -> Shrink:
    """The shrink of `program`'s traced graph by `factor`; None: the smallest factor (of
    `FACTORS`) whose check holds at most `SHRUNK_CHECK_BYTES` (a check of seconds), or failing
    that the most shrunk copy within `budget` (default `CHECK_BUDGET_BYTES`), estimated by the
    share of elements left. PcompileError when none fits, naming what kept dims at full size."""
    _refuse_mode(program)
    splits = plan_splits(program)
    graph = program.graph
    if factor is not None:
        if factor < 1:
            raise PcompileError(f"the shrink factor must be >= 1, got {factor}")
        return shrinker(graph, splits)(factor)
    solve = shrinker(graph, splits)
    budget = CHECK_BUDGET_BYTES if budget is None else budget
    target = min(budget, SHRUNK_CHECK_BYTES)
    cost = check_cost(program)
    best = None
    for f in FACTORS:
        shrink = solve(f)
        if best is not None and shrink.sizes == best.sizes:
            break  # no dim shrinks further
        best = shrink
        if cost * shrink.ratio(graph) <= target:
            return shrink
    assert best is not None
    if cost * best.ratio(graph) <= budget:
        return best
    kept = "; ".join(best.kept) or "the plan's splits (at least 2 elements per slice)"
    raise PcompileError(
        f"the shrunk check does not fit in {_size(budget)}: at factor {best.factor} the check "
        f"would still hold about {_size(cost * best.ratio(graph))}; dims kept at full size "
        f"by: {kept}")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GB" if nbytes >= 2**27 else f"{nbytes / 2**20:.2f} MB"



def whole_batch_shrink(program: CompiledProgram, shrink: Shrink) -> Shrink:
    """data_parallel traces one rank's part of the batch, a pipeline (nn.PipelineCell) one
    micro-batch; their single-device program traces the whole batch. The whole-batch trace
    shrunk by the same factor, with dim 0 of every input and label kept a multiple of the
    parts (ranks or micro-batches) times its split in the plan, must be `shrink` with dim 0
    of the inputs and labels times the parts (else PcompileError: the two copies would not be
    one model)."""
    state = program.state
    whole = compile_program(state.model_file.path, devices=1, dump=False,
                          overrides=dict(state.overrides), trace_only=True).graph
    parts: dict[str, int] = {}
    splits = []
    for p in whole.inputs:
        if not p.shape:
            continue
        parts[p.name] = p.shape[0] // program.graph.param(p.name).shape[0]
        # the ranks of data_parallel split the batch; a pipeline's batch keeps its size
        # (`plan_splits`), so that its micro-batches stay what the plan splits
        splits.append((p, 0, 0, parts[p.name] if state.parallel_mode == "data_parallel"
                       else p.shape[0]))
    # the plan's splits of weights (the parallel optimizer's shards) hold in both copies
    names = {p.name for p in whole.params}
    for value, elem, dim, k in plan_splits(program):
        name = getattr(value, "name", None)
        if isinstance(value, GraphParam) and name in names and name not in parts and \
                whole.param(name).shape == value.shape:
            splits.append((whole.param(name), elem, dim, k))
    solved = shrinker(whole, splits)(shrink.factor)
    for name, shape in solved.params.items():
        local = shrink.params.get(name)
        n = parts.get(name, 1)
        expect = (local[0] * n, *local[1:]) if local else local
        if expect != shape:
            raise PcompileError(
                f"the shrunk check (factor {shrink.factor}) cannot shrink this plan: {name} "
                f"would be {shape} on one device but {local} in each of its {n} parts "
                f"({'ranks' if state.parallel_mode == 'data_parallel' else 'micro-batches'}); "
                f"--check-shrunk with another factor, or --force-check")
    return solved


def pin_plan(program: CompiledProgram, shrink: Shrink) -> PinnedPlan:
    """The plan's strategies and Reshape layouts by node position, layouts at shrunk shapes."""
    state = program.state
    pinned = PinnedPlan(shrink, mode=state.search_mode,
                        reduced_parameters=state.reduced_parameters)
    if state.options.optimizer_shard.enabled:  # which weights it sharded was a size choice
        pinned.opt_sharded = tuple(sorted(state.opt_shard))
    if state.parallel_mode == "data_parallel" or state.micro_batched:
        pinned.reference = whole_batch_shrink(program, shrink)
    search = state.search
    if search is None:
        return pinned
    pinned.ilp = search.ilp
    specs = search.specs()
    for i, node in enumerate(program.graph.nodes):
        strategy = specs.get(node)
        if strategy is not None:
            pinned.strategies[i] = strategy
        layout = search.reshape_layouts.get(node)
        if layout is not None:
            pinned.reshape_layouts[i] = TensorLayout(layout.dev_matrix, layout.tensor_map,
                                                     shrink.results[i][0])
    return pinned


@dataclass
class ShrunkCheck:
    """The shrunk compile, its oracle report, and what was shrunk."""

    program: CompiledProgram
    report: Any
    shrink: Shrink

    def describe(self) -> str:
        return describe(self.shrink)


def describe(shrink: Shrink) -> str:
    """The factor, the dims it changed (old -> new size), and what kept dims at full size."""
    sizes = ", ".join(f"{a} -> {'/'.join(map(str, sorted(b)))}"
                      for a, b in sorted(shrink.sizes.items(), reverse=True) if b != {a})
    text = f"factor {shrink.factor}, dims {sizes or 'unchanged'}"
    if shrink.kept:
        text += "; kept at full size by " + "; ".join(shrink.kept)
    return text


def compile_shrunk(program: CompiledProgram, shrink: Shrink) -> CompiledProgram:
    """`program`'s model file compiled again with the same options, traced graph shrunk by
    `shrink` and every strategy pinned to `program`'s (no dumps)."""
    state = program.state
    pinned = pin_plan(program, shrink)
    shrunk = compile_program(state.model_file.path, devices=state.devices,
                           parallel_mode=state.parallel_mode,
                           search_mode=state.search_mode
                           if state.parallel_mode == "auto_parallel" else None,
                           dump=False, overrides=dict(state.overrides), shrink=pinned)
    _same_plan(program, shrunk)
    same_communication(program, shrunk)
    return shrunk


def _same_plan(program: CompiledProgram, shrunk: CompiledProgram) -> None:
    """Same ops, same strategies (a difference is a bug of the shrink, not of the plan)."""
    a, b = program.graph.nodes, shrunk.graph.nodes
    if [n.op for n in a] != [n.op for n in b]:
        raise PcompileError("the shrunk copy traced a different graph than the plan's")
    for x, y in zip(a, b):
        sx = x.parallel.in_strategy if x.parallel is not None else None
        sy = y.parallel.in_strategy if y.parallel is not None else None
        if sx != sy:
            raise PcompileError(
                f"the shrunk copy of {x.op} ({x.source or x.scope}) got strategy {sy}, the "
                f"plan {sx}")


#: Collective attrs that follow from sizes, not from the plan: a point-to-point transfer's
#: shape, and the communication fusion id (buckets are filled by bytes, so smaller gradients
#: share fewer of them; fused or not, each collective computes the same). The programs are
#: compared before communication fusion (`CompileState.unfused`) for the same reason.
SIZE_ATTRS = frozenset({"shape", "fusion"})


def communication(program: CompiledProgram) -> list[list[tuple[str, tuple[tuple[str, str], ...]]]]:
    """Each distinct rank graph's op sequence, with every collective's attrs (group, ranks,
    reduction, split/concat dims, tags, peers; no sizes, no fusion buckets): what the plan
    communicates, and the redistributions (slices, concats, reshapes) around it, in order."""
    from pcompile.ir.registry import get_op

    out = []
    for nodes in _programs(program):
        seq = []
        for node in nodes:
            attrs: tuple[tuple[str, str], ...] = ()
            if get_op(node.op).collective or node.op.startswith("_"):
                attrs = tuple((k, repr(v)) for k, v in sorted(node.attrs.items())
                              if k not in SIZE_ATTRS)
            seq.append((node.op, attrs))
        out.append(seq)
    return out


def _programs(program: CompiledProgram) -> list[list[Node]]:
    """Each distinct rank graph's nodes, before communication fusion where it ran."""
    state = program.state
    return state.unfused or [list(g.nodes) for g in state.graphs]


def same_communication(program: CompiledProgram, shrunk: CompiledProgram) -> None:
    """The shrunk compile re-derives redistributions, collectives, communication fusion and
    the parallel optimizer's sharding on smaller shapes; its verdict is about the plan only
    if they are the same ops with the same groups and attrs (PcompileError: the first
    difference)."""
    full, small = communication(program), communication(shrunk)
    graphs_a, graphs_b = _programs(program), _programs(shrunk)
    if len(full) != len(small):
        raise PcompileError(
            f"the shrunk copy's ranks run {len(small)} distinct programs, the plan's "
            f"{len(full)}; the shrunk check would not check the same plan (--force-check)")
    for g, (a, b) in enumerate(zip(full, small)):
        if a == b:
            continue
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        nodes_a, nodes_b = graphs_a[g], graphs_b[g]

        raise PcompileError(
            f"the shrunk copy (factor {shrink_factor(shrunk)}) communicates "
            f"differently from the plan, so its check would not be about the same plan: "
            f"{_graph_name(program, g)}, op {i}: the plan has {_show(nodes_a, a, i)}, the "
            f"shrunk copy {_show(nodes_b, b, i)}; --check-shrunk with a smaller factor, or "
            f"--force-check")


def _show(nodes: list[Any], seq: list[Any], i: int) -> str:
    if i >= len(seq):
        return "nothing (the program ends)"
    node = nodes[i]
    where = node.source or node.scope or "?"
    return f"{node.op}{dict(seq[i][1]) if seq[i][1] else ''} ({where})"


def shrink_factor(shrunk: CompiledProgram) -> int:
    """The factor a shrunk compile was shrunk by."""
    pinned = shrunk.state.shrink
    assert pinned is not None
    return pinned.shrink.factor


def _graph_name(program: CompiledProgram, index: int) -> str:
    graph = program.state.graphs[index]
    ranks = [r for r, g in enumerate(program.state.rank_graphs) if g is graph]
    if len(ranks) == len(program.state.rank_graphs):
        return "every rank's program"
    return f"the program of rank{'s' if len(ranks) > 1 else ''} {ranks[0]}" + (
        f"..{ranks[-1]}" if len(ranks) > 1 else "")


def shrunk_check(program: CompiledProgram, factor: int | None = None, steps: int = 1
                 ) -> ShrunkCheck:
    """Check `program`'s plan on a shrunk copy (see the module docstring): the report is
    `oracle.check` of the shrunk parallel program against its single-device program."""
    shrink = choose_shrink(program, factor)
    shrunk = compile_shrunk(program, shrink)
    return ShrunkCheck(shrunk, check(shrunk, steps=steps), shrink)

