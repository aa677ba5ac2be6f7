"""StridedSlice's masks (begin, end, ellipsis, new axis, shrink axis), MindSpore's reading of
them: forward and gradients against numpy/JAX indexing, the sharding rule of masked dims
against the single-device oracle, MindSpore's refusals, and MindSpore's stridedslice unit
tests' networks compiled and trained like one device."""

from __future__ import annotations

import textwrap
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.ops.shape import slice_layout
from pcompile.ir.sharding import OpContext, rule_for
from pcompile.ir.types import DType, TensorType
from pcompile.passes.step_parallel_begin import assign
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests.e2e.test_parallel import draw_strategy, rnd
from tests.ir.test_parallel_ops import case_graph, run_sharded
from tests.op_harness import check_op

MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")


def python_index(attrs: dict[str, Any]) -> tuple[Any, ...]:
    """The numpy index a StridedSlice spells, read from the masks entry by entry (the oracle:
    numpy's and JAX's own indexing)."""
    index: list[Any] = []
    for i, (b, e, s) in enumerate(zip(attrs["begin"], attrs["end"], attrs["strides"])):
        bit = 1 << i
        if attrs.get("ellipsis_mask", 0) & bit:
            index.append(Ellipsis)
        elif attrs.get("new_axis_mask", 0) & bit:
            index.append(None)
        elif attrs.get("shrink_axis_mask", 0) & bit:
            index.append(b)
        else:
            index.append(slice(None if attrs.get("begin_mask", 0) & bit else b,
                               None if attrs.get("end_mask", 0) & bit else e, s))
    return tuple(index)


@st.composite
def masked_case(draw: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    """A shape and begin/end/strides with random masks: at most one ellipsis, shrink indices
    inside their dim, bounds anywhere (clamped), some mask bits past the entries."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=4))
    n = draw(st.integers(1, len(shape) + 2))
    kinds = []
    ellipsis = draw(st.booleans())
    taken = 0
    for _ in range(n):
        options = ["slice", "new"]
        if taken < len(shape):
            options.append("shrink")
        else:
            options = ["new"]
        if ellipsis and "ellipsis" not in kinds:
            options.append("ellipsis")
        kind = draw(st.sampled_from(options))
        if kind in ("slice", "shrink"):
            if taken >= len(shape):
                kind = "new"
            else:
                taken += 1
        kinds.append(kind)
    attrs: dict[str, Any] = {m: 0 for m in MASKS}
    begin, end, strides = [], [], []
    dim = 0
    rest = len(shape) - taken  # the dims an ellipsis stands for
    for i, kind in enumerate(kinds):
        bit = 1 << i
        if kind == "ellipsis":
            dim += rest
            attrs["ellipsis_mask"] |= bit
            begin.append(draw(st.integers(-3, 3)))
            end.append(draw(st.integers(-3, 3)))
            strides.append(1)
        elif kind == "new":
            attrs["new_axis_mask"] |= bit
            if draw(st.booleans()):
                attrs["shrink_axis_mask"] |= bit  # ignored: the new axis wins
            begin.append(draw(st.integers(-3, 3)))
            end.append(draw(st.integers(-3, 3)))
            strides.append(draw(st.integers(1, 2)))
        elif kind == "shrink":
            size = shape[dim]
            attrs["shrink_axis_mask"] |= bit
            begin.append(draw(st.integers(-size, size - 1)))
            end.append(draw(st.integers(-3, 5)))
            strides.append(1)
            dim += 1
        else:
            size = shape[dim]
            begin.append(draw(st.integers(-size - 1, size + 1)))
            end.append(draw(st.integers(-size - 1, size + 1)))
            strides.append(draw(st.sampled_from([-3, -2, -1, 1, 2, 3])))
            for mask in ("begin_mask", "end_mask"):
                if draw(st.booleans()):
                    attrs[mask] |= bit
            dim += 1
    # bits past the entries are ignored
    attrs["new_axis_mask"] |= draw(st.integers(0, 3)) << n
    attrs["shrink_axis_mask"] |= draw(st.integers(0, 3)) << n
    attrs.update(begin=tuple(begin), end=tuple(end), strides=tuple(strides))
    return shape, attrs


@settings(max_examples=30, deadline=None)
@given(masked_case(), st.integers(0, 2**31 - 1))
def test_strided_slice_masks(case: tuple[tuple[int, ...], dict[str, Any]], seed: int) -> None:
    """Forward values (numpy interpreter, JAX lowering) and the gradient equal indexing with
    the numpy index the masks spell."""
    shape, attrs = case
    index = python_index(attrs)
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    assert slice_layout(shape, attrs).out_shape == x[index].shape
    check_op("StridedSlice", [x], attrs, lambda v: v[index])


def test_mindspore_mask_cases_give_mindspore_shapes() -> None:
    """The output shapes MindSpore's test_stridedslice.py asserts (through the strategy of the
    ReLU after the slice) for an input of shape (2, 4, 8, 16)."""
    shape = (2, 4, 8, 16)
    full = {"begin": (0, 0, 0, 0), "end": (2, 4, 8, 16), "strides": (1, 1, 1, 1)}
    cases = [
        (dict(full, new_axis_mask=7), (1, 1, 1, 2, 4, 8, 16)),
        (dict(begin=(0, 0), end=(2, 4), strides=(1, 1), new_axis_mask=7), (1, 1, 2, 4, 8, 16)),
        (dict(begin=(0, 0), end=(2, 4), strides=(1, 1), new_axis_mask=8), (2, 4, 8, 16)),
        (dict(full, begin=(1, 1, 1, 0), new_axis_mask=7), (1, 1, 1, 2, 4, 8, 16)),
        (dict(full, new_axis_mask=20), (2, 4, 1, 8, 16)),
        (dict(full, new_axis_mask=7, shrink_axis_mask=7), (1, 1, 1, 2, 4, 8, 16)),
        (dict(full, shrink_axis_mask=7), (16,)),
        (dict(begin=(1, 1), end=(2, 4), strides=(1, 1), new_axis_mask=6, shrink_axis_mask=1),
         (1, 4, 8, 16)),
        (dict(begin=(1, 1, 3), end=(2, 4, 8), strides=(1, 1, 1), new_axis_mask=2,
              shrink_axis_mask=1, begin_mask=4), (1, 4, 8, 16)),
    ]
    for attrs, want in cases:
        assert slice_layout(shape, attrs).out_shape == want, attrs


@pytest.mark.parametrize("attrs,message", [
    ({"begin": (0, 0), "end": (4, 4), "strides": (1, 1), "shrink_axis_mask": 1,
      "begin_mask": 1} | {"begin": (4, 0)}, r"index begin\[0\]=4 of dim 0.*\[-4, 4\)"),
    ({"begin": (0, 0, 0), "end": (1, 1, 1), "strides": (1, 1, 1), "ellipsis_mask": 5},
     "only one ellipsis"),
    ({"begin": (0, 0, 0), "end": (1, 1, 1), "strides": (1, 1, 1), "new_axis_mask": 2},
     "2 entries that index input dims.*rank 1"),
    ({"begin": (0,), "end": (1,), "strides": (1,), "begin_mask": -1}, "must be >= 0"),
    ({"begin": (1,), "end": (2,), "strides": (-1,), "shrink_axis_mask": 1},
     "the stride cannot be negative"),
])
def test_masked_slice_errors_name_the_problem(attrs: dict[str, Any], message: str) -> None:
    from pcompile.ir.errors import ShapeError

    shape = (4, 4) if len(attrs["begin"]) == 2 else (4,)
    with pytest.raises(ShapeError, match=message):
        slice_layout(shape, attrs)


# -- the sharding rule ---------------------------------------------------------------------------

RULE_CASES = [
    ((8, 4, 6), {"begin": (0, 1), "end": (8, 3), "strides": (1, 1), "begin_mask": 2,
                 "end_mask": 2}),
    ((8, 4, 6), {"begin": (0, 0, 0), "end": (8, 4, 6), "strides": (1, 1, 1),
                 "new_axis_mask": 1}),
    ((4, 8, 2), {"begin": (1, 0, 0), "end": (2, 8, 2), "strides": (1, 1, 1),
                 "shrink_axis_mask": 1}),
    ((4, 8, 2), {"begin": (0, 0, 3), "end": (4, 1, 8), "strides": (1, 1, 1),
                 "new_axis_mask": 2, "shrink_axis_mask": 4, "end_mask": 1}),
    ((8, 6, 4), {"begin": (0, 1, 0), "end": (8, 5, 4), "strides": (1, 2, 1), "begin_mask": 1}),
    ((8, 6, 4), {"begin": (0, 0, 0), "end": (8, 0, 4), "strides": (1, -1, 1), "begin_mask": 2,
                 "end_mask": 2}),
]


@settings(max_examples=20, deadline=None)
@given(data=st.data(), devices=st.sampled_from([1, 2, 4, 8, 6]),
       case=st.sampled_from(range(len(RULE_CASES))))
def test_masked_slice_rule_matches_the_oracle(data: Any, devices: int, case: int) -> None:
    """Strategies the rule allows (whole dims split, masked ones whole), run sharded: every
    output and the input's gradient equal the unsharded op's (float64)."""
    shape, attrs = RULE_CASES[case]
    attrs = {m: 0 for m in MASKS} | attrs
    arrays = [rnd(shape)]
    strategy = draw_strategy(data.draw, "StridedSlice", arrays, attrs, devices)
    run_sharded("StridedSlice", arrays, attrs, strategy, devices)


def test_masked_dims_follow_mindspore_splits() -> None:
    """Which dims may split: a masked begin/end counts as the dim's start/end (fetched whole);
    a new axis maps to no device axis; a shrunk dim leaves the output map."""
    x = TensorType(DType.float32, (2, 4, 8, 16))
    attrs = {m: 0 for m in MASKS} | {"begin": (1, 1, 3), "end": (2, 4, 8),
                                      "strides": (1, 1, 1), "new_axis_mask": 2,
                                      "shrink_axis_mask": 1, "begin_mask": 4}
    out = TensorType(DType.float32, (1, 4, 8, 16))
    sharding = rule_for("StridedSlice").apply(OpContext("StridedSlice", [x], out, attrs, 512),
                                              ((1, 4, 8, 16),))
    assert sharding.dev_matrix == (1, 4, 8, 16)  # the strategy, as MindSpore
    assert sharding.in_layouts[0].tensor_map == (-1, 2, 1, 0)
    assert sharding.out_layouts[0].tensor_map == (-1, 2, 1, 0)
    assert sharding.out_layouts[0].slice_shape == (1, 1, 1, 1)


@pytest.mark.parametrize("shape,attrs,strategy,message", [
    # MindSpore's test_stridedslice_shrink_axis_and_split
    ((256, 64, 32), {"begin": (0, 0, 0), "end": (256, 64, 32), "strides": (1, 1, 1),
                     "shrink_axis_mask": 1}, ((2, 4, 1),), "dim 0.*shrunk"),
    # test_stridedslice_new_axis_mask_no_0_output: dim 0 is fetched [0:64] of 128
    ((128, 64, 1), {"begin": (0, 0, 0), "end": (64, 64, 1), "strides": (1, 1, 1),
                    "new_axis_mask": 1}, ((8, 1, 1),), r"dim 0.*not fully fetched \(\[0:64\]"),
    # test_stridedslice_strides_no_1_split_error
    ((256, 64, 32), {"begin": (0, 0, 0), "end": (128, 64, 32), "strides": (1, 1, 2)},
     ((1, 2, 2),), "dim 2.*stride is 2"),
    # a reversed dim, fetched whole: MindSpore splits only stride 1
    ((256, 64, 32), {"begin": (0, 0, 0), "end": (256, 64, 32), "strides": (1, -1, 1),
                     "begin_mask": 2, "end_mask": 2}, ((1, 2, 1),), "dim 1.*stride is -1"),
    # test_stridedslice_ellipsis_mask_no_0_parameter
    ((256, 64, 32), {"begin": (127, 0, 0), "end": (128, 64, 32), "strides": (1, 1, 1),
                     "begin_mask": 1, "end_mask": 2, "ellipsis_mask": 4}, ((1, 4, 2),),
     "ellipsis_mask=4 is not supported in a parallel plan"),
])
def test_mindspore_refusals(shape: tuple[int, ...], attrs: dict[str, Any], strategy: Any,
                            message: str) -> None:
    graph, _ = case_graph("StridedSlice", [np.zeros(shape, np.float32)],
                          {m: 0 for m in MASKS} | attrs, strategy)
    with pytest.raises(OpError, match=message):
        assign(graph, 8, "full_batch")


# -- MindSpore's networks, trained on 8 ranks like one device --------------------------------

NET = """
import numpy as np
from pcompile import nn, ops, Parameter, Tensor, initializer, set_seed, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="{mode}", device_num=8,
                          dataset_strategy="full_batch"{search})


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(5)
        {w1}
        self.w2 = Parameter(initializer("normal", {w2}), "w2")
        self.mul = ops.Mul(){shard1}
        self.strided_slice = ops.StridedSlice({masks}){shard2}
        self.mul2 = ops.Mul()

    def construct(self, x):
        {body}


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal({x}).astype(np.float32),)


def labels():
    return (np.ones({out}, np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""

_ON_PARAMETER = ("out = self.strided_slice(self.w1, {begin}, {end}, {strides})\n"
                 "        out = self.mul(x, out)\n"
                 "        return self.mul2(out, self.w2)")
_ON_OUTPUT = ("out = self.mul(x, self.w2)\n"
              "        return self.strided_slice(out, {begin}, {end}, {strides})")

# (MindSpore test, body, w1, w2, x, out, begin, end, strides, masks, shard1, shard2, mode)
NETS = {
    "begin_end_mask_parameter": (
        _ON_PARAMETER, (16, 8, 4), (8, 8, 1), (8, 8, 1), (8, 8, 4), (15, 0, 0), (8, 7, 4),
        (1, 1, 1), "begin_mask=1, end_mask=2", ((1, 4, 1), (1, 4, 2)), ((1, 4, 2),), "semi"),
    "new_axis_mask_parameter": (
        _ON_PARAMETER, (16, 8, 4), (1, 8, 4, 4), (1, 8, 4, 4), (1, 8, 4, 4), (0, 0, 0),
        (1, 8, 4), (1, 1, 1), "new_axis_mask=1", ((1, 4, 2, 1), (1, 4, 2, 1)), ((1, 1, 4),),
        "semi"),
    "shrink_axis_mask_parameter": (
        _ON_PARAMETER, (16, 8, 4), (8, 4), (8, 4), (8, 4), (0, 0, 0), (16, 8, 4), (1, 1, 1),
        "shrink_axis_mask=1", ((1, 2), (1, 2)), ((1, 4, 1),), "semi"),
    # test_stridedslice_begin_mask_no_0_tensor: the sliced operand a constant tensor
    "begin_mask_tensor": (
        _ON_PARAMETER, ("tensor", (16, 8, 4)), (8, 8, 1), (8, 8, 1), (8, 8, 4), (15, 0, 0),
        (8, 8, 4), (1, 1, 1), "begin_mask=1", ((1, 4, 1), (1, 4, 2)), ((1, 4, 2),), "semi"),
    "shrink_axis_mask_output": (
        _ON_OUTPUT, None, (16, 8, 1), (16, 8, 1), (8, 1), (0, 0, 0), (8, 8, 1), (1, 1, 1),
        "shrink_axis_mask=1", ((1, 8, 1), (1, 8, 1)), ((1, 8, 1),), "semi"),
    "begin_mask_auto_parallel": (
        _ON_OUTPUT, None, (16, 8, 1), (16, 8, 1), (4, 8, 1), (13, 0, 0), (4, 8, 1),
        (1, 1, 1), "begin_mask=1, end_mask=4", None, None, "auto"),
}


def _w1_line(w1: Any) -> str:
    """The sliced operand: a Parameter of shape `w1`, a constant tensor for ("tensor", shape),
    none for None."""
    if w1 is None:
        return ""
    if w1[0] == "tensor":
        return ("self.w1 = Tensor(np.random.default_rng(1).standard_normal("
                f"{w1[1]}).astype(np.float32))")
    return f'self.w1 = Parameter(initializer("normal", {list(w1)}), "w1")'


def _write(tmp_path: Any, name: str) -> str:
    (body, w1, w2, x, out, begin, end, strides, masks, shard1, shard2, mode) = NETS[name]
    text = NET.format(
        mode="semi_auto_parallel" if mode == "semi" else "auto_parallel",
        search="" if mode == "semi" else ", search_mode='sharding_propagation'",
        w1=_w1_line(w1),
        w2=list(w2), x=x, out=out, masks=masks,
        shard1=f".shard({shard1})" if shard1 else "",
        shard2=f".shard({shard2})" if shard2 else "",
        body=body.format(begin=begin, end=end, strides=strides))
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("name", sorted(NETS))
def test_masked_slice_networks_train_like_one_device(tmp_path: Any, name: str) -> None:
    """MindSpore's stridedslice networks with masks (on a parameter, on an op's output, in
    auto_parallel), scaled down: the plan compiles, the slice keeps its strategy, and two
    training steps on 8 simulated ranks give the single-device loss, gradients and parameters
    (float64)."""
    program = compile_model(_write(tmp_path, name), dump=False)
    (node,) = program.graph.find("StridedSlice")
    sharding = program.state.assignment.sharding(node)
    assert sharding is not None
    shard2 = NETS[name][-2]
    if shard2 is not None:
        assert sharding.strategy == shard2
    report = check(program, steps=2)
    assert report.ok(), report.errors


def test_masked_slice_split_that_mindspore_refuses_is_refused(tmp_path: Any) -> None:
    """test_stridedslice_shrink_axis_and_split: the shrunk dim split 2 ways."""
    path = _write(tmp_path, "shrink_axis_mask_parameter").replace(
        "shrink_axis_mask_parameter", "shrink_split")
    text = open(_write(tmp_path, "shrink_axis_mask_parameter")).read()
    text = text.replace(".shard(((1, 4, 1),))", ".shard(((2, 4, 1),))")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    with pytest.raises(PcompileError, match=r"(?s)StridedSlice.*dim 0.*shrunk"):
        compile_model(path, dump=False)


def test_masked_slice_shrinks_with_its_input() -> None:
    """The shrunk check's dimension relations: a dim taken whole shrinks with the input, a
    sliced one keeps its margins, a shrunk one keeps its size; the rewritten attributes (one
    entry per dim and new axis, masks recomputed) give the shrunk shapes and the verifier
    accepts the graph."""
    from pcompile.ir import dims
    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.verifier import verify

    g = Graph("slice")
    x = g.add_param(GraphParam(TensorType(DType.float32, (16, 3, 32, 8)), "x"))
    b = Builder(g)
    attrs = {m: 0 for m in MASKS} | {"begin": (0, 1, 0, 4), "end": (0, 2, 0, 8),
                                      "strides": (1, 1, 1, 1), "begin_mask": 1, "end_mask": 1,
                                      "new_axis_mask": 4, "shrink_axis_mask": 2}
    out = b("StridedSlice", x, **attrs)
    assert out.shape == (16, 1, 4, 8)  # x[:, 1, None, 4:8]
    g.outputs = [out]
    verify(g)
    dims.shrink_graph(g, [], 4).apply(g)
    verify(g)
    (node,) = g.find("StridedSlice")
    new_x = node.operands[0].shape
    assert new_x[0] < 16 and new_x[1] == 3  # a whole dim shrinks, the shrunk one stays
    assert out.shape[0] == new_x[0] and new_x[2] - out.shape[2] == 28  # margins kept
    index = python_index(node.attrs)
    assert np.zeros(new_x)[index].shape == out.shape


NET3 = """
import numpy as np
from pcompile import nn, ops, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="auto_parallel", device_num={devices},
                          search_mode="sharding_propagation", dataset_strategy="full_batch")


class Net3(nn.Cell):
    def __init__(self):
        super().__init__()
        self.strided_slice = ops.StridedSlice({masks}).shard({strategy})
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.relu(self.strided_slice(x, {begin}, {end}, {strides}))


def model():
    return Net3()


def inputs():
    return (np.ones((2, 4, 8, 16), np.float32),)
"""

# MindSpore's test_stridedslice.py auto_parallel cases on x (2, 4, 8, 16): (begin, end, strides,
# the slice's strategy, masks, devices) and the ReLU strategy its test asserts.
NET3_CASES = {
    "new_axis_mask": ((0, 0, 0, 0), (2, 4, 8, 16), (1, 1, 1, 1), ((2, 4, 8, 16),),
                      "new_axis_mask=7", 1024, (1, 1, 1, 2, 4, 8, 16)),
    "new_axis_mask_exceed_begin_len": ((0, 0), (2, 4), (1, 1), ((2, 4, 8, 16),),
                                       "new_axis_mask=7", 1024, (1, 1, 2, 4, 8, 16)),
    "new_axis_mask_exceed_begin_len1": ((0, 0), (2, 4), (1, 1), ((2, 4, 8, 16),),
                                        "new_axis_mask=8", 1024, (2, 4, 8, 16)),
    "new_axis_mask_no_fully_fetch": ((1, 1, 1, 0), (2, 4, 8, 16), (1, 1, 1, 1),
                                     ((2, 4, 8, 16),), "new_axis_mask=7", 1024,
                                     (1, 1, 1, 2, 4, 8, 16)),
    "new_axis_mask_out_of_range": ((0, 0, 0, 0), (2, 4, 8, 16), (1, 1, 1, 1), ((2, 4, 8, 16),),
                                   "new_axis_mask=20", 1024, (2, 4, 1, 8, 16)),
    "new_axis_mask_ignore_shrink_axis_mask": (
        (0, 0, 0, 0), (2, 4, 8, 16), (1, 1, 1, 1), ((2, 4, 8, 16),),
        "new_axis_mask=7, shrink_axis_mask=7", 1024, (1, 1, 1, 2, 4, 8, 16)),
    "shrink_axis_mask": ((0, 0, 0, 0), (2, 4, 8, 16), (1, 1, 1, 1), ((1, 1, 1, 16),),
                         "shrink_axis_mask=7", 16, (16,)),
    "new_axis_mask_and_shrink_axis_mask": ((1, 1), (2, 4), (1, 1), ((1, 4, 8, 16),),
                                           "new_axis_mask=6, shrink_axis_mask=1", 512,
                                           (1, 4, 8, 16)),
    "new_axis_mask_and_shrink_axis_mask_and_begin_mask": (
        (1, 1, 3), (2, 4, 8), (1, 1, 1), ((1, 4, 8, 16),),
        "new_axis_mask=2, shrink_axis_mask=1, begin_mask=4", 512, (1, 4, 8, 16)),
}


@pytest.mark.parametrize("name", sorted(NET3_CASES))
def test_mindspore_auto_parallel_mask_cases_give_its_relu_strategies(tmp_path: Any,
                                                                      name: str) -> None:
    """Sharding propagation carries the masked slice's output layout to the ReLU after it:
    the strategy MindSpore's test asserts (new axes 1, shrunk dims gone, the rest split)."""
    begin, end, strides, strategy, masks, devices, want = NET3_CASES[name]
    path = tmp_path / "net3.py"
    path.write_text(NET3.format(devices=devices, masks=masks, strategy=strategy, begin=begin,
                                end=end, strides=strides))
    program = compile_model(str(path), dump=False)
    (relu,) = program.graph.find("ReLU")
    sharding = program.state.assignment.sharding(relu)
    assert sharding is not None and sharding.strategy == (want,)


LAYOUT_NET = """
import numpy as np
from pcompile import nn, ops, Layout, Parameter, initializer, set_seed, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                          dataset_strategy="full_batch")
layout = Layout((2, 4), ("dp", "mp"))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(5)
        self.w = Parameter(initializer("normal", [8, 16, 4]), "w")
        self.strided_slice = ops.StridedSlice({masks}).shard((layout({slice_map}),))
        self.mul = ops.Mul()

    def construct(self, x):
        return self.mul(x, self.strided_slice(self.w, {begin}, {end}, (1, 1, 1)))


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal({x}).astype(np.float32),)


def labels():
    return (np.ones({x}, np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""


@pytest.mark.parametrize("masks,slice_map,begin,end,x,message", [
    # a Layout splitting the dims a begin_mask and end_mask fetch whole: trains like one device
    ("begin_mask=3, end_mask=3", '"dp", "mp", "None"', (5, 3, 0), (2, 9, 4), (8, 16, 4), None),
    # x[3] with the shrunk dim split by the Layout: MindSpore's refusal, with the reason
    ("shrink_axis_mask=1", '"dp", "mp", "None"', (3, 0, 0), (8, 16, 4), (16, 4),
     "dim 0.*shrunk"),
    ("begin_mask=1, ellipsis_mask=2", '"dp", "None", "None"', (0, 0, 0), (8, 16, 4),
     (8, 16, 4), "ellipsis_mask=2 is not supported in a parallel plan"),
])
def test_masked_slice_with_a_layout(tmp_path: Any, masks: str, slice_map: str,
                                    begin: tuple[int, ...], end: tuple[int, ...],
                                    x: tuple[int, ...], message: str | None) -> None:
    """An input Layout gets stridedslice_info's checks and reasons too."""
    path = tmp_path / "layout_net.py"
    path.write_text(LAYOUT_NET.format(masks=masks, slice_map=slice_map, begin=begin, end=end,
                                      x=x))
    if message is not None:
        with pytest.raises(PcompileError, match=f"(?s)StridedSlice.*{message}"):
            compile_model(str(path), dump=False)
        return
    program = compile_model(str(path), dump=False)
    (node,) = program.graph.find("StridedSlice")
    sharding = program.state.assignment.sharding(node)
    assert sharding is not None and sharding.in_layouts[0].splits == (2, 4, 1)
    report = check(program, steps=2)
    assert report.ok(), report.errors
