"""MindSpore's two-op dropout, `P.DropoutGenMask(Seed0, Seed1)(shape, keep_prob)` and
`P.DropoutDoMask()(x, mask, keep_prob)` (compiler/frontend/dropout.py, ir/ops/random.py): the packed
UInt8 mask holds the bits ops.Dropout draws, DoMask's strategy is MindSpore's one tuple for x,
and every plan trains like one device. MindSpore's tests/ut/python/parallel/
test_dropout_do_mask.py is ported as facts: its five networks compile on 16 devices."""

from __future__ import annotations

import numpy as np
import pytest

from pcompile import Tensor, ops
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

# MindSpore's Net: Mul, GenMask of the Mul's shape with keep_prob Tensor(0.9) cast to the
# Mul's dtype, DoMask, Mul; trained by TrainOneStepCell with Momentum (full batch).
MINDSPORE_NET = """
import numpy as np
from pcompile import Parameter, Tensor, nn, set_auto_parallel_context
from pcompile.ops import operations as P
set_auto_parallel_context(dataset_strategy="full_batch")
S1, S2 = {s1}, {s2}
class Net(nn.Cell):
    def __init__(self, mul_weight, strategy1=None, strategy2=None):
        super().__init__()
        self.mul = P.Mul().shard(strategy1) if strategy1 else P.Mul()
        self.mul2 = P.Mul().shard(strategy1) if strategy1 else P.Mul()
        self.dropout_do_mask = P.DropoutDoMask().shard(strategy2) if strategy2 else \\
            P.DropoutDoMask()
        self.dropout_gen_mask = P.DropoutGenMask({seeds})
        self.get_shape = P.Shape()
        self.cast = P.Cast()
        self.mul_weight = Parameter(mul_weight, "w1")
        self.mul_weight2 = Parameter(mul_weight, "w2")
        self.keep_prob = Tensor(0.9)
    def construct(self, x, b):
        out = self.mul(x, self.mul_weight)
        shape = self.get_shape(out)
        dtype = P.DType()(out)
        keep_prob = self.cast(self.keep_prob, dtype)
        mask = {mask}
        out = self.dropout_do_mask(out, mask, keep_prob)
        out = self.mul2(out, self.mul_weight2)
        return out
def model():
    w = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    net = Net(Tensor(w), S1, S2)
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    return nn.TrainOneStepCell(net, opt)
def inputs():
    rng = np.random.default_rng(1)
    return [rng.standard_normal((128, 64)).astype(np.float32), np.ones((128, 64), np.float32)]
"""
GEN = "self.dropout_gen_mask(shape, keep_prob)"

CASES = {  # MindSpore's five: mode, the Muls' strategy, DoMask's strategy
    "data_parallel": ("semi_auto_parallel", ((16, 1), (16, 1)), ((16, 1),)),
    "model_parallel": ("semi_auto_parallel", ((1, 16), (1, 16)), ((1, 16),)),
    "hybrid_parallel": ("semi_auto_parallel", ((4, 4), (4, 4)), ((4, 4),)),
    "auto_parallel": ("auto_parallel", None, None),
    "repeat_calc": ("semi_auto_parallel", ((4, 4), (4, 4)), ((2, 4),)),
}


def _write(tmp_path, name, s1, s2, mask=GEN, seeds=""):
    path = tmp_path / f"do_mask_{name}.py"
    path.write_text(MINDSPORE_NET.format(s1=s1, s2=s2, mask=mask, seeds=seeds))
    return str(path)


def compile_case(tmp_path, name: str, devices: int = 16):
    mode, s1, s2 = CASES[name]
    search = "sharding_propagation" if mode == "auto_parallel" else None
    return compile_model(_write(tmp_path, name, s1, s2), devices=devices, parallel_mode=mode,
                         search_mode=search, dump=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mindspore_do_mask_networks_compile(tmp_path, name: str) -> None:
    program = compile_case(tmp_path, name)
    (gen,) = [n for n in program.graph.nodes if n.op == "DropoutGenMask"]
    (do,) = [n for n in program.graph.nodes if n.op == "DropoutDoMask"]
    assert gen.attrs["shape"] == (128, 64) and gen.attrs["keep_prob"] == pytest.approx(0.9)
    assert gen.result.shape == (1024,)  # 128 * 64 bits in 128-bit blocks: 8192 / 8 bytes
    assert do.operands[1] is gen.result
    strategy = program.state.assignment.sharding(do).strategy
    if CASES[name][2] is not None:
        assert strategy == (CASES[name][2][0], (1,), (1,))  # the mask and offsets whole
    else:  # the propagation gives DoMask the Mul's layout of x
        mul = next(n for n in program.graph.nodes if n.op == "Mul")
        assert strategy[0] == program.state.assignment.sharding(mul).strategy[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid_parallel", "repeat_calc", "auto_parallel"])
def test_mindspore_do_mask_networks_train_like_one_device(tmp_path, name: str) -> None:
    """Two steps on 16 devices (ranks that repeat a block included) equal one device's."""
    report = check(compile_case(tmp_path, name), steps=2)
    assert report.ok(), report


def test_do_mask_trains_like_one_device(tmp_path) -> None:
    """MindSpore's test_dropout_do_mask_repeat_calc on 8 devices (DoMask ((2, 4),) under Muls
    ((4, 2), (4, 2)): a redistribution and repeated ranks) trains like one device."""
    path = _write(tmp_path, "eight", ((4, 2), (4, 2)), ((2, 4),))
    program = compile_model(path, devices=8, parallel_mode="semi_auto_parallel", dump=False)
    report = check(program, steps=2)
    assert report.ok(), report


def test_gen_and_do_mask_drop_what_ops_dropout_drops() -> None:
    """The same seeds and step: DoMask(x, GenMask(shape, keep)) is ops.Dropout(keep)(x), and
    GenMask's bits are Dropout's mask packed (eager calls draw the first step's bits)."""
    x = np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)
    out, kept = ops.Dropout(keep_prob=0.7, Seed0=3, Seed1=4)(x)
    mask = ops.DropoutGenMask(Seed0=3, Seed1=4)((6, 50), Tensor(np.float32(0.7)))
    bits = mask.asnumpy()
    assert bits.dtype == np.uint8 and bits.shape == (48,)
    assert np.array_equal(np.unpackbits(bits, bitorder="little")[:300],
                          kept.asnumpy().reshape(-1).astype(np.uint8))
    got = ops.DropoutDoMask()(x, mask, 0.7)
    np.testing.assert_array_equal(got.asnumpy(), out.asnumpy())


def test_mindspore_refusals(tmp_path) -> None:
    """MindSpore's errors: a DoMask strategy of more than one tuple, keep_prob outside [0, 1]
    or not a float, a mask too short; in a parallel plan a mask that is not a DropoutGenMask's
    output (DropoutDoMaskInfo finds and rewrites that op)."""
    x = np.ones((4, 64), np.float32)
    mask = ops.DropoutGenMask()((4, 64), 0.5)
    with pytest.raises(ValueError, match=r"range \[0, 1\], but got 1.5"):
        ops.DropoutDoMask()(x, mask, 1.5)
    with pytest.raises(TypeError, match="keep_prob input type must be float"):
        ops.DropoutGenMask()((4, 64), 1)
    with pytest.raises(TypeError, match="'shape' must be a tuple of ints"):
        ops.DropoutGenMask()(x, 0.5)
    with pytest.raises(TypeError, match="'Seed0' must be int"):
        ops.DropoutGenMask(Seed0=0.5)
    with pytest.raises(PcompileError, match="fewer than the 512 elements"):
        ops.DropoutDoMask()(np.ones((8, 64), np.float32), mask, 0.5)

    two = _write(tmp_path, "two", ((4, 4), (4, 4)), ((4, 4), (1,)))
    with pytest.raises(PcompileError, match="invalid strategy size 2, it must be 1"):
        compile_model(two, devices=16, parallel_mode="semi_auto_parallel", dump=False)
    ones = "Tensor(np.full((1024,), 255, np.uint8))"
    given = _write(tmp_path, "given", ((4, 4), (4, 4)), ((4, 4),), mask=ones)
    with pytest.raises(PcompileError, match="must be the output of a DropoutGenMask"):
        compile_model(given, devices=16, parallel_mode="semi_auto_parallel", dump=False)
    # on one device any UInt8 mask is read (all bits set: x / keep_prob everywhere)
    compile_model(given, devices=1, dump=False)
