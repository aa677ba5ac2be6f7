"""A forward AllReduce whose every user takes one block of the sum: a ReduceScatter instead.

An op with a split reduced dim (a row-parallel MatMul) leaves partial sums, which MindSpore
all-reduces (and reduce-scatters only when `out_strategy` asks for it). When every user of the
result wants it split on dim 0, over exactly the AllReduce's group, further than the op's own
output layout (the same slices otherwise, the group's ranks in the order of the split), the
AllReduce followed by that slicing is a ReduceScatter of the partial sums (unless the user
chose the AllReduce form with `out_strategy`): (n - 1) / n of the
bytes instead of 2 (n - 1) / n, and its vjp is an AllGather instead of another AllReduce. XLA's
partitioner does the same where a data-parallel residual or loss follows a row-parallel
projection. `scatter_layouts` decides it on the global graph; `passes/step_parallel.py` emits it.
"""

from __future__ import annotations

from math import prod

from pcompile.ir.core import Graph, Node
from pcompile.ir.layout import TensorLayout, axis_index, map_axes
from pcompile.ir.rank import Digit, RankGroup
from pcompile.passes.layouts import ParallelAssignment


def _dim_digits(layout: TensorLayout, dim: int) -> list[Digit]:
    """The rank digits that number the slices of `dim`, most significant first."""
    dev = layout.dev_matrix
    out = []
    for value in map_axes(layout.tensor_map[dim]):
        index = axis_index(value, dev)
        out.append((prod(dev[index + 1:]), dev[index]))
    return out


def _merged(digits: list[Digit]) -> list[Digit]:
    """Adjacent digits that number slices as one (stride_i = stride_j * count_j) merged."""
    out: list[Digit] = []
    for stride, count in digits:
        if count == 1:
            continue
        if out and out[-1][0] == stride * count:
            out[-1] = (stride, out[-1][1] * count)
        else:
            out.append((stride, count))
    return out


def scatters(have: TensorLayout, want: TensorLayout, group: tuple[Digit, ...]) -> bool:
    """Whether `want` is `have` with dim 0 further split over the ranks of `group`, each rank
    taking the block of its position in the group (a ReduceScatter's order)."""
    if have.shape != want.shape or not have.shape:
        return False
    if _merged(_dim_digits(have, 0) + list(group)) != _merged(_dim_digits(want, 0)):
        return False
    return all(_merged(_dim_digits(have, d)) == _merged(_dim_digits(want, d))
               for d in range(1, len(have.shape)))


def scatter_layouts(graph: Graph, assignment: ParallelAssignment) -> dict[Node, TensorLayout]:
    """Node -> the layout its result takes when its forward AllReduce becomes a
    ReduceScatter (module docstring)."""
    outputs = {id(v) for v in graph.outputs}
    out: dict[Node, TensorLayout] = {}
    for node in graph.nodes:
        sharding = assignment.sharding(node)
        if (sharding is None or sharding.expand or len(sharding.out_layouts) != 1
                or id(node.result) in outputs or not node.result.uses
                or node.attrs.get("out_strategy") is not None):  # the user chose the form
            continue
        comms = [c for c in sharding.forward if c.kind != "Div"]
        if len(comms) != 1 or comms[0].kind != "AllReduce" or comms[0].op != "sum":
            continue
        wants: set[TensorLayout] = set()
        for user, index in node.result.uses:
            user_sharding = assignment.sharding(user)
            if user_sharding is None or index >= len(user_sharding.in_layouts):
                break
            wants.add(user_sharding.in_layouts[index])
        else:
            if len(wants) != 1:
                continue
            want = wants.pop()
            group = RankGroup.along(sharding.dev_matrix, comms[0].axes).digits
            if scatters(sharding.out_layouts[0], want, group):
                out[node] = want
    return out
