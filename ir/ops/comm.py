"""Communication primitives (MindSpore names and attrs) and the virtual ops whose vjps are
collectives.

Collectives (`collective=True`: AllReduce, AllGather, ReduceScatter, AlltoAll, Broadcast) have
no numpy/JAX callables; backends run them with their own runtime, over the ranks in the node's
`rank_list` (a world of one runs them as the identity). Every collective has the attrs `group`
(the group name, "" when not named yet), `rank_list` (the member ranks; its length is the group
size used by shape inference) and `fusion` (0 = never fused).

The vjps follow MindSpore's `grad_comm_ops.py` (see parallel-semantics.md section 3.3):
AllReduce(sum) -> AllReduce(sum); AllGather -> ReduceScatter(sum) (times 1/n if `mean_flag`);
ReduceScatter(sum) -> AllGather; AlltoAll -> AlltoAll with split/concat dims swapped;
_MirrorOperator (forward identity) -> AllReduce(sum) (times 1/dev_num if `mean_flag`);
_VirtualDiv (forward identity) -> cotangent / divisor. Backward collectives copy `group`,
`rank_list` and `fusion` from the forward node.
"""

from __future__ import annotations

from typing import Any

from pcompile.ir.builder import Builder
from pcompile.ir.core import Node, Value
from pcompile.ir.errors import PcompileError, ShapeError
from pcompile.ir.ops._define import define
from pcompile.ir.ops._util import normalize_axis, tensor
from pcompile.ir.registry import ALL, CommFacts, InferFn, OpDef
from pcompile.ir.types import ValueType

_COMM_DEFAULTS: dict[str, Any] = {"group": "", "rank_list": (0,), "fusion": 0}
_REDUCE_OPS = ("sum", "max", "min", "prod")


_PLAIN_INTS = frozenset({int})  # a rank list's entries (not bool, nor an int subclass)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _group_size(attrs: dict[str, Any]) -> int:
    """Validate `group`, `rank_list` and `fusion`; return the group size len(rank_list)."""
    group, ranks, fusion = attrs["group"], attrs["rank_list"], attrs["fusion"]
    if not isinstance(group, str):
        raise ShapeError(f"group must be a str, got {group!r}")
    if not isinstance(ranks, tuple) or not ranks or not _PLAIN_INTS.issuperset(
            map(type, ranks)) or min(ranks) < 0:
        raise ShapeError(f"rank_list must be a non-empty tuple of non-negative ints, got {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ShapeError(f"rank_list {ranks} names a rank twice")
    if not _is_int(fusion) or fusion < 0:
        raise ShapeError(f"fusion must be a non-negative int, got {fusion!r}")
    return len(ranks)


def _reduce_op(attrs: dict[str, Any], allowed: tuple[str, ...] = _REDUCE_OPS) -> str:
    op = attrs["op"]
    if op not in allowed:
        raise ShapeError(f"op must be one of {', '.join(allowed)}, got {op!r}")
    return str(op)


def _comm_attrs(node: Node) -> dict[str, Any]:
    """The group attrs a backward collective copies from its forward node."""
    return {k: node.attrs[k] for k in _COMM_DEFAULTS}


def _sum_collective(b: Builder, op: str, cot: Value, node: Node) -> Value:
    """`op`(op="sum") of `cot` over `node`'s group. (`b.emit`, since `b(...)` reserves the
    keyword `op` for the op name.)"""
    return b.emit(op, [cot], {"op": "sum", **_comm_attrs(node)})


def _flag(attrs: dict[str, Any], name: str) -> bool:
    value = attrs[name]
    if not isinstance(value, bool):
        raise ShapeError(f"{name} must be a bool, got {value!r}")
    return value


# -- bytes one rank moves (passes/comm_info.py has the two conventions' tables) ---------------


def _operand_received(operand: int, result: int, n: int) -> int:
    """The tensor: AllReduce, Broadcast (and a _MirrorOperator, for its gradient AllReduce)."""
    return operand


def _all_reduce_ring(size: int, n: int) -> int:
    """A ring AllReduce: ReduceScatter then AllGather, each (n - 1) / n of the tensor."""
    return 2 * (n - 1) * size // n


def _spread_ring(size: int, n: int) -> int:
    """(n - 1) / n of the operand: ReduceScatter's n - 1 blocks of size / n; AlltoAll, every
    block but its own."""
    return (n - 1) * size // n


_COLLECTIVE_RULE = ("*no strategy*: inserted per rank by the parallel passes (user-callable in "
                    "hybrid_parallel mode)")


def collective(name: str, infer: InferFn, *, tests: tuple[str, ...], **fields: Any) -> OpDef:
    """A collective: one operand, executed by the backends' communication runtime (no
    numpy/jax callables), any dtype, no strategy of its own; its tests end with the check that
    every collective is the identity on one rank."""
    return define(name, infer, num_inputs=1, collective=True, section="compiler", dtypes=ALL,
                  rule=_COLLECTIVE_RULE,
                  tests=(*tests, "test_ops_comm.py::test_single_rank_collectives_are_identity"),
                  **fields)


# -- AllReduce ------------------------------------------------------------------------------


def _all_reduce_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    _group_size(attrs)
    _reduce_op(attrs)
    return x


def _all_reduce_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    op = node.attrs["op"]
    if node.attrs.get("replicated_cotangent") is True:
        # every rank of the group holds the same cotangent share (passes/cotangents.py): their
        # sum is the share times the group size, with no communication
        grad = b("Mul", cot, float(len(node.attrs["rank_list"])))
    else:
        grad = _sum_collective(b, "AllReduce", cot, node)
    if op == "sum":
        return [grad]
    if op in ("max", "min"):
        # MindSpore: the summed cotangent flows to every rank whose input equals the result
        # (all tied ranks get it).
        (x,) = node.operands
        mask = b("Cast", b("Equal", x, node.result), dst_type=cot.dtype)
        return [b("Mul", grad, mask)]
    raise PcompileError(f"{node.where()}: AllReduce(op={op!r}) has no gradient rule")


collective("AllReduce", _all_reduce_infer, vjp=_all_reduce_vjp,
           comm=CommFacts(_operand_received, _all_reduce_ring, fusion_key="allreduce"),
           attrs={"op": "sum", **_COMM_DEFAULTS},
           doc="Element-wise reduction (op sum|max|min|prod) over the ranks of the group. vjp: "
               "AllReduce(sum) of the cotangent (the cotangent times the group size when the node "
               "has `replicated_cotangent: true`: every rank of the group holds the same one); for "
               "max/min masked by x == result; prod has none.",
           operands="x; `op`, `group`, `rank_list`, `fusion`",
           tests=("test_ops_comm.py::test_shape_inference",
                  "test_ops_comm.py::test_all_reduce_sum_vjp_is_all_reduce_sum"))

# -- AllGather ------------------------------------------------------------------------------


def _all_gather_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    n = _group_size(attrs)
    _flag(attrs, "mean_flag")
    if x.rank == 0:
        raise ShapeError("x must have rank >= 1 (it is gathered along dim 0), got a scalar")
    return x.with_shape((x.shape[0] * n,) + x.shape[1:])


def _all_gather_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    grad = _sum_collective(b, "ReduceScatter", cot, node)
    if node.attrs["mean_flag"]:
        grad = b("Mul", grad, 1.0 / len(node.attrs["rank_list"]))
    return [grad]


def _all_gather_received(operand: int, result: int, n: int) -> int:
    """The n - 1 pieces of the other ranks."""
    return operand * (n - 1)


def _all_gather_ring(size: int, n: int) -> int:
    """A ring AllGather: its own piece passed on n - 1 times."""
    return (n - 1) * size


collective("AllGather", _all_gather_infer, vjp=_all_gather_vjp,
           comm=CommFacts(_all_gather_received, _all_gather_ring, fusion_key="allgather"),
           attrs={**_COMM_DEFAULTS, "mean_flag": False},
           doc="Concatenates the ranks' x along dim 0 in rank_list order (dim 0 grows n times). "
               "vjp: ReduceScatter(sum), times 1/n if mean_flag.",
           operands="x; `group`, `rank_list`, `fusion` (gathers on dim 0)",
           tests=("test_ops_comm.py::test_gather_scatter_shapes",
                  "test_ops_comm.py::test_all_gather_vjp_is_reduce_scatter"))

# -- ReduceScatter --------------------------------------------------------------------------


def _reduce_scatter_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    n = _group_size(attrs)
    _reduce_op(attrs)
    if x.rank == 0:
        raise ShapeError("x must have rank >= 1 (it is scattered along dim 0), got a scalar")
    if x.shape[0] % n:
        raise ShapeError(
            f"dim 0 of x ({x.shape[0]}) must be divisible by the group size {n} "
            f"(rank_list {attrs['rank_list']})"
        )
    return x.with_shape((x.shape[0] // n,) + x.shape[1:])


def _reduce_scatter_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    op = node.attrs["op"]
    if op != "sum":
        raise PcompileError(f"{node.where()}: ReduceScatter(op={op!r}) has no gradient rule")
    return [b("AllGather", cot, **_comm_attrs(node))]


def _reduce_scatter_received(operand: int, result: int, n: int) -> int:
    """n - 1 blocks of its own (the result's) size."""
    return result * (n - 1)


collective("ReduceScatter", _reduce_scatter_infer, vjp=_reduce_scatter_vjp,
           comm=CommFacts(_reduce_scatter_received, _spread_ring, fusion_key="reducescatter"),
           attrs={"op": "sum", **_COMM_DEFAULTS},
           doc="Reduces x over the group and gives rank i the i-th of n blocks along dim 0. vjp "
               "(op sum only): AllGather.",
           operands="x; `op`, `group`, `rank_list`, `fusion` (scatters dim 0)",
           tests=("test_ops_comm.py::test_gather_scatter_shapes",
                  "test_ops_comm.py::test_reduce_scatter_vjp_is_all_gather"))

# -- AlltoAll -------------------------------------------------------------------------------


def _all_to_all_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    n = _group_size(attrs)
    k, split, concat = attrs["split_count"], attrs["split_dim"], attrs["concat_dim"]
    if not all(_is_int(v) for v in (k, split, concat)):
        raise ShapeError(
            f"split_count, split_dim and concat_dim must be ints, got {k!r}, {split!r}, {concat!r}"
        )
    if k != n:
        raise ShapeError(
            f"split_count {k} must equal the group size {n} (rank_list {attrs['rank_list']})"
        )
    if x.rank == 0:
        raise ShapeError("x must have rank >= 1, got a scalar")
    split = normalize_axis(split, x.rank, "split_dim")
    concat = normalize_axis(concat, x.rank, "concat_dim")
    if x.shape[split] % k:
        raise ShapeError(
            f"dim {split} of x ({x.shape[split]}) must be divisible by split_count {k}"
        )
    shape = list(x.shape)
    shape[split] //= k
    shape[concat] *= k
    return x.with_shape(tuple(shape))


def _all_to_all_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    a = node.attrs
    return [
        b(
            "AlltoAll",
            cot,
            split_count=a["split_count"],
            split_dim=a["concat_dim"],
            concat_dim=a["split_dim"],
            **_comm_attrs(node),
        )
    ]


def _all_to_all_received(operand: int, result: int, n: int) -> int:
    """(n - 1) / n of the operand: every block but its own."""
    return operand * (n - 1) // n


collective("AlltoAll", _all_to_all_infer, vjp=_all_to_all_vjp,
           comm=CommFacts(_all_to_all_received, _spread_ring),
           attrs={"split_count": 1, "split_dim": 0, "concat_dim": 0, **_COMM_DEFAULTS},
           doc="Splits x into split_count blocks along split_dim, sends block i to the i-th rank "
               "and concatenates the received blocks along concat_dim. split_count must equal "
               "len(rank_list). vjp: AlltoAll with split_dim and concat_dim swapped.",
           operands="x; `split_count`, `split_dim`, `concat_dim`, `group`, `rank_list`",
           tests=("test_ops_comm.py::test_shape_inference",
                  "test_ops_comm.py::test_all_to_all_vjp_swaps_dims"))

# -- Broadcast ------------------------------------------------------------------------------


def _broadcast_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    _group_size(attrs)
    root = attrs["root_rank"]
    if not _is_int(root) or root < 0:
        raise ShapeError(f"root_rank must be a non-negative int, got {root!r}")
    return x


def _broadcast_ring(size: int, n: int) -> int:
    """A chain Broadcast: the root and each relay send the tensor once."""
    return size


collective("Broadcast", _broadcast_infer, vjp=None, attrs={"root_rank": 0, **_COMM_DEFAULTS},
           comm=CommFacts(_operand_received, _broadcast_ring),
           doc="Every rank receives the root_rank's x. Not differentiable here: the correct "
               "gradient (sum of the cotangents onto the root, zero elsewhere) needs a "
               "rank-dependent op; MindSpore's own bprop passes the cotangent through unchanged.",
           operands="x; `root_rank`, `group`, `rank_list`",
           tests=("test_ops_comm.py::test_shape_inference",
                  "test_ops_comm.py::test_broadcast_is_not_differentiable"))

# -- _MirrorOperator ------------------------------------------------------------------------


def _mirror_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    _group_size(attrs)
    _flag(attrs, "mean_flag")
    dev_num = attrs["dev_num"]
    if not _is_int(dev_num) or dev_num < 1:
        raise ShapeError(f"dev_num must be a positive int, got {dev_num!r}")
    if not isinstance(attrs["parameter"], str):
        raise ShapeError(f"parameter must be a str, got {attrs['parameter']!r}")
    return x


def _mirror_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    grad = _sum_collective(b, "AllReduce", cot, node)
    if node.attrs["mean_flag"]:
        grad = b("Mul", grad, 1.0 / node.attrs["dev_num"])
    return [grad]


def _identity_np(x: Any, **_: Any) -> Any:
    return x.copy()


def _identity_jax(x: Any, **_: Any) -> Any:
    return x


define("_MirrorOperator", _mirror_infer, _identity_np, _identity_jax, vjp=_mirror_vjp,
       # the identity when run; its bytes stand for its vjp's gradient AllReduce
       comm=CommFacts(_operand_received, _all_reduce_ring),
       attrs={**_COMM_DEFAULTS, "dev_num": 1, "mean_flag": False, "parameter": ""}, num_inputs=1,
       doc="Forward identity placed after a parameter; vjp: AllReduce(sum) of the gradient over "
           "the parameter's mirror group, times 1/dev_num if mean_flag.", section="compiler",
       operands="x (identity; its vjp all-reduces a parameter's gradient)", dtypes=ALL,
       rule="*no strategy*: inserted per rank by the parallel passes",
       tests=("test_ops_comm.py::test_mirror_vjp_is_all_reduce",
              "test_ops_comm.py::test_virtual_ops_single_rank"),
       spelling="inserted by the compiler")

# -- _VirtualDiv ----------------------------------------------------------------------------


def _virtual_div_infer(types: list[ValueType], attrs: dict[str, Any]) -> ValueType:
    x = tensor(types[0], "x")
    divisor = attrs["divisor"]
    if not _is_int(divisor) or divisor < 1:
        raise ShapeError(f"divisor must be a positive int, got {divisor!r}")
    return x


def _virtual_div_vjp(b: Builder, node: Node, cot: Value) -> list[Value | None]:
    return [b("RealDiv", cot, float(node.attrs["divisor"]))]


define("_VirtualDiv", _virtual_div_infer, _identity_np, _identity_jax, vjp=_virtual_div_vjp,
       attrs={"divisor": 1}, num_inputs=1,
       doc="Forward identity on the loss; vjp: cotangent / divisor (the loss repeat count).",
       section="compiler",
       operands="x; `divisor` (identity; its vjp divides by the loss's repeat count)", dtypes=ALL,
       rule="*no strategy*: inserted per rank by the parallel passes",
       tests=("test_ops_comm.py::test_virtual_div_vjp_divides",
              "test_ops_comm.py::test_virtual_ops_single_rank"),
       spelling="inserted by the compiler")
