"""Terminal rendering of `pcompile show` and `pcompile diff` with rich (tables, the layout grid
in the style of `jax.debug.visualize_array_sharding`, a coloured diff). The numbers come from
`compiler/inspection.py`; this module only draws them."""

from __future__ import annotations

import os

from rich import box
from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pcompile.compiler import inspection
from pcompile.compiler.plan import Plan


def console(no_color: bool = False) -> Console:
    """stdout; colours only on a terminal (rich's own detection; NO_COLOR is honoured). Not
    on a terminal, lines are up to `PIPE_WIDTH` wide (rich would cut them at 80)."""
    probe = Console()
    width = None if probe.is_terminal else max(PIPE_WIDTH, probe.width)
    return Console(no_color=no_color or None, highlight=False, soft_wrap=False, width=width)


#: Width of show's output when stdout is not a terminal (COLUMNS, when set, if wider).
PIPE_WIDTH = 160


def header(plan: Plan, out_dir: str) -> Text:
    search = f", search {plan.search_mode}" if plan.search_mode else ""
    what = "training step" if plan.training else "inference"
    return Text.assemble((f"{out_dir}", "bold"), f": {plan.parallel_mode}{search}, "
                         f"{plan.devices} device(s), {what}; {len(plan.ops)} ops, "
                         f"{len(plan.parameters)} parameters")


def strategy_table(rows: list[inspection.OpRow], searched: bool) -> Table:
    table = Table(title="strategies", title_justify="left", show_lines=False)
    table.add_column("op")
    table.add_column("instance", style="bold")
    table.add_column("strategy", style="cyan", no_wrap=True)
    table.add_column("device matrix", no_wrap=True)
    table.add_column("tensor maps", no_wrap=True)
    table.add_column("slice shapes", no_wrap=True)
    if searched:
        table.add_column("cost", justify="right", no_wrap=True)
        table.add_column("runner-up (cost)", no_wrap=True)
        table.add_column("chosen via")
    for r in rows:
        cells = [r.op, r.instance_name, r.strategy, r.dev_matrix, r.tensor_maps, r.slice_shapes]
        if searched:
            cells += [r.cost, r.runner_up, r.via]
        table.add_row(*cells)
    return table


def grid_table(grid: inspection.LayoutGrid, highlight: int | None = None) -> Panel:
    """The blocks of a tensor in a grid: rows are dim-0 blocks, columns the other dims'."""
    table = Table(show_header=False, show_lines=True, box=box.SQUARE, padding=(0, 1))
    for _ in grid.cols:
        table.add_column(justify="center", min_width=10)
    for r, rb in enumerate(grid.rows):
        cells = []
        for c, cb in enumerate(grid.cols):
            block = grid.cells.get((r, c))
            if block is None:
                cells.append(Text(""))
                continue
            where = ", ".join(f"{b}:{e}" for b, e in (rb, *cb)) if grid.shape else "scalar"
            ranks = inspection.rank_label(block.ranks)
            style = f"black on {inspection.block_colour(block.index)}"
            if highlight is not None and highlight in block.ranks:
                style += " bold underline"
            cells.append(Text(f"{ranks}\n[{where}]", style=style, justify="center"))
        table.add_row(*cells)
    title = f"{grid.name} {list(grid.shape)}: {grid.layout}"
    return Panel(table, title=title, title_align="left", expand=False)


def comm_table(rows: list[inspection.CommRow], rank: int) -> Table:
    table = Table(title=f"communication of rank {rank}, per step", title_justify="left")
    table.add_column("collective", style="bold")
    table.add_column("group", no_wrap=True)
    table.add_column("ranks")
    table.add_column("phase")
    table.add_column("count", justify="right")
    table.add_column("bytes", justify="right", no_wrap=True)
    table.add_column("ring sent", justify="right", no_wrap=True)
    table.add_column("why", ratio=1)
    for r in rows:
        shown = r.reasons[:MAX_REASONS]
        more = len(r.reasons) - len(shown)
        why = "\n".join(shown) + (f"\n(+{more} more)" if more > 0 else "")
        table.add_row(r.kind, r.group, ",".join(map(str, r.rank_list)), r.phase,
                      str(r.count), f"{r.bytes:,}",
                      "?" if r.ring_bytes is None else f"{r.ring_bytes:,}", why)
    received = inspection.comm_totals(rows)
    sent = inspection.comm_totals(rows, ring=True)
    table.caption = (f"total {received.get('total', 0):,} bytes per step received"
                     + _phase_parts(received) + "; "
                     + (f"{sent.get('total', 0):,} sent with ring algorithms" + _phase_parts(sent)
                        if sent or not rows else "ring bytes not in this plan.json (recompile)"))
    table.caption_justify = "left"
    return table


def _phase_parts(totals: dict[str, int]) -> str:
    parts = [f"{phase} {totals[phase]:,}" for phase in ("forward", "backward", "optimizer")
             if phase in totals]
    return f" ({', '.join(parts)})" if parts else ""


#: Distinct reasons listed per row of the communication table.
MAX_REASONS = 4


def show(out_dir: str, *, rank: int | None = None, op: str | None = None,
         tensors: tuple[str, ...] = (), svg: bool = True, out: Console | None = None) -> list[str]:
    """`pcompile show DIR [--rank R] [--op NAME] [--tensor T]`; returns the SVG files written."""
    out = out or console()
    plan = inspection.load(out_dir)
    out.print(header(plan, out_dir))
    rows = inspection.op_rows(plan, op)
    if op and not rows:
        names = sorted({o.instance_name for o in plan.ops.values() if o.instance_name})
        from pcompile.ir.errors import PcompileError

        raise PcompileError(f"no op named {op!r} in {out_dir}/plan.json; ops: "
                            f"{', '.join(names)}")
    out.print(strategy_table(rows, plan.search is not None))
    layouts = inspection.tensor_layouts(plan)
    chosen = _tensors(plan, layouts, op, tensors, out_dir)
    written: list[str] = []
    grids = []
    for name, lay in chosen:
        grid = inspection.layout_grid(name, lay, plan.devices)
        grids.append(grid_table(grid, rank))
        if svg:
            written.append(_write_svg(out_dir, name, inspection.grid_svg(grid)))
    if grids:
        out.print(Padding(Group(*grids), (1, 0, 0, 0)))
    if written:
        out.print(f"layout pictures: {', '.join(written)}")
    if plan.pipeline is not None:
        from pcompile.compiler.pipelining import schedule_from_plan

        out.print(Text(schedule_from_plan(plan.pipeline).text()), overflow="ignore", crop=False)
    which = rank if rank is not None else (plan.dump_ranks[0] if plan.dump_ranks else None)
    if which is None:
        out.print("communication: no rank was dumped (--dump-ranks none)")
    elif plan.devices > 1:
        out.print(comm_table(inspection.comm_summary(plan, which), which))
    return written


def _tensors(plan: Plan, layouts: dict, op: str | None, tensors: tuple[str, ...],
             out_dir: str) -> list[tuple[str, inspection.PlanLayout]]:
    from pcompile.ir.errors import PcompileError

    if tensors:
        missing = [t for t in tensors if t not in layouts]
        if missing:
            raise PcompileError(f"no parameter named {', '.join(missing)} in {out_dir}/"
                                f"plan.json; parameters: {', '.join(layouts)}")
        return [(t, layouts[t]) for t in tensors]
    if op:  # the op's inputs
        picked = []
        for name, entry in plan.ops.items():
            if inspection.matches(name, entry.instance_name, op) and entry.in_layouts:
                label = entry.instance_name or name
                picked += [(f"{label} input {i}", lay) for i, lay in enumerate(entry.in_layouts)]
        return picked
    weights = [(n, layouts[n]) for n, p in plan.parameters.items() if p.kind == "weight"]
    return weights[:MAX_GRIDS]


#: `show` without --tensor draws the first this many weights.
MAX_GRIDS = 8


def _write_svg(out_dir: str, name: str, text: str) -> str:
    folder = os.path.join(out_dir, "show")
    os.makedirs(folder, exist_ok=True)
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name)
    path = os.path.join(folder, f"{safe}.svg")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def diff(out_dir: str, ranks: tuple[int, int], pass_name: str = "execute",
         out: Console | None = None) -> int:
    """`pcompile diff DIR --ranks A,B`: the lines where two ranks' programs differ; returns the
    number of changed lines."""
    out = out or console()
    a, b, lines = inspection.rank_diff(out_dir, ranks, pass_name)
    changed = sum(1 for line in lines if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    if not lines:
        out.print(f"rank {ranks[0]} and rank {ranks[1]} run the same {os.path.basename(a)}")
        return 0
    for line in lines:
        style = ("bold" if line.startswith(("+++", "---")) else "green" if line.startswith("+")
                 else "red" if line.startswith("-") else "cyan" if line.startswith("@@") else "")
        out.print(Text(line, style=style), overflow="ignore", crop=False)
    out.print(f"{changed} line(s) differ between rank {ranks[0]} and rank {ranks[1]} "
              f"({os.path.basename(a)})")
    return changed
