"""The program writer both code generators share (backends/jax/codegen.py: the SPMD rank
programs; backends/jax/pipeline_codegen.py: a pipeline's): Python literals of attribute values
and arrays (`literal`, `array_literal`), `StatementWriter` (one statement per node of a plan,
its comment pointing back to the dump, the per-rank tables and the constants for consts.npz),
and the parts of the file every rank program has: `header` (the docstring: how to run it),
`preamble` (imports, RANK ... PLAN_ID, the run report's facts), `layouts_literal`,
`params_literal` and `footer` (the per-rank tables and the `__main__` entry).

Like the code generators, it does not import JAX; its output is deterministic.
"""

from __future__ import annotations

import keyword
import math
import os
import re
from typing import Any

import numpy as np

from pcompile.backends.jax.collectives import COLLECTIVES
from pcompile.backends.jax.plan import CollectivePlan, NodePlan, SpmdLoweringError, SpmdPlan
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


class StatementWriter:
    """The statements of a plan's nodes (`statements`, the same on every rank), their per-rank
    tables (`tables`) and large constants (`consts`); a code generator adds the file around
    them."""

    prefix = ""  # of table names (a pipeline program has one writer per stage)
    fallback_axes = "AXES"  # the mesh axes a fallback collective gathers over
    fallback_note = "exact fallback: gathers from all ranks"  # its statement's comment

    def __init__(self, plan: SpmdPlan, info: dict[str, Any]) -> None:
        self.plan = plan
        self.info = info
        self.consts: dict[str, np.ndarray] = {}
        self.tables: list[str] = []
        graph = plan.graph
        taken: set[str] = set()
        self.param_names = [identifier(p.name, taken) for p in graph.params]
        self.dump_names = dump_names(graph)
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
        key = self._store(f"const.{array_digest(arr)}", arr)  # the same data stored once
        return f"jnp.asarray(DATA[{key!r}])"

    def _store(self, key: str, arr: np.ndarray) -> str:
        """`arr` under `key` in consts.npz, or under a key naming its dtype and shape when
        other data of the same bytes is stored there (a (64, 1) and a (1, 64) iota)."""
        known = self.consts.get(key)
        if known is not None and (known.shape != arr.shape or known.dtype != arr.dtype):
            key = f"{key}.{_dtype_name(arr.dtype)}.{'x'.join(map(str, arr.shape))}"
        self.consts[key] = arr
        return key

    def _table(self, name: str, table: np.ndarray, what: str) -> None:
        if table.size > 64 * max(1, self.plan.num_ranks):
            # the same table (one per layer) stored once
            key = self._store(f"table.{array_digest(table)}", np.asarray(table))
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
            rows, what = self._members(c)
            self._table(members, rows, f"{what} of %{n.index} ({c.op})")
            self._table(positions, c.positions, f"position in the group of %{n.index}")
            given = "".join(f", {k}={literal(v)}" for k, v in c.attrs.items())
            return (f"{target} = spmd.group_collective({c.op!r}, {', '.join(args)}, "
                    f"all_axes={self.fallback_axes}, members=pick({members}, me), "
                    f"position=pick({positions}, me){given})  # {self.fallback_note}")
        raise SpmdLoweringError(f"unknown node kind {n.kind}")

    # -- the file ------------------------------------------------------------------------------

    def _members(self, c: CollectivePlan) -> tuple[np.ndarray, str]:
        """A fallback collective's table of every rank's group members, and what it holds."""
        return c.members, "group members"


HEADER = '''#!/usr/bin/env python3
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


def layouts_literal(layouts: dict[str, Any]) -> str:
    rows = "".join(f"    {name!r}: {literal(_to_tuple_entry(e))},\n" for name, e in layouts.items())
    return "{\n" + rows + "}"


def _to_tuple_entry(e: dict[str, Any]) -> tuple[Any, ...]:
    tmap = tuple(tuple(x) if isinstance(x, list) else x for x in e["tensor_map"])
    return (tuple(e["shape"]), tuple(e["dev_matrix"]), tmap)


def dump_names(graph: Graph) -> list[str]:
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


def header(info: dict[str, Any], rank: int | None, n: int, *, what: str,
           note: str = "") -> str:
    """The program's docstring and first imports (`HEADER`): rank `rank`'s file (None: every
    rank's), `what` it computes, `note` after what its comments show."""
    model = info["model"]
    return HEADER.format(
        title=f"Rank {rank} of {n}" if rank is not None else f"All {n} ranks",
        comments=(f"The comments show rank {rank}'s values." if rank is not None
                  else "rank_<r>/program.py (dumped ranks) comments each rank's values.")
        + note,
        path=f"rank_{rank}/program.py" if rank is not None else "program.py",
        n=n,
        model=os.path.relpath(model, ROOT) if model.startswith(ROOT) else model,
        mode=info["mode"], what=what,
        dump=f"rank_{rank if rank is not None else 0}/{info['dump']}",
        plan_id=info["plan_id"],
    )


def preamble(info: dict[str, Any], rank: int | None, n: int, *, modules: str = "spmd",
             noqa: str = "E402") -> list[str]:
    """The imports (`modules` of backends/jax; `noqa` on the modules the program may not
    use) and the constants every rank program starts with, RANK to the run report's."""
    return [
        f"import jax.numpy as jnp  # noqa: {noqa}",
        f"import numpy as np  # noqa: {noqa}",
        f"from jax import lax  # noqa: {noqa}",
        "",
        f"from pcompile.backends.jax import {modules}  # noqa: {noqa}",
        "from pcompile.backends.jax.spmd import LazyTable, const, ops, pick  # noqa: E402,F401",
        "from pcompile.ir.types import DType  # noqa: E402,F401",
        "",
        f"RANK = {rank}",
        f"NUM_RANKS = {n}",
        f"MODEL_FILE = {info['model']!r}",
        f"PARALLEL_MODE = {info['mode']!r}",
        f"TRAINING = {info['training']!r}",
        f"PLAN_ID = {info['plan_id']!r}",
        *run_report_lines(info),
    ]


def params_literal(info: dict[str, Any]) -> str:
    """PARAMS: (name, kind, local shape, dtype name) of each graph parameter, a row each."""
    return "(\n" + "".join(f"    {literal(row)},\n" for row in info["params"]) + ")"


def footer(tables: list[str]) -> list[str]:
    """The per-rank tables and the entry point that runs the program."""
    return [
        *(["# Per-rank tables (row r: rank r)."] if tables else []),
        *tables,
        *([""] if tables else []),
        "",
        'if __name__ == "__main__":',
        "    from pcompile.backends.jax.rank_runtime import main",
        "",
        "    sys.exit(main(sys.modules[__name__]))",
        "",
    ]


# -- what a program says of its run ----------------------------------------------------------


def run_report_lines(info: dict[str, Any]) -> list[str]:
    """The program's lines for its run report (`program.rank_program.RunReport.info()`)."""
    return [f"MODEL_FLOPS = {int(info.get('model_flops') or 0)}  # of one step, all ranks: "
            "3 x the forward's matmul/attention FLOPs when training (0: not counted)",
            f"LEARNING_RATE = {info.get('learning_rate')!r}  # None: a schedule, or no "
            "optimizer",
            f"TOKENS_PER_STEP = {int(info.get('tokens_per_step') or 0)}  # token ids one step "
            "trains on, all ranks (0: none looked up)",
            "# where the batches come from (compiler.runtime.DatasetSpec): the model file's",
            "# dataset(), its first `inputs` arrays the inputs, the next `labels` the labels",
            f"DATASET = {info.get('dataset')!r}"]
