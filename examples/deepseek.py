"""DeepSeek-V3 as mindformers writes it (research/deepseek3 of mindformers r1.5.0, the training
path its finetune yaml selects): multi-head latent attention, RMSNorm, dense feed-forwards in the
first layers, then mixture-of-experts layers of one shared expert plus routed experts (MoEV2 with
TopkRouterV2: sigmoid scores, aux-loss-free routing through a bias the step updates, capacity),
the LM head and mindformers' masked cross-entropy inside the network.

Written from mindformers' cells and strategies (`DeepSeekV2Attention`, `DeepSeekV2DecodeLayer`,
`LlamaFeedForwardWithMoE`, `MoEV2`, `TopkRouterV2`, `TrainingDeepseekV3ForCausalLM`):

* **MLA**: q2l_proj [hidden -> q_lora_rank], lq_norm, l2q_nope_proj and l2q_pe_proj (the query's
  no-position and rotary parts, split over the heads by mp); kv2l_latent_kv [hidden ->
  kv_lora_rank] and lkv_norm, kv2l_k_pe [hidden -> qk_rope_head_dim] (one rotary key shared by
  the heads: reshaped to (B, 1, S, r) and tiled over them), lkv2kv_k_nope and lkv2kv_v from the
  latent; rotary embedding on the rope parts only, Concat of the nope and rope parts, flash
  attention (the value padded with zeros to the query's head size, the result sliced back) or
  the BatchMatMul path, wo;
* **MoE** (layers from first_k_dense_replace on): the routed experts' output plus one shared
  expert's (a SwiGLU of moe_intermediate_size x shared_expert_num). Routing per group of tokens:
  a float32 Dense [hidden -> E], a Sigmoid, TopK of the scores plus the aux-loss-free bias
  (`topk_bias`), the chosen scores gathered back (Gather with batch_dims=2), normalised over the k
  (norm_topk_prob); dispatch and combine indices with each expert's capacity C = ceil(k N
  capacity_factor / E), by the fused `P._inner_ops.TopKRouter` (use_fused_ops_topkrouter,
  the default) or mindformers' unfused OneHot / CumSum / Sort form (DEEPSEEK_FUSED_ROUTER=0),
  choices queued by rank ("kdrop", mindformers' default without enable_sdrop); the tokens
  gathered into (groups, E, C, h) slots, the expert axis moved to the front (the dispatch
  AlltoAll under expert parallelism), the [E, in, out] SwiGLU experts, the axis moved back (the
  combine AlltoAll) and each token's k outputs gathered, weighted and summed;
* **state updated by the step**: each MoE layer accumulates its experts' load (the mean one-hot
  of the chosen experts) into the Parameter `expert_load` with `P.AssignAdd`, as mindformers'
  router does; mindformers' TopkBiasBalanceCallback (between steps: `topk_bias` moved by
  topk_bias_update_rate towards the experts loaded less than the mean, sign(mean load - load),
  and the load zeroed) runs at the start of the next step's routing, with `P.AssignAdd` and
  `P.Assign`; both are requires_grad=False state, stored, checkpointed and resumed with the
  weights (docs/state.md);
* **dropless MoE** (DEEPSEEK_USE_GMM=1, the yaml's pretraining `use_gmm: True`: mindformers'
  MoEV3): no capacity; each group's choices sorted by expert, the experts in a Morph region
  (self_define_shard) that runs on each rank's slices: an AlltoAll of the per-expert counts,
  AlltoAllV of the tokens and ids with the counts the step computes, two GroupedMatmuls over
  the rank's experts (Swiglu between) and the AlltoAllV back, over the rank's expert-parallel
  group (mindformers' FFN: Layout (dp * mp / ep, ep, 1, 1, 1), ep = DEEPSEEK_EP dividing
  dp * mp, default dp * mp; each group the ep consecutive ranks, made with create_group and
  named by a hash of its ranks as mindformers names it); E a multiple of ep, DEEPSEEK_GROUPS
  of dp * mp;
* **loss**: the masked cross-entropy of the next token plus the expert-level balance loss
  (alpha E^2 mean(f_e P_e), aux_loss_factors [0.0001]) of every MoE layer;
* **MTP** (multi-token prediction, DEEPSEEK_MTP, default 0 layers; mindformers' mtp_depth 1): one
  more decoder layer per depth on the fusion (Concat and Dense) of the last hidden state and the
  next token's embedding, its logits scored against the labels shifted by one more token, times
  mtp_loss_factor (0.3) / depth.

Parallelism from the parallel context and the environment, as mindformers' MoE parallel config:
mp = DEEPSEEK_MP (default 2), dp = devices / mp, ep = DEEPSEEK_EP (default gcd(dp, experts)); ep
divides dp and the expert count (with DEEPSEEK_USE_GMM=1, as mindformers' MoEV3: ep divides dp * mp,
default dp * mp). DEEPSEEK_SEQ_PARALLEL (`1`, the yaml's use_seq_parallel, or
`0`): the norms and residual adds split over the tokens on mp, q2l_proj, kv2l_latent_kv and
kv2l_k_pe on the (dp * mp) token rows, lq_norm and lkv_norm on 2-D rows, wo reduce-scattering its
output. Routing groups: DEEPSEEK_GROUPS (default 8, a multiple of dp; mindformers routes per
data-parallel group). LLAMA_FLASH and LLAMA_STRATEGIES (`none`: every shard() removed,
auto_parallel) of examples/llama.py apply here too.

Sizes from DEEPSEEK_PRESET: `tiny` (default: compiles and checks in seconds) or `v3_671b` (the
yaml's: 61 layers, hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, nope / rope / v
head dims 128 / 64 / 128, dense FFN 18432 in the first 3 layers, 256 routed experts of FFN 2048,
top 8, 1 shared expert, capacity factor 1.5, vocabulary 129280, sequence 4096). Each is overridden
by DEEPSEEK_LAYERS, DEEPSEEK_HIDDEN, DEEPSEEK_HEADS, DEEPSEEK_Q_LORA, DEEPSEEK_KV_LORA,
DEEPSEEK_NOPE, DEEPSEEK_ROPE, DEEPSEEK_V_HEAD, DEEPSEEK_FFN, DEEPSEEK_MOE_FFN, DEEPSEEK_EXPERTS,
DEEPSEEK_TOP_K, DEEPSEEK_DENSE (first_k_dense_replace), DEEPSEEK_VOCAB, DEEPSEEK_SEQ,
DEEPSEEK_BATCH; DEEPSEEK_CAPACITY the capacity factor, DEEPSEEK_DTYPE the compute dtype
(bfloat16 by default). DEEPSEEK_TOPK_METHOD: `greedy` (default, the yaml's) or
`group_limited_greedy` (mindformers' group-limited routing: the experts in DEEPSEEK_N_GROUP
groups, a token choosing among those of its DEEPSEEK_TOPK_GROUP best; 4 and 1 for tiny, 8 and 4
for v3_671b). DEEPSEEK_RECOMPUTE=1 recomputes every decoder layer (mindformers' recompute: True),
0 none, and a comma-separated list of one count per pipeline stage recomputes that stage's
first layers (mindformers' recompute list, as its LayerSetting applies it: the first n of the
stage's layers); v3_671b at the yaml's 16 stages takes the yaml's list 3,4,...,4,3,2,0 by
default, every other configuration 0; DEEPSEEK_PARALLEL_OPTIMIZER=1 shards the weights over their
data-parallel copies (the yaml's enable_parallel_optimizer, threshold 64 KB; v3_671b's default;
0 for tiny, whose weights are all smaller).

Pipeline stages as the pretraining yaml's parallel_config (DEEPSEEK_PP stages, default 16 for
v3_671b, 1 for tiny; `--pipeline-stages` overrides it): dp x mp are one stage's devices
(dp = devices / (mp x stages): 32 x 4 x 16 stages on 2048 devices), model() returns
nn.PipelineCell with DEEPSEEK_MICRO micro-batches (the yaml's micro_batch_num 32 for v3_671b;
as many as the stages otherwise); the embedding and the input split run in the first stage,
the decoder layers then the MTP layers spread as mindformers' LayerSetting counts them
((layers + mtp) // stages each plus the stage's DEEPSEEK_PP_OFFSET, the yaml's
1,...,1,-1 for v3_671b), the final norm, the LM head and the loss in the last. Each layer adds
its balance loss to the running sum, so the sum runs in the layer's stage. Under stages the
step's loss is a scalar (the micro-batches' mean), the routing groups and capacities are each
micro-batch's, the expert load adds up over the micro-batches, and the aux-loss-free bias does
not move between steps (mindformers moves it in TopkBiasBalanceCallback, outside the step);
MTP layers are refused (their embedding would be shared between the first and last stages).

    pcompile examples/deepseek.py --devices 8                      # compile + check
    DEEPSEEK_PP=2 DEEPSEEK_MICRO=1 pcompile examples/deepseek.py --devices 8  # 2 stages
    pcompile examples/deepseek.py --devices 8 --run --steps 20    # 8 processes
    DEEPSEEK_MP=1 pcompile examples/deepseek.py --devices 8        # dp 8 x ep 8
"""

import hashlib
import importlib.util
import math
import os

import numpy as np

from pcompile import (
    Layout,
    Parameter,
    Tensor,
    get_auto_parallel_context,
    initializer,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)
from pcompile.communication import create_group, get_rank
from pcompile.ops import operations as P  # noqa: N812  (mindformers' spelling)


def _load_llama():
    """examples/llama.py as a private module (its Linear, RMSNorm, rotary embedding and loss)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama.py")
    spec = importlib.util.spec_from_file_location("_deepseek_llama_cells", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


llama = _load_llama()

_NAMES = ("LAYERS", "HIDDEN", "HEADS", "Q_LORA", "KV_LORA", "NOPE", "ROPE", "V_HEAD", "FFN",
          "MOE_FFN", "EXPERTS", "TOP_K", "DENSE", "VOCAB", "SEQ", "BATCH")
PRESETS = {
    #          layers hidden heads q_lora kv_lora nope rope v ffn moe_ffn experts top_k dense
    #          vocab seq batch
    "tiny": (2, 64, 8, 32, 16, 8, 8, 8, 128, 32, 8, 2, 1, 128, 16, 8),
    "v3_671b": (61, 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 8, 3, 129280, 4096,
                1024),
}
PRESET = os.environ.get("DEEPSEEK_PRESET", "tiny")
if PRESET not in PRESETS:
    raise ValueError(f"DEEPSEEK_PRESET={PRESET!r}: choose one of {', '.join(PRESETS)}")
(LAYERS, HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD, FFN, MOE_FFN, EXPERTS, TOP_K,
 DENSE, VOCAB, SEQ, BATCH) = (int(os.environ.get(f"DEEPSEEK_{k}", v))
                             for k, v in zip(_NAMES, PRESETS[PRESET]))
Q_HEAD = NOPE + ROPE
SHARED_EXPERTS = 1
CAPACITY_FACTOR = float(os.environ.get("DEEPSEEK_CAPACITY", "1.5"))
ROUTED_SCALING = 2.5  # applied by mindformers only without norm_topk_prob
TOPK_BIAS_RATE = float(os.environ.get("DEEPSEEK_BIAS_RATE", "0.001"))
AUX_EXPERT_FACTOR = 0.0001
MTP_DEPTH = int(os.environ.get("DEEPSEEK_MTP", "0"))
MTP_LOSS_FACTOR = 0.3
GROUPS = int(os.environ.get("DEEPSEEK_GROUPS", "8"))
TOPK_METHOD = os.environ.get("DEEPSEEK_TOPK_METHOD", "greedy")
if TOPK_METHOD not in ("greedy", "group_limited_greedy"):
    raise ValueError(f"DEEPSEEK_TOPK_METHOD={TOPK_METHOD!r}: choose greedy or "
                     "group_limited_greedy")
N_GROUP, TOPK_GROUP = (int(os.environ.get(f"DEEPSEEK_{k}", v)) for k, v in
                       (("N_GROUP", 8 if PRESET == "v3_671b" else 4),
                        ("TOPK_GROUP", 4 if PRESET == "v3_671b" else 1)))
FUSED_ROUTER = os.environ.get("DEEPSEEK_FUSED_ROUTER", "1") == "1"
USE_GMM = os.environ.get("DEEPSEEK_USE_GMM", "0") == "1"  # mindformers' use_gmm: MoEV3
# the pretraining yaml's recompute_config.recompute: full recompute of the first n layers of
# each of its 16 stages
YAML_RECOMPUTE = (3,) + (4,) * 12 + (3, 2, 0)
_recompute = os.environ.get("DEEPSEEK_RECOMPUTE")
RECOMPUTE = _recompute == "1"  # every decoder layer
PARALLEL_OPTIMIZER = os.environ.get("DEEPSEEK_PARALLEL_OPTIMIZER",
                                    "1" if PRESET == "v3_671b" else "0") == "1"
SEQ_PARALLEL = os.environ.get("DEEPSEEK_SEQ_PARALLEL", "1") == "1"
COMPUTE_DTYPE = llama.DTYPES[os.environ.get("DEEPSEEK_DTYPE", "bfloat16").lower()]
ROPE_THETA, NORM_EPS = 10000.0, 1e-6
if not 1 <= TOP_K <= EXPERTS:
    raise ValueError(f"DEEPSEEK_TOP_K={TOP_K} must be between 1 and the {EXPERTS} experts")

# Pipeline stages as the yaml's parallel_config: pipeline_stage 16, micro_batch_num 32 and the
# model config's offset (the first 15 stages one layer more than 62 // 16, the last one less:
# 61 decoder layers plus the MTP layer); none for tiny. --pipeline-stages overrides the stages.
PIPELINE_STAGES = int(os.environ.get("DEEPSEEK_PP", "16" if PRESET == "v3_671b" else "1"))
MICRO_BATCHES = int(os.environ.get("DEEPSEEK_MICRO", "32" if PRESET == "v3_671b" else "0"))
YAML_OFFSET = (1,) * 15 + (-1,)
_offset = os.environ.get("DEEPSEEK_PP_OFFSET")
PP_OFFSET = (tuple(int(v) for v in _offset.split(",")) if _offset
             else YAML_OFFSET if PRESET == "v3_671b" else None)

set_auto_parallel_context(
    parallel_mode="semi_auto_parallel" if llama.STRATEGIES == "hand" else "auto_parallel",
    device_num=8, dataset_strategy="full_batch", enable_alltoall=True,
    enable_parallel_optimizer=PARALLEL_OPTIMIZER, pipeline_stages=PIPELINE_STAGES,
    # the yaml's threshold (KB); the tiny model's weights are all below it
    parallel_optimizer_config={"parallel_optimizer_threshold": 64 if PRESET == "v3_671b" else 0})


def micro_batches():
    """The micro-batches of a step: DEEPSEEK_MICRO (the yaml's micro_batch_num 32 for v3_671b),
    by default as many as the pipeline stages; 1 without stages."""
    stages = int(get_auto_parallel_context("pipeline_stages"))
    if stages == 1:
        return 1
    return MICRO_BATCHES or stages


def stage_layers(stages):
    """How many of the decoder layers, then the MTP layers, each pipeline stage runs, as
    mindformers' LayerSetting counts them: (layers + mtp) // stages plus the stage's offset
    (DEEPSEEK_PP_OFFSET, comma-separated; the yaml's for v3_671b at 16 stages); without an
    offset that fits, the remainder goes to the first stages. The yaml's offset counts its MTP
    layer (mtp_depth 1) in the last stage: without MTP that stage holds one layer less."""
    total = LAYERS + MTP_DEPTH
    if PP_OFFSET is not None and len(PP_OFFSET) == stages:
        # the yaml's MTP slot, kept empty when the model has no MTP layer
        missing = 1 if PRESET == "v3_671b" and not _offset and MTP_DEPTH == 0 else 0
        counts = [(total + missing) // stages + o for o in PP_OFFSET]
        counts[-1] -= missing
        if sum(counts) == total and min(counts) >= 0:
            return counts
        if _offset:
            raise ValueError(f"DEEPSEEK_PP_OFFSET={_offset} gives {counts} layers per stage, but "
                             f"the model has {total} ({LAYERS} decoder + {MTP_DEPTH} MTP)")
    elif _offset:
        raise ValueError(f"DEEPSEEK_PP_OFFSET={_offset} has {len(PP_OFFSET)} entries for "
                         f"{stages} pipeline stages")
    if total < stages:
        raise ValueError(f"{total} layers cannot fill {stages} pipeline stages")
    return [total // stages + (s < total % stages) for s in range(stages)]


def stage_recompute(stages):
    """How many of each stage's first layers are recomputed (mindformers' recompute list):
    DEEPSEEK_RECOMPUTE as one count per stage, else the yaml's for v3_671b at its 16 stages;
    None where no list applies (DEEPSEEK_RECOMPUTE 0 or 1, or unset elsewhere)."""
    if _recompute in ("0", "1"):
        return None
    if _recompute is None:
        return YAML_RECOMPUTE if PRESET == "v3_671b" and stages == len(YAML_RECOMPUTE) else None
    counts = tuple(int(v) for v in _recompute.split(","))
    if len(counts) != stages or min(counts) < 0:
        raise ValueError(f"DEEPSEEK_RECOMPUTE={_recompute}: 0, 1, or one count of recomputed "
                         f"layers (>= 0) per pipeline stage ({stages} here)")
    return counts


def parallel_config():
    """(dp, mp, ep) from the parallel context, as mindformers' MoEParallelConfig: the devices
    of one pipeline stage are dp x mp."""
    devices = int(get_auto_parallel_context("device_num"))
    stages = int(get_auto_parallel_context("pipeline_stages"))
    if devices > 1 and devices % stages:
        raise ValueError(f"{stages} pipeline stages do not divide the {devices} devices")
    devices = max(devices // stages, 1)
    mp = min(int(os.environ.get("DEEPSEEK_MP", "2")), devices)
    if devices % mp:
        raise ValueError(f"DEEPSEEK_MP={mp} does not divide the {devices} devices of a stage")
    dp = devices // mp
    ep = min(int(os.environ.get("DEEPSEEK_EP", str(math.gcd(dp, EXPERTS)))), dp)
    if not USE_GMM and (dp % ep or EXPERTS % ep):  # MoEV3's ep: MoEFFN
        raise ValueError(f"DEEPSEEK_EP={ep} must divide the data parallel {dp} and the "
                         f"{EXPERTS} experts")
    if GROUPS % dp:
        raise ValueError(f"DEEPSEEK_GROUPS={GROUPS} routing groups must be a multiple of the "
                         f"data parallel {dp}")
    return dp, mp, ep


def residual_strategy(dp, mp):
    """The residual stream [batch, seq, hidden] (adds and norms): under sequence parallelism
    split over the tokens on mp, the rows wo and w2 reduce-scatter: (dp, mp, 1) when a
    data-parallel rank holds one sequence (mindformers' batch_size 1), else (dp * mp, 1, 1)
    (rows are batch-major, so mp splits whole sequences)."""
    if not SEQ_PARALLEL or mp == 1:
        return (dp, 1, 1)
    local = BATCH // micro_batches() // dp  # a micro-batch's sequences per rank
    return (dp, mp, 1) if local == 1 or local % mp else (dp * mp, 1, 1)


def token_strategy(dp, mp):
    """The (B * S, h) rows of the Linears that read the residual stream."""
    return (dp * mp, 1) if SEQ_PARALLEL and mp > 1 else (dp, 1)


class FeedForward(nn.Cell):
    """mindformers' LlamaFeedForward: w2(silu(w1 x) * w3 x) in the compute dtype."""

    def __init__(self, dim, hidden_dim, dp, mp):
        super().__init__()
        if hidden_dim % mp:
            raise ValueError(f"FFN {hidden_dim} must be a multiple of the model parallel {mp}")
        self.dtype = COMPUTE_DTYPE
        self.cast = ops.Cast()
        self.w1 = llama.Linear(dim, hidden_dim, COMPUTE_DTYPE, activation=llama.LlamaSiLU).shard(
            ((dp, 1), (mp, 1)), strategy_activation=((dp, mp),))
        self.w3 = llama.Linear(dim, hidden_dim, COMPUTE_DTYPE).shard(((dp, 1), (mp, 1)))
        self.w2 = llama.Linear(hidden_dim, dim, COMPUTE_DTYPE)
        self.w2.matmul.shard(((dp, mp), (1, mp)),
                             out_strategy=((dp * mp, 1),) if SEQ_PARALLEL and mp > 1 else None)
        self.mul = ops.Mul().shard(((dp, 1, mp), (dp, 1, mp)))

    def construct(self, x):
        x = self.cast(x, self.dtype)
        return self.w2(self.mul(self.w3(x), self.w1(x)))


class MLAttention(nn.Cell):
    """mindformers' DeepSeekV2Attention (training, no incremental state)."""

    def __init__(self, dp, mp):
        super().__init__()
        if HEADS % mp:
            raise ValueError(f"heads {HEADS} must be a multiple of the model parallel {mp}")
        dtype, rows = COMPUTE_DTYPE, token_strategy(dp, mp)
        self.dtype = dtype
        self.shape = ops.Shape()
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.q2l_proj = llama.Linear(HIDDEN, Q_LORA, dtype).shard((rows, (1, 1)))
        self.lq_norm = llama.LlamaRMSNorm(Q_LORA, NORM_EPS)
        self.l2q_nope_proj = llama.Linear(Q_LORA, HEADS * NOPE, dtype).shard(((dp, 1), (mp, 1)))
        self.l2q_pe_proj = llama.Linear(Q_LORA, HEADS * ROPE, dtype).shard(((dp, 1), (mp, 1)))
        self.kv2l_k_pe = llama.Linear(HIDDEN, ROPE, dtype).shard((rows, (1, 1)))
        self.kv2l_latent_kv = llama.Linear(HIDDEN, KV_LORA, dtype).shard((rows, (1, 1)))
        self.lkv_norm = llama.LlamaRMSNorm(KV_LORA, NORM_EPS)
        self.lkv2kv_k_nope = llama.Linear(KV_LORA, HEADS * NOPE, dtype).shard(((dp, 1), (mp, 1)))
        self.lkv2kv_v = llama.Linear(KV_LORA, HEADS * V_HEAD, dtype).shard(((dp, 1), (mp, 1)))
        if SEQ_PARALLEL:  # the latents normalised on 2-D token rows
            self.lq_norm.shard((dp * mp, 1))
            self.lkv_norm.shard((dp * mp, 1))
        else:
            self.lq_norm.shard((dp, 1, 1))
            self.lkv_norm.shard((dp, 1, 1))
        self.wo = llama.Linear(HEADS * V_HEAD, HIDDEN, dtype)
        self.wo.matmul.shard(((dp, mp), (1, mp)),
                             out_strategy=((dp * mp, 1),) if SEQ_PARALLEL and mp > 1 else None)
        self.transpose = ops.Transpose().shard(((dp, 1, mp, 1),))
        self.merger_head_transpose = ops.Transpose().shard(((dp, mp, 1, 1),))
        self.tile_kv = ops.Tile().shard(((dp, mp, 1, 1),))
        self.pe_concat = ops.Concat(3).shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        self.apply_rotary_emb = llama.RotaryEmbedding(ROPE)
        self.apply_rotary_emb.shard((dp, mp, 1, 1))
        self.scale = 1.0 / math.sqrt(Q_HEAD)
        if llama.FLASH and Q_HEAD - V_HEAD not in (0, ROPE):
            raise ValueError(f"flash attention pads the value head ({V_HEAD}) to the query's "
                             f"({Q_HEAD}) with a rope-sized block of zeros: give DEEPSEEK_V_HEAD "
                             f"{Q_HEAD} or {Q_HEAD - ROPE}, or LLAMA_FLASH=0")
        if llama.FLASH:
            self.mul_zeros = ops.Mul().shard(((dp, mp, 1, 1), ()))
            self.dim_slice_4d = ops.StridedSlice().shard(((dp, mp, 1, 1),))
            self.flash_attention = ops.FlashAttentionScore(
                head_num=HEADS, keep_prob=1.0, scale_value=self.scale, pre_tokens=65536,
                next_tokens=0, input_layout="BNSD", sparse_mode=0)
            self.flash_attention.shard(((dp, mp, 1, 1), (dp, mp, 1, 1), (dp, mp, 1, 1),
                                        (dp, 1, 1, 1)))
        else:
            self.batch_matmul_q_k = ops.BatchMatMul(transpose_b=True).shard(
                ((dp, mp, 1, 1), (dp, mp, 1, 1)))
            self.batch_matmul = ops.BatchMatMul().shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
            self.mul = ops.Mul().shard(((dp, mp, 1, 1), ()))
            self.add = ops.Add().shard(((dp, 1, 1, 1), (dp, mp, 1, 1)))
            self.softmax = ops.Softmax().shard(((dp, mp, 1, 1),))
            self.cast_attn = ops.Cast()

    def _norm_rows(self, norm, x):
        if not SEQ_PARALLEL:
            return norm(x)
        shape = self.shape(x)
        return self.reshape(norm(self.reshape(x, (-1, x.shape[-1]))), shape)

    def _heads(self, x, bs, seq_len, dim):
        return self.transpose(self.reshape(x, (bs, seq_len, HEADS, dim)), (0, 2, 1, 3))

    def construct(self, x, freqs_cis, mask):
        ori_dtype = x.dtype
        bs, seq_len, _ = self.shape(x)
        norm_q = self._norm_rows(self.lq_norm, self.q2l_proj(x))
        q_nope = self._heads(self.l2q_nope_proj(norm_q), bs, seq_len, NOPE)
        q_pe = self._heads(self.l2q_pe_proj(norm_q), bs, seq_len, ROPE)
        k_pe = self.reshape(self.kv2l_k_pe(x), (bs, 1, seq_len, ROPE))
        k_pe = self.tile_kv(k_pe, (1, HEADS, 1, 1))
        latent_kv = self.reshape(self.kv2l_latent_kv(x), (bs, seq_len, KV_LORA))
        i_kv = self._norm_rows(self.lkv_norm, latent_kv)
        k_nope = self._heads(self.lkv2kv_k_nope(i_kv), bs, seq_len, NOPE)
        value = self._heads(self.lkv2kv_v(i_kv), bs, seq_len, V_HEAD)
        q_pe, k_pe = self.apply_rotary_emb(q_pe, k_pe, freqs_cis)
        query = self.pe_concat((q_nope, q_pe))
        key = self.pe_concat((k_nope, k_pe))
        if llama.FLASH:
            if Q_HEAD > V_HEAD:  # the value padded with zeros to the query's head size
                value = self.pe_concat((value, self.mul_zeros(q_pe, 0)))
            context = self.flash_attention(self.cast(query, self.dtype),
                                           self.cast(key, self.dtype),
                                           self.cast(value, self.dtype), None, None, None,
                                           mask, None, None, None)[3]
            context = self.dim_slice_4d(context, (0, 0, 0, 0), (bs, HEADS, seq_len, V_HEAD),
                                        (1, 1, 1, 1))
        else:
            score = self.mul(self.batch_matmul_q_k(query, key), self.scale)
            score = self.add(mask, score)
            probs = self.softmax(self.cast_attn(score, "float32"))
            context = self.batch_matmul(self.cast(probs, self.dtype), self.cast(value, self.dtype))
        context = self.merger_head_transpose(context, (0, 2, 1, 3))
        output = self.wo(self.reshape(context, (bs, seq_len, HEADS * V_HEAD)))
        return self.cast(output, ori_dtype)


def expert_capacity(tokens):
    """mindformers' capacity: ceil(k N capacity_factor / E) slots per expert, at most k N."""
    return min(math.ceil(TOP_K * tokens * CAPACITY_FACTOR / EXPERTS), TOP_K * tokens)


class TopkRouterV2(nn.Cell):
    """mindformers' TopkRouterV2 with sigmoid gating and aux-loss-free balancing: dispatch and
    combine indices, the router coefficients and the expert balance loss of (groups, N, E)
    float32 logits; the experts' load and the routing bias updated by the step."""

    def __init__(self, dp):
        super().__init__()
        self.dp = dp
        self.sigmoid = P.Sigmoid().shard(((dp, 1, 1),))
        self.topk_bias = Parameter(initializer("zeros", (EXPERTS,)), "topk_bias",
                                   requires_grad=False)
        self.expert_load = Parameter(initializer("zeros", (EXPERTS,)), "expert_load",
                                     requires_grad=False)
        self.afb_add_topk_bias = P.Add().shard(((dp, 1, 1), (1,)))
        self.afb_topk = P.TopK().shard(((dp, 1, 1),))
        self.gate_gather = P.Gather(batch_dims=2).shard(((dp, 1, 1), (dp, 1, 1)))
        self.onehot_2d = P.OneHot().shard(((dp, 1, 1), (), ()))
        self.reduce_mean = P.ReduceMean(keep_dims=False).shard(((dp, 1, 1),))
        self.afb_reduce_mean = P.ReduceMean(keep_dims=False).shard(((1, 1),))
        self.assign_add = P.AssignAdd().shard(((1,), (1,)))
        # TopkBiasBalanceCallback's arithmetic on the replicated state
        self.assign_add_bias = P.AssignAdd().shard(((1,), (1,)))
        self.reset_load = P.Assign().shard(((1,), (1,)))
        self.afb_load_mean = P.ReduceMean(keep_dims=True).shard(((1,),))
        self.afb_sub = P.Sub().shard(((1,), (1,)))
        self.afb_sign = P.Sign().shard(((1,),))
        self.afb_rate = P.Mul().shard(((1,), ()))
        self.zeros_e = Tensor(np.zeros((EXPERTS,), np.float32))
        self.transpose_3d = P.Transpose().shard(((dp, 1, 1),))
        self.reshape = P.Reshape()
        self.cast = P.Cast()
        self.mod = P.Mod().shard(((dp, 1, 1), ()))
        self.not_equal = P.NotEqual().shard(((dp, 1, 1), ()))
        self.mul_3d = P.Mul().shard(((dp, 1, 1), (dp, 1, 1)))
        self.reduce_sum_keep = P.ReduceSum(keep_dims=True).shard(((dp, 1, 1),))
        self.add_eps = P.Add().shard(((dp, 1, 1), ()))
        self.div_3d = P.RealDiv().shard(((dp, 1, 1), (dp, 1, 1)))
        self.reduce_mean_2d = P.ReduceMean(keep_dims=False).shard(((dp, 1),))
        self.mul_2d = P.Mul().shard(((dp, 1), (dp, 1)))
        self.on_value = Tensor(1.0, np.float32)
        self.off_value = Tensor(0.0, np.float32)
        if TOPK_METHOD == "group_limited_greedy":
            if EXPERTS % N_GROUP or not 1 <= TOPK_GROUP <= N_GROUP:
                raise ValueError(f"group-limited routing: DEEPSEEK_N_GROUP={N_GROUP} must divide "
                                 f"the {EXPERTS} experts and DEEPSEEK_TOPK_GROUP={TOPK_GROUP} "
                                 "be between 1 and it")
            self.topk = P.TopK().shard(((dp, 1, 1),))
            self.tile = P.Tile()
        if FUSED_ROUTER:
            self.topkrouter = P._inner_ops.TopKRouter().shard(((dp, 1, 1),))
        else:
            self.cumsum = P.CumSum().shard(((dp, 1, 1),))
            self.less = P.Less().shard(((dp, 1, 1), ()))
            self.reduce_sum = P.ReduceSum(keep_dims=False).shard(((dp, 1, 1),))
            self.sort_range = P.Sort().shard(((dp, 1, 1),))

    def construct(self, router_logits):
        router_prob = self.sigmoid(router_logits)                    # (groups, N, E) fp32
        topk_bias = self._balance_topk_bias()
        # aux-loss-free: the bias chooses the experts, the scores weigh them
        choice_scores = self.afb_add_topk_bias(router_prob, topk_bias)
        if TOPK_METHOD == "group_limited_greedy":
            choice_scores = self._group_limited(choice_scores)
        _, expert_index = self.afb_topk(choice_scores, TOP_K)
        expert_gate = self.gate_gather(router_prob, expert_index, 2)  # (groups, N, k)
        self._update_expert_load(expert_index)
        extra_loss = self._expert_load_balancing(router_prob, expert_index)
        if FUSED_ROUTER:
            dispatch_idx, combine_idx, router_coeff = self._maskout_topkrouter(expert_index,
                                                                              expert_gate)
        else:
            dispatch_idx, combine_idx, router_coeff = self._maskout_sort_kdrop(expert_index,
                                                                              expert_gate)
        return dispatch_idx, combine_idx, router_coeff, extra_loss

    def _group_limited(self, scores):
        """mindformers' group_limited_greedy: only the experts of each token's TOPK_GROUP best
        groups (a group's score: its best expert's) stay candidates, the others' scores 0."""
        groups, tokens, _ = scores.shape
        group_scores = self.reshape(scores, (groups, tokens, N_GROUP, -1)).max(axis=-1)
        top_values, _ = self.topk(group_scores, TOPK_GROUP)
        group_mask = self.cast(group_scores.ge(self.tile(top_values.min(axis=-1, keepdims=True),
                                                         (1, 1, N_GROUP))), "float32")
        score_mask = self.reshape(group_mask, (groups, tokens, N_GROUP, 1))
        score_mask = score_mask.repeat(EXPERTS // N_GROUP, axis=-1)
        score_mask = self.reshape(score_mask, (groups, tokens, -1))
        return ops.masked_fill(scores, ~score_mask.bool(), 0.0)

    def _balance_topk_bias(self):
        """mindformers' TopkBiasBalanceCallback, which runs between steps, at the start of
        the next: the bias moves by topk_bias_update_rate towards the experts the last step
        loaded less than the mean (sign(mean load - load)), and the load restarts from zero.
        The first step's load is zero: its bias does not move."""
        load = self.expert_load
        step = self.afb_sign(self.afb_sub(self.afb_load_mean(load, 0), load))
        topk_bias = self.assign_add_bias(self.topk_bias, self.afb_rate(step, TOPK_BIAS_RATE))
        self.reset_load(self.expert_load, self.zeros_e)
        return topk_bias

    def _update_expert_load(self, expert_index):
        groups = expert_index.shape[0]
        mask = self.onehot_2d(self.reshape(expert_index, (groups, -1)), EXPERTS,
                              self.on_value, self.off_value)          # (groups, kN, E)
        load = self.afb_reduce_mean(self.reduce_mean(mask, 1), 0)      # (E,)
        self.assign_add(self.expert_load, load)

    def _expert_load_balancing(self, scores, top_indices):
        pi = self.reduce_mean(scores, 1)                               # (groups, E)
        groups = top_indices.shape[0]
        top_indices = self.reshape(self.transpose_3d(top_indices, (0, 2, 1)), (groups, -1))
        fi = self.reduce_mean(self.onehot_2d(top_indices, EXPERTS, self.on_value,
                                             self.off_value), 1)       # (groups, E)
        return self.reduce_mean_2d(self.mul_2d(pi, fi)) * (AUX_EXPERT_FACTOR * EXPERTS ** 2)

    def _normalize(self, router_coeff_raw):
        total = self.reduce_sum_keep(router_coeff_raw, 2)
        return self.div_3d(router_coeff_raw, self.add_eps(total, 1e-9))

    def _coefficients(self, expert_gate):
        if TOP_K > 1:  # norm_topk_prob
            return self._normalize(expert_gate)
        return ops.mul(ROUTED_SCALING, expert_gate)

    def _maskout_topkrouter(self, expert_index, expert_gate):
        capacity = expert_capacity(expert_index.shape[1])
        dispatch_index, combine_index = self.topkrouter(expert_index, capacity, EXPERTS, 1)
        within = self.not_equal(self.mod(combine_index, capacity + 1), 0)
        expert_gate = self.mul_3d(self.cast(within, "float32"), expert_gate)
        return dispatch_index, combine_index, self._coefficients(expert_gate)

    def _maskout_sort_kdrop(self, expert_index, expert_gate):
        """The unfused form: every token's first choice queued first, slots from a CumSum of
        the one-hot choices, each expert's tokens from a Sort of their positions."""
        groups, tokens, k = expert_index.shape
        kn = k * tokens
        capacity = expert_capacity(tokens)
        flat = self.reshape(self.transpose_3d(expert_index, (0, 2, 1)), (groups, kn))
        mask = self.onehot_2d(flat, EXPERTS, self.on_value, self.off_value)  # (g, kN, E)
        position = self.mul_3d(self.cumsum(mask, 1), mask)
        position = self.mul_3d(position, self.cast(self.less(position, capacity + 1),
                                                   "float32"))
        slot = self.reduce_sum(position, -1)                              # (g, kN)
        combine = self.cast(flat, "float32") * (capacity + 1) + slot
        combine = self.transpose_3d(self.reshape(combine, (groups, k, tokens)), (0, 2, 1))
        within = self.cast(slot > 0, "float32")
        within = self.transpose_3d(self.reshape(within, (groups, k, tokens)), (0, 2, 1))
        order = Tensor(np.tile(np.arange(kn, dtype=np.float32), (1, EXPERTS, 1)))
        select = self.transpose_3d(mask, (0, 2, 1))                        # (g, E, kN)
        raw = select * order + (1 - select) * (order + 2 * kn)
        ranked, _ = self.sort_range(raw)
        ranked = ranked[:, :, :capacity]
        safe = self.cast(ranked < 2 * kn, "float32")
        dispatch = (self.mod(ranked, tokens) + 1) * safe
        router_coeff = self._coefficients(self.mul_3d(expert_gate, within))
        return self.cast(dispatch, "int32"), self.cast(combine, "int32"), router_coeff


class Experts(nn.Cell):
    """E SwiGLU experts as [E, in, out] weights (mindformers' FeedForward with expert_num): the
    expert axis split by ep, an expert's tokens by dp / ep, the FFN size by mp."""

    def __init__(self, dp, mp, ep):
        super().__init__()
        if MOE_FFN % mp:
            raise ValueError(f"expert FFN {MOE_FFN} must be a multiple of the model parallel "
                             f"{mp}")
        self.dtype = COMPUTE_DTYPE
        self.w1 = Parameter(initializer("normal", [EXPERTS, HIDDEN, MOE_FFN]), "w1")
        self.w3 = Parameter(initializer("normal", [EXPERTS, HIDDEN, MOE_FFN]), "w3")
        self.w2 = Parameter(initializer("normal", [EXPERTS, MOE_FFN, HIDDEN]), "w2")
        # the data-parallel axis is (dp / ep, ep): the experts take its minor factor, so one
        # AlltoAll over the ep ranks of a data-parallel group moves the slots
        layout = Layout((dp // ep, ep, mp), ("dp", "ep", "mp"))
        tokens, features = layout("ep", "dp", "None"), layout("ep", "dp", "mp")
        self.gate = ops.BatchMatMul().shard((tokens, layout("ep", "None", "mp")))
        self.up = ops.BatchMatMul().shard((tokens, layout("ep", "None", "mp")))
        self.silu = ops.SiLU().shard((features,))
        self.mul = ops.Mul().shard((features, features))
        self.down = ops.BatchMatMul().shard((features, layout("ep", "mp", "None")))
        self.cast = ops.Cast()

    def construct(self, x):
        gate = self.silu(self.gate(x, self.cast(self.w1, self.dtype)))
        hidden = self.mul(gate, self.up(x, self.cast(self.w3, self.dtype)))
        return self.down(hidden, self.cast(self.w2, self.dtype))


class MoEV2(nn.Cell):
    """mindformers' MoEV2: route each group's tokens, gather them into expert slots, run the
    experts with the expert axis in front, gather each token's k outputs back and weigh them."""

    def __init__(self, dp, mp, ep):
        super().__init__()
        self.dtype = COMPUTE_DTYPE
        self.router_dense = llama.Linear(HIDDEN, EXPERTS, "float32").shard(((dp, 1), (1, 1)))
        self.router = TopkRouterV2(dp)
        self.ffn = Experts(dp, mp, ep)
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.concat_3d = P.Concat(1).shard(((dp, 1, 1), (dp, 1, 1)))
        self.dispatch_gather = P.Gather(batch_dims=1).shard(((dp, 1, 1), (dp, 1, 1)))
        self.to_experts = P.Transpose().shard(((dp, 1, 1, 1),))
        self.to_groups = P.Transpose().shard(((1, dp, 1, 1),))
        self.concat = P.Concat(2).shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        # the zero rows are computed (a slice times 0, as mindformers pads MLA's value): a
        # (groups, E, 1, h) constant is gigabytes at 671B's sizes
        self.slice_3d = P.StridedSlice().shard(((dp, 1, 1),))
        self.zeros_3d = P.Mul().shard(((dp, 1, 1), ()))
        self.slice_4d = P.StridedSlice().shard(((dp, 1, 1, 1),))
        self.zeros_4d = P.Mul().shard(((dp, 1, 1, 1), ()))
        self.combine_gather = P.Gather(batch_dims=1).shard(((dp, 1, 1), (dp, 1, 1)))
        self.mul_router_coeff = P.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.sum_router_coeff = P.ReduceSum(keep_dims=False).shard(((dp, 1, 1, 1),))

    def construct(self, x):
        """x: [batch, seq, h] -> ([batch, seq, h], the balance loss)."""
        batch, seq, dim = x.shape
        if (batch * seq) % GROUPS:
            raise ValueError(f"{batch} x {seq} tokens do not split into DEEPSEEK_GROUPS={GROUPS}"
                             " routing groups")
        tokens = batch * seq // GROUPS
        capacity = expert_capacity(tokens)
        x = self.reshape(x, (GROUPS, tokens, dim))
        logits = self.router_dense(self.cast(self.reshape(x, (GROUPS * tokens, dim)), "float32"))
        dispatch_idx, combine_idx, router_coeff, extra_loss = self.router(
            self.reshape(logits, (GROUPS, tokens, EXPERTS)))
        x = self.cast(x, self.dtype)
        # dispatch: slot c of expert e holds token dispatch_idx - 1 (row 0: zeros)
        zero_row = self.zeros_3d(self.slice_3d(x, (0, 0, 0), (GROUPS, 1, dim), (1, 1, 1)), 0)
        padded = self.concat_3d((zero_row, x))
        slots = self.dispatch_gather(padded, dispatch_idx, 1)          # (g, E, C, h)
        slots = self.reshape(self.to_experts(slots, (1, 0, 2, 3)), (EXPERTS, GROUPS * capacity,
                                                                     dim))
        out = self.ffn(slots)
        out = self.to_groups(self.reshape(out, (EXPERTS, GROUPS, capacity, dim)), (1, 0, 2, 3))
        # combine: each choice's output at expert * (C + 1) + slot (slot 0: zeros, dropped)
        zero_slot = self.zeros_4d(self.slice_4d(out, (0, 0, 0, 0), (GROUPS, EXPERTS, 1, dim),
                                                (1, 1, 1, 1)), 0)
        out = self.concat((zero_slot, out))
        out = self.reshape(out, (GROUPS, EXPERTS * (capacity + 1), dim))
        chosen = self.combine_gather(out, combine_idx, 1)               # (g, N, k, h)
        coeff = self.cast(router_coeff, self.dtype)
        chosen = self.mul_router_coeff(chosen, self.reshape(coeff, (GROUPS, tokens, TOP_K, 1)))
        out = self.sum_router_coeff(chosen, 2)
        return self.reshape(out, (batch, seq, dim)), extra_loss


def ffn_forward(x, expert_id, counter, w1, w2, ep_group, hidden_size, ep):
    """mindformers' MoEV3 ffn_forward_func on one rank's slices (a Morph region): x (g, kN, h)
    and expert_id (g, kN) the local routing groups' choices, counter (g, E) their counts, w1
    (E / ep, h, 2 F) and w2 (E / ep, F, h) the rank's experts. The counts go to every rank of its
    expert-parallel group ep_group (an AlltoAll), the tokens and their expert ids with
    AlltoAllV, sorted there by expert for two GroupedMatmuls over the received counts with
    Swiglu between, and come back the same way.
    Differences from mindformers' function, which takes one group per rank: the local groups'
    choices are sorted by expert together first (so that each rank's tokens leave in one
    block), and the rows past the received ones (AlltoAllV's static bound, zeros) sort last."""
    groups, choices, _ = x.shape
    rows = x.reshape(-1, hidden_size)
    ids = expert_id.reshape(-1)
    _, order = ops.sort(ids)
    _, back_order = ops.sort(ops.cast(order, "float32"))
    rows, ids = ops.gather(rows, order, 0), ops.gather(ids, order, 0)
    counter = counter.sum(0).reshape(1, EXPERTS)
    local_counter = ops.AlltoAll(ep, -1, -2, ep_group)(counter)        # (ep, E / ep)
    send = ops.MoveTo()(ops.cast(counter.reshape(ep, -1).sum(-1), "int32"), "CPU", True)
    recv = ops.MoveTo()(ops.cast(local_counter.sum(-1), "int32"), "CPU", True)
    group_list = ops.cumsum(ops.cast(local_counter.sum(0), "int32"), 0)
    received = ops.AlltoAllV(ep_group, hidden_size)(rows.reshape(-1), send, recv)
    received = received.reshape(-1, hidden_size)
    ids = ops.AlltoAllV(ep_group, 1)(ids, send, recv)
    index = Tensor(np.arange(ids.shape[0], dtype=np.int32))
    valid = ops.cast(index < recv.sum(), "float32")
    _, sort_map = ops.sort(ids * valid + EXPERTS * (1 - valid))
    _, unsort_map = ops.sort(ops.cast(sort_map, "float32"))
    gmm = ops.GroupedMatmul(split_item=3, group_type=0)
    gate = gmm([ops.gather(received, sort_map, 0)], [w1], None, None, None, None, None,
               group_list)[0]
    hidden = ops.Swiglu()(gate, -1)
    y = gmm([hidden], [w2], None, None, None, None, None, group_list)[0]
    y = ops.gather(y, unsort_map, 0)
    y = ops.AlltoAllV(ep_group, hidden_size)(y.reshape(-1), recv, send)
    y = ops.gather(y.reshape(-1, hidden_size), back_order, 0)
    return y.reshape(groups, choices, hidden_size)


def _morph_shape(*shapes):
    return shapes[0]


def _morph_dtype(*dtypes):
    return dtypes[0]


_EP_GROUP_NAME = {}


def ep_group_name(ep):
    """mindformers' FFN._get_ep_group_name: this rank's expert-parallel group, the ep
    consecutive ranks from rank // ep * ep, named by a hash of their list and created once."""
    start = get_rank() // ep * ep
    ranks = list(range(start, start + ep))
    key = "-".join(str(r) for r in ranks)
    if key not in _EP_GROUP_NAME:
        _EP_GROUP_NAME[key] = hashlib.sha256(key.encode()).hexdigest()[:48]
        create_group(_EP_GROUP_NAME[key], ranks)
    return _EP_GROUP_NAME[key]


class MoEFFN(nn.Cell):
    """mindformers' MoEV3 `FFN` cell: w1 [E, h, 2 F] (gate and up) and w2 [E, F, h], the experts
    in a Morph region (`hook_ffn_forward`, self_define_shard) laid out as mindformers' Layout
    (outer_dp, inner_dp, sp, mp0, mp1) = (devices / ep, ep, 1, 1, 1): the groups over
    (outer_dp, inner_dp), the experts over inner_dp = ep. Its AlltoAll and AlltoAllVs run over
    the rank's expert-parallel group (ep_group_name)."""

    def __init__(self, devices):
        super().__init__()
        ep = min(int(os.environ.get("DEEPSEEK_EP", str(devices))), devices)
        if devices % ep:
            raise ValueError(f"DEEPSEEK_USE_GMM=1: the expert parallel DEEPSEEK_EP={ep} must "
                             f"divide data_parallel * model_parallel ({devices}), as mindformers' "
                             "MoEV3 requires")
        if EXPERTS % ep or GROUPS % devices:
            raise ValueError(f"DEEPSEEK_USE_GMM=1 puts E / ep experts on each of the ep={ep} "
                             f"ranks of an expert-parallel group and splits the routing groups "
                             f"over the {devices} ranks: {EXPERTS} experts must be a multiple of "
                             f"{ep} and DEEPSEEK_GROUPS={GROUPS} of {devices}")
        self.dtype = COMPUTE_DTYPE
        self.ep = ep
        self.ep_group = ep_group_name(ep)
        self.w1 = Parameter(initializer("normal", [EXPERTS, HIDDEN, 2 * MOE_FFN]), "w1")
        self.w2 = Parameter(initializer("normal", [EXPERTS, MOE_FFN, HIDDEN]), "w2")
        self.cast = P.Cast()
        layout = Layout((devices // ep, ep, 1, 1, 1), ("outer_dp", "inner_dp", "sp", "mp0",
                                                          "mp1"))
        self.hook_ffn_forward = P.Morph(ffn_forward, _morph_shape, _morph_dtype)
        self.hook_ffn_forward.add_prim_attr("self_define_shard", True)
        self.hook_ffn_forward.shard(
            in_strategy=(layout(("outer_dp", "inner_dp"), "sp", "mp0"),   # x [g, kN, h]
                         layout(("outer_dp", "inner_dp"), "sp"),          # expert_id [g, kN]
                         layout(("outer_dp", "inner_dp"), "sp"),          # counter [g, E]
                         layout("inner_dp", "mp0", "mp1"),                # w1 [E, h, 2F]
                         layout("inner_dp", "mp1", "mp0")),               # w2 [E, F, h]
            out_strategy=(layout(("outer_dp", "inner_dp"), "sp", "mp0"),))

    def construct(self, x, expert_id, counter):
        w1, w2 = self.cast(self.w1, self.dtype), self.cast(self.w2, self.dtype)
        return self.hook_ffn_forward(x, expert_id, counter, w1, w2, self.ep_group, HIDDEN,
                                     self.ep)


class MoEV3(nn.Cell):
    """mindformers' MoEV3 (use_gmm: dropless, GroupedMatmul, AlltoAllV): routing as
    TopkRouterV2's without capacity (sigmoid scores, aux-loss-free bias, the expert load, the
    coefficients normalised over the k then times routed_scaling_factor), each group's k N
    choices sorted by expert (_tensor_sort: Sort, Gather, the OneHot counts), the experts in
    MoEFFN's Morph region, the sort undone and each token's k outputs weighed and summed
    (_tensor_unsort). The balance loss reads the normalised scores and their own top k, as
    MoEV3's does with balance_via_topk_bias."""

    def __init__(self, dp, mp):
        super().__init__()
        devices = dp * mp
        self.dtype = COMPUTE_DTYPE
        self.router_dense = llama.Linear(HIDDEN, EXPERTS, "float32").shard(((dp, 1), (1, 1)))
        self.router = TopkRouterV2(dp)
        self.ffn = MoEFFN(devices)
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.aux_topk = P.TopK().shard(((dp, 1, 1),))
        self.mul_scaling = P.Mul().shard(((), (dp, 1, 1)))
        self.transpose_3d = P.Transpose().shard(((dp, 1, 1),))
        self.sort = P.Sort(1).shard(((dp, 1),))
        self.mod = P.Mod().shard(((dp, 1), ()))
        self.gather_sort = P.Gather(batch_dims=1).shard(((dp, 1, 1), (dp, 1)))
        self.onehot = P.OneHot().shard(((dp, 1, 1), (), ()))
        self.reduce_cnt = P.ReduceSum(keep_dims=False).shard(((dp, 1, 1),))
        self.transpose_unsort_map = P.Transpose().shard(((dp, 1, 1),))
        self.gather_unsort = P.Gather(batch_dims=1).shard(((dp, 1, 1), (dp, 1, 1)))
        self.mul_router_coeff = P.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.sum_router_coeff = P.ReduceSum(keep_dims=False).shard(((dp, 1, 1, 1),))
        self.on_value = Tensor(1.0, np.float32)
        self.off_value = Tensor(0.0, np.float32)

    def _route(self, router_logits):
        router = self.router
        router_prob = router.sigmoid(router_logits)                    # (g, N, E) fp32
        choice_scores = router.afb_add_topk_bias(router_prob, router._balance_topk_bias())
        if TOPK_METHOD == "group_limited_greedy":
            choice_scores = router._group_limited(choice_scores)
        _, expert_index = router.afb_topk(choice_scores, TOP_K)
        expert_gate = router.gate_gather(router_prob, expert_index, 2)  # (g, N, k)
        router._update_expert_load(expert_index)
        coeff = router._normalize(expert_gate) if TOP_K > 1 else expert_gate
        coeff = self.mul_scaling(ROUTED_SCALING, coeff)
        prob_for_aux = router._normalize(router_prob)
        _, index_for_aux = self.aux_topk(prob_for_aux, TOP_K)
        return expert_index, coeff, router._expert_load_balancing(prob_for_aux, index_for_aux)

    def construct(self, x):
        """x: [batch, seq, h] -> ([batch, seq, h], the balance loss)."""
        batch, seq, dim = x.shape
        if (batch * seq) % GROUPS:
            raise ValueError(f"{batch} x {seq} tokens do not split into DEEPSEEK_GROUPS={GROUPS}"
                             " routing groups")
        tokens = batch * seq // GROUPS
        x = self.reshape(x, (GROUPS, tokens, dim))
        logits = self.router_dense(self.cast(self.reshape(x, (GROUPS * tokens, dim)), "float32"))
        expert_index, coeff, extra_loss = self._route(
            self.reshape(logits, (GROUPS, tokens, EXPERTS)))
        x = self.cast(x, self.dtype)
        # _tensor_sort: each group's choices (first choices first) sorted by expert
        index = self.reshape(self.transpose_3d(expert_index, (0, 2, 1)), (GROUPS, -1))
        sorted_index, sort_map = self.sort(self.cast(index, "float32"))
        expert_input = self.gather_sort(x, self.mod(sort_map, tokens), 1)   # (g, kN, h)
        counter = self.reduce_cnt(self.onehot(index, EXPERTS, self.on_value, self.off_value), 1)
        _, unsort_map = self.sort(self.cast(sort_map, "float32"))
        unsort_map = self.transpose_unsort_map(self.reshape(unsort_map, (GROUPS, TOP_K, tokens)),
                                               (0, 2, 1))                   # (g, N, k)
        expert_output = self.ffn(expert_input, sorted_index, counter)
        # _tensor_unsort
        out = self.gather_unsort(expert_output, unsort_map, 1)               # (g, N, k, h)
        out = self.mul_router_coeff(out, self.cast(self.reshape(coeff, (GROUPS, tokens, TOP_K,
                                                                        1)), self.dtype))
        out = self.sum_router_coeff(out, 2)
        return self.reshape(out, (batch, seq, dim)), extra_loss


class FeedForwardWithMoE(nn.Cell):
    """mindformers' LlamaFeedForwardWithMoE: the routed experts plus the shared expert."""

    def __init__(self, dp, mp, ep):
        super().__init__()
        self.routed_experts = MoEV3(dp, mp) if USE_GMM else MoEV2(dp, mp, ep)
        self.shared_experts = FeedForward(HIDDEN, MOE_FFN * SHARED_EXPERTS, dp, mp)
        self.add = ops.Add().shard(((dp, 1, 1), (dp, 1, 1)))
        self.cast = ops.Cast()

    def construct(self, x):
        routed, extra_loss = self.routed_experts(x)
        shared = self.shared_experts(x)
        return self.add(self.cast(routed, shared.dtype), shared), extra_loss


class DecodeLayer(nn.Cell):
    def __init__(self, layer_id, dp, mp, ep):
        super().__init__()
        self.attention_norm = llama.LlamaRMSNorm(HIDDEN, NORM_EPS)
        self.ffn_norm = llama.LlamaRMSNorm(HIDDEN, NORM_EPS)
        self.attention = MLAttention(dp, mp)
        self.moe = layer_id >= DENSE
        self.feed_forward = (FeedForwardWithMoE(dp, mp, ep) if self.moe
                             else FeedForward(HIDDEN, FFN, dp, mp))
        residual = residual_strategy(dp, mp)
        self.add = ops.Add().shard((residual, residual))
        self.attention_norm.shard(residual)
        self.ffn_norm.shard(residual)
        self.cast = ops.Cast()

    def construct(self, x, freqs_cis, mask, extra_loss=0.0):
        """(the layer's output, `extra_loss` plus its balance loss): as mindformers' decode
        layer, each layer adds its own, so that the sum runs in the layer's pipeline stage."""
        h = self.add(x, self.attention(self.attention_norm(x), freqs_cis, mask))
        if self.moe:
            out, layer_loss = self.feed_forward(self.ffn_norm(h))
            extra_loss = extra_loss + layer_loss
        else:
            out = self.feed_forward(self.ffn_norm(h))
        return self.add(h, self.cast(out, h.dtype)), extra_loss


class MTPHiddenFuser(nn.Cell):
    """mindformers' MTPHiddenFuser: the normalised hidden state and next-token embedding,
    concatenated and projected back to the hidden size."""

    def __init__(self, dp, mp):
        super().__init__()
        self.norm = llama.LlamaRMSNorm(HIDDEN, NORM_EPS)
        self.norm_emb = llama.LlamaRMSNorm(HIDDEN, NORM_EPS)
        residual = residual_strategy(dp, mp)
        self.norm.shard(residual)
        self.norm_emb.shard(residual)
        self.concat = ops.Concat(-1).shard((residual, residual))
        self.dense = llama.Linear(2 * HIDDEN, HIDDEN, COMPUTE_DTYPE).shard(
            (token_strategy(dp, mp), (1, 1)))
        self.cast = ops.Cast()

    def construct(self, h, h_emb):
        return self.dense(self.concat((self.norm(h), self.cast(self.norm_emb(h_emb), h.dtype))))


class DeepseekV3Model(nn.Cell):
    def __init__(self, dp, mp, ep):
        super().__init__()
        self.shape = ops.Shape()
        self.cast = ops.Cast()
        self.reshape = ops.Reshape()
        self.embedding_weight = Parameter(initializer("normal", [VOCAB, HIDDEN]),
                                          "embedding_weight")
        self.gather = ops.Gather().shard(((1, 1), (dp, 1)))
        self.layers = nn.CellList([DecodeLayer(i, dp, mp, ep) for i in range(LAYERS)])
        if RECOMPUTE:  # mindformers' recompute: True (the assignments are not recomputed)
            for layer in self.layers:
                layer.recompute()
        self.norm_out = llama.LlamaRMSNorm(HIDDEN, NORM_EPS)
        self.norm_out.shard(residual_strategy(dp, mp))
        self.freqs_cos, self.freqs_sin = llama.rope_tables(SEQ, ROPE, ROPE_THETA)
        self.mask = llama.causal_mask(SEQ)
        self.tile_mask = ops.Tile().shard(((1, 1, 1, 1),))
        self.mask_cast = ops.Cast()
        self.mtp_fusers = nn.CellList([MTPHiddenFuser(dp, mp) for _ in range(MTP_DEPTH)])
        self.mtp_layers = nn.CellList([DecodeLayer(DENSE, dp, mp, ep)
                                       for _ in range(MTP_DEPTH)])
        self.mtp_norms = nn.CellList([llama.LlamaRMSNorm(HIDDEN, NORM_EPS)
                                      for _ in range(MTP_DEPTH)])
        for norm in self.mtp_norms:
            norm.shard(residual_strategy(dp, mp))

    def embed(self, tokens):
        bs, seq_len = self.shape(tokens)
        h = self.cast(self.gather(self.embedding_weight, tokens, 0), COMPUTE_DTYPE)
        return self.reshape(h, (bs, seq_len, HIDDEN))

    def construct(self, tokens, mtp_tokens):
        """The main model's hidden states and, per MTP depth, the depth's (their logits are
        scored against labels shifted once more), and the layers' balance losses."""
        bs, _ = self.shape(tokens)
        mask = self.tile_mask(self.mask, (bs, 1, 1, 1))
        if not llama.FLASH:
            mask = self.mask_cast(mask, COMPUTE_DTYPE)
        freqs_cis = (self.freqs_cos, self.freqs_sin)
        h = self.embed(tokens)
        extra_loss = 0.0
        for layer in self.layers:
            h, extra_loss = layer(h, freqs_cis, mask, extra_loss)
        outputs = [self.norm_out(h)]
        for fuser, layer, norm, next_tokens in zip(self.mtp_fusers, self.mtp_layers,
                                                   self.mtp_norms, mtp_tokens):
            h, extra_loss = layer(fuser(h, self.embed(next_tokens)), freqs_cis, mask,
                                  extra_loss)
            outputs.append(norm(h))
        return outputs, extra_loss


class InputSplit(nn.Cell):
    """tokens = input_ids[:, :-1], labels = input_ids[:, 1:] (a cell of its own: under
    pipeline stages it runs in the first stage, the loss in the last)."""

    def __init__(self, dp):
        super().__init__()
        self.shape = ops.Shape()
        self.slice = ops.StridedSlice().shard(((dp, 1),))

    def construct(self, input_ids):
        bsz, seqlen = self.shape(input_ids)
        return (self.slice(input_ids, (0, 0), (bsz, seqlen - 1), (1, 1)),
                self.slice(input_ids, (0, 1), (bsz, seqlen), (1, 1)))


class DeepseekV3ForCausalLM(nn.Cell):
    """mindformers' TrainingDeepseekV3ForCausalLM: tokens = input_ids[:, :-1], labels =
    input_ids[:, 1:]; the masked cross-entropy (padding and ignored labels do not count), the
    MoE layers' balance losses and, per MTP depth, its loss on labels shifted once more (the
    shifted-out end padded) times mtp_loss_factor / depth; a (1,) tensor."""

    def __init__(self):
        super().__init__()
        dp, mp, ep = parallel_config()
        set_seed(1)
        self.model = DeepseekV3Model(dp, mp, ep)
        self.lm_head = llama.Linear(HIDDEN, VOCAB, COMPUTE_DTYPE)
        self.lm_head.shard(((dp, 1), (mp, 1)) if VOCAB % mp == 0 else ((dp, 1), (1, 1)))
        self.loss = llama.CrossEntropyLoss(dp, mp)
        self.shape = ops.Shape()
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.input_split = InputSplit(dp)
        self.scalar_loss = False  # set by model() under pipeline stages
        self.slice = ops.StridedSlice().shard(((dp, 1),))
        self.not_equal = ops.NotEqual().shard(((dp, 1), ()))
        self.mul = ops.Mul().shard(((dp, 1), (dp, 1)))
        self.concat_2d = ops.Concat(-1).shard(((dp, 1), (dp, 1)))

    def _shift_and_pad(self, x):
        """x one position to the left, the end padded with zeros (mindformers' roll)."""
        bs, seq_len = self.shape(x)
        x = self.slice(x, (0, 1), (bs, seq_len), (1, 1))
        return self.concat_2d((x, Tensor(np.zeros((bs, 1)), x.dtype)))

    def _loss(self, hidden, labels, tokens):
        input_mask = self.cast(self.not_equal(tokens, llama.PAD_TOKEN_ID), "float32")
        label_mask = self.cast(self.not_equal(labels, llama.IGNORE_TOKEN_ID), "float32")
        logits = self.cast(self.lm_head(hidden), "float32")
        return self.loss(self.reshape(logits, (-1, VOCAB)), labels,
                         self.mul(input_mask, label_mask))

    def construct(self, input_ids):
        tokens, labels = self.input_split(input_ids)
        mtp_tokens, shifted = [], tokens
        for _ in range(MTP_DEPTH):
            shifted = self._shift_and_pad(shifted)
            mtp_tokens.append(shifted)
        outputs, extra_loss = self.model(tokens, mtp_tokens)
        loss = self._loss(outputs[0], labels, tokens) + extra_loss
        for depth in range(MTP_DEPTH):
            labels = self._shift_and_pad(labels)
            tokens = self._shift_and_pad(tokens)
            loss = loss + self._loss(outputs[depth + 1], labels, tokens) * (
                MTP_LOSS_FACTOR / MTP_DEPTH)
        if self.scalar_loss:  # nn.PipelineCell: the step's loss is its micro-batches' mean
            return self.reshape(loss, ())
        return loss


def assign_stages(net, stages):
    """mindformers' pipeline placement: the embedding in the first stage, the decoder layers
    then the MTP layers spread by `stage_layers`, the final norm and LM head in the last."""
    counts = stage_layers(stages)
    owners = [s for s, n in enumerate(counts) for _ in range(n)]
    if MTP_DEPTH:
        raise ValueError(f"DEEPSEEK_MTP={MTP_DEPTH} with {stages} pipeline stages: the MTP "
                         "layers embed their tokens with the first stage's embedding, which "
                         "this example does not share across stages; use DEEPSEEK_MTP=0")
    net.pipeline_stage = stages - 1  # the loss
    net.input_split.pipeline_stage = 0
    backbone = net.model
    backbone.pipeline_stage = 0
    for layer, stage in zip(backbone.layers, owners):
        layer.pipeline_stage = stage
    for layer, stage in zip(backbone.mtp_layers, owners[LAYERS:]):
        layer.pipeline_stage = stage
    for cell in (*backbone.mtp_fusers, *backbone.mtp_norms, backbone.norm_out, net.lm_head,
                 net.loss):
        cell.pipeline_stage = stages - 1


def model():
    net = DeepseekV3ForCausalLM()
    if llama.STRATEGIES == "none":  # LLAMA_STRATEGIES=none: the search decides every op
        llama.remove_strategies(net)
    stages = int(get_auto_parallel_context("pipeline_stages"))
    if stages > 1 and int(get_auto_parallel_context("device_num")) > 1:
        assign_stages(net, stages)
        recompute_layers(net, stages)
        net.scalar_loss = True
        # The routers accumulate the experts' load over the micro-batches (AssignAdd), but the
        # bias moves between steps (mindformers' TopkBiasBalanceCallback), not once per
        # micro-batch: with stages they read the bias as it is (see docs/deepseek.md).
        for _, cell in net.cells_and_names():
            if isinstance(cell, TopkRouterV2):
                cell._balance_topk_bias = lambda router=cell: router.topk_bias
        return nn.PipelineCell(net, micro_size=micro_batches())
    recompute_layers(net, stages)  # (the single-device reference of a pipelined plan too)
    return net


def recompute_layers(net, stages):
    """mindformers' recompute list: the first n layers of each stage recomputed
    (`stage_recompute`), the stages counted by `stage_layers`."""
    counts = stage_recompute(stages)
    if counts is None:
        return
    owners = [s for s, n in enumerate(stage_layers(stages)) for _ in range(n)]
    for i, (layer, stage) in enumerate(zip(net.model.layers, owners)):
        if i - owners.index(stage) < counts[stage]:
            layer.recompute()


def optimizer(params):
    return nn.AdamWeightDecay(params, learning_rate=1e-3, weight_decay=0.01)


def dataset():
    """Learnable sequences (each next token the previous one + 1, mod the vocabulary, skipping
    the padding id 0; the last sample ends in padding)."""
    return llama.learnable_sequences(VOCAB, SEQ, BATCH)


def inputs():
    return next(iter(dataset()))
