"""FlashAttentionScore against attention written directly in JAX (float64): the four outputs
of the numpy interpreter and of the JAX lowering, and the gradients of attention_out (IR
autodiff through FlashAttentionScoreGrad, run by both backends) against `jax.vjp`; over
layouts, grouped-query attention, sparse modes, masks, window sizes and dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.backends.jax import lower_graph
from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from tests import op_harness  # noqa: F401  (64-bit JAX types for the float64 reference)

F32_MAX = float(np.finfo(np.float32).max)


@dataclass
class Case:
    layout: str
    batch: int
    q_heads: int
    kv_heads: int
    q_seq: int
    kv_seq: int
    head_dim: int
    mode: int
    pre: int
    next: int
    mask: str  # "none", "2d", "b1", "bn", "1n", "compressed"
    dtype: Any
    scale: float

    def shape(self, seq: int, heads: int) -> tuple[int, ...]:
        b, d = self.batch, self.head_dim
        return {"BSH": (b, seq, heads * d), "SBH": (seq, b, heads * d),
                "BNSD": (b, heads, seq, d), "BSND": (b, seq, heads, d)}[self.layout]

    @property
    def attrs(self) -> dict[str, Any]:
        return {"head_num": self.q_heads, "input_layout": self.layout, "sparse_mode": self.mode,
                "pre_tokens": self.pre, "next_tokens": self.next, "scale_value": self.scale}


FLOAT32 = st.just(np.float32)


@st.composite
def cases(draw: Any, dtypes: Any = FLOAT32) -> Case:
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    q_seq = draw(st.integers(1, 6))
    mode = draw(st.sampled_from([0, 1, 2, 3, 4]))
    kv_seq = draw(st.integers(1, 6)) if mode != 2 else draw(st.integers(q_seq, 6))
    if mode == 1:
        mask = draw(st.sampled_from(["2d", "b1", "bn", "1n"]))
    elif mode == 0:
        mask = draw(st.sampled_from(["none", "2d", "b1", "bn"]))
    else:
        mask = draw(st.sampled_from(["none", "compressed"]))
    window = st.one_of(st.integers(-3, 7), st.just(2147483647))
    return Case(draw(st.sampled_from(["BSH", "SBH", "BNSD", "BSND"])), draw(st.integers(1, 2)),
                kv_heads * group, kv_heads, q_seq, kv_seq, draw(st.sampled_from([2, 4])), mode,
                draw(window), draw(window), mask, draw(dtypes),
                draw(st.sampled_from([1.0, 0.5, 0.3])))


def make_inputs(case: Case, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(case.shape(case.q_seq, case.q_heads)).astype(case.dtype)
    k = rng.standard_normal(case.shape(case.kv_seq, case.kv_heads)).astype(case.dtype)
    v = rng.standard_normal(case.shape(case.kv_seq, case.kv_heads)).astype(case.dtype)
    b, n, s1, s2 = case.batch, case.q_heads, case.q_seq, case.kv_seq
    mask_shape = {"2d": (s1, s2), "b1": (b, 1, s1, s2), "bn": (b, n, s1, s2),
                  "1n": (1, n, s1, s2), "compressed": (2048, 2048)}.get(case.mask)
    if mask_shape is None:
        return [q, k, v]
    if case.mask == "compressed":
        mask = np.triu(np.ones(mask_shape, np.uint8), 1)
    else:
        mask = (rng.random(mask_shape) < 0.3).astype(np.uint8)
    return [q, k, v, mask]


def reference(case: Case, q: Any, k: Any, v: Any, mask: Any = None) -> tuple[Any, ...]:
    """MindSpore's documented semantics, written directly (float64 scores and softmax)."""
    def bnsd(x: Any, heads: int) -> Any:
        if case.layout == "BNSD":
            return x
        if case.layout == "BSND":
            return x.transpose(0, 2, 1, 3)
        if case.layout == "SBH":
            x = x.transpose(1, 0, 2)
        return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)

    dtype = q.dtype
    group = case.q_heads // case.kv_heads
    qb = bnsd(q, case.q_heads).astype(jnp.float64)
    kb = jnp.repeat(bnsd(k, case.kv_heads).astype(jnp.float64), group, axis=1)
    vb = jnp.repeat(bnsd(v, case.kv_heads).astype(jnp.float64), group, axis=1)
    s = case.scale * jnp.einsum("bnid,bnjd->bnij", qb, kb)
    i = jnp.arange(case.q_seq)[:, None]
    j = jnp.arange(case.kv_seq)[None, :]
    shift = case.kv_seq - case.q_seq
    keep = jnp.ones((case.q_seq, case.kv_seq), bool)
    if case.mode == 0 and mask is not None:
        keep = (j - i >= -case.pre) & (j - i <= case.next)
    elif case.mode == 2:
        keep = j <= i
    elif case.mode == 3:
        keep = j - i <= shift
    elif case.mode == 4:
        keep = (j - i - shift >= -case.pre) & (j - i - shift <= case.next)
    if mask is not None and case.mode in (0, 1):
        keep = keep & (mask == 0)
    s = jnp.where(keep, s, -0.7 * F32_MAX)
    row_max = jnp.max(s, -1, keepdims=True)
    e = jnp.exp(s - row_max)
    row_sum = jnp.sum(e, -1, keepdims=True)
    out = jnp.einsum("bnij,bnjd->bnid", e / row_sum, vb)
    if case.layout != "BNSD":
        out = out.transpose(0, 2, 1, 3)
        if case.layout in ("BSH", "SBH"):
            out = out.reshape(out.shape[0], out.shape[1], -1)
            if case.layout == "SBH":
                out = out.transpose(1, 0, 2)
    stats = row_max.shape[:3] + (8,)
    return (jnp.broadcast_to(row_max, stats), jnp.broadcast_to(row_sum, stats),
            jnp.zeros((1,), dtype), out.astype(dtype))


def tolerance(case: Case) -> float:
    """Float32 scores sum head_dim products, the softmax and the weighted sum run over kv_seq
    terms: a few units of the last place times those counts. 16-bit inputs round the
    probabilities and the output once each."""
    f32 = 8 * float(np.finfo(np.float32).eps) * (case.head_dim + case.kv_seq + case.q_seq)
    if np.dtype(case.dtype).itemsize == 2:
        return 4 * float(ml_dtypes.finfo(case.dtype).eps) + f32
    return f32


def close(got: Any, want: Any, rtol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def build(case: Case, inputs: list[np.ndarray]) -> tuple[Graph, list[GraphParam]]:
    graph = Graph("fa")
    params = [graph.add_param(GraphParam(TensorType(DType.from_any(a.dtype), a.shape), f"x{i}",
                                         "weight", i < 3)) for i, a in enumerate(inputs)]
    b = Builder(graph)
    out = b.emit("FlashAttentionScore", list(params), case.attrs)
    graph.outputs = [b("TupleGetItem", out, index=i) for i in range(4)]
    return graph, params


def check(case: Case, seed: int) -> None:
    """The four outputs and the gradients of attention_out for a random cotangent; one graph,
    run once by each backend, and one jitted reference."""
    inputs = make_inputs(case, seed)
    graph, params = build(case, inputs)
    cot = np.random.default_rng(seed + 1).standard_normal(graph.outputs[3].shape)
    cot = cot.astype(case.dtype)
    grads = append_gradients(graph, [graph.outputs[3]], params[:3],
                             [Constant(cot, params[0].dtype)])
    assert [n.op for n in graph.nodes].count("FlashAttentionScoreGrad") == 1
    graph.outputs = list(graph.outputs) + grads
    got = run_graph(graph, inputs)
    lowered = jax.jit(lower_graph(graph))(*inputs)

    @jax.jit
    def want_fn(q: Any, k: Any, v: Any, *mask: Any) -> Any:
        outs = reference(case, q, k, v, *mask)
        f64 = [x.astype(jnp.float64) for x in (q, k, v)]
        _, pullback = jax.vjp(lambda *qkv: reference(case, *qkv, *mask)[3]
                              .astype(jnp.float64), *f64)
        return outs, pullback(jnp.asarray(cot, jnp.float64))

    want, want_grads = want_fn(*inputs)
    rtol = tolerance(case)
    for i, name in enumerate(("softmax_max", "softmax_sum", "softmax_out", "attention_out")):
        dtype = np.float32 if i < 2 else np.dtype(case.dtype)
        assert got[i].dtype == dtype and lowered[i].dtype == dtype, name
        close(got[i], want[i], rtol, f"numpy {name}")
        close(lowered[i], want[i], rtol, f"jax {name}")
    # Gradients sum over the query positions and heads as well.
    grad_rtol = rtol + 8 * float(np.finfo(np.float32).eps) * case.q_seq * case.q_heads
    for name, g, lj, w in zip("qkv", got[4:], lowered[4:], want_grads):
        close(g, w, grad_rtol, f"numpy d{name}")
        close(lj, w, grad_rtol, f"jax d{name}")


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(0, 2**31 - 1))
def test_flash_attention_float32(case: Case, seed: int) -> None:
    check(case, seed)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(cases(st.sampled_from([np.float16, ml_dtypes.bfloat16])), st.integers(0, 2**31 - 1))
def test_flash_attention_16_bit(case: Case, seed: int) -> None:
    check(case, seed)


@pytest.mark.parametrize("layout", ["BNSD", "BSH", "SBH", "BSND"])
def test_llama_call_causal_gqa(layout: str) -> None:
    """mindformers' call: pre_tokens 65536, next_tokens 0, a (B, 1, S, S) causal mask of
    ones above the diagonal, sparse_mode 0; grouped-query attention 8 -> 2 heads."""
    s = 8
    case = Case(layout, 2, 8, 2, s, s, 4, 0, 65536, 0, "b1", np.float32, 0.5)
    check(case, 3)


def test_large_scores_and_fully_masked_rows() -> None:
    """Scores near float32's exponent limit stay finite; a row whose every position is
    masked averages the values (as jax.nn.dot_product_attention does)."""
    case = Case("BNSD", 1, 2, 1, 4, 4, 4, 1, 0, 0, "2d", np.float32, 30.0)
    inputs = make_inputs(case, 5)
    inputs[3][1] = 1
    graph, _ = build(case, inputs)
    got = run_graph(graph, inputs)
    want = reference(case, *[jnp.asarray(a) for a in inputs])
    close(got[3], want[3], tolerance(case) * 30, "attention_out")
    np.testing.assert_allclose(got[3][0, :, 1], np.broadcast_to(inputs[2][0, 0].mean(0),
                                                               (2, 4)), rtol=1e-6)


def _emit(shapes: list[tuple[int, ...]], attrs: dict[str, Any],
          dtypes: list[DType] | None = None) -> Any:
    graph = Graph("e")
    dtypes = dtypes or [DType.float16] * 3 + [DType.uint8]
    params = [graph.add_param(GraphParam(TensorType(d, s), f"x{i}"))
              for i, (s, d) in enumerate(zip(shapes, dtypes))]
    return Builder(graph).emit("FlashAttentionScore", list(params), attrs)


@pytest.mark.parametrize("shapes,attrs,message", [
    ([(2, 4, 8)] * 3, {"head_num": 2, "keep_prob": 0.9}, "dropout inside attention"),
    ([(2, 4, 8)] * 3, {"head_num": 2, "sparse_mode": 5}, "sparse_mode 5 is not supported"),
    ([(2, 4, 8)] * 3, {"head_num": 2, "input_layout": "TND"}, "input_layout must be one of"),
    ([(2, 4, 8)] * 3, {}, "needs attribute head_num"),
    ([(2, 4, 8)] * 3, {"head_num": 3}, "must divide by head_num 3"),
    ([(2, 4, 8), (2, 4, 6), (2, 4, 6)], {"head_num": 4}, "3 head"),
    ([(2, 4, 4, 2), (2, 3, 4, 2), (2, 3, 4, 2)], {"head_num": 4, "input_layout": "BNSD"},
     "must divide head_num 4"),
    ([(2, 4, 8)] * 3, {"head_num": 2, "sparse_mode": 1}, "needs attn_mask"),
    ([(2, 4, 8)] * 3 + [(4, 5)], {"head_num": 2}, r"attn_mask shape \(4, 5\) must be"),
    ([(2, 4, 8)] * 3 + [(4, 4)], {"head_num": 2, "sparse_mode": 2}, r"compressed \(2048"),
    ([(2, 4, 8), (2, 4, 8), (2, 5, 8)], {"head_num": 2}, "value shape"),
])
def test_bad_calls_name_the_problem(shapes: list[tuple[int, ...]], attrs: dict[str, Any],
                                    message: str) -> None:
    with pytest.raises(OpError, match=message) as info:
        _emit(shapes, attrs)
    assert str(info.value).startswith("FlashAttentionScore")


def test_mask_and_operand_dtypes() -> None:
    with pytest.raises(OpError, match="attn_mask must be Bool or UInt8"):
        _emit([(2, 4, 8)] * 4, {"head_num": 2}, [DType.float16] * 4)
    with pytest.raises(OpError, match="floating-point"):
        _emit([(2, 4, 8)] * 3, {"head_num": 2}, [DType.int32] * 3)


def test_gradient_through_statistics_is_refused() -> None:
    case = Case("BSH", 1, 2, 2, 4, 4, 2, 0, 0, 0, "none", np.float32, 1.0)
    graph, params = build(case, make_inputs(case, 0))
    b = Builder(graph)
    loss = b("ReduceSum", graph.outputs[0], axis=(), keep_dims=False)
    with pytest.raises(PcompileError, match="differentiates through FlashAttentionScore's "
                                            "softmax_max"):
        append_gradients(graph, loss, params[:3])
