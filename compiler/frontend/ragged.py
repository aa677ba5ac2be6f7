"""`ops.AlltoAllV`: MindSpore's all-to-all with counts known only at run time (mindformers'
MoEV3 dispatch and combine), over static capacity bounds.

`AlltoAllV(group, block_size)(x, send_list, recv_list)`: x a flat tensor of blocks of
`block_size` elements; member j of the group gets the next `send_list[j]` blocks of x, in
order; this rank's result is the blocks it receives, `recv_list[j]` of them from member j, in
member order. The counts are tensors (the step computes them), so the result's length is not
known when the program is compiled. pcompile gives it a static bound and fills the blocks past
the received ones with zeros:

* the blocks every member could send at most: the group size times x's blocks (each member
  sending all of its x here), unless
* the call undoes an earlier one (its send_list is that call's recv_list tensor and its
  recv_list that call's send_list, as MoEV3's combine undoes its dispatch): then that call's
  input length, so the combine's result has the shape of the dispatch's input.

The lowering is one AlltoAll of padded buffers plus masks, the same math as a ragged
all-to-all: each member's blocks are gathered into a (group, capacity, block) buffer (capacity
= x's blocks, zeros past `send_list[j]`), exchanged with the fixed-size AlltoAll, and the
received blocks gathered back together by the exclusive sums of recv_list. XLA's
`ragged-all-to-all` (`jax.lax.ragged_all_to_all`) would move only the blocks sent, but XLA:CPU
does not implement it (the tests and the gloo processes run on CPU); the padded buffers move
capacity blocks per member. Being IR ops (Gather, CumSum, comparisons, AlltoAll), it runs on
both backends and differentiates as they do: the gradient is the AlltoAllV back, with the
counts swapped.

The group is the world group or one `create_group` made (compiler/frontend/communication.py): inside
a Morph region, each rank's own group of the like groups (mindformers' expert-parallel groups
of ep ranks, ep smaller than the devices); the padded AlltoAll runs over it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.compiler.frontend.primitive import Primitive
from pcompile.compiler.frontend.tensor import Tensor

# (id(send_list), id(recv_list)) of each traced call -> (its input's blocks, the two tensors,
# kept alive so that their ids are not reused)
_CALLS: dict[tuple[int, int], tuple[int, Any, Any]] = {}


class AlltoAllV(Primitive):
    """`AlltoAllV(group="nccl_world_group", block_size=1)(x, send_list, recv_list)`: module
    docstring."""

    op = "AlltoAllV"

    def __init__(self, group: str = "nccl_world_group", block_size: int = 1) -> None:
        from pcompile.compiler.frontend.ops import _world

        name, ranks = _world(group, "AlltoAllV")
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
                or block_size < 1:
            raise TypeError(f"For 'AlltoAllV', the 'block_size' must be an int >= 1, got "
                            f"{block_size!r}")
        super().__init__(group=name, block_size=int(block_size))
        self.ranks, self.group = ranks, group

    def __call__(self, x: Any, send_list: Any, recv_list: Any) -> Any:
        from pcompile.compiler.frontend import ops

        n, block = len(self.ranks), int(self.attrs["block_size"])
        send, recv = (_counts(v, n, what) for v, what in ((send_list, "send_list"),
                                                           (recv_list, "recv_list")))
        if not isinstance(x, Tensor):
            x = Tensor(np.asarray(x))
        size = int(np.prod(x.shape))
        if x.ndim != 1 or size % block:
            raise ValueError(f"For 'AlltoAllV', x must be a flat tensor of whole blocks of "
                             f"block_size {block} elements, got shape {tuple(x.shape)}")
        rows = size // block
        undone = _CALLS.get((id(recv_list), id(send_list)))
        out_rows = undone[0] if undone is not None else n * rows
        _CALLS[(id(send_list), id(recv_list))] = (rows, send_list, recv_list)
        blocks = ops.Reshape()(x, (rows, block))
        if n == 1:  # a world of one: the blocks it sends itself
            kept = blocks if out_rows == rows else _resize(blocks, out_rows)
            return ops.Reshape()(_mask_rows(kept, recv, out_rows), (out_rows * block,))
        packed = _pack(blocks, send, n, rows)                        # (n * rows, block)
        exchanged = ops.AlltoAll(n, 0, 0, self.group)(packed)        # (n * rows, block)
        out = _unpack(exchanged, recv, n, rows, out_rows)            # (out_rows, block)
        return ops.Reshape()(out, (out_rows * block,))


def _counts(value: Any, n: int, what: str) -> Any:
    from pcompile.compiler.frontend import ops

    if isinstance(value, (list, tuple)):
        value = Tensor(np.asarray(value, np.int32))
    if not isinstance(value, Tensor) or tuple(value.shape) != (n,):
        raise ValueError(f"For 'AlltoAllV', {what} must hold one count per member of the "
                         f"group ({n},), got {getattr(value, 'shape', value)!r}")
    return ops.Cast()(value, "int32")


def _iota(count: int, shape: tuple[int, ...] | None = None) -> Tensor:
    """0 .. count - 1 as an Int32 constant of `shape` (built in numpy: a constant is never an
    op's operand only to be reshaped)."""
    return Tensor(np.arange(count, dtype=np.int32).reshape(shape or (count,)))


def _exclusive(counts: Any) -> Any:
    from pcompile.compiler.frontend import ops

    return ops.CumSum(exclusive=True)(counts, 0)


def _pack(blocks: Any, send: Any, n: int, rows: int) -> Any:
    """(n * rows, block): member j's blocks at [j * rows, j * rows + send[j]), zeros after."""
    from pcompile.compiler.frontend import ops

    offsets = ops.Reshape()(_exclusive(send), (n, 1))
    slot = _iota(rows, (1, rows))
    index = ops.Add()(offsets, slot)                                   # (n, rows)
    index = ops.Minimum()(index, rows - 1)
    keep = ops.Less()(slot, ops.Reshape()(send, (n, 1)))               # (n, rows)
    gathered = ops.Gather()(blocks, ops.Reshape()(index, (n * rows,)), 0)
    mask = ops.Cast()(ops.Reshape()(keep, (n * rows, 1)), blocks.dtype)
    return ops.Mul()(gathered, mask)


def _unpack(exchanged: Any, recv: Any, n: int, rows: int, out_rows: int) -> Any:
    """(out_rows, block): row t from member j, j the member whose received run holds t, at
    j * rows + t - (recv's exclusive sum at j); zeros past the received rows."""
    from pcompile.compiler.frontend import ops

    ends = ops.CumSum()(recv, 0)                                       # inclusive
    t = _iota(out_rows, (out_rows, 1))
    passed = ops.Cast()(ops.LessEqual()(ops.Reshape()(ends, (1, n)), t), "int32")
    member = ops.ReduceSum(keep_dims=False)(passed, 1)                 # (out_rows,)
    valid = ops.Less()(member, n)
    member = ops.Minimum()(member, n - 1)
    start = ops.Gather()(_exclusive(recv), member, 0)
    index = ops.Add()(ops.Mul()(member, rows), ops.Sub()(_iota(out_rows), start))
    index = ops.Maximum()(ops.Minimum()(index, n * rows - 1), 0)
    gathered = ops.Gather()(exchanged, index, 0)
    mask = ops.Cast()(ops.Reshape()(valid, (out_rows, 1)), exchanged.dtype)
    return ops.Mul()(gathered, mask)


def _resize(blocks: Any, out_rows: int) -> Any:
    from pcompile.compiler.frontend import ops

    rows = blocks.shape[0]
    index = Tensor(np.minimum(np.arange(out_rows), rows - 1).astype(np.int32))
    return ops.Gather()(blocks, index, 0)


def _mask_rows(blocks: Any, recv: Any, out_rows: int) -> Any:
    from pcompile.compiler.frontend import ops

    t = _iota(out_rows)
    keep = ops.Less()(t, ops.ReduceSum(keep_dims=False)(recv, 0))
    mask = ops.Cast()(ops.Reshape()(keep, (out_rows, 1)), blocks.dtype)
    return ops.Mul()(blocks, mask)
