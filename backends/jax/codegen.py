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

This module does not import JAX; `write_rank_artifacts` is called from the driver's output step
and writes into its temporary folder, so the files appear atomically with the dumps. Output is
deterministic: the same compile gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import keyword
import math
import os
import re
from typing import Any

import numpy as np

from pcompile.backends.checkpoint_files import layout_entry
from pcompile.backends.jax.collectives import COLLECTIVES
from pcompile.backends.jax.plan import NodePlan, SpmdLoweringError, SpmdPlan
from pcompile.backends.npz_files import npz_bytes
from pcompile.ir.core import Constant, Graph, array_digest
from pcompile.ir.memo import items_key
from pcompile.ir.rank import resolve_attrs
from pcompile.ir.registry import get_op
from pcompile.ir.types import DType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INLINE_CONST_LIMIT = 16  # constants with more elements go to consts.npz


def identifier(name: str, taken: set[str]) -> str:
    """A unique Python identifier for a graph-parameter name."""
    base = re.sub(r"\W", "_", name) or "p"
    if base[0].isdigit() or keyword.iskeyword(base) or base in ("me", "jnp", "np", "lax"):
        base = "p_" + base
    out, k = base, 1
    while out in taken or re.fullmatch(r"v\d+", out):
        k += 1
        out = f"{base}_{k}"
    taken.add(out)
    return out


def literal(value: Any) -> str:
    """Python source for an attribute value."""
    if isinstance(value, DType):
        return f"DType.{value.name}"
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, np.integer)):
        return repr(int(value))
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return repr(f) if math.isfinite(f) else f"float({str(f)!r})"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, tuple):
        inner = ", ".join(literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    raise SpmdLoweringError(f"cannot write attribute value {value!r} as Python source")


def array_literal(array: np.ndarray) -> str:
    return literal(_to_tuple(np.asarray(array).tolist()))


def _to_tuple(x: Any) -> Any:
    return tuple(_to_tuple(v) for v in x) if isinstance(x, list) else x


def _dtype_name(dtype: np.dtype) -> str:
    return DType.from_any(dtype).name


_KEYWORDS: dict[tuple[Any, ...], list[str]] = {}


class _Writer:
    """Generates one rank's program from the plan."""

    prefix = ""  # of table names (a pipeline program has one writer per stage)

    def __init__(self, plan: SpmdPlan, info: dict[str, Any]) -> None:
        self.plan = plan
        self.info = info
        self.consts: dict[str, np.ndarray] = {}
        self.tables: list[str] = []
        graph = plan.graph
        taken: set[str] = set()
        self.param_names = [identifier(p.name, taken) for p in graph.params]
        self.dump_names = _dump_names(graph)
        # The statements (and so the tables) are the same on every rank; only comments differ.
        self.statements = [self._statement(n) for n in plan.nodes]
        self._body: list[str] | None = None  # comment and statement of each node, indented

    # -- pieces --------------------------------------------------------------------------------
    def _const(self, n: NodePlan, i: int, value: Constant) -> str:
        arr = value.array
        if n.const_tables.get(i) is not None:
            table = n.const_tables[i]
            name = f"{self.prefix}K{n.index}_{i}"
            self._table(name, table, f"per-rank constant operand {i} of %{n.index}")
            return f"pick({name}, me)"
        dtype = _dtype_name(arr.dtype)
        if arr.size <= INLINE_CONST_LIMIT and (arr.dtype.kind != "f" or np.isfinite(
                arr.astype(np.float64)).all()):
            return f"const({array_literal(arr)}, {dtype!r})"
        key = f"const.{array_digest(arr)}"  # the same data (one mask per layer) stored once
        self.consts[key] = arr
        return f"jnp.asarray(DATA[{key!r}])"

    def _table(self, name: str, table: np.ndarray, what: str) -> None:
        if table.size > 64 * max(1, self.plan.num_ranks):
            key = f"table.{array_digest(table)}"  # the same table (one per layer) stored once
            self.consts[key] = np.asarray(table)
            self.tables.append(f"{name} = LazyTable(DATA, {key!r})  # {what}, in consts.npz")
            return
        # DType's numpy dtype: numpy itself has no bfloat16 (ml_dtypes gives DType its own)
        dtype = f"DType.{_dtype_name(np.asarray(table).dtype)}.np"
        rows = [array_literal(row) for row in np.asarray(table)]
        line = f"{name} = np.array(({', '.join(rows)},), {dtype})  # {what}"
        if len(line) <= 100:
            self.tables.append(line)
            return
        body = "".join(f"    {row},  # rank {r}\n" for r, row in enumerate(rows))
        self.tables.append(f"{name} = np.array((  # {what}\n{body}), {dtype})")

    def _value(self, kind: str, idx: int) -> str:
        """How the source names node `idx`'s result or parameter `idx`."""
        return f"v{idx}" if kind == "node" else self.param_names[idx]

    def _arg(self, n: NodePlan, i: int) -> str:
        kind, idx = n.operands[i]
        if kind in ("node", "param"):
            return self._value(kind, idx)
        value = n.node.operands[i]
        assert isinstance(value, Constant)
        return self._const(n, i, value)

    def _comment(self, n: NodePlan, view: int = 0, indent: str = "    ") -> str:
        """The node's line of the dump, as a comment (the same on every rank; `view`: the
        rank whose graph is read), and the attributes the lowering changed (`lowering_attrs`,
        e.g. a constant causal mask run as sparse_mode 2)."""
        node = self.plan.graphs[view].nodes[n.index]
        args = ", ".join(self._dump_ref(n, i) for i in range(len(n.operands)))
        name = f" {node.instance_name}" if node.instance_name else ""
        line = _clip(f"# %{n.index} = {node.op}({args}){name} (scope {node.scope})")
        if n.kind != "op" or get_op(node.op).lowering_attrs is None:
            return line
        dumped = resolve_attrs(get_op(node.op).impl_attrs(node.attrs), 0)
        changed = [f"{k}={literal(v)}" for k, v in n.attrs.items() if dumped.get(k) != v]
        if not changed:
            return line
        return f"{line}\n{indent}" + _clip(
            f"#   lowered with {', '.join(changed)}", 96 - len(indent))

    def _detail(self, n: NodePlan, rank: int) -> str:
        """`rank`'s values of a node that differs between ranks, as a comment ("" if none)."""
        if n.kind not in ("slice", "slice_grad", "collective", "switch") and not n.const_tables:
            return ""
        detail = _rank_detail(n, self.plan.graphs[rank].nodes[n.index], rank)
        return _clip(f"#   this rank: {detail}") if detail else ""

    def _keywords(self, attrs: dict[str, Any]) -> list[str]:
        """`k=<literal>` of each attribute; memoised, as a model's layers repeat them."""
        try:
            key = items_key(attrs)
        except TypeError:  # an unhashable value
            return [f"{k}={literal(v)}" for k, v in attrs.items()]
        kw = _KEYWORDS.get(key)
        if kw is None:
            kw = [f"{k}={literal(v)}" for k, v in attrs.items()]
            if len(_KEYWORDS) < 100_000:
                _KEYWORDS[key] = kw
        return kw

    def _dump_ref(self, n: NodePlan, i: int) -> str:
        kind, idx = n.operands[i]
        if kind == "node":
            return f"%{idx}"
        if kind == "param":
            return self.dump_names[idx]
        return "const"

    def _statement(self, n: NodePlan) -> str:
        args = [self._arg(n, i) for i in range(len(n.operands))]
        target = self._value("node", n.index)
        if n.kind == "op":
            return f"{target} = ops.{n.op}({', '.join(args + self._keywords(n.attrs))})"
        if n.kind in ("slice", "slice_grad"):
            s = n.slice
            assert s is not None
            if s.offsets is not None:  # arithmetic on the rank: no table per rank
                starts = (f"spmd.rank_offsets(me, {literal(s.offsets.base)}, "
                          f"{literal(s.offsets.terms)})")
            else:
                table = f"{self.prefix}S{n.index}"
                self._table(table, s.starts, f"start offsets of %{n.index} ({n.op})")
                starts = f"pick({table}, me)"
            if n.kind == "slice":
                return (f"{target} = spmd.dyn_slice({args[0]}, {starts}, "
                        f"{literal(s.span)}, {literal(s.steps)})")
            return (f"{target} = spmd.dyn_slice_grad({args[0]}, {starts}, "
                    f"{literal(s.span)}, {literal(s.steps)}, {literal(s.shape)})")
        if n.kind == "switch":
            table = f"{self.prefix}V{n.index}"
            self._table(table, np.asarray(n.variant, np.int32),
                        f"attribute variant of %{n.index} ({n.op})")
            params = ", ".join(f"a{i}" for i in range(len(args)))
            branches = []
            for v in n.variants:
                call = ", ".join([f"a{i}" for i in range(len(args))]
                                 + [f"{k}={literal(x)}" for k, x in v.items()])
                branches.append(f"        lambda {params}: ops.{n.op}({call}),")
            return (f"{target} = lax.switch(pick({table}, me), (\n" + "\n".join(branches)
                    + f"\n    ), {', '.join(args)})")
        if n.kind == "collective":
            c = n.collective
            assert c is not None
            if c.axes is not None:
                row = COLLECTIVES[c.op]
                kw = [f"axes={literal(c.axes)}"] + [
                    f"{k}={literal(v)}" for k, v in row.keywords(c.attrs).items()]
                return f"{target} = spmd.{row.over_axes}({', '.join(args + kw)})"
            members, positions = f"{self.prefix}G{n.index}", f"{self.prefix}P{n.index}"
            self._table(members, c.members, f"group members of %{n.index} ({c.op})")
            self._table(positions, c.positions, f"position in the group of %{n.index}")
            kw = [f"{k}={literal(v)}" for k, v in c.attrs.items()]
            return (f"{target} = spmd.group_collective({c.op!r}, {', '.join(args)}, "
                    f"all_axes=AXES, members=pick({members}, me), "
                    f"position=pick({positions}, me){''.join(', ' + k for k in kw)})"
                    "  # exact fallback: gathers from all ranks")
        raise SpmdLoweringError(f"unknown node kind {n.kind}")

    # -- the file ------------------------------------------------------------------------------
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
        params_rows = "".join(f"    {literal(row)},\n" for row in info["params"])
        mesh = tuple(zip(plan.mesh.names, plan.mesh.sizes))
        sig = ", ".join(self.param_names)
        head = _HEADER.format(
            title=f"Rank {rank} of {plan.num_ranks}" if rank is not None
            else f"All {plan.num_ranks} ranks",
            comments=f"The comments show rank {rank}'s values." if rank is not None
            else "rank_<r>/program.py (dumped ranks) comments each rank's values.",
            path=f"rank_{rank}/program.py" if rank is not None else "program.py",
            n=plan.num_ranks,
            model=os.path.relpath(info["model"], ROOT) if info["model"].startswith(ROOT)
            else info["model"],
            mode=info["mode"],
            what="training step" if info["training"] else "inference",
            dump=f"rank_{rank if rank is not None else 0}/{info['dump']}",
            plan_id=info["plan_id"],
        )
        parts = [
            head,
            "import jax.numpy as jnp  # noqa: E402",
            "import numpy as np  # noqa: E402",
            "from jax import lax  # noqa: E402",
            "",
            "from pcompile.backends.jax import spmd  # noqa: E402",
            "from pcompile.backends.jax.spmd import LazyTable, const, ops, pick  # noqa: E402,F401",
            "from pcompile.ir.types import DType  # noqa: E402,F401",
            "",
            f"RANK = {rank}",
            f"NUM_RANKS = {plan.num_ranks}",
            f"MODEL_FILE = {info['model']!r}",
            f"PARALLEL_MODE = {info['mode']!r}",
            f"TRAINING = {info['training']!r}",
            f"PLAN_ID = {info['plan_id']!r}",
            *run_report_lines(info),
            f"MESH = {literal(mesh)}  # rank = row-major index on this mesh",
            f"AXES = {literal(plan.mesh.names)}",
            "# Graph parameters in order: (name, kind, local shape, dtype name); their layouts",
            "# (global shape, device matrix, tensor map) are in LAYOUTS.",
            f"PARAMS = (\n{params_rows})",
            f"LAYOUTS = {_layouts_literal(info['layouts'])}",
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
            *(["# Per-rank tables (row r: rank r)."] if self.tables else []),
            *self.tables,
            *([""] if self.tables else []),
            "",
            'if __name__ == "__main__":',
            "    from pcompile.backends.jax.rank_runtime import main",
            "",
            "    sys.exit(main(sys.modules[__name__]))",
            "",
        ]
        return "\n".join(parts)


_HEADER = '''#!/usr/bin/env python3
"""{title}: {what} of {model} ({mode}).

Generated by pcompile from {dump} (plan {plan_id}).
Regenerate it (compile again) rather than editing it.
Every rank runs this same SPMD step; what differs between ranks (slice offsets, groups,
constants) is read from per-rank tables at `me = lax.axis_index(AXES)`, so that every process
compiles the same XLA program. {comments}

Run one process per rank (docs/running.md):
    python {path} --coordinator HOST:PORT --num-processes {n} \\
        --process-id I --steps 10
or set PCOMPILE_COORDINATOR / PCOMPILE_NUM_PROCESSES / PCOMPILE_PROCESS_ID (or torchrun's,
msrun's or MindSpore's variables), or start the ranks with mpirun / srun (the process id picks
the rank); `--num-processes 1` runs all ranks in this process on {n} virtual CPU devices;
`pcompile MODEL.py ... --run` launches them on this machine. Each rank makes its own parameter
slices from ../params.json (backends/params.py).
"""

from __future__ import annotations

import os
import sys
'''


def _clip(line: str, width: int = 96) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _layouts_literal(layouts: dict[str, Any]) -> str:
    rows = "".join(f"    {name!r}: {literal(_to_tuple_entry(e))},\n" for name, e in layouts.items())
    return "{\n" + rows + "}"


def _to_tuple_entry(e: dict[str, Any]) -> tuple[Any, ...]:
    tmap = tuple(tuple(x) if isinstance(x, list) else x for x in e["tensor_map"])
    return (tuple(e["shape"]), tuple(e["dev_matrix"]), tmap)


def _dump_names(graph: Graph) -> list[str]:
    from pcompile.ir.printer import param_ref

    return [param_ref(i, p) for i, p in enumerate(graph.params)]


def _rank_detail(n: NodePlan, node: Any, rank: int) -> str:
    if n.kind in ("slice", "slice_grad"):
        a = resolve_attrs(node.attrs, rank)
        return f"begin {literal(tuple(a['begin']))}, end {literal(tuple(a['end']))}"
    if n.kind == "collective":
        c = n.collective
        assert c is not None
        how = f"over mesh axes {literal(c.axes)}" if c.axes is not None else "exact fallback"
        return f"group {literal(c.group_of(rank))} ({how})"
    if n.kind == "switch":
        return f"variant {n.variant[rank]}: {literal(n.variants[n.variant[rank]])}"
    if n.const_tables:
        return "constants " + ", ".join(
            f"operand {i} = {array_literal(t[rank]) if t[rank].size <= 8 else '...'}"
            for i, t in n.const_tables.items())
    return ""


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


def rank_artifacts(state: Any, folder: str) -> dict[str, bytes]:
    """The files of the rank programs, by path relative to the output folder: `program.py`
    (every rank's SPMD program), `rank_<r>/program.py` for each dumped rank (the same program,
    commented with that rank's values), `consts.npz` (large constants and tables). `folder`
    holds the dumps (for the dump name)."""
    graphs: list[Graph] = state.rank_graphs
    n = len(graphs)
    dumped = list(getattr(state, "dump_ranks", range(n)))
    first = os.path.join(folder, f"rank_{dumped[0]}") if dumped else ""
    irs = sorted(f for f in os.listdir(first) if f.endswith(".ir")) if first else []
    if getattr(state, "pipelined", False):  # one program of all stages (pipeline_codegen.py)
        from pcompile.backends.jax.pipeline_codegen import pipeline_artifacts

        return pipeline_artifacts(state, dumped, irs[-1] if irs else "")
    try:
        plan = SpmdPlan.build(graphs)
    except SpmdLoweringError as exc:
        ident = hashlib.sha256(str(exc).encode()).hexdigest()[:16]
        text = _STUB.format(reason=str(exc).replace('"""', "'''"), plan_id=ident).encode()
        return {"program.py": text, **{f"rank_{r}/program.py": text for r in dumped}}
    layouts = state.assignment.param_layouts if state.assignment is not None else {}
    graph = graphs[0]
    info = {
        "model": os.path.abspath(state.model_file.path),
        "mode": state.parallel_mode,
        "training": bool(state.training),
        "dump": irs[-1] if irs else "",
        "plan_id": "",
        "outputs": list(graph.attrs.get("outputs") or
                        [f"output{i}" for i in range(len(graph.outputs))]),
        "params": [(p.name, p.kind, tuple(p.shape), p.dtype.name) for p in graph.params],
        "layouts": {p.name: layout_entry(layouts.get(p.name), tuple(p.shape), p.dtype.name)
                    for p in graph.params},
        "doc": "One training step" if state.training else "The forward computation",
        **run_report_info(state),
    }
    writer = _Writer(plan, info)
    info["plan_id"] = _plan_id(writer, n)
    out: dict[str, bytes] = {"program.py": writer.source(None).encode()}
    for r in dumped:
        out[f"rank_{r}/program.py"] = writer.source(r).encode()
    if writer.consts:
        out["consts.npz"] = npz_bytes(writer.consts)
    return out


def run_report_info(state: Any) -> dict[str, Any]:
    """What the runtime needs to report a run (backends/run_report.py): the model FLOPs of one
    step counted on the traced forward graph (compiler/flops.py; 0: none counted), the
    optimizer's learning rate when it is a constant (the model file's optimizer() or the one
    its training step cell holds), and the token ids one step trains on (`tokens_per_step`)."""
    from pcompile.compiler.flops import constant_learning_rate, model_flops, training_optimizer
    from pcompile.compiler.runtime import dataset_spec

    traced = getattr(state, "traced", None)
    graph = traced.graph if traced is not None else None
    return {"model_flops": model_flops(graph, bool(state.training)),
            "learning_rate": constant_learning_rate(training_optimizer(state)),
            "tokens_per_step": tokens_per_step(state),
            "dataset": dataset_spec(state).literal() if traced is not None else None}


def tokens_per_step(state: Any) -> int:
    """Token ids of the first input one step trains on, all ranks: those its embedding lookup
    reads (compiler/data_checks.py, `looked_up_ids`), not the ids the input holds (a sample of
    S + 1 ids trains S tokens); 0 when they reach no lookup. The traced graph takes one
    micro-batch under nn.PipelineCell: scaled to the whole batch."""
    from pcompile.compiler.data_checks import looked_up_ids

    traced = getattr(state, "traced", None)
    if traced is None or not traced.input_names:
        return 0
    name = traced.input_names[0]
    looked = looked_up_ids(traced.graph, name)
    if not looked:
        return 0
    held = int(np.prod(traced.graph.param(name).shape, dtype=np.int64))
    whole = held
    if state.micro_batched and state.assignment is not None:
        whole = int(np.prod(state.assignment.param_layouts[name].shape, dtype=np.int64))
    return looked * whole // max(1, held)


def run_report_lines(info: dict[str, Any]) -> list[str]:
    """The program's lines for `run_report_info`."""
    return [f"MODEL_FLOPS = {int(info.get('model_flops') or 0)}  # of one step, all ranks: "
            "3 x the forward's matmul/attention FLOPs when training (0: not counted)",
            f"LEARNING_RATE = {info.get('learning_rate')!r}  # None: a schedule, or no "
            "optimizer",
            f"TOKENS_PER_STEP = {int(info.get('tokens_per_step') or 0)}  # token ids one step "
            "trains on, all ranks (0: none looked up)",
            "# where the batches come from (compiler.runtime.DatasetSpec): the model file's",
            "# dataset(), its first `inputs` arrays the inputs, the next `labels` the labels",
            f"DATASET = {info.get('dataset')!r}"]


def stored_values(state: Any) -> list[tuple[str, str, Any]]:
    """(name, kind, abstract initial value) of every parameter and optimizer state the
    program stores (what `params.json` describes)."""
    seen: dict[str, Any] = {}
    for graph in state.graphs:  # the stages' graphs of a pipeline hold different values
        for p in graph.params:
            if p.kind != "input" and p.name not in seen:
                seen[p.name] = (p.name, p.kind, state.initial_values.source(p.name))
    return list(seen.values())


_STUB = '''#!/usr/bin/env python3
"""pcompile could not generate an SPMD program for this plan (plan {plan_id}):

{reason}
"""

import sys

sys.exit(__doc__)
'''


def write_rank_artifacts(folder: str, state: Any) -> None:
    """Write the rank programs, `consts.npz` and `params.json` (backends/params.py: every
    rank makes its own parameter slices at run time) into `folder` (the driver's staging
    folder; compiler/outdir.py carries run outputs such as checkpoints over)."""
    from pcompile.backends.params import write_manifest

    for rel, data in rank_artifacts(state, folder).items():
        path = os.path.join(folder, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        if rel.endswith("program.py"):
            os.chmod(path, 0o755)
    write_manifest(folder, stored_values(state))
