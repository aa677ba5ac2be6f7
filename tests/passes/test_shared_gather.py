"""Two Reshapes of one activation that need the same collectives (to different shapes, one
through a Cast to the dtype it already has) share them: DeepSeek's MoE layer flattens its
split-token input for the router (G, T, h) and, after a Cast, for the shared expert (B S, h),
each read on the data-parallel rows; mindformers' plan gathers it once (issue 35)."""

from __future__ import annotations

from typing import Any

from pcompile.compiler.driver.plan import read_plan
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, initializer, set_auto_parallel_context
import pcompile as ms

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [8, 8]), "w")
        self.v = Parameter(initializer("normal", [8, 8]), "v")
        self.g = Parameter(initializer("normal", [8, 4, 8]), "g")
        self.norm = ops.Mul().shard(((8, 1, 1), (8, 1, 1)))    # split tokens on dp x mp
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.routed = ops.MatMul().shard(((4, 1), (1, 1)))      # dp rows of (G T, h)
        self.shared = ops.MatMul().shard(((4, 1), (1, 1)))      # dp rows of (B S, h)
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        h = self.norm(x, self.g)                                   # (8, 4, 8)
        routed = self.routed(self.reshape(h, (32, 8)), self.w)
        shared = self.shared(self.reshape(self.cast(h, ms.float32), (-1, 8)), self.v)
        return self.loss(routed + shared, y)


def model():
    return Net()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8, 4, 8)).astype(np.float32),
            rng.standard_normal((32, 8)).astype(np.float32))
"""


def _compile(tmp_path: Any) -> Any:
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return compile_model(str(path), devices=8, out_dir=str(tmp_path / "out"), save_graphs=0)


def test_reshapes_of_one_value_share_their_gather(tmp_path: Any) -> None:
    _compile(tmp_path)
    plan = read_plan(str(tmp_path / "out"))
    moved = sorted((r.op, r.phase) for r in plan.collectives["0"]
                   if r.op in ("AllGather", "ReduceScatter"))
    # the split tokens gathered once, not once per Reshape; the backward sums the two
    # cotangents before its one ReduceScatter
    assert moved == [("AllGather", "forward"), ("ReduceScatter", "backward")]


def test_the_shared_gather_trains_like_one_device(tmp_path: Any) -> None:
    assert check(_compile(tmp_path)).ok()
