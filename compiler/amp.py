"""MindSpore's automatic mixed precision: `amp.auto_mixed_precision(network, amp_level, dtype)`.

What MindSpore does (mindspore.amp.auto_mixed_precision, summarised): the low-precision type is
float16 (default) or bfloat16; the cells and primitives it converts get their inputs and
parameters cast to it, and their results cast back to float32.

* `O0`: nothing changes.
* `O1`: only the white list runs in low precision: cells `nn.Dense`, `nn.Conv2d` and primitives
  `MatMul`, `BatchMatMul`, `Conv2D`, `PReLU`, `ReLU` (inputs cast down, result cast back to
  float32 at each of them).
* `O2`: the whole network in low precision except the black list (`nn.LayerNorm`,
  `nn.BatchNorm*`), which keeps float32 (its result goes back to the low-precision type); the
  network's outputs are cast to float32 (the loss is computed in float32).
* `O3`: the whole network in low precision; its outputs cast to float32.

Parameters keep float32 (master weights; each use is a Cast, whose gradient brings the gradient
back to float32), so the optimizer updates float32 values. Every Cast is a node of the traced
graph and shows in the dumps. pcompile inserts no loss scaling for float16 by itself: wrap the
network in a loss-scaling training cell (docs/user-guide.md) when float16 gradients underflow.
"""

from __future__ import annotations

from typing import Any

from pcompile.ir.types import DType

AMP_LEVELS = ("O0", "O1", "O2", "O3")
WHITE_CELLS = ("Dense", "Conv2d")
WHITE_PRIMITIVES = ("MatMul", "BatchMatMul", "Conv2D", "PReLU", "ReLU")
BLACK_CELLS = ("LayerNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d")


def _low(dtype: Any) -> DType:
    try:
        low = DType.from_any(dtype)
    except (TypeError, ValueError):
        low = None
    if low not in (DType.float16, DType.bfloat16):
        raise ValueError(f"For 'auto_mixed_precision', the argument 'dtype' must be float16 or "
                         f"bfloat16, but got {dtype!r}")
    return low


def auto_mixed_precision(network: Any, amp_level: str = "O0",
                         dtype: Any = DType.float16) -> Any:
    """Convert `network` for mixed precision at `amp_level` (module docstring); returns it."""
    from pcompile.compiler.nn.cell import Cell

    if not isinstance(network, Cell):
        raise TypeError(f"For 'auto_mixed_precision', the argument 'network' must be a Cell, "
                        f"but got {type(network).__name__}")
    if amp_level not in AMP_LEVELS:
        raise ValueError(f"For 'auto_mixed_precision', the argument 'amp_level' must be one of "
                         f"{', '.join(AMP_LEVELS)}, but got {amp_level!r}")
    low = _low(dtype)
    if amp_level == "O0":
        return network
    if amp_level == "O1":
        for _, cell in network.cells_and_names():
            if type(cell).__name__ in WHITE_CELLS:
                cell.to_float(low)
                object.__setattr__(cell, "_output_dtype", DType.float32)
            for prim in cell._primitives.values():
                if prim.op in WHITE_PRIMITIVES:
                    prim._amp_dtype = low
        return network
    network.to_float(low)
    if amp_level == "O2":
        for _, cell in network.cells_and_names():
            if type(cell).__name__ in BLACK_CELLS:
                cell.to_float(DType.float32)
                object.__setattr__(cell, "_output_dtype", low)
    object.__setattr__(network, "_output_dtype", DType.float32)
    return network
