"""Generated program of a pipeline: `<out>/program.py` (and `rank_<r>/program.py`).

The file has the interface of every rank program (backends/jax/rank_runtime.py: `PARAMS`,
`LAYOUTS`, `OUTPUTS`, `MESH`, `AXES`, `step`), so the runtime, the launcher and
`jax.distributed` run it as they run an SPMD program:

* `stage_<s>(unit, v, p, me)`: stage s's code, one block per unit (`F0`, `B0`, ...), one
  statement per node of the stage's execute dump under a comment pointing back to it (`v[k]` is
  node %k, `p[i]` the stage graph's parameter i); Send and Receive are comments (the runtime
  moves their values);
* `PIPELINE`: the schedule as data (backends/jax/pipeline_plan.py): ticks, which unit each
  stage runs at each tick, what it keeps and what it sends between ticks;
* `step(*arrays)`: `pipeline.run_step(PIPELINE, STAGES, arrays, AXES)`, the ticks under one
  `lax.switch` on the device's stage each and `ppermute` between stages;
* `PARAMS` / `OUTPUTS`: the union of the stages' parameters and results (a device reads and
  updates its own stage's; `PARAM_STAGES` says which stage holds what, for checkpoints).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from pcompile.backends.checkpoint_files import layout_entry
from pcompile.backends.jax.pipeline_plan import PipelinePlan
from pcompile.backends.jax.plan import CollectivePlan, NodePlan
from pcompile.backends.jax.program_writer import (
    StatementWriter,
    footer,
    header,
    layouts_literal,
    literal,
    params_literal,
    preamble,
)
from pcompile.backends.npz_files import npz_bytes
from pcompile.program.rank_program import RankProgram


class _StagePlan:
    """What `StatementWriter` reads of a plan, for one stage's graph."""

    def __init__(self, plan: PipelinePlan, stage: int) -> None:
        self.graph = plan.graphs[stage]
        self.graphs = [self.graph] * plan.num_ranks
        self.nodes = plan.nodes[stage]
        self.num_ranks = plan.num_ranks
        self.mesh = plan.mesh
        self.outputs: list[Any] = []


class _StageWriter(StatementWriter):
    """Statements of one stage: `v[k]` for node results, `p[i]` for the stage's parameters;
    a fallback collective gathers over the stage's axes (AXES[1:]), its members given by their
    positions in the stage."""

    fallback_axes = "AXES[1:]"
    fallback_note = "exact fallback, in the stage"

    def __init__(self, plan: PipelinePlan, stage: int, info: dict[str, Any]) -> None:
        self.prefix = f"S{stage}_"
        self.stage = stage
        self.per_stage = plan.program.per_stage
        super().__init__(_StagePlan(plan, stage), info)  # type: ignore[arg-type]

    def _value(self, kind: str, idx: int) -> str:
        return f"v[{idx}]" if kind == "node" else f"p[{idx}]"

    def _statement(self, n: NodePlan) -> str:
        if n.kind == "send":
            return f"v[{n.index}] = {self._arg(n, 0)}  # sent after the unit (PIPELINE)"
        if n.kind == "recv":
            return "pass  # arrived before the unit (PIPELINE)"
        return super()._statement(n)

    def _members(self, c: CollectivePlan) -> tuple[np.ndarray, str]:
        return c.members % self.per_stage, "group members (positions in the stage)"

    def function(self, plan: PipelinePlan, rank: int | None) -> list[str]:
        s = self.stage
        ranks = plan.program.ranks(s)
        view = rank if rank is not None and rank in ranks else ranks[0]
        lines = [
            f"def stage_{s}(unit, v, p, me):",
            f'    """Stage {s} (ranks {ranks[0]}-{ranks[-1]}): the nodes of `unit` (the stage\'s '
            f'dump,',
            f'    rank_{view}/.../*_execute.ir); v[k] is node %k, p[i] parameter i."""',
        ]
        first = True
        units = [(entry[0], entry[1]) for row in plan.tables.units
                 for entry in [row[s]] if entry is not None]
        for label, members in units:
            lines.append(f"    {'if' if first else 'elif'} unit == {label!r}:")
            first = False
            for k in members:
                n = self.plan.nodes[k]
                lines.append("        " + self._comment(n, view, indent="        "))
                detail = self._detail(n, view)
                if detail:
                    lines.append("        " + detail)
                lines.extend("        " + part for part in self.statements[k].split("\n"))
            if not members:
                lines.append("        pass")
        if first:
            lines.append("    pass")
        return lines


def pipeline_artifacts(compiled: RankProgram, dumped: list[int], dump: str
                       ) -> dict[str, bytes]:
    """`program.py`, `rank_<r>/program.py` (dumped ranks) and `consts.npz` of a pipeline."""
    program = compiled.pipeline
    assert program is not None
    plan = PipelinePlan.build(program)
    tables = plan.tables
    layouts = compiled.param_layouts
    info = {
        "model": compiled.model_path,
        "mode": compiled.parallel_mode,
        "training": True,
        "dump": dump,
        "plan_id": "",
        "outputs": list(tables.union_outputs),
        "params": [(name, kind, tuple(shape), dtype)
                   for name, kind, shape, dtype in tables.union_params],
        "layouts": {name: layout_entry(layouts.get(name), tuple(shape), dtype)
                    for name, _, shape, dtype in tables.union_params},
        "doc": "One training step",
        **compiled.run_report.info(),
    }
    writers = [_StageWriter(plan, s, info) for s in range(program.stages)]
    digest = hashlib.sha256(repr(sorted(tables.literal().items())).encode())
    for w in writers:
        for text in (*w.statements, *w.tables):
            digest.update(text.encode())
        for key in sorted(w.consts):
            digest.update(key.encode())
            digest.update(np.ascontiguousarray(w.consts[key]).tobytes())
    digest.update(repr((info["params"], sorted(info["layouts"].items()), plan.mesh)).encode())
    info["plan_id"] = digest.hexdigest()[:16]
    out = {"program.py": _source(plan, writers, info, None).encode()}
    for r in dumped:
        out[f"rank_{r}/program.py"] = _source(plan, writers, info, r).encode()
    consts = {k: v for w in writers for k, v in w.consts.items()}
    if consts:
        out["consts.npz"] = npz_bytes(consts)
    return out


def _source(plan: PipelinePlan, writers: list[_StageWriter], info: dict[str, Any],
            rank: int | None) -> str:
    program = plan.program
    n = plan.num_ranks
    head = header(info, rank, n, what="training step",
                  note=f" Pipeline: {program.stages} stages of {program.per_stage} ranks, "
                       f"{program.micro} micro-batch(es) per step, schedule "
                       f"{program.scheduler}.")
    mesh = tuple(zip(plan.mesh.names, plan.mesh.sizes))
    functions: list[str] = []
    for w in writers:
        functions += w.function(plan, rank) + ["", ""]
    tables = [line for w in writers for line in w.tables]
    stage_of = {name: list(stages) for name, stages in program.param_stages.items()}
    parts = [
        head,
        *preamble(info, rank, n, modules="pipeline, spmd", noqa="E402,F401"),
        f"MESH = {literal(mesh)}  # rank = row-major index; stage s owns ranks "
        f"[s*{program.per_stage}, (s+1)*{program.per_stage})",
        f"AXES = {literal(plan.mesh.names)}",
        "# Graph parameters of all stages: (name, kind, local shape, dtype name); a device",
        "# reads its own stage's. Their layouts (inside a stage) are in LAYOUTS.",
        f"PARAMS = {params_literal(info)}",
        f"LAYOUTS = {layouts_literal(info['layouts'])}",
        f"OUTPUTS = {literal(tuple(info['outputs']))}",
        f"PARAM_STAGES = {literal(stage_of)}  # the stages that hold each stored value",
        f"RANKS_PER_STAGE = {program.per_stage}",
        "# The schedule (backends/jax/pipeline_plan.py): ticks, units, carries and sends.",
        f"PIPELINE = {literal(plan.tables.literal())}",
        "DATA: dict = {}  # constants and tables from consts.npz, loaded by the runtime",
        "",
        "",
        *functions,
        f"STAGES = ({', '.join(f'stage_{s}' for s in range(program.stages))},)",
        "",
        "",
        "def step(*arrays):",
        '    """One training step of this device\'s stage: every tick runs each stage\'s unit',
        "    (lax.switch on the stage) and moves what crosses stages (ppermute); inside",
        '    shard_map over the mesh."""',
        "    return pipeline.run_step(PIPELINE, STAGES, arrays, AXES)",
        "",
        "",
        *footer(tables),
    ]
    return "\n".join(parts)
