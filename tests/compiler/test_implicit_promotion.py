"""MindSpore's implicit type conversion for mixed-dtype arithmetic (compiler/frontend/primitive.py
`implicit_dtype`): the front end converts the operands to one dtype and the dumps show the
Casts; the IR ops themselves keep requiring one dtype (tests/ir/test_ops_elementwise.py)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from pcompile import Tensor, ops
from pcompile.compiler.frontend.primitive import implicit_dtype
from pcompile.ir.types import DType

F16, BF16, F32, F64 = DType.float16, DType.bfloat16, DType.float32, DType.float64
I32, I64, U8, B = DType.int32, DType.int64, DType.uint8, DType.bool_


def t(dtype: DType) -> Tensor:
    return Tensor(np.zeros((2,)), dtype)


@pytest.mark.parametrize(("args", "want"), [
    ((t(F32), t(B)), F32),        # Float32 x Bool (mindformers' MoE routing)
    ((t(I32), t(F32)), F32),      # Int32 + Float32
    ((t(U8), t(I32)), I32),
    ((t(I32), t(I64)), I64),
    ((t(F16), t(F32)), F32),
    ((t(F16), t(BF16)), F32),     # neither holds the other
    ((t(F32), t(F64)), F64),
    ((t(F16), 2.5), F16),         # a scalar takes the tensor's dtype...
    ((t(I32), 0.5), F32),         # ... but a float scalar makes integers float32
    ((t(B), 0.5), F32),
    ((t(B), 3), I32),             # and an int scalar makes bool int32
    ((t(B), True), B),
    ((t(I32), 3), I32),
    ((t(F32), t(I32), 2), F32),
    ((t(F32), t(F32)), None),     # one dtype and no scalar: nothing to do
    ((1.0, 2.0), None),           # no tensor: nothing to do here
])
def test_mindspores_conversion_rules(args: tuple, want: DType | None) -> None:
    assert implicit_dtype("Mul", list(args)) == want
    assert implicit_dtype("MatMul", list(args)) is None  # not an implicit-conversion op


def test_eager_mixed_dtypes_compute_in_the_promoted_dtype() -> None:
    ints = Tensor(np.array([1, 2, 3], np.int32))
    floats = Tensor(np.array([0.5, 1.5, 2.5], np.float32))
    out = ops.Add()(ints, floats)
    assert out.dtype is F32
    np.testing.assert_array_equal(out.asnumpy(), np.array([1.5, 3.5, 5.5], np.float32))
    assert (ints * 0.5).dtype is F32 and (ints * 0.5).asnumpy()[0] == 0.5
    mask = Tensor(np.array([True, False, True]))
    np.testing.assert_array_equal(ops.Mul()(floats, mask).asnumpy(), [0.5, 0.0, 2.5])
    assert ops.Greater()(ints, floats).dtype is B


MODEL = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [8, 4]), "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 1)))
        self.mul = ops.Mul()
        self.add = ops.Add()
        self.greater = ops.Greater()

    def construct(self, x, ids):
        h = self.matmul(x, self.w)
        h = self.mul(h, self.greater(h, 0.0))  # Float32 x Bool
        h = self.add(ids, h)                   # Int32 + Float32
        return h * 2 + ids * 0.5               # a float scalar with an Int32 tensor


def model():
    return Net()


def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((4, 8)).astype(np.float32),
            rng.integers(0, 5, (4, 4)).astype(np.int32)]
"""


def test_a_traced_model_shows_the_casts_and_computes_what_numpy_does(tmp_path) -> None:
    from pcompile.tools.compile import compile as compile_model
    from pcompile.tools.oracle import single_device
    from pcompile.tools.runners import StandAloneRunner

    path = tmp_path / "mixed.py"
    path.write_text(textwrap.dedent(MODEL))
    program = compile_model(str(path), devices=2, out_dir=str(tmp_path / "out"))
    trace = (tmp_path / "out" / "rank_0" / "00_trace.ir").read_text()
    casts = [line for line in trace.splitlines() if "= Cast(" in line]
    assert len(casts) == 3, casts  # the bool mask, ids for the Add, ids for the scalar
    assert all("dst_type: Float32" in line for line in casts)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    ids = rng.integers(0, 5, (4, 4)).astype(np.int32)
    runner = StandAloneRunner(single_device(program), "numpy")
    w = np.asarray(runner.values["w"], np.float32)
    h = x @ w
    h = h * (h > 0).astype(np.float32)
    want = (ids.astype(np.float32) + h) * 2 + ids.astype(np.float32) * np.float32(0.5)
    got = runner.run([x, ids])[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
