"""`execute`: the graph every rank executes, dumped under MindSpore's name.

It runs nothing (running is above the backends: `pcompile.tools` and the rank programs); it
fixes what the program executes: a pipeline's schedule of its final stage graphs, recorded in
the plan (`pipeline`)."""

from __future__ import annotations

from pcompile.passes.unit import CompileUnit


class ExecutePass:
    name = "execute"
    appends_only = True  # changes no node

    def apply(self, unit: CompileUnit) -> None:
        assert unit.rank_graphs, "execute needs the per-rank graphs"
        if unit.pipelined:  # the schedule of the final stage graphs
            assert unit.pipeline is not None and unit.pipeline.program is not None
            unit.pipeline.program.finish()
            unit.plan.pipeline = unit.pipeline.program.describe()
