"""A small GPT-style decoder: token + position embedding, pre-LayerNorm blocks with causal
multi-head attention (BatchMatMul, Softmax) and a GeLU MLP, final LayerNorm, LM head and
cross-entropy over next tokens.

The sizes come from environment variables, so the benchmarks compile anything from the
default toy to a 7B-class model from the same file: GPT_LAYERS (default 2), GPT_BATCH (global
batch, default 8), GPT_HIDDEN (32), GPT_HEADS (4), GPT_SEQ (16), GPT_VOCAB (64).

Pipeline parallelism: with `pipeline_stages` S > 1 in the context, model() puts the embedding in
stage 0, the head (final LayerNorm, LM head) in stage S-1 and spreads the blocks between
(`pipeline_stage`); GPT_MICRO=m makes model() return
`nn.PipelineCell(nn.WithLossCell(gpt, nn.CrossEntropyLoss()), m)` (the loss is then part of
the model, and the file defines no loss()). With `pipeline_config={"pipeline_interleave": True}`
the cells are spread over S x GPT_CHUNKS (default 2) chunks instead: chunk c runs on stage
c % S as `pipeline_segment` c // S.

    GPT_MICRO=4 pcompile examples/gpt_block.py --devices 8 --parallel-mode semi_auto_parallel \
        --pipeline-stages 4

    GPT_LAYERS=8 pcompile examples/gpt_block.py --devices 8 --search recursive_programming
    GPT_LAYERS=32 GPT_HIDDEN=4096 GPT_HEADS=32 GPT_SEQ=2048 GPT_VOCAB=32000 GPT_BATCH=64 \
        pcompile examples/gpt_block.py --devices 64 --search sharding_propagation --no-check
"""

import os

import numpy as np

from pcompile import Parameter, get_auto_parallel_context, initializer, nn, ops, set_seed

VOCAB = int(os.environ.get("GPT_VOCAB", "64"))
SEQ = int(os.environ.get("GPT_SEQ", "16"))
HIDDEN = int(os.environ.get("GPT_HIDDEN", "32"))
HEADS = int(os.environ.get("GPT_HEADS", "4"))
BATCH = int(os.environ.get("GPT_BATCH", "8"))
LAYERS = int(os.environ.get("GPT_LAYERS", "2"))
MICRO = int(os.environ.get("GPT_MICRO", "0"))  # > 0: model() returns nn.PipelineCell


class Attention(nn.Cell):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query = nn.Dense(hidden, hidden)
        # No key bias: softmax is invariant to it, so its gradient is exactly zero.
        self.key = nn.Dense(hidden, hidden, has_bias=False)
        self.value = nn.Dense(hidden, hidden)
        self.proj = nn.Dense(hidden, hidden)
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.context = ops.BatchMatMul()
        self.scale = ops.Mul()
        self.add_mask = ops.Add()
        self.softmax = ops.Softmax(-1)
        mask = np.triu(np.full((SEQ, SEQ), -1e4, np.float32), k=1)
        self.mask = mask

    def split_heads(self, x, batch, seq):
        x = self.reshape(x, (batch, seq, self.heads, self.head_dim))
        return self.transpose(x, (0, 2, 1, 3))

    def construct(self, x):
        batch, seq, hidden = x.shape
        q = self.split_heads(self.query(x), batch, seq)
        k = self.split_heads(self.key(x), batch, seq)
        v = self.split_heads(self.value(x), batch, seq)
        scores = self.scale(self.scores(q, k), 1.0 / float(np.sqrt(self.head_dim)))
        scores = self.add_mask(scores, self.mask)
        probs = self.softmax(scores)
        ctx = self.context(probs, v)
        ctx = self.reshape(self.transpose(ctx, (0, 2, 1, 3)), (batch, seq, hidden))
        return self.proj(ctx)


class Block(nn.Cell):
    def __init__(self, hidden, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm((hidden,))
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm((hidden,))
        self.fc1 = nn.Dense(hidden, 4 * hidden)
        self.gelu = nn.GELU()
        self.fc2 = nn.Dense(4 * hidden, hidden)
        self.add1 = ops.Add()
        self.add2 = ops.Add()

    def construct(self, x):
        x = self.add1(x, self.attn(self.ln1(x)))
        h = self.fc2(self.gelu(self.fc1(self.ln2(x))))
        return self.add2(x, h)


class GPT(nn.Cell):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.position = Parameter(initializer("normal", [SEQ, HIDDEN]), "position_embedding")
        self.add_pos = ops.Add()
        self.blocks = nn.SequentialCell([Block(HIDDEN, HEADS) for _ in range(layers)])
        self.ln_f = nn.LayerNorm((HIDDEN,))
        self.head = nn.Dense(HIDDEN, VOCAB, has_bias=False)
        self.reshape = ops.Reshape()

    def construct(self, tokens):
        x = self.add_pos(self.embedding(tokens), self.position)
        x = self.ln_f(self.blocks(x))
        logits = self.head(x)
        return self.reshape(logits, (-1, VOCAB))


def assign_stages(gpt, stages, chunks=1):
    """Embedding in the first chunk, head in the last, the blocks spread between (cell i of
    the layers + 2 cells in chunk c = i * stages * chunks // (layers + 2), which is stage
    c % stages, segment c // stages)."""
    cells = [gpt.embedding, *gpt.blocks, gpt.ln_f]
    for i, cell in enumerate(cells):
        chunk = i * stages * chunks // len(cells)
        cell.pipeline_stage = chunk % stages
        cell.pipeline_segment = chunk // stages
    gpt.head.pipeline_stage = stages - 1
    gpt.head.pipeline_segment = chunks - 1


def model():
    set_seed(1)
    gpt = GPT()
    stages = get_auto_parallel_context("pipeline_stages")
    if stages > 1:
        interleave = get_auto_parallel_context("pipeline_config")["pipeline_interleave"]
        assign_stages(gpt, stages, int(os.environ.get("GPT_CHUNKS", "2")) if interleave else 1)
    if MICRO:
        return nn.PipelineCell(nn.WithLossCell(gpt, nn.CrossEntropyLoss()), micro_size=MICRO)
    return gpt


def inputs():
    return (np.zeros((BATCH, SEQ), np.int32),)


if not MICRO:  # with nn.PipelineCell the loss is part of model()

    def loss():
        return nn.CrossEntropyLoss()


def optimizer(params):
    return nn.AdamWeightDecay(params, learning_rate=1e-3, weight_decay=0.01)


def dataset():
    rng = np.random.default_rng(0)
    for _ in range(1000):
        start = rng.integers(0, VOCAB, (BATCH, 1))
        seq = (start + np.arange(SEQ + 1)) % VOCAB  # learnable: next token = token + 1
        yield seq[:, :SEQ].astype(np.int32), seq[:, 1:].reshape(-1).astype(np.int32)
