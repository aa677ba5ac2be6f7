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
from pcompile.compiler.driver.trace_model import trace_cell
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check

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
    return [n.op for n in program.rank_graph(0).nodes]


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
    assert report.ok(), report.errors


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


# -- RmsNorm, as LlamaRMSNorm calls it ----------------------------------------------------------

RMS_NORM_MODEL = """
class LlamaRMSNorm(nn.Cell):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = Parameter(np.linspace(0.5, 1.5, dim, dtype=np.float32), "weight")
        self.norm = ops.RmsNorm(eps)
        self.cast = ops.Cast()
        self.rcast = ops.Cast()

    def construct(self, x):
        original_type = x.dtype
        output = self.norm(self.cast(x, np.float32), self.weight)[0]
        return self.rcast(output, original_type)

    def shard(self, strategy_in):
        self.norm.shard((strategy_in, (1,)))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(3)
        self.w = Parameter(r.standard_normal((16, 16)).astype(np.float32), "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
        self.norm = LlamaRMSNorm(16)
        self.norm.shard((2, 1, 1))
        self.reshape = ops.Reshape()

    def construct(self, x):
        h = self.reshape(self.matmul(x, self.w), (4, 2, 16))
        return self.reshape(self.norm(h), (8, 16))

def model():
    return Net()

def inputs():
    return (np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32),)

def labels():
    return (np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_rms_norm_as_llama_calls_it_trains_like_one_device(tmp_path: Any) -> None:
    program = compile_source(tmp_path, RMS_NORM_MODEL)
    assert "RmsNorm" in node_ops(program) and "RmsNormGrad" in node_ops(program)
    norm = next(n for n in program.rank_graph(0).nodes if n.op == "RmsNorm")
    assert norm.parallel.in_strategy == ((2, 1, 1), (1,))
    report = check(program, steps=2)
    assert report.ok(), report.errors


# -- Tile, as LLamaAttention._repeat_kv calls it -------------------------------------------------

REPEAT_KV_MODEL = """
DP, MP, N_KV, REP, HD, SEQ, HIDDEN = 2, 4, 4, 2, 4, 6, 16


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(5)
        self.wk = Parameter(r.standard_normal((HIDDEN, N_KV * HD)).astype(np.float32), "wk")
        self.matmul = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.shape = ops.Shape()
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose().shard(((DP, 1, MP, 1),))
        self.tile_kv = ops.Tile().shard(((DP, MP, 1, 1),))

    def _repeat_kv(self, x, rep):
        bs, n_kv_head, seqlen, head_dim = self.shape(x)
        x = self.reshape(x, (bs, n_kv_head, 1, seqlen * head_dim))
        x = self.tile_kv(x, (1, 1, rep, 1))
        return self.reshape(x, (bs, n_kv_head * rep, seqlen, head_dim))

    def construct(self, x):
        bs, seq, _ = self.shape(x)
        k = self.reshape(self.matmul(self.reshape(x, (bs * seq, HIDDEN)), self.wk),
                         (bs, seq, N_KV, HD))
        k = self.transpose(k, (0, 2, 1, 3))
        return self._repeat_kv(k, REP)

def model():
    return Net()

def inputs():
    return (np.random.default_rng(0).standard_normal((4, SEQ, HIDDEN)).astype(np.float32),)

def labels():
    return (np.random.default_rng(1).standard_normal((4, N_KV * REP, SEQ, HD))
            .astype(np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_tile_as_repeat_kv_calls_it_trains_like_one_device(tmp_path: Any) -> None:
    program = compile_source(tmp_path, REPEAT_KV_MODEL)
    tile = next(n for n in program.rank_graph(0).nodes if n.op == "Tile")
    assert tile.parallel.in_strategy == ((2, 4, 1, 1),)
    report = check(program, steps=2)
    assert report.ok(), report.errors


# -- OneHot with MindSpore's ((dp, mp), (), ()) strategy -----------------------------------------

ONE_HOT_MODEL = """
DP, MP, V = 2, 4, 16


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(7)
        self.w = Parameter(r.standard_normal((8, V)).astype(np.float32), "w")
        self.matmul = ops.MatMul().shard(((DP, 1), (1, MP)))
        self.onehot = ops.OneHot().shard(((DP, MP), (), ()))
        self.on_value = Tensor(1.0, np.float32)
        self.off_value = Tensor(0.0, np.float32)
        self.mul = ops.Mul().shard(((DP, MP), (DP, MP)))

    def construct(self, x, ids):
        logits = self.matmul(x, self.w)
        hot = self.onehot(ids, V, self.on_value, self.off_value)
        return self.mul(logits, hot)

def model():
    return Net()

def inputs():
    r = np.random.default_rng(0)
    return (r.standard_normal((8, 8)).astype(np.float32),
            r.integers(0, V, (8,)).astype(np.int32))

def labels():
    return (np.random.default_rng(1).standard_normal((8, V)).astype(np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_one_hot_mindspore_strategy_splits_depth_and_trains_like_one_device(
        tmp_path: Any) -> None:
    program = compile_source(tmp_path, ONE_HOT_MODEL)
    graph = program.rank_graph(5)
    hot = next(n for n in graph.nodes if n.op == "OneHot")
    assert hot.parallel.in_strategy == ((2, 4), (), ()) and hot.attrs["depth"] == 4
    shift = hot.operands[0].node
    assert shift.op == "Sub" and int(shift.operands[1].array) == 4  # rank 5: classes 4..7
    report = check(program, steps=2)
    assert report.ok(), report.errors


# -- FlashAttentionScore, as mindformers' FlashAttention cell calls it ---------------------------

ATTENTION_MODEL = """
import math

DP, MP, B, S, N, N_KV, D = 2, 4, 4, 8, 8, 4, 4
HIDDEN = N * D


class FlashAttention(nn.Cell):
    def __init__(self, head_num, pre_tokens, next_tokens, input_layout, sparse_mode,
                 scale_value):
        super().__init__()
        self.flash_attention = ops.FlashAttentionScore(
            head_num=head_num, keep_prob=1.0, scale_value=scale_value, pre_tokens=pre_tokens,
            next_tokens=next_tokens, inner_precise=0, input_layout=input_layout,
            sparse_mode=sparse_mode)

    def construct(self, query, key, value, attn_mask=None, alibi_mask=None, prefix=None,
                  padding_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        _, _, _, output = self.flash_attention(query, key, value, alibi_mask, None,
                                               padding_mask, attn_mask, prefix,
                                               actual_seq_qlen, actual_seq_kvlen)
        return output

    def shard(self, dp, mp):
        self.flash_attention.shard(((dp, mp, 1, 1), (dp, mp, 1, 1), (dp, mp, 1, 1),
                                    (dp, 1, 1, 1)))
        return self


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        r = np.random.default_rng(11)
        w = lambda o, i: Parameter(  # noqa: E731
            (r.standard_normal((o, i)) / math.sqrt(i)).astype(np.float32))
        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN), w(N_KV * D, HIDDEN),
                                              w(N_KV * D, HIDDEN), w(HIDDEN, HIDDEN))
        self.mm_q = ops.MatMul(transpose_b=True).shard(((DP, 1), (MP, 1)))
        self.mm_k = ops.MatMul(transpose_b=True).shard(((DP, 1), (MP, 1)))
        self.mm_v = ops.MatMul(transpose_b=True).shard(((DP, 1), (MP, 1)))
        self.mm_o = ops.MatMul(transpose_b=True).shard(((DP, MP), (1, MP)))
        self.shape = ops.Shape()
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose().shard(((DP, 1, MP, 1),))
        self.merger_head_transpose = ops.Transpose().shard(((DP, MP, 1, 1),))
        self.flash_attention = FlashAttention(N, 65536, 0, "BNSD", 0,
                                              1.0 / math.sqrt(D)).shard(DP, MP)
        mask = np.triu(np.ones((S, S), np.uint8), 1)
        self.mask = Tensor(np.broadcast_to(mask, (B, 1, S, S)).copy())

    def heads(self, x, n):
        bs, seq, _ = self.shape(x)
        return self.transpose(self.reshape(x, (bs, seq, n, D)), (0, 2, 1, 3))

    def construct(self, x):
        bs, seq, _ = self.shape(x)
        flat = self.reshape(x, (bs * seq, HIDDEN))
        q = self.heads(self.reshape(self.mm_q(flat, self.wq), (bs, seq, HIDDEN)), N)
        k = self.heads(self.reshape(self.mm_k(flat, self.wk), (bs, seq, N_KV * D)), N_KV)
        v = self.heads(self.reshape(self.mm_v(flat, self.wv), (bs, seq, N_KV * D)), N_KV)
        context = self.flash_attention(q, k, v, self.mask)
        context = self.merger_head_transpose(context, (0, 2, 1, 3))
        context = self.reshape(context, (bs * seq, HIDDEN))
        return self.reshape(self.mm_o(context, self.wo), (bs, seq, HIDDEN))

def model():
    return Attention()

def inputs():
    return (np.random.default_rng(0).standard_normal((B, S, HIDDEN)).astype(np.float32),)

def labels():
    return (np.random.default_rng(1).standard_normal((B, S, HIDDEN)).astype(np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_flash_attention_as_mindformers_calls_it_trains_like_one_device(tmp_path: Any) -> None:
    """BNSD, grouped-query attention (8 query heads, 4 kv heads), the causal (B, 1, S, S)
    uint8 mask with sparse_mode 0, pre_tokens 65536, next_tokens 0; dp 2 x mp 4."""
    program = compile_source(tmp_path, ATTENTION_MODEL)
    graph = program.rank_graph(3)
    fa = next(n for n in graph.nodes if n.op == "FlashAttentionScore")
    assert fa.attrs["head_num"] == 2 and fa.operands[0].shape == (2, 2, 8, 4)
    assert fa.operands[1].shape == (2, 1, 8, 4) and fa.operands[3].shape == (2, 1, 8, 8)
    assert "FlashAttentionScoreGrad" in node_ops(program)
    report = check(program, steps=2)
    assert report.ok(), report.errors


def test_flash_attention_refuses_unsupported_inputs_with_one_message(tmp_path: Any) -> None:
    with pytest.raises(PcompileError, match="optional input.s. drop_mask are not supported"):
        compile_source(tmp_path, """
            class Net(nn.Cell):
                def __init__(self):
                    super().__init__()
                    self.fa = ops.FlashAttentionScore(head_num=2, input_layout="BSH")

                def construct(self, q, mask):
                    return self.fa(q, q, q, None, mask)[3]

            def model():
                return Net()

            def inputs():
                return (np.ones((8, 4, 8), np.float16), np.ones((8, 2, 4, 1), np.uint8))
        """)


def test_flash_attention_with_a_split_query_sequence_trains_like_one_device(
        tmp_path: Any) -> None:
    """Context parallel as mindformers shards it: query (dp, mp, cp, 1), key/value
    (dp, mp, 1, 1), mask (dp, 1, cp, 1); the second half of the sequence moves its window."""
    body = ATTENTION_MODEL.replace(
        "self.flash_attention.shard(((dp, mp, 1, 1), (dp, mp, 1, 1), (dp, mp, 1, 1),\n"
        "                                    (dp, 1, 1, 1)))",
        "self.flash_attention.shard(((dp, 2, 2, 1), (dp, 2, 1, 1), (dp, 2, 1, 1),\n"
        "                                    (dp, 1, 2, 1)))")
    assert "(dp, 2, 2, 1)" in body
    program = compile_source(tmp_path, body)
    windows = {(n.attrs["pre_tokens"], n.attrs["next_tokens"])
               for r in range(len(program.rank_graphs))
               for n in program.rank_graph(r).nodes if n.op == "FlashAttentionScore"}
    assert windows == {(65536, 0), (65532, 4)}
    report = check(program, steps=2)
    assert report.ok(), report.errors
