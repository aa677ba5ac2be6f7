"""A pipeline program's ranks in one process: the stages' graphs run unit by unit, in the
order of the schedule's ticks, with Send/Receive through mailboxes.

Inside a stage every rank runs the same graph: its units run in lockstep over the stage's
ranks (collectives read their group's inputs, as `simulate._lockstep`). A `Send` leaves its
value in the mailbox of (sr_tag, destination rank); the `Receive` with that tag on the
destination takes it. The schedule (passes/pipeline_schedule.py) runs every unit after the
units whose Sends it receives, so a Receive always finds its value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pcompile.backends.numpy.simulate import collective_result
from pcompile.ir.core import Constant, Graph, Node, Value
from pcompile.ir.interpret import checked_result, constant_value, node_attrs, value_dtype
from pcompile.ir.rank import resolve, resolve_attrs
from pcompile.ir.registry import get_op

if TYPE_CHECKING:
    from pcompile.passes.pipeline_split import PipelineProgram


def _start(graph: Graph, values: Sequence[Any], float64: bool) -> dict[int, Any]:
    env: dict[int, Any] = {}
    for p, v in zip(graph.params, values):
        arr = np.asarray(v)
        if arr.shape != p.shape:
            raise ValueError(f"stage graph parameter {p.name}: expected {p.shape}, got "
                             f"{arr.shape}")
        env[id(p)] = arr.astype(value_dtype(p.dtype, float64), copy=False)
    return env


def run_pipeline(program: PipelineProgram, feeds: Sequence[Sequence[Any]],
                 float64: bool = False) -> list[list[Any]]:
    """Run every rank's stage graph (`program`, with its schedule); `feeds[r]` lists rank
    r's parameter values in its graph's order. Returns every rank's outputs."""
    schedule = program.schedule
    assert schedule is not None, "the pipeline program has no schedule (finish() it)"
    n = program.per_stage
    envs = [_start(program.graphs[r // n], feeds[r], float64) for r in range(program.devices)]
    mailbox: dict[tuple[int, int], Any] = {}

    def read(env: dict[int, Any], value: Value, rank: int) -> Any:
        if isinstance(value, Constant):
            return constant_value(value, float64, rank)
        return env[id(value)]

    events = sorted((tick, u.stage, i) for u in schedule.units
                    for i, tick in enumerate(u.ticks))
    with np.errstate(all="ignore"):  # overflow: inf or NaN, no numpy warning (run_graph)
        for _, s, i in events:
            graph = program.graphs[s]
            ranks = list(program.ranks(s))
            for k in schedule.units[s].nodes[i]:
                node = graph.nodes[k]
                args = {r: [read(envs[r], v, r) for v in node.operands] for r in ranks}
                for r in ranks:
                    envs[r][id(node.result)] = checked_result(
                        node, node.result.type, _execute(node, r, args, mailbox, float64),
                        float64)
    return [[read(envs[r], v, r) for v in program.graphs[r // n].outputs]
            for r in range(program.devices)]


def _execute(node: Node, rank: int, args: dict[int, list[Any]],
             mailbox: dict[tuple[int, int], Any], float64: bool) -> Any:
    if node.op == "Send":
        dest = int(resolve(node.attrs["dest_rank"], rank))
        mailbox[(int(node.attrs["sr_tag"]), dest)] = args[rank][0]
        return args[rank][0]
    if node.op == "Receive":
        key = (int(node.attrs["sr_tag"]), rank)
        if key not in mailbox:
            raise RuntimeError(f"{node.where()}: rank {rank} receives sr_tag {key[0]} from rank "
                               f"{resolve(node.attrs['src_rank'], rank)}, which has not sent it")
        return mailbox.pop(key)
    opdef = get_op(node.op)
    if opdef.collective:
        return collective_result(node, rank, args)
    assert opdef.numpy is not None, f"{node.op} has no numpy implementation"
    return opdef.numpy(*args[rank], **resolve_attrs(node_attrs(opdef, node, float64), rank))
