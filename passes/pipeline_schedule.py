"""Pipeline schedules: which micro-batch's forward or backward each stage runs at each tick.

A stage's graph (passes/pipeline_split.py) runs in **units**: `F k` (the forward of
micro-batch k), `B k` (its backward). A schedule is each stage's order of units:

* GPipe: F 0 .. F m-1, then B 0 .. B m-1 (every micro-batch's activations are held until the
  backward starts: m micro-batches in flight);
* 1F1B (PipeDream-flush, MindSpore's default): stage s runs w = min(S-1-s, m) forwards, then
  alternates one forward and one backward, then the last w backwards (at most S-s
  micro-batches in flight).

Interleaved (`pipeline_interleave`, v chunks per stage, passes/pipeline_stages.py): a unit is
`F k c` / `B k c`, micro-batch k on chunk c, and a chunk-unit is 1/v of a stage's work. The
forward order takes the micro-batches in groups of S and runs each group through chunk 0, then
chunk 1, ...; the backward order the same with the chunks reversed (Megatron-LM's interleaved
schedule). GPipe runs every forward, then every backward; 1F1B runs
w = min(2(S-1-s) + (v-1)S, m v) forwards, then alternates, then the last w backwards. The ideal
bubble falls to (S-1)/(m v+S-1).

Which unit a node belongs to (`positions`): a node labelled with a micro-batch (`micro: k` in
its parallel annotation; backward when its scope is autodiff's `Gradients/...`) runs in that
micro-batch's unit, or later if an operand is computed later; a node without a label (a weight's
mirror, the loss's mean, the gradient communication and the optimizer update) runs in the first
unit where all its operands exist. So the gradient AllReduce and the update run once, in the
last backward unit.

Ticks (`Schedule.ticks`): every unit takes one tick; a unit starts when the stage's previous
unit is done and every Send it receives from has been sent (the earliest synchronous timing,
the longest path through the unit graph). Both runtimes execute units in tick order, and
`text()` draws the table. The ideal bubble fraction of both schedules is (S-1)/(m+S-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pcompile.ir.core import Graph, Node, NodeResult
from pcompile.ir.errors import PcompileError

Label = tuple[str, int, int]  # ("F" | "B", micro-batch, chunk)

SCHEDULERS = ("1f1b", "gpipe")


def unit_name(label: Label, chunks: int = 1) -> str:
    """`F3` (chunks = 1) or `F3c1`: how dumps, plan.json and the schedule picture name a unit."""
    return f"{label[0]}{label[1]}" if chunks == 1 else f"{label[0]}{label[1]}c{label[2]}"


def parse_unit(text: str) -> Label:
    """The label `unit_name` wrote."""
    micro, _, chunk = text[1:].partition("c")
    return (text[0], int(micro), int(chunk or 0))


def _orders(stages: int, micro: int, chunks: int) -> tuple[list[Label], list[Label]]:
    """Every stage's forward and backward unit orders (module docstring)."""
    forward: list[Label] = []
    backward: list[Label] = []
    for start in range(0, micro, stages):
        group = range(start, min(start + stages, micro))
        forward += [("F", k, c) for c in range(chunks) for k in group]
        backward += [("B", k, c) for c in reversed(range(chunks)) for k in group]
    return forward, backward


def unit_sequence(scheduler: str, stages: int, stage: int, micro: int,
                  chunks: int = 1) -> list[Label]:
    """The order in which `stage` runs its units."""
    forward, backward = _orders(stages, micro, chunks)
    if scheduler == "gpipe":
        return forward + backward
    if scheduler != "1f1b":
        raise ValueError(f"unknown pipeline scheduler {scheduler!r}")
    total = micro * chunks
    if chunks == 1:
        warm = min(stages - 1 - stage, micro)
    else:
        warm = min(2 * (stages - 1 - stage) + (chunks - 1) * stages, total)
    out = forward[:warm]
    for i in range(total - warm):
        out += [forward[warm + i], backward[i]]
    return out + backward[total - warm:]


def node_label(node: Node) -> Label | None:
    """A node's unit label: its `micro` (and `chunk`) annotation, backward under autodiff's
    scope."""
    info = node.parallel
    if info is None or info.micro is None:
        return None
    phase = "B" if node.scope.startswith("Gradients") else "F"
    return (phase, info.micro, info.chunk or 0)


def positions(graph: Graph, sequence: list[Label]) -> dict[Node, int]:
    """node -> index in `sequence` of the unit that runs it (see the module docstring)."""
    index = {label: i for i, label in enumerate(sequence)}
    out: dict[Node, int] = {}
    free: set[Node] = set()  # unlabelled, reading no labelled node: placed by their users
    for node in graph.nodes:
        label = node_label(node)
        pos = index[label] if label is not None else 0
        bound = label is not None
        for value in node.operands:
            if isinstance(value, NodeResult):
                pos = max(pos, out[value.node])
                bound = bound or value.node not in free
        if node.op == "TupleGetItem" and isinstance(node.operands[0], NodeResult):
            # an element of a multi-output op (RmsNorm's rstd read by its backward) is taken
            # where the op runs: the element, not the tuple, is what a later unit holds
            pos = out[node.operands[0].node]
        out[node] = pos
        if not bound:
            free.add(node)
    # A node that depends on no micro-batch (a weight's mirror or cast, a constant, the
    # optimizer's work on its state) runs in the unit of its first user, not the first unit:
    # it is not held longer than needed. A Send of such a value (a constant mask another stage
    # reads) has no user here: it runs in the first unit, before any unit of the stage that
    # receives it can wait on it.
    last = len(sequence) - 1
    for node in reversed(graph.nodes):
        if node in free:
            users = [out[u] for u in node.result.users if u in out]
            out[node] = min(users) if users else 0 if node.op == "Send" else last
    return out


def order_by_units(graph: Graph, sequence: list[Label]) -> None:
    """Reorder `graph`'s nodes unit by unit (stable: a topological order stays one)."""
    pos = positions(graph, sequence)
    graph.reorder(sorted(graph.nodes, key=lambda n: pos[n]))


@dataclass
class StageUnits:
    """One stage's units: their labels in order, the tick each runs at, and the nodes of each
    (indices into the stage graph's node list)."""

    stage: int
    sequence: list[Label]
    ticks: list[int] = field(default_factory=list)
    nodes: list[list[int]] = field(default_factory=list)


@dataclass
class Schedule:
    """Every stage's units and ticks, the peak activation memory of both schedules, and the
    table `text()` draws."""

    scheduler: str
    stages: int
    micro: int
    devices_per_stage: int
    units: list[StageUnits]
    held_bytes: dict[str, list[int]] = field(default_factory=dict)
    in_flight: dict[str, list[int]] = field(default_factory=dict)
    chunks: int = 1

    @property
    def num_ticks(self) -> int:
        return 1 + max((t for u in self.units for t in u.ticks), default=-1)

    @property
    def bubble(self) -> float:
        """Idle stage-ticks over all stage-ticks."""
        busy = sum(len(u.ticks) for u in self.units)
        return 1.0 - busy / float(self.num_ticks * self.stages) if self.num_ticks else 0.0

    @property
    def ideal_bubble(self) -> float:
        """(S-1)/(m v+S-1), v = chunks."""
        return (self.stages - 1) / float(self.micro * self.chunks + self.stages - 1)

    def grid(self) -> list[list[str]]:
        """grid[stage][tick]: "F3", "B0" (or "F3c1" interleaved) or "" (idle)."""
        rows = [[""] * self.num_ticks for _ in self.units]
        for u in self.units:
            for label, tick in zip(u.sequence, u.ticks):
                rows[u.stage][tick] = unit_name(label, self.chunks)
        return rows

    def text(self) -> str:
        """The schedule as a table (stages down, ticks across) with the bubble and memory."""
        rows = self.grid()
        width = max(3, max((len(c) for r in rows for c in r), default=2) + 1)
        head = "tick     " + "".join(f"{t:<{width}}" for t in range(self.num_ticks))
        if self.chunks == 1:
            title = (f"pipeline schedule: {self.scheduler}, {self.stages} stages x "
                     f"{self.devices_per_stage} device(s), {self.micro} micro-batch(es) per "
                     "step (Fk: forward of micro-batch k, Bk: its backward; . idle)")
        else:
            title = (f"pipeline schedule: {self.scheduler} interleaved, {self.stages} stages x "
                     f"{self.devices_per_stage} device(s), {self.chunks} chunks per stage, "
                     f"{self.micro} micro-batch(es) per step (Fkcg: forward of micro-batch k "
                     "on chunk g, Bkcg: its backward; . idle)")
        lines = [title, head.rstrip()]
        for s, row in enumerate(rows):
            cells = "".join(f"{(c or '.'):<{width}}" for c in row)
            lines.append(f"stage {s:<3}{cells}".rstrip())
        formula = "(S-1)/(m+S-1)" if self.chunks == 1 else "(S-1)/(m*v+S-1)"
        lines.append(f"bubble: {self.bubble:.1%} of stage-ticks idle (ideal {formula} = "
                     f"{self.ideal_bubble:.1%})")
        what = "mb" if self.chunks == 1 else "chunk-units"
        for name in sorted(self.held_bytes):
            held = ", ".join(f"{_mib(b)} ({n} {what})" for b, n in
                             zip(self.held_bytes[name], self.in_flight[name]))
            lines.append(f"activation memory per stage, {name}: {held}")
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    if nbytes < 1 << 20:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def _units(graph: Graph, sequence: list[Label]) -> list[list[int]]:
    pos = positions(graph, sequence)
    out: list[list[int]] = [[] for _ in sequence]
    for i, node in enumerate(graph.nodes):
        out[pos[node]].append(i)
    return out


def held(graph: Graph, sequence: list[Label]) -> tuple[int, int]:
    """Peak bytes of the activations held: values computed in a forward unit and read in a
    later unit (not the parameters, nor the gradient sums of the backward units, which both
    schedules hold alike), and the peak number of micro-batches whose forward ran and
    backward did not."""
    pos = positions(graph, sequence)
    last: dict[Node, int] = {}
    for node in graph.nodes:
        for value in node.operands:
            if isinstance(value, NodeResult):
                key = value.node
                last[key] = max(last.get(key, 0), pos[node])
    delta = [0] * (len(sequence) + 2)  # delta[i]: change of what is held when unit i starts
    for node in graph.nodes:
        first, end = pos[node], last.get(node, pos[node])
        if end > first and sequence[first][0] == "F":
            nbytes = _nbytes(node)
            delta[first + 1] += nbytes
            delta[end + 1] -= nbytes
    peak = live = 0
    for d in delta[:len(sequence)]:
        live += d
        peak = max(peak, live)
    flight = open_ = 0
    for label in sequence:
        open_ += 1 if label[0] == "F" else -1
        flight = max(flight, open_)
    return peak, flight


def _nbytes(node: Node) -> int:
    types = getattr(node.result.type, "elements", None) or (node.result.type,)
    return sum(int(getattr(t, "nbytes", 0)) for t in types)


def schedule(graphs: list[Graph], scheduler: str, micro: int, devices_per_stage: int,
             chunks: int = 1) -> Schedule:
    """The ticks of every unit of the stage graphs `graphs` (one per stage) under `scheduler`,
    and both schedules' activation memory. PcompileError when the transfers between stages
    form a cycle that no order of units can run."""
    stages = len(graphs)
    units = []
    for s, graph in enumerate(graphs):
        seq = unit_sequence(scheduler, stages, s, micro, chunks)
        units.append(StageUnits(s, seq, [-1] * len(seq), _units(graph, seq)))
    sends: dict[int, tuple[int, int]] = {}
    receives: list[tuple[int, int, int]] = []
    for s, (graph, u) in enumerate(zip(graphs, units)):
        for i, members in enumerate(u.nodes):
            for k in members:
                node = graph.nodes[k]
                if node.op == "Send":
                    sends[int(node.attrs["sr_tag"])] = (s, i)
                elif node.op == "Receive":
                    receives.append((int(node.attrs["sr_tag"]), s, i))
    deps: dict[tuple[int, int], set[tuple[int, int]]] = {
        (s, i): ({(s, i - 1)} if i else set()) for s, u in enumerate(units)
        for i in range(len(u.sequence))}
    for tag, s, i in receives:
        if tag not in sends:
            raise PcompileError(f"pipeline: Receive sr_tag {tag} in stage {s} has no Send")
        deps[(s, i)].add(sends[tag])
    done: dict[tuple[int, int], int] = {}
    pending = set(deps)
    while pending:
        ready = sorted(k for k in pending if deps[k] <= done.keys())
        if not ready:
            stuck = sorted(pending)[0]
            raise PcompileError(
                f"pipeline schedule {scheduler}: stage {stuck[0]}'s unit "
                f"{unit_name(units[stuck[0]].sequence[stuck[1]], chunks)} waits on data that "
                "is only sent after it (a cycle between stages); report the model")
        for unit in ready:
            done[unit] = max((done[d] + 1 for d in deps[unit]), default=0)
            pending.discard(unit)
    for (s, i), tick in done.items():
        units[s].ticks[i] = tick
    out = Schedule(scheduler, stages, micro, devices_per_stage, units, chunks=chunks)
    for name in SCHEDULERS:
        peaks = [held(g, unit_sequence(name, stages, s, micro, chunks))
                 for s, g in enumerate(graphs)]
        out.held_bytes[name] = [p for p, _ in peaks]
        out.in_flight[name] = [f for _, f in peaks]
    return out
