"""Every registered primitive under every element type: the dtypes an op accepts (its `OpDoc`
record's `dtypes`, which docs/ops.md prints) run on the numpy interpreter and the JAX lowering
with equal results (and the inferred result dtype); the dtypes it refuses raise one `OpError`
naming the dtype. A new op must add a case here, and a doc record next to its declaration."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

from pcompile.backends.jax import lower_graph
from pcompile.backends.numpy import run_graph
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.parser import parse_graph
from pcompile.ir.printer import print_graph
from pcompile.ir.registry import FLOATS, all_ops, get_op
from pcompile.ir.types import DType, TensorType, TupleType
from tests import op_harness  # noqa: F401  (64-bit JAX types, as in the other op tests)

B, U8, I32, I64 = DType.bool_, DType.uint8, DType.int32, DType.int64
F16, BF16, F32 = DType.float16, DType.bfloat16, DType.float32
INTS = frozenset({U8, I32, I64})
SWEPT = (B, U8, I32, I64, F16, BF16, F32)

Maker = Callable[[DType, np.random.Generator], tuple[list[np.ndarray], dict[str, Any]]]


def values(dtype: DType, shape: tuple[int, ...], rng: np.random.Generator,
           positive: bool = False) -> np.ndarray:
    """Test values of `dtype`: small integers (no overflow in the ops below), or normal floats
    (in [0.5, 2.5) when `positive`)."""
    if dtype is B:
        return rng.random(shape) < 0.5
    if dtype in INTS:
        low = 0 if dtype is U8 or positive else -5
        return rng.integers(low + (1 if positive else 0), 6, shape).astype(dtype.np)
    if positive:
        return rng.uniform(0.5, 2.5, shape).astype(dtype.np)
    return rng.standard_normal(shape).astype(dtype.np)


@dataclass
class Case:
    """How to call an op with operands of one dtype (the dtypes it must accept are its doc
    record's, `all_ops()[op].page.dtypes`).

    `terms` is the number of products or terms one output element accumulates: rounding
    differences between the two backends grow with it."""

    make: Maker
    terms: int = 1


def unary(in_shape: tuple[int, ...] = (3, 4), positive: bool = False, **attrs: Any) -> Maker:
    return lambda d, rng: ([values(d, in_shape, rng, positive)], dict(attrs))


def binary(sx: tuple[int, ...] = (3, 4), sy: tuple[int, ...] = (4,), positive: bool = False,
           **attrs: Any) -> Maker:
    return lambda d, rng: ([values(d, sx, rng, positive), values(d, sy, rng, positive)],
                           dict(attrs))


def same_pair(shape: tuple[int, ...] = (3, 4), **attrs: Any) -> Maker:
    return lambda d, rng: ([values(d, shape, rng, True), values(d, shape, rng)], dict(attrs))


def _select(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [rng.random((3, 4)) < 0.5, values(d, (3, 4), rng), values(d, (4,), rng)], {}


def _gather(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (5, 3), rng), np.array([[4, 0], [2, 2]], np.int32)], {"axis": 0}


def _gather_grad(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    idx = np.array([[4, 0], [2, 2]], np.int32)
    return [values(d, (2, 2, 3), rng), idx], {"shape": (5, 3), "axis": 0}


def _one_hot(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (4,), rng, True)], {"depth": 5}


def _layer_norm(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    attrs = {"begin_norm_axis": -1, "begin_params_axis": -1, "epsilon": 1e-5}
    return [values(d, (3, 8), rng), values(d, (8,), rng), values(d, (8,), rng)], attrs


def _layer_norm_grad(d: DType, rng: np.random.Generator
                     ) -> tuple[list[np.ndarray], dict[str, Any]]:
    attrs = {"begin_norm_axis": -1, "begin_params_axis": -1, "epsilon": 1e-5}
    return [values(d, (3, 8), rng), values(d, (3, 8), rng), values(d, (8,), rng)], attrs


def _rms_norm(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (3, 8), rng), values(d, (8,), rng)], {"epsilon": 1e-5}


def _rms_norm_grad(d: DType, rng: np.random.Generator
                   ) -> tuple[list[np.ndarray], dict[str, Any]]:
    rstd = values(F32, (3, 1), rng, positive=True)
    return [values(d, (3, 8), rng), values(d, (3, 8), rng), rstd, values(d, (8,), rng)], {}


_FA = {"head_num": 2, "input_layout": "BNSD", "scale_value": 0.5, "sparse_mode": 2}


def _fa(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (1, 2, 3, 4), rng), values(d, (1, 1, 3, 4), rng),
            values(d, (1, 1, 3, 4), rng)], dict(_FA)


def _fa_grad(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    q, k, v = (values(d, s, rng) for s in ((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4)))
    dy = values(d, (1, 2, 3, 4), rng)
    if d not in FLOATS:
        stats = np.ones((1, 2, 3, 8), np.float32)
        return [q, k, v, dy, stats, stats, q], dict(_FA)
    # The numpy backward reads the forward's statistics: give it the true ones.
    row_max, row_sum, _, out = all_ops()["FlashAttentionScore"].numpy(q, k, v, **{
        **all_ops()["FlashAttentionScore"].attrs, **_FA})
    return [q, k, v, dy, row_max, row_sum, out], dict(_FA)


def _sce(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    labels = np.eye(5)[[0, 3, 1]].astype(d.np)
    return [values(d, (3, 5), rng), labels], {}


def _sce_grad(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    labels = np.eye(5)[[0, 3, 1]].astype(d.np)
    return [values(d, (3, 5), rng), labels, values(d, (3,), rng)], {}


def _sparse_sce(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (3, 5), rng), np.array([0, 4, 2], np.int32)], {}


_CONV = {"out_channel": 4, "kernel_size": (2, 2)}
_POOL = {"kernel_size": (2, 2), "strides": (2, 2)}


def _conv(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (2, 3, 4, 4), rng), values(d, (4, 3, 2, 2), rng)], dict(_CONV)


def _conv_bp_input(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return ([values(d, (2, 4, 3, 3), rng), values(d, (4, 3, 2, 2), rng)],
            {**_CONV, "input_size": (2, 3, 4, 4)})


def _conv_bp_filter(d: DType, rng: np.random.Generator
                    ) -> tuple[list[np.ndarray], dict[str, Any]]:
    return ([values(d, (2, 4, 3, 3), rng), values(d, (2, 3, 4, 4), rng)],
            {**_CONV, "filter_size": (4, 3, 2, 2)})


def _pool_grad(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    x = values(d, (1, 2, 4, 4), rng)
    return [x, values(d, (1, 2, 2, 2), rng), values(d, (1, 2, 2, 2), rng)], dict(_POOL)


def _strided_slice_grad(d: DType, rng: np.random.Generator
                        ) -> tuple[list[np.ndarray], dict[str, Any]]:
    return ([values(d, (2, 2), rng)],
            {"shape": (4, 4), "begin": (1, 0), "end": (3, 4), "strides": (1, 2)})


def _concat(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (2, 3), rng), values(d, (2, 1), rng)], {"axis": 1}


def _rope(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (1, 2, 3, 4), rng), values(d, (1, 1, 3, 4), rng),
            values(d, (1, 1, 3, 4), rng)], {"mode": 0}


def _dropout(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    operands = [values(d, (3, 4), rng), np.asarray(2, np.int32), np.zeros(2, np.int32)]
    return operands, {"keep_prob": 0.5, "seed0": 1, "seed1": 2, "global_shape": (3, 4)}


def _gen_mask(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (), rng, True)], {"shape": (3, 50), "keep_prob": 0.5, "seed0": 1,
                                        "seed1": 2}


def _do_mask(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    mask = rng.integers(0, 256, (16,)).astype(np.uint8)
    return ([values(d, (3, 4), rng), mask, np.zeros(2, np.int32)],
            {"keep_prob": 0.5, "global_shape": (3, 4)})


def _make_tuple(d: DType, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
    return [values(d, (2, 3), rng), values(d, (4,), rng)], {}


GRAD_PAIR = same_pair()

CASES: dict[str, Case] = {
    "Add": Case(binary()),
    "Sub": Case(binary()),
    "Mul": Case(binary()),
    "RealDiv": Case(binary(positive=True)),
    "Mod": Case(binary(positive=True)),
    "Maximum": Case(binary()),
    "Minimum": Case(binary()),
    "Pow": Case(binary(positive=True)),
    "ReLU": Case(unary()),
    "ReluGrad": Case(binary((3, 4), (3, 4))),
    "Neg": Case(unary()),
    "Abs": Case(unary()),
    "Square": Case(unary()),
    "Exp": Case(unary()),
    "Log": Case(unary(positive=True)),
    "Sqrt": Case(unary(positive=True)),
    "SqrtGrad": Case(GRAD_PAIR),
    "Rsqrt": Case(unary(positive=True)),
    "RsqrtGrad": Case(GRAD_PAIR),
    "Tanh": Case(unary()),
    "TanhGrad": Case(GRAD_PAIR),
    "Sigmoid": Case(unary()),
    "SigmoidGrad": Case(GRAD_PAIR),
    "GeLU": Case(unary()),
    "GeLUGrad": Case(GRAD_PAIR),
    "Erf": Case(unary()),
    "BiasAdd": Case(binary((2, 3, 4), (3,))),
    "Cast": Case(unary(dst_type=F32)),
    "Select": Case(_select),
    "Greater": Case(binary()),
    "GreaterEqual": Case(binary()),
    "Less": Case(binary()),
    "Equal": Case(binary()),
    "NotEqual": Case(binary()),
    "LessEqual": Case(binary()),
    "LogicalAnd": Case(binary()),
    "LogicalOr": Case(binary()),
    "SiLU": Case(unary()),
    "SiLUGrad": Case(binary((3, 4), (3, 4))),
    "LogicalNot": Case(unary()),
    "Identity": Case(unary()),
    "FloorDiv": Case(binary(positive=True)),
    "Cos": Case(unary()),
    "Sin": Case(unary()),
    "IsFinite": Case(unary()),
    "Sign": Case(unary()),
    "Trunc": Case(unary()),
    "FloorMod": Case(binary(positive=True)),
    "Atan2": Case(binary()),
    "DivNoNan": Case(binary(positive=True)),
    "MulNoNan": Case(binary()),
    "BitwiseAnd": Case(binary()),
    "BitwiseOr": Case(binary()),
    "BitwiseXor": Case(binary()),
    "AddExt": Case(binary(alpha=2)),
    "SubExt": Case(binary(alpha=2)),
    "Assign": Case(binary()),
    "AssignAdd": Case(binary()),
    "AssignSub": Case(binary()),
    "TopKRouter": Case(lambda d, rng: ([rng.integers(0, 4, (2, 5, 2)).astype(d.np)],
                                       {"capacity": 3, "expert_num": 4, "drop_type": 0})),
    "Swiglu": Case(unary((3, 4), dim=-1)),
    "GroupedMatmul": Case(lambda d, rng: ([values(d, (5, 3), rng), values(d, (3, 3, 2), rng),
                                           np.array([2, 2, 4], np.int64)], {}), terms=3),
    # a region of user code: its body runs, not the node (tests/compiler/test_morph.py)
    "Morph": Case(unary()),
    "GroupedMatmulWeightGrad": Case(lambda d, rng: ([values(d, (5, 3), rng),
                                                     values(d, (5, 2), rng),
                                                     np.array([2, 2, 4], np.int64)], {}),
                                    terms=2),
    "SwigluGrad": Case(binary((3, 2), (3, 4), dim=-1)),
    "RotateHalf": Case(unary((3, 4), mode=1)),
    "RotaryPositionEmbedding": Case(_rope),
    "Depend": Case(binary()),
    "MatMul": Case(binary((3, 4), (4, 2)), terms=4),
    "BatchMatMul": Case(binary((2, 3, 4), (2, 4, 2)), terms=4),
    "Softmax": Case(unary(axis=(-1,)), terms=4),
    "SoftmaxGrad": Case(same_pair(axis=(-1,)), terms=4),
    "LogSoftmax": Case(unary(axis=-1), terms=4),
    "LogSoftmaxGrad": Case(same_pair(axis=-1), terms=4),
    "LayerNorm": Case(_layer_norm, terms=8),
    "LayerNormGrad": Case(_layer_norm_grad, terms=8),
    "FlashAttentionScore": Case(_fa, terms=8),
    "FlashAttentionScoreGrad": Case(_fa_grad, terms=12),
    "RmsNorm": Case(_rms_norm, terms=8),
    "RmsNormGrad": Case(_rms_norm_grad, terms=8),
    "LpNorm": Case(unary((3, 4), axis=(1,), p=3), terms=4),
    "SoftmaxCrossEntropyWithLogits": Case(_sce, terms=5),
    "SoftmaxCrossEntropyWithLogitsGrad": Case(_sce_grad, terms=5),
    "SparseSoftmaxCrossEntropyWithLogits": Case(_sparse_sce, terms=15),
    "Conv2D": Case(_conv, terms=12),
    "Conv2DBackpropInput": Case(_conv_bp_input, terms=16),
    "Conv2DBackpropFilter": Case(_conv_bp_filter, terms=18),
    "MaxPool": Case(unary((1, 2, 4, 4), **_POOL)),
    "MaxPoolGrad": Case(_pool_grad),
    "AvgPool": Case(unary((1, 2, 4, 4), **_POOL), terms=4),
    "AvgPoolGrad": Case(_pool_grad),
    "ReduceSum": Case(unary(axis=(1,), keep_dims=False), terms=4),
    "ReduceMean": Case(unary(axis=(1,), keep_dims=True), terms=4),
    "ReduceMax": Case(unary(axis=(0,), keep_dims=False)),
    "ReduceMin": Case(unary(axis=(1,), keep_dims=True)),
    "BroadcastTo": Case(unary((3, 1), shape=(2, 3, 4))),
    "Tile": Case(unary((3, 1), multiples=(2, 1, 3))),
    "ZerosLike": Case(unary()),
    "OnesLike": Case(unary()),
    "Reshape": Case(unary(shape=(2, 6))),
    "Transpose": Case(unary((2, 3, 4), perm=(2, 0, 1))),
    "ExpandDims": Case(unary(axis=1)),
    "Squeeze": Case(unary((3, 1, 4), axis=(1,))),
    "Flatten": Case(unary((2, 3, 4))),
    "StridedSlice": Case(unary((4, 5), begin=(1, 0), end=(3, 5), strides=(1, 2))),
    "StridedSliceGrad": Case(_strided_slice_grad),
    "Concat": Case(_concat),
    "Split": Case(unary((2, 4), axis=1, output_num=2)),
    "MakeTuple": Case(_make_tuple),
    "TupleGetItem": Case(unary()),  # tuple operand: covered with Split
    "Gather": Case(_gather),
    "GatherGrad": Case(_gather_grad),
    "OneHot": Case(_one_hot),
    "TopK": Case(unary((3, 5), k=2, sorted=True)),
    "Sort": Case(unary((3, 4), axis=0, descending=True)),
    "CumSum": Case(unary((3, 4), axis=1, exclusive=True, reverse=True), terms=4),
    "_VirtualDiv": Case(unary(divisor=2)),
    "_MirrorOperator": Case(unary()),
    "Dropout": Case(_dropout),
    "DropoutMask": Case(_dropout),
    "DropoutGrad": Case(_dropout),
    "DropoutGenMask": Case(_gen_mask),
    "DropoutDoMask": Case(_do_mask),
}


def local_ops() -> list[str]:
    # TestOnly_* ops are registered by other test modules.
    return sorted(name for name, op in all_ops().items()
                  if not op.collective and not name.startswith("TestOnly_"))


def test_every_op_has_a_dtype_case() -> None:
    missing = [name for name in local_ops() if name not in CASES]
    assert not missing, f"add a dtype case for {missing}"


def test_every_op_has_a_doc_record() -> None:
    """Every registered op (collectives included) has the OpDoc record docs/ops.md is
    generated from, and every test it names exists (a renamed test fails here)."""
    from pcompile.tools import ops_doc

    assert ops_doc.problems() == []


def test_doc_record_problems_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed test, a rule the sharding registry does not have, a missing record: each is
    named, and the page is then not generated."""
    import dataclasses

    from pcompile.tools import ops_doc

    add, neg, sqrt_grad = get_op("Add"), get_op("Neg"), get_op("SqrtGrad")
    assert add.page is not None and neg.page is not None
    monkeypatch.setattr(add, "page", dataclasses.replace(
        add.page, tests=("test_ops_elementwise.py::test_binary_renamed",)))
    monkeypatch.setattr(neg, "page", dataclasses.replace(neg.page, rule="no strategy"))
    monkeypatch.setattr(sqrt_grad, "page", None)
    found = "\n".join(ops_doc.problems())
    assert "Add's OpDoc names test_ops_elementwise.py::test_binary_renamed" in found
    assert "Neg: its OpDef has sharding rule" in found
    assert "SqrtGrad has no OpDoc record" in found
    with pytest.raises(ValueError, match="cannot be generated"):
        ops_doc.generated()


def test_collectives_accept_their_documented_dtypes() -> None:
    """Collectives have no numpy/JAX callables (the test below skips them): their shape
    inference accepts every dtype their record names, with the result of that dtype."""
    x_ops = {"AllReduce": {"op": "sum"}, "AllGather": {}, "ReduceScatter": {"op": "sum"},
             "AlltoAll": {}, "Broadcast": {}}
    collectives = sorted(n for n, o in all_ops().items() if o.collective)
    assert set(collectives) == set(x_ops) | {"Send", "Receive"}
    for name in collectives:
        op = get_op(name)
        assert op.page is not None
        for dtype in sorted(op.page.dtypes, key=lambda d: d.value):
            x = TensorType(dtype, (4, 2))
            if name == "Receive":
                attrs = op.full_attrs({"shape": (4, 2), "dtype": dtype})
                got = op.infer_type([], attrs)
            else:
                extra = {"shape": (4, 2), "dtype": dtype} if name == "Send" else x_ops[name]
                got = op.infer_type([x], op.full_attrs(extra))
            assert isinstance(got, TensorType) and got.dtype is dtype, (name, dtype)


def _graph(op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> Graph:
    graph = Graph("dtypes_" + op)
    params = [graph.add_param(GraphParam(TensorType(DType.from_any(a.dtype), a.shape), f"x{i}"))
              for i, a in enumerate(inputs)]
    b = Builder(graph)
    out = b.emit(op, list(params), attrs)
    if isinstance(out.type, TupleType):
        graph.outputs = [b("TupleGetItem", out, index=i) for i in range(len(out.type.elements))]
    else:
        graph.outputs = [out]
    return graph


def tolerance(dtype: np.dtype, terms: int) -> float:
    """Relative difference two correct implementations may show: a few units of the last
    place, growing with the number of accumulated terms (16-bit results are rounded once from
    a float32 computation on both sides)."""
    if dtype.kind != "f" and dtype != ml_dtypes.bfloat16:
        return 0.0
    eps = float(ml_dtypes.finfo(dtype).eps)
    return 2.0 * eps * (1 + terms) if dtype.itemsize < 4 else 4.0 * eps * terms


@pytest.mark.parametrize("op", sorted(CASES))
def test_op_under_every_dtype(op: str) -> None:
    case = CASES[op]
    if op in ("TupleGetItem", "Morph"):
        return
    for dtype in SWEPT:
        inputs, attrs = case.make(dtype, np.random.default_rng(0))
        page = get_op(op).page
        assert page is not None, f"{op} has no doc record"
        if dtype not in page.dtypes:
            with pytest.raises(OpError, match=dtype.value):
                _graph(op, inputs, attrs)
            continue
        graph = _graph(op, inputs, attrs)
        got = run_graph(graph, inputs)
        # jitted, as programs run (eagerly, JAX would compile each primitive on its own)
        lowered = jax.jit(lower_graph(graph))(*[jax.device_put(a) for a in inputs])
        for i, (out, g, j) in enumerate(zip(graph.outputs, got, lowered)):
            want = out.dtype.np
            assert np.asarray(j).dtype == want, f"{op} {dtype.value}: JAX output {i} is " \
                f"{np.asarray(j).dtype}, inferred {want}"
            g64 = np.asarray(g).astype(np.float64)
            j64 = np.asarray(j).astype(np.float64)
            rtol = tolerance(want, case.terms)
            scale = float(np.max(np.abs(g64))) if g64.size else 0.0
            np.testing.assert_allclose(j64, g64, rtol=rtol, atol=rtol * scale,
                                       err_msg=f"{op} {dtype.value} output {i}")


@pytest.mark.parametrize("dtype", SWEPT)
def test_constants_of_every_dtype_print_and_parse(dtype: DType) -> None:
    rng = np.random.default_rng(3)
    graph = Graph("consts")
    x = graph.add_param(GraphParam(TensorType(dtype, (2, 3)), "x"))
    b = Builder(graph)
    const = Constant(values(dtype, (2, 3), rng), dtype)
    splat = Constant(np.full((2, 3), values(dtype, (), rng)), dtype)
    graph.outputs = [b("Select", Constant(np.array([[True, False, True]] * 2), B), x, const),
                     b("Select", Constant(np.array(True), B), splat, x)]
    text = print_graph(graph)
    parsed = parse_graph(text)
    assert print_graph(parsed) == text
    consts = [v for n in parsed.nodes for v in n.operands if isinstance(v, Constant)]
    assert consts[1].dtype is dtype and consts[1].array.dtype == dtype.np
    np.testing.assert_array_equal(consts[1].array.view(np.uint8), const.array.view(np.uint8))
    np.testing.assert_array_equal(consts[3].array.view(np.uint8), splat.array.view(np.uint8))
