"""Sharding rules of the primitives a mindformers-style Llama needs, against the single-device
oracle: hypothesis draws a device count and a strategy the rule allows, runs the op sharded on
every simulated rank and compares every output (gathered from the ranks by its layout) and the
gradient of every floating-point input with the unsharded op."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.backends.numpy.simulate import run_ranks
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Value
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType, TupleType
from pcompile.passes.autodiff import append_gradients
from pcompile.passes.step_parallel import SplitOptions, build_rank_graphs
from pcompile.passes.step_parallel_begin import assign
from pcompile.tools.oracle import FLOAT64_RTOL
from tests.e2e.test_parallel import draw_strategy, rnd

DEVICES = st.sampled_from([1, 2, 4, 8, 16])
RULE_EXAMPLES = settings(max_examples=12, deadline=None,
                         suppress_health_check=list(HealthCheck))


def ints(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 3, shape).astype(np.int32)


def bools(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(shape) < 0.5


# Outputs that carry no gradient (read by no differentiated computation in real programs).
NO_GRAD_OUTPUTS = {"FlashAttentionScore": (0, 1, 2)}


def case_graph(op: str, arrays: list[np.ndarray], attrs: dict[str, Any], strategy: Any,
               out_strategy: Any = None) -> tuple[Graph, list[GraphParam]]:
    """op(*arrays) with every output returned, and a scalar loss: the sum of every float
    output (but NO_GRAD_OUTPUTS) times a fixed random cotangent."""
    graph = Graph("case")
    params = []
    for i, arr in enumerate(arrays):
        dtype = DType.from_any(arr.dtype)
        params.append(graph.add_param(GraphParam(TensorType(dtype, arr.shape), f"x{i}",
                                                 "weight", dtype.is_float)))
    b = Builder(graph)
    user = {"in_strategy": strategy} if strategy is not None else None
    if user is not None and out_strategy is not None:
        user["out_strategy"] = out_strategy
    out = b.emit(op, list(params), attrs, user_attrs=user, instance_name="op")
    outs: list[Value] = ([b("TupleGetItem", out, index=i)
                          for i in range(len(out.type.elements))]
                         if isinstance(out.type, TupleType) else [out])
    rng = np.random.default_rng(1)
    terms = []
    for i, v in enumerate(outs):
        if not v.dtype.is_float and v.dtype is not DType.bool_:
            continue
        if i in NO_GRAD_OUTPUTS.get(op, ()):
            continue
        val = v if v.dtype is DType.float32 else b("Cast", v, dst_type=DType.float32)
        cot = Constant(rng.standard_normal(v.shape).astype(np.float32), DType.float32)
        terms.append(b("ReduceSum", b("Mul", val, cot), axis=(), keep_dims=False))
    loss = terms[0]
    for t in terms[1:]:
        loss = b("Add", loss, t)
    graph.outputs = [loss, *outs]
    return graph, params


def assemble(parts: list[np.ndarray], layout: Any, like: np.ndarray) -> np.ndarray:
    full = np.zeros(layout.shape, like.dtype)
    for rank, part in enumerate(parts):
        full[tuple(slice(lo, hi) for lo, hi in layout.slice_bounds(rank))] = part
    return full


def close(got: np.ndarray, want: np.ndarray, what: str, rtol: float = FLOAT64_RTOL) -> None:
    if want.dtype == bool or want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    scale = max(float(np.max(np.abs(want))) if want.size else 0.0, 1e-6)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=rtol * scale, err_msg=what)


def run_sharded(op: str, arrays: list[np.ndarray], attrs: dict[str, Any], strategy: Any,
                devices: int, rtol: float = FLOAT64_RTOL, out_strategy: Any = None) -> None:
    """Every output and every input gradient of `op` under `strategy` (and `out_strategy`)
    equal the unsharded op's. Both run in float64 (the oracle's mode: the same arithmetic on
    slices, up to the order of additions), so the bound is the oracle's derived one whatever
    the dtype."""
    ref, ref_params = case_graph(op, arrays, attrs, strategy)
    wrt = [p for p in ref_params if p.requires_grad]
    ref.outputs = [*ref.outputs, *append_gradients(ref, ref.outputs[0], wrt)]
    want = run_graph(ref, arrays, float64=True)

    graph, params = case_graph(op, arrays, attrs, strategy, out_strategy)
    assignment = assign(graph, devices, "full_batch")
    ranks, out_layouts = build_rank_graphs(graph, assignment, SplitOptions(devices, True), {})
    for g in ranks:
        ws = [p for p in g.weights if p.requires_grad]
        g.outputs = [*g.outputs, *append_gradients(g, g.outputs[0], ws)]
    feeds = [[arr[tuple(slice(lo, hi) for lo, hi in
                        assignment.param_layouts[p.name].slice_bounds(r))] if arr.shape else arr
              for p, arr in zip(graph.params, arrays)] for r in range(devices)]
    outs = run_ranks(ranks, feeds, float64=True)
    close(outs[0][0], want[0], "loss", rtol)
    n_out = len(graph.outputs)
    for i in range(1, n_out):
        got = assemble([o[i] for o in outs], out_layouts[i], want[i])
        close(got, want[i], f"output {i - 1}", rtol)
    for k, p in enumerate(wrt):
        lay = assignment.param_layouts[p.name]
        got = assemble([o[n_out + k] for o in outs], lay, want[n_out + k])
        close(got, want[n_out + k], f"gradient of input {ref_params.index(p)}", rtol)


CASES: dict[str, Any] = {
    "NotEqual": lambda: ([ints((4, 8)), ints((8,), 2)], {}),
    "Equal": lambda: ([ints((4, 8)), ints((4, 8), 2)], {}),
    "LessEqual": lambda: ([rnd((4, 8)), rnd((4, 1), 2)], {}),
    "GreaterEqual": lambda: ([rnd((4, 8)), rnd((4, 8), 2)], {}),
    "LogicalAnd": lambda: ([bools((4, 8)), bools((1, 8), 2)], {}),
    "LogicalOr": lambda: ([bools((4, 8)), bools((4, 8), 2)], {}),
    "LogicalNot": lambda: ([bools((4, 8))], {}),
    "Select": lambda: ([bools((4, 8)), rnd((4, 8)), rnd((8,), 2)], {}),
    "SiLU": lambda: ([rnd((8, 4))], {}),
    "RmsNorm": lambda: ([rnd((4, 4, 8)), rnd((8,), 3)], {"epsilon": 1e-5}),
    "RmsNorm2": lambda: ([rnd((8, 2, 4)), rnd((2, 4), 3)], {}),
    "Abs": lambda: ([rnd((8, 4))], {}),
    "Erf": lambda: ([rnd((4, 8))], {}),
    "Gather": lambda: ([rnd((4, 6, 2)), ints((4, 8))], {"axis": 1, "batch_dims": 1}),
    "Gather2": lambda: ([rnd((2, 4, 2, 6)), ints((2, 4, 3))], {"axis": 3, "batch_dims": 2}),
    "LpNorm": lambda: ([rnd((4, 8, 2))], {"axis": (0, 1), "p": 2}),
    "LpNorm2": lambda: ([rnd((4, 8, 2))], {"axis": (1,), "p": 1, "keep_dims": True}),
    "LpNorm3": lambda: ([rnd((8, 4))], {"axis": (), "p": 3}),
    "LpNorm4": lambda: ([rnd((2, 8))], {"axis": (-1,), "p": 4, "keep_dims": False}),
    "ReduceMin": lambda: ([rnd((4, 6, 8))], {"axis": (2,), "keep_dims": False}),
    "ReduceMin2": lambda: ([rnd((8, 4))], {"axis": (0,), "keep_dims": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@RULE_EXAMPLES
@given(data=st.data(), devices=DEVICES)
def test_rule_matches_the_oracle(case: str, data: Any, devices: int) -> None:
    op = case.rstrip("0123456789")
    arrays, attrs = CASES[case]()
    strategy = draw_strategy(data.draw, op, arrays, attrs, devices)
    run_sharded(op, arrays, attrs, strategy, devices)


@pytest.mark.parametrize("op,arrays,attrs,strategy,message", [
    ("RmsNorm", [rnd((4, 8)), rnd((8,))], {}, ((1, 2), (2,)), "normalised dim"),
    ("RmsNorm", [rnd((4, 8)), rnd((8,))], {}, ((2, 1), (1, 1)), "has 2 values but"),
    ("LogicalAnd", [bools((4, 8)), bools((1, 8))], {}, ((2, 1), (2, 1)),
     "cannot be divisible by strategy value 2"),
])
def test_invalid_strategies_name_the_problem(op: str, arrays: list[np.ndarray],
                                             attrs: dict[str, Any], strategy: Any,
                                             message: str) -> None:
    graph, _ = case_graph(op, arrays, attrs, strategy)
    with pytest.raises(OpError, match=message):
        assign(graph, 8, "full_batch")


# -- Tile: strategies that split the copies of tiled dims ---------------------------------------


def draw_tile_strategy(draw: Any, shape: tuple[int, ...], reps: tuple[int, ...],
                       devices: int) -> tuple[tuple[int, ...]]:
    """A split per dim dividing its multiple (tiled dims) or its size, within `devices`."""
    from pcompile.ir.sharding import is_power_of_two

    remaining, split = devices, []
    for m, d in zip(reps, shape):
        extent = m if m > 1 else d
        options = [c for c in range(1, remaining + 1) if remaining % c == 0 and extent % c == 0
                   and (not is_power_of_two(devices) or is_power_of_two(c))]
        c = draw(st.sampled_from(options))
        split.append(c)
        remaining //= c
    return (tuple(split),)


@RULE_EXAMPLES
@given(data=st.data(), devices=st.sampled_from([1, 2, 4, 8, 6]),
       case=st.sampled_from([((2, 2, 1, 6), (1, 1, 4, 1)), ((4, 3), (2, 2)), ((2, 4), (3, 1)),
                             ((4, 1, 2), (1, 6, 2))]))
def test_tile_rule_matches_the_oracle(data: Any, devices: int, case: Any) -> None:
    shape, reps = case
    strategy = draw_tile_strategy(data.draw, shape, reps, devices)
    run_sharded("Tile", [rnd(shape)], {"multiples": reps}, strategy, devices)


def test_tile_strategy_of_a_tiled_dim_splits_its_multiple() -> None:
    """mindformers' tile_kv.shard(((dp, mp, 1, 1),)) with multiples (1, 1, rep, 1); and a split
    of the rep copies (the input stays whole in that dim, the local multiple shrinks)."""
    from pcompile.ir.sharding import OpContext, rule_for
    from pcompile.ir.types import TensorType

    x = TensorType(DType.float32, (2, 4, 1, 12))
    out = TensorType(DType.float32, (2, 4, 4, 12))
    ctx = OpContext("Tile", [x], out, {"multiples": (1, 1, 4, 1)}, 8)
    sharding = rule_for("Tile").apply(ctx, ((2, 2, 2, 1),))
    assert sharding.in_layouts[0].slice_shape == (1, 2, 1, 12)
    assert sharding.out_layouts[0].slice_shape == (1, 2, 2, 12)
    assert sharding.local_attrs == {"multiples": (1, 1, 2, 1)}
    run_sharded("Tile", [rnd((2, 4, 1, 12))], {"multiples": (1, 1, 4, 1)}, ((2, 2, 2, 1),), 8)
    with pytest.raises(OpError, match="tiled 4 times.*cannot be divisible by strategy value 8"):
        run_sharded("Tile", [rnd((2, 4, 1, 12))], {"multiples": (1, 1, 4, 1)},
                    ((1, 1, 8, 1),), 8)


# -- OneHot: MindSpore's strategy form splits the [N, depth] output, depth included ---------------


@RULE_EXAMPLES
@given(data=st.data(), devices=st.sampled_from([1, 2, 4, 8, 16, 6]),
       case=st.sampled_from([((8,), -1), ((8,), 0), ((4, 2), -1), ((4, 2), 1)]))
def test_one_hot_mindspore_form_matches_the_oracle(data: Any, devices: int, case: Any) -> None:
    from pcompile.ir.sharding import is_power_of_two

    shape, axis = case
    depth = 12
    out_shape = list(shape)
    out_shape.insert(axis % (len(shape) + 1), depth)
    remaining, split = devices, []
    for size in out_shape:
        options = [c for c in range(1, remaining + 1) if remaining % c == 0 and size % c == 0
                   and (not is_power_of_two(devices) or is_power_of_two(c))]
        split.append(data.draw(st.sampled_from(options)))
        remaining //= split[-1]
    # Indices in range, out of range (all off) and negative (all off).
    idx = np.random.default_rng(4).integers(-2, depth + 2, shape).astype(np.int32)
    attrs = {"depth": depth, "axis": axis, "on_value": 2.0, "off_value": -1.0}
    run_sharded("OneHot", [idx], attrs, (tuple(split), (), ()), devices)


def test_one_hot_forms_agree_and_name_problems() -> None:
    idx = np.array([1, 0, 3, 11, 7, 5, 2, 9], np.int32)
    attrs = {"depth": 12}
    run_sharded("OneHot", [idx], attrs, ((2,),), 8)  # pcompile's form: indices only
    run_sharded("OneHot", [idx], attrs, ((2, 4), (), ()), 8)
    graph, _ = case_graph("OneHot", [idx], attrs, ((2, 4, 1), (), ()))
    with pytest.raises(OpError, match=r"splits the output \(8, 12\), so it has 2 values"):
        assign(graph, 8, "full_batch")
    graph, _ = case_graph("OneHot", [idx], attrs, ((1, 8), (), ()))
    with pytest.raises(OpError, match=r"the depth 12 \(dim 1 of the output \(8, 12\)\) "
                                      "cannot be divisible by strategy value 8"):
        assign(graph, 8, "full_batch")


# -- FlashAttentionScore: batch and heads (kv heads with them under grouped-query attention) ------


def test_flash_attention_rule_matches_the_oracle_examples() -> None:
    """mindformers' strategies: BNSD ((dp, mp, 1, 1), (dp, mp, 1, 1) x2, (dp, 1, 1, 1)) with a
    (B, 1, S, S) mask; BSH ((dp, 1, mp), (dp, 1, mp) x2); multi-query (kv heads whole)."""
    from tests.ir.test_ops_attention import Case, make_inputs

    bnsd = Case("BNSD", 2, 8, 4, 6, 6, 4, 0, 65536, 0, "b1", np.float32, 0.5)
    run_sharded("FlashAttentionScore", make_inputs(bnsd, 0), bnsd.attrs,
                ((2, 4, 1, 1), (2, 4, 1, 1), (2, 4, 1, 1), (2, 1, 1, 1)), 8)
    bsh = Case("BSH", 2, 8, 2, 4, 6, 2, 3, 0, 0, "none", np.float32, 1.0)
    run_sharded("FlashAttentionScore", make_inputs(bsh, 1), bsh.attrs,
                ((2, 1, 2), (2, 1, 2), (2, 1, 2)), 8)
    mqa = Case("BSND", 2, 4, 1, 5, 5, 2, 2, 0, 0, "compressed", np.float32, 1.0)
    run_sharded("FlashAttentionScore", make_inputs(mqa, 2), mqa.attrs,
                ((2, 1, 4, 1), (2, 1, 1, 1), (2, 1, 1, 1), (1, 1)), 8)


@st.composite
def attention_cases(draw: Any) -> Any:
    from tests.ir.test_ops_attention import cases

    case = draw(cases())
    case.batch = draw(st.sampled_from([2, 4]))
    case.kv_heads = draw(st.sampled_from([1, 2, 4]))
    case.q_heads = case.kv_heads * draw(st.sampled_from([1, 2]))
    if case.mask == "1n" or (case.mask == "bn" and draw(st.booleans())):
        case.mask = "bn"
    return case


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), devices=st.sampled_from([2, 4, 8, 16, 6]), case=attention_cases())
def test_flash_attention_rule_matches_the_oracle(data: Any, devices: int, case: Any) -> None:
    from tests.ir.test_ops_attention import make_inputs

    arrays = make_inputs(case, 7)
    strategy = draw_strategy(data.draw, "FlashAttentionScore", arrays, case.attrs, devices)
    # The labels allow any split of a BSH/SBH hidden size; the rule keeps whole heads.
    axis = 2 if case.layout != "BNSD" else 1
    heads, kv = strategy[0][axis], strategy[1][axis]
    assume(case.q_heads % heads == 0 and case.kv_heads % kv == 0)
    run_sharded("FlashAttentionScore", arrays, case.attrs, strategy, devices)


@pytest.mark.parametrize("layout,strategy,message", [
    ("BNSD", ((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)), "split like the dims it is matched"),
    ("BNSD", ((1, 1, 1, 2), (1, 1, 1, 2), (1, 1, 1, 2)), "it is the head size"),
    ("BNSD", ((1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 2, 1)), "it is the kv sequence"),
    ("BSH", ((1, 1, 8), (1, 1, 8), (1, 1, 8)), "4 heads, which cannot be split 8 ways"),
    ("BSH", ((1, 1, 4), (1, 1, 4), (1, 1, 4)), "2 heads, which cannot be split 4 ways"),
])
def test_flash_attention_invalid_strategies(layout: str, strategy: Any, message: str) -> None:
    from tests.ir.test_ops_attention import Case, make_inputs

    case = Case(layout, 2, 4, 2, 4, 4, 4, 0, 0, 0, "none", np.float32, 1.0)
    graph, _ = case_graph("FlashAttentionScore", make_inputs(case, 0), case.attrs, strategy)
    with pytest.raises(OpError, match=message):
        assign(graph, 8, "full_batch")


def test_flash_attention_multi_query_keeps_kv_heads_whole() -> None:
    from tests.ir.test_ops_attention import Case, make_inputs

    case = Case("BNSD", 2, 4, 1, 4, 4, 4, 0, 0, 0, "none", np.float32, 1.0)
    graph, _ = case_graph("FlashAttentionScore", make_inputs(case, 0), case.attrs,
                          ((1, 2, 1, 1), (1, 2, 1, 1), (1, 2, 1, 1)))
    with pytest.raises(OpError, match="one head .multi-query attention., so their head dim"):
        assign(graph, 8, "full_batch")


# -- FlashAttentionScore: query-sequence split (windows moved per rank) --------------------------


def test_query_split_window_keeps_exactly_the_slice_rows() -> None:
    """Every mode, window, split and length: the positions a slice keeps with its moved window
    are the rows of the positions the whole query keeps."""
    from pcompile.ir.ops.attention import position_keep, query_split_window

    for mode in (0, 1, 2, 3, 4):
        for q_seq, kv_seq in ((4, 4), (8, 4), (4, 8), (6, 6), (12, 5)):
            for pre, nxt in ((2147483647, 2147483647), (0, 0), (2, 1), (65536, 0), (-1, 3)):
                attrs = {"sparse_mode": mode, "pre_tokens": pre, "next_tokens": nxt}
                whole = position_keep(mode, pre, nxt, q_seq, kv_seq, True)
                whole = np.ones((q_seq, kv_seq), bool) if whole is None else whole
                for parts in (2, 4):
                    if q_seq % parts:
                        continue
                    length = q_seq // parts
                    for sid in range(parts):
                        local = {**attrs, **query_split_window(attrs, q_seq, kv_seq, sid, parts)}
                        keep = position_keep(local["sparse_mode"], local["pre_tokens"],
                                             local["next_tokens"], length, kv_seq, True)
                        keep = np.ones((length, kv_seq), bool) if keep is None else keep
                        np.testing.assert_array_equal(
                            keep, whole[sid * length:(sid + 1) * length],
                            err_msg=f"{attrs} {q_seq}x{kv_seq} slice {sid}/{parts}")


@pytest.mark.parametrize("mode,mask", [(0, "b1"), (0, "2d"), (0, "none"), (1, "bn"),
                                       (2, "compressed"), (3, "none"), (4, "compressed")])
def test_flash_attention_query_split_matches_the_oracle(mode: int, mask: str) -> None:
    """mindformers' context-parallel strategy: query (dp, mp, cp, 1), key/value (dp, mp, 1, 1),
    a full mask (dp, 1, cp, 1) or a compressed one (1, 1)."""
    from tests.ir.test_ops_attention import Case, make_inputs

    case = Case("BNSD", 2, 4, 2, 8, 8, 2, mode, 3, 1, mask, np.float32, 0.5)
    arrays = make_inputs(case, 3)
    mask_strategy = {"b1": ((2, 1, 2, 1),), "2d": ((2, 1),), "bn": ((2, 2, 2, 1),),
                     "compressed": ((1, 1),), "none": ()}[mask]
    strategy = ((2, 2, 2, 1), (2, 2, 1, 1), (2, 2, 1, 1)) + mask_strategy
    run_sharded("FlashAttentionScore", arrays, case.attrs, strategy, 8)
    bsh = Case("BSH", 2, 4, 2, 8, 8, 2, mode, 3, 1, mask.replace("bn", "b1"), np.float32, 0.5)
    mask_strategy = {"b1": ((2, 1, 4, 1),), "2d": ((4, 1),), "compressed": ((1, 1),),
                     "none": ()}[bsh.mask]
    run_sharded("FlashAttentionScore", make_inputs(bsh, 4), bsh.attrs,
                ((2, 4, 1), (2, 1, 1), (2, 1, 1)) + mask_strategy, 8)


def test_query_split_windows_per_rank() -> None:
    """Ranks along the query split get different windows; the SPMD plan runs them as attribute
    variants of one program."""
    from pcompile.backends.jax.plan import SpmdPlan
    from tests.ir.test_ops_attention import Case, make_inputs

    case = Case("BNSD", 2, 2, 2, 8, 8, 2, 2, 0, 0, "none", np.float32, 1.0)
    graph, _ = case_graph("FlashAttentionScore", make_inputs(case, 0), case.attrs,
                          ((1, 1, 4, 1), (1, 1, 1, 1), (1, 1, 1, 1)))
    assignment = assign(graph, 4, "full_batch")
    ranks, _ = build_rank_graphs(graph, assignment, SplitOptions(4, False), {})
    windows = [next((n.attrs["sparse_mode"], n.attrs["pre_tokens"], n.attrs["next_tokens"])
                    for n in g.at_rank(r).nodes if n.op == "FlashAttentionScore")
               for r, g in enumerate(ranks)]
    # Left-up causal over 8 x 8, query slices of 2, as bottom-right-aligned bands.
    assert windows == [(4, 14, -6), (4, 12, -4), (4, 10, -2), (4, 8, 0)]
    SpmdPlan.build(ranks)


# -- every element-wise op of the registry --------------------------------------------------------


def _elementwise_ops() -> list[str]:
    from pcompile.ir.registry import all_ops
    from pcompile.ir.sharding import ELEMENTWISE

    return sorted(name for name, opdef in all_ops().items() if opdef.sharding is ELEMENTWISE
                  and name != "Select")  # Select's Bool condition: CASES above


def elementwise_case(op: str) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Inputs for an element-wise op read from its registration: as many operands as it
    takes, the second broadcast along dim 0, of its first accepted dtype among Bool (for an op
    without a float dtype: the harness needs a float or Bool output), float32 (positive: inside
    every unary op's domain) and int32."""
    from pcompile.ir.registry import BOOL, get_op

    opdef = get_op(op)
    assert opdef.page is not None
    count = opdef.num_inputs if isinstance(opdef.num_inputs, int) else 1
    shapes = [(4, 8) if i % 2 == 0 else (1, 8) for i in range(count)]
    if opdef.page.dtypes == BOOL or (BOOL <= opdef.page.dtypes
                                     and DType.float32 not in opdef.page.dtypes):
        arrays = [bools(s, i) for i, s in enumerate(shapes)]
    elif DType.float32 in opdef.page.dtypes:
        arrays = [rnd(s, i, True) for i, s in enumerate(shapes)]
    else:
        arrays = [ints(s, i) + 1 for i, s in enumerate(shapes)]
    return arrays, {"dst_type": DType.float32} if op == "Cast" else {}


@pytest.mark.parametrize("op", _elementwise_ops())
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), devices=DEVICES)
def test_every_elementwise_rule_matches_the_oracle(op: str, data: Any, devices: int) -> None:
    """Every op the registry gives the element-wise rule, not only those with a case above."""
    arrays, attrs = elementwise_case(op)
    strategy = draw_strategy(data.draw, op, arrays, attrs, devices)
    run_sharded(op, arrays, attrs, strategy, devices)


def test_local_expansions_are_their_op_blocks_callables() -> None:
    """A sharding that the op itself on the local slices would get wrong carries its op
    block's `Expansion` (issue 37 move 3), which step_parallel calls: a new op brings its own
    without a case in the pass (they were names the pass switched on)."""
    from pcompile.ir.sharding import Expansion

    cases = [("Gather", [rnd((8, 6)), np.array([[1, 7, 3], [0, 5, 5]], np.int32)],
              {"axis": 0}, ((4, 1), (1, 1)), "pcompile.ir.ops.shape"),
             ("OneHot", [np.array([1, 0, 3, 11, 7, 5, 2, 9], np.int32)], {"depth": 12},
              ((2, 4), (), ()), "pcompile.ir.ops.shape"),
             ("LpNorm", [rnd((4, 8, 2))], {"axis": (0, 1), "p": 2}, ((2, 2, 1),),
              "pcompile.ir.ops.norm")]
    for op, arrays, attrs, strategy, block in cases:
        graph, _ = case_graph(op, arrays, attrs, strategy)
        assignment = assign(graph, 8, "full_batch")
        (node,) = [n for n in graph.nodes if n.op == op]
        expand = assignment.sharding(node).expand
        assert isinstance(expand, Expansion) and type(expand).__module__ == block, op

    class Negated(Expansion):  # an expansion the pass has never heard of
        def finish(self, node: Any, b: Builder, out: Value, attrs: dict[str, Any]) -> Value:
            return b.emit("Neg", [out])

    graph, _ = case_graph("Abs", [rnd((8, 4))], {}, ((2, 1),))
    assignment = assign(graph, 2, "full_batch")
    (node,) = [n for n in graph.nodes if n.op == "Abs"]
    assignment.sharding(node).expand = Negated()
    ranks, _ = build_rank_graphs(graph, assignment, SplitOptions(2, False), {})
    ops = [n.op for n in ranks[0].nodes]
    assert ops[ops.index("Abs") + 1] == "Neg"
