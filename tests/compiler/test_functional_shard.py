"""Functional shard: the seed's Net1/Net2 forms, the function form, and its misuse errors."""

from __future__ import annotations

import os

import numpy as np
import pytest

import pcompile as ms
from pcompile import Tensor, nn, ops
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

NET2 = os.path.join(ROOT, "examples", "functional_shard.py")


def test_net2_compiles_with_sharding_propagation_and_matches_single_device() -> None:
    program = compile_model(NET2, devices=8, dump=False)
    graph = program.graph
    configured = [(n.instance_name, n.attrs["in_strategy"]) for n in graph.nodes
                  if n.attrs.get("functional_shard")]
    assert configured == [
        ("shard_input_0", ((8, 1),)),  # block1_graph's input
        ("shard_param_block1.dense2.weight", ((8, 1),)),
        ("shard_input_0", ((1, 8),)),  # block2.shard
        ("shard_input_0", ((4, 2),)),  # the sharded dense_relu function
    ]
    # The stored slice of block1.dense2.weight follows the parameter plan: rows split 8 ways.
    assert program.rank_graph(0).param("block1.dense2.weight").shape == (4, 32)
    assert check(program, steps=2).ok()


def test_shard_is_refused_outside_sharding_propagation() -> None:
    with pytest.raises(PcompileError, match="only supported with parallel_mode='auto_parallel'"):
        compile_model(NET2, devices=8, parallel_mode="semi_auto_parallel", dump=False)
    with pytest.raises(PcompileError, match="recursive_programming"):
        compile_model(NET2, devices=8, search_mode="recursive_programming", dump=False)


def test_assigning_a_sharded_function_to_the_cell_attribute_is_a_type_error() -> None:
    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.relu = ops.ReLU()

        def construct(self, x):
            return self.relu(x)

    class NetError(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block1 = Block()
            self.block1 = ms.shard(self.block1, in_strategy=((8, 1),),
                                   parameter_plan={'self.block1.dense2.weight': (8, 1)})

    with pytest.raises(TypeError, match="For 'Cell', the type of block1 should be cell, "
                                        "but got function."):
        NetError()


def test_function_form_runs_eagerly_outside_a_model() -> None:
    def dense_relu(x, weight, bias):
        return ops.relu(ops.bias_add(ops.matmul(x, weight), bias))

    rng = np.random.default_rng(0)
    x = Tensor(rng.uniform(0, 1, (32, 128)), ms.float32)
    w = Tensor(rng.uniform(0, 1, (128, 10)), ms.float32)
    b = Tensor(rng.uniform(0, 1, (10,)), ms.float32)
    result = ms.shard(dense_relu, in_strategy=((4, 2), None, None))(x, w, b)
    assert result.shape == (32, 10)
    want = np.maximum(x.asnumpy().astype(np.float64) @ w.asnumpy() + b.asnumpy(), 0)
    # Every term is non-negative, so a float32 dot product of 128 terms plus the bias is
    # within (128 + 1) unit roundoffs of the exact value, relatively (the standard bound
    # |fl(x.y) - x.y| <= K u sum|x_i y_i|, with sum|x_i y_i| = x.y here).
    np.testing.assert_allclose(result.asnumpy(), want, rtol=(128 + 1) * 2.0 ** -24)


def test_malformed_functional_strategies() -> None:
    with pytest.raises(TypeError):
        ms.shard(lambda x: x, in_strategy=((2.0, 1),))
    with pytest.raises(ValueError):
        nn.Dense(4, 4).shard(in_strategy=((0, 1),))
