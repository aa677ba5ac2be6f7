"""Generated rank programs: `<out>/rank_<r>/program.py` (+ `params.npz`, `consts.npz`).

`program.py` is readable JAX source for rank r: one statement per node of the execute dump, in
its order, each under a comment `# %12 = MatMul(%10, %11) matmul (scope ...)` that points back to
the dump. Every rank's program computes the same SPMD step (backends/jax/spmd.py): what differs
between ranks (slice offsets, constants, attribute variants, fallback groups) is read from
per-rank tables at `me = lax.axis_index(AXES)`, because processes under `jax.distributed` must
compile identical XLA programs (with rank-specific constants the collectives of different
processes do not match and hang). The comments show this rank's values; so the files differ
between ranks only in `RANK` and comments.

`params.npz` holds rank r's initial parameter and optimizer-state slices (after
`parameter_broadcast`), `consts.npz` the constants too large to print. Running is done by
`backends.jax.rank_runtime.main` (flags/env, jax.distributed, data, checkpoints, train.log).

The pieces every rank program shares with a pipeline's (backends/jax/pipeline_codegen.py) are
in backends/jax/program_writer.py. This module does not import JAX; `write_rank_artifacts` is
called from the driver's output step and writes into its temporary folder, so the files appear
atomically with the dumps. Output is deterministic: the same compile gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from pcompile.backends.checkpoint_files import layout_entry
from pcompile.backends.jax.plan import SpmdLoweringError, SpmdPlan
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


class _Writer(StatementWriter):
    """One SPMD program for every rank (`source(r)`: commented with rank r's values)."""

    def source(self, rank: int | None) -> str:
        """The program, commented with `rank`'s values (None: every rank's file)."""
        plan, info = self.plan, self.info
        if self._body is None:
            self._body = [f"    {self._comment(n)}\n    " + stmt.replace("\n", "\n    ")
                          for n, stmt in zip(plan.nodes, self.statements)]
        body = self._body
        if rank is not None:
            body = list(body)
            for i, n in enumerate(plan.nodes):
                detail = self._detail(n, rank)
                if detail:
                    head, _, stmt = body[i].partition("\n")
                    body[i] = f"{head}\n    {detail}\n{stmt}"
        outs = []
        for kind, idx in plan.outputs:
            outs.append(f"v{idx}" if kind == "node" else self.param_names[idx])
        ret = "    return (" + ", ".join(outs) + ("," if len(outs) == 1 else "") + ")"
        mesh = tuple(zip(plan.mesh.names, plan.mesh.sizes))
        sig = ", ".join(self.param_names)
        what = "training step" if info["training"] else "inference"
        parts = [
            header(info, rank, plan.num_ranks, what=what),
            *preamble(info, rank, plan.num_ranks),
            f"MESH = {literal(mesh)}  # rank = row-major index on this mesh",
            f"AXES = {literal(plan.mesh.names)}",
            "# Graph parameters in order: (name, kind, local shape, dtype name); their layouts",
            "# (global shape, device matrix, tensor map) are in LAYOUTS.",
            f"PARAMS = {params_literal(info)}",
            f"LAYOUTS = {layouts_literal(info['layouts'])}",
            f"OUTPUTS = {literal(tuple(info['outputs']))}",
            "DATA: dict = {}  # constants and tables from consts.npz, loaded by the runtime",
            "",
            "",
            f"def step({sig}):",
            f'    """{info["doc"]} of rank RANK\'s slices; runs on every rank of the mesh',
            '    (inside shard_map): `me` is the rank this device runs."""',
            "    me = lax.axis_index(AXES)",
            *body,
            ret,
            "",
            "",
            *footer(self.tables),
        ]
        return "\n".join(parts)


# -- the driver hook ---------------------------------------------------------------------------


def _plan_id(writer: _Writer, n: int) -> str:
    """Digest of the program every rank runs (statements, tables, parameters, layouts)."""
    h = hashlib.sha256()
    h.update(f"{n}\n{writer.info['mode']}\n{writer.info['training']}\n".encode())
    for text in (*writer.statements, *writer.tables, repr(writer.info["params"]),
                 repr(sorted(writer.info["layouts"].items())), repr(writer.plan.mesh)):
        h.update(text.encode())
        h.update(b"\n")
    for key in sorted(writer.consts):
        h.update(key.encode())
        h.update(np.ascontiguousarray(writer.consts[key]).tobytes())
    return h.hexdigest()[:16]


def rank_artifacts(program: RankProgram, folder: str) -> dict[str, bytes]:
    """The files of the rank programs, by path relative to the output folder: `program.py`
    (every rank's SPMD program), `rank_<r>/program.py` for each dumped rank (the same program,
    commented with that rank's values), `consts.npz` (large constants and tables). `folder`
    holds the dumps (for the dump name)."""
    graphs = list(program.rank_graphs)
    n = len(graphs)
    dumped = list(program.dump_ranks)
    first = os.path.join(folder, f"rank_{dumped[0]}") if dumped else ""
    irs = sorted(f for f in os.listdir(first) if f.endswith(".ir")) if first else []
    if program.pipeline is not None:  # one program of all stages (pipeline_codegen.py)
        from pcompile.backends.jax.pipeline_codegen import pipeline_artifacts

        return pipeline_artifacts(program, dumped, irs[-1] if irs else "")
    try:
        plan = SpmdPlan.build(graphs)
    except SpmdLoweringError as exc:
        ident = hashlib.sha256(str(exc).encode()).hexdigest()[:16]
        text = _STUB.format(reason=str(exc).replace('"""', "'''"), plan_id=ident).encode()
        return {"program.py": text, **{f"rank_{r}/program.py": text for r in dumped}}
    layouts = program.param_layouts
    graph = graphs[0]
    info = {
        "model": program.model_path,
        "mode": program.parallel_mode,
        "training": program.training,
        "dump": irs[-1] if irs else "",
        "plan_id": "",
        "outputs": list(graph.attrs.get("outputs") or
                        [f"output{i}" for i in range(len(graph.outputs))]),
        "params": [(p.name, p.kind, tuple(p.shape), p.dtype.name) for p in graph.params],
        "layouts": {p.name: layout_entry(layouts.get(p.name), tuple(p.shape), p.dtype.name)
                    for p in graph.params},
        "doc": "One training step" if program.training else "The forward computation",
        **program.run_report.info(),
    }
    writer = _Writer(plan, info)
    info["plan_id"] = _plan_id(writer, n)
    out: dict[str, bytes] = {"program.py": writer.source(None).encode()}
    for r in dumped:
        out[f"rank_{r}/program.py"] = writer.source(r).encode()
    if writer.consts:
        out["consts.npz"] = npz_bytes(writer.consts)
    return out


_STUB = '''#!/usr/bin/env python3
"""pcompile could not generate an SPMD program for this plan (plan {plan_id}):

{reason}
"""

import sys

sys.exit(__doc__)
'''


def write_rank_artifacts(folder: str, program: RankProgram) -> None:
    """Write the rank programs, `consts.npz` and `params.json` (backends/params.py: every
    rank makes its own parameter slices at run time) into `folder` (the driver's staging
    folder; compiler/driver/outdir.py carries run outputs such as checkpoints over)."""
    from pcompile.backends.params import write_manifest

    for rel, data in rank_artifacts(program, folder).items():
        path = os.path.join(folder, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        if rel.endswith("program.py"):
            os.chmod(path, 0o755)
    write_manifest(folder, program.stored_values())
