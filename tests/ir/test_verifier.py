"""The verifier accepts well-formed graphs and names the node for each broken invariant."""

from __future__ import annotations

import numpy as np
import pytest

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Node
from pcompile.ir.errors import PcompileError
from pcompile.ir.parser import parse_graph
from pcompile.ir.types import DType, TensorType
from pcompile.ir.verifier import VerifyError, verify
from tests import ROOT
from tests.ir.test_printer_parser import GOLDEN, ensure_test_ops, golden_graph

ensure_test_ops()

F32 = TensorType(DType.float32, (4, 8))


def small_graph() -> Graph:
    """x, w -> %0 = Mul(x, w) 'mul'; %1 = ReLU(%0) 'relu'; %2 = Add(%1, 1.0) 'add'."""
    g = Graph("small")
    x = g.add_param(GraphParam(F32, "x"))
    w = g.add_param(GraphParam(F32, "w", "weight", requires_grad=True))
    b = Builder(g, scope="Default/net")
    y = b.emit("Mul", [x, w], instance_name="mul")
    z = b.emit("ReLU", [y], instance_name="relu")
    out = b.emit("Add", [z, b.const(1.0)], instance_name="add")
    g.outputs = [out, w]
    return g


def fails(graph: Graph, *patterns: str, **kwargs: bool) -> VerifyError:
    with pytest.raises(VerifyError) as info:
        verify(graph, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, message
    assert isinstance(info.value, PcompileError)
    return info.value


def test_valid_graphs_pass() -> None:
    verify(small_graph())
    verify(golden_graph())
    verify(parse_graph(GOLDEN))
    verify(Graph("empty"))


def test_operand_defined_later() -> None:
    g = small_graph()
    g.reorder([g.nodes[1], g.nodes[0], *g.nodes[2:]])
    err = fails(g, "node %0 ReLU 'relu'", "operand 0 is %1 (Mul), which is defined later")
    assert err.node is g.nodes[0]


def test_operand_from_another_graph() -> None:
    g = small_graph()
    other = small_graph()
    g.nodes[1].set_operand(0, other.nodes[0].result)
    fails(g, "node %1 ReLU 'relu'", "operand 0 is the result of Mul 'mul'", "not in the graph")


def test_removed_node_operand() -> None:
    g = small_graph()
    removed = g.nodes[0]
    g.nodes.remove(removed)  # the list itself: Graph.remove would refuse (still used)
    fails(g, "node %0 ReLU 'relu'", "not in the graph")
    assert removed.op == "Mul"


def test_parameter_of_another_graph() -> None:
    g = small_graph()
    stranger = GraphParam(F32, "stranger")
    g.nodes[0].set_operand(1, stranger)
    fails(g, "node %0 Mul 'mul'", "operand 1 is parameter 'stranger' (not of this graph)")


def test_use_list_missing_use() -> None:
    g = small_graph()
    x = g.params[0]
    x.uses.clear()
    fails(g, "node %0 Mul 'mul'", "use lists: %para1_x is operand 0 but its use list lacks")


def test_use_list_extra_use() -> None:
    g = small_graph()
    w = g.params[1]
    w.uses.append((g.nodes[1], 0))
    fails(g, "node %1 ReLU 'relu'", "use lists: %para2_w lists 1 use(s) as operand 0, but")


def test_use_list_duplicate_use() -> None:
    g = small_graph()
    result = g.nodes[0].result
    result.uses.append(result.uses[0])
    fails(g, "node %1 ReLU 'relu'", "%0 lists 2 use(s) as operand 0, but the node has 1")


def test_use_by_node_outside_graph() -> None:
    g = small_graph()
    Node("ReLU", [g.params[0]], {}, F32)  # built but never inserted
    fails(g, "use lists: %para1_x lists a use by ReLU", "which is not in the graph")


def test_result_type_disagrees_with_inference() -> None:
    g = small_graph()
    g.nodes[1].result.type = TensorType(DType.float32, (8, 4))
    fails(
        g,
        "node %1 ReLU 'relu' (scope Default/net)",
        "result type <Tensor[Float32], (8, 4)> disagrees with <Tensor[Float32], (4, 8)>",
    )


def test_operands_rejected_by_op() -> None:
    g = small_graph()
    g.nodes[2].set_operand(1, Constant(np.zeros((3,)), DType.float32))
    fails(g, "node %2 Add 'add'", "Add rejects its operands", "cannot be broadcast")


def test_unknown_attribute() -> None:
    g = small_graph()
    g.nodes[0].attrs["bogus"] = 1
    fails(g, "node %0 Mul 'mul'", "unknown attribute(s) bogus")
    verify(g, allow_extra_attrs=True)


def test_missing_attribute() -> None:
    g = golden_graph()
    split = g.nodes[4]
    del split.attrs["output_num"]
    fails(g, "node %4 TestOnly_Split", "missing attribute(s) output_num")


def test_unknown_op() -> None:
    g = small_graph()
    g.nodes[1].op = "NoSuchOp"
    fails(g, "node %1", "unknown op 'NoSuchOp'")


def test_undefined_output() -> None:
    g = small_graph()
    g.outputs = [*g.outputs, small_graph().nodes[2].result]
    fails(g, "graph small: output 2 is undefined: the result of Add 'add'")


def test_a_node_is_in_one_place() -> None:
    """The node list refuses a node it holds (the verifier's duplicate check stays for lists
    built elsewhere)."""
    g = small_graph()
    with pytest.raises(ValueError, match="already in this graph"):
        g.nodes.append(g.nodes[0])
    with pytest.raises(ValueError, match="already in this graph"):
        g.insert_after(g.nodes[2], g.nodes[0])


def test_constant_type_mismatch() -> None:
    g = small_graph()
    const = g.nodes[2].operands[1]
    assert isinstance(const, Constant)
    const.array = np.zeros((2,), np.float32)
    fails(g, "node %2 Add 'add'", "operand 1 is a constant that holds a float32 array")


def test_duplicate_parameter_names() -> None:
    g = small_graph()
    g.params.append(GraphParam(F32, "x"))
    fails(g, "graph small: duplicate parameter name 'x'")


@pytest.mark.parametrize("each,where", [("1", "comm_fusion"), ("", "execute")])
def test_a_compile_verifies_the_final_graph(monkeypatch, tmp_path, each: str, where: str) -> None:
    """A pass that leaves an invalid graph is caught: in that pass with PCOMPILE_VERIFY_EACH,
    else by the verification of the final graph, before anything is written."""
    import os

    from pcompile.passes import comm_fusion
    from pcompile.tools.compile import compile as compile_model

    original = comm_fusion.CommFusionPass.apply

    def corrupting(self, state) -> None:
        original(self, state)
        graph = state.graphs[0] if state.split else state.graph
        node = graph.nodes[-1]
        node.result.type = TensorType(DType.int32, (3, 5, 7))  # not what its op infers

    monkeypatch.setattr(comm_fusion.CommFusionPass, "apply", corrupting)
    monkeypatch.setenv("PCOMPILE_VERIFY_EACH", each)
    root = ROOT
    out = tmp_path / "out"
    with pytest.raises(PcompileError, match=rf"(?s)disagrees with .*in pass '{where}'"):
        compile_model(os.path.join(root, "examples", "quickstart.py"), devices=8,
                      out_dir=str(out))
    assert not out.exists()
