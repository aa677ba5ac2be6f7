"""Dropout inside nn.PipelineCell trains like one device (it was refused): the micro-batch
pass gives each micro-batch's copy of a Dropout its rows' place in the whole batch (micro-batch
k's rows of a rank begin at m * o + k * r on the batch dim), so every micro-batch draws the
single-device program's bits of its rows, and the step counter's update reads no micro-batch and
runs once a step (each stage that reads it computes it)."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(16, 16)
        self.d1 = nn.Dropout(p=0.3)
        self.l2 = nn.Dense(16, 8)
        self.d2 = nn.Dropout(p=0.5)
        {extra}
        for cell, stage in ((self.l1, 0), (self.d1, 0), (self.l2, 1), (self.d2, 1)):
            cell.pipeline_stage = stage

    def construct(self, x):
        return {body}


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size={micro})


def inputs():
    return (np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
"""
BODY = "self.d2(self.l2(self.d1(self.l1(x))))"


def _write(tmp_path: Any, micro: int, body: str = BODY, extra: str = "") -> str:
    path = tmp_path / f"pipe_dropout_{micro}.py"
    path.write_text(textwrap.dedent(MODEL.format(micro=micro, body=body, extra=extra)))
    return str(path)


@pytest.mark.parametrize("micro,devices", [(2, 4), (4, 8), (4, 2)])
def test_dropout_in_a_pipeline_trains_like_one_device(tmp_path: Any, micro: int,
                                                      devices: int) -> None:
    """Two stages, 2 or 4 micro-batches, the batch split over 2, 4 or 1 device(s) of a stage:
    two steps equal the whole-batch single-device program's (losses, weights, the counter)."""
    program = compile_model(_write(tmp_path, micro), devices=devices, dump=False)
    report = check(program, steps=2)
    assert report.ok(), report
    assert "random_step" in report.params


def test_a_pipeline_refuses_what_cannot_draw_its_rows_bits(tmp_path: Any) -> None:
    """A Dropout whose dim 0 is split otherwise than the inputs' (here its rows whole on the
    4 devices of a stage that split the inputs' rows) and DropoutDoMask (its packed mask is
    drawn once for the traced micro-batch) are refused with one message each."""
    split = _write(tmp_path, 2, extra="self.d1.dropout.shard(((1, 4),))")
    with pytest.raises(PcompileError, match=r"Dropout .* micro-batches: its input's dim 0 "
                                            r"must be the batch's"):
        compile_model(split, devices=8, dump=False)
    do_mask = _write(tmp_path, 2, body="ops.DropoutDoMask()(self.l2(self.l1(x)), "
                                       "ops.DropoutGenMask()((16, 8), 0.5), 0.5)")
    with pytest.raises(PcompileError, match=r"DropoutDoMask .* micro-batches: its packed mask"):
        compile_model(do_mask, devices=4, dump=False)
