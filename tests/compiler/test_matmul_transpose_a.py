"""MindSpore's test_matmul_transpose_a.py (tests/ut/python/parallel), ported as facts: a Square,
a Transpose of it and a MatMul / BatchMatMul with `transpose_a` (and `transpose_b`), then a
ReLU. MindSpore orders the MatMul's device matrix as the logical operand, `[batch..., M, K, N]`,
so the MatMul reads the Transpose's output as it is and the ReLU reads the MatMul's AllReduce
as it is (its validator's `check_node_inputs_has`); ordered as the stored operand
(`[K, M, N]`) both edges needed a redistribution. Every compiled case is also checked against
the single-device program."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="{mode}", device_num={devices},
                          dataset_strategy="full_batch"{search})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.square = ops.Square(){s0}
        self.matmul = ops.{op}(transpose_a=True, transpose_b={tb}){s1}
        self.transpose = ops.Transpose(){s0}
        self.relu = ops.ReLU(){s2}
        w = np.random.default_rng(1).standard_normal({w}).astype(np.float32)
        self.weight = Parameter(w, "w1")

    def construct(self, x):
        out = self.transpose(self.square(x), {perm})
        return self.relu(self.matmul(out, self.weight))


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal({x}).astype(np.float32),)
"""


def compile_net(tmp_path: Any, op: str, tb: bool, strategies: tuple | None, x: tuple, w: tuple,
                perm: tuple, devices: int = 8) -> Any:
    def shard(s: Any) -> str:
        return "" if s is None else f".shard({s!r})"

    s0, s1, s2 = strategies or (None, None, None)
    mode, search = (("semi_auto_parallel", "") if strategies else
                    ("auto_parallel", ', search_mode="dynamic_programming"'))
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL.format(
        mode=mode, devices=devices, search=search, op=op, tb=tb, s0=shard(s0), s1=shard(s1),
        s2=shard(s2), x=x, w=w, perm=perm)))
    return compile_model(str(path), dump=False)


def producers(graph: Any, op: str) -> list[str]:
    """The ops whose results the forward `op` of rank 0's program reads (a parameter: '')."""
    node = next(n for n in graph.nodes if n.op == op and not n.scope.startswith("Gradients"))
    return [getattr(getattr(v, "node", None), "op", "") for v in node.operands]


#: (test name, op, transpose_b, (Square/Transpose, MatMul, ReLU strategies), x, w, perm,
#: devices, whether the test asserts ReLU-0 reads AllReduce-0)
SEMI_CASES = [
    ("transpose_a", "MatMul", False, (((4, 2),), ((2, 4), (2, 1)), ((4, 1),)),
     (16, 8), (8, 32), (1, 0), 8, True),
    ("transpose_a_data_parallel", "MatMul", False, (((8, 1),), ((1, 8), (1, 1)), ((8, 1),)),
     (16, 8), (8, 32), (1, 0), 8, False),
    ("transpose_a_repeat_calculation", "MatMul", False,
     (((2, 2),), ((2, 2), (2, 1)), ((2, 1),)), (16, 8), (8, 32), (1, 0), 8, True),
    ("transpose_a_b", "MatMul", True, (((4, 2),), ((2, 4), (1, 2)), ((4, 1),)),
     (16, 8), (32, 8), (1, 0), 8, True),
    ("transpose_a_b_repeat_calculation", "MatMul", True,
     (((2, 2),), ((2, 2), (1, 2)), ((2, 1),)), (16, 8), (32, 8), (1, 0), 8, True),
    ("batch_transpose_a", "BatchMatMul", False,
     (((2, 2, 4, 4),), ((2, 2, 4, 4), (4, 1)), ((2, 2, 4, 1),)),
     (2, 4, 8, 16), (16, 32), (0, 1, 3, 2), 64, True),
    ("batch_transpose_a_b", "BatchMatMul", True,
     (((2, 2, 4, 4),), ((2, 2, 4, 4), (1, 4)), ((2, 2, 4, 1),)),
     (2, 4, 8, 16), (32, 16), (0, 1, 3, 2), 64, True),
    ("batch_transpose_a_broadcast", "BatchMatMul", False,
     (((2, 2, 4, 4),), ((2, 2, 4, 4), (2, 1, 4, 1)), ((2, 2, 4, 1),)),
     (2, 4, 8, 16), (2, 1, 16, 32), (0, 1, 3, 2), 64, True),
    ("batch_transpose_a_b_broadcast", "BatchMatMul", True,
     (((2, 2, 4, 4),), ((2, 2, 4, 4), (2, 1, 1, 4)), ((2, 2, 4, 1),)),
     (2, 4, 8, 16), (2, 1, 32, 16), (0, 1, 3, 2), 64, True),
    ("batch_transpose_a_b_broadcast_3x4", "BatchMatMul", True,
     (((2, 4, 4),), ((2, 4, 4), (1, 1, 1, 4)), ((1, 2, 4, 1),)),
     (4, 8, 16), (2, 1, 32, 16), (0, 2, 1), 64, True),
]


@pytest.mark.parametrize("case", SEMI_CASES, ids=[c[0] for c in SEMI_CASES])
def test_semi_auto_transpose_a_reads_its_neighbours_as_they_are(tmp_path: Any,
                                                                 case: tuple) -> None:
    _, op, tb, strategies, x, w, perm, devices, reads_allreduce = case
    program = compile_net(tmp_path, op, tb, strategies, x, w, perm, devices)
    graph = program.rank_graph(0)
    assert producers(graph, "Transpose") == ["Square"]
    assert producers(graph, op) == ["Transpose", ""]
    if reads_allreduce:
        assert producers(graph, "ReLU") == ["AllReduce"]


def test_the_device_matrix_is_the_logical_operands() -> None:
    """((2, 4), (2, 1)) with transpose_a: a stored [K, M] split (2, 4) is the logical
    [M, K] = (4, 2), so the device matrix is [4, 2, 1] and a's tensor map (1, 2) (K on the
    size-2 axis, M on the size-4 one); the output's M keeps the size-4 axis."""
    from pcompile.ir.sharding import OpContext, rule_for
    from pcompile.ir.types import TensorType, float32

    ctx = OpContext("MatMul", [TensorType(float32, (8, 16)), TensorType(float32, (8, 32))],
                    TensorType(float32, (16, 32)), {"transpose_a": True, "transpose_b": False},
                    8)
    rule = rule_for("MatMul")
    assert rule is not None
    sharding = rule.apply(ctx, ((2, 4), (2, 1)))
    a = sharding.in_layouts[0]
    assert sharding.dev_matrix == a.dev_matrix == (4, 2, 1) and a.tensor_map == (1, 2)
    assert sharding.out_layouts[0].tensor_map == (2, -1)


@pytest.mark.parametrize("op,tb,x,w,perm", [
    ("MatMul", False, (16, 8), (8, 32), (1, 0)),
    ("MatMul", True, (16, 8), (32, 8), (1, 0)),
    ("BatchMatMul", False, (8, 4, 8, 16), (8, 1, 16, 32), (0, 1, 3, 2)),
    ("BatchMatMul", True, (8, 4, 8, 16), (8, 1, 32, 16), (0, 1, 3, 2)),
], ids=["matmul", "matmul_b", "batch", "batch_b"])
def test_auto_parallel_transpose_a_reads_the_transpose(tmp_path: Any, op: str, tb: bool,
                                                       x: tuple, w: tuple, perm: tuple) -> None:
    program = compile_net(tmp_path, op, tb, None, x, w, perm)
    graph = program.rank_graph(0)
    assert producers(graph, "Transpose") == ["Square"]
    assert producers(graph, op) == ["Transpose", ""]


@pytest.mark.parametrize("case", [SEMI_CASES[0], SEMI_CASES[2], SEMI_CASES[3]],
                         ids=["transpose_a", "repeat_calculation", "transpose_a_b"])
def test_transpose_a_plans_compute_the_single_device_program(tmp_path: Any,
                                                             case: tuple) -> None:
    _, op, tb, strategies, x, w, perm, devices, _ = case
    report = check(compile_net(tmp_path, op, tb, strategies, x, w, perm, devices))
    assert report.ok(), report.errors


@pytest.mark.parametrize("op,strategies,x,w,tb", [
    ("MatMul", (((2, 2),), ((2, 2), (1, 2)), ((2, 1),)), (16, 8), (8, 32), False),
    ("MatMul", (((2, 2),), ((2, 4), (2, 1)), ((2, 1),)), (16, 8), (32, 8), True),
], ids=["transpose_a", "transpose_a_b"])
def test_mismatched_contraction_splits_are_refused(tmp_path: Any, op: str, strategies: tuple,
                                                   x: tuple, w: tuple, tb: bool) -> None:
    """MindSpore's *_error_strategy cases raise: a's K split differs from b's."""
    with pytest.raises(PcompileError, match="split like the dims it is matched with"):
        compile_net(tmp_path, op, tb, strategies, x, w, (1, 0))
