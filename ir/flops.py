"""FLOPs of one forward op (global shapes), for the run report's MFU and the cost model.

What a run reports as model TFLOP/s and MFU (backends/run_report.py) divides these FLOPs by the
step time. They count the matrix products only, as MFU conventionally does:

* `MatMul` and `BatchMatMul`: 2 * M * N * K per product (times the broadcast batch);
* `FlashAttentionScore`: 4 * B * N * Sq * Skv * D (QK^T and PV), halved when the mask is
  causal (`sparse_mode` 2/3/4, or a mask the compiler recognised as lower-triangular);

and a training step counts 3 times the forward (the backward computes two products per
forward product). Recomputation and the optimizer are not model FLOPs. Element-wise ops,
reductions and softmax are left out. When the forward has no matrix product (or no graph
was traced) the runtime falls back on 6 * parameters * tokens.
"""

from __future__ import annotations

from pcompile.ir.core import Node
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.types import TensorType

TRAINING_FACTOR = 3  # forward + backward (two products per forward product)


def _shape(node: Node, index: int) -> tuple[int, ...] | None:
    if index >= len(node.operands):
        return None
    value_type = node.operands[index].type
    return tuple(value_type.shape) if isinstance(value_type, TensorType) else None


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def node_flops(node: Node) -> int:
    """FLOPs of one forward node (0 for anything but a matrix product or attention)."""
    if has_trait(node.op, Trait.MATMUL):
        a, b = _shape(node, 0), _shape(node, 1)
        out = node.result.type
        if a is None or b is None or not isinstance(out, TensorType) or len(a) < 2:
            return 0
        k = a[-2] if node.attrs.get("transpose_a") else a[-1]
        return 2 * _prod(tuple(out.shape)) * int(k)
    if node.op == "FlashAttentionScore":
        return _attention_flops(node)
    return 0


def _attention_flops(node: Node) -> int:
    from pcompile.ir.errors import ShapeError
    from pcompile.ir.ops.attention import attention_dims

    query, key = _shape(node, 0), _shape(node, 1)
    head_num = node.attrs.get("head_num")
    if query is None or key is None or not isinstance(head_num, int):
        return 0
    try:
        dims = attention_dims(query, key, head_num, str(node.attrs.get("input_layout", "BSH")))
    except ShapeError:
        return 0
    flops = 4 * dims.batch * dims.q_heads * dims.q_seq * dims.kv_seq * dims.head_dim
    if _causal(node):
        flops //= 2
    return flops


def _causal(node: Node) -> bool:
    from pcompile.ir.ops.attention import causal_lowering_attrs

    if node.attrs.get("sparse_mode") in (2, 3, 4):
        return True
    try:
        return causal_lowering_attrs(node, node.attrs).get("sparse_mode") == 2
    except Exception:  # an attribute the recognition does not read: not known to be causal
        return False
