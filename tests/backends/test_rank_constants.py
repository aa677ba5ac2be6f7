"""A constant that the plan splits per rank is a per-rank table in program.py (row r: rank
r's slice). Its dtype is written as DType's numpy dtype: numpy has no bfloat16 of its own, so
`np.bfloat16` made every rank of a bfloat16 table die at import."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import single_device
from pcompile.tools.runners import StandAloneRunner

MODEL = """
import numpy as np
from pcompile import Parameter, Tensor, initializer, nn, ops, set_auto_parallel_context
from pcompile.ir.types import DType

set_auto_parallel_context(parallel_mode="semi_auto_parallel")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [8, 8]), "w")
        self.matmul = ops.MatMul().shard(((8, 1), (1, 1)))
        self.mul = ops.Mul().shard(((8, 1), (8, 1)))
        self.c = Tensor(np.arange(64, dtype=np.float32).reshape(8, 8) / 7, DType.bfloat16)
        self.cast = ops.Cast()

    def construct(self, x):
        h = self.cast(self.matmul(x, self.w), DType.bfloat16)
        return self.cast(self.mul(h, self.c), DType.float32)


def model():
    return Net()


def inputs():
    return [np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)]
"""


def test_a_bfloat16_per_rank_table_is_written_with_ml_dtypes(tmp_path) -> None:
    path = tmp_path / "bf16_table.py"
    path.write_text(textwrap.dedent(MODEL))
    compile_model(str(path), devices=8, out_dir=str(tmp_path / "out"))
    source = (tmp_path / "out" / "rank_0" / "program.py").read_text()
    assert "DType.bfloat16.np)" in source and "np.bfloat16" not in source


@pytest.mark.slow
def test_a_bfloat16_per_rank_constant_runs_on_8_processes(tmp_path) -> None:
    from pcompile.backends.launcher import launch

    path = tmp_path / "bf16_table.py"
    path.write_text(textwrap.dedent(MODEL))
    out = tmp_path / "out"
    program = compile_model(str(path), devices=8, out_dir=str(out))
    result = launch(str(out), steps=1, processes=8, echo=lambda line: None)
    assert result.code == 0, result.message
    one = StandAloneRunner(single_device(program), "numpy")
    one.values["w"] = np.asarray(program.initial_values["w"])  # the plan's initial values
    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    want = one.run([x])[0]
    got = np.concatenate([np.load(out / f"rank_{r}" / "outputs.npz")["output0"]
                          for r in range(8)])
    # the same bfloat16 products (one rounding each) on every side
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=0)
