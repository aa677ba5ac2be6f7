"""The primitives a mindformers-style Llama calls, used as mindformers calls them (its
strategies, its optional arguments, Python-scalar operands), compiled for 8 devices and checked
against the single-device oracle: the gathered outputs of an inference model, or the loss, the
optimizer state and the updated parameters after a training step."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile import Tensor, ops
from pcompile.compiler.driver import compile as compile_model
from pcompile.compiler.oracle import check
from pcompile.compiler.trace_model import trace_cell
from pcompile.ir.errors import PcompileError

HEADER = """\
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, set_auto_parallel_context
set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
"""


def compile_source(tmp_path: Any, body: str, **kwargs: Any) -> Any:
    path = tmp_path / "model.py"
    path.write_text(HEADER + textwrap.dedent(body))
    return compile_model(str(path), dump=False, **kwargs)


def node_ops(program: Any) -> list[str]:
    return [n.op for n in program.rank_graphs[0].nodes]


# -- Shape --------------------------------------------------------------------------------------


def test_shape_is_a_python_tuple_at_trace_time() -> None:
    from pcompile import nn

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.shape = ops.Shape()
            self.reshape = ops.Reshape()

        def construct(self, x):
            bs, seq, hidden = self.shape(x)
            assert (bs, seq, hidden) == (2, 3, 4) and isinstance(bs, int)
            return self.reshape(x, (bs * seq, hidden))

    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    graph, _ = trace_cell(Net(), x)
    assert [n.op for n in graph.nodes] == ["Reshape"]
    assert ops.Shape()(Tensor(x)) == (2, 3, 4) and ops.shape(Tensor(x)) == (2, 3, 4)
    with pytest.raises(TypeError, match="expects a tensor"):
        ops.Shape()(3)


# -- comparisons with a Python scalar and MindSpore's () strategy --------------------------------


def test_not_equal_with_a_scalar_and_its_empty_strategy(tmp_path: Any) -> None:
    program = compile_source(tmp_path, """
        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.shape = ops.Shape()
                self.not_equal = ops.NotEqual().shard(((2, 1), ()))
                self.cast = ops.Cast()
                self.mul = ops.Mul().shard(((2, 4), (2, 4)))
                self.silu = nn.SiLU()
                self.w = Parameter(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "w")
                self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
                self.sum = ops.ReduceSum()

            def construct(self, tokens, x):
                bs, seq = self.shape(tokens)
                mask = self.cast(self.not_equal(tokens, 0), x.dtype)
                h = self.silu(self.matmul(x, self.w))
                return self.sum(self.mul(h, mask), ())

        def model():
            return Net()

        def inputs():
            r = np.random.default_rng(0)
            return (r.integers(0, 3, (8, 8)).astype(np.int32),
                    r.standard_normal((8, 8)).astype(np.float32))
    """)
    assert "NotEqual" in node_ops(program) and "SiLU" in node_ops(program)
    report = check(program)
    assert report.ok(1e-5), report.errors


def test_logical_ops_need_bool_operands(tmp_path: Any) -> None:
    with pytest.raises(PcompileError, match="LogicalAnd.*must be Bool, got Int32"):
        compile_source(tmp_path, """
            class Net(nn.Cell):
                def construct(self, x):
                    return ops.logical_and(ops.greater(x, 0), x)

            def model():
                return Net()

            def inputs():
                return (np.ones((8, 2), np.int32),)
        """)
