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
graph and shows in the dumps.

`build_train_network(network, optimizer, loss_fn, level, **kwargs)` is where MindSpore spells
`amp_level` for training (its `Model(amp_level=...)` calls it; `set_context` has no amp option):

* `O0`, `O1`: `auto_mixed_precision(network, level)` (float16), a plain `TrainOneStepCell`.
* `O2`: the network in float16 (`cast_model_type`) with the black list kept float32
  (`keep_batchnorm_fp32=True`), and a `DynamicLossScaleManager()` (2^24, factor 2, window 2000):
  the step is a `TrainOneStepWithLossScaleCell` with a `DynamicLossScaleUpdateCell`.
* `O3`: the network in float16, black list included, no loss scale.
* `auto`: O2 for `device_target` GPU, O3 for Ascend.

`loss_fn` given: the loss is computed in float32 on the network's output cast to float32.
Without it, the network computes its own loss at the network's precision, as in MindSpore.
`cast_model_type` (float16, float32, and bfloat16 in pcompile), `keep_batchnorm_fp32` and
`loss_scale_manager` override the level's choices.
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
    from pcompile.compiler.frontend.nn.cell import Cell

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


# -- build_train_network -------------------------------------------------------------------


class LossScaleManager:
    """Base of the loss scale managers `build_train_network` accepts (MindSpore's
    `amp.LossScaleManager`): `get_loss_scale()` and `get_update_cell()`."""

    def get_loss_scale(self) -> float:
        raise NotImplementedError

    def get_update_cell(self) -> Any:
        raise NotImplementedError


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale. With `drop_overflow_update` (default) the step is a
    `TrainOneStepWithLossScaleCell` with a `FixedLossScaleUpdateCell` (an overflowing step is
    skipped); without it, a `TrainOneStepCell(sens=loss_scale)` whose gradients stay scaled (as
    in MindSpore, give the optimizer the same `loss_scale` to divide them)."""

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        if not isinstance(loss_scale, (int, float)) or isinstance(loss_scale, bool) \
                or loss_scale < 1:
            raise ValueError("For 'FixedLossScaleManager', the argument 'loss_scale' must be "
                             f"a number >= 1, but got {loss_scale!r}")
        self._loss_scale = float(loss_scale)
        self._drop_overflow_update = bool(drop_overflow_update)

    def get_loss_scale(self) -> float:
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        return self._drop_overflow_update

    def get_update_cell(self) -> Any:
        from pcompile.compiler.frontend.nn.wrap import FixedLossScaleUpdateCell

        if not self._drop_overflow_update:
            return None
        return FixedLossScaleUpdateCell(self._loss_scale)


class DynamicLossScaleManager(LossScaleManager):
    """MindSpore's defaults: start at 2^24, divide by `scale_factor` on overflow, multiply by it
    after `scale_window` steps without one (`nn.DynamicLossScaleUpdateCell`)."""

    def __init__(self, init_loss_scale: float = 2.0 ** 24, scale_factor: int = 2,
                 scale_window: int = 2000) -> None:
        if not isinstance(init_loss_scale, (int, float)) or isinstance(init_loss_scale, bool) \
                or init_loss_scale < 1:
            raise ValueError("For 'DynamicLossScaleManager', the argument 'init_loss_scale' "
                             f"must be a number >= 1, but got {init_loss_scale!r}")
        for name, value in (("scale_factor", scale_factor), ("scale_window", scale_window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"For 'DynamicLossScaleManager', the argument '{name}' must "
                                 f"be a positive int, but got {value!r}")
        self.loss_scale = float(init_loss_scale)
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def get_loss_scale(self) -> float:
        return self.loss_scale

    def get_drop_overflow_update(self) -> bool:
        return True

    def get_update_cell(self) -> Any:
        from pcompile.compiler.frontend.nn.wrap import DynamicLossScaleUpdateCell

        return DynamicLossScaleUpdateCell(self.loss_scale, self.scale_factor, self.scale_window)


def _config_level(level: str) -> dict[str, Any]:
    """What each level sets (MindSpore's table; a fresh manager each call)."""
    low = level in ("O2", "O3")
    return {"keep_batchnorm_fp32": level == "O2",
            "cast_model_type": DType.float16 if low else DType.float32,
            "loss_scale_manager": DynamicLossScaleManager() if level == "O2" else None}


def _check_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    for name in kwargs:
        if name not in ("cast_model_type", "keep_batchnorm_fp32", "loss_scale_manager"):
            raise ValueError(f"For 'build_train_network', unsupported argument {name!r}: valid "
                             "are cast_model_type, keep_batchnorm_fp32, loss_scale_manager")
    if "cast_model_type" in kwargs:
        try:
            cast = DType.from_any(kwargs["cast_model_type"])
        except (TypeError, ValueError):
            cast = None
        if cast not in (DType.float16, DType.bfloat16, DType.float32):
            raise ValueError("For 'build_train_network', 'cast_model_type' must be float16, "
                             f"bfloat16 or float32, but got {kwargs['cast_model_type']!r}")
        out["cast_model_type"] = cast
    if "keep_batchnorm_fp32" in kwargs and not isinstance(kwargs["keep_batchnorm_fp32"], bool):
        raise TypeError("For 'build_train_network', 'keep_batchnorm_fp32' must be a bool, but "
                        f"got {type(kwargs['keep_batchnorm_fp32']).__name__}")
    manager = kwargs.get("loss_scale_manager")
    if manager is not None and not isinstance(manager, LossScaleManager):
        raise TypeError("For 'build_train_network', 'loss_scale_manager' must be None or an "
                        "amp.LossScaleManager (amp.DynamicLossScaleManager, "
                        f"amp.FixedLossScaleManager), but got {type(manager).__name__}")
    return out


def _check_level(level: Any, boost_level: Any) -> str:
    from pcompile.compiler.config.general_context import get_context

    if level not in AMP_LEVELS + ("auto",):
        raise ValueError("For 'build_train_network', the argument 'level' must be one of "
                         f"{', '.join(AMP_LEVELS)}, auto, but got {level!r}")
    if boost_level != "O0":
        raise ValueError("For 'build_train_network', pcompile supports only boost_level='O0' "
                         f"(mindspore.boost is not built), but got {boost_level!r}")
    if level == "auto":
        target = get_context("device_target")
        if target == "GPU":
            return "O2"
        if target == "Ascend":
            return "O3"
        raise ValueError("For 'build_train_network', level 'auto' needs set_context("
                         f"device_target='GPU' or 'Ascend'), but device_target is {target!r}")
    return str(level)


def _keep_black_list_fp32(network: Any, low: DType) -> None:
    for _, cell in network.cells_and_names():
        if cell is not network and type(cell).__name__ in BLACK_CELLS:
            cell.to_float(DType.float32)
            object.__setattr__(cell, "_output_dtype", low)


def _amp_with_loss_cell(backbone: Any, loss_fn: Any) -> Any:
    """`loss_fn(backbone(data), label)` with the backbone's float output and a float label
    cast to float32 first: the loss of a low-precision network is computed in float32."""
    from pcompile.compiler.frontend import ops
    from pcompile.compiler.frontend.nn import loss

    # named as MindSpore's amp names its own: the dumps' scope reads `network-WithLossCell`
    class WithLossCell(loss.WithLossCell):
        def construct(self, data: Any, label: Any) -> Any:
            out = self._backbone(data)
            return self._loss_fn(_to_fp32(out), _to_fp32(label))

    def _to_fp32(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is not None and DType.from_any(dtype).is_float \
                and DType.from_any(dtype) != DType.float32:
            return ops.cast(x, DType.float32)  # type: ignore[misc]  # mypy#5345
        return x

    return WithLossCell(backbone, loss_fn)


def build_train_network(network: Any, optimizer: Any, loss_fn: Any = None, level: str = "O0",
                        boost_level: str = "O0", **kwargs: Any) -> Any:
    """MindSpore's `amp.build_train_network`: convert `network` for `level` (module docstring),
    add `loss_fn` (computed in float32 when the network is low
    precision), and wrap it in a training step: `nn.TrainOneStepWithLossScaleCell` with the
    loss scale manager's update cell (O2's default: `DynamicLossScaleManager()`), else
    `nn.TrainOneStepCell`. `kwargs`: cast_model_type, keep_batchnorm_fp32, loss_scale_manager
    override the level's choices."""
    from pcompile.compiler.frontend.nn.cell import Cell
    from pcompile.compiler.frontend.nn.loss import WithLossCell
    from pcompile.compiler.frontend.nn.optim_base import Optimizer
    from pcompile.compiler.frontend.nn.wrap import TrainOneStepCell, TrainOneStepWithLossScaleCell

    if not isinstance(network, Cell):
        raise TypeError("For 'build_train_network', the argument 'network' must be a Cell, "
                        f"but got {type(network).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError("For 'build_train_network', the argument 'optimizer' must be an nn "
                        f"optimizer, but got {type(optimizer).__name__}")
    level = _check_level(level, boost_level)
    config = dict(_config_level(level), **_check_kwargs(kwargs))
    cast = config["cast_model_type"]
    if cast != DType.float32:
        network.to_float(cast)
        if config["keep_batchnorm_fp32"]:
            _keep_black_list_fp32(network, cast)
    elif not config["keep_batchnorm_fp32"] and level == "O2":
        network.to_float(DType.float16)
    elif level in ("O0", "O1"):
        network = auto_mixed_precision(network, level)
    if loss_fn is not None:
        if not isinstance(loss_fn, Cell):
            raise TypeError("For 'build_train_network', the argument 'loss_fn' must be a Cell "
                            f"or None, but got {type(loss_fn).__name__}")
        network = (_amp_with_loss_cell(network, loss_fn) if cast != DType.float32
                   else WithLossCell(network, loss_fn))
    manager = config["loss_scale_manager"]
    if manager is not None:
        update_cell = manager.get_update_cell()
        if update_cell is not None:
            return TrainOneStepWithLossScaleCell(network, optimizer,
                                                 scale_sense=update_cell).set_train()
    sens = manager.get_loss_scale() if manager is not None else None
    return TrainOneStepCell(network, optimizer, sens).set_train()
