"""A Mixtral-style mixture of experts with expert parallelism, as mindformers trains it: the
decoder of `examples/llama.py` (RMSNorm, grouped-query attention with rotary embedding, the
masked cross-entropy inside the network) with every feed-forward replaced by a sparse MoE
layer of SwiGLU experts, top-k routed with a capacity, and the router's load-balancing loss
added to the language-model loss.

Written from mindformers' MoE architecture (`MoE` with a top-k router and `FeedForward(...,
expert_num=E)`) and its strategies:

* **router**: a float32 Dense [hidden -> E] split by batch, a softmax, `TopK` (k of E); the
  k chosen probabilities normalised to sum to one (Mixtral's `norm_topk_prob`);
* **capacity**: each data-parallel group of T tokens gives every expert
  C = ceil(k T capacity_factor / E) slots, first choices before second choices, in token
  order (`CumSum(exclusive=True)` over the one-hot choices); a choice past its expert's
  capacity is dropped (the residual carries the token);
* **dispatch and combine** as one-hot BatchMatMuls: [dp, T, E C] dispatch (and combine,
  weighted by the gates) tensors, the tokens gathered per slot as [dp, E C, h];
* **expert parallelism**: the experts' weights are [E, in, out] tensors split over the experts
  by ep (and over the FFN size by mp); a Transpose moves the expert axis to the front, and the
  expert BatchMatMuls' layouts split it over ep (the data-parallel axis's minor factor): with
  `enable_alltoall` the redistribution between the two is one AlltoAll (dispatch), and the
  Transpose back to the data-parallel groups another (combine), per layer and direction;
* **load balancing**: Switch/Mixtral's auxiliary loss E * sum_e f_e P_e (f_e the share of the
  group's choices routed to e, P_e its mean router probability), times MIXTRAL_AUX (0.01).

The attention, the norms, the LM head and the loss are examples/llama.py's cells (loaded from
beside this file), so its LLAMA_FLASH, LLAMA_RECOMPUTE, LLAMA_SEQ_PARALLEL and LLAMA_STRATEGIES
(`none`: every shard() removed, auto_parallel) apply here too.

Parallelism from the parallel context and the environment: mp = MIXTRAL_MP (default 1),
dp = devices / mp, ep = MIXTRAL_EP (default min(dp, experts)); ep divides both dp and the
expert count. dp 8 x mp 1 x ep 8 on 8 devices, as mindformers' Mixtral configuration.

Sizes come from a preset, MIXTRAL_PRESET: `tiny` (default: compiles and checks in seconds) or
`mixtral_8x7b` (32 layers, hidden 4096, 32 heads, 8 kv heads, expert FFN 14336, vocabulary
32000, sequence 4096, 8 experts, top 2). Each is overridden by MIXTRAL_LAYERS, MIXTRAL_HIDDEN,
MIXTRAL_HEADS, MIXTRAL_KV_HEADS, MIXTRAL_FFN, MIXTRAL_VOCAB, MIXTRAL_SEQ, MIXTRAL_BATCH,
MIXTRAL_EXPERTS, MIXTRAL_TOP_K; MIXTRAL_CAPACITY (1.1) is the capacity factor, MIXTRAL_DTYPE
the compute dtype (`bfloat16` by default, or `float32`, `float16`).

MIXTRAL_PRETRAINED: a safetensors checkpoint with Hugging Face Mixtral names (a file, a
`model.safetensors.index.json` or a folder holding either) to start from, read with
`load_checkpoint(path, name_map="mixtral")`: pcompile's built-in map renames every tensor and
reads each expert's w1/w2/w3 [out, in] weights, transposed, as the slices of the stacked
[experts, in, out] parameters; each rank reads only its slices. The sizes must be the
checkpoint's. `pcompile-merge DIR --names mixtral` writes a run's weights back under
Hugging Face's names, one tensor per expert.

    pcompile examples/mixtral.py --devices 8                       # compile + check
    pcompile examples/mixtral.py --devices 8 --run --steps 20     # 8 processes
    MIXTRAL_MP=2 pcompile examples/mixtral.py --devices 8          # dp 4 x mp 2 x ep 4
    MIXTRAL_PRESET=mixtral_8x7b MIXTRAL_MP=8 MIXTRAL_BATCH=64 pcompile examples/mixtral.py \\
        --devices 64 --no-check --dump-ranks 0
"""

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
    load_checkpoint,
    load_param_into_net,
    nn,
    ops,
    set_auto_parallel_context,
    set_seed,
)


def _load_llama():
    """examples/llama.py as a private module, made anew on every load (its LLAMA_* settings
    are read when it runs)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama.py")
    spec = importlib.util.spec_from_file_location("_mixtral_llama_cells", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


llama = _load_llama()

PRESETS = {
    #              layers hidden heads kv ffn    vocab  seq   batch experts top_k theta
    "tiny": (2, 64, 8, 4, 128, 128, 16, 8, 8, 2, 10000.0),
    "mixtral_8x7b": (32, 4096, 32, 8, 14336, 32000, 4096, 8, 8, 2, 1000000.0),
}
PRESET = os.environ.get("MIXTRAL_PRESET", "tiny")
if PRESET not in PRESETS:
    raise ValueError(f"MIXTRAL_PRESET={PRESET!r}: choose one of {', '.join(PRESETS)}")
_NAMES = ("LAYERS", "HIDDEN", "HEADS", "KV_HEADS", "FFN", "VOCAB", "SEQ", "BATCH", "EXPERTS",
          "TOP_K")
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, SEQ, BATCH, EXPERTS, TOP_K = (
    int(os.environ.get(f"MIXTRAL_{k}", v)) for k, v in zip(_NAMES, PRESETS[PRESET]))
ROPE_THETA = PRESETS[PRESET][10]
GROUPS = int(os.environ.get("MIXTRAL_GROUPS", "8"))
CAPACITY_FACTOR = float(os.environ.get("MIXTRAL_CAPACITY", "1.1"))
AUX_LOSS_FACTOR = float(os.environ.get("MIXTRAL_AUX", "0.01"))
COMPUTE_DTYPE = llama.DTYPES[os.environ.get("MIXTRAL_DTYPE", "bfloat16").lower()]
if not 1 <= TOP_K <= EXPERTS:
    raise ValueError(f"MIXTRAL_TOP_K={TOP_K} must be between 1 and the {EXPERTS} experts")

# Expert parallelism moves tokens with AlltoAll: MindSpore's enable_alltoall (off by default)
# lets a redistribution that moves a split from one dimension to another use it.
set_auto_parallel_context(
    parallel_mode="semi_auto_parallel" if llama.STRATEGIES == "hand" else "auto_parallel",
    device_num=8, dataset_strategy="full_batch", enable_alltoall=True)


def parallel_config():
    """(dp, mp, ep) from the parallel context, as mindformers' MoEParallelConfig."""
    devices = int(get_auto_parallel_context("device_num"))
    mp = min(int(os.environ.get("MIXTRAL_MP", "1")), devices)
    if devices % mp:
        raise ValueError(f"MIXTRAL_MP={mp} does not divide the {devices} devices")
    dp = devices // mp
    # at most dp (one device: no expert parallelism), as mp is at most the device count
    ep = min(int(os.environ.get("MIXTRAL_EP", str(math.gcd(dp, EXPERTS)))), dp)
    if dp % ep or EXPERTS % ep:
        raise ValueError(f"MIXTRAL_EP={ep} must divide the data parallel {dp} and the "
                         f"{EXPERTS} experts")
    return dp, mp, ep


def expert_capacity(tokens):
    """Slots per expert for a group of `tokens`: ceil(k tokens capacity_factor / E), at most
    the group's k tokens."""
    return min(math.ceil(TOP_K * tokens * CAPACITY_FACTOR / EXPERTS), TOP_K * tokens)


class TopKRouter(nn.Cell):
    """Logits of E experts per token (float32), their softmax, the k largest, the one-hot
    dispatch and the gate-weighted combine tensors with each expert's capacity, and the
    load-balancing loss of the group."""

    def __init__(self, dim, dp):
        super().__init__()
        self.dense = llama.Linear(dim, EXPERTS, "float32").shard(((dp, 1), (1, 1)))
        self.reshape = ops.Reshape()
        self.softmax = ops.Softmax().shard(((dp, 1, 1),))
        self.topk = ops.TopK().shard(((dp, 1, 1),))
        self.gate_sum = ops.ReduceSum(keep_dims=True).shard(((dp, 1, 1),))
        self.gate_div = ops.RealDiv().shard(((dp, 1, 1), (dp, 1, 1)))
        self.choice_first = ops.Transpose().shard(((dp, 1, 1),))
        self.onehot_expert = ops.OneHot().shard(((dp, 1, 1), (), ()))
        self.cumsum = ops.CumSum(exclusive=True).shard(((dp, 1, 1),))
        self.pick = ops.Mul().shard(((dp, 1, 1), (dp, 1, 1)))
        self.slot_sum = ops.ReduceSum().shard(((dp, 1, 1),))
        self.less = ops.Less().shard(((dp, 1), ()))
        self.cast = ops.Cast()
        self.onehot_slot = ops.OneHot().shard(((dp, 1, 1), (), ()))
        self.expand_e = ops.ExpandDims().shard(((dp, 1, 1),))
        self.expand_c = ops.ExpandDims().shard(((dp, 1, 1),))
        self.outer = ops.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.keep = ops.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.weigh = ops.Mul().shard(((dp, 1, 1, 1), (dp, 1, 1, 1)))
        self.choice_sum = ops.ReduceSum().shard(((dp, 1, 1, 1),))
        self.choice_sum2 = ops.ReduceSum().shard(((dp, 1, 1, 1),))
        self.mean_tokens = ops.ReduceMean().shard(((dp, 1, 1),))
        self.mean_probs = ops.ReduceMean().shard(((dp, 1, 1),))
        self.balance = ops.Mul().shard(((dp, 1), (dp, 1)))
        self.balance_sum = ops.ReduceSum().shard(((dp, 1),))
        self.on_value = Tensor(np.float32(1.0))
        self.off_value = Tensor(np.float32(0.0))

    def construct(self, x):
        """x: [groups, T, h] -> dispatch [groups, T, E C], combine [groups, T, E C] (float32)
        and the auxiliary loss (a scalar, the mean over the groups)."""
        groups, tokens, dim = x.shape
        capacity = expert_capacity(tokens)
        logits = self.dense(self.reshape(x, (groups * tokens, dim)))
        probs = self.softmax(self.reshape(logits, (groups, tokens, EXPERTS)))
        gates, experts = self.topk(probs, TOP_K)                           # [dp, T, k]
        gates = self.gate_div(gates, self.gate_sum(gates, -1))
        # choices in priority order: every token's first choice, then the second ...
        experts = self.reshape(self.choice_first(experts, (0, 2, 1)), (groups, TOP_K * tokens))
        gates = self.reshape(self.choice_first(gates, (0, 2, 1)), (groups, TOP_K * tokens))
        chosen = self.onehot_expert(experts, EXPERTS, self.on_value, self.off_value)
        before = self.cumsum(chosen, 1)                                    # [dp, kT, E]
        slot = self.slot_sum(self.pick(before, chosen), -1)                # [dp, kT]
        fits = self.cast(self.less(slot, float(capacity)), "float32")
        slot_onehot = self.onehot_slot(self.cast(slot, "int32"), capacity, self.on_value,
                                       self.off_value)                     # [dp, kT, C]
        dispatch = self.outer(self.expand_c(chosen, 3), self.expand_e(slot_onehot, 2))
        dispatch = self.keep(dispatch, self.reshape(fits, (groups, TOP_K * tokens, 1, 1)))
        combine = self.weigh(dispatch, self.reshape(gates, (groups, TOP_K * tokens, 1, 1)))
        slots = EXPERTS * capacity
        dispatch = self.choice_sum(self.reshape(dispatch, (groups, TOP_K, tokens, slots)), 1)
        combine = self.choice_sum2(self.reshape(combine, (groups, TOP_K, tokens, slots)), 1)
        # E * sum_e f_e P_e per group: f_e over the group's k T choices
        share = self.mean_tokens(chosen, 1)                                # [dp, E]
        mean_prob = self.mean_probs(probs, 1)                              # [dp, E]
        aux = self.balance_sum(self.balance(share, mean_prob), -1) * float(EXPERTS / groups)
        return dispatch, combine, aux.sum()


class Experts(nn.Cell):
    """E SwiGLU experts as [E, in, out] weights: w2(silu(x w1) * x w3) per expert, the expert
    axis split by ep, the tokens of an expert by dp / ep, the FFN size by mp."""

    def __init__(self, dim, hidden_dim, compute_dtype, dp, mp, ep):
        super().__init__()
        if hidden_dim % mp:
            raise ValueError(f"expert FFN {hidden_dim} must be a multiple of the model "
                             f"parallel {mp}")
        self.dtype = compute_dtype
        self.w1 = Parameter(initializer("normal", [EXPERTS, dim, hidden_dim]), "w1")
        self.w3 = Parameter(initializer("normal", [EXPERTS, dim, hidden_dim]), "w3")
        self.w2 = Parameter(initializer("normal", [EXPERTS, hidden_dim, dim]), "w2")
        # The data-parallel axis is (dp / ep, ep): the experts take its minor factor, so the
        # ep ranks that exchange slots are the ones whose groups a rank's experts serve (one
        # AlltoAll over ep ranks); the tokens of an expert are split over the major factor.
        layout = Layout((dp // ep, ep, mp), ("dp", "ep", "mp"))
        tokens, features = layout("ep", "dp", "None"), layout("ep", "dp", "mp")
        self.gate = ops.BatchMatMul().shard((tokens, layout("ep", "None", "mp")))
        self.up = ops.BatchMatMul().shard((tokens, layout("ep", "None", "mp")))
        self.silu = ops.SiLU().shard((features,))
        self.mul = ops.Mul().shard((features, features))
        self.down = ops.BatchMatMul().shard((features, layout("ep", "mp", "None")))
        self.cast = ops.Cast()

    def construct(self, x):
        """x: [E, tokens, h] in the compute dtype -> [E, tokens, h]."""
        gate = self.silu(self.gate(x, self.cast(self.w1, self.dtype)))
        hidden = self.mul(gate, self.up(x, self.cast(self.w3, self.dtype)))
        return self.down(hidden, self.cast(self.w2, self.dtype))


class MoE(nn.Cell):
    """The sparse feed-forward: route each data-parallel group's tokens, gather them per expert
    slot, move the expert axis to the front (the dispatch AlltoAll), run the experts, move it
    back (the combine AlltoAll) and sum each token's slots weighted by its gates."""

    def __init__(self, dim, hidden_dim, compute_dtype, dp, mp, ep):
        super().__init__()
        if GROUPS % dp:
            raise ValueError(f"MIXTRAL_GROUPS={GROUPS} routing groups must be a multiple of "
                             f"the data parallel {dp}")
        self.dtype = compute_dtype
        self.router = TopKRouter(dim, dp)
        self.experts = Experts(dim, hidden_dim, compute_dtype, dp, mp, ep)
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.gather_slots = ops.BatchMatMul(transpose_a=True).shard(((dp, 1, 1), (dp, 1, 1)))
        self.to_experts = ops.Transpose().shard(((dp, 1, 1, 1),))
        self.to_groups = ops.Transpose().shard(((1, dp, 1, 1),))
        self.combine = ops.BatchMatMul().shard(((dp, 1, 1), (dp, 1, 1)))

    def construct(self, x):
        """x: [batch, seq, h] -> ([batch, seq, h], the auxiliary loss)."""
        batch, seq, dim = x.shape
        if (batch * seq) % GROUPS:
            raise ValueError(f"{batch} x {seq} tokens do not split into MIXTRAL_GROUPS={GROUPS}"
                             " routing groups")
        tokens = batch * seq // GROUPS
        capacity = expert_capacity(tokens)
        x = self.cast(self.reshape(x, (GROUPS, tokens, dim)), self.dtype)
        dispatch, combine, aux = self.router(x)
        slots = self.gather_slots(self.cast(dispatch, self.dtype), x)     # [dp, E C, h]
        slots = self.reshape(slots, (GROUPS, EXPERTS, capacity, dim))
        slots = self.to_experts(slots, (1, 0, 2, 3))                      # [E, dp, C, h]
        out = self.experts(self.reshape(slots, (EXPERTS, GROUPS * capacity, dim)))
        out = self.reshape(out, (EXPERTS, GROUPS, capacity, dim))
        out = self.to_groups(out, (1, 0, 2, 3))                           # [dp, E, C, h]
        out = self.reshape(out, (GROUPS, EXPERTS * capacity, dim))
        out = self.combine(self.cast(combine, self.dtype), out)           # [dp, T, h]
        return self.reshape(out, (batch, seq, dim)), aux


class MixtralDecodeLayer(nn.Cell):
    def __init__(self, dp, mp, ep):
        super().__init__()
        self.attention_norm = llama.LlamaRMSNorm(HIDDEN)
        self.ffn_norm = llama.LlamaRMSNorm(HIDDEN)
        self.attention = llama.LlamaAttention(HIDDEN, HEADS, KV_HEADS, COMPUTE_DTYPE, dp, mp)
        self.moe = MoE(HIDDEN, FFN, COMPUTE_DTYPE, dp, mp, ep)
        self.cast = ops.Cast()
        self.add = ops.Add().shard(((dp, 1, 1), (dp, 1, 1)))
        self.attention_norm.shard((dp, 1, 1))
        self.ffn_norm.shard((dp, 1, 1))

    def construct(self, x, freqs_cis, mask):
        h = self.add(x, self.attention(self.attention_norm(x), freqs_cis, mask))
        out, aux = self.moe(self.ffn_norm(h))
        return self.add(h, self.cast(out, h.dtype)), aux


class MixtralForCausalLM(nn.Cell):
    """Next-token training from the token ids (tokens = input_ids[:, :-1], labels =
    input_ids[:, 1:], padding and ignored labels masked), the mean cross-entropy plus the
    layers' load-balancing losses times MIXTRAL_AUX, a (1,) tensor."""

    def __init__(self):
        super().__init__()
        dp, mp, ep = parallel_config()
        set_seed(1)
        self.embedding_weight = Parameter(initializer("normal", [VOCAB, HIDDEN]),
                                          "embedding_weight")
        self.gather = ops.Gather().shard(((1, 1), (dp, 1)))
        self.layers = nn.CellList([MixtralDecodeLayer(dp, mp, ep) for _ in range(LAYERS)])
        self.norm_out = llama.LlamaRMSNorm(HIDDEN)
        self.norm_out.shard((dp, 1, 1))
        self.freqs_cos, self.freqs_sin = llama.rope_tables(SEQ, HIDDEN // HEADS, ROPE_THETA)
        self.mask = llama.causal_mask(SEQ)
        self.tile_mask = ops.Tile().shard(((1, 1, 1, 1),))
        self.mask_cast = ops.Cast()
        self.lm_head = llama.Linear(HIDDEN, VOCAB, COMPUTE_DTYPE)
        self.lm_head.shard(((dp, 1), (mp, 1)) if VOCAB % mp == 0 else ((dp, 1), (1, 1)))
        self.loss = llama.CrossEntropyLoss(dp, mp)
        self.shape = ops.Shape()
        self.reshape = ops.Reshape()
        self.cast = ops.Cast()
        self.slice = ops.StridedSlice().shard(((dp, 1),))
        self.not_equal = ops.NotEqual().shard(((dp, 1), ()))
        self.mul = ops.Mul().shard(((dp, 1), (dp, 1)))
        self.aux_factor = AUX_LOSS_FACTOR / LAYERS

    def construct(self, input_ids):
        bsz, seqlen = self.shape(input_ids)
        tokens = self.slice(input_ids, (0, 0), (bsz, seqlen - 1), (1, 1))
        labels = self.slice(input_ids, (0, 1), (bsz, seqlen), (1, 1))
        input_mask = self.cast(self.not_equal(tokens, llama.PAD_TOKEN_ID), "float32")
        label_mask = self.cast(self.not_equal(labels, llama.IGNORE_TOKEN_ID), "float32")
        input_mask = self.mul(input_mask, label_mask)
        mask = self.tile_mask(self.mask, (bsz, 1, 1, 1))
        if not llama.FLASH:
            mask = self.mask_cast(mask, COMPUTE_DTYPE)
        h = self.cast(self.gather(self.embedding_weight, tokens, 0), COMPUTE_DTYPE)
        h = self.reshape(h, (bsz, seqlen - 1, HIDDEN))
        aux = 0.0
        for layer in self.layers:
            h, layer_aux = layer(h, (self.freqs_cos, self.freqs_sin), mask)
            aux = aux + layer_aux
        logits = self.cast(self.lm_head(self.norm_out(h)), "float32")
        loss = self.loss(self.reshape(logits, (-1, VOCAB)), labels, input_mask)
        return loss + aux * self.aux_factor


def model():
    net = MixtralForCausalLM()
    if llama.STRATEGIES == "none":  # LLAMA_STRATEGIES=none: the search decides every op
        llama.remove_strategies(net)
    path = os.environ.get("MIXTRAL_PRETRAINED")
    if path:
        not_loaded, _ = load_param_into_net(net, load_checkpoint(path, name_map="mixtral"))
        if not_loaded:
            raise ValueError(f"MIXTRAL_PRETRAINED={path} has no tensor for "
                             f"{', '.join(not_loaded)} (Hugging Face names, mapped by "
                             "name_map='mixtral')")
    return net


def optimizer(params):
    return nn.AdamWeightDecay(params, learning_rate=1e-3, weight_decay=0.01)


def dataset():
    """Learnable sequences (each next token the previous one + 1, mod the vocabulary, skipping
    the padding id 0; the last sample ends in padding)."""
    return llama.learnable_sequences(VOCAB, SEQ, BATCH)


def inputs():
    return next(iter(dataset()))
