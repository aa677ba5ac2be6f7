"""What `pcompile show` and `pcompile diff` compute from a compile's folder: rows of the strategy
table, how a tensor's blocks are held by the ranks, the communication summary of a rank, and
the difference between two ranks' programs. Pure data (the terminal rendering is
`compiler/render.py`); everything is read from `DIR/plan.json` (validated, compiler/plan.py)
and the rank dumps, so it works on a folder compiled elsewhere.
"""

from __future__ import annotations

import difflib
import glob
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pcompile.compiler.plan import Plan, PlanCollective, PlanLayout, read_plan
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout


def fmt_strategy(strategy: Any) -> str:
    """As MindSpore prints it: ((2, 4), (4, 1)); one input: ((2, 4))."""
    if strategy is None:
        return "-"
    inner = ", ".join("(" + ", ".join(str(x) for x in s) + ")" for s in strategy)
    return f"({inner})"


def fmt_map(tensor_map: list[Any]) -> str:
    def entry(e: Any) -> str:
        return "(" + ", ".join(map(str, e)) + ")" if isinstance(e, list) else str(e)

    return "[" + ", ".join(entry(e) for e in tensor_map) + "]"


# -- strategy table -------------------------------------------------------------------------------


@dataclass
class OpRow:
    """One row of the strategy table."""

    name: str  # full name
    op: str
    instance_name: str
    strategy: str
    dev_matrix: str
    tensor_maps: str
    slice_shapes: str
    cost: str  # the search's local objective, or "" (user-configured / not searched)
    runner_up: str
    via: str


def _num(x: Any) -> str:
    if x is None:
        return "inf"
    return f"{float(x):.6g}"


def op_rows(plan: Plan, select: str | None = None) -> list[OpRow]:
    """The strategy table (ops in graph order); `select` keeps ops whose instance name or full
    name equals it (or whose full name ends with it)."""
    search = plan.search.ops if plan.search is not None else {}
    rows = []
    for name, op in plan.ops.items():
        if select and not matches(name, op.instance_name, select):
            continue
        layouts = op.in_layouts or []
        found = search.get(name)
        rows.append(OpRow(
            name=name, op=op.op, instance_name=op.instance_name or "-",
            strategy=fmt_strategy(op.in_strategy),
            dev_matrix=str(op.dev_matrix) if op.dev_matrix is not None else "-",
            tensor_maps=" ".join(fmt_map(lay.tensor_map) for lay in layouts) or "-",
            slice_shapes=" ".join("(" + ", ".join(map(str, lay.slice_shape)) + ")"
                                  for lay in layouts) or "-",
            cost=_num(found.local_objective) if found is not None else "",
            runner_up=(f"{fmt_strategy(found.runner_up.strategy)} "
                       f"{_num(found.runner_up.local_objective)}"
                       if found is not None and found.runner_up is not None else ""),
            via=(found.via or "") if found is not None else
            ("user" if op.in_strategy is not None and plan.search is not None else ""),
        ))
    return rows


def matches(fullname: str, instance_name: str, select: str) -> bool:
    return select in (instance_name, fullname) or fullname.endswith("/" + select)


# -- layout grid ----------------------------------------------------------------------------------


@dataclass
class Block:
    """One block of a tensor and the ranks that hold it."""

    bounds: tuple[tuple[int, int], ...]
    ranks: list[int]
    index: int  # position in first-seen order (the colour)


@dataclass
class LayoutGrid:
    """How a tensor is split over the ranks: its blocks arranged by dim 0 (rows) and the
    remaining dims (columns), each with the ranks that hold it."""

    name: str
    shape: tuple[int, ...]
    layout: str
    devices: int
    rows: list[tuple[int, int]] = field(default_factory=list)  # dim-0 bounds per row
    cols: list[tuple[tuple[int, int], ...]] = field(default_factory=list)  # other dims' bounds
    cells: dict[tuple[int, int], Block] = field(default_factory=dict)

    @property
    def blocks(self) -> list[Block]:
        seen: dict[int, Block] = {}
        for block in self.cells.values():
            seen.setdefault(block.index, block)
        return [seen[k] for k in sorted(seen)]


def tensor_layout(lay: PlanLayout) -> TensorLayout:
    return TensorLayout(tuple(lay.dev_matrix),
                        tuple(tuple(e) if isinstance(e, list) else e for e in lay.tensor_map),
                        tuple(lay.shape))


def layout_grid(name: str, lay: PlanLayout, devices: int) -> LayoutGrid:
    """Which ranks hold which block of a tensor laid out as `lay` over `devices` ranks."""
    layout = tensor_layout(lay)
    holders: dict[tuple[tuple[int, int], ...], list[int]] = {}
    per = max(1, layout.device_num)
    for rank in range(devices):
        bounds = layout.slice_bounds(rank % per) if lay.shape else ((0, 1),)
        holders.setdefault(tuple(bounds), []).append(rank)
    grid = LayoutGrid(name, tuple(lay.shape), f"dev {list(lay.dev_matrix)}, map "
                      f"{fmt_map(lay.tensor_map)}", devices)
    grid.rows = sorted({b[0] for b in holders})
    grid.cols = sorted({b[1:] for b in holders})
    for index, (bounds, ranks) in enumerate(holders.items()):
        cell = (grid.rows.index(bounds[0]), grid.cols.index(bounds[1:]))
        grid.cells[cell] = Block(bounds, ranks, index)
    return grid


def tensor_layouts(plan: Plan) -> dict[str, PlanLayout]:
    """Every parameter's layout by name."""
    return {name: PlanLayout(shape=p.shape, dev_matrix=p.dev_matrix, tensor_map=p.tensor_map,
                             slice_shape=p.slice_shape)
            for name, p in plan.parameters.items()}


_PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
            "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")


def rank_label(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def block_colour(index: int) -> str:
    return _PALETTE[index % len(_PALETTE)]


def grid_svg(grid: LayoutGrid, width: int = 480) -> str:
    """An SVG picture of the grid: one rectangle per block, sized by its extent, labelled with
    the ranks holding it."""
    shape = grid.shape if grid.shape else (1,)
    rows_total = shape[0]
    cols_extent = [_extent(c) for c in grid.cols]
    cols_total = sum(cols_extent) or 1
    height = max(120, min(480, int(width * rows_total / max(1, cols_total))))
    top = 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 20}" '
           f'height="{height + top + 10}" font-family="monospace" font-size="12">',
           f'<text x="10" y="16">{_esc(grid.name)} {list(grid.shape)}</text>',
           f'<text x="10" y="32">{_esc(grid.layout)} over {grid.devices} ranks</text>']
    y = float(top)
    for r, rb in enumerate(grid.rows):
        h = height * (rb[1] - rb[0]) / max(1, rows_total)
        x = 10.0
        for c, extent in enumerate(cols_extent):
            w = width * extent / cols_total
            block = grid.cells.get((r, c))
            if block is not None:
                label = rank_label(block.ranks)
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                           f'fill="{block_colour(block.index)}" stroke="black"/>')
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" '
                           f'text-anchor="middle">{_esc(label)}</text>')
            x += w
        y += h
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _extent(bounds: tuple[tuple[int, int], ...]) -> int:
    size = 1
    for b, e in bounds:
        size *= e - b
    return size


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- communication summary ------------------------------------------------------------------------


@dataclass
class CommRow:
    """Collectives of one kind, group and phase on one rank."""

    kind: str
    group: str
    rank_list: list[int]
    phase: str
    count: int
    bytes: int  # received (plan.json's `bytes`)
    reasons: list[str]
    ring_bytes: int | None = 0  # sent with ring algorithms; None: an older plan.json lacks it


def comm_summary(plan: Plan, rank: int) -> list[CommRow]:
    """Rank `rank`'s communication per step, by (kind, group, phase), in first-seen order.
    `_MirrorOperator`s are left out: they are the identity when run, and the gradient
    AllReduce they cause is a row of its own (docs/plan-json.md)."""
    rows: dict[tuple[str, str, str], CommRow] = {}
    for c in collectives_of(plan, rank):
        if c.op == "_MirrorOperator":
            continue
        key = (c.op, c.group, c.phase)
        row = rows.get(key)
        if row is None:
            row = rows[key] = CommRow(c.op, c.group, list(c.rank_list), c.phase, 0, 0, [])
        row.count += 1
        row.bytes += c.bytes
        row.ring_bytes = (None if row.ring_bytes is None or c.ring_bytes is None
                          else row.ring_bytes + c.ring_bytes)
        if c.reason not in row.reasons:
            row.reasons.append(c.reason)
    return list(rows.values())


def collectives_of(plan: Plan, rank: int) -> list[PlanCollective]:
    if str(rank) not in plan.collectives:
        raise PcompileError(f"rank {rank} was not dumped (dumped: "
                            f"{', '.join(map(str, plan.dump_ranks)) or 'none'}); recompile "
                            f"with --dump-ranks {rank} (or all) to see it")
    return plan.collectives[str(rank)]


def comm_totals(rows: list[CommRow], ring: bool = False) -> dict[str, int]:
    """Bytes per phase and in all (key 'total'): received (plan.json's `bytes`), or with
    `ring` the bytes sent with ring algorithms (`ring_bytes`; {} when the plan lacks them)."""
    totals: dict[str, int] = defaultdict(int)
    for row in rows:
        size = row.ring_bytes if ring else row.bytes
        if size is None:
            return {}
        totals[row.phase] += size
        totals["total"] += size
    return dict(totals)


# -- dumps ----------------------------------------------------------------------------------------


def dump_path(out_dir: str, rank: int, pass_name: str = "execute") -> str:
    """`DIR/rank_<r>/NN_<pass>.ir` (the last pass whose name contains `pass_name`)."""
    folder = os.path.join(out_dir, f"rank_{rank}")
    if not os.path.isdir(folder):
        raise PcompileError(f"{folder} does not exist: rank {rank} was not dumped; recompile "
                            f"with --dump-ranks {rank} (or all)")
    found = sorted(glob.glob(os.path.join(folder, f"*{pass_name}*.ir")))
    if not found:
        have = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.ir")))
        raise PcompileError(f"no dump of a pass named like {pass_name!r} in {folder} (there "
                            f"are: {', '.join(have) or 'none'})")
    return found[-1]


def rank_diff(out_dir: str, ranks: tuple[int, int], pass_name: str = "execute",
              context: int = 1) -> tuple[str, str, list[str]]:
    """Unified diff of two ranks' dumps of one pass: (path a, path b, diff lines)."""
    a, b = (dump_path(out_dir, r, pass_name) for r in ranks)
    with open(a, encoding="utf-8") as fa, open(b, encoding="utf-8") as fb:
        left, right = fa.read().splitlines(), fb.read().splitlines()
    lines = list(difflib.unified_diff(left, right, a, b, n=context, lineterm=""))
    return a, b, lines


def load(out_dir: str) -> Plan:
    """plan.json of `out_dir`, validated (PlanError is a PcompileError: one message)."""
    return read_plan(out_dir)


__all__ = ["Block", "CommRow", "LayoutGrid", "OpRow", "comm_summary", "comm_totals",
           "dump_path", "grid_svg", "layout_grid", "load", "op_rows", "rank_diff",
           "tensor_layouts"]
