"""Each pass, before and after, on small models: rank 0's dump of every pass compared byte for
byte with `tests/passes/goldens/<case>/<NN>_<pass>.ir`, two ways:

* the compile: every dump of a whole compile of the case equals its golden
  (`test_every_pass_matches_its_golden`);
* each pass alone: `<NN>_<before>.ir` parsed, the one pass that follows run on a plain
  `passes.unit.CompileUnit` holding the parsed graph, printed, equals `<NN+1>_<pass>.ir`
  (`test_each_pass_alone_on_its_before_dump`). What the text does not carry (the options, the
  strategy assignment, the search's decision, the pipeline's stages: typed fields of the unit)
  the test takes from the compile's unit as it was when that pass began, its facts about nodes
  moved to the parsed graph's nodes by position. The plan sections the pass writes are the
  compile's.

A difference names the pass and shows what it changed against what its golden says it changes
(the dump before it is the previous pass's). Between the cases every pass the driver has runs at
least once (checked below). Regenerate after an intended change with

    PCOMPILE_ACCEPT=1 python -m pytest tests/passes/test_pass_goldens.py

and review the diff."""

from __future__ import annotations

import copy
import difflib
import os
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import pcompile.compiler.driver.driver as driver
from pcompile.compiler.driver.compiled import CompileState
from pcompile.compiler.driver.front_passes import TrainStepPass
from pcompile.ir.core import Graph, Node
from pcompile.ir.parser import parse_graph
from pcompile.ir.printer import print_graph
from pcompile.passes.layouts import ParallelAssignment
from pcompile.passes.pipeline_stages import PipelineSettings
from pcompile.passes.unit import CompileUnit, Pass, PlanRecord
from pcompile.tools.compile import compile as compile_model
from tests import ROOT
from tests.multiprocess import mlp_source

GOLDENS = Path(ROOT, "tests", "passes", "goldens")

_RECOMPUTE = textwrap.dedent('''
    import numpy as np
    from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

    set_auto_parallel_context(parallel_mode="semi_auto_parallel")


    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(initializer("normal", [8, 8]), "w")
            self.matmul = ops.MatMul().shard(((1, 2), (2, 1)))
            self.relu = ops.ReLU().shard(((2, 1),))

        def construct(self, x):
            return self.relu(self.matmul(x, self.w))


    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.block.recompute()

        def construct(self, x):
            return self.block(x)


    def model():
        set_seed(3)
        return Net()


    def inputs():
        return (np.zeros((4, 8), np.float32),)


    def loss():
        return nn.MSELoss()


    def optimizer(params):
        return nn.SGD(params, learning_rate=0.1)


    def labels():
        return (np.zeros((4, 8), np.float32),)
''')

_TRAIN_STEP = textwrap.dedent('''
    import numpy as np
    from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

    set_auto_parallel_context(parallel_mode="semi_auto_parallel")


    class NetWithLoss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(initializer("normal", [8, 4]), "w")
            self.matmul = ops.MatMul().shard(((2, 1), (1, 1)))
            self.loss = nn.MSELoss()

        def construct(self, x, y):
            return self.loss(self.matmul(x, self.w), y)


    def model():
        set_seed(3)
        net = NetWithLoss()
        return nn.TrainOneStepCell(net, nn.SGD(net.trainable_params(), learning_rate=0.1))


    def inputs():
        return (np.zeros((4, 8), np.float32), np.zeros((4, 4), np.float32))
''')

#: case -> (model source or example path, devices, parallel mode, search, environment)
CASES: dict[str, tuple[str, int, str | None, str | None, dict[str, str]]] = {
    "semi_auto": (mlp_source("((2, 1), (1, 1))", relu_matmul=True), 2, None, None, {}),
    "data_parallel": (mlp_source("((1, 1), (1, 1))"), 2, "data_parallel", None, {}),
    "sharding_propagation": (mlp_source("((1, 2), (2, 1))", relu_matmul=True), 2,
                             None, "sharding_propagation", {}),
    "recompute": (_RECOMPUTE, 2, None, None, {}),
    "pipeline": ("examples/pipeline_mlp.py", 2, None, None,
                 {"PIPE_STAGES": "2", "PIPE_MICRO": "2", "PIPE_MP": "1", "PIPE_BATCH": "4",
                  "PIPE_HIDDEN": "4"}),
    "train_step": (_TRAIN_STEP, 2, None, None, {}),
    # whole-parameter sums completed over the slices (the optimizer's AllReduces)
    "lamb": (mlp_source("((1, 2), (2, 1))").replace(
        "nn.Momentum(params, learning_rate=0.1, momentum=0.9)",
        "nn.Lamb(params, 1e-2, weight_decay=0.01)"), 2, None, None, {}),
    "adafactor": (mlp_source("((1, 2), (2, 1))").replace(
        "nn.Momentum(params, learning_rate=0.1, momentum=0.9)",
        "nn.AdaFactor(params, weight_decay=0.01)"), 2, None, None, {}),
}


@dataclass
class Step:
    """A pass of the compile and the unit's typed fields as they were when it began: the
    nodes of the graph its dump before shows (the forward graph, or rank 0's once split) and
    of the forward graph, by which facts about nodes reach the parsed graph's nodes."""

    index: int
    step: Pass[Any]
    split: bool
    nodes: list[Node]
    forward_nodes: list[Node]
    fields: dict[str, Any]


@dataclass
class Compiled:
    dumps: dict[str, str]  # rank 0's dump of every pass, by file name
    steps: list[Step]  # every pass after the trace, in order
    state: CompileState  # the unit at the end (what no pass changes: devices, options, ...)


#: The unit's typed fields a pass may read, copied when it begins (the passes change them).
_FIELDS = ("assignment", "search", "pipeline", "opt_shard", "reduced_parameters",
           "output_layouts", "state_owners")


def _snapshot(index: int, step: Pass[Any], state: CompileState) -> Step:
    """The step of pass `index` (`step`), taken when the unit is `state`: its typed fields
    copied (the passes change them)."""
    fields: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(state, name)
        if isinstance(value, ParallelAssignment):
            value = replace(value, shardings=dict(value.shardings),
                            param_layouts=dict(value.param_layouts),
                            reshape_layouts=dict(value.reshape_layouts))
        elif isinstance(value, PipelineSettings):
            value = replace(value, local_stage=dict(value.local_stage),
                            labels=dict(value.labels))
        elif isinstance(value, (dict, list)):
            value = copy.copy(value)
        fields[name] = value
    graph = state.rank_graphs[0] if state.split else state.graph
    assert graph is not None and state.graph is not None
    return Step(index, step, state.split, list(graph.nodes), list(state.graph.nodes), fields)


class _Recorder:
    """Records a compile's steps: the driver's `pipeline` (the passes after the trace) and
    its progress events (after pass k, the unit is what pass k + 1 begins with)."""

    def __init__(self) -> None:
        self.state: CompileState | None = None
        self.passes: list[Pass[CompileState]] = []
        self.steps: list[Step] = []
        self._pipeline = driver.pipeline

    def pipeline(self, state: CompileState) -> list[Pass[CompileState]]:
        self.passes = self._pipeline(state)
        self.state = state
        self.steps.append(_snapshot(1, self.passes[0], state))
        return self.passes

    def on_event(self, event: str, **info: Any) -> None:
        index = int(info.get("index", 0)) + 1
        if event == "pass" and self.state is not None and index <= len(self.passes):
            self.steps.append(_snapshot(index, self.passes[index - 1], self.state))


_COMPILED: dict[str, Compiled] = {}


def _compile(case: str, tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """The case compiled once (both tests read it): rank 0's dumps and the passes' steps."""
    if case in _COMPILED:
        return _COMPILED[case]
    source, devices, mode, search, env = CASES[case]
    tmp_path = tmp_path_factory.mktemp(case)
    recorder = _Recorder()
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(driver, "pipeline", recorder.pipeline)
        # source paths in dumps are relative to the working directory
        if source.endswith(".py"):
            monkeypatch.chdir(ROOT)
            model = source
        else:
            monkeypatch.chdir(tmp_path)
            model = f"{case}.py"
            Path(model).write_text(source)
        out = tmp_path / "out"
        compile_model(model, devices=devices, parallel_mode=mode, search_mode=search,
                      out_dir=str(out), dump_ranks="0", on_event=recorder.on_event)
    folder = out / "rank_0"
    dumps = {f: (folder / f).read_text() for f in sorted(os.listdir(folder))
             if f.endswith(".ir")}
    assert recorder.state is not None
    _COMPILED[case] = Compiled(dumps, recorder.steps, recorder.state)
    return _COMPILED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_pass_matches_its_golden(case: str,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    dumps = _compile(case, tmp_path_factory).dumps
    folder = GOLDENS / case
    if os.environ.get("PCOMPILE_ACCEPT"):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.ir"):
            old.unlink()
        for name, text in dumps.items():
            (folder / name).write_text(text)
    want = sorted(p.name for p in folder.glob("*.ir"))
    assert list(dumps) == want, (
        f"{case}: the passes dumped {list(dumps)}, the goldens are {want}; rerun with "
        "PCOMPILE_ACCEPT=1 to update")
    previous = ""
    for name, text in dumps.items():
        golden = (folder / name).read_text()
        if text != golden:
            did = "".join(difflib.unified_diff(previous.splitlines(True), golden.splitlines(True),
                                               "before", f"golden {name}", n=1))
            does = "".join(difflib.unified_diff(previous.splitlines(True), text.splitlines(True),
                                                "before", f"now {name}", n=1))
            pytest.fail(f"{case}: pass {name} differs from its golden; rerun with "
                        f"PCOMPILE_ACCEPT=1 to update.\nWhat it should do:\n{did[:4000]}\n"
                        f"What it does:\n{does[:4000]}")
        previous = text


def test_the_cases_cover_every_pass() -> None:
    """Every pass the driver has dumps in some case (a new pass needs a case here)."""
    names = {"trace", "optimizer", "train_step", "step_auto_parallel_begin"}
    for value in vars(driver).values():
        if isinstance(value, type) and isinstance(getattr(value, "name", None), str) \
                and callable(getattr(value, "apply", None)):
            names.add(value.name)
    dumped = {name.split("_", 1)[1][:-3] for case in CASES for name in
              (p.name for p in (GOLDENS / case).glob("*.ir"))}
    assert names <= dumped, f"passes without a golden: {sorted(names - dumped)}"


def _moved(nodes: list[Node], parsed: Graph) -> dict[Node, Node]:
    """Each node of the compile's graph -> the parsed graph's node at its position."""
    assert len(nodes) == len(parsed.nodes), (len(nodes), len(parsed.nodes))
    return dict(zip(nodes, parsed.nodes))


def _unit(compiled: Compiled, step: Step, before: Graph, forward: Graph) -> CompileUnit:
    """A unit for `step`'s pass holding the parsed graph `before` (the forward graph
    `forward` of record), its typed fields the compile's when the pass began, their facts
    about nodes moved to the parsed nodes by position."""
    state = compiled.state
    local = _moved(step.nodes, before)
    record = _moved(step.forward_nodes, forward)
    fields = dict(step.fields)
    assignment = fields["assignment"]
    if assignment is not None:
        fields["assignment"] = replace(
            assignment,
            shardings={record[n]: s for n, s in assignment.shardings.items()},
            reshape_layouts={record[n]: lay for n, lay in assignment.reshape_layouts.items()})
    search = fields["search"]
    if search is not None:
        fields["search"] = replace(
            search, strategies={record[n]: s for n, s in search.strategies.items()},
            explain={record[n]: e for n, e in search.explain.items()},
            reshape_layouts={record[n]: lay for n, lay in search.reshape_layouts.items()},
            layouts={record[n]: lay for n, lay in search.layouts.items()})
    pipeline = fields["pipeline"]
    if pipeline is not None:
        stage_map = pipeline.stage_map
        if stage_map is not None:
            stage_map = replace(stage_map, node_stage={
                new: stage_map.node_stage[old] for old, new in record.items()
                if old in stage_map.node_stage})
        fields["pipeline"] = replace(pipeline, stage_map=stage_map,
                                     local_stage={local[n]: stage for n, stage
                                                  in pipeline.local_stage.items()
                                                  if n in local},
                                     labels={local[n]: label for n, label
                                             in pipeline.labels.items() if n in local})
    common = {"devices": state.devices, "parallel_mode": state.parallel_mode,
              "search_mode": state.search_mode, "options": state.options,
              "training": state.training, "backward": state.backward, "graph": forward,
              "rank_graphs": [before] * state.devices if step.split else [],
              "split": step.split, **fields}
    if isinstance(step.step, TrainStepPass):  # a front-end pass: it replays the user's cell
        return replace(state, **common, plan=PlanRecord())
    return CompileUnit(**common)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_pass_alone_on_its_before_dump(case: str,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """`<NN>_<before>.ir` parsed, the pass after it run on a unit holding that graph, printed:
    `<NN+1>_<pass>.ir`, for every pass after the trace."""
    compiled = _compile(case, tmp_path_factory)
    folder = GOLDENS / case
    names = sorted(p.name for p in folder.glob("*.ir"))
    assert [s.index for s in compiled.steps] == list(range(1, len(names))), case
    forward: Graph | None = None
    failures: list[str] = []
    for step in compiled.steps:
        before_name, after_name = names[step.index - 1], names[step.index]
        assert after_name == f"{step.index:02d}_{step.step.name}.ir", (after_name, step.index)
        before = parse_graph((folder / before_name).read_text(), before_name)
        if not step.split:
            forward = before
        assert forward is not None
        unit = _unit(compiled, step, before, forward)
        nodes = list(before.nodes)
        step.step.apply(unit)
        if step.step.name == "comm_fusion":  # it keeps the nodes before fusion (the shrunk check's)
            assert unit.unfused == [nodes], case
        graph = unit.rank_graphs[0] if unit.split else unit.graph
        assert graph is not None
        text = print_graph(graph, 0)
        # the plan sections it writes are the compile's, and so are the parameters' layouts,
        # the parallel optimizer's shards and the cotangent reductions it leaves in the unit
        written = {name: compiled.state.plan.get(name) for name in unit.plan}
        if dict(unit.plan) != written:
            failures.append(f"pass {step.step.name}: plan {dict(unit.plan)} != {written}")
        after = (compiled.steps[step.index].fields if step.index < len(compiled.steps)
                 else _snapshot(0, step.step, compiled.state).fields)
        for name in ("opt_shard", "reduced_parameters", "state_owners"):
            if getattr(unit, name) != after[name]:
                failures.append(f"pass {step.step.name}: {name} {getattr(unit, name)} != "
                                f"{after[name]}")
        if (unit.assignment is None) != (after["assignment"] is None) or (
                unit.assignment is not None
                and unit.assignment.param_layouts != after["assignment"].param_layouts):
            failures.append(f"pass {step.step.name}: the parameters' layouts differ")
        golden = (folder / after_name).read_text()
        if text != golden:
            does = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True),
                                                f"golden {after_name}", "now", n=1))
            failures.append(f"pass {step.step.name} on {before_name}:\n{does[:3000]}")
    assert not failures, f"{case}: " + "\n".join(failures)
