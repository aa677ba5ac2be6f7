"""Graph edits through the Graph API: the node list keeps its order under O(1) appends,
inserts, moves and removals (checked against a plain list on random edit sequences), and the
outputs are uses of their values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.builder import Builder
from pcompile.ir.core import Constant, Graph, GraphParam, Node, NodeList
from pcompile.ir.types import DType, TensorType
from pcompile.ir.verifier import VerifyError, verify

F32 = TensorType(DType.float32, (2,))


def _node(k: int) -> Node:
    return Node("Neg", [Constant(np.zeros(2, np.float32), DType.float32)], {}, F32,
                instance_name=f"n{k}")


EDITS = st.lists(st.tuples(st.sampled_from(["append", "after", "before", "remove", "move",
                                             "index"]),
                           st.integers(0, 1000), st.integers(0, 1000)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(EDITS)
def test_the_node_list_orders_like_a_list(edits: list[tuple[str, int, int]]) -> None:
    nodes, model = NodeList(), []
    made = 0
    for what, a, b in edits:
        if what == "append" or not model:
            node = _node(made)
            made += 1
            nodes.append(node)
            model.append(node)
        elif what in ("after", "before"):
            anchor = model[a % len(model)]
            node = _node(made)
            made += 1
            if what == "after":
                nodes.insert_after(anchor, node)
                model.insert(model.index(anchor) + 1, node)
            else:
                nodes.insert_before(anchor, node)
                model.insert(model.index(anchor), node)
        elif what == "remove":
            node = model.pop(a % len(model))
            nodes.remove(node)
            assert node not in nodes
        elif what == "move":  # a node moved after another (Graph.move_after's step)
            node = model[a % len(model)]
            anchor = model[b % len(model)]
            if anchor is node:
                continue
            nodes.remove(node)
            model.remove(node)
            nodes.insert_after(anchor, node)
            model.insert(model.index(anchor) + 1, node)
        else:
            node = model[a % len(model)]
            assert nodes.index(node) == model.index(node)
        assert len(nodes) == len(model)
        keys = [nodes.order_key(n) for n in model]
        assert all(a < b for a, b in zip(keys, keys[1:]))
    assert list(nodes) == model
    assert list(reversed(nodes)) == model[::-1]
    assert nodes[1:3] == model[1:3]


def test_order_keys_survive_many_inserts_at_one_place() -> None:
    """Inserting again and again right after the head exhausts the floats between two keys;
    the list numbers its nodes afresh and the keys still increase."""
    head, tail = _node(0), _node(1)
    nodes = NodeList([head, tail])
    model = [head, tail]
    for k in range(2, 200):
        node = _node(k)
        nodes.insert_after(head, node)
        model.insert(1, node)
    assert list(nodes) == model
    keys = [nodes.order_key(n) for n in model]
    assert all(a < b for a, b in zip(keys, keys[1:]))


def _chain() -> tuple[Graph, list[Node]]:
    g = Graph("g")
    x = g.add_param(GraphParam(F32, "x"))
    b = Builder(g)
    y = b("Neg", x)
    z = b("Abs", y)
    g.outputs = [z]
    return g, list(g.nodes)


def test_move_after_and_reorder_keep_the_graph_valid() -> None:
    g, (neg, abs_) = _chain()
    extra = Builder(g)("Exp", g.params[0])
    g.move_after(None, [extra.node])  # type: ignore[attr-defined]
    assert [n.op for n in g.nodes] == ["Exp", "Neg", "Abs"]
    g.move_after(neg, [extra.node])  # type: ignore[attr-defined]
    assert [n.op for n in g.nodes] == ["Neg", "Exp", "Abs"]
    verify(g)
    g.reorder([abs_, neg, extra.node])  # type: ignore[attr-defined]
    with pytest.raises(VerifyError, match="defined later"):
        verify(g)
    with pytest.raises(ValueError, match="each once"):
        g.reorder([neg, neg, abs_])


def test_outputs_are_uses() -> None:
    g, (neg, abs_) = _chain()
    assert abs_.result.output_uses == [(g, 0)]
    with pytest.raises(ValueError, match="still used"):
        g.remove(abs_)  # the graph returns it
    exp = Builder(g)("Exp", neg.result)
    abs_.result.replace_all_uses_with(exp)  # the output follows, no graph needed
    assert g.outputs == (exp,) and abs_.result.output_uses == []
    g.remove(abs_)
    verify(g)
    assert exp.output_uses == [(g, 0)]
    g.outputs = [neg.result, exp]
    assert exp.output_uses == [(g, 1)] and neg.result.output_uses == [(g, 0)]
    exp.output_uses.clear()  # a stale use list is what the verifier reports
    with pytest.raises(VerifyError, match="output 1 .* does not list its use"):
        verify(g)


def test_a_copied_graph_keeps_its_order_and_links() -> None:
    """The node list is keyed by node identity; a deep copy (or a pickle) rebuilds it from the
    copied nodes in order."""
    import copy

    g, _ = _chain()
    twin = copy.deepcopy(g)
    assert [n.op for n in twin.nodes] == [n.op for n in g.nodes]
    assert all(a is not b for a, b in zip(twin.nodes, g.nodes))
    verify(twin)
    last = twin.nodes[-1]
    assert twin.index_of(last) == len(twin.nodes) - 1
    assert twin.outputs[0] is last.result and last.result.output_uses == [(twin, 0)]
