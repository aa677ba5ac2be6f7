"""TopKRouter (ir/ops/routing.py), mindformers' fused routing kernel: MindSpore's own example,
the fused op against mindformers' unfused TopkRouterV2 form (OneHot, CumSum, Sort; sdrop and
kdrop) written with pcompile's ops, on numpy and JAX; its sharding rule (the group dim only,
MindSpore's TopKRouterInfo) against the oracle, and the refused token split."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType, TensorType
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner
from tests.e2e.test_parallel import draw_strategy, run_sharded

# MindSpore's TopKRouter test (tests/st/ops/ascend/test_topkrouter.py): 10 tokens choosing 2 of
# 4 experts, capacity 3, drop_type 0
EXAMPLE_X = np.array([[[0, 1], [1, 3], [3, 2], [2, 2], [2, 0], [0, 1], [1, 2], [2, 1], [1, 2],
                       [2, 0]]], np.int32)
EXAMPLE_DISPATCH = np.array([[[1, 5, 6], [1, 2, 6], [3, 4, 4], [2, 3, 0]]], np.int32)
EXAMPLE_COMBINE = np.array([[[1, 5], [6, 13], [14, 9], [10, 11], [8, 2], [3, 7], [4, 8], [8, 4],
                             [4, 8], [8, 0]]], np.int32)


def _router_graph(shape: tuple[int, ...], **attrs: Any) -> Graph:
    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.int32, shape), "x"))
    b = Builder(graph)
    out = b("TopKRouter", x, **attrs)
    graph.outputs = [b("TupleGetItem", out, index=0), b("TupleGetItem", out, index=1)]
    return graph


def _jax(graph: Graph, arrays: list[np.ndarray]) -> list[np.ndarray]:
    import jax

    from pcompile.backends.jax import lower_graph

    return [np.asarray(o) for o in jax.jit(lower_graph(graph))(*arrays)]


def test_mindspore_example() -> None:
    graph = _router_graph(EXAMPLE_X.shape, capacity=3, expert_num=4, drop_type=0)
    for outs in (run_graph(graph, [EXAMPLE_X]), _jax(graph, [EXAMPLE_X])):
        np.testing.assert_array_equal(outs[0], EXAMPLE_DISPATCH)
        np.testing.assert_array_equal(outs[1], EXAMPLE_COMBINE)
        assert outs[0].dtype == np.int32 and outs[1].dtype == np.int32


# mindformers' TopkRouterV2 with and without the fused kernel, as a model file: the routing
# of `GROUPS` groups of `TOKENS` tokens choosing `K` of `EXPERTS` experts (random scores), the
# group dim split `DP` ways as mindformers' strategies split it
ROUTER = '''
import numpy as np
from pcompile import nn, ops, Tensor, set_auto_parallel_context
from pcompile.ops import operations as P

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num={dp},
                          dataset_strategy="full_batch")
GROUPS, TOKENS, K, EXPERTS, CAPACITY, DP = {groups}, {tokens}, {k}, {experts}, {capacity}, {dp}


class Router(nn.Cell):
    def __init__(self, fused, kdrop):
        super().__init__()
        self.fused, self.kdrop = fused, kdrop
        dp = DP
        self.topk = P.TopK().shard(((dp, 1, 1),))
        self.topkrouter = P._inner_ops.TopKRouter().shard(((dp, 1, 1),))
        self.onehot = P.OneHot().shard(((dp, 1, 1), (), ()))
        self.cumsum = P.CumSum().shard(((dp, 1, 1),))
        self.mul_3d = P.Mul().shard(((dp, 1, 1), (dp, 1, 1)))
        self.less = P.Less().shard(((dp, 1, 1), ()))
        self.reduce_sum = P.ReduceSum().shard(((dp, 1, 1),))
        self.transpose_3d = P.Transpose().shard(((dp, 1, 1),))
        self.sort = P.Sort().shard(((dp, 1, 1),))
        self.mod = P.Mod().shard(((dp, 1, 1), ()))

    def construct(self, scores):
        _, index = self.topk(scores, K)
        if self.fused:
            return self.topkrouter(index, CAPACITY, EXPERTS, 1 if self.kdrop else 0)
        n, kn = TOKENS, TOKENS * K
        if self.kdrop:  # every token's first choice first
            flat = ops.reshape(self.transpose_3d(index, (0, 2, 1)), (GROUPS, kn))
        else:
            flat = ops.reshape(index, (GROUPS, kn))
        mask = self.onehot(flat, EXPERTS, Tensor(1.0, np.float32), Tensor(0.0, np.float32))
        position = self.mul_3d(self.cumsum(mask, 1), mask)
        position = self.mul_3d(position, ops.cast(self.less(position, CAPACITY + 1), np.float32))
        slot = self.reduce_sum(position, -1)
        combine = ops.cast(flat, np.float32) * (CAPACITY + 1) + slot
        if self.kdrop:
            combine = self.transpose_3d(ops.reshape(combine, (GROUPS, K, n)), (0, 2, 1))
        else:
            combine = ops.reshape(combine, (GROUPS, n, K))
        order = Tensor(np.tile(np.arange(kn, dtype=np.float32), (1, EXPERTS, 1)))
        select = self.transpose_3d(mask, (0, 2, 1))
        raw = select * order + (1 - select) * (order + 2 * kn)
        ranked, _ = self.sort(raw)
        ranked = ranked[:, :, :CAPACITY]
        safe = ops.cast(ranked < 2 * kn, np.float32)
        token = self.mod(ranked, n) if self.kdrop else ops.floor_divide(ranked, K)
        dispatch = (token + 1) * safe
        return ops.cast(dispatch, np.int32), ops.cast(combine, np.int32)


def model():
    return Router({fused}, {kdrop})


def inputs():
    rng = np.random.default_rng({seed})
    return (rng.standard_normal((GROUPS, TOKENS, EXPERTS)).astype(np.float32),)
'''


def _router_program(tmp_path: Any, name: str, **values: Any) -> Any:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(ROUTER.format(**values)))
    return compile_model(str(path), devices=values["dp"], dump=False)


@pytest.mark.parametrize("kdrop", [False, True])
def test_fused_router_equals_the_unfused_form(tmp_path: Any, kdrop: bool) -> None:
    """On one device, numpy and JAX: the fused kernel's dispatch and combine indices equal
    mindformers' unfused computation on 4 groups of 12 tokens choosing 3 of 6 experts with
    capacity 5 (some experts overflow, some have empty slots)."""
    sizes = dict(groups=4, tokens=12, k=3, experts=6, capacity=5, dp=1, kdrop=kdrop, seed=3)
    fused = _router_program(tmp_path, "fused", fused=True, **sizes)
    unfused = _router_program(tmp_path, "unfused", fused=False, **sizes)
    assert any(n.op == "TopKRouter" for n in fused.graph.nodes)
    assert not any(n.op == "TopKRouter" for n in unfused.graph.nodes)
    x = np.random.default_rng(3).standard_normal((4, 12, 6)).astype(np.float32)
    want = StandAloneRunner(unfused, "numpy").run([x])
    assert np.any(want[0] == 0) and np.any(want[1] % 6 == 0)  # empty slots, dropped choices
    for backend in ("numpy", "jax"):
        got = StandAloneRunner(fused, backend).run([x])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=backend)


def test_fused_router_split_by_group_computes_the_single_device_result(tmp_path: Any) -> None:
    program = _router_program(tmp_path, "split", groups=8, tokens=6, k=2, experts=4,
                              capacity=2, dp=8, fused=True, kdrop=False, seed=5)
    report = check(program)
    assert report.ok() and max(report.errors.values()) == 0.0, report.errors


@settings(max_examples=8, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 1]))
def test_router_rule_matches_the_oracle(data: Any, devices: int, drop_type: int) -> None:
    x = np.random.default_rng(devices).integers(0, 5, (8, 6, 2)).astype(np.int32)
    attrs = {"capacity": 3, "expert_num": 5, "drop_type": drop_type}
    strategy = draw_strategy(data.draw, "TopKRouter", [x], attrs, devices)
    run_sharded("TopKRouter", [x], attrs, strategy, devices)


def test_a_token_split_is_refused_with_one_message(tmp_path: Any) -> None:
    source = ROUTER.replace("self.topkrouter = P._inner_ops.TopKRouter().shard(((dp, 1, 1),))",
                            "self.topkrouter = P._inner_ops.TopKRouter().shard(((1, 2, 1),))")
    path = tmp_path / "bad.py"
    path.write_text(textwrap.dedent(source.format(groups=2, tokens=16, k=2, experts=4,
                                                  capacity=3, dp=2, fused=True, kdrop=False,
                                                  seed=0)))
    with pytest.raises(PcompileError) as info:
        compile_model(str(path), devices=2, dump=False)
    message = str(info.value)
    assert "TopKRouter" in message and "topkrouter" in message and "bad.py:" in message
    assert "the tokens and choices of a group" in message, message
