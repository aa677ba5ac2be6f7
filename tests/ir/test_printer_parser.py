"""Printer/parser round trips: `parse(print(g))` is structurally equal to `g`, and
`print(parse(text)) == text` for everything the printer writes; plus a golden text, the value
grammar, and parse-error messages with line:column."""

from __future__ import annotations

import re
from typing import Any

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Node, ParallelInfo, SourceLoc, Value
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.parallel_info import LayoutDetail, RunnerUp, SearchCost, SwcCost
from pcompile.ir.parser import ParseError, parse_graph
from pcompile.ir.printer import format_parallel, format_value, print_graph, sanitize_hint
from pcompile.ir.registry import OpDef, get_op, register
from pcompile.ir.types import DType, TensorType, TupleType, ValueType
from pcompile.ir.verifier import verify

# -- test-only ops (tuple results, attributes of every kind, no operands) ---------------------


def _infer_split(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    t = types[0]
    if not isinstance(t, TensorType) or not t.shape:
        raise ShapeError("needs a tensor of rank >= 1")
    axis, num = attrs["axis"], attrs["output_num"]
    if t.shape[axis] % num:
        raise ShapeError(f"dimension {t.shape[axis]} is not divisible by {num}")
    shape = list(t.shape)
    shape[axis] //= num
    return TupleType(tuple(TensorType(t.dtype, tuple(shape)) for _ in range(num)))


def _infer_getitem(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    t = types[0]
    if not isinstance(t, TupleType):
        raise ShapeError("needs a tuple")
    return t.elements[int(attrs["index"])]


def _infer_any(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    return types[0]


def _infer_source(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    return TensorType(attrs["dtype"], attrs["shape"])


ANY_ATTRS: dict[str, Any] = {
    "flag": False,
    "count": 0,
    "scale": 1.0,
    "label": "sum",
    "dims": (),
    "dtype": DType.float32,
    "extra": None,
}

TEST_OPS = [
    OpDef("TestOnly_Split", _infer_split, attrs={"axis": 0, "output_num": 2}, num_inputs=1),
    OpDef("TestOnly_GetItem", _infer_getitem, attrs={"index": 0}, num_inputs=1),
    OpDef("TestOnly_Any", _infer_any, attrs=dict(ANY_ATTRS), num_inputs=(1, 4)),
    OpDef(
        "TestOnly_Source",
        _infer_source,
        attrs={"shape": (2,), "dtype": DType.float32},
        num_inputs=0,
    ),
]


def ensure_test_ops() -> None:
    """Register the test-only ops once per process (register() rejects duplicates)."""
    for opdef in TEST_OPS:
        try:
            get_op(opdef.name)
        except KeyError:
            register(opdef)


ensure_test_ops()

# -- structural equality ----------------------------------------------------------------------


def same_value(a: Any, b: Any) -> bool:
    """Type-strict deep equality; floats compare by repr (so nan == nan, -0.0 != 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    return bool(a == b)


def same_constant(a: Constant, b: Constant) -> bool:
    """Same type and elements, bit for bit except that all NaNs are alike."""
    if a.type != b.type or a.array.dtype != b.array.dtype or a.array.shape != b.array.shape:
        return False
    if not a.tensor_type.dtype.is_float:
        return a.array.tobytes() == b.array.tobytes()
    x, y = a.array.astype(np.float64), b.array.astype(np.float64)
    nan = np.isnan(x)
    same_bits = x.view(np.uint64) == y.view(np.uint64)
    return bool(np.array_equal(nan, np.isnan(y)) and np.all(same_bits | nan))


def assert_same_graph(a: Graph, b: Graph) -> None:
    """`b` (parsed) has the structure of `a` (built); hints compare after sanitizing."""
    assert a.name == b.name
    assert same_value(a.attrs, b.attrs), (a.attrs, b.attrs)
    assert len(a.params) == len(b.params)
    ids: dict[int, int] = {}
    for pa, pb in zip(a.params, b.params):
        assert (pa.name, pa.kind, pa.requires_grad, pa.type) == (
            pb.name,
            pb.kind,
            pb.requires_grad,
            pb.type,
        )
        ids[id(pa)] = id(pb)
    assert len(a.nodes) == len(b.nodes)

    def same_operand(x: Value, y: Value) -> bool:
        if isinstance(x, Constant):
            return isinstance(y, Constant) and same_constant(x, y)
        return ids.get(id(x)) == id(y)

    for na, nb in zip(a.nodes, b.nodes):
        assert na.op == nb.op
        assert len(na.operands) == len(nb.operands)
        assert all(same_operand(x, y) for x, y in zip(na.operands, nb.operands))
        assert same_value(na.attrs, nb.attrs), (na.attrs, nb.attrs)
        assert na.result.type == nb.result.type
        assert sanitize_hint(na.result.name_hint) == nb.result.name_hint
        assert (na.instance_name, na.scope, na.source) == (nb.instance_name, nb.scope, nb.source)
        assert na.fullname == nb.fullname
        assert (na.parallel is None) == (nb.parallel is None)
        if na.parallel is not None and nb.parallel is not None:
            assert same_value(na.parallel.items(), nb.parallel.items())
        ids[id(na.result)] = id(nb.result)
    assert len(a.outputs) == len(b.outputs)
    assert all(same_operand(x, y) for x, y in zip(a.outputs, b.outputs))


def round_trip(graph: Graph) -> Graph:
    text = print_graph(graph)
    parsed = parse_graph(text, "rt.ir")
    assert_same_graph(graph, parsed)
    assert print_graph(parsed) == text
    verify(parsed, allow_extra_attrs=True)
    return parsed


# -- golden -----------------------------------------------------------------------------------

GOLDEN = """\
# IR entry: @1_net.construct
# Total subgraphs: 1

# Attrs:
training: true
step: 3
lr: 0.001
tag: "4-6301172352641561019"

# Total params: 3
# Params:
%para1_x: <Tensor[Float32], (4, 8)>
%para2_w: <Ref[Tensor[Float32]], (4, 8), ref_key=w, is_parameter>  :  has_default
%para3_moments.w: <Ref[Tensor[Float32]], (4, 8), ref_key=moments.w, is_state>  :  has_default

Node counting information:
Total number of nodes: 9
Total number of cnodes: 6

subgraph @1_net.construct() {
  %0(out) = Mul(%para1_x, %para2_w) {instance name: mul} primitive_attrs: {} {in_strategy: ((2, 4), (2, 4)), out_strategy: ((2, 4)), reason: "a b"}
      : (<Tensor[Float32], (4, 8)>, <Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], (4, 8)>)
      # scope: (Default/network-WithLossCell/_backbone-Net)
      # In file examples/quickstart.py:17/        out = self.mul(x, self.w)/
  %1(CNode) = Mul(%0, Tensor(shape=[], dtype=Float32, value=0.5)) {instance name: Mul-op1} primitive_attrs: {}
      : (<Tensor[Float32], (4, 8)>, <Tensor[Float32], ()>) -> (<Tensor[Float32], (4, 8)>)
      # scope: (Default)
  %2(y) = ReLU(%1) primitive_attrs: {}
      : (<Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], (4, 8)>)
      # scope: (Default)
  %3(CNode) = Add(%2, Tensor(shape=[1, 8], dtype=Float32, value=[[0.0, 1.0, -2.5, 0.10000000149011612, inf, -inf, nan, -0.0]])) primitive_attrs: {}
      : (<Tensor[Float32], (4, 8)>, <Tensor[Float32], (1, 8)>) -> (<Tensor[Float32], (4, 8)>)
      # scope: (Default)
  %4(parts) = TestOnly_Split(%3) primitive_attrs: {axis: 1, output_num: 2}
      : (<Tensor[Float32], (4, 8)>) -> (<Tuple[Tensor[Float32]*2], TupleShape((4, 4), (4, 4))>)
      # scope: (Default)
  Return(%2, %4, %para3_moments.w)
      : (<Tensor[Float32], (4, 8)>, <Tuple[Tensor[Float32]*2], TupleShape((4, 4), (4, 4))>, <Tensor[Float32], (4, 8)>)
      # scope: (Default)
}
"""  # noqa: E501  (IR lines are long)


def golden_graph() -> Graph:
    g = Graph("1_net.construct")
    g.attrs.update(training=True, step=3, lr=0.001, tag="4-6301172352641561019")
    f32 = DType.float32
    x = g.add_param(GraphParam(TensorType(f32, (4, 8)), "x"))
    w = g.add_param(GraphParam(TensorType(f32, (4, 8)), "w", "weight", requires_grad=True))
    m = g.add_param(GraphParam(TensorType(f32, (4, 8)), "moments.w", "state"))
    b = Builder(g)
    out = b.emit(
        "Mul",
        [x, w],
        instance_name="mul",
        scope="Default/network-WithLossCell/_backbone-Net",
        source=SourceLoc("examples/quickstart.py", 17, "        out = self.mul(x, self.w)"),
        name_hint="out",
        parallel=ParallelInfo(((2, 4), (2, 4)), ((2, 4),), reason="a b"),
    )
    scaled = b.emit("Mul", [out, b.const(0.5)], instance_name="Mul-op1")
    y = b.emit("ReLU", [scaled], name_hint="y")
    row = np.array([[0.0, 1.0, -2.5, 0.1, np.inf, -np.inf, np.nan, -0.0]], np.float32)
    shifted = b.emit("Add", [y, Constant(row, f32)])
    parts = b.emit("TestOnly_Split", [shifted], {"axis": 1}, name_hint="parts")
    g.outputs = [y, parts, m]
    return g


def test_golden_text() -> None:
    g = golden_graph()
    assert print_graph(g) == GOLDEN
    parsed = parse_graph(GOLDEN)
    assert_same_graph(g, parsed)
    assert print_graph(parsed) == GOLDEN
    const = parsed.nodes[3].operands[1]
    assert isinstance(const, Constant)
    assert const.array.dtype == np.float32 and const.array.shape == (1, 8)
    assert np.float32(0.1) == const.array[0, 3]
    assert np.signbit(const.array[0, 7]) and np.isnan(const.array[0, 6])
    assert [n.fullname for n in parsed.nodes] == [
        "Default/network-WithLossCell/_backbone-Net/Mul-op0",
        "Default/Mul-op1",
        "Default/ReLU-op0",
        "Default/Add-op0",
        "Default/TestOnly_Split-op0",
    ]


def test_print_is_deterministic() -> None:
    assert print_graph(golden_graph()) == print_graph(golden_graph())


def test_empty_graph() -> None:
    g = Graph("empty")
    text = print_graph(g)
    assert text == (
        "# IR entry: @empty\n# Total subgraphs: 1\n\n# Attrs:\n\n# Total params: 0\n# Params:\n\n"
        "Node counting information:\nTotal number of nodes: 1\nTotal number of cnodes: 1\n\n"
        "subgraph @empty() {\n  Return()\n      : ()\n      # scope: (Default)\n}\n"
    )
    round_trip(g)


def test_param_flags_and_quoted_names() -> None:
    g = Graph("odd name")
    t = TensorType(DType.bfloat16, (3,))
    g.add_param(GraphParam(t, "in.put-1", "input", requires_grad=True))
    g.add_param(GraphParam(t, "w frozen", "weight", requires_grad=False))
    g.add_param(GraphParam(t, "s", "state", requires_grad=True))
    g.outputs = list(g.params)
    text = print_graph(g)
    assert "%para1_in.put-1: <Tensor[BFloat16], (3,)>  :  requires_grad\n" in text
    assert (
        '%para2_"w frozen": <Ref[Tensor[BFloat16]], (3,), ref_key="w frozen", is_parameter, '
        "no_grad>  :  has_default\n"
    ) in text
    assert "ref_key=s, is_state, requires_grad>  :  has_default\n" in text
    assert 'subgraph @"odd name"() {' in text
    round_trip(g)


def test_constants_of_every_dtype() -> None:
    g = Graph("consts")
    b = Builder(g)
    arrays: list[tuple[np.ndarray, DType, str]] = [
        (np.array(7, np.int32), DType.int32, "value=7"),
        (np.array([1, -2, 2**40], np.int64), DType.int64, "value=[1, -2, 1099511627776]"),
        (np.array([[True, False]]), DType.bool_, "value=[[true, false]]"),
        (np.full((2, 3), True), DType.bool_, "shape=[2, 3], dtype=Bool, value=true"),
        (np.full((2,), 0.1, np.float16), DType.float16, "value=0.0999755859375"),
        (np.zeros((2, 0)), DType.float32, "shape=[2, 0], dtype=Float32, value=[[], []]"),
        (np.array([0.1, 3.0]), DType.bfloat16, "value=[0.10009765625, 3.0]"),
        (np.array([0.0, -0.0]), DType.float32, "value=[0.0, -0.0]"),
        (np.full((2,), np.nan), DType.float32, "value=nan"),
    ]
    outputs: list[Value] = []
    for array, dtype, _ in arrays:
        const = Constant(array, dtype)
        outputs.append(b.emit("TestOnly_Any", [const]))
    g.outputs = outputs + [Constant(np.array(2.5), DType.float32)]
    text = print_graph(g)
    for _, _, snippet in arrays:
        assert snippet in text
    assert "Return(%0, %1, %2, %3, %4, %5, %6, %7, %8, Tensor(shape=[], dtype=Float32" in text
    round_trip(g)


def test_name_hints_are_sanitized() -> None:
    g = Graph("g")
    x = g.add_param(GraphParam(TensorType(DType.float32, (2,)), "x"))
    Builder(g).emit("ReLU", [x], name_hint="equiv[CNode]472")
    Builder(g).emit("ReLU", [x], name_hint="a b/c")
    g.outputs = [g.nodes[1].result]
    text = print_graph(g)
    assert "%0(equiv[CNode]472) = ReLU" in text and "%1(a_b_c) = ReLU" in text
    round_trip(g)


def test_source_and_scope_escapes() -> None:
    g = Graph("g")
    x = g.add_param(GraphParam(TensorType(DType.float32, (2,)), "x"))
    b = Builder(g)
    b.emit("ReLU", [x], scope='"quoted"', source=SourceLoc("C:\\m.py", 3, "a/b/"))
    b.emit("ReLU", [x], scope="a\nb", source=SourceLoc("m.py", 4, "x\ny"))
    b.emit("ReLU", [x], scope="", source=SourceLoc("", 0, ""))
    g.outputs = [g.nodes[2].result]
    text = print_graph(g)
    assert '# scope: ("\\"quoted\\"")\n      # In file "C:\\\\m.py":3/a/b//\n' in text
    assert '# scope: ("a\\nb")\n      # In file m.py:4 "x\\ny"\n' in text
    assert "# scope: ()\n      # In file :0//\n" in text
    round_trip(g)


# -- the value grammar ------------------------------------------------------------------------

VALUE_CASES: list[tuple[Any, str]] = [
    (True, "true"),
    (False, "false"),
    (None, "None"),
    (12, "12"),
    (-3, "-3"),
    (1.0, "1.0"),
    (1e-05, "1e-05"),
    (1.5e300, "1.5e+300"),
    (float("inf"), "inf"),
    (float("-inf"), "-inf"),
    ("sum", "sum"),
    ("Default/net-Net.x", "Default/net-Net.x"),
    ("4-6301172352641561019", '"4-6301172352641561019"'),
    ("a b", '"a b"'),
    ("true", '"true"'),
    ("None", '"None"'),
    ("nan", '"nan"'),
    ("Float32", '"Float32"'),
    ("", '""'),
    (DType.float32, "Float32"),
    (DType.bool_, "Bool"),
    ((), "()"),
    ((1,), "(1,)"),
    (((2, 4), (4, 1)), "((2, 4), (4, 1))"),
    ([1, (2,)], "[1, (2,)]"),
    ({"dev_matrix": (2, 4), "tensor_map": (1, -1)}, "{dev_matrix: (2, 4), tensor_map: (1, -1)}"),
    ({}, "{}"),
]


@pytest.mark.parametrize(("value", "text"), VALUE_CASES)
def test_value_grammar(value: Any, text: str) -> None:
    assert format_value(value) == text
    g = Graph("g")
    g.attrs["v"] = value
    assert same_value(parse_graph(print_graph(g)).attrs["v"], value)


def test_unprintable_attr_value() -> None:
    g = Graph("g")
    g.attrs["v"] = object()
    with pytest.raises(TypeError, match="cannot print attribute value"):
        print_graph(g)
    g.attrs = {1: 2}
    with pytest.raises(TypeError, match="graph g: attribute keys must be strings, got 1"):
        print_graph(g)


def test_value_not_in_graph_is_a_print_error() -> None:
    other = Graph("other")
    y = other.add_param(GraphParam(TensorType(DType.float32, (2,)), "y"))
    g = Graph("g")
    Builder(g).emit("ReLU", [y])
    with pytest.raises(ValueError, match="not in the graph"):
        print_graph(g)


# -- hypothesis round trips -------------------------------------------------------------------

NAME_CHARS = "abcxyzAB_019.-"
names = st.one_of(
    st.text(NAME_CHARS, min_size=1, max_size=8),
    st.text(min_size=0, max_size=6),
)
free_text = st.text(max_size=12)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(list(DType)),
    st.sampled_from(["sum", "true", "None", "inf", "Float32", "4-63", "a b", "x/y.z", ""]),
    free_text,
)
attr_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(tuple),
        st.lists(inner, max_size=3),
        st.dictionaries(free_text, inner, max_size=3),
    ),
    max_leaves=8,
)
strategies_ = st.lists(st.lists(st.integers(1, 8), max_size=3).map(tuple), max_size=3).map(tuple)
costs = st.one_of(st.floats(min_value=0.0, allow_nan=False), st.integers(0, 10**6))
swc_costs = st.builds(SwcCost, costs, costs, costs)
tensor_maps = st.lists(st.one_of(st.integers(-1, 7), st.lists(st.integers(-1, 7), min_size=1,
                                                            max_size=2).map(tuple)),
                       max_size=3).map(tuple)
layout_details = st.builds(
    LayoutDetail,
    st.lists(st.integers(1, 8), max_size=3).map(tuple),
    tensor_maps,
    st.one_of(st.none(), st.booleans()),
    st.one_of(st.none(), st.lists(free_text, max_size=3).map(tuple)),
)
#: a value of every ParallelInfo field (a new field needs one here: the test below says so)
parallel_fields: dict[str, st.SearchStrategy[Any]] = {
    "in_strategy": strategies_,
    "out_strategy": strategies_,
    "in_layout": st.lists(layout_details, max_size=2).map(tuple),
    "out_layout": st.lists(layout_details, max_size=2).map(tuple),
    "cost": st.builds(SearchCost, costs, costs, st.one_of(st.none(), costs)),
    "decision": swc_costs,
    "runner_up": st.builds(RunnerUp, strategies_, st.one_of(st.none(), costs),
                           st.one_of(st.none(), swc_costs)),
    "decided_by": free_text,
    "micro": st.integers(-5, 10**9),
    "chunk": st.integers(-5, 10**9),
    "reason": free_text,
    "fusion": st.integers(-5, 10**9),
    "members": st.lists(free_text, max_size=3).map(tuple),
    "bytes": st.integers(-5, 10**12),
    "parameter": free_text,
}


@st.composite
def parallel_info(draw: st.DrawFn) -> ParallelInfo:
    """Some fields, set in any order (the order the dump keeps)."""
    info = ParallelInfo()
    for name in draw(st.permutations(ParallelInfo.FIELDS))[:draw(st.integers(0, 5))]:
        setattr(info, name, draw(parallel_fields[name]))
    return info


parallel_infos = st.one_of(st.none(), parallel_info())


def test_parallel_fields_all_drawn() -> None:
    from pcompile.ir import parser, printer

    declared = {k for k, v in vars(ParallelInfo).items() if type(v).__name__ == "_Field"}
    assert declared == set(ParallelInfo.FIELDS) == set(parallel_fields)
    assert set(printer.PARALLEL_FIELDS) == set(parser.PARALLEL_FIELDS) == declared
sources = st.one_of(st.none(), st.builds(SourceLoc, free_text, st.integers(-5, 10**6), free_text))


@st.composite
def arrays_of(draw: st.DrawFn, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    elements: st.SearchStrategy[Any]
    base: type[np.generic]
    if dtype is DType.bool_:
        elements, base = st.booleans(), np.bool_
    elif dtype is DType.int32:
        elements, base = st.integers(-(2**31), 2**31 - 1), np.int32
    elif dtype is DType.int64:
        elements, base = st.integers(-(2**63), 2**63 - 1), np.int64
    elif dtype is DType.uint8:
        elements, base = st.integers(0, 255), np.uint8
    elif dtype is DType.float16:
        elements, base = st.floats(width=16), np.float16
    else:
        elements, base = st.floats(width=32), np.float32
    if draw(st.booleans()):
        return np.full(shape, draw(elements), dtype=base).astype(dtype.np)
    return draw(hnp.arrays(base, shape, elements=elements)).astype(dtype.np)


@st.composite
def constants(draw: st.DrawFn, dtype: DType, shape: tuple[int, ...]) -> Constant:
    return Constant(draw(arrays_of(dtype, shape)), dtype)


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    g = Graph(draw(names))
    g.attrs.update(draw(st.dictionaries(free_text, attr_values, max_size=3)))
    dtype = draw(st.sampled_from(list(DType)))
    shape = draw(st.sampled_from([(2,), (4, 2), (2, 1, 4)]))
    ttype = TensorType(dtype, shape)
    used: set[str] = set()
    for _ in range(draw(st.integers(1, 5))):
        name = draw(names.filter(lambda n: n not in used))
        used.add(name)
        kind = draw(st.sampled_from(["input", "weight", "state"]))
        g.add_param(GraphParam(ttype, name, kind, requires_grad=draw(st.booleans())))
    tensors: list[Value] = list(g.params)  # all of type `ttype`
    tuples: list[Value] = []
    others: list[Value] = []  # tuple elements: other shapes

    def emit(op: str, operands: list[Value], attrs: dict[str, Any] | None = None) -> Value:
        b = Builder(g, scope=draw(free_text), source=draw(sources))
        return b.emit(
            op,
            operands,
            attrs,
            instance_name=draw(st.one_of(st.just(""), names)),
            name_hint=draw(free_text),
            parallel=draw(parallel_infos),
        )

    any_const = st.sampled_from(list(DType)).flatmap(
        lambda d: st.sampled_from([(), (3,), (2, 2)]).flatmap(lambda s: constants(d, s))
    )
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["unary", "binary", "const", "split", "getitem", "any", "src"]))
        x = draw(st.sampled_from(tensors))
        if kind == "unary":
            tensors.append(emit("ReLU", [x]))
        elif kind == "binary":
            y = draw(st.sampled_from(tensors))
            tensors.append(emit(draw(st.sampled_from(["Add", "Mul", "ReluGrad"])), [x, y]))
        elif kind == "const":
            cshape = draw(st.sampled_from([(), shape, (1,) * (len(shape) - 1) + shape[-1:]]))
            c = draw(constants(dtype, cshape))
            operands = [x, c] if draw(st.booleans()) else [c, x]
            tensors.append(emit(draw(st.sampled_from(["Add", "Mul"])), operands))
        elif kind == "split":
            tuples.append(emit("TestOnly_Split", [x], {"axis": len(shape) - 1}))
        elif kind == "getitem" and tuples:
            t = draw(st.sampled_from(tuples))
            others.append(emit("TestOnly_GetItem", [t], {"index": draw(st.integers(0, 1))}))
        elif kind == "any":
            pool = tensors + tuples + others
            extra = draw(st.lists(st.one_of(any_const, st.sampled_from(pool)), max_size=3))
            attrs = draw(st.dictionaries(st.sampled_from(list(ANY_ATTRS)), attr_values))
            tensors.append(emit("TestOnly_Any", [x, *extra], attrs))
        elif kind == "src":
            tensors.append(emit("TestOnly_Source", [], {"shape": shape, "dtype": dtype}))
    pool = tensors + tuples + others
    outs = draw(st.lists(st.one_of(st.sampled_from(pool), any_const), max_size=4))
    g.outputs = outs
    return g


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_round_trip_random_graphs(graph: Graph) -> None:
    verify(graph)
    round_trip(graph)


@settings(max_examples=200, deadline=None)
@given(attr_values)
def test_round_trip_attr_values(value: Any) -> None:
    g = Graph("g")
    g.attrs["v"] = value
    text = print_graph(g)
    parsed = parse_graph(text)
    assert same_value(parsed.attrs["v"], value)
    assert print_graph(parsed) == text


# -- parse errors -----------------------------------------------------------------------------


def _edit(old: str, new: str) -> str:
    assert GOLDEN.count(old) == 1, old
    return GOLDEN.replace(old, new)


def _line_of(text: str, needle: str) -> tuple[int, int]:
    """Line and column of the first line containing `needle` without its `|`; the column is
    where the `|` stands (or the start of `needle` when it has none)."""
    before, _, after = needle.rpartition("|")
    for i, line in enumerate(text.split("\n"), start=1):
        if before + after in line:
            return i, line.index(before + after) + len(before) + 1
    raise AssertionError(needle)


@pytest.mark.parametrize(
    ("old", "new", "needle", "message"),
    [
        ("= ReLU(%1)", "= Relu(%1)", "Relu", "expected a registered op, got 'Relu'"),
        (
            "= ReLU(%1)",
            "= ReLU(%7)",
            "%7",
            "expected a node defined above (%0..%1), got '%7'",
        ),
        (
            "Mul(%para1_x, %para2_w)",
            "Mul(%para1_x, %para2_v)",
            "%para2_v",
            "expected %para2_w, got '%para2_v'",
        ),
        (
            "Mul(%para1_x, %para2_w)",
            "Mul(%para1_x, %para9_w)",
            "%para9_w",
            "expected a parameter %para1..%para3, got '%para9'",
        ),
        ("  %2(y) =", "  %5(y) =", "%5(y)", "expected %2 (nodes are numbered in order), got '%5'"),
        (
            "ReLU(%1) primitive",
            "ReLU(%1)  primitive",
            "ReLU(%1)|  primitive",
            "expected ' {instance name: ' or ' primitive_attrs: ', got '  '",
        ),
        (
            "{axis: 1, output_num: 2}",
            "{axis: 1 output_num: 2}",
            " output_num: 2}",
            "expected ', ' or '}', got ' '",
        ),
        (
            "Total number of nodes: 9",
            "Total number of nodes: 10",
            "Total number of nodes: |10",
            "expected 9 (parameters + nodes + 1), got 10",
        ),
        (
            "# Total params: 3",
            "# Total params: 2",
            "# Total params: |2",
            "expected 3 (the number of parameters listed), got 2",
        ),
        (
            "value=[[0.0, 1.0, -2.5, 0.10000000149011612, inf, -inf, nan, -0.0]]",
            "value=[[0.0, 1.0, -2.5, 0.1, inf, -inf, nan]]",
            "]]))",
            "expected ', ' (the dimension has 8 entries), got ']'",
        ),
    ],
)
def test_parse_errors(old: str, new: str, needle: str, message: str) -> None:
    text = _edit(old, new)
    line, column = _line_of(text, needle)
    with pytest.raises(ParseError) as info:
        parse_graph(text, "bad.ir")
    assert str(info.value) == f"bad.ir:{line}:{column}: {message}"
    assert isinstance(info.value, PcompileError)
    assert (info.value.line, info.value.column) == (line, column)


RELU_TYPES = (
    "(<Tensor[Float32], (4, 8)>) -> (<Tensor[Float32], (4, 8)>)\n      # scope: (Default)\n  %3"
)


def test_parse_error_result_type_mismatch() -> None:
    text = _edit(
        RELU_TYPES,
        RELU_TYPES.replace("-> (<Tensor[Float32], (4, 8)>)", "-> (<Tensor[Float32], (8, 4)>)"),
    )
    line, column = _line_of(text, "-> (|<Tensor[Float32], (8, 4)>")
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    assert str(info.value) == (
        f"<string>:{line}:{column}: expected the result type <Tensor[Float32], (4, 8)> that ReLU "
        "infers, got <Tensor[Float32], (8, 4)>"
    )


def test_parse_error_operand_type_mismatch() -> None:
    text = _edit(
        RELU_TYPES,
        RELU_TYPES.replace("(<Tensor[Float32], (4, 8)>) ->", "(<Tensor[Int32], (4, 8)>) ->"),
    )
    line, column = _line_of(text, "<Tensor[Int32]")
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    assert str(info.value).startswith(f"<string>:{line}:{column}: expected the operand's type")


def test_parse_error_shape_rejected_by_op() -> None:
    text = _edit("{axis: 1, output_num: 2}", "{axis: 1, output_num: 3}")
    line, column = _line_of(text, "TestOnly_Split(")
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    assert str(info.value) == (
        f"<string>:{line}:{column}: TestOnly_Split rejects its operands: "
        "dimension 8 is not divisible by 3"
    )


def test_parse_error_end_of_file() -> None:
    text = GOLDEN[: GOLDEN.index("  Return(")]
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    line = text.count("\n") + 1
    expected = "expected a node or '  Return(...)', got end of file"
    assert str(info.value) == f"<string>:{line}:1: {expected}"


def test_parse_error_unterminated_string() -> None:
    text = _edit('tag: "4-6301172352641561019"', 'tag: "4-630')
    line, column = _line_of(text, '"4-630')
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    assert str(info.value) == (
        f"<string>:{line}:{column}: expected a closing '\"' of the string, got end of line"
    )


def test_missing_attrs_get_defaults() -> None:
    text = _edit("{axis: 1, output_num: 2}", "{axis: 1}")
    parsed = parse_graph(text)
    assert parsed.nodes[4].attrs == {"axis": 1, "output_num": 2}
    assert print_graph(parsed) == GOLDEN


def test_node_objects_are_fresh() -> None:
    parsed = parse_graph(GOLDEN)
    assert all(isinstance(n, Node) for n in parsed.nodes)
    relu = parsed.nodes[2]
    assert relu.operands[0] is parsed.nodes[1].result
    assert [u for u, _ in parsed.nodes[1].result.uses] == [relu]
    assert parsed.outputs[2] is parsed.params[2]


@pytest.mark.parametrize(
    ("line", "needle", "message"),
    [
        ("v: (1)", ")", "expected ',)' (a 1-tuple), got ')'"),
        ("v: (1, 2", "", "expected ', ' or ')', got end of line"),
        ("v: 1.5.2", ".2", "expected end of line, got '.2'"),
        ("v: {a 1}", " 1}", "expected ': ', got ' '"),
        ("v: {a: 1, a: 2}", "a: 2", "duplicate key 'a'"),
        ("v: {[1]: 2}", "[1]", "expected a hashable key, got '['"),
        ("v: @", "@", "expected a value, got '@'"),
        ("1: 2", "1", "expected an attribute name, got '1'"),
        ('v: "a\\q"', '"a', "expected a valid JSON string, got invalid \\escape"),
    ],
)
def test_value_parse_errors(line: str, needle: str, message: str) -> None:
    text = print_graph(Graph("g")).replace("# Attrs:\n", f"# Attrs:\n{line}\n")
    column = line.rindex(needle) + 1 if needle else len(line) + 1
    with pytest.raises(ParseError) as info:
        parse_graph(text)
    assert str(info.value) == f"<string>:5:{column}: {message}"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("dtype=Float32, value=0.5", "dtype=Float128, value=0.5", "expected a dtype (Float32, "),
        ("dtype=Float32, value=0.5", "dtype=Int32, value=0.5", "expected ')', got '.5'"),
        ("dtype=Float32, value=0.5", "dtype=Bool, value=1", "expected true or false, got '1'"),
        ("shape=[], dtype=Float32, value=0.5", "shape=[2], dtype=Int32, value=[1, 2**40]", ""),
        ("#", "%", "expected '# IR entry: @'"),
        ("ref_key=w,", "ref_key=v,", "expected ref_key=w, got 'v'"),
        ("subgraph @1_net.construct()", "subgraph @other()", "expected the entry graph"),
    ],
)
def test_more_parse_errors(old: str, new: str, message: str) -> None:
    text = GOLDEN.replace(old, new, 1)
    with pytest.raises(ParseError, match="^<string>:[0-9]+:[0-9]+: " + re.escape(message)):
        parse_graph(text)


@pytest.mark.parametrize(
    ("new", "message"),
    [
        ('why: "a b"}', "expected a parallel annotation (in_strategy, out_strategy, "),
        ("reason: 3}", "expected a string as the value of reason"),
        ('reason: "a b", micro: true}', "expected an integer as the value of micro"),
        ('reason: "a b", members: (1,)}', "expected a tuple of strings as the value of members"),
        ('reason: "a b", cost: {op: 1.0}}',
         "expected a cost {op, redistribution} or {local, op, redistribution} as the value"),
        ('reason: "a b", in_layout: ()}',
         "expected the parallel annotations in the order in_strategy, out_strategy, in_layout"),
    ],
)
def test_parallel_annotation_errors(new: str, message: str) -> None:
    text = GOLDEN.replace('reason: "a b"}', new, 1)
    with pytest.raises(ParseError, match="^<string>:[0-9]+:[0-9]+: " + re.escape(message)):
        parse_graph(text)


def test_parallel_fields_print_in_the_order_set() -> None:
    made = ParallelInfo(micro=1, reason="r", bytes=4)  # a node made for micro-batch 1
    copied = ParallelInfo(reason="r", bytes=4).copy()  # a node copied into it
    copied.micro = 1
    assert format_parallel(made) == "{micro: 1, reason: r, bytes: 4}"
    assert format_parallel(copied) == "{reason: r, bytes: 4, micro: 1}"
    copied.reason = "again"  # set anew: keeps its place
    assert format_parallel(copied) == "{reason: again, bytes: 4, micro: 1}"
    late = ParallelInfo(((2,),), reason="r")
    late.in_layout = (LayoutDetail((2,), (0,)),)  # layouts print right after the strategies
    assert format_parallel(late) == (
        "{in_strategy: ((2)), in_layout: ({'device_matrix': (2), 'tensor_map': (0)}), reason: r}")
    late.reason = None
    assert late.reason is None and format_parallel(late).endswith("(0)})}")


def test_int_constant_out_of_range() -> None:
    text = GOLDEN.replace(
        "Tensor(shape=[], dtype=Float32, value=0.5)",
        "Tensor(shape=[], dtype=Int32, value=2147483648)",
    )
    with pytest.raises(ParseError, match="expected an Int32 integer, got 2147483648"):
        parse_graph(text)


def test_memoised_printing_and_inference_tell_equal_values_of_other_types() -> None:
    """`True == 1 == 1.0` and `0.0 == -0.0` in Python: the printer's and the inference's memos
    must still keep them apart (a memo keyed by value alone prints whichever came first)."""
    from pcompile.ir.errors import ShapeError
    from pcompile.ir.printer import format_dict
    from pcompile.ir.registry import get_op

    texts = [format_dict({"a": v}) for v in (1, True, 1.0, 0.0, -0.0, (1, 1), (1, True))]
    assert texts == ["{a: 1}", "{a: true}", "{a: 1.0}", "{a: 0.0}", "{a: -0.0}",
                     "{a: (1, 1)}", "{a: (1, true)}"]
    op = get_op("ReduceSum")
    x = [TensorType(DType.float32, (2, 3))]
    assert op.infer_type(x, {"axis": (0,), "keep_dims": False}).shape == (3,)
    with pytest.raises(ShapeError, match="tuple of ints"):
        op.infer_type(x, {"axis": (0.0,), "keep_dims": False})


def test_large_constants_print_by_digest_and_round_trip() -> None:
    """A constant of more than LARGE_CONSTANT elements prints as the digest of its data (a
    2048 x 2048 mask would be 80 MB of text per dump); splats print their one value whatever
    the size; the parser gives an OpaqueConstant that prints the same again."""
    from pcompile.ir.core import OpaqueConstant
    from pcompile.ir.printer import LARGE_CONSTANT

    g = Graph("big")
    x = g.add_param(GraphParam(TensorType(DType.float32, (64, 64)), "x"))
    b = Builder(g)
    mask = np.triu(np.full((64, 64), -1e4, np.float32), k=1)
    assert mask.size > LARGE_CONSTANT
    y = b.emit("Add", [x, Constant(mask, DType.float32)])
    z = b.emit("Add", [y, Constant(np.zeros((64, 64), np.float32), DType.float32)])
    g.outputs = [z]
    text = print_graph(g)
    assert "value=@" in text and "value=0.0)" in text and "-10000.0" not in text
    parsed = parse_graph(text)
    assert isinstance(parsed.nodes[0].operands[1], OpaqueConstant)
    assert print_graph(parsed) == text
    other = mask.copy()
    other[0, 63] = 1.0
    g2 = Graph("big")
    x2 = g2.add_param(GraphParam(TensorType(DType.float32, (64, 64)), "x"))
    g2.outputs = [Builder(g2).emit("Add", [x2, Constant(other, DType.float32)])]
    digest = [line for line in text.splitlines() if "value=@" in line][0].split("value=@")[1]
    assert digest not in print_graph(g2)  # different data, different digest
    with pytest.raises(ValueError, match="not in the dump"):
        _ = parsed.nodes[0].operands[1].array
