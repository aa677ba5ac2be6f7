"""Each pass, before and after, on small models: rank 0's dump of every pass compared byte for
byte with `tests/passes/goldens/<case>/<NN>_<pass>.ir`. A difference names the pass and shows
what it changed against what its golden says it changes (the dump before it is the previous
pass's). Between the cases every pass the driver has runs at least once (checked below).
Regenerate after an intended change with

    PCOMPILE_ACCEPT=1 python -m pytest tests/passes/test_pass_goldens.py

and review the diff."""

from __future__ import annotations

import difflib
import os
import textwrap
from pathlib import Path

import pytest

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


def _compile(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    source, devices, mode, search, env = CASES[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
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
                  out_dir=str(out), dump_ranks="0")
    folder = out / "rank_0"
    return {f: (folder / f).read_text() for f in sorted(os.listdir(folder)) if f.endswith(".ir")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_pass_matches_its_golden(case: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    dumps = _compile(case, tmp_path, monkeypatch)
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
    import pcompile.compiler.driver as driver

    names = {"trace", "optimizer", "train_step", "step_auto_parallel_begin"}
    for value in vars(driver).values():
        if isinstance(value, type) and isinstance(getattr(value, "name", None), str) \
                and callable(getattr(value, "apply", None)):
            names.add(value.name)
    dumped = {name.split("_", 1)[1][:-3] for case in CASES for name in
              (p.name for p in (GOLDENS / case).glob("*.ir"))}
    assert names <= dumped, f"passes without a golden: {sorted(names - dumped)}"
