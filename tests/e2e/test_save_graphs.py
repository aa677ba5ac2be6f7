"""`set_context(save_graphs=..., save_graphs_path=...)` in the model file is honoured, the
command line overrides it, and MindSpore's levels decide what is dumped: 0 no `.ir` files, 1
the introductory passes, 2 every pass, 3 also `.dot` files."""

from __future__ import annotations

import os
import re

import pytest
from click.testing import CliRunner

from pcompile.cli import main

MODEL = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_context
from tests import ROOT
{context}
set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [8, 8]), "w")
        self.matmul = ops.MatMul().shard(((2, 2), (2, 1)))

    def construct(self, x):
        return self.matmul(x, self.w)


def model():
    return Net()


def inputs():
    return (np.ones((4, 8), np.float32),)


def labels():
    return (np.ones((4, 8), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def _model(tmp_path, context: str) -> str:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(context=context))
    return str(path)


def _compile(model: str, *args: str, cwd: str) -> str:
    here = os.getcwd()
    os.chdir(cwd)  # save_graphs_path is relative to where pcompile runs
    try:
        result = CliRunner().invoke(main, [model, "--devices", "4", "--no-check", *args])
    finally:
        os.chdir(here)
    assert result.exit_code == 0, result.output
    return result.output


def _dumps(folder) -> list[str]:
    return sorted(re.sub(r"^\d\d_", "", f) for f in os.listdir(folder)
                  if f.endswith((".ir", ".dot")))


@pytest.mark.parametrize("level, expected", [
    (0, []),
    (1, ["execute.ir", "step_parallel_begin.ir", "step_parallel_end.ir", "trace.ir"]),
    (2, ["autodiff.ir", "comm_fusion.ir", "execute.ir", "optimizer.ir",
         "step_parallel_begin.ir", "step_parallel_end.ir", "trace.ir"]),
])
def test_model_file_level_and_path(tmp_path, level: int, expected: list[str]) -> None:
    model = _model(tmp_path, f'set_context(save_graphs={level}, save_graphs_path="graphs")')
    _compile(model, cwd=str(tmp_path))
    out = tmp_path / "graphs"
    assert _dumps(out / "rank_0") == expected
    # plan.json and the rank programs are written at every level
    assert (out / "plan.json").is_file() and (out / "program.py").is_file()
    assert not (tmp_path / "saved_graph").exists()


def test_command_line_overrides(tmp_path) -> None:
    model = _model(tmp_path, 'set_context(save_graphs=0, save_graphs_path="graphs")')
    _compile(model, "--save-graphs", "1", "--out", "elsewhere", cwd=str(tmp_path))
    assert _dumps(tmp_path / "elsewhere" / "rank_3") == [
        "execute.ir", "step_parallel_begin.ir", "step_parallel_end.ir", "trace.ir"]
    assert not (tmp_path / "graphs").exists()


def test_level_3_writes_dot_files(tmp_path) -> None:
    model = _model(tmp_path, "set_context(save_graphs=3)")
    _compile(model, "--out", "g", cwd=str(tmp_path))
    files = _dumps(tmp_path / "g" / "rank_0")
    irs = [f for f in files if f.endswith(".ir")]
    assert len(irs) == 7 and [f[:-3] + ".dot" for f in irs] == [
        f for f in files if f.endswith(".dot")]
    dot = next((tmp_path / "g" / "rank_0").glob("*_execute.dot")).read_text()
    assert dot.startswith("digraph ") and dot.rstrip().endswith("}")
    defined = set(re.findall(r"^  (\w+) \[", dot, re.M))
    for src, dst in re.findall(r"^  (\w+) -> (\w+)", dot, re.M):
        assert src in defined and dst in defined
    assert "AllReduce" in dot and "fillcolor=lightblue" in dot


def test_true_is_level_2_and_nothing_leaks(tmp_path) -> None:
    """save_graphs=True is level 2 (MindSpore); a model file's set_context does not carry over
    to the next compile in the same process."""
    first = _model(tmp_path, "set_context(save_graphs=0)")
    _compile(first, "--out", "a", cwd=str(tmp_path))
    assert _dumps(tmp_path / "a" / "rank_0") == []
    (tmp_path / "second").mkdir()
    second = _model(tmp_path / "second", "")
    _compile(second, "--out", "b", cwd=str(tmp_path))
    assert len(_dumps(tmp_path / "b" / "rank_0")) == 7
    third = _model(tmp_path, "set_context(save_graphs=True)")
    _compile(third, "--out", "c", cwd=str(tmp_path))
    assert len(_dumps(tmp_path / "c" / "rank_0")) == 7
