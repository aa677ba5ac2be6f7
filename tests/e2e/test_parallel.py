"""The parallel core against the single-device oracle: the seed scenarios, every example in
semi_auto_parallel, and every sharding rule under random strategies and device counts."""

from __future__ import annotations

import os
from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcompile.backends.numpy import run_graph
from pcompile.backends.numpy.simulate import run_ranks
from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam
from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.sharding import OpContext, is_power_of_two, rule_for
from pcompile.ir.types import DType, TensorType, TupleType
from pcompile.passes.autodiff import append_gradients
from pcompile.passes.step_parallel import SplitOptions, build_spmd_graph
from pcompile.passes.step_parallel_begin import assign
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, check
from tests import ROOT

MODELS = os.path.join(ROOT, "tests", "models")


def test_quickstart_seed_rank0_dump(tmp_path) -> None:
    program = compile_model(os.path.join(MODELS, "quickstart_semi.py"), devices=8,
                            out_dir=str(tmp_path / "out"))
    rank0 = program.rank_graph(0)
    fwd = [n for n in rank0.nodes if not n.scope.startswith(("Gradients", "Default/optimizer"))]
    matmul = next(n for n in fwd if n.instance_name == "matmul")
    assert [v.shape for v in matmul.operands] == [(8, 8), (8, 16)]
    after = fwd[fwd.index(matmul) + 1]
    assert after.op == "AllReduce" and after.attrs["rank_list"] == (0, 1, 2, 3)
    assert after.attrs["group"] == "4-6301172352641561019"
    sliced = fwd[fwd.index(matmul) + 2]
    assert sliced.op == "StridedSlice" and sliced.result.shape == (8, 4)
    relu = next(n for n in fwd if n.instance_name == "relu")
    assert relu.operands[0] is sliced.result and relu.result.shape == (8, 4)
    assert rank0.param("w2").shape == (4, 16)
    matmul2 = next(n for n in fwd if n.instance_name == "matmul2")
    assert [v.shape for v in matmul2.operands] == [(8, 4), (4, 16)]
    # rank 5 = coordinate (1, 1): the other row block and group.
    rank5 = program.rank_graph(5)
    ar5 = next(n for n in rank5.nodes if n.op == "AllReduce")
    assert ar5.attrs["rank_list"] == (4, 5, 6, 7)
    text = (tmp_path / "out" / "rank_0" / "01_step_parallel_begin.ir").read_text()
    assert "{in_strategy: ((2, 4), (4, 1))}" in text
    assert check(program, steps=2).ok()


@pytest.mark.parametrize("example", ["quickstart.py", "layout_mlp.py", "dense_gelu_blocks.py",
                                     "gpt_block.py"])
def test_examples_match_single_device(example) -> None:
    # dense_gelu_blocks uses Cell.shard, which the seed allows only with sharding propagation.
    mode = ({"search_mode": "sharding_propagation"} if example == "dense_gelu_blocks.py"
            else {"parallel_mode": "semi_auto_parallel"})
    program = compile_model(os.path.join(ROOT, "examples", example), devices=8, dump=False,
                            **mode)
    report = check(program, steps=1)
    assert report.ok(), (report.losses, report.worst)  # float64: the derived bound


def test_layout_scenario_strategies() -> None:
    program = compile_model(os.path.join(ROOT, "examples", "layout_mlp.py"), devices=8,
                            dump=False)
    rank0 = program.rank_graph(0)
    m1 = next(n for n in rank0.nodes if n.instance_name == "matmul1")
    # x (32, 784): dim 0 on "mp" (2), dim 1 on ("sp", "dp") (4); w (784, 512) rows on (sp, dp).
    assert [v.shape for v in m1.operands] == [(16, 196), (196, 512)]
    m2 = next(n for n in rank0.nodes if n.instance_name == "matmul2")
    assert [v.shape for v in m2.operands] == [(32, 64), (64, 512)]
    reduce = rank0.nodes[rank0.nodes.index(m2) + 1]
    # the partial sums over the 8 ranks; relu2 ((8, 1)) takes each rank's block of rows, so
    # they are reduce-scattered (MindSpore all-reduces, then slices: passes/forward_scatter.py)
    assert reduce.op == "ReduceScatter" and len(reduce.attrs["rank_list"]) == 8
    assert reduce.result.shape == (32 // 8, 512)


def test_shared_parameter_with_different_layouts_fails() -> None:
    with pytest.raises(PcompileError) as info:
        compile_model(os.path.join(ROOT, "examples", "shared_parameter_error.py"), devices=8,
                      dump=False)
    text = str(info.value)
    assert "The parameter: weight1 has multiple users, but the TensorInfo are different" in text
    assert "'mul1'" in text and "'mul2'" in text
    assert "map [1, -1]" in text and "map [-1, 0]" in text or "map" in text


def test_data_parallel_needs_divisible_batch(tmp_path) -> None:
    model = tmp_path / "m.py"
    model.write_text(
        "import numpy as np\nfrom compiler import nn, ops\n"
        "class N(nn.Cell):\n    def __init__(self):\n        super().__init__()\n"
        "        self.relu = ops.ReLU()\n    def construct(self, x):\n"
        "        return self.relu(x)\n"
        "def model():\n    return N()\n"
        "def inputs():\n    return (np.ones((6, 4), np.float32),)\n")
    with pytest.raises(PcompileError, match="not divisible by 8"):
        compile_model(str(model), devices=8, parallel_mode="semi_auto_parallel",
                      overrides={"dataset_strategy": "data_parallel"}, dump=False)


# -- every rule, random strategies ----------------------------------------------------------------


def _case_graph(op: str, arrays: list[np.ndarray], attrs: dict, strategy) -> tuple:
    graph = Graph("case")
    params = []
    for i, arr in enumerate(arrays):
        dtype = DType.from_any(arr.dtype)
        params.append(graph.add_param(GraphParam(TensorType(dtype, arr.shape), f"x{i}", "weight",
                                                 dtype.is_float)))
    b = Builder(graph)
    out = b.emit(op, list(params), attrs, user_attrs={"in_strategy": strategy},
                 instance_name="op")
    if isinstance(out.type, TupleType):
        out = b("TupleGetItem", out, index=0)
    rng = np.random.default_rng(1)
    cot = Constant(rng.standard_normal(out.shape).astype(np.float32), DType.float32)
    val = out if out.dtype == DType.float32 else b("Cast", out, dst_type=DType.float32)
    loss = b("ReduceSum", b("Mul", val, cot), axis=(), keep_dims=False)
    graph.outputs = [loss, out]
    return graph, params


def run_sharded(op: str, arrays: list[np.ndarray], attrs: dict, strategy, devices: int) -> None:
    """Forward output and input gradients of one op under `strategy` equal the unsharded op."""
    graph, params = _case_graph(op, arrays, attrs, strategy)
    ref_graph, ref_params = _case_graph(op, arrays, attrs, strategy)
    wrt = [p for p in ref_params if p.requires_grad]
    ref_graph.outputs = [*ref_graph.outputs,
                         *append_gradients(ref_graph, ref_graph.outputs[0], wrt)]
    # Both sides in float64 (the oracle's mode): the bound is the derived FLOAT64_RTOL.
    want = run_graph(ref_graph, arrays, float64=True)

    assignment = assign(graph, devices, "full_batch")
    local, out_layouts = build_spmd_graph(graph, assignment, SplitOptions(devices, True), {})
    ws = [p for p in local.weights if p.requires_grad]
    local.outputs = [*local.outputs, *append_gradients(local, local.outputs[0], ws)]
    ranks = [local] * devices
    feeds = []
    for r in range(devices):
        feeds.append([arr[tuple(slice(b, e) for b, e in
                                assignment.param_layouts[p.name].slice_bounds(r))]
                      if arr.shape else arr for p, arr in zip(graph.params, arrays)])
    outs = run_ranks(ranks, feeds, float64=True)
    rtol = FLOAT64_RTOL
    scale = lambda w: max(float(np.max(np.abs(w))), 1e-6)  # noqa: E731
    np.testing.assert_allclose(outs[0][0], want[0], rtol=rtol, atol=rtol * scale(want[0]))
    layout = out_layouts[1]
    full = np.zeros(layout.shape, want[1].dtype)
    for r in range(devices):
        full[tuple(slice(b, e) for b, e in layout.slice_bounds(r))] = outs[r][1]
    np.testing.assert_allclose(full, want[1], rtol=rtol, atol=rtol * scale(want[1]))
    for k, p in enumerate(wrt):
        lay = assignment.param_layouts[p.name]
        full = np.zeros(lay.shape, np.float64)
        for r in range(devices):
            full[tuple(slice(b, e) for b, e in lay.slice_bounds(r))] = outs[r][2 + k]
        np.testing.assert_allclose(full, want[2 + k], rtol=rtol, atol=rtol * scale(want[2 + k]),
                                   err_msg=f"gradient of input {k}")


def draw_strategy(draw, op: str, arrays: list[np.ndarray], attrs: dict, devices: int):
    graph, params = _case_graph(op, arrays, attrs, None)
    node = graph.nodes[0]
    rule = rule_for(op)
    ctx = OpContext(op, [p.type for p in params], node.result.type, node.attrs, devices)
    labels = rule.labels(ctx)
    sizes: dict[str, list[int]] = {}
    for lab, arr in zip(labels.inputs, arrays):
        for name, size in zip(lab, arr.shape):
            sizes.setdefault(name, []).append(size)
    remaining = devices
    split: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: draw(st.integers(0, 100))):
        options = [s for s in range(1, remaining + 1)
                   if remaining % s == 0 and all(d % s == 0 for d in sizes[name])
                   and (not is_power_of_two(devices) or is_power_of_two(s))
                   and (s == 1 or name not in labels.unsplittable)]
        split[name] = draw(st.sampled_from(options))
        remaining //= split[name]
    return tuple(tuple(split[n] for n in lab) for lab in labels.inputs)


def rnd(shape, seed=0, positive=False):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return np.abs(x) + 0.5 if positive else x


CASES = {
    "MatMul": lambda t: ([rnd((4, 8) if not t else (8, 4)), rnd((8, 12))],
                         {"transpose_a": bool(t), "transpose_b": False}),
    "MatMulT": lambda t: ([rnd((4, 8)), rnd((12, 8))], {"transpose_b": True}),
    "BatchMatMul": lambda t: ([rnd((4, 2, 4, 6)), rnd((4, 2, 6, 8))], {}),
    "BatchMatMulBroadcast": lambda t: ([rnd((4, 4, 6)), rnd((6, 8))], {}),
    "Add": lambda t: ([rnd((4, 6)), rnd((6,))], {}),
    "Mul": lambda t: ([rnd((4, 1, 6)), rnd((2, 6))], {}),
    "RealDiv": lambda t: ([rnd((4, 6)), rnd((4, 6), 1, True)], {}),
    "ReLU": lambda t: ([rnd((8, 6))], {}),
    "GeLU": lambda t: ([rnd((8, 6))], {}),
    "Exp": lambda t: ([rnd((4, 6))], {}),
    "Softmax": lambda t: ([rnd((4, 8))], {"axis": (-1,)}),
    "LogSoftmax": lambda t: ([rnd((8, 4))], {"axis": 0}),
    "ReduceSum": lambda t: ([rnd((4, 6, 8))], {"axis": (1,), "keep_dims": bool(t)}),
    "ReduceMean": lambda t: ([rnd((4, 6, 8))], {"axis": (0, 2), "keep_dims": bool(t)}),
    "ReduceMax": lambda t: ([rnd((4, 6, 8))], {"axis": (2,), "keep_dims": bool(t)}),
    "Transpose": lambda t: ([rnd((4, 6, 8))], {"perm": (2, 0, 1)}),
    "LayerNorm": lambda t: ([rnd((4, 6, 8)), rnd((8,)), rnd((8,))],
                            {"begin_norm_axis": -1, "begin_params_axis": -1, "epsilon": 1e-5}),
    "BiasAdd": lambda t: ([rnd((4, 6, 2)), rnd((6,))], {}),
    "Gather": lambda t: ([rnd((8, 6)), np.array([[1, 7, 3], [0, 5, 5]], np.int32)], {"axis": 0}),
    "SoftmaxCrossEntropyWithLogits": lambda t: (
        [rnd((8, 6)), np.eye(6, dtype=np.float32)[np.arange(8) % 6]], {}),
    "SparseSoftmaxCrossEntropyWithLogits": lambda t: (
        [rnd((8, 6)), (np.arange(8) % 6).astype(np.int32)], {}),
    "Concat": lambda t: ([rnd((4, 6)), rnd((4, 2))], {"axis": 1}),
    "Split": lambda t: ([rnd((4, 6))], {"axis": 1, "output_num": 3}),
    "StridedSlice": lambda t: ([rnd((8, 6))], {"begin": (0, 1), "end": (8, 5), "strides": (1, 2)}),
    "OneHot": lambda t: ([np.array([1, 0, 3, 2], np.int32)], {"depth": 4}),
    "ExpandDims": lambda t: ([rnd((4, 6))], {"axis": 1}),
    "Squeeze": lambda t: ([rnd((4, 1, 6))], {"axis": (1,)}),
    "Flatten": lambda t: ([rnd((8, 2, 3))], {}),
    "Conv2D": lambda t: ([rnd((4, 4, 5, 5)), rnd((6, 4, 3, 3))],
                         {"out_channel": 6, "kernel_size": (3, 3)}),
    "MaxPool": lambda t: ([rnd((4, 2, 4, 4))], {"kernel_size": (2, 2), "strides": (2, 2)}),
    "AvgPool": lambda t: ([rnd((4, 2, 4, 4))], {"kernel_size": (2, 2), "strides": (2, 2)}),
    "Cast": lambda t: ([rnd((4, 6))], {"dst_type": DType.float32}),
    "Sub": lambda t: ([rnd((4, 6)), rnd((4, 6), 2)], {}),
    "Maximum": lambda t: ([rnd((4, 6)), rnd((4, 6), 2)], {}),
}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data(), st.sampled_from(sorted(CASES)), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]),
       st.integers(0, 1))
def test_every_rule_matches_the_oracle(data, case, devices, variant) -> None:
    arrays, attrs = CASES[case](variant)
    op = {"MatMulT": "MatMul", "BatchMatMulBroadcast": "BatchMatMul"}.get(case, case)
    strategy = draw_strategy(data.draw, op, arrays, attrs, devices)
    if op == "Gather" and strategy[0][0] > 1:
        # A split table axis needs unsplit indices (the masked lookup; see GatherRule).
        strategy = (strategy[0], tuple(1 for _ in strategy[1]))
    run_sharded(op, arrays, attrs, strategy, devices)


def test_gather_on_a_split_table() -> None:
    arrays = [rnd((8, 6)), np.array([[1, 7, 3], [0, 5, 5]], np.int32)]
    run_sharded("Gather", arrays, {"axis": 0}, ((4, 1), (1, 1)), 8)
    run_sharded("Gather", arrays, {"axis": 0}, ((8, 2), (1, 1)), 16)


def test_reduce_scatter_out_strategy() -> None:
    graph, params = _case_graph("MatMul", [rnd((8, 8)), rnd((8, 4))], {}, ((2, 4), (4, 1)))
    node = graph.nodes[0]
    node.attrs["out_strategy"] = ((8, 1),)
    run = assign(graph, 8, "full_batch")
    sharding = run.sharding(node)
    assert [c.kind for c in sharding.forward] == ["ReduceScatter"]
    assert sharding.out_layouts[0].slice_shape == (1, 4)


@pytest.mark.parametrize("op,arrays,attrs,strategy,message", [
    ("MatMul", [rnd((4, 8)), rnd((8, 4))], {}, ((2, 4), (2, 1)), "must be split like"),
    ("Softmax", [rnd((4, 8))], {"axis": (-1,)}, ((1, 2),), "softmax axis"),
    ("ReLU", [rnd((6, 4))], {}, ((4, 1),), "cannot be divisible by strategy value 4"),
    ("ReLU", [rnd((6, 4))], {}, ((3, 1),), "power of 2"),
    ("ReLU", [rnd((16, 4))], {}, ((16, 1),), "requires 16 devices"),
    ("LayerNorm", [rnd((4, 8)), rnd((8,)), rnd((8,))], {"begin_norm_axis": -1,
     "begin_params_axis": -1}, ((1, 2), (2,), (2,)), "normalised dim"),
])
def test_invalid_strategies_name_the_problem(op, arrays, attrs, strategy, message) -> None:
    graph, _ = _case_graph(op, arrays, attrs, strategy)
    with pytest.raises(OpError, match=message):
        assign(graph, 8, "full_batch")


def test_non_power_of_two_devices() -> None:
    run_sharded("MatMul", [rnd((6, 4)), rnd((4, 6))], {}, ((3, 2), (2, 1)), 6)


def test_prod_helper() -> None:
    assert prod(()) == 1


def test_reduce_scatter_plans_match_single_device(tmp_path) -> None:
    program = compile_model(os.path.join(ROOT, "examples", "layout_reduce_scatter.py"),
                            dump=False)
    assert any(n.op == "ReduceScatter" for n in program.rank_graph(0).nodes)
    assert check(program).ok()
    model = tmp_path / "rs.py"
    model.write_text(
        "import numpy as np\nfrom compiler import nn, ops, set_auto_parallel_context\n"
        "set_auto_parallel_context(parallel_mode='semi_auto_parallel', device_num=8,"
        " dataset_strategy='full_batch')\n"
        "class N(nn.Cell):\n    def __init__(self):\n        super().__init__()\n"
        "        self.mm = ops.MatMul().shard(((2, 4), (4, 1)), ((8, 1),))\n"
        "    def construct(self, x, w):\n        return self.mm(x, w)\n"
        "def model():\n    return N()\n"
        "def inputs():\n    r = np.random.default_rng(0)\n"
        "    return (r.standard_normal((16, 32)).astype(np.float32),"
        " r.standard_normal((32, 8)).astype(np.float32))\n")
    program = compile_model(str(model), dump=False)
    assert [n.op for n in program.rank_graph(0).nodes].count("ReduceScatter") == 1
    assert check(program).ok()


def test_traits_agree_with_the_rules() -> None:
    """Ops without a strategy of their own have no sharding rule; the ops the searches treat
    as matrix products, lookups or batch-only ops have one."""
    from pcompile.ir.registry import Trait, all_ops

    for name, opdef in all_ops().items():
        if {Trait.NO_STRATEGY, Trait.FIRST_OPERAND} & opdef.traits:
            assert opdef.sharding is None, name
        if {Trait.MATMUL, Trait.BATCH_ONLY, Trait.LOOKUP} & opdef.traits:
            assert opdef.sharding is not None, name
