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
from pcompile.ir.ops.random import kept_jax, kept_np, mask_bytes
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


def _emit(op, arrays, attrs):
    graph = Graph(op)
    params = [graph.add_param(GraphParam(TensorType(DType.from_any(a.dtype), a.shape), f"x{i}"))
              for i, a in enumerate(arrays)]
    graph.outputs = [Builder(graph).emit(op, params, attrs)]
    return graph


def test_gen_mask_packs_the_dropout_bits() -> None:
    """DropoutGenMask packs the bits Dropout keeps (the same seeds and step) as MindSpore's
    UInt8 mask, ceil(n / 128) * 16 bytes, element i in bit i % 8 of byte i // 8, the bits past n
    zero; numpy and JAX agree; DropoutDoMask with that mask is Dropout, and its gradient keeps
    the same elements."""
    from pcompile.backends.jax import lower_graph

    shape, keep, step = (5, 70), 0.6, np.asarray(4, np.int32)
    attrs = {"shape": shape, "keep_prob": keep, "seed0": 9, "seed1": 3}
    gen = _emit("DropoutGenMask", [step], attrs)
    (mask,) = run_graph(gen, [step])
    assert mask.dtype == np.uint8 and mask.shape == (mask_bytes(shape),) == (48,)
    bits = np.unpackbits(mask, bitorder="little")
    kept = kept_np(shape, step, np.zeros(2, np.int32), keep, 9, 3, shape)
    assert np.array_equal(bits[:350], kept.reshape(-1)) and not bits[350:].any()
    assert np.array_equal(np.asarray(jax.jit(lower_graph(gen))(step)[0]), mask)
    assert mask_bytes((128,)) == 16 and mask_bytes((129,)) == 32 and mask_bytes(()) == 16
    for edge, want in ((0.0, 0), (1.0, 1)):  # MindSpore's keep_prob range is [0, 1]
        (m,) = run_graph(_emit("DropoutGenMask", [step], {**attrs, "keep_prob": edge}), [step])
        assert (np.unpackbits(m, bitorder="little")[:350] == want).all()

    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    zero = np.zeros(2, np.int32)
    do = _emit("DropoutDoMask", [x, mask, zero], {"keep_prob": keep, "global_shape": shape})
    (got,) = run_graph(do, [x, mask, zero])
    drop = _emit("Dropout", [x, step, zero], {"keep_prob": keep, "seed0": 9, "seed1": 3,
                                               "global_shape": shape})
    assert np.array_equal(got, run_graph(drop, [x, step, zero])[0])
    assert np.array_equal(np.asarray(jax.jit(lower_graph(do))(x, mask, zero)[0]), got)
    with pytest.raises(OpError, match="holds 128 bits, fewer than the 350"):
        _emit("DropoutDoMask", [x, mask[:16], zero], {"keep_prob": keep, "global_shape": shape})
    with pytest.raises(OpError, match="1-D UInt8"):
        _emit("DropoutDoMask", [x, x, zero], {"keep_prob": keep, "global_shape": shape})


@pytest.mark.parametrize("strategy,devices", [
    (((2, 4), (1,), (1,)), 8), (((1, 4), (1,), (1,)), 8), (((4, 2), (1,), (1,)), 16)])
def test_a_split_do_mask_reads_the_single_device_bits(strategy, devices) -> None:
    """DropoutDoMask under MindSpore's strategies (x split, the mask whole, repeated ranks
    included) computes the unsplit op's output and gradient."""
    x = np.random.default_rng(3).standard_normal((8, 12))
    shape = (8, 12)
    step = np.asarray(2, np.int32)
    (mask,) = run_graph(_emit("DropoutGenMask", [step], {"shape": shape, "keep_prob": 0.7,
                                                        "seed0": 1, "seed1": 5}), [step])
    run_sharded("DropoutDoMask", [x, mask, np.zeros(2, np.int32)],
                {"keep_prob": 0.7, "global_shape": shape}, strategy, devices)
