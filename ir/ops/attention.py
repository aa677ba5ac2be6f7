"""FlashAttentionScore (MindSpore's `ops.FlashAttentionScore`) and FlashAttentionScoreGrad.

Operands: query, key, value and, optionally, attn_mask (MindSpore's other optional inputs,
real_shift, drop_mask, padding_mask, prefix and the actual sequence lengths, are refused by the
user-facing primitive). Attributes and outputs follow MindSpore:

* `input_layout` BSH (B, S, N*D), SBH (S, B, N*D), BNSD (B, N, S, D) or BSND (B, S, N, D);
  `head_num` is N1, the query's head count; key and value have N2 heads, N2 dividing N1
  (grouped-query attention: query head h reads kv head h // (N1 / N2)).
* scores = scale_value * query @ key^T in float32; positions masked out (below) get
  -0.7 * float32 max before the float32 softmax (a row with every position masked averages
  the values, as jax.nn.dot_product_attention does); probabilities are rounded to the value
  dtype and multiplied by value.
* `sparse_mode` (i a query position, j a key position, S1/S2 the query/kv lengths):
  0 defaultMask: without attn_mask nothing is masked (pre_tokens/next_tokens ignored); with
    it, keep where attn_mask == 0 and -pre_tokens <= j - i <= next_tokens;
  1 allMask: keep where attn_mask == 0;
  2 leftUpCausal: keep j <= i;
  3 rightDownCausal: keep j - i <= S2 - S1;
  4 band: keep -pre_tokens <= j - i - (S2 - S1) <= next_tokens.
  In modes 2-4 attn_mask, when given, is the kernel's compressed (2048, 2048) causal pattern
  and its values are not read. Modes 5-8 (prefix, global, dilated, block-local) are refused.
* `keep_prob` must be 1.0 (dropout inside attention is refused); `inner_precise` selects a
  precision mode of Ascend's kernel and is kept for the dump only.
* Outputs: softmax_max and softmax_sum (Float32, (B, N1, S1, 8), the row max and the row sum
  of exp(scores - max), repeated 8 times as the kernel stores them), softmax_out (a (1,)
  placeholder of the query dtype, zeros) and attention_out (the query's shape and dtype).

The JAX implementation computes attention_out with `jax.nn.dot_product_attention` (cuDNN's
fused kernel on GPUs for 16-bit inputs, its XLA path elsewhere; 16-bit inputs on CPU and float64
use the same computation written out, see `_implementation`), with `is_causal=True` whenever
the positions kept are exactly j <= i. That includes mindformers' call, sparse_mode 0 with a
constant causal attn_mask: `causal_lowering_attrs` recognises the mask from the graph at
compile time (`ir/ops/causal_mask.py`) and the lowering runs the node as sparse_mode 2, so
XLA drops the mask. The statistics come from the same computation on the written-out path;
through jax.nn.dot_product_attention they are computed apart, and XLA removes them when the
program does not read them (FlashAttentionScoreGrad's JAX form does not). Inside a lowering
(`ir.lowering.lowering`) the forward is run by `jax.vjp` and leaves its pullback in the
lowering's memo; FlashAttentionScoreGrad of the same query, key, value, mask and output runs
that pullback (cuDNN's backward from the forward's own residuals) instead of differentiating
a second forward, as a hand-written `jax.grad` does. Gradients flow
through attention_out only: reading softmax_max/softmax_sum/softmax_out in a differentiated
computation is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.dims import DimRule, Divides, Fixed, In, Out, Product, Same
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.lowering import current_lowering, lowering_memo
from pcompile.ir.ops._define import define, grad_helper
from pcompile.ir.ops._jax import jax, jnp
from pcompile.ir.ops._util import is_zero, same_dtype, tensor, tuple_type
from pcompile.ir.ops.causal_mask import is_causal_mask
from pcompile.ir.rank import RankScalar, RankValue, layout_offsets
from pcompile.ir.registry import FLOATS
from pcompile.ir.sharding import (
    Expansion,
    LabelRule,
    Labels,
    LocalLowering,
    OpContext,
    OpSharding,
    Strategy,
    StrategyError,
    fresh_labels,
    label_sharding,
)
from pcompile.ir.types import DType, TensorType, TupleType, ValueType

LAYOUTS = ("BSH", "SBH", "BNSD", "BSND")
INT_MAX = 2147483647
SOFTMAX_LAST_DIM = 8
COMPRESSED_MASK = (2048, 2048)
SUPPORTED_SPARSE_MODES = (0, 1, 2, 3, 4)
# jax.nn.dot_product_attention's fill for masked float32 logits.
MASKED = -0.7 * float(np.finfo(np.float32).max)

DEFAULTS: dict[str, Any] = {
    "head_num": None,
    "keep_prob": 1.0,
    "scale_value": 1.0,
    "pre_tokens": INT_MAX,
    "next_tokens": INT_MAX,
    "inner_precise": 0,
    "input_layout": "BSH",
    "sparse_mode": 0,
}


@dataclass(frozen=True)
class AttentionDims:
    """The sizes one FlashAttentionScore application works on."""

    batch: int
    q_seq: int
    kv_seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    layout: str

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q_heads // self.kv_heads

    @property
    def seq_dim(self) -> int:
        """The query/key dim that holds the sequence in this layout."""
        return {"BSH": 1, "SBH": 0, "BNSD": 2, "BSND": 1}[self.layout]

    @property
    def head_axis(self) -> int:
        """The query/key dim that holds the heads (or the hidden size N * D)."""
        return {"BSH": 2, "SBH": 2, "BNSD": 1, "BSND": 2}[self.layout]


def _int(attrs: dict[str, Any], name: str) -> int:
    value = attrs[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShapeError(f"attribute {name} must be an int, got {value!r}")
    return value


def check_attrs(attrs: dict[str, Any]) -> tuple[str, int]:
    """(input_layout, sparse_mode), after checking every attribute."""
    layout = attrs["input_layout"]
    if layout not in LAYOUTS:
        raise ShapeError(
            f"input_layout must be one of {', '.join(LAYOUTS)}, got {layout!r} (TND and TH "
            "need actual sequence lengths, which are not supported)"
        )
    if attrs["head_num"] is None:
        raise ShapeError("needs attribute head_num (the number of query heads)")
    if _int(attrs, "head_num") < 1:
        raise ShapeError(f"head_num must be positive, got {attrs['head_num']}")
    keep_prob = attrs["keep_prob"]
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)):
        raise ShapeError(f"keep_prob must be a float, got {keep_prob!r}")
    if keep_prob != 1.0:
        raise ShapeError(
            f"keep_prob {keep_prob}: dropout inside attention is not supported; use "
            "keep_prob=1.0 (and no drop_mask)"
        )
    scale = attrs["scale_value"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ShapeError(f"scale_value must be a float, got {scale!r}")
    for name in ("pre_tokens", "next_tokens", "inner_precise"):
        _int(attrs, name)
    mode = _int(attrs, "sparse_mode")
    if mode not in SUPPORTED_SPARSE_MODES:
        raise ShapeError(
            f"sparse_mode {mode} is not supported; supported: 0 (defaultMask), 1 (allMask), "
            "2 (leftUpCausal), 3 (rightDownCausal), 4 (band)"
        )
    return layout, mode


def attention_dims(query: tuple[int, ...], key: tuple[int, ...], head_num: int, layout: str
                   ) -> AttentionDims:
    """Sizes from the query and key shapes; ShapeError when they do not fit the layout."""
    rank = 3 if layout in ("BSH", "SBH") else 4
    if len(query) != rank or len(key) != rank:
        raise ShapeError(
            f"input_layout {layout} needs rank-{rank} query and key, got {query} and {key}"
        )
    if layout in ("BSH", "SBH"):
        b_dim, s_dim = (0, 1) if layout == "BSH" else (1, 0)
        hidden, kv_hidden = query[2], key[2]
        if hidden % head_num:
            raise ShapeError(
                f"the query hidden size {hidden} must divide by head_num {head_num}"
            )
        head_dim = hidden // head_num
        if kv_hidden % head_dim:
            raise ShapeError(
                f"the key hidden size {kv_hidden} must be a multiple of the head size "
                f"{head_dim} (query hidden {hidden} / head_num {head_num})"
            )
        kv_heads = kv_hidden // head_dim
        batch, kv_batch = query[b_dim], key[b_dim]
        q_seq, kv_seq = query[s_dim], key[s_dim]
    else:
        n_dim, s_dim = (1, 2) if layout == "BNSD" else (2, 1)
        if query[n_dim] != head_num:
            raise ShapeError(
                f"query dim {n_dim} ({layout}) must equal head_num {head_num}, got {query}"
            )
        if query[3] != key[3]:
            raise ShapeError(f"query and key head sizes differ: {query} and {key}")
        head_dim, kv_heads = query[3], key[n_dim]
        batch, kv_batch = query[0], key[0]
        q_seq, kv_seq = query[s_dim], key[s_dim]
    if batch != kv_batch:
        raise ShapeError(f"query and key batch sizes differ: {query} and {key} ({layout})")
    if kv_heads < 1 or head_num % kv_heads:
        raise ShapeError(
            f"the key has {kv_heads} head(s), which must divide head_num {head_num} "
            "(grouped-query attention)"
        )
    return AttentionDims(batch, q_seq, kv_seq, head_num, kv_heads, head_dim, layout)


def _check_mask(mask: TensorType, dims: AttentionDims, mode: int) -> None:
    if mask.dtype not in (DType.bool_, DType.uint8):
        raise ShapeError(
            f"attn_mask must be Bool or UInt8 (1/True = masked out), got {mask.dtype.value}"
        )
    if mode in (2, 3, 4):
        if mask.shape != COMPRESSED_MASK:
            raise ShapeError(
                f"sparse_mode {mode} takes the compressed (2048, 2048) attn_mask (or none), "
                f"got {mask.shape}"
            )
        return
    b, n, s1, s2 = dims.batch, dims.q_heads, dims.q_seq, dims.kv_seq
    ok = mask.shape == (s1, s2) or (
        mask.rank == 4 and mask.shape[2:] == (s1, s2) and mask.shape[0] in (1, b)
        and mask.shape[1] in (1, n))
    if not ok:
        raise ShapeError(
            f"attn_mask shape {mask.shape} must be ({b}, {n}, {s1}, {s2}), ({b}, 1, {s1}, "
            f"{s2}) or ({s1}, {s2}) (batch, query heads, query and kv sequence)"
        )


def _infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    q, k, v = (tensor(t, name) for t, name in zip(types, ("query", "key", "value")))
    layout, mode = check_attrs(attrs)
    dtype = same_dtype([q, k, v])
    if not dtype.is_float:
        raise ShapeError(f"query, key and value must be floating-point, got {dtype.value}")
    if v.shape != k.shape:
        raise ShapeError(f"value shape {v.shape} must equal key shape {k.shape}")
    dims = attention_dims(q.shape, k.shape, attrs["head_num"], layout)
    if len(types) == 4:
        _check_mask(tensor(types[3], "attn_mask"), dims, mode)
    elif mode == 1:
        raise ShapeError("sparse_mode 1 (allMask) needs attn_mask")
    stats = TensorType(DType.float32, (dims.batch, dims.q_heads, dims.q_seq, SOFTMAX_LAST_DIM))
    return tuple_type(stats, stats, TensorType(dtype, (1,)), q)


# -- masks ---------------------------------------------------------------------------------------


def position_keep(mode: int, pre_tokens: int, next_tokens: int, q_seq: int, kv_seq: int,
                  has_mask: bool) -> np.ndarray | None:
    """The positions (q_seq, kv_seq) that `sparse_mode` keeps, None when it keeps all."""
    i = np.arange(q_seq)[:, None]
    j = np.arange(kv_seq)[None, :]
    if mode == 0:
        if not has_mask:
            return None
        keep = (j - i >= -pre_tokens) & (j - i <= next_tokens)
    elif mode == 1:
        return None
    elif mode == 2:
        keep = j <= i
    elif mode == 3:
        keep = j - i <= kv_seq - q_seq
    else:
        offset = j - i - (kv_seq - q_seq)
        keep = (offset >= -pre_tokens) & (offset <= next_tokens)
    return None if keep.all() else keep


def keep_mask(xp: Any, mask: Any, attrs: dict[str, Any], dims: AttentionDims) -> Any:
    """Boolean keep mask broadcastable to (B, N1, S1, S2), or None (keep everything)."""
    mode = attrs["sparse_mode"]
    keep = position_keep(mode, attrs["pre_tokens"], attrs["next_tokens"], dims.q_seq,
                         dims.kv_seq, mask is not None)
    out = None if keep is None else xp.asarray(keep)[None, None]
    if mask is not None and mode in (0, 1):
        user = mask == 0
        user = user[None, None] if user.ndim == 2 else user
        out = user if out is None else xp.logical_and(user, out)
    return out


def causal_lowering_attrs(node: Node, attrs: dict[str, Any]) -> dict[str, Any]:
    """`lowering_attrs` of FlashAttentionScore(Grad): when the attn_mask operand is a
    constant causal mask (`ir/ops/causal_mask.py`: 1 exactly where j > i in every block) and
    the mode keeps exactly j <= i with it (mode 1; mode 0 when its window
    -pre_tokens <= j - i <= next_tokens keeps all of j <= i: next_tokens >= 0 and pre_tokens
    >= S1 - 1), the same attention as sparse_mode 2 (leftUpCausal, whose mask operand is not
    read): the JAX implementation then runs the fused causal kernel
    (`jax.nn.dot_product_attention(is_causal=True)`) and XLA drops the mask's computation.
    Anything else (no mask, another mask, rank-dependent windows as a query split makes them)
    keeps `attrs`."""
    # (operands with a mask, the mask's position): (q, k, v, mask) and (q, k, v, dy, mask, ...)
    with_mask, at = (4, 3) if node.op == "FlashAttentionScore" else (8, 4)
    if len(node.operands) != with_mask:
        return attrs
    mode, pre, nxt = attrs["sparse_mode"], attrs["pre_tokens"], attrs["next_tokens"]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (mode, pre, nxt)):
        return attrs  # a rank-dependent window (a query split): per rank, not causal
    if mode not in (0, 1):
        return attrs  # modes 2-4 do not read the mask; attention_out_jax sees their causality
    q_seq = attention_dims(tuple(node.operands[0].shape), tuple(node.operands[1].shape),
                           attrs["head_num"], attrs["input_layout"]).q_seq
    if mode == 0 and not (nxt >= 0 and pre >= q_seq - 1):
        return attrs
    if not is_causal_mask(node.operands[at]):
        return attrs
    return {**attrs, "sparse_mode": 2, "pre_tokens": INT_MAX, "next_tokens": INT_MAX}


def query_split_window(attrs: dict[str, Any], q_seq: int, kv_seq: int, split_id: int,
                       split_num: int) -> dict[str, int]:
    """sparse_mode, pre_tokens and next_tokens for the `split_id`-th of `split_num` equal
    slices of the query sequence (MindSpore's flash_attention_score_info), so that the slice
    keeps exactly the positions the whole query keeps. `q_seq` is the whole query length.

    defaultMask shifts its window by the slice offset; the causal modes and band become band
    (4) aligned to the slice's bottom-right corner; allMask needs no change (its mask rows are
    split with the query)."""
    mode = int(attrs["sparse_mode"])
    if mode == 1 or split_num == 1:
        return {}
    length = q_seq // split_num
    offset = split_id * length
    pre, nxt = int(attrs["pre_tokens"]), int(attrs["next_tokens"])
    if mode == 0:
        pre, nxt = pre - offset, nxt + offset
    elif mode == 2:
        # left-up causal (j <= i) seen from the slice's bottom-right corner
        pre, nxt = 2 * kv_seq - offset - length, offset + length - kv_seq
    else:
        if mode == 3:
            pre, nxt = kv_seq, 0
        below = (split_num - split_id - 1) * length
        pre, nxt = pre + below, nxt - below
    if mode == 2 and q_seq > kv_seq:
        # MindSpore's window bounds j from below by i - kv_seq, which a causal mask does not
        # do when the query is longer than the keys: leave it unbounded.
        pre = INT_MAX
    return {"sparse_mode": 4 if mode in (2, 3, 4) else mode,
            "pre_tokens": _int32(pre), "next_tokens": _int32(nxt)}


@dataclass(frozen=True)
class QueryWindow(RankValue):
    """`key` (pre_tokens or next_tokens) of `query_split_window` for the query slice a rank
    holds: the slice starting at `start` (a `RankScalar`) of `length` positions."""

    window: tuple[tuple[str, int], ...]
    q_seq: int
    kv_seq: int
    start: RankScalar
    length: int
    key: str

    def at(self, rank: int) -> int:
        split_id = self.start.at(rank) // self.length
        out = query_split_window(dict(self.window), self.q_seq, self.kv_seq, split_id,
                                 self.q_seq // self.length)
        return int(out.get(self.key, dict(self.window)[self.key]))


def _int32(value: int) -> int:
    """MindSpore's saturating add keeps the window in int32."""
    return max(-INT_MAX - 1, min(INT_MAX, value))


# -- layouts -------------------------------------------------------------------------------------


def to_bnsd(xp: Any, x: Any, layout: str, heads: int) -> Any:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return xp.transpose(x, (0, 2, 1, 3))
    if layout == "SBH":
        x = xp.transpose(x, (1, 0, 2))
    b, s, h = x.shape
    return xp.transpose(xp.reshape(x, (b, s, heads, h // heads)), (0, 2, 1, 3))


def from_bnsd(xp: Any, x: Any, layout: str) -> Any:
    if layout == "BNSD":
        return x
    x = xp.transpose(x, (0, 2, 1, 3))  # B S N D
    if layout == "BSND":
        return x
    b, s, n, d = x.shape
    x = xp.reshape(x, (b, s, n * d))
    return xp.transpose(x, (1, 0, 2)) if layout == "SBH" else x


def _operands(arrays: tuple[Any, ...], attrs: dict[str, Any]
              ) -> tuple[Any, Any, Any, Any, AttentionDims]:
    q, k, v = arrays[:3]
    mask = arrays[3] if len(arrays) == 4 else None
    dims = attention_dims(tuple(q.shape), tuple(k.shape), attrs["head_num"],
                          attrs["input_layout"])
    return q, k, v, mask, dims


# -- numpy reference -----------------------------------------------------------------------------


def _probabilities(q: np.ndarray, k: np.ndarray, mask: Any, attrs: dict[str, Any],
                   dims: AttentionDims) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(queries, repeated keys, masked scores, keep) in float32, BNSD."""
    wide = np.result_type(np.float32, q.dtype, k.dtype)  # float64 stays float64 (the oracle)
    qb = to_bnsd(np, q, dims.layout, dims.q_heads).astype(wide)
    kb = to_bnsd(np, k, dims.layout, dims.kv_heads).astype(wide)
    kb = np.repeat(kb, dims.group, axis=1)
    scores = wide.type(attrs["scale_value"]) * np.einsum("bnsd,bntd->bnst", qb, kb)
    keep = keep_mask(np, mask, attrs, dims)
    if keep is not None:
        scores = np.where(keep, scores, wide.type(MASKED))
    return qb, kb, scores.astype(wide), keep


def _fa_np(*arrays: Any, **attrs: Any) -> tuple[np.ndarray, ...]:
    q, k, v, mask, dims = _operands(arrays, attrs)
    _, _, scores, _ = _probabilities(q, k, mask, attrs, dims)
    row_max = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - row_max)
    row_sum = e.sum(axis=-1, keepdims=True)
    wide = scores.dtype
    probs = (e / row_sum).astype(v.dtype).astype(wide)
    vb = np.repeat(to_bnsd(np, v, dims.layout, dims.kv_heads).astype(wide), dims.group, 1)
    out = from_bnsd(np, np.einsum("bnst,bntd->bnsd", probs, vb), dims.layout).astype(q.dtype)
    stats_shape = row_max.shape[:3] + (SOFTMAX_LAST_DIM,)
    return (np.broadcast_to(row_max, stats_shape).astype(wide),
            np.broadcast_to(row_sum, stats_shape).astype(wide),
            np.zeros((1,), q.dtype), out)


# -- JAX -----------------------------------------------------------------------------------------


def _implementation(dtype: Any, dims: AttentionDims, explicit_mask: bool
                    ) -> Literal["xla", "cudnn"] | None:
    """cuDNN's fused kernel where it applies (GPU, 16-bit inputs, head size a multiple of 8
    up to 128, no mask other than causal); jax.nn.dot_product_attention's XLA path elsewhere,
    except where that path is not the op: 16-bit inputs on CPU, whose backward it cannot
    lower (it asks dot_general for an F16_F16_F32 / BF16_BF16_F32 precision CPUs lack), and
    float64 (the oracle's evaluation), whose softmax it rounds to float32. None: the same
    computation written here (`_attention_xla`)."""
    backend = jax.default_backend()
    size = np.dtype(dtype).itemsize
    if size > 4:
        return None
    half = size == 2
    # The lowering's `fused_attention=False` (PCOMPILE_ATTENTION=xla) keeps GPUs off cuDNN (a
    # way out should its kernel reject a configuration at compile time).
    if (backend == "gpu" and half and dims.head_dim % 8 == 0 and dims.head_dim <= 128
            and not explicit_mask and current_lowering().fused_attention):
        return "cudnn"
    return None if half and backend == "cpu" else "xla"


def _attention_xla(q: Any, k: Any, v: Any, mask: Any, scale: float, causal: bool
                   ) -> tuple[Any, Any, Any]:
    """jax.nn.dot_product_attention's XLA computation (BTNH operands) without an explicit
    dot precision: float32 scores (float64 in float64), masks, softmax in that type,
    probabilities in v's dtype. Returns (out BTNH, row max, row sum), the statistics
    (B, N, T, 1) from the same scores."""
    b, t, n, h = q.shape
    kv_heads, s = k.shape[2], k.shape[1]
    wide = jnp.promote_types(q.dtype, jnp.float32)
    qg = jnp.reshape(q, (b, t, kv_heads, n // kv_heads, h))
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=wide)
    logits = logits * jnp.asarray(scale, wide)
    keep = None if mask is None else jnp.reshape(
        jnp.broadcast_to(mask, (b, n, t, s)), (b, kv_heads, n // kv_heads, t, s))
    if causal:
        tril = jnp.tril(jnp.ones((t, s), bool))
        keep = tril if keep is None else jnp.logical_and(keep, tril)
    if keep is not None:
        logits = jnp.where(keep, logits, MASKED)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    unnormalised = jnp.exp(logits - jax.lax.stop_gradient(row_max))
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    probs = (unnormalised / row_sum).astype(v.dtype)
    out = jnp.reshape(jnp.einsum("BKGTS,BSKH->BTKGH", probs, v), (b, t, n, h))
    return out, jnp.reshape(row_max, (b, n, t, 1)), jnp.reshape(row_sum, (b, n, t, 1))


def _masking(mask: Any, attrs: dict[str, Any], dims: AttentionDims) -> tuple[bool, Any]:
    """(causal, keep): whether the positions kept are exactly j <= i (the fused kernel's
    `is_causal`), else the boolean keep mask (None: keep everything)."""
    mode = attrs["sparse_mode"]
    if mode == 2:  # leftUpCausal (also a constant causal mask, `causal_lowering_attrs`)
        return True, None
    keep = position_keep(mode, attrs["pre_tokens"], attrs["next_tokens"], dims.q_seq,
                         dims.kv_seq, mask is not None)
    uses_mask = mask is not None and mode in (0, 1)
    causal = keep is not None and np.array_equal(keep, np.tril(np.ones_like(keep)))
    if uses_mask or (keep is not None and not causal):
        return False, keep_mask(jnp, mask, attrs, dims)
    return causal, None


def _attention(q: Any, k: Any, v: Any, mask: Any, attrs: dict[str, Any], dims: AttentionDims,
               statistics: bool) -> tuple[Any, Any, Any]:
    """(attention_out in the op's layout, row max, row sum (B, N1, S1, 1)). On the written-out
    path one computation gives all three; through jax.nn.dot_product_attention the
    statistics (when asked for) are computed apart, and XLA removes them when nothing reads
    them (a training step reads them only in FlashAttentionScoreGrad, whose JAX form does
    not)."""
    def btnh(x: Any, heads: int) -> Any:
        return jnp.transpose(to_bnsd(jnp, x, dims.layout, heads), (0, 2, 1, 3))

    operands = (btnh(q, dims.q_heads), btnh(k, dims.kv_heads), btnh(v, dims.kv_heads))
    causal, keep = _masking(mask, attrs, dims)
    scale = float(attrs["scale_value"])
    impl = _implementation(q.dtype, dims, keep is not None)
    if impl is None:
        out, row_max, row_sum = _attention_xla(*operands, keep, scale, causal)
    else:
        out = jax.nn.dot_product_attention(*operands, mask=keep, scale=scale,
                                           is_causal=causal, implementation=impl)
        row_max = row_sum = None
        if statistics:
            _, row_max, row_sum = _attention_xla(*operands, keep, scale, causal)
    return from_bnsd(jnp, jnp.transpose(out, (0, 2, 1, 3)), dims.layout), row_max, row_sum


def attention_out_jax(q: Any, k: Any, v: Any, mask: Any, attrs: dict[str, Any],
                      dims: AttentionDims) -> Any:
    """attention_out through jax.nn.dot_product_attention (or its computation written out,
    see `_implementation`)."""
    return _attention(q, k, v, mask, attrs, dims, statistics=False)[0]


@dataclass(frozen=True)
class _Forward:
    """What a FlashAttentionScore lowered inside a lowering leaves for its gradient: its
    operands and output (the traced arrays themselves), its attributes and its pullback."""

    q: Any
    k: Any
    v: Any
    mask: Any
    out: Any
    attrs: dict[str, Any]
    pullback: Any

    def serves(self, q: Any, k: Any, v: Any, mask: Any, out: Any, attrs: dict[str, Any]
               ) -> bool:
        """Whether the gradient of (q, k, v, mask) -> out with `attrs` is this forward's: the
        same traced arrays (an array of another trace, e.g. a `lax.switch` branch, is another
        object), a mask that is the same array, equal constants, or not read."""
        if not (self.q is q and self.k is k and self.v is v and self.out is out):
            return False
        if any(self.attrs.get(name) != attrs.get(name) for name in DEFAULTS):
            return False
        if self.mask is mask or attrs["sparse_mode"] not in (0, 1):
            return True
        if self.mask is None or mask is None:
            return False
        try:  # constants (the same data read twice) are concrete arrays
            return bool(np.array_equal(np.asarray(self.mask), np.asarray(mask)))
        except jax.errors.TracerArrayConversionError:  # computed in the trace: other values
            return False


def _fa_jax(*arrays: Any, **attrs: Any) -> tuple[Any, ...]:
    q, k, v, mask, dims = _operands(arrays, attrs)
    memo = lowering_memo()
    if memo is None:
        out, row_max, row_sum = _attention(q, k, v, mask, attrs, dims, statistics=True)
    else:
        def forward(q_: Any, k_: Any, v_: Any) -> tuple[Any, tuple[Any, Any]]:
            o, m, s = _attention(q_, k_, v_, mask, attrs, dims, statistics=True)
            return o, (m, s)

        out, pullback, (row_max, row_sum) = jax.vjp(forward, q, k, v, has_aux=True)
        memo[("FlashAttentionScore", id(out))] = _Forward(q, k, v, mask, out, dict(attrs),
                                                          pullback)
    shape = (dims.batch, dims.q_heads, dims.q_seq, SOFTMAX_LAST_DIM)
    return (jnp.broadcast_to(row_max, shape), jnp.broadcast_to(row_sum, shape),
            jnp.zeros((1,), q.dtype), out)


# -- vjp -----------------------------------------------------------------------------------------

_OUTPUT_NAMES = ("softmax_max", "softmax_sum", "softmax_out")


def _fa_vjp(b: Builder, node: Node, cot: list[Value]) -> list[Value | None]:
    for name, c in zip(_OUTPUT_NAMES, cot[:3]):
        if not is_zero(c):
            raise PcompileError(
                f"{node.where()}: the program differentiates through FlashAttentionScore's "
                f"{name}; gradients flow through attention_out only (as in MindSpore). Use "
                f"{name} outside the differentiated computation, or compute attention from ops"
            )
    q, k, v = node.operands[:3]
    mask = list(node.operands[3:])
    stats = [b("TupleGetItem", node.result, index=i) for i in (0, 1, 3)]
    attrs = {name: node.attrs[name] for name in DEFAULTS}
    grads = b("FlashAttentionScoreGrad", q, k, v, cot[3], *mask, *stats, **attrs)
    return [b("TupleGetItem", grads, index=i) for i in range(3)] + [None] * len(mask)


_FLASH_ATTENTION_NOTE = '''\
MindSpore's `FlashAttentionScore(head_num, keep_prob=1.0, scale_value=1.0,
pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, input_layout="BSH",
sparse_mode=0)`, called as MindSpore calls it:

```python
import math

from pcompile import nn, ops

n_head, head_dim, dp, mp = 8, 64, 2, 4


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fa = ops.FlashAttentionScore(head_num=n_head, scale_value=1 / math.sqrt(head_dim),
                                          pre_tokens=65536, next_tokens=0, input_layout="BNSD")
        self.fa.shard(((dp, mp, 1, 1), (dp, mp, 1, 1), (dp, mp, 1, 1), (dp, 1, 1, 1)))

    def construct(self, query, key, value, attn_mask):
        _, _, _, out = self.fa(query, key, value, None, None, None, attn_mask, None, None, None)
        return out


attention = Attention()
```

* **Inputs.** query, key, value in layout BSH `(B, S, N*D)`, SBH `(S, B, N*D)`, BNSD
  `(B, N, S, D)` or BSND `(B, S, N, D)`; Float16, BFloat16 (MindSpore's types) or Float32.
  key and value may have fewer heads than the query (grouped-query attention: query head h
  reads kv head h // (N1 / N2)). `attn_mask` is UInt8 or Bool, 1/True = masked out, shaped
  `(B, N1, S1, S2)`, `(B, 1, S1, S2)` or `(S1, S2)`. The other optional inputs (real_shift,
  drop_mask, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen) are refused, as are
  `keep_prob` < 1 (dropout) and the layouts TND/TH.
* **sparse_mode** (i a query position, j a key position): 0 masks nothing without attn_mask
  and keeps `attn_mask == 0` and `-pre_tokens <= j - i <= next_tokens` with it; 1 keeps
  `attn_mask == 0`; 2 keeps `j <= i` (causal from the top-left corner); 3 keeps
  `j - i <= S2 - S1` (causal from the bottom-right corner); 4 keeps the band
  `-pre_tokens <= j - i - (S2 - S1) <= next_tokens`. Modes 2-4 take MindSpore's compressed
  `(2048, 2048)` mask or none; pcompile does not read its values. Modes 5-8 are refused.
* **Outputs**, MindSpore's four: softmax_max and softmax_sum (Float32, `(B, N1, S1, 8)`: the
  row max of the masked, scaled scores and the row sum of exp(score - max), repeated 8 times
  as Ascend's kernel stores them), softmax_out (a `(1,)` placeholder, zeros) and
  attention_out (the query's shape and dtype).
* **Numerics.** Scores and softmax in float32; masked positions get -0.7 * the float32 max
  (a row with every position masked averages the values, as `jax.nn.dot_product_attention`
  does); the probabilities are rounded to the value dtype before the product with value.
* **Backends.** numpy computes the definition; JAX calls `jax.nn.dot_product_attention`:
  cuDNN's fused kernel on GPUs for 16-bit inputs with head size a multiple of 8 up to 128 and
  no mask other than causal, its XLA path otherwise (16-bit inputs on CPU and float64 use the
  same computation written out: that path's backward needs a dot precision CPUs lack, and it
  rounds the softmax of float64 inputs to float32); the lowering's `fused_attention=False`
  (`PCOMPILE_ATTENTION=xla` where the program runs) keeps GPUs on the XLA path. The
  statistics come from the same computation on the written-out path; next to
  `jax.nn.dot_product_attention` they are computed apart, and XLA removes them when nothing
  reads them.
* **Causal masks known at compile time.** An attn_mask that the graph shows to be
  MindSpore's causal mask (1 exactly where j > i in every `(S1, S2)` block: a constant, or a
  constant through Tile, Cast, Reshape, ExpandDims, Squeeze, BroadcastTo, a StridedSlice of
  the leading dims, or split by the plan over its leading dims), under sparse_mode 1, or 0
  with `next_tokens >= 0` and `pre_tokens >= S1 - 1` (mindformers' 65536 and 0), is causal
  attention: the JAX program runs the node and its grad as sparse_mode 2, i.e.
  `is_causal=True` (cuDNN's causal kernel on GPUs), and never reads the mask
  (`ir/ops/causal_mask.py`; `program.py` notes it under the node). Other masks (a sliding
  window, padding, a mask computed from inputs, the row slice of a query split) keep the
  general path. numpy, the check's reference, always computes the definition.
* **Gradients** flow through attention_out only. The vjp emits `FlashAttentionScoreGrad`
  (query, key, value, dy, [attn_mask], softmax_max, softmax_sum, attention_in) -> (dq, dk, dv)
  (MindSpore's operand order without the inputs pcompile does not take); its numpy form
  rebuilds the probabilities from the saved statistics. In JAX the forward runs under
  `jax.vjp` and the grad of the same operands and output runs its pullback, so the program
  computes the attention forward once and GPUs run cuDNN's fused forward and backward, as a
  hand-written `jax.grad` does (a grad in another trace, e.g. another pipeline tick,
  differentiates the fused forward again). Reading softmax_max, softmax_sum or
  softmax_out in a differentiated computation is refused.
* **Rule** (MindSpore's flash_attention_score_info): the strategy lists the passed inputs.
  Batch and query heads split freely; key and value split their heads exactly as the query
  (whole heads per rank: head_num and the kv head count divide by the split), except under
  multi-query attention (one kv head), where they stay whole; the kv sequence and the head
  size never split. The mask follows the batch and heads where it has those dims and the
  query sequence (a compressed mask never splits). Each rank runs with `head_num / split`
  heads. The **query sequence** may split too (context parallelism, e.g. mindformers'
  `((dp, mp, cp, 1), (dp, mp, 1, 1), (dp, mp, 1, 1), (dp, 1, cp, 1))`): the mask's rows split
  with it and each rank's window moves to its slice: mode 0 shifts pre/next_tokens by the
  slice offset, modes 2-4 become a band (mode 4) aligned with the slice's bottom-right
  corner, mode 1 needs no change (`ir/ops/attention.py::query_split_window`, applied per rank
  by `passes/step_parallel.py`). Ranks with different windows run one SPMD program with
  attribute variants.'''

def flash_attention_labels(ctx: OpContext) -> Labels:
    """FlashAttentionScore (MindSpore's flash_attention_score_info): b batch, s query
    sequence, t kv sequence (never split), n query heads (or hidden N1 * D), d head dim (never
    split). The kv heads share n's label, so they split as the query heads do, except under
    multi-query attention (one kv head), where they are never split. The mask's batch and
    head dims follow b and n where it has them; a compressed mask is never split. A split
    query sequence splits the mask's rows with it, and every rank's window (sparse_mode,
    pre_tokens, next_tokens) is moved to its slice (expand "attention_query_split")."""
    q, k = ctx.in_types[0], ctx.in_types[1]
    layout = str(ctx.attrs.get("input_layout", "BSH"))
    dims = attention_dims(q.shape, k.shape, int(ctx.attrs["head_num"]), layout)
    kv = "n" if dims.kv_heads > 1 else "m"
    q_lab, k_lab = {"BSH": ("bsn", f"bt{kv}"), "SBH": ("sbn", f"tb{kv}"),
                    "BNSD": ("bnsd", f"b{kv}td"), "BSND": ("bsnd", f"bt{kv}d")}[layout]
    unsplit = {"t", "d", "m"}
    ins = [q_lab, k_lab, k_lab]
    if len(ctx.in_types) == 4:
        mask = ctx.in_types[3]
        used = set("bsntdm")
        if int(ctx.attrs.get("sparse_mode", 0)) in (2, 3, 4):
            m_lab = "".join(fresh_labels(mask.rank, used))
            unsplit |= set(m_lab)
        elif mask.rank == 2:
            m_lab = "st"
        else:
            m_lab = ""
            for size, name in zip(mask.shape[:2], "bn"):
                if size > 1:
                    m_lab += name
                else:
                    fresh = fresh_labels(1, used)[0]
                    unsplit.add(fresh)
                    m_lab += fresh
            m_lab += "st"
        ins.append(m_lab)
    e, f = fresh_labels(2, set("".join(ins)))
    return Labels(ins, ["bns" + e, "bns" + e, f, q_lab], unsplit | {e, f})


_ATTENTION_ROLES = {
    "t": "the kv sequence",
    "d": "the head size",
    "m": "the kv heads of multi-query attention (one kv head)",
    "s": "the query sequence",
}


class _QuerySplitWindow(Expansion):
    """FlashAttentionScore with a split query sequence: this rank's query slice keeps the
    positions the whole query keeps once its window is moved to the slice."""

    def attrs(self, lower: LocalLowering, node: Node, sharding: OpSharding) -> dict[str, Any]:
        q_layout = sharding.in_layouts[0]
        dims = attention_dims(q_layout.shape, node.operands[1].shape,
                              int(node.attrs["head_num"]), str(node.attrs["input_layout"]))
        length = q_layout.slice_shape[dims.seq_dim]
        count = dims.q_seq // length
        if count == 1 or int(node.attrs["sparse_mode"]) == 1:
            return {}
        window = {k: int(node.attrs[k]) for k in ("sparse_mode", "pre_tokens", "next_tokens")}
        start = RankScalar(layout_offsets(q_layout), dims.seq_dim)
        out = query_split_window(window, dims.q_seq, dims.kv_seq, 0, count)
        out.update({key: lower.rank_value(QueryWindow(tuple(window.items()), dims.q_seq,
                                                      dims.kv_seq, start, length, key))
                    for key in ("pre_tokens", "next_tokens")})
        return out


QUERY_SPLIT_WINDOW = _QuerySplitWindow()


class FlashAttentionRule(LabelRule):
    """Labels plus what they cannot say: a split of the hidden size (BSH, SBH) or of the
    heads must keep whole heads on a rank, query and kv alike; the local op sees
    head_num / split heads."""

    def __init__(self) -> None:
        super().__init__(flash_attention_labels)

    def role(self, name: str) -> str:
        return _ATTENTION_ROLES.get(name, "a dim of a compressed or broadcast attn_mask")

    def apply(self, ctx: OpContext, strategy: Strategy, out_strategy: Strategy | None = None
              ) -> OpSharding:
        if len(strategy) != len(ctx.in_types):
            raise StrategyError(
                f"the strategy has {len(strategy)} entries but the op has {len(ctx.in_types)} "
                "tensor inputs (query, key, value and attn_mask when it is passed)",
                "give one tuple per passed input",
            )
        q, k = ctx.in_types[0], ctx.in_types[1]
        layout = str(ctx.attrs.get("input_layout", "BSH"))
        head_num = int(ctx.attrs["head_num"])
        dims = attention_dims(q.shape, k.shape, head_num, layout)
        axis = dims.head_axis
        heads_split = strategy[0][axis] if len(strategy[0]) > axis else 1
        kv_split = strategy[1][axis] if len(strategy[1]) > axis else 1
        if head_num % heads_split:
            raise StrategyError(
                f"the query has {head_num} heads, which cannot be split {heads_split} ways "
                "(head_num % split must be 0)",
                "split the heads by a divisor of head_num",
            )
        if dims.kv_heads == 1 and kv_split > 1:
            raise StrategyError(
                "the key and value have one head (multi-query attention), so their head dim "
                f"cannot be split, but the strategy splits it {kv_split} ways",
                "use 1 for the kv head dim; the query heads may still be split",
            )
        if dims.kv_heads > 1 and dims.kv_heads % kv_split:
            raise StrategyError(
                f"the key and value have {dims.kv_heads} heads, which cannot be split "
                f"{kv_split} ways; under grouped-query attention they split as the query "
                "heads do",
                "split the heads by a divisor of the kv head count",
            )
        result = label_sharding(ctx, self.labels(ctx), strategy, out_strategy)
        result.local_attrs["head_num"] = head_num // heads_split
        if strategy[0][dims.seq_dim] > 1:
            result.expand = QUERY_SPLIT_WINDOW
        return result


def _fa_dims(ins: Any, outs: Any, attrs: dict[str, Any]) -> Any:
    """q, k, v, the mask and the statistics share batch, heads and sequences; grouped-query
    attention keeps its ratio of query to kv heads (BSH/SBH: of hidden sizes)."""
    q, k = ins[0][0], ins[1][0]
    layout = attrs["input_layout"]
    for d in range(len(k)):
        yield Same(In(1, d), In(2, d))
    for d in range(len(q)):
        yield Same(In(0, d), Out(d, 3))
    if layout in ("BSH", "SBH"):
        b, s = (0, 1) if layout == "BSH" else (1, 0)
        n = None
        yield Divides(In(0, 2), attrs["head_num"])
        yield Product((In(1, 2),), (In(0, 2),), q[2] // k[2])
    else:
        n, s = (1, 2) if layout == "BNSD" else (2, 1)
        yield Same(In(0, 3), In(1, 3))
        yield Product((In(1, n),), (In(0, n),), q[n] // k[n])
    yield Same(In(0, b := 0 if layout != "SBH" else 1), In(1, b))
    for e in (0, 1):
        yield Same(In(0, b), Out(0, e))
        yield Same(In(0, s), Out(2, e))
        yield Fixed(Out(3, e))
        if n is not None:
            yield Same(In(0, n), Out(1, e))
        else:
            yield Fixed(Out(1, e), "BSH/SBH statistics count heads by head_num")
    if len(ins) == 4:
        mask = ins[3][0]
        if attrs["sparse_mode"] in (2, 3, 4):
            for d in range(len(mask)):
                yield Fixed(In(3, d))
            return
        r = len(mask)
        yield Same(In(3, r - 2), In(0, s))
        yield Same(In(3, r - 1), In(1, s))
        if r == 4 and mask[0] != 1:
            yield Same(In(3, 0), In(0, b))
        if r == 4 and mask[1] != 1 and n is not None:
            yield Same(In(3, 1), In(0, n))


def _fa_rewrite(attrs: dict[str, Any], old_in: Any, old_out: Any, new_in: Any,
                new_out: Any) -> dict[str, Any]:
    layout = attrs["input_layout"]
    if layout in ("BSH", "SBH"):
        return dict(attrs)
    return {**attrs, "head_num": new_in[0][0][1 if layout == "BNSD" else 2]}


define("FlashAttentionScore", _infer, _fa_np, _fa_jax, vjp=_fa_vjp,
       lowering_attrs=causal_lowering_attrs, attrs=dict(DEFAULTS), num_inputs=(3, 4),
       sharding=FlashAttentionRule(),
       doc="(softmax_max, softmax_sum, softmax_out, attention_out) of softmax(scale * q k^T, "
           "masked by sparse_mode/attn_mask) v; layouts BSH, SBH, BNSD, BSND; kv heads may be "
           "fewer than query heads (grouped-query attention). See ir/ops/attention.py.",
       section="attention",
       operands="query, key, value, [attn_mask] -> (softmax_max, softmax_sum, softmax_out, "
                "attention_out)", dtypes=FLOATS,
       rule="batch and query heads split (kv heads as the query's); the query sequence may split; "
            "kv sequence and head size never",
       tests=("test_ops_attention.py::test_flash_attention_float32",
              "test_ops_attention.py::test_flash_attention_16_bit",
              "test_ops_attention.py::test_llama_call_causal_gqa",
              "test_attention_causal.py::test_fused_lowering_equals_the_general_path",
              "test_attention_causal.py::test_fused_lowering_in_float64_is_the_definition",
              "test_parallel_ops.py::test_flash_attention_rule_matches_the_oracle",
              "test_parallel_ops.py::test_flash_attention_query_split_matches_the_oracle",
              "test_mindformers_ops.py::test_flash_attention_as_mindformers_calls_it_trains_like_on"
              "e_device"),
       note=_FLASH_ATTENTION_NOTE, dims=DimRule(_fa_dims, _fa_rewrite))

# -- FlashAttentionScoreGrad ---------------------------------------------------------------------


def _grad_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    q, k, v, dy = (tensor(t, name) for t, name in zip(types, ("query", "key", "value", "dy")))
    forward = _infer(list(types[:3]) + list(types[4:-3]), attrs)
    assert isinstance(forward, TupleType)
    stats, _, _, out = forward.elements
    given = [tensor(t, name) for t, name in
             zip(types[-3:], ("softmax_max", "softmax_sum", "attention_in"))]
    for t, want, name in zip(given + [dy], [stats, stats, out, out],
                             ("softmax_max", "softmax_sum", "attention_in", "dy")):
        if t != want:
            raise ShapeError(f"{name} must be {want}, got {t}")
    return tuple_type(q, k, v)


def _grad_np(*arrays: Any, **attrs: Any) -> tuple[np.ndarray, ...]:
    q, k, v, dy = arrays[:4]
    mask = arrays[4] if len(arrays) == 8 else None
    row_max, row_sum = arrays[-3], arrays[-2]
    _, _, _, _, dims = _operands((q, k, v), attrs)
    qb, kb, scores, keep = _probabilities(q, k, mask, attrs, dims)
    # The kernel's recomputation: probabilities from the saved row statistics.
    probs = np.exp(scores - row_max[..., :1]) / row_sum[..., :1]
    wide = np.result_type(scores.dtype, v.dtype, dy.dtype)  # float32, or float64 (the oracle)
    vb = np.repeat(to_bnsd(np, v, dims.layout, dims.kv_heads).astype(wide), dims.group, 1)
    dyb = to_bnsd(np, dy, dims.layout, dims.q_heads).astype(wide)
    dp = np.einsum("bnsd,bntd->bnst", dyb, vb)
    ds = probs * (dp - np.sum(probs * dp, axis=-1, keepdims=True))
    if keep is not None:
        ds = np.where(keep, ds, wide.type(0))  # masked scores are a constant fill
    scale = wide.type(attrs["scale_value"])
    dq = scale * np.einsum("bnst,bntd->bnsd", ds, kb)

    def per_kv_head(x: np.ndarray) -> np.ndarray:
        b, _, s, d = x.shape
        result: np.ndarray = x.reshape(b, dims.kv_heads, dims.group, s, d).sum(axis=2)
        return result

    dk = per_kv_head(scale * np.einsum("bnst,bnsd->bntd", ds, qb))
    dv = per_kv_head(np.einsum("bnst,bnsd->bntd", probs, dyb))
    return tuple(from_bnsd(np, g, dims.layout).astype(x.dtype)
                 for g, x in ((dq, q), (dk, k), (dv, v)))


def _grad_jax(*arrays: Any, **attrs: Any) -> tuple[Any, ...]:
    q, k, v, dy = arrays[:4]
    mask = arrays[4] if len(arrays) == 8 else None
    memo = lowering_memo()
    forward = None if memo is None else memo.get(("FlashAttentionScore", id(arrays[-1])))
    if forward is not None and forward.serves(q, k, v, mask, arrays[-1], attrs):
        return tuple(forward.pullback(dy))
    dims = attention_dims(tuple(q.shape), tuple(k.shape), attrs["head_num"],
                          attrs["input_layout"])
    _, pullback = jax.vjp(lambda q_, k_, v_: attention_out_jax(q_, k_, v_, mask, attrs, dims),
                          q, k, v)
    return tuple(pullback(dy))


grad_helper("FlashAttentionScoreGrad", _grad_infer, _grad_np, _grad_jax,
            lowering_attrs=causal_lowering_attrs, attrs=dict(DEFAULTS), num_inputs=(7, 8),
            doc="FlashAttentionScoreGrad(query, key, value, dy, [attn_mask], softmax_max, "
                "softmax_sum, attention_in) -> (dq, dk, dv), MindSpore's operand order without the "
                "inputs pcompile does not take. The JAX implementation runs the pullback the "
                "forward left in the lowering's memo when the operands are the forward's own, "
                "else differentiates the fused forward (jax.vjp); GPUs run cuDNN's fused "
                "backward either way.",
            grad_of="FlashAttentionScore",
            operands="query, key, value, dy, [attn_mask], softmax_max, softmax_sum, attention_in "
                     "-> (dq, dk, dv)", dtypes=FLOATS, section="attention",
            tests=("test_ops_attention.py::test_flash_attention_float32",
                   "test_ops_attention.py::test_flash_attention_16_bit",
                   "test_attention_causal.py::test_fused_lowering_equals_the_general_path"))
