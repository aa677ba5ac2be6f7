"""The pipeline's tables (backends/jax/pipeline_plan.py): what each stage holds between ticks
lives in registers, one per value for its lifetime; no two values a stage holds at one tick
share a register; each value is held exactly from the tick after the one that defines or
receives it to its last reader (the end of the step for results); a tick's switch passes
exactly the registers some stage writes then; the tables are plain data that survive a
literal round trip. The numbers they produce are checked by the JAX runs
(tests/backends/test_pipeline_jax.py)."""

from __future__ import annotations

import ast
import os
from math import prod

import pytest

from pcompile.backends.jax.pipeline_plan import PipelinePlan, PipelineTables
from pcompile.ir.core import NodeResult
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

MLP = os.path.join(ROOT, "examples", "pipeline_mlp.py")


def tables_of(monkeypatch, micro: int, scheduler: str) -> tuple[PipelineTables, object]:
    monkeypatch.setenv("PIPE_MICRO", str(micro))
    monkeypatch.setenv("PIPE_SCHEDULER", scheduler)
    program = compile_model(MLP, devices=8, dump=False).state.pipeline.program
    return PipelinePlan.build(program).tables, program


def lifetimes(tb: PipelineTables, program, s: int) -> dict[int, tuple[int, int]]:
    """node -> (first, last) tick it must be held entering, recomputed from the units and the
    arrivals: from the tick after it is computed or received to its last reader's tick (the
    end, tb.ticks, for a result); only values some later tick reads."""
    g = program.graphs[s]
    index = {id(node.result): k for k, node in enumerate(g.nodes)}
    born: dict[int, int] = {}
    for t in range(tb.ticks):
        entry = tb.units[t][s]
        for k in entry[1] if entry else ():
            if g.nodes[k].op != "Receive":  # its value arrives earlier (below)
                born[k] = t
        for _, slots in tb.arrivals[t][s]:
            for slot in slots:
                born[slot[0]] = t
    last: dict[int, int] = {}
    for t in range(tb.ticks):
        entry = tb.units[t][s]
        for k in entry[1] if entry else ():
            for v in g.nodes[k].operands:
                if isinstance(v, NodeResult):
                    j = index[id(v)]
                    last[j] = max(last.get(j, -1), t)
    for v in g.outputs:
        if isinstance(v, NodeResult):
            last[index[id(v)]] = tb.ticks
    return {k: (born[k] + 1, last[k]) for k in last if born[k] < last[k]}


@pytest.mark.parametrize("micro,scheduler", [(1, "gpipe"), (4, "1f1b"), (4, "gpipe")])
def test_held_values_keep_one_register_and_never_share_one(monkeypatch, micro,
                                                           scheduler) -> None:
    tb, program = tables_of(monkeypatch, micro, scheduler)
    for s in range(tb.stages):
        g = program.graphs[s]
        want = lifetimes(tb, program, s)
        got = {k: (first, last) for k, _, first, last in tb.held[s]}
        assert got == want, s
        for k, r, *_ in tb.held[s]:
            value = g.nodes[k].result
            assert tb.registers[r] == (value.tensor_type.dtype.name, tuple(value.shape))
        for t in range(tb.ticks + 1):
            regs = [r for _, r, *_ in tb.carry(s, t)]
            assert len(regs) == len(set(regs)), (s, t)
    for t in range(tb.ticks):
        written = {r for s in range(tb.stages) for _, r, *_ in tb.written(s, t)}
        assert tb.writes[t] == sorted(written), t


def test_stages_writing_at_one_tick_share_registers(monkeypatch) -> None:
    """In 1F1B's steady state two stages write their gradient accumulators at every tick: the
    allocation gives them the same registers, so a tick passes one set through the switch,
    not one per stage: per dtype and shape, the registers written at a tick are as many as
    the most one stage writes of that kind."""
    tb, _ = tables_of(monkeypatch, 4, "1f1b")
    for t in range(tb.ticks):
        kinds: dict[tuple[str, tuple[int, ...]], int] = {}
        for s in range(tb.stages):
            for _, r, *_ in tb.written(s, t):
                kinds[tb.registers[r]] = max(kinds.get(tb.registers[r], 0),
                                             sum(1 for _, q, *_ in tb.written(s, t)
                                                 if tb.registers[q] == tb.registers[r]))
        # registers written at t: per kind, no more than the most one stage writes of it
        per_kind: dict[tuple[str, tuple[int, ...]], int] = {}
        for r in tb.writes[t]:
            per_kind[tb.registers[r]] = per_kind.get(tb.registers[r], 0) + 1
        assert per_kind == kinds, t


def test_tables_are_plain_literals(monkeypatch) -> None:
    tb, _ = tables_of(monkeypatch, 2, "1f1b")
    again = PipelineTables(**ast.literal_eval(repr(tb.literal())))
    assert again.literal() == tb.literal()
    size = sum(prod(shape) for _, shape in tb.registers)
    assert size > 0 and all(isinstance(r, int) for row in tb.writes for r in row)
