"""FlashAttentionScore with a constant causal mask on the fused kernel.

mindformers' Llama gives FlashAttentionScore its causal mask as a uint8 constant (1 strictly
above the diagonal) tiled over the batch; `ir/ops/causal_mask.py` recognises it from the graph
and `causal_lowering_attrs` runs the node as sparse_mode 2, which the JAX implementation turns
into `jax.nn.dot_product_attention(is_causal=True)`. Here: which masks are recognised (and which
keep the general path: sliding windows, padding, a row slice), that the fused lowering computes
what the general path and the numpy definition compute, in float32, 16-bit and float64, and
that examples/llama.py on 1 and on 8 devices (dp 2 x mp 4) runs fused and still checks."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pcompile.backends.jax import lower_graph
from pcompile.backends.jax.lowering import x64
from pcompile.backends.numpy import run_graph
from pcompile.compiler.driver.runtime import batches
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Node, RankConstant, Value
from pcompile.ir.layout import TensorLayout
from pcompile.ir.ops import attention
from pcompile.ir.ops.attention import INT_MAX, QueryWindow
from pcompile.ir.ops.causal_mask import is_causal_mask
from pcompile.ir.rank import RankOffsets, RankScalar, SlicedArray
from pcompile.ir.registry import get_op
from pcompile.ir.types import DType, TensorType
from pcompile.passes.autodiff import append_gradients
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, relative_error
from pcompile.tools.runners import StandAloneRunner
from tests import (
    ROOT,
    op_harness,  # noqa: F401  (64-bit JAX types for the float64 evaluation)
)
from tests.ir.test_ops_attention import Case, tolerance

LLAMA = os.path.join(ROOT, "examples", "llama.py")
S = 8


def causal(shape: tuple[int, ...] = (1, 1, S, S), dtype: Any = np.uint8) -> np.ndarray:
    """MindSpore's causal mask: 1 (masked) strictly above the diagonal."""
    return np.broadcast_to(np.triu(np.ones(shape[-2:], dtype), 1), shape).copy()


def const(array: np.ndarray) -> Constant:
    return Constant(array, DType.from_any(array.dtype))


def _graph() -> tuple[Graph, Builder]:
    graph = Graph("masks")
    return graph, Builder(graph)


# -- recognition ---------------------------------------------------------------------------


def _tiled(b: Builder, mask: np.ndarray, batch: int = 4) -> Value:
    return b("Tile", const(mask), multiples=(batch, 1, 1, 1))


def _llama_8_devices(b: Builder, mask: np.ndarray) -> Value:
    """What examples/llama.py hands the attention of one rank under dp 2 x mp 4: the tiled mask
    reshaped, sliced to the rank's half of the batch (rank-dependent offsets) and reshaped
    back."""
    flat = b("Reshape", _tiled(b, mask), shape=(4, S, S))
    half = b("StridedSlice", flat, begin=RankOffsets((0, 0, 0), (((4, 2, 2),), (), ())),
             end=RankOffsets((2, S, S), (((4, 2, 2),), (), ())), strides=(1, 1, 1))
    return b("Reshape", half, shape=(2, 1, S, S))


def _sliding_window(width: int) -> np.ndarray:
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    return ((j > i) | (j < i - width)).astype(np.uint8)[None, None]


def _padded() -> np.ndarray:
    """The causal mask with the last key masked too (a padded sample)."""
    mask = causal()
    mask[..., -1] = 1
    return mask


RECOGNISED = {
    "constant": lambda b: const(causal()),
    "2d bool": lambda b: const(causal((S, S), np.bool_)),
    "tiled (llama, 1 device)": lambda b: _tiled(b, causal()),
    "llama, 8 devices": lambda b: _llama_8_devices(b, causal()),
    "float cast to uint8": lambda b: b("Cast", b("Tile", const(causal(dtype=np.float32)),
                                               multiples=(2, 1, 1, 1)), dst_type=DType.uint8),
    "broadcast and depend": lambda b: b("Depend", b("BroadcastTo", const(causal((S, S))),
                                                    shape=(2, 1, S, S)), const(np.ones(2))),
    "batch of equal masks": lambda b: const(causal((3, 1, S, S))),
}

NOT_RECOGNISED = {
    "sliding window": lambda b: const(_sliding_window(3)),
    "no mask (all zeros)": lambda b: const(np.zeros((1, 1, S, S), np.uint8)),
    "the diagonal masked too": lambda b: const(np.triu(np.ones((S, S), np.uint8))),
    "lower triangle (keep-mask convention)": lambda b: const(np.tril(np.ones((S, S),
                                                                             np.uint8))),
    "padding in one sample": lambda b: const(np.concatenate([causal(), _padded()])),
    "a row slice (query split)": lambda b: b("StridedSlice", _tiled(b, causal()),
                                             begin=(0, 0, 4, 0), end=(4, 1, 8, S),
                                             strides=(1, 1, 1, 1)),
    "rank-dependent row slice": lambda b: b("StridedSlice", _tiled(b, causal()),
                                            begin=RankOffsets((0, 0, 0, 0),
                                                              ((), (), ((1, 2, 4),), ())),
                                            end=RankOffsets((4, 1, 4, S),
                                                            ((), (), ((1, 2, 4),), ())),
                                            strides=(1, 1, 1, 1)),
    "halves cast to uint8 (zeros)": lambda b: b("Cast", const(causal(dtype=np.float32) * 0.5),
                                                dst_type=DType.uint8),
    "a tile of the columns": lambda b: b("Tile", const(causal((1, 1, S, S // 2))),
                                         multiples=(1, 1, 1, 2)),
    "computed from an input": lambda b: b("Cast", b.graph.add_param(
        GraphParam(TensorType(DType.float32, (S, S)), "m")), dst_type=DType.uint8),
}


@pytest.mark.parametrize("name", list(RECOGNISED))
def test_causal_masks_are_recognised(name: str) -> None:
    _, b = _graph()
    assert is_causal_mask(RECOGNISED[name](b))


@pytest.mark.parametrize("name", list(NOT_RECOGNISED))
def test_other_masks_keep_the_general_path(name: str) -> None:
    _, b = _graph()
    assert not is_causal_mask(NOT_RECOGNISED[name](b))


def _sliced(mask: np.ndarray, tensor_map: tuple[int, ...]) -> RankConstant:
    layout = TensorLayout((2, 4), tensor_map, mask.shape)
    return RankConstant(SlicedArray(mask, layout), DType.uint8)


def test_a_split_constant_is_recognised_when_its_blocks_stay_whole() -> None:
    """A constant mask operand that the plan splits becomes a RankConstant: split over the
    batch it is still causal on every rank; split over the query rows it is not."""
    mask = causal((4, 1, S, S))
    assert is_causal_mask(_sliced(mask, (1, -1, -1, -1)))
    assert not is_causal_mask(_sliced(mask, (1, -1, 0, -1)))


_CONSTANT_MASK_MODEL = """
import numpy as np
from pcompile import Tensor, TensorSpec, nn, ops


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mask = Tensor(np.triu(np.ones((4, 1, 16, 16), np.uint8), 1))
        self.fa = ops.FlashAttentionScore(head_num=8, pre_tokens=65536, next_tokens=0,
                                          input_layout="BNSD").shard(
            ((2, 4, 1, 1), (2, 4, 1, 1), (2, 4, 1, 1), (2, 1, 1, 1)))

    def construct(self, q, k, v):
        return self.fa(q, k, v, None, None, None, self.mask, None, None, None)[3]


model = Attention
inputs = lambda: [TensorSpec((4, 8, 16, 8), "float32")] * 3  # noqa: E731
"""


def test_a_constant_mask_the_plan_splits_is_recognised(tmp_path: Any) -> None:
    """A whole-batch constant mask handed to the attention directly: the plan splits it over
    dp as a RankConstant, which the SPMD program still runs as causal."""
    from pcompile.backends.jax.plan import SpmdPlan

    path = tmp_path / "fa_constant_mask.py"
    path.write_text(_CONSTANT_MASK_MODEL)
    program = compile_model(str(path), devices=8, parallel_mode="semi_auto_parallel",
                            dump=False, overrides={"dataset_strategy": "full_batch"})
    plan = SpmdPlan.build(program.rank_graphs)
    (node,) = [n for n in plan.nodes if n.op == "FlashAttentionScore"]
    assert isinstance(node.node.operands[3], RankConstant)
    assert node.kind == "op" and node.attrs["sparse_mode"] == 2


# -- the lowering's attributes ---------------------------------------------------------------


def _attention(b: Builder, mask: Value, **attrs: Any) -> Node:
    g = b.graph
    q, k, v = (g.add_param(GraphParam(TensorType(DType.bfloat16, (4, n, S, 4)), name))
               for n, name in ((4, "q"), (2, "k"), (2, "v")))
    out = b.emit("FlashAttentionScore", [q, k, v, mask],
                 {"head_num": 4, "input_layout": "BNSD", **attrs})
    node = out.node  # type: ignore[attr-defined]
    assert isinstance(node, Node)
    return node


FUSED = {"sparse_mode": 2, "pre_tokens": INT_MAX, "next_tokens": INT_MAX}


@pytest.mark.parametrize("attrs,fused", [
    ({"sparse_mode": 0, "pre_tokens": 65536, "next_tokens": 0}, True),  # mindformers' call
    ({}, True),  # defaultMask with the whole window
    ({"sparse_mode": 0, "pre_tokens": S - 1, "next_tokens": 1}, True),  # the mask bounds it
    ({"sparse_mode": 1, "pre_tokens": 0, "next_tokens": 0}, True),  # allMask ignores them
    ({"sparse_mode": 0, "pre_tokens": 3, "next_tokens": 0}, False),  # a sliding window
    ({"sparse_mode": 0, "pre_tokens": 65536, "next_tokens": -1}, False),  # no diagonal
])
def test_the_window_decides_with_the_mask(attrs: dict[str, Any], fused: bool) -> None:
    _, b = _graph()
    node = _attention(b, _tiled(b, causal()), **attrs)
    lowered = get_op("FlashAttentionScore").jax_attrs(node)
    dumped = get_op("FlashAttentionScore").impl_attrs(node.attrs)
    assert lowered == ({**dumped, **FUSED} if fused else dumped)


def test_a_query_split_window_keeps_the_general_path() -> None:
    """Under context parallelism each rank's window is a rank value (`QueryWindow`): the
    attention of a query slice is not causal from its own corner, so nothing changes."""
    _, b = _graph()
    window = (("sparse_mode", 0), ("pre_tokens", 65536), ("next_tokens", 0))
    start = RankScalar(RankOffsets((0,), (((1, 2, 4),),)), 0)
    node = _attention(b, _tiled(b, causal()), sparse_mode=0,
                      pre_tokens=QueryWindow(window, S, S, start, 4, "pre_tokens"),
                      next_tokens=QueryWindow(window, S, S, start, 4, "next_tokens"))
    opdef = get_op("FlashAttentionScore")
    assert opdef.jax_attrs(node) == opdef.impl_attrs(node.attrs)


# -- fused against general ----------------------------------------------------------------


def _training_graph(dtype: Any, layout: str, mask: np.ndarray, seed: int
                    ) -> tuple[Graph, list[np.ndarray]]:
    """FlashAttentionScore(q, k, v, Tile(mask)) as mindformers calls it, its four outputs and
    the gradients of attention_out for a random cotangent."""
    case = Case(layout, 2, 4, 2, S, S, 4, 0, 65536, 0, "b1", dtype, 0.5)
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(case.shape(S, heads)).astype(dtype)
              for heads in (4, 2, 2)]
    graph = Graph("fa")
    params = [graph.add_param(GraphParam(TensorType(DType.from_any(a.dtype), a.shape), n,
                                         "weight", True)) for a, n in zip(arrays, "qkv")]
    b = Builder(graph)
    out = b.emit("FlashAttentionScore", list(params) + [_tiled(b, mask, 2)], case.attrs)
    outs = [b("TupleGetItem", out, index=i) for i in range(4)]
    cot = rng.standard_normal(outs[3].shape).astype(dtype)
    grads = append_gradients(graph, [outs[3]], params, [Constant(cot, params[0].dtype)])
    graph.outputs = outs + grads
    return graph, arrays


def _general(graph: Graph, float64: bool = False) -> Any:
    """The lowering without the compile-time specialisation: the general (mask) path."""
    fwd, grad = get_op("FlashAttentionScore"), get_op("FlashAttentionScoreGrad")
    saved = fwd.lowering_attrs, grad.lowering_attrs
    fwd.lowering_attrs = grad.lowering_attrs = None
    try:
        return lower_graph(graph, float64=float64)
    finally:
        fwd.lowering_attrs, grad.lowering_attrs = saved


def _lowered_modes(graph: Graph) -> list[int]:
    return [get_op(n.op).jax_attrs(n)["sparse_mode"] for n in graph.nodes
            if n.op.startswith("FlashAttentionScore")]


def _close(got: Any, want: Any, rtol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-6)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


NAMES = ("softmax_max", "softmax_sum", "softmax_out", "attention_out", "dq", "dk", "dv")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_fused_lowering_equals_the_general_path(dtype: Any, layout: str) -> None:
    """Each output and gradient of the fused lowering within the rounding bound of the
    attention tests (`tolerance`, plus the gradients' reductions over query positions and
    heads) of both the general path and the numpy definition."""
    graph, arrays = _training_graph(dtype, layout, causal(), 0)
    assert _lowered_modes(graph) == [2, 2]
    fused = jax.jit(lower_graph(graph))(*arrays)
    general = jax.jit(_general(graph))(*arrays)
    numpy = run_graph(graph, arrays)
    case = Case(layout, 2, 4, 2, S, S, 4, 0, 65536, 0, "b1", dtype, 0.5)
    rtol = tolerance(case)
    grad_rtol = rtol + 8 * float(np.finfo(np.float32).eps) * S * 4
    for i, name in enumerate(NAMES):
        bound = rtol if i < 4 else grad_rtol
        assert fused[i].dtype == numpy[i].dtype, name
        _close(fused[i], general[i], 2 * bound, f"fused vs general {name}")
        _close(fused[i], numpy[i], 2 * bound, f"fused vs numpy {name}")


@pytest.mark.parametrize("layout", ["BNSD", "SBH"])
def test_fused_lowering_in_float64_is_the_definition(layout: str) -> None:
    """The oracle's evaluation: every float in float64 on both sides, so the fused lowering
    and the numpy definition agree within FLOAT64_RTOL (jax.nn.dot_product_attention rounds
    its softmax to float32, so float64 runs the computation written out)."""
    graph, arrays = _training_graph(np.float32, layout, causal(), 1)
    wide = [a.astype(np.float64) for a in arrays]
    with x64():
        fused = jax.jit(lower_graph(graph, float64=True))(*[jnp.asarray(a) for a in wide])
        general = jax.jit(_general(graph, float64=True))(*[jnp.asarray(a) for a in wide])
    want = run_graph(graph, arrays, float64=True)
    for i, name in enumerate(NAMES):
        assert np.asarray(fused[i]).dtype == np.float64, name
        _close(fused[i], want[i], FLOAT64_RTOL, f"float64 fused {name}")
        _close(general[i], want[i], FLOAT64_RTOL, f"float64 general {name}")


def test_a_sliding_window_mask_runs_the_general_path_and_matches() -> None:
    graph, arrays = _training_graph(np.float32, "BNSD", _sliding_window(2), 2)
    assert _lowered_modes(graph) == [0, 0]
    got = jax.jit(lower_graph(graph))(*arrays)
    want = run_graph(graph, arrays)
    case = Case("BNSD", 2, 4, 2, S, S, 4, 0, 65536, 0, "b1", np.float32, 0.5)
    for i, name in enumerate(NAMES):
        _close(got[i], want[i], 2 * tolerance(case) + 8e-7 * S * 4, name)


# -- the gradient runs the forward's pullback -------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_the_gradient_runs_the_forwards_pullback(dtype: Any, monkeypatch: Any) -> None:
    """Lowered, a training graph computes its attention once: FlashAttentionScoreGrad runs
    the pullback its forward left, as a hand-written `jax.grad` does (on GPUs: one cuDNN
    forward and its backward, not a second forward); without the memo the gradient computes
    the forward again. Both give the same values."""
    graph, arrays = _training_graph(dtype, "BNSD", causal(), 3)
    graph.outputs = graph.outputs[3:]  # attention_out, dq, dk, dv
    calls: list[int] = []
    original = attention._attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "_attention", counted)
    paired = jax.jit(lower_graph(graph))(*arrays)
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setattr(attention, "lowering_memo", lambda: None)
    again = jax.jit(lower_graph(graph))(*arrays)
    assert len(calls) == 2
    case = Case("BNSD", 2, 4, 2, S, S, 4, 0, 65536, 0, "b1", dtype, 0.5)
    bound = tolerance(case) + 8 * float(np.finfo(np.float32).eps) * S * 4
    for name, a, b in zip(NAMES[3:], paired, again):
        _close(a, b, bound, f"pullback vs second forward {name}")


def test_a_forward_serves_only_its_own_gradient() -> None:
    """What the forward leaves is used only for the very arrays it ran on: another array
    (of another trace, or another value), other attributes or another mask keep the
    gradient's own forward; an equal constant mask, or one the mode does not read, serves."""
    q, k, v, out = (jnp.zeros((1, 2, 4, 4)) for _ in range(4))
    mask = jnp.asarray(causal())
    attrs = {**attention.DEFAULTS, "head_num": 2, "input_layout": "BNSD"}
    forward = attention._Forward(q, k, v, mask, out, attrs, pullback=None)
    assert forward.serves(q, k, v, mask, out, dict(attrs))
    assert forward.serves(q, k, v, jnp.asarray(causal()), out, attrs)  # equal constant
    assert not forward.serves(jnp.zeros((1, 2, 4, 4)), k, v, mask, out, attrs)
    assert not forward.serves(q, k, v, mask, jnp.zeros((1, 2, 4, 4)), attrs)
    assert not forward.serves(q, k, v, mask, out, {**attrs, "scale_value": 0.5})
    assert not forward.serves(q, k, v, 1 - mask, out, attrs)
    assert not forward.serves(q, k, v, None, out, attrs)
    causal_mode = {**attrs, "sparse_mode": 2}
    assert attention._Forward(q, k, v, mask, out, causal_mode, None).serves(
        q, k, v, 1 - mask, out, causal_mode)  # mode 2 reads no mask

    seen: list[bool] = []

    def body(m: Any) -> Any:  # traced masks: another array is another value
        seen.append(attention._Forward(q, k, v, m, out, attrs, None).serves(
            q, k, v, m + 0, out, attrs))
        return m

    jax.jit(body)(mask)
    assert seen == [False]


# -- examples/llama.py -------------------------------------------------------------------------


@pytest.fixture
def llama_env(monkeypatch: Any) -> None:
    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)


def test_llama_on_one_device_runs_fused_and_checks(llama_env: None) -> None:
    """`pcompile examples/llama.py --devices 1`: the JAX program (fused causal attention, in
    float64) against the numpy interpreter."""
    program = compile_model(LLAMA, devices=1, dump=False)
    modes = _lowered_modes(program.rank_graphs[0])
    assert modes and set(modes) == {2}, modes
    _, _, arrays = next(batches(program, 1))
    want = StandAloneRunner(program, "numpy", float64=True).run(arrays)
    got = StandAloneRunner(program, "jax", float64=True).run(arrays)
    for name, a, b in zip(program.output_names, got, want):
        assert relative_error(a, b) <= FLOAT64_RTOL, name


# slow: an 8-device worker process; test_llama_on_one_device_runs_fused_and_checks checks the
# fused lowering fast
@pytest.mark.slow
def test_llama_on_8_devices_runs_fused_and_matches() -> None:
    """dp 2 x mp 4: the mask reaches each rank's attention through Tile, Reshape, a
    rank-dependent StridedSlice of the batch and Reshape; the JAX SPMD program (8 virtual CPU
    devices, float64) runs every attention fused and equals the numpy simulator and one
    device within the oracle's bound."""
    from tests.backends.test_jax_backend import assert_agrees_in_float64, worker

    result = worker("llama")
    assert result["attention"] > 0 and result["causal"] == result["attention"], result
    assert_agrees_in_float64(result, "llama")


@pytest.mark.parametrize("flip", [None, (0, 1), (1500, 1499), (2047, 2046)])
def test_a_long_mask_is_checked_band_by_band(flip: tuple[int, int] | None) -> None:
    """A 2048 x 2048 mask is checked in bands of 512 rows (no whole-block temporaries at
    compile time): causal as written, and refused when one element of any band is wrong."""
    mask = np.triu(np.ones((1, 1, 2048, 2048), np.uint8), 1)
    if flip is not None:
        mask[(0, 0) + flip] ^= 1
    assert is_causal_mask(Constant(mask, DType.uint8)) is (flip is None)
