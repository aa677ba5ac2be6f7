"""Dropout, DropoutGrad and DropoutMask (ir/ops/random.py): the bits are the same in numpy and
JAX, keep about keep_prob of the elements, change with the step and the seeds, and depend only on
each element's place in the whole tensor, so every strategy draws the single-device mask."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.ops.random import kept_jax, kept_np
from pcompile.ir.types import DType, TensorType
from tests.e2e.test_parallel import run_sharded


def _kept(shape, step=1, offset=None, keep=0.5, seeds=(1, 2), whole=None):
    offset = np.zeros(len(shape), np.int32) if offset is None else np.asarray(offset, np.int32)
    return kept_np(shape, np.int32(step), offset, keep, *seeds, whole or shape)


def test_dropout_values_and_statistics() -> None:
    shape, keep = (200, 500), 0.3
    kept = _kept(shape, keep=keep)
    # numpy and JAX draw the same bits
    fn = jax.jit(lambda s, o: kept_jax(shape, s, o, keep, 1, 2, shape))
    assert np.array_equal(np.asarray(fn(np.int32(1), np.zeros(2, np.int32))), kept)
    # about keep_prob of the elements are kept: within 5 standard deviations of a binomial
    n = kept.size
    assert abs(kept.sum() - keep * n) < 5 * math.sqrt(n * keep * (1 - keep))
    # rows and columns are not correlated: each row keeps about keep_prob too
    rows = kept.mean(axis=1)
    assert abs(rows.mean() - keep) < 0.01 and rows.std() < 3 * math.sqrt(keep * (1 - keep) / 500)
    # another step, other seeds: other bits (about keep^2 + (1-keep)^2 of them agree)
    for other in (_kept(shape, step=2, keep=keep), _kept(shape, keep=keep, seeds=(1, 3)),
                  _kept(shape, keep=keep, seeds=(2, 2))):
        agree = float(np.mean(other == kept))
        assert abs(agree - (keep**2 + (1 - keep)**2)) < 0.01
    # a block at an offset draws the whole tensor's bits of its elements
    block = _kept((50, 100), offset=(100, 300), keep=keep, whole=shape)
    assert np.array_equal(block, kept[100:150, 300:400])
    assert _kept((3, 4), keep=1.0).all()

    # the ops: x / keep where kept, 0 elsewhere; the gradient keeps the same elements
    graph = Graph("dropout")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (4, 6)), "x"))
    step = graph.add_param(GraphParam(TensorType(DType.int32, ()), "step"))
    offset = graph.add_param(GraphParam(TensorType(DType.int32, (2,)), "offset"))
    b = Builder(graph)
    attrs = {"keep_prob": 0.75, "seed0": 5, "seed1": 0, "global_shape": (4, 6)}
    graph.outputs = [b.emit(op, [x, step, offset], attrs)
                     for op in ("Dropout", "DropoutMask", "DropoutGrad")]
    data = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    out, mask, grad = run_graph(graph, [data, np.int32(7), np.zeros(2, np.int32)])
    kept = kept_np((4, 6), np.int32(7), np.zeros(2, np.int32), 0.75, 5, 0, (4, 6))
    assert np.array_equal(mask, kept.astype(np.float32))
    want = np.where(kept, data * np.float32(1 / 0.75), 0).astype(np.float32)
    assert np.array_equal(out, want) and np.array_equal(grad, want)


def test_bad_operands_are_one_error() -> None:
    graph = Graph("dropout")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (4, 6)), "x"))
    step = graph.add_param(GraphParam(TensorType(DType.int32, ()), "step"))
    offset = graph.add_param(GraphParam(TensorType(DType.int32, (2,)), "offset"))
    b = Builder(graph)
    with pytest.raises(OpError, match="keep_prob must be in"):
        b.emit("Dropout", [x, step, offset],
               {"keep_prob": 0.0, "seed0": 0, "seed1": 0, "global_shape": (4, 6)})
    with pytest.raises(OpError, match="global_shape"):
        b.emit("Dropout", [x, step, offset],
               {"keep_prob": 0.5, "seed0": 0, "seed1": 0, "global_shape": (2, 6)})


@pytest.mark.parametrize("strategy,devices", [
    (((2, 4), (), (1,)), 8), (((8, 1), (), (1,)), 8), (((1, 4), (), (1,)), 8),
    (((4, 2), (), (1,)), 16)])
def test_every_strategy_draws_the_single_device_mask(strategy, devices) -> None:
    """Forward and gradient of a split Dropout equal the unsplit op's (the same elements
    kept), repeated ranks included (((1, 4),) on 8 devices)."""
    x = np.random.default_rng(3).standard_normal((8, 12))
    attrs = {"keep_prob": 0.6, "seed0": 11, "seed1": 4, "global_shape": (8, 12)}
    arrays = [x, np.asarray(3, np.int32), np.zeros(2, np.int32)]
    run_sharded("Dropout", arrays, attrs, strategy, devices)
    run_sharded("DropoutMask", arrays, attrs, strategy, devices)
