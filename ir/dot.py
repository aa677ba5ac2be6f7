"""Graphviz `.dot` text of a graph (what MindSpore writes beside its `.ir` files at
`save_graphs=3`): one box per parameter and per node (op, instance name, result shape), an edge
per operand; collectives are filled. Deterministic: the same graph gives the same text."""

from __future__ import annotations

from pcompile.ir.core import Constant, Graph, GraphParam, NodeResult, Value
from pcompile.ir.registry import get_op
from pcompile.ir.types import TensorType

NEWLINE = "\x00"  # a line break inside a label: written as dot's \n by _quote


def _quote(text: str) -> str:
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace(NEWLINE, "\\n")
    return '"' + text + '"'


def _shape(value: Value) -> str:
    t = value.type
    if isinstance(t, TensorType):
        return f"{t.dtype.value}{tuple(t.shape)}"
    return str(t)


def graph_to_dot(graph: Graph) -> str:
    """The graph as a `digraph` (parameters as ellipses, nodes as boxes)."""
    ids: dict[int, str] = {}
    lines = [f"digraph {_quote(graph.name or 'graph')} {{", "  rankdir=TB;",
             '  node [fontname="monospace", fontsize=10];']
    for k, p in enumerate(graph.params):
        ids[id(p)] = f"p{k}"
        label = _quote(p.name + NEWLINE + _shape(p))
        lines.append(f"  p{k} [shape=ellipse, label={label}];")
    constants = 0
    for k, node in enumerate(graph.nodes):
        name = f"n{k}"
        ids[id(node.result)] = name
        title = node.op + (f" '{node.instance_name}'" if node.instance_name else "")
        style = ", style=filled, fillcolor=lightblue" if get_op(node.op).collective else ""
        label = _quote(f"%{k} {title}" + NEWLINE + _shape(node.result))
        lines.append(f"  {name} [shape=box{style}, label={label}];")
        for index, operand in enumerate(node.operands):
            source = ids.get(id(operand))
            if source is None and isinstance(operand, Constant):
                source = f"c{constants}"
                constants += 1
                lines.append(f"  {source} [shape=plaintext, label={_quote(_shape(operand))}];")
            if source is None and isinstance(operand, (GraphParam, NodeResult)):
                continue  # a value from outside this graph
            lines.append(f"  {source} -> {name} [label={index}];")
    for k, out in enumerate(graph.outputs):
        source = ids.get(id(out))
        if source is not None:
            lines.append(f"  out{k} [shape=doublecircle, label={_quote(f'output {k}')}];")
            lines.append(f"  {source} -> out{k};")
    lines.append("}")
    return "\n".join(lines) + "\n"


__all__ = ["graph_to_dot"]
