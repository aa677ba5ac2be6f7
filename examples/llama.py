"""Llama as mindformers writes it (training path): token embedding, decoder layers of RMSNorm,
grouped-query attention with rotary position embedding (flash attention, or the BatchMatMul
path), a residual, RMSNorm, a SwiGLU feed-forward and a residual; a final RMSNorm, the LM head
and mindformers' masked cross-entropy computed inside the network from the token ids.

Written from mindformers' architecture (`LlamaForCausalLM`, `LLamaDecodeLayer`,
`LLamaAttention`, `LlamaFeedForward`, `LlamaRMSNorm`, `RotaryEmbedding`, `Linear`,
`CrossEntropyLoss`) with its primitives and `.shard()` strategies. Data parallel (dp) and model
parallel (mp) come from the parallel context: mp = LLAMA_MP (default 4, at most the device
count), dp = devices / mp; dp 2 x mp 4 on 8 devices. Parameters are float32; the compute dtype
(bfloat16 by default, as mindformers trains) is reached through explicit Casts, the norms, the
rotary embedding, the softmax and the loss computing in float32.

Sizes come from a preset, LLAMA_PRESET: `tiny` (default: compiles and checks in seconds),
`llama2_7b` (32 layers, hidden 4096, 32 heads, FFN 11008, vocab 32000, sequence 4096),
`llama3_8b` (32 layers, hidden 4096, 32 heads, 8 kv heads, FFN 14336, vocab 128256, sequence
8192, RoPE theta 500000) or `llama2_70b` (80 layers, hidden 8192, 64 heads, 8 kv heads, FFN
28672, vocab 32000, sequence 4096, global batch 128). Any size is overridden by LLAMA_LAYERS,
LLAMA_HIDDEN, LLAMA_HEADS, LLAMA_KV_HEADS, LLAMA_FFN, LLAMA_VOCAB, LLAMA_SEQ (tokens seen per
sample; the data has one more), LLAMA_BATCH (global batch). Other knobs:

* LLAMA_DTYPE: compute dtype, `bfloat16` (default), `float16` or `float32`;
* LLAMA_FLASH: `1` (default) FlashAttentionScore (BNSD, causal uint8 mask), `0` the
  BatchMatMul + Softmax path with Tile-repeated kv heads;
* LLAMA_RECOMPUTE: `none` (default), `full` (`Cell.recompute()` on every decoder layer, as
  mindformers' `recompute: True`) or `select` (mindformers' select_recompute: the SwiGLU's
  gate path (w1's Casts, SiLU, Reshape) and Mul, and without flash attention the attention
  core's primitives);
* LLAMA_VOCAB_EMB_DP: `1` (default, mindformers' `vocab_emb_dp`: the embedding table is
  replicated, the lookup split by batch) or `0` (the table split by vocabulary rows over mp);
* LLAMA_SEQ_PARALLEL: `0` (default) or `1` (mindformers' `use_seq_parallel`, as in its
  Llama-2-70B configuration): the norms and residual adds are split over the sequence on the
  model-parallel axis ((dp, mp, 1)), wo and w2 reduce-scatter their output over the tokens
  (`out_strategy` ((dp * mp, 1),)) instead of all-reducing it, and the column-parallel
  projections gather their input: the same bytes, the norms' and residuals' activations
  divided by mp;
* LLAMA_STRATEGIES: `hand` (default: mindformers' shard() strategies, semi_auto_parallel) or
  `none` (every shard() removed after the network is built, auto_parallel: the search
  chosen by `--search` decides every op, e.g. `--search ilp`);
* LLAMA_TRAIN_STEP: `0` (default: model() is the network, optimizer() AdamWeightDecay) or `1`
  (model() is mindformers' training step: dynamic loss scale from LLAMA_LOSS_SCALE, default
  2^12, global-norm clipping at LLAMA_CLIP, default 1.0, AdamWeightDecay);
* LLAMA_TOKEN_FILE: train from a pretraining corpus, a flat binary file of token ids
  (LLAMA_TOKEN_DTYPE `uint16` by default, or `int32`, `uint32`, `int64`), read through
  `pcompile.dataset.TokenFileDataset` in windows of LLAMA_SEQ + 1 tokens, shuffled (seed
  LLAMA_DATA_SEED, default 1), LLAMA_BATCH to a batch; each data-parallel rank reads only its
  rows of every batch (under the default full_batch, every rank reads the whole batch; with
  `--dataset-strategy data_parallel` only its share). Unset (default): the learnable
  sequences below.
* LLAMA_PP: pipeline stages (default 1), as mindformers places them: the embedding in stage
  0, decoder layer i in stage min((i + offset) // max((layers + 1) // PP, 1), PP - 1) (its
  set_layer_stage_recompute; LLAMA_PP_OFFSET, one integer per stage, gives the list form:
  layers // PP + offset[s] layers on stage s), the final norm, LM head and loss in the last;
  dp x mp are then a stage's devices (devices / PP). LLAMA_MICRO: micro-batches (default
  LLAMA_PP); above 1 model() returns nn.PipelineCell(net, LLAMA_MICRO), the loss a scalar (the
  micro-batches' mean) and the cross entropy's bprops run per micro-batch. The learnable
  sequences end every micro-batch's last sample in padding, so that each micro-batch counts
  as many tokens (the mean of their losses is then the batch's);
* LLAMA_PRETRAINED: a safetensors checkpoint with Hugging Face Llama names (a `.safetensors`
  file, a `model.safetensors.index.json` or a folder holding either) to start from: read
  with `load_checkpoint(path, name_map="llama")` / `load_param_into_net`, each rank reading only
  its slices. The sizes (preset and LLAMA_* overrides) must be the checkpoint's.

    pcompile examples/llama.py --devices 8                        # compile + check, bf16
    LLAMA_DTYPE=float32 LLAMA_FLASH=0 pcompile examples/llama.py --devices 8
    pcompile examples/llama.py --devices 8 --run --steps 20      # 8 processes
    LLAMA_PRESET=llama3_8b LLAMA_BATCH=16 pcompile examples/llama.py --devices 64 --no-check \\
        --dump-ranks 0
    LLAMA_TOKEN_FILE=corpus.bin pcompile examples/llama.py --devices 8 --run --steps 100
    LLAMA_PP=2 pcompile examples/llama.py --devices 8               # 2 stages of dp 1 x mp 4
"""

import math
import os

import numpy as np

from pcompile import (
    Parameter,
    Tensor,
    get_auto_parallel_context,
    initializer,
    load_checkpoint,
    load_param_into_net,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)

PRESETS = {
    #            layers hidden heads kv ffn    vocab   seq   batch theta
    "tiny": (2, 64, 8, 4, 128, 128, 16, 4, 10000.0),
    "llama2_7b": (32, 4096, 32, 32, 11008, 32000, 4096, 8, 10000.0),
    "llama3_8b": (32, 4096, 32, 8, 14336, 128256, 8192, 8, 500000.0),
    "llama2_70b": (80, 8192, 64, 8, 28672, 32000, 4096, 128, 10000.0),
}
PRESET = os.environ.get("LLAMA_PRESET", "tiny")
if PRESET not in PRESETS:
    raise ValueError(f"LLAMA_PRESET={PRESET!r}: choose one of {', '.join(PRESETS)}")
_P = dict(zip(("LAYERS", "HIDDEN", "HEADS", "KV_HEADS", "FFN", "VOCAB", "SEQ", "BATCH"),
              PRESETS[PRESET][:8]))
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, SEQ, BATCH = (
    int(os.environ.get(f"LLAMA_{k}", v)) for k, v in _P.items())
ROPE_THETA = PRESETS[PRESET][8]
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}
COMPUTE_DTYPE = DTYPES[os.environ.get("LLAMA_DTYPE", "bfloat16").lower()]
FLASH = os.environ.get("LLAMA_FLASH", "1") == "1"
RECOMPUTE = os.environ.get("LLAMA_RECOMPUTE", "none")
VOCAB_EMB_DP = os.environ.get("LLAMA_VOCAB_EMB_DP", "1") == "1"
TRAIN_STEP = os.environ.get("LLAMA_TRAIN_STEP", "0") == "1"
SEQ_PARALLEL = os.environ.get("LLAMA_SEQ_PARALLEL", "0") == "1"
STRATEGIES = os.environ.get("LLAMA_STRATEGIES", "hand")
if STRATEGIES not in ("hand", "none"):
    raise ValueError(f"LLAMA_STRATEGIES={STRATEGIES!r}: choose hand or none")
PIPELINE_STAGES = int(os.environ.get("LLAMA_PP", "1"))
MICRO_BATCHES = int(os.environ.get("LLAMA_MICRO", str(PIPELINE_STAGES)))
_offset = os.environ.get("LLAMA_PP_OFFSET")
PP_OFFSET = tuple(int(v) for v in _offset.split(",")) if _offset else 0
if PIPELINE_STAGES < 1 or MICRO_BATCHES < 1:
    raise ValueError(f"LLAMA_PP={PIPELINE_STAGES} and LLAMA_MICRO={MICRO_BATCHES} must be "
                     "at least 1")
if TRAIN_STEP and MICRO_BATCHES > 1:
    raise ValueError("LLAMA_TRAIN_STEP=1 with LLAMA_PP / LLAMA_MICRO: nn.PipelineCell trains "
                     "the network with the model file's optimizer(); use LLAMA_TRAIN_STEP=0")
PAD_TOKEN_ID, IGNORE_TOKEN_ID, NORM_EPS = 0, -100, 1e-5

# mindformers trains Llama in semi-auto parallel with full_batch: every rank reads the whole
# batch and the strategies split it. `pcompile --devices N` overrides the device count.
set_auto_parallel_context(
    parallel_mode="semi_auto_parallel" if STRATEGIES == "hand" else "auto_parallel",
    device_num=8, dataset_strategy="full_batch", pipeline_stages=PIPELINE_STAGES)


def remove_strategies(net):
    """Every shard() of `net` undone (LLAMA_STRATEGIES=none): the search decides each op, but
    a self_define_shard region's (a Morph), whose Layouts are its own code's."""
    for _, cell in net.cells_and_names():
        for value in vars(cell).values():
            if isinstance(value, ops.Primitive) and \
                    not value.user_attrs.get("self_define_shard"):
                value.in_strategy = value.out_strategy = None
    return net


def pipelined():
    """Whether model() returns nn.PipelineCell: pipeline stages or micro-batches, on more
    than one device (one device runs the network on the whole batch, the oracle's program)."""
    return MICRO_BATCHES > 1 and int(get_auto_parallel_context("device_num")) > 1


def parallel_config():
    """(dp, mp) from the parallel context, as mindformers' TransformerOpParallelConfig: the
    devices of one pipeline stage (devices / LLAMA_PP) are dp x mp."""
    devices = int(get_auto_parallel_context("device_num"))
    stages = int(get_auto_parallel_context("pipeline_stages"))
    if devices > 1 and devices % stages:
        raise ValueError(f"LLAMA_PP={stages} pipeline stages do not divide the {devices} "
                         "devices")
    devices = max(devices // stages, 1) if devices > 1 else 1
    mp = min(int(os.environ.get("LLAMA_MP", "4")), devices)
    if devices % mp:
        raise ValueError(f"LLAMA_MP={mp} does not divide the {devices} devices"
                         + (" of a pipeline stage" if stages > 1 else ""))
    return devices // mp, mp


def layer_stage(layer_id, stages, layers=None):
    """The pipeline stage of decoder layer `layer_id`, as mindformers' LLama sets it
    (set_layer_stage_recompute): with an integer offset (LLAMA_PP_OFFSET unset: 0), stage
    min((layer_id + offset) // max((layers + 1) // stages, 1), stages - 1); with a list of
    one offset per stage (LLAMA_PP_OFFSET=a,b,...), stage s holds layers // stages + offset[s]
    layers, in order."""
    layers = LAYERS if layers is None else layers
    if isinstance(PP_OFFSET, tuple):
        if len(PP_OFFSET) != stages:
            raise ValueError(f"LLAMA_PP_OFFSET={_offset} has {len(PP_OFFSET)} entries for "
                             f"{stages} pipeline stages")
        counts = [layers // stages + o for o in PP_OFFSET]
        if sum(counts) != layers or min(counts) < 0:
            raise ValueError(f"LLAMA_PP_OFFSET={_offset} gives {counts} layers per stage, but "
                             f"the model has {layers}")
        return int(np.sum(np.cumsum(counts) < layer_id + 1))
    return min((layer_id + PP_OFFSET) // max((layers + 1) // stages, 1), stages - 1)


def assign_stages(net, stages):
    """mindformers' pipeline placement: the embedding (and the causal mask) in the first
    stage, decoder layer i in `layer_stage(i)`, the final norm, the LM head and the loss in
    the last."""
    if LAYERS < stages:
        raise ValueError(f"{LAYERS} decoder layers cannot fill LLAMA_PP={stages} stages")
    # the network's own ops (the token and label slices, the masks, the logits' cast) follow
    # their data: the tokens in the first stage, the labels and the logits in the last
    net.model.pipeline_stage = 0
    for i, layer in enumerate(net.model.layers):
        layer.pipeline_stage = layer_stage(i, stages)
    for cell in (net.model.norm_out, net.lm_head, net.loss):
        cell.pipeline_stage = stages - 1


def residual_strategy(dp, mp):
    """The strategy of the residual stream [batch, seq, hidden] (its adds and norms). Under
    sequence parallelism it is split over the tokens on mp, the same tokens as wo's and w2's
    reduce-scattered [batch * seq, hidden] rows: (dp, mp, 1) as mindformers writes it when a
    data-parallel rank holds one sequence (its usual batch_size 1), else over the batch,
    (dp * mp, 1, 1) (rows are batch-major, so mp then splits whole sequences)."""
    if not SEQ_PARALLEL:
        return (dp, 1, 1)
    local = (BATCH // MICRO_BATCHES if pipelined() else BATCH) // dp  # a micro-batch's rows
    if local == 1 or local % mp:
        return (dp, mp, 1)
    return (dp * mp, 1, 1)


class Linear(nn.Cell):
    """mindformers' Linear: weight [out, in], MatMul(transpose_b=True) in the compute dtype on
    the flattened input, an optional activation, the result cast back to the input's dtype."""

    def __init__(self, in_channels, out_channels, compute_dtype, activation=None):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = Parameter(initializer("normal", [out_channels, in_channels]), "weight")
        self.dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)
        self.cast = ops.Cast()
        self.shape = ops.Shape()
        self.reshape = ops.Reshape()
        self.activation = activation() if activation is not None else None

    def construct(self, x):
        out_shape = self.shape(x)[:-1] + (self.out_channels,)
        x = self.reshape(x, (-1, self.in_channels))
        ori_dtype = x.dtype
        weight = self.cast(self.weight, self.dtype)
        x = self.matmul(self.cast(x, self.dtype), weight)
        if self.activation is not None:
            x = self.activation(x)
        return self.reshape(self.cast(x, ori_dtype), out_shape)

    def shard(self, strategy_matmul, strategy_activation=None):
        self.matmul.shard(strategy_matmul)
        if self.activation is not None and strategy_activation is not None:
            self.activation.shard(strategy_activation)
        return self


class LlamaSiLU(nn.Cell):
    def __init__(self):
        super().__init__()
        self.silu = ops.SiLU()

    def construct(self, x):
        return self.silu(x)

    def shard(self, strategy):
        self.silu.shard(strategy)


class LlamaRMSNorm(nn.Cell):
    """RmsNorm in float32 (gamma float32, never split), the result cast back."""

    def __init__(self, dim, eps=NORM_EPS):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,)), "weight")
        self.norm = ops.RmsNorm(eps)
        self.cast = ops.Cast()
        self.rcast = ops.Cast()

    def construct(self, x):
        original_type = x.dtype
        output = self.norm(self.cast(x, "float32"), self.weight)[0]
        return self.rcast(output, original_type)

    def shard(self, strategy_in):
        self.norm.shard((strategy_in, (1,)))


class RotaryEmbedding(nn.Cell):
    """x * cos + rotate_half(x) * sin in float32; rotate_half(x) = concat(-x2, x1) (x1, x2 the
    halves of the head dim, the convention of mindformers and Hugging Face Llama) is a
    BatchMatMul with the swap matrix [[0, I], [-I, 0]], as mindformers writes it."""

    def __init__(self, head_dim):
        super().__init__()
        self.cast = ops.Cast()
        self.mul = ops.Mul()
        self.add = ops.Add()
        self.bmm_swap = ops.BatchMatMul()
        half = head_dim // 2
        swap = np.zeros((head_dim, head_dim), np.float32)
        swap[np.arange(half), np.arange(half) + half] = 1.0
        swap[np.arange(half) + half, np.arange(half)] = -1.0
        self.swap_mask = Tensor(swap)

    def rotate(self, x, freqs_cos, freqs_sin):
        return self.add(self.mul(x, freqs_cos),
                        self.mul(self.bmm_swap(x, self.swap_mask), freqs_sin))

    def construct(self, xq, xk, freqs_cis):
        original_type = xq.dtype
        freqs_cos, freqs_sin = freqs_cis
        xq = self.rotate(self.cast(xq, "float32"), freqs_cos, freqs_sin)
        xk = self.rotate(self.cast(xk, "float32"), freqs_cos, freqs_sin)
        return self.cast(xq, original_type), self.cast(xk, original_type)

    def shard(self, strategy_in):
        self.add.shard((strategy_in, strategy_in))
        self.bmm_swap.shard((strategy_in, (1, 1)))
        self.mul.shard((strategy_in, (1, 1)))


class LlamaAttention(nn.Cell):
    def __init__(self, dim, n_heads, n_kv_heads, compute_dtype, dp, mp):
        super().__init__()
        if n_heads % mp or n_kv_heads % mp:
            raise ValueError(f"heads {n_heads} and kv heads {n_kv_heads} must be multiples of "
                             f"the model parallel {mp}")
        self.hidden_size, self.n_head, self.n_kv_head = dim, n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.kv_dim = n_kv_heads * self.head_dim
        self.dtype = compute_dtype
        self.shape = ops.Shape()
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.wq = Linear(dim, dim, compute_dtype).shard(((dp, 1), (mp, 1)))
        self.wk = Linear(dim, self.kv_dim, compute_dtype).shard(((dp, 1), (mp, 1)))
        self.wv = Linear(dim, self.kv_dim, compute_dtype).shard(((dp, 1), (mp, 1)))
        # mindformers gives wo out_strategy_matmul ((dp, 1),): the AllReduce form; under
        # sequence parallelism ((dp * mp, 1),): the ReduceScatter form.
        self.wo = Linear(dim, dim, compute_dtype)
        self.wo.matmul.shard(((dp, mp), (1, mp)),
                             out_strategy=((dp * mp, 1),) if SEQ_PARALLEL else ((dp, 1),))
        self.transpose = ops.Transpose().shard(((dp, 1, mp, 1),))
        self.merger_head_transpose = ops.Transpose().shard(((dp, mp, 1, 1),))
        self.apply_rotary_emb = RotaryEmbedding(self.head_dim)
        self.apply_rotary_emb.shard((dp, mp, 1, 1))
        scale = 1.0 / math.sqrt(self.head_dim)
        if FLASH:
            self.flash_attention = ops.FlashAttentionScore(
                head_num=n_heads, keep_prob=1.0, scale_value=scale, pre_tokens=65536,
                next_tokens=0, input_layout="BNSD", sparse_mode=0)
            self.flash_attention.shard(((dp, mp, 1, 1), (dp, mp, 1, 1), (dp, mp, 1, 1),
                                        (dp, 1, 1, 1)))
        else:
            self.inv_norm_factor = scale
            self.batch_matmul_q_k = ops.BatchMatMul(transpose_b=True).shard(
                ((dp, mp, 1, 1), (dp, mp, 1, 1)))
            self.batch_matmul = ops.BatchMatMul().shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
            self.mul = ops.Mul().shard(((dp, mp, 1, 1), ()))
            self.add = ops.Add().shard(((dp, 1, 1, 1), (dp, mp, 1, 1)))
            self.softmax = ops.Softmax().shard(((dp, mp, 1, 1),))
            self.cast_attn = ops.Cast()
            self.tile_kv = ops.Tile().shard(((dp, mp, 1, 1),))
            if RECOMPUTE == "select":
                for prim in (self.tile_kv, self.batch_matmul_q_k, self.mul, self.add,
                             self.cast_attn, self.softmax, self.batch_matmul):
                    prim.recompute()

    def construct(self, x, freqs_cis, mask):
        ori_dtype = x.dtype
        bs, seq_len, _ = self.shape(x)
        query = self.cast(self.wq(x), self.dtype)
        key = self.cast(self.wk(x), self.dtype)
        value = self.cast(self.wv(x), self.dtype)
        query = self.transpose(self.reshape(query, (bs, seq_len, self.n_head, self.head_dim)),
                               (0, 2, 1, 3))
        key = self.transpose(self.reshape(key, (bs, seq_len, self.n_kv_head, self.head_dim)),
                             (0, 2, 1, 3))
        query, key = self.apply_rotary_emb(query, key, freqs_cis)
        value = self.transpose(self.reshape(value, (bs, seq_len, self.n_kv_head,
                                                    self.head_dim)), (0, 2, 1, 3))
        if FLASH:
            context = self.flash_attention(query, key, value, None, None, None, mask, None,
                                           None, None)[3]
        else:
            context = self._attn(query, self._repeat_kv(key), self._repeat_kv(value), mask)
        output = self.wo(self._merge_heads(context))
        return self.cast(output, ori_dtype)

    def _repeat_kv(self, x):
        if self.n_rep == 1:
            return x
        bs, n_kv_head, seqlen, head_dim = self.shape(x)
        x = self.reshape(x, (bs, n_kv_head, 1, seqlen * head_dim))
        x = self.tile_kv(x, (1, 1, self.n_rep, 1))
        return self.reshape(x, (bs, n_kv_head * self.n_rep, seqlen, head_dim))

    def _merge_heads(self, x):
        x = self.merger_head_transpose(x, (0, 2, 1, 3))
        bs, seq_len, n_head, head_dim = self.shape(x)
        return self.reshape(x, (bs, seq_len, n_head * head_dim))

    def _attn(self, query, key, value, mask):
        score = self.batch_matmul_q_k(query, key)
        score = self.add(mask, self.mul(score, self.inv_norm_factor))
        probs = self.softmax(self.cast_attn(score, "float32"))
        return self.batch_matmul(self.cast(probs, self.dtype), value)


class LlamaFeedForward(nn.Cell):
    """w2(silu(w1 x) * w3 x) in the compute dtype."""

    def __init__(self, dim, hidden_dim, compute_dtype, dp, mp):
        super().__init__()
        if hidden_dim % mp or dim % mp:
            raise ValueError(f"FFN {hidden_dim} and hidden {dim} must be multiples of the "
                             f"model parallel {mp}")
        self.dtype = compute_dtype
        self.cast = ops.Cast()
        self.w1 = Linear(dim, hidden_dim, compute_dtype, activation=LlamaSiLU).shard(
            ((dp, 1), (mp, 1)), strategy_activation=((dp, mp),))
        self.w2 = Linear(hidden_dim, dim, compute_dtype).shard(((dp, mp), (1, mp)))
        if SEQ_PARALLEL:
            self.w2.matmul.shard(((dp, mp), (1, mp)), out_strategy=((dp * mp, 1),))
        self.w3 = Linear(dim, hidden_dim, compute_dtype).shard(((dp, 1), (mp, 1)))
        self.mul = ops.Mul().shard(((dp, 1, mp), (dp, 1, mp)))
        if RECOMPUTE == "select":
            # SiLU's output reaches the Mul through w1's Cast and Reshape: recompute them too,
            # or the Mul's backward keeps their (equally large) result.
            for prim in (self.w1.activation.silu, self.w1.cast, self.w1.reshape, self.mul):
                prim.recompute()

    def construct(self, x):
        x = self.cast(x, self.dtype)
        gate = self.w1(x)
        hidden = self.w3(x)
        return self.w2(self.mul(hidden, gate))


class LlamaDecodeLayer(nn.Cell):
    def __init__(self, dim, n_heads, n_kv_heads, ffn, compute_dtype, dp, mp):
        super().__init__()
        self.attention_norm = LlamaRMSNorm(dim)
        self.ffn_norm = LlamaRMSNorm(dim)
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads, compute_dtype, dp, mp)
        self.feed_forward = LlamaFeedForward(dim, ffn, compute_dtype, dp, mp)
        residual = residual_strategy(dp, mp)
        self.add = ops.Add().shard((residual, residual))
        self.attention_norm.shard(residual)
        self.ffn_norm.shard(residual)

    def construct(self, x, freqs_cis, mask):
        h = self.add(x, self.attention(self.attention_norm(x), freqs_cis, mask))
        return self.add(h, self.feed_forward(self.ffn_norm(h)))


def rope_tables(seq, head_dim, theta):
    """FreqsMgr's tables: float32 cos and sin, [seq, head_dim]."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(seq, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return Tensor(np.cos(emb).astype(np.float32)), Tensor(np.sin(emb).astype(np.float32))


def causal_mask(seq):
    """The causal mask [1, 1, seq, seq]: flash attention's uint8 (1 = masked), else the
    additive float32 form (-10000 where masked)."""
    causal = np.triu(np.ones((1, 1, seq, seq), np.uint8), 1)
    return Tensor(causal) if FLASH else Tensor(causal.astype(np.float32) * -10000.0)


class LlamaModel(nn.Cell):
    def __init__(self, dp, mp):
        super().__init__()
        self.dtype = COMPUTE_DTYPE
        self.shape = ops.Shape()
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.embedding_weight = Parameter(initializer("normal", [VOCAB, HIDDEN]),
                                          "embedding_weight")
        self.gather = ops.Gather()
        if VOCAB_EMB_DP or VOCAB % mp:
            self.gather.shard(((1, 1), (dp, 1)))
        else:
            self.gather.shard(((mp, 1), (dp, 1)))
        self.layers = nn.CellList([
            LlamaDecodeLayer(HIDDEN, HEADS, KV_HEADS, FFN, COMPUTE_DTYPE, dp, mp)
            for _ in range(LAYERS)])
        if RECOMPUTE == "full":
            for layer in self.layers:
                layer.recompute()
        self.norm_out = LlamaRMSNorm(HIDDEN)
        self.norm_out.shard(residual_strategy(dp, mp))
        self.freqs_cos, self.freqs_sin = rope_tables(SEQ, HIDDEN // HEADS, ROPE_THETA)
        self.mask = causal_mask(SEQ)
        self.tile_mask = ops.Tile().shard(((1, 1, 1, 1),))
        if not FLASH:
            self.mask_cast = ops.Cast()

    def construct(self, tokens):
        bs, seq_len = self.shape(tokens)
        mask = self.tile_mask(self.mask, (bs, 1, 1, 1))
        if not FLASH:
            mask = self.mask_cast(mask, self.dtype)
        h = self.cast(self.gather(self.embedding_weight, tokens, 0), self.dtype)
        h = self.reshape(h, (bs, seq_len, HIDDEN))
        for layer in self.layers:
            h = layer(h, (self.freqs_cos, self.freqs_sin), mask)
        return self.norm_out(h)


class LogSoftmax(nn.Cell):
    """mindformers' _LogSoftmax: the float32 logits' log-softmax over the (split) vocabulary
    and the labels' one-hot, in MindSpore's strategy form. Its bprop hands the log-softmax's
    cotangent through unchanged: NLLLoss's bprop already gives the logits' gradient, so the
    max (a shift the softmax does not see) gets no gradient mask of its own."""

    def __init__(self, dp, mp):
        super().__init__()
        self.max = ops.ReduceMax(keep_dims=True).shard(((dp, mp),))
        self.sub = ops.Sub().shard(((dp, mp), (dp, 1)))
        self.exp = ops.Exp().shard(((dp, mp),))
        self.sum = ops.ReduceSum(keep_dims=True).shard(((dp, mp),))
        self.log = ops.Log().shard(((dp, 1),))
        self.onehot = ops.OneHot().shard(((dp, mp), (), ()))
        self.on_value = Tensor(np.float32(1.0))
        self.off_value = Tensor(np.float32(0.0))

    def construct(self, logits, label):
        logit_sub = self.sub(logits, self.max(logits, 1))
        log_exp_sum = self.log(self.sum(self.exp(logit_sub), -1))
        one_hot = self.onehot(label, logits.shape[-1], self.on_value, self.off_value)
        return self.sub(logit_sub, log_exp_sum), one_hot

    if STRATEGIES == "hand":  # without the strategies the bprop's layouts are not known
        def bprop(self, logits, label, out, dout):
            return dout[0], ops.zeros_like(label)


class NLLLoss(nn.Cell):
    """mindformers' _NLLLoss: minus the target's log-probability per token. Its bprop is the
    softmax minus the one-hot, times the cotangent and `repeat_loss`: under (semi-)auto
    parallel the cotangent arrives divided by mp (the loss's _VirtualDiv over the mp ranks
    that hold it), which mindformers undoes with repeat_loss = mp."""

    def __init__(self, dp, mp):
        super().__init__()
        self.mul = ops.Mul().shard(((dp, mp), (dp, mp)))
        self.neg = ops.Neg().shard(((dp, mp),))
        self.sum = ops.ReduceSum().shard(((dp, mp),))
        self.exp = ops.Exp().shard(((dp, mp),))
        self.grad_sub = ops.Sub().shard(((dp, mp), (dp, mp)))
        self.grad_mul = ops.Mul().shard(((dp, mp), (dp, 1)))
        self.expand = ops.ExpandDims().shard(((dp,),))
        self.repeat_loss = float(mp)

    def construct(self, log_softmax, one_hot):
        return self.sum(self.neg(self.mul(log_softmax, one_hot)), -1)

    if STRATEGIES == "hand":
        # mindformers' bprop with repeat_loss is right for its own strategies only; with
        # LLAMA_STRATEGIES=none autodiff differentiates the loss under whatever plan is chosen
        def bprop(self, log_softmax, one_hot, out, dout):
            grad = self.grad_mul(self.grad_sub(self.exp(log_softmax), one_hot),
                                 self.expand(dout, -1))
            return grad * self.repeat_loss, ops.zeros_like(one_hot)


class CrossEntropyLoss(nn.Cell):
    """mindformers' CrossEntropyLoss: the log-softmax of the float32 logits (split over the
    vocabulary) and the negative log-likelihood, each with mindformers' own bprop (the
    gradient softmax - one_hot, no autodiff of the max and the sums), and the masked mean
    over the tokens as a (1,) tensor."""

    def __init__(self, dp, mp):
        super().__init__()
        self.log_softmax = LogSoftmax(dp, mp)
        self.nll = NLLLoss(dp, mp)
        self.reshape = ops.Reshape()
        self.sum2 = ops.ReduceSum(keep_dims=True).shard(((1,),))
        self.mul2 = ops.Mul().shard(((1,), (1,)))
        self.add2 = ops.Add().shard(((1,), ()))
        self.div2 = ops.RealDiv().shard(((1,), (1,)))

    def construct(self, logits, label, input_mask):
        log_softmax, one_hot = self.log_softmax(logits, self.reshape(label, (-1,)))
        loss = self.nll(log_softmax, one_hot)
        input_mask = self.reshape(input_mask, (-1,))
        numerator = self.sum2(self.mul2(loss, input_mask), ())
        denominator = self.add2(self.sum2(input_mask, ()), 1e-8)
        return self.div2(numerator, denominator)


class LlamaForCausalLM(nn.Cell):
    """Next-token training from the token ids alone: tokens = input_ids[:, :-1], labels =
    input_ids[:, 1:]; padding (token 0) and ignored labels (-100) do not count in the loss."""

    def __init__(self):
        super().__init__()
        dp, mp = parallel_config()
        set_seed(1)
        self.model = LlamaModel(dp, mp)
        self.lm_head = Linear(HIDDEN, VOCAB, COMPUTE_DTYPE)
        if VOCAB % mp == 0:
            self.lm_head.shard(((dp, 1), (mp, 1)))
        else:
            self.lm_head.shard(((dp, 1), (1, 1)))
        self.loss = CrossEntropyLoss(dp, mp)
        self.shape = ops.Shape()
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.slice = ops.StridedSlice().shard(((dp, 1),))
        self.not_equal = ops.NotEqual().shard(((dp, 1), ()))
        self.mul = ops.Mul().shard(((dp, 1), (dp, 1)))

    def construct(self, input_ids, labels=None):
        bsz, seqlen = self.shape(input_ids)
        tokens = self.slice(input_ids, (0, 0), (bsz, seqlen - 1), (1, 1))
        if labels is None:
            labels = self.slice(input_ids, (0, 1), (bsz, seqlen), (1, 1))
        input_mask = self.cast(self.not_equal(tokens, PAD_TOKEN_ID), "float32")
        label_mask = self.cast(self.not_equal(labels, IGNORE_TOKEN_ID), "float32")
        input_mask = self.mul(input_mask, label_mask)
        output = self.model(tokens)
        logits = self.cast(self.lm_head(output), "float32")
        logits = self.reshape(logits, (-1, VOCAB))
        loss = self.loss(logits, labels, input_mask)
        if pipelined():  # nn.PipelineCell: the step's loss is its micro-batches' mean
            return self.reshape(loss, ())
        return loss


class TrainStep(nn.TrainOneStepWithLossScaleCell):
    """mindformers' training step: unscale, check for overflow, clip the global norm, update
    unless the step overflowed."""

    def __init__(self, network, optimizer, scale_sense, max_grad_norm):
        super().__init__(network, optimizer, scale_sense)
        self.clip = nn.ClipGradNorm(max_norm=max_grad_norm)

    def construct(self, *inputs):
        loss = self.network(*inputs)
        scaling_sens = self.scale_sense
        sens = ops.ones_like(loss) * ops.cast(scaling_sens, loss.dtype)
        grads = self.grad(self.network, self.weights)(*inputs, sens)
        inverse = ops.reciprocal(scaling_sens)
        grads = tuple(g * ops.cast(inverse, g.dtype) for g in grads)
        overflow = self.process_loss_scale(self.get_overflow_status(False, grads))
        grads, global_norm = self.clip(grads)
        loss = ops.depend(loss, self.optimizer(grads, skip=overflow))
        return loss, overflow, scaling_sens, global_norm


def load_pretrained(net, path):
    """Start `net` from the Hugging Face Llama checkpoint `path` (every parameter must be in
    it): its names are mapped to this file's by pcompile's built-in Llama name map
    (pcompile.compiler.frontend.name_maps.LLAMA: every tensor taken as it is, lm_head tied to the
    embedding table when the checkpoint has none)."""
    not_loaded, _ = load_param_into_net(net, load_checkpoint(path, name_map="llama"))
    if not_loaded:
        raise ValueError(f"LLAMA_PRETRAINED={path} has no tensor for {', '.join(not_loaded)} "
                         "(Hugging Face names, mapped by name_map='llama')")


def adamw(params):
    return nn.AdamWeightDecay(params, learning_rate=1e-3, weight_decay=0.01)


if not TRAIN_STEP:  # a training step cell brings its own optimizer
    optimizer = adamw


def model():
    net = LlamaForCausalLM()
    if STRATEGIES == "none":
        remove_strategies(net)
    if os.environ.get("LLAMA_PRETRAINED"):
        load_pretrained(net, os.environ["LLAMA_PRETRAINED"])
    if pipelined():
        stages = int(get_auto_parallel_context("pipeline_stages"))
        if stages > 1:
            assign_stages(net, stages)
        return nn.PipelineCell(net, micro_size=MICRO_BATCHES)
    if not TRAIN_STEP:
        return net
    scale = float(os.environ.get("LLAMA_LOSS_SCALE", str(2.0 ** 12)))
    clip = float(os.environ.get("LLAMA_CLIP", "1.0"))
    return TrainStep(net, adamw(net.trainable_params()),
                     nn.DynamicLossScaleUpdateCell(scale, 2, 1000), clip)


TOKEN_FILE = os.environ.get("LLAMA_TOKEN_FILE")


def dataset():
    """Learnable sequences: each next token is the previous one + 1 (mod the vocabulary,
    skipping the padding id 0); the last sample ends in padding. With LLAMA_TOKEN_FILE: the
    corpus's windows, BATCH at a time."""
    if TOKEN_FILE:
        return token_file_dataset(TOKEN_FILE)
    return learnable_sequences()


def token_file_dataset(path):
    import pcompile.dataset as ds

    # dataset() may run without model() (a rank program's data): seed the data here
    ds.config.set_seed(int(os.environ.get("LLAMA_DATA_SEED", "1")))
    data = ds.TokenFileDataset(path, SEQ, dtype=os.environ.get("LLAMA_TOKEN_DTYPE", "uint16"),
                               vocab_size=VOCAB, shuffle=True)
    if data.get_dataset_size() < BATCH:
        raise ValueError(f"LLAMA_TOKEN_FILE {path} holds {data.get_dataset_size()} windows of "
                         f"{SEQ + 1} tokens, fewer than one batch of {BATCH}; use a longer "
                         "file, or a smaller LLAMA_BATCH or LLAMA_SEQ")
    return data.batch(BATCH, drop_remainder=True)


def learnable_sequences(vocab=VOCAB, seq=SEQ, batch=BATCH, micro=MICRO_BATCHES):
    """The last sample of every micro-batch (of the batch, without micro-batches) ends in
    padding: each micro-batch counts as many tokens, so the mean of their masked losses (what
    nn.PipelineCell trains) is the batch's."""
    rng = np.random.default_rng(0)
    rows = batch // micro if batch % micro == 0 else batch
    for _ in range(1000):
        start = rng.integers(0, vocab - 1, (batch, 1))
        ids = (start + np.arange(seq + 1)) % (vocab - 1) + 1
        ids[rows - 1::rows, -2:] = PAD_TOKEN_ID
        yield (ids.astype(np.int32),)


def inputs():
    return next(iter(dataset()))
