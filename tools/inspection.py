"""What `pcompile show` and `pcompile diff` compute from a compile's folder: rows of the strategy
table, how a tensor's blocks are held by the ranks, the communication summary of a rank, and
the difference between two ranks' programs. Pure data (the terminal rendering is
`tools/render.py`); everything is read from `DIR/plan.json` (validated, compiler/driver/plan.py)
and the rank dumps, so it works on a folder compiled elsewhere.
"""

from __future__ import annotations

import difflib
import glob
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pcompile.compiler.driver.plan import Plan, PlanCollective, PlanLayout, read_plan
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
    scope: str  # where the op sits, as a dotted cell path (`model.layers.0.attention.wq`)
    strategy: str
    dev_matrix: str
    tensor_maps: str
    slice_shapes: str
    cost: str  # the op's objective plus its edges' (neighbours fixed); NONE when not searched
    runner_up: str
    via: str


#: Printed where plan.json has no value (never `inf`: a missing number is not an infinite cost).
NONE = "\u2014"


def _num(x: Any) -> str:
    if x is None:
        return NONE
    return f"{float(x):.6g}"


def scope_path(fullname: str) -> str:
    """The cell path of an op's scope as parameter names spell it: `Default/network-Llama/
    model-LlamaModel/layers-CellList/0-LlamaDecodeLayer/MatMul-op0` -> `model.layers.0`
    (`Default` and the network cell itself dropped, each `attribute-Class` its attribute)."""
    parts = fullname.split("/")[:-1]
    if parts and parts[0] == "Default":
        parts = parts[1:]
    if parts and parts[0].startswith("network-"):
        parts = parts[1:]
    return ".".join(part.split("-", 1)[0] for part in parts)


def local_cost(found: Any) -> float | None:
    """What the search minimised for one op: dynamic programming's `local_objective`, else the
    op's own objective plus its edges' redistributions with the neighbours' chosen strategies
    (the same sum; sharding propagation and recursive programming leave `local_objective`
    null). None when plan.json has neither."""
    if found.local_objective is not None:
        return float(found.local_objective)
    terms = [found.cost.get("objective"), found.redistribution.get("objective")]
    if all(t is None for t in terms):
        return None
    return float(sum(t for t in terms if t is not None))


def _terms(item: Any) -> str:
    """Sharding propagation's comparison terms (MindSpore's CompareSwcCost): redistribution
    communication and computation on the deciding edges, then the op's forward communication."""
    values = [("comm", item.communication), ("comp", item.computation), ("fwd", item.forward)]
    if all(v is None for _, v in values):
        return ""
    return " ".join(f"{k} {_num(v)}" for k, v in values)


def _runner_up(found: Any) -> str:
    other = found.runner_up
    if other is None:
        return NONE
    if other.local_objective is not None:
        return f"{fmt_strategy(other.strategy)} {_num(other.local_objective)}"
    terms = _terms(other)
    return f"{fmt_strategy(other.strategy)} {terms}" if terms else fmt_strategy(other.strategy)


def _via(found: Any) -> str:
    via = found.via or found.decided_by or ""
    terms = _terms(found.decision) if found.decision is not None else ""
    return f"{via}: {terms}" if via and terms else via or NONE


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
        user = op.in_strategy is not None and plan.search is not None
        rows.append(OpRow(
            name=name, op=op.op, instance_name=op.instance_name or "-",
            scope=scope_path(name),
            strategy=fmt_strategy(op.in_strategy),
            dev_matrix=str(op.dev_matrix) if op.dev_matrix is not None else "-",
            tensor_maps=" ".join(fmt_map(lay.tensor_map) for lay in layouts) or "-",
            slice_shapes=" ".join("(" + ", ".join(map(str, lay.slice_shape)) + ")"
                                  for lay in layouts) or "-",
            cost=_num(local_cost(found)) if found is not None else NONE,
            runner_up=_runner_up(found) if found is not None else NONE,
            via=_via(found) if found is not None else ("user" if user else NONE),
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
    """An SVG picture of the grid on a white background: one rectangle per block, sized by
    its extent and labelled with the ranks holding it and its slice ranges; dim 0 runs down
    the left side and the other dims along the top, each block's range marked there."""
    shape = grid.shape if grid.shape else (1,)
    rows_total = shape[0]
    cols_extent = [_extent(c) for c in grid.cols]
    cols_total = sum(cols_extent) or 1
    height = max(120, min(480, int(width * rows_total / max(1, cols_total))))
    top = 76.0
    left = float(max(90, 8 * len(f"dim 0 ({shape[0]}) v") + 14))
    total_w, total_h = int(left + width + 10), int(top + height + 10)
    others = (f"dim 1 ({shape[1]})" if len(shape) == 2 else
              f"dims 1-{len(shape) - 1} ({', '.join(map(str, shape[1:]))})" if len(shape) > 2
              else "")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
           f'font-family="monospace" font-size="12">',
           f'<rect class="background" x="0" y="0" width="{total_w}" height="{total_h}" '
           f'fill="white"/>',
           f'<text x="10" y="16">{_esc(grid.name)} {list(grid.shape)}</text>',
           f'<text x="10" y="32">{_esc(grid.layout)} over {grid.devices} ranks</text>']
    if others:
        out.append(f'<text class="dim" x="{left + width / 2:.1f}" y="52" '
                   f'text-anchor="middle">{_esc(others)} \u2192</text>')
    if grid.shape:
        out.append(f'<text class="dim" x="10" y="{top - 6:.1f}">dim 0 ({shape[0]}) '
                   f'\u2193</text>')
    x = left
    for cb, extent in zip(grid.cols, cols_extent):
        w = width * extent / cols_total
        if cb:
            out.append(f'<text class="range" x="{x + w / 2:.1f}" y="{top - 6:.1f}" '
                       f'text-anchor="middle">{_esc(_ranges(cb))}</text>')
        x += w
    y = top
    for r, rb in enumerate(grid.rows):
        h = height * (rb[1] - rb[0]) / max(1, rows_total)
        if grid.shape:
            out.append(f'<text class="range" x="{left - 6:.1f}" y="{y + h / 2 + 4:.1f}" '
                       f'text-anchor="end">{rb[0]}:{rb[1]}</text>')
        x = left
        for c, extent in enumerate(cols_extent):
            w = width * extent / cols_total
            block = grid.cells.get((r, c))
            if block is not None:
                where = _ranges((rb, *grid.cols[c])) if grid.shape else "scalar"
                out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                           f'fill="{block_colour(block.index)}" stroke="black"/>')
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + h / 2 - 2:.1f}" '
                           f'text-anchor="middle">{_esc(rank_label(block.ranks))}</text>')
                out.append(f'<text class="range" x="{x + w / 2:.1f}" y="{y + h / 2 + 12:.1f}" '
                           f'text-anchor="middle">[{_esc(where)}]</text>')
            x += w
        y += h
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _ranges(bounds: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{b}:{e}" for b, e in bounds)


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


@dataclass
class DiffLine:
    """A line of `rank_diff`'s output and, for a changed line paired with its counterpart of
    the other rank, the character spans (of `text`, prefix included) where the two differ."""

    text: str
    marks: list[tuple[int, int]] = field(default_factory=list)


_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")


def differing_spans(left: str, right: str) -> tuple[list[tuple[int, int]],
                                                    list[tuple[int, int]]]:
    """Where two lines differ, token by token (words, numbers, punctuation): the spans of
    each line that the other does not have."""
    a, b = _TOKEN.findall(left), _TOKEN.findall(right)
    start_a = [0]
    for t in a:
        start_a.append(start_a[-1] + len(t))
    start_b = [0]
    for t in b:
        start_b.append(start_b[-1] + len(t))
    spans_a: list[tuple[int, int]] = []
    spans_b: list[tuple[int, int]] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if i2 > i1:
            spans_a.append((start_a[i1], start_a[i2]))
        if j2 > j1:
            spans_b.append((start_b[j1], start_b[j2]))
    return spans_a, spans_b


def marked_diff(lines: list[str]) -> list[DiffLine]:
    """The unified diff `lines` with each removed line followed by the added line that
    replaces it (paired in order within a change, when the two are mostly alike), both
    marked where they differ; other lines as they are."""
    out: list[DiffLine] = []
    i = 0
    while i < len(lines):
        if not _changed(lines[i], "-"):
            out.append(DiffLine(lines[i]))
            i += 1
            continue
        minus, plus = [], []
        while i < len(lines) and _changed(lines[i], "-"):
            minus.append(lines[i])
            i += 1
        while i < len(lines) and _changed(lines[i], "+"):
            plus.append(lines[i])
            i += 1
        paired = 0
        for old, new in zip(minus, plus):
            if difflib.SequenceMatcher(None, old[1:], new[1:]).quick_ratio() < 0.5:
                break
            spans_a, spans_b = differing_spans(old[1:], new[1:])
            out.append(DiffLine(old, [(b + 1, e + 1) for b, e in spans_a]))
            out.append(DiffLine(new, [(b + 1, e + 1) for b, e in spans_b]))
            paired += 1
        out += [DiffLine(line) for line in minus[paired:] + plus[paired:]]
    return out


def _changed(line: str, sign: str) -> bool:
    return line.startswith(sign) and not line.startswith(sign * 3)


def load(out_dir: str) -> Plan:
    """plan.json of `out_dir`, validated (PlanError is a PcompileError: one message)."""
    return read_plan(out_dir)


__all__ = ["Block", "CommRow", "DiffLine", "LayoutGrid", "OpRow", "comm_summary",
           "comm_totals", "differing_spans", "dump_path", "grid_svg", "layout_grid", "load",
           "marked_diff", "op_rows", "rank_diff", "scope_path", "tensor_layouts"]
