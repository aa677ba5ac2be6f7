"""Terminal rendering of `pcompile show` and `pcompile diff` with rich (tables, the layout grid
in the style of `jax.debug.visualize_array_sharding`, a coloured diff). The numbers come from
`tools/inspection.py`; this module only draws them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rich import box
from rich.cells import cell_len
from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from pcompile.compiler.driver.outdir import record_shown, write_file_atomic
from pcompile.compiler.driver.plan import Plan
from pcompile.ir.errors import PcompileError
from pcompile.tools import inspection


def console(no_color: bool = False, width: int | None = None) -> Console:
    """stdout; colours only on a terminal (rich's own detection; NO_COLOR is honoured). `width`
    (show's --width) sets the width of the lines; else `pipe_width()` when stdout is not a
    terminal (rich would cut them at 80), and the terminal's own width when it is."""
    if width is None and not Console().is_terminal:
        width = pipe_width()
    return Console(no_color=no_color or None, highlight=False, soft_wrap=False, width=width)


#: Width of show's output when stdout is not a terminal and neither COLUMNS nor a terminal on
#: stdin or stderr says how wide the screen is (a file, a pipe in a script).
PIPE_WIDTH = 160


def pipe_width(environ: dict[str, str] | None = None) -> int:
    """The width for output that does not go to a terminal: COLUMNS when it holds a number;
    else the width of the terminal on stderr or stdin (`pcompile show DIR | less` pages on the
    screen the user types at); else `PIPE_WIDTH`."""
    columns = (os.environ if environ is None else environ).get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return max(MIN_WIDTH, int(columns))
    for fd in (2, 0):
        try:
            if os.isatty(fd):
                return max(MIN_WIDTH, os.get_terminal_size(fd).columns or PIPE_WIDTH)
        except OSError:
            continue
    return PIPE_WIDTH


#: The narrowest layout of show's tables (its --width accepts no less).
MIN_WIDTH = 40


def header(plan: Plan, out_dir: str) -> Text:
    search = f", search {plan.search_mode}" if plan.search_mode else ""
    what = "training step" if plan.training else "inference"
    return Text.assemble((f"{out_dir}", "bold"), f": {plan.parallel_mode}{search}, "
                         f"{plan.devices} device(s), {what}; {len(plan.ops)} ops, "
                         f"{len(plan.parameters)} parameters")


def prediction_text(prediction: dict | None, search: dict | None = None,
                    megatron: dict | None = None) -> list[tuple[str, str]]:
    """The plan's prediction (plan.json `prediction`), the ilp search's choices and the bytes
    against Megatron-LM's minimum (`megatron_minimum`), a line each as (text, style): what the
    compile prints and `pcompile show` draws. Nothing for a plan without a prediction."""
    p = prediction
    if not p:
        return []
    m = p["memory"]
    unit, scale = ("GB", 1e9) if m["total"] >= 1e8 else ("MB", 1e6)
    lines = [(f"predicted on {p['device_profile']}: step {p['step_time'] * 1e3:.3f} ms "
              f"(compute {p['compute'] * 1e3:.3f}, communication "
              f"{p['communication'] * 1e3:.3f}), {p['communication_bytes'] / 1e6:.1f} MB moved "
              f"per rank; memory per rank {m['total'] / scale:.2f} {unit} of "
              f"{p['device_memory'] / 1e9:.2f} GB (weights {m['weights'] / scale:.2f}, gradients "
              f"{m['gradients'] / scale:.2f}, optimizer {m['optimizer'] / scale:.2f}, "
              f"activations {m['activations'] / scale:.2f})"
              + ("" if p["fits"] else ": does NOT fit"), "")]
    if p.get("advice"):
        lines.append((p["advice"], "yellow"))
    search = search or {}
    if search.get("mode") == "ilp" and "mesh" in search:
        ilp = search.get("ilp") or {}
        folded = ", ".join(f"{n} of {k.rsplit('/', 1)[-1]}"
                           for k, n in (ilp.get("folded_layers") or {}).items()) or "none"
        lines.append((
            f"search ilp: mesh data {search['mesh']['data']} x model {search['mesh']['model']}"
            + (f" (expert axis {search['mesh']['expert']} of data)"
               if search["mesh"].get("expert") else "") + ", "
            f"parallel optimizer {'on' if search['parallel_optimizer'] else 'off'}, recompute "
            f"{'on' if search['recompute'] else 'off'}; {ilp.get('solves')} solves of up to "
            f"{ilp.get('variables')} variables, layers solved once: {folded}", ""))
    if megatron:
        parts = []
        own, best = megatron.get("scheme"), megatron.get("best_scheme")
        if own is not None and megatron.get("ratio") is not None:
            parts.append(f"{megatron['ratio']:.3f}x Megatron-LM's minimum at {_scheme(own)}")
        if best is not None and megatron.get("ratio_to_best") is not None:
            parts.append(f"{megatron['ratio_to_best']:.3f}x its least ({_scheme(best)})")
        lines.append((f"bytes: rank {megatron['rank']} sends {megatron['ring_bytes'] / 1e6:.2f} "
                      "MB per step (ring), " + ", ".join(parts), ""))
    return lines


def _scheme(s: dict) -> str:
    vocab = ("vocabulary split" if s["embedding_split"] and s["head_split"]
             else "head split" if s["head_split"] else "vocabulary whole")
    return (f"dp {s['dp']} x mp {s['mp']}, {vocab}"
            + (", sequence parallel" if s["seq_parallel"] else ""))


def prediction_lines(plan: Plan) -> list[Text]:
    """`prediction_text` of a plan.json, as rich Text ("predicted" in bold)."""
    dump = (lambda x: x.model_dump() if x is not None else None)
    search = plan.search.model_dump() if plan.search is not None else None
    lines = []
    for i, (text, style) in enumerate(prediction_text(dump(plan.prediction), search,
                                                      dump(plan.megatron_minimum))):
        if i == 0:
            head, rest = text.split(" ", 1)
            lines.append(Text.assemble((head, "bold"), " " + rest))
        else:
            lines.append(Text(text, style=style))
    return lines


# -- tables that fit the terminal -----------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A column of a table that `fitted_table` lays out for the terminal. Names are never
    wrapped, cut or dropped, and numbers never wrapped. The other columns wrap (folding words
    with no space, such as a dotted scope) and come in order of `drop`, lowest first: an
    essential one while it fits at `floor` characters, any other while all columns so far fit
    at their `ideal` width (or their content's, when narrower); the first that does not
    ends the table."""

    header: str
    drop: int = 0  # 0: a name, never dropped; otherwise the higher, the sooner it goes
    floor: int = 10
    ideal: int = 16
    name: bool = False
    number: bool = False
    essential: bool = False
    style: str | None = None


def _cell_width(text: str) -> int:
    return max((cell_len(line) for line in text.splitlines()), default=0)


def fitted_table(title: str, columns: list[Column], rows: list[list[str]],
                 width: int) -> Table:
    """A rich table of `rows` no wider than `width` (when its names allow): the columns that
    do not fit are left out and named in the caption."""
    natural = [max([cell_len(c.header) if c.name or c.number
                    else max(map(cell_len, c.header.split()), default=0)]
                   + [_cell_width(row[i]) for row in rows]) for i, c in enumerate(columns)]
    fixed = [c.name or c.number for c in columns]
    least = [n if f else min(n, c.floor) for c, n, f in zip(columns, natural, fixed)]
    ideal = [n if f else min(n, max(c.ideal, c.floor)) for c, n, f in zip(columns, natural, fixed)]

    def span(widths: list[int], which: list[int]) -> int:
        # a column costs its width, 2 of padding and 1 of border; the table 1 more border
        return sum(widths[i] + 3 for i in which) + 1

    kept = [i for i, c in enumerate(columns) if c.drop == 0]
    for i in sorted((i for i, c in enumerate(columns) if c.drop > 0),
                    key=lambda i: columns[i].drop):
        if columns[i].essential:
            essentials = [k for k in kept if columns[k].essential or columns[k].drop == 0]
            if span(least, [*essentials, i]) > width:
                break
        elif span(ideal, [*kept, i]) > width:
            break
        kept.append(i)
    kept.sort()
    table = Table(title=title, title_justify="left")
    for i in kept:
        c = columns[i]
        table.add_column(c.header, style=c.style, no_wrap=fixed[i],
                         justify="right" if c.number else "left",
                         overflow="ignore" if c.name else "fold", min_width=least[i])
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    hidden = [columns[i].header for i in range(len(columns)) if i not in kept]
    if hidden:
        table.caption = (f"not shown at {width} columns: {', '.join(hidden)} (a wider "
                         "terminal or --width shows them)")
        table.caption_justify = "left"
    return table


def strategy_table(rows: list[inspection.OpRow], searched: bool, width: int = PIPE_WIDTH
                   ) -> Table:
    """Every op's strategy; at narrow widths the layout columns, then the search's, go first
    (op and instance names always stay whole)."""
    columns = [Column("op", name=True), Column("instance", name=True, style="bold"),
               Column("strategy", 1, 12, 28, essential=True, style="cyan"),
               Column("scope", 2, 12, 32, essential=True),
               Column("slice shapes", 5, 10), Column("device matrix", 6, 8),
               Column("tensor maps", 7, 10)]
    if searched:
        columns += [Column("cost", 3, number=True), Column("runner-up", 8, 12, 28),
                    Column("chosen via", 4, 12, 24)]
    cells = []
    for r in rows:
        row = [r.op, r.instance_name, r.strategy, r.scope or "-", r.slice_shapes,
               r.dev_matrix, r.tensor_maps]
        if searched:
            row += [r.cost, r.runner_up, r.via]
        cells.append(row)
    return fitted_table("strategies", columns, cells, width)


def weights_table(plan: Plan, width: int = PIPE_WIDTH) -> Table:
    """Every weight and its layout (the grids below draw some of them)."""
    columns = [Column("weight", name=True, style="bold"),
               Column("slice shape", 1, 8, essential=True), Column("shape", 2, 8),
               Column("device matrix", 3, 8), Column("tensor map", 4, 8)]
    rows = [[name, str(p.slice_shape), str(p.shape), str(p.dev_matrix),
             inspection.fmt_map(p.tensor_map)]
            for name, p in plan.parameters.items() if p.kind == "weight"]
    return fitted_table(f"weights ({len(rows)})", columns, rows, width)


def grid_table(grid: inspection.LayoutGrid, highlight: int | None = None) -> Group:
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
    title = Text(f"{grid.name} {list(grid.shape)}: {grid.layout}", style="bold",
                 overflow="fold")
    return Group(title, table)


def comm_table(rows: list[inspection.CommRow], rank: int, width: int = PIPE_WIDTH) -> Table:
    """Rank `rank`'s communication per step: bytes it receives and bytes it sends (ring
    algorithms; a Send's bytes are sent, a Receive's received)."""
    columns = [Column("collective", name=True, style="bold"),
               Column("phase", 1, 8, essential=True), Column("count", number=True),
               Column("received", number=True), Column("sent", number=True),
               Column("ranks", 3, 5), Column("why", 4, 20, 60), Column("group", 5, 12, 24)]
    cells = []
    for r in rows:
        shown = r.reasons[:MAX_REASONS]
        more = len(r.reasons) - len(shown)
        why = "\n".join(shown) + (f"\n(+{more} more)" if more > 0 else "")
        cells.append([r.kind, r.phase, str(r.count), f"{r.bytes:,}",
                      "?" if r.ring_bytes is None else f"{r.ring_bytes:,}",
                      ",".join(map(str, r.rank_list)), why, r.group])
    table = fitted_table(f"communication of rank {rank}, per step", columns, cells, width)
    received = inspection.comm_totals(rows)
    sent = inspection.comm_totals(rows, ring=True)
    total = (f"total {received.get('total', 0):,} bytes per step received"
             + _phase_parts(received) + "; "
             + (f"{sent.get('total', 0):,} sent with ring algorithms" + _phase_parts(sent)
                if sent or not rows else "ring bytes not in this plan.json (recompile)"))
    table.caption = total + ("\n" + str(table.caption) if table.caption else "")
    table.caption_justify = "left"
    return table


def _phase_parts(totals: dict[str, int]) -> str:
    parts = [f"{phase} {totals[phase]:,}" for phase in ("forward", "backward", "optimizer")
             if phase in totals]
    return f" ({', '.join(parts)})" if parts else ""


#: Distinct reasons listed per row of the communication table.
MAX_REASONS = 4


def show(out_dir: str, *, rank: int | None = None, op: str | None = None,
         tensors: tuple[str, ...] = (), svg: bool = True, all_weights: bool = False,
         out: Console | None = None) -> list[str]:
    """`pcompile show DIR [--rank R] [--op NAME] [--tensor T] [--all-weights]`; returns the
    SVG files written."""
    out = out or console()
    width = out.width
    plan = inspection.load(out_dir)
    out.print(header(plan, out_dir))
    for line in prediction_lines(plan):
        out.print(line, overflow="fold")
    rows = inspection.op_rows(plan, op)
    if op and not rows:
        names = sorted({o.instance_name for o in plan.ops.values() if o.instance_name})
        raise PcompileError(f"no op named {op!r} in {out_dir}/plan.json; ops: "
                            f"{', '.join(names)}")
    out.print(strategy_table(rows, plan.search is not None, width))
    layouts = inspection.tensor_layouts(plan)
    if not op and not tensors:
        out.print(Padding(weights_table(plan, width), (1, 0, 0, 0)))
    chosen, note = _tensors(plan, layouts, op, tensors, out_dir, all_weights)
    grids = [inspection.layout_grid(name, lay, plan.devices) for name, lay in chosen]
    if grids:
        out.print(Padding(Group(*(grid_table(g, rank) for g in grids)), (1, 0, 0, 0)))
    if note:
        out.print(note)
    written: list[str] = []
    if svg and grids:
        written = _write_svgs(out_dir, [(label, inspection.grid_svg(g))
                                        for (label, _), g in zip(chosen, grids)])
        folder = os.path.join(out_dir, "show")
        out.print(Text(f"layout pictures: {len(written)} written to {folder}/: "
                       + ", ".join(os.path.basename(p) for p in written)), overflow="fold")
    if plan.pipeline is not None:
        from pcompile.compiler.driver.pipelining import schedule_from_plan

        out.print(Text(schedule_from_plan(plan.pipeline).text()), overflow="ignore", crop=False)
    which = rank if rank is not None else (plan.dump_ranks[0] if plan.dump_ranks else None)
    if which is None:
        out.print("communication: no rank was dumped (--dump-ranks none)")
    elif plan.devices > 1:
        out.print(comm_table(inspection.comm_summary(plan, which), which, width))
    return written


def _tensors(plan: Plan, layouts: dict, op: str | None, tensors: tuple[str, ...],
             out_dir: str, all_weights: bool
             ) -> tuple[list[tuple[str, inspection.PlanLayout]], str]:
    """The tensors to draw, each with a label unique in the plan (it names its picture), and
    a line saying what was left out, if anything."""
    if tensors:
        missing = [t for t in tensors if t not in layouts]
        if missing:
            raise PcompileError(f"no parameter named {', '.join(missing)} in {out_dir}/"
                                f"plan.json; parameters: {', '.join(layouts)}")
        return [(t, layouts[t]) for t in tensors], ""
    if op:  # the inputs of every op it names, each op by its scope
        matched = [(name, entry) for name, entry in plan.ops.items()
                   if inspection.matches(name, entry.instance_name, op) and entry.in_layouts]
        labels = [_op_label(name, entry.instance_name) for name, entry in matched]
        picked = []
        for (name, entry), label in zip(matched, labels):
            if labels.count(label) > 1:  # same scope and instance name: add the op's own name
                label += f" ({name.rsplit('/', 1)[-1]})"
            ins = entry.in_layouts or []  # non-empty: `matched` keeps ops with in_layouts
            picked += [(f"{label} input {i}", lay) for i, lay in enumerate(ins)]
        return picked, ""
    weights = [(n, layouts[n]) for n, p in plan.parameters.items() if p.kind == "weight"]
    if all_weights or len(weights) <= MAX_GRIDS:
        return weights, ""
    return weights[:MAX_GRIDS], (
        f"layout grids of the first {MAX_GRIDS} of {len(weights)} weights (all are listed "
        "above); --tensor NAME draws one, --all-weights all of them")


def _op_label(name: str, instance_name: str) -> str:
    scope = inspection.scope_path(name)
    instance = instance_name or name.rsplit("/", 1)[-1]
    return f"{scope}.{instance}" if scope else instance


#: `show` without --tensor or --all-weights draws the first this many weights.
MAX_GRIDS = 8


def _write_svgs(out_dir: str, pictures: list[tuple[str, str]]) -> list[str]:
    """DIR/show/<label>.svg per picture (one file per label: a name that a label's safe
    spelling already took gets -2, -3, ...), listed in DIR/show/.pcompile-show.json so that a
    recompile drops them (compiler/driver/outdir.py)."""
    folder = os.path.join(out_dir, "show")
    if os.path.islink(folder):
        raise PcompileError(f"{folder} is a symbolic link; pcompile show writes its pictures "
                            "into a folder of its own: remove the link")
    os.makedirs(folder, exist_ok=True)
    taken: set[str] = set()
    written: dict[str, bytes] = {}
    paths = []
    for label, text in pictures:
        safe = "".join(ch if ch.isascii() and (ch.isalnum() or ch in "._-") else "_"
                       for ch in label).lstrip(".")
        stem, k = safe or "tensor", 1
        while f"{stem}.svg" in taken:
            k += 1
            stem = f"{safe}-{k}"
        taken.add(f"{stem}.svg")
        data = text.encode("utf-8")
        path = os.path.join(folder, f"{stem}.svg")
        write_file_atomic(path, data)
        written[f"show/{stem}.svg"] = data
        paths.append(path)
    record_shown(out_dir, written)
    return paths


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
    for entry in inspection.marked_diff(lines):
        line = entry.text
        style = ("bold" if line.startswith(("+++", "---")) else "green" if line.startswith("+")
                 else "red" if line.startswith("-") else "cyan" if line.startswith("@@") else "")
        text = Text(line, style=style)
        for begin, end in entry.marks:
            text.stylize("reverse bold", begin, end)
        out.print(text, overflow="ignore", crop=False)
        if entry.marks:  # where it differs, visible without colours too (as ndiff's `?` lines)
            guide = [" "] * max(e for _, e in entry.marks)
            for begin, end in entry.marks:
                guide[begin:end] = "^" * (end - begin)
            out.print(Text("?" + "".join(guide)[1:], style="yellow"), overflow="ignore",
                      crop=False)
    out.print(f"{changed} line(s) differ between rank {ranks[0]} and rank {ranks[1]} "
              f"({os.path.basename(a)})")
    return changed
