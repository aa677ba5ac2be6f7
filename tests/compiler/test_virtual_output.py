"""MindSpore's test_virtual_output.py (tests/ut/python/parallel), ported as facts: a network
compiled for prediction (semi_auto_parallel or auto_parallel, no loss) gets a `_VirtualOutput`
after every non-scalar output, whose strategy splits the batch dim over all 8 devices with
dataset_strategy="data_parallel" (`v[0][0] == 8`) and keeps it whole with "full_batch"
(`v[0][0] == 1`); a scalar output gets none. pcompile left each output in its producer's
layout. Every case is also checked against the single-device program."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

HEADER = """
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="{mode}", device_num=8,
                          dataset_strategy="{dataset}"{search})
r = np.random.default_rng(1)
"""

NETS = {
    # DenseMutMulNet: three Dense of x, q @ k.T, (.) @ v, a Dense whose MatMul is configured
    "dense": """
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(128, 768)
        self.fc2 = nn.Dense(128, 768)
        self.fc3 = nn.Dense(128, 768)
        self.fc4 = nn.Dense(768, 768, has_bias=False)
        self.relu4 = nn.ReLU()
        self.relu5 = nn.ReLU()
        self.transpose = ops.Transpose()
        self.matmul1 = ops.MatMul()
        self.matmul2 = ops.MatMul()
        self.fc4.matmul.shard(((1, 1), (8, 1)))

    def construct(self, x):
        q, k, v = self.fc1(x), self.fc2(x), self.fc3(x)
        c = self.relu4(self.matmul1(q, self.transpose(k, (1, 0))))
        return self.fc4(self.relu5(self.matmul2(c, v)))


def inputs():
    return (r.standard_normal((32, 128)).astype(np.float32) * 0.01,)
""",
    # MulNegTwoOutputNet: two outputs
    "two_outputs": """
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mul = ops.Mul().shard(((2, 4), (2, 4)))
        self.neg = ops.Neg().shard(((2, 4),))
        self.mul_weight = Parameter(r.standard_normal((32, 128)).astype(np.float32), "weight")

    def construct(self, x):
        out1 = self.mul(x, self.mul_weight)
        return out1, self.neg(out1)


def inputs():
    return (r.standard_normal((32, 128)).astype(np.float32),)
""",
    # ReshapeMatMulNet: x (64, 4, 7) reshaped to (64, 28), MatMul ((1, 1), (1, 8))
    "reshape_matmul": """
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.reshape = ops.Reshape()
        self.matmul = ops.MatMul().shard(((1, 1), (1, 8)))
        self.matmul_weight = Parameter(r.standard_normal((28, 64)).astype(np.float32), "weight")

    def construct(self, x):
        return self.matmul(self.reshape(x, (64, 28)), self.matmul_weight)


def inputs():
    return (r.standard_normal((64, 4, 7)).astype(np.float32),)
""",
    # MatMulReshapeNet: MatMul ((1, 1), (1, 8)) of x (128, 28), reshaped to (64, -1)
    "matmul_reshape": """
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.reshape = ops.Reshape()
        self.matmul = ops.MatMul().shard(((1, 1), (1, 8)))
        self.matmul_weight = Parameter(r.standard_normal((28, 64)).astype(np.float32), "weight")

    def construct(self, x):
        return self.reshape(self.matmul(x, self.matmul_weight), (64, -1))


def inputs():
    return (r.standard_normal((128, 28)).astype(np.float32),)
""",
    # ReshapeMulNet: the weight reshaped to (1, 128, 96) times itself, Mul ((1, 2, 4), (2, 4))
    "reshape_mul": """
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.reshape = ops.Reshape()
        self.mul = ops.Mul().shard(((1, 2, 4), (2, 4)))
        self.mul_weight = Parameter(r.standard_normal((128, 96)).astype(np.float32), "weight")

    def construct(self, x):
        return self.mul(self.reshape(self.mul_weight, (1, 128, 96)), self.mul_weight)


def inputs():
    return (r.standard_normal((64, 4)).astype(np.float32),)
""",
    # a scalar output and a tensor one (MindSpore's scalar-output cases: the scalar loss of
    # a WithEvalCell gets no _VirtualOutput)
    "scalar_and_tensor": """
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mul = ops.Mul().shard(((2, 4), (2, 4)))
        self.mean = ops.ReduceMean()
        self.mul_weight = Parameter(r.standard_normal((32, 128)).astype(np.float32), "weight")

    def construct(self, x):
        out = self.mul(x, self.mul_weight)
        return self.mean(out), out


def inputs():
    return (r.standard_normal((32, 128)).astype(np.float32),)
""",
}

FOOTER = """

def model():
    return Net()
"""


def compile_net(tmp_path: Any, net: str, mode: str, dataset: str) -> Any:
    search = ', search_mode="sharding_propagation"' if mode == "auto_parallel" else ""
    path = tmp_path / f"{net}.py"
    path.write_text(textwrap.dedent(HEADER.format(mode=mode, dataset=dataset, search=search))
                    + NETS[net] + FOOTER)
    return compile_model(str(path), dump=False)


def batch_splits(program: Any) -> list[int | None]:
    """The split of dim 0 of every output as the ranks return it (None: a scalar)."""
    return [None if not layout.shape else layout.splits[0]
            for layout in program.state.output_layouts]


CASES = [  # (network, mode, dataset_strategy, MindSpore's v[0][0] per non-scalar output)
    ("dense", "semi_auto_parallel", "data_parallel", [8]),
    ("dense", "semi_auto_parallel", "full_batch", [1]),
    ("dense", "auto_parallel", "data_parallel", [8]),
    ("dense", "auto_parallel", "full_batch", [1]),
    ("two_outputs", "semi_auto_parallel", "data_parallel", [8, 8]),
    ("two_outputs", "semi_auto_parallel", "full_batch", [1, 1]),
    ("two_outputs", "auto_parallel", "data_parallel", [8, 8]),
    ("two_outputs", "auto_parallel", "full_batch", [1, 1]),
    ("reshape_matmul", "semi_auto_parallel", "data_parallel", [8]),
    ("reshape_matmul", "auto_parallel", "data_parallel", [8]),
    ("matmul_reshape", "semi_auto_parallel", "data_parallel", [8]),
    ("matmul_reshape", "auto_parallel", "data_parallel", [8]),
    ("reshape_mul", "semi_auto_parallel", "full_batch", [1]),
    ("reshape_mul", "auto_parallel", "full_batch", [1]),
]
FAST = {("two_outputs", "semi_auto_parallel", "data_parallel"),
        ("two_outputs", "semi_auto_parallel", "full_batch"),
        ("matmul_reshape", "auto_parallel", "data_parallel")}


@pytest.mark.parametrize("net,mode,dataset,want", [
    pytest.param(*case, marks=() if case[:3] in FAST else pytest.mark.slow,
                 id="-".join(case[:3])) for case in CASES])
def test_prediction_outputs_take_virtual_output_layouts(tmp_path: Any, net: str, mode: str,
                                                        dataset: str, want: list[int]) -> None:
    program = compile_net(tmp_path, net, mode, dataset)
    assert not program.training
    assert batch_splits(program) == want
    for layout in program.state.output_layouts:
        # the batch dim over every device in rank order, or whole: nothing else split
        assert all(s == 1 for s in layout.splits[1:])
    report = check(program)
    assert report.ok(), report.errors


def test_a_rank_returns_its_rows_or_the_whole_output(tmp_path: Any) -> None:
    """What a rank's prediction output holds: with data_parallel rank r's block of rows
    (4 of 32: rows 4r to 4r + 4), whole dims after; with full_batch the whole output; a scalar
    as it is, on every rank."""
    program = compile_net(tmp_path, "scalar_and_tensor", "semi_auto_parallel", "data_parallel")
    assert batch_splits(program) == [None, 8]
    graph = program.rank_graph(3)
    assert [tuple(v.shape) for v in graph.outputs] == [(), (4, 128)]
    assert program.state.output_layouts[1].slice_bounds(3) == ((12, 16), (0, 128))
    report = check(program)
    assert report.ok(), report.errors
    program = compile_net(tmp_path, "scalar_and_tensor", "semi_auto_parallel", "full_batch")
    assert [tuple(v.shape) for v in program.rank_graph(3).outputs] == [(), (32, 128)]
