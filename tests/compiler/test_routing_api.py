"""The API surface mindformers' DeepSeek-V3 router calls (issue 35): `P.Sign`, `ops.Zeros()(shape,
dtype=...)`, `Tensor.ge`, `Tensor.min`, `Tensor.repeat_interleave`, `Tensor.bool`, unary `~`,
`ops.masked_fill`: each against numpy on concrete tensors, its invalid inputs refused with one
message, and group-limited routing written with them compiled for 8 devices and checked against
the single-device oracle."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile import Tensor, ops
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check


def arr(values: Any, dtype: Any = np.float32) -> Tensor:
    return Tensor(np.asarray(values, dtype))


def test_sign_primitive_and_functional() -> None:
    from pcompile.ops import operations as P  # noqa: N812  (MindSpore's spelling)

    x = np.array([[-3.0, 0.0], [0.5, -0.0]], np.float32)
    for out in (P.Sign()(Tensor(x)), ops.sign(Tensor(x))):
        np.testing.assert_array_equal(out.asnumpy(), np.sign(x))
        assert out.dtype == Tensor(x).dtype


def test_zeros_takes_the_dtype_keyword() -> None:
    out = ops.Zeros()((2, 3), dtype=np.int32)
    assert out.shape == (2, 3) and out.asnumpy().dtype == np.int32 and not out.asnumpy().any()
    ones = ops.Ones()(4, dtype=np.float16)
    assert ones.asnumpy().dtype == np.float16 and (ones.asnumpy() == 1).all()
    with pytest.raises(TypeError, match="Zeros: give the dtype once"):
        ops.Zeros()((2,), np.float32, dtype=np.int32)


def test_tensor_ge_min_bool_and_invert() -> None:
    x = np.array([[3.0, -1.0, 2.0], [0.0, 5.0, 0.0]], np.float32)
    t = Tensor(x)
    np.testing.assert_array_equal(t.ge(2.0).asnumpy(), x >= 2.0)
    np.testing.assert_array_equal(t.min().asnumpy(), x.min())
    np.testing.assert_array_equal(t.min(axis=1).asnumpy(), x.min(axis=1))
    np.testing.assert_array_equal(t.min(0, keepdims=True).asnumpy(), x.min(0, keepdims=True))
    np.testing.assert_array_equal(t.bool().asnumpy(), x != 0)
    np.testing.assert_array_equal((~t.bool()).asnumpy(), x == 0)
    with pytest.raises(TypeError, match="unary ~ .* Bool tensor, got Float32"):
        _ = ~t
    with pytest.raises(ValueError, match="Tensor.min: initial, where and return_indices"):
        t.min(0, return_indices=True)


def test_repeat_interleave_matches_numpy() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = Tensor(x)
    np.testing.assert_array_equal(t.repeat_interleave(2, 1).asnumpy(), np.repeat(x, 2, 1))
    np.testing.assert_array_equal(t.repeat_interleave(3, dim=-2).asnumpy(), np.repeat(x, 3, 0))
    np.testing.assert_array_equal(t.repeat_interleave(2).asnumpy(), np.repeat(x, 2))
    # MindSpore's Tensor.repeat (numpy's), as mindformers' group-limited routing calls it
    np.testing.assert_array_equal(t.repeat(2, axis=-1).asnumpy(), np.repeat(x, 2, -1))
    np.testing.assert_array_equal(t.repeat_interleave([1, 3], 0).asnumpy(),
                                  np.repeat(x, [1, 3], 0))
    np.testing.assert_array_equal(ops.repeat_interleave(t, Tensor(np.array([2, 1, 1])), 1)
                                  .asnumpy(), np.repeat(x, [2, 1, 1], 1))
    with pytest.raises(ValueError, match="repeats has 2 counts for axis 1 of size 3"):
        t.repeat_interleave([1, 2], 1)
    with pytest.raises(ValueError, match=r"axis must be an int in \[-2, 1\]"):
        t.repeat_interleave(2, 2)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        t.repeat_interleave(0, 1)


def test_masked_fill_matches_numpy() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    mask = np.array([True, False, True])
    out = ops.masked_fill(Tensor(x), Tensor(mask), -1.5)
    np.testing.assert_array_equal(out.asnumpy(), np.where(mask, np.float32(-1.5), x))
    ints = np.arange(6, dtype=np.int32).reshape(2, 3)
    out = ops.masked_fill(Tensor(ints), Tensor(mask), Tensor(np.asarray(7.0, np.float32)))
    assert out.dtype == Tensor(ints).dtype
    np.testing.assert_array_equal(out.asnumpy(), np.where(mask, 7, ints))
    with pytest.raises(TypeError, match="masked_fill: mask must be a Bool tensor .* Int32"):
        ops.masked_fill(Tensor(x), Tensor(ints), 0.0)
    with pytest.raises(ValueError, match="masked_fill: value must be a number or a 0-d tensor"):
        ops.masked_fill(Tensor(x), Tensor(mask), Tensor(x))


ROUTER_MODEL = """
import numpy as np
import pcompile.common.dtype as mstype
from pcompile import nn, ops, Parameter, set_auto_parallel_context
from pcompile.ops import operations as P

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
TOKENS, HIDDEN, EXPERTS, GROUPS, TOPK_GROUP = 8, 16, 8, 4, 2


class Router(nn.Cell):
    # group-limited routing as mindformers' TopkRouterV2 writes it (noaux_tc)
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(0)
        self.w = Parameter(r.standard_normal((HIDDEN, EXPERTS)).astype(np.float32), "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
        self.sign = P.Sign()
        self.zeros = ops.Zeros()

    def construct(self, x):
        scores = ops.sigmoid(self.matmul(x, self.w))
        grouped = scores.reshape(TOKENS, GROUPS, EXPERTS // GROUPS)
        group_score = grouped.min(axis=-1)
        floor = group_score.min(axis=-1, keepdims=True)
        chosen = group_score.ge(floor + 0.05)
        dropped = ~(group_score - floor).bool()
        keep = chosen.repeat_interleave(EXPERTS // GROUPS, dim=-1)
        routed = ops.masked_fill(scores, ~keep, 0.0)
        load = self.zeros((EXPERTS,), dtype=mstype.float32) + self.sign(scores.sum(0) - 4.0)
        return routed + load, dropped


def model():
    return Router()


def inputs():
    return np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
"""


def test_group_limited_routing_compiles_and_matches_single_device(tmp_path: Any) -> None:
    path = tmp_path / "router.py"
    path.write_text(textwrap.dedent(ROUTER_MODEL))
    program = compile_model(str(path), dump=False)
    ops_used = {n.op for n in program.rank_graph(0).nodes}
    assert {"Sign", "ReduceMin", "GreaterEqual", "LogicalNot", "Select"} <= ops_used
    report = check(program)
    assert report.ok(), report.errors


SWIGLU_MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, Layout, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
DP, MP, BS, SEQ, HIDDEN, FF = 2, 4, 2, 4, 8, 16


class FeedForward(nn.Cell):
    # mindformers' FeedForward with use_fused_swiglu (ffn_concat off)
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(3)
        self.w1 = Parameter(0.3 * r.standard_normal((HIDDEN, FF)).astype(np.float32), "w1")
        self.w3 = Parameter(0.3 * r.standard_normal((HIDDEN, FF)).astype(np.float32), "w3")
        self.w2 = Parameter(0.3 * r.standard_normal((FF, HIDDEN)).astype(np.float32), "w2")
        self.matmul1 = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.matmul3 = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.matmul2 = ops.MatMul().shard(((DP, MP), (MP, 1)))
        self.expand_dims = ops.ExpandDims().shard(((DP, 1, MP),))
        self.w13_concat = ops.Concat(-2).shard(((DP, 1, 1, MP), (DP, 1, 1, MP)))
        self.swiglu = ops.auto_generate.gen_ops_prim.Swiglu()
        layout = Layout((DP, 1, MP), ("dp", "cp", "mp"))
        self.swiglu.shard((layout("dp", "cp", "None", "mp"),),
                          (layout("dp", "cp", "None", "mp"),))
        self.swiglu.add_prim_attr("self_define_shard", True)
        self.reshape = ops.Reshape()

    def construct(self, x):
        flat = self.reshape(x, (BS * SEQ, HIDDEN))
        gate = self.reshape(self.matmul1(flat, self.w1), (BS, SEQ, FF))
        hidden = self.reshape(self.matmul3(flat, self.w3), (BS, SEQ, FF))
        gate_hidden = self.w13_concat((self.expand_dims(gate, -2), self.expand_dims(hidden, -2)))
        out = self.swiglu(gate_hidden, -2)
        out = self.reshape(out, (BS * SEQ, FF))
        return self.reshape(self.matmul2(out, self.w2), (BS, SEQ, HIDDEN))


def model():
    return FeedForward()


def inputs():
    return (np.random.default_rng(0).standard_normal((BS, SEQ, HIDDEN)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((BS, SEQ, HIDDEN)).astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_fused_swiglu_feed_forward_matches_single_device(tmp_path: Any) -> None:
    path = tmp_path / "ffn.py"
    path.write_text(textwrap.dedent(SWIGLU_MODEL))
    program = compile_model(str(path), dump=False)
    nodes = program.rank_graph(0).nodes
    swiglu = next(n for n in nodes if n.op == "Swiglu")
    assert swiglu.operands[0].shape == (1, 4, 2, 4)  # (dp, 1, 1, mp) of (2, 4, 2, 16)
    assert swiglu.result.shape == (1, 4, 1, 4)
    assert "SwigluGrad" in {n.op for n in nodes}
    report = check(program, steps=2)
    assert report.ok(), report.errors


ROPE_MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
DP, MP, BS, SEQ, HEADS, HEAD_DIM = 2, 4, 2, 4, 4, 4
HIDDEN = HEADS * HEAD_DIM


class Attention(nn.Cell):
    # the query projection and mindformers' fused rope (use_fused_rope), BNSD
    def __init__(self, mode):
        super().__init__()
        r = np.random.default_rng(3)
        self.wq = Parameter(0.3 * r.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), "wq")
        self.matmul = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.transpose = ops.Transpose().shard(((DP, 1, MP, 1),))
        self.rope = ops.auto_generate.gen_ops_prim.RotaryPositionEmbedding()
        self.rope.shard(((DP, MP, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)))
        angles = np.outer(np.arange(SEQ), np.linspace(0.1, 1.0, HEAD_DIM // 2))
        freqs = np.concatenate([angles, angles], -1).reshape(1, 1, SEQ, HEAD_DIM)
        self.cos = Tensor(np.cos(freqs).astype(np.float32))
        self.sin = Tensor(np.sin(freqs).astype(np.float32))
        self.mode = mode
        self.reshape = ops.Reshape()

    def construct(self, x):
        q = self.matmul(self.reshape(x, (BS * SEQ, HIDDEN)), self.wq)
        q = self.transpose(self.reshape(q, (BS, SEQ, HEADS, HEAD_DIM)), (0, 2, 1, 3))
        return self.rope(q, self.cos, self.sin, self.mode)


def model():
    return Attention(MODE)


def inputs():
    return (np.random.default_rng(0).standard_normal((BS, SEQ, HIDDEN)).astype(np.float32),)


def labels():
    return (np.random.default_rng(1).standard_normal((BS, HEADS, SEQ, HEAD_DIM))
            .astype(np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


@pytest.mark.parametrize("mode", [0, 1])
def test_fused_rope_matches_single_device(tmp_path: Any, mode: int) -> None:
    path = tmp_path / "rope.py"
    path.write_text(f"MODE = {mode}\n" + textwrap.dedent(ROPE_MODEL))
    program = compile_model(str(path), dump=False)
    nodes = program.rank_graph(0).nodes
    rope = next(n for n in nodes if n.op == "RotaryPositionEmbedding")
    assert rope.attrs["mode"] == mode
    assert rope.operands[0].shape == (1, 1, 4, 4) and rope.operands[1].shape == (1, 1, 4, 4)
    assert "RotateHalf" in {n.op for n in nodes}  # x's gradient
    report = check(program, steps=2)
    assert report.ok(), report.errors
