"""MindSpore-style losses: `MSELoss`, `L1Loss`, `SoftmaxCrossEntropyWithLogits`,
`CrossEntropyLoss`, and `WithLossCell` (network + loss in one Cell).

Losses hold their primitives as attributes, so the nodes they emit have readable instance names
(`square`, `reduce_mean`, `softmax_cross_entropy`, ...). `reduction` is 'mean' (over every
element), 'sum' or 'none', as MindSpore's `LossBase`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pcompile.compiler.frontend import ops
from pcompile.compiler.frontend.nn.cell import Cell
from pcompile.compiler.frontend.nn.layers import LayerInputError, check_bool, check_number
from pcompile.compiler.frontend.tensor import Tensor
from pcompile.compiler.frontend.tracing import current_tracer
from pcompile.ir.types import DType

__all__ = [
    "CrossEntropyLoss",
    "L1Loss",
    "LossBase",
    "MSELoss",
    "SoftmaxCrossEntropyWithLogits",
    "WithLossCell",
]

_REDUCTIONS = ("mean", "sum", "none")
_INT_TYPES = (DType.int32, DType.int64)


def _check_reduction(reduction: Any, owner: str) -> str:
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(
            f"{owner}: reduction must be one of 'mean', 'sum', 'none', got {reduction!r}"
        )
    return reduction.lower()


def _input_error(cell: Cell, message: str) -> LayerInputError:
    tracer = current_tracer()
    where = f" in scope {tracer.scope}" if tracer is not None else ""
    return LayerInputError(f"{type(cell).__name__}{where}: {message}")


def _scalar(value: float, dtype: DType) -> Tensor:
    return Tensor(np.asarray(value, dtype.np))


class LossBase(Cell):
    """Base of the losses: `get_loss(x)` applies the reduction."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction, type(self).__name__)
        self.reduce_mean = ops.ReduceMean()
        self.reduce_sum = ops.ReduceSum()

    def get_loss(self, x: Tensor) -> Tensor:
        """`x` reduced over all dims ('mean' / 'sum') or as it is ('none')."""
        axes = tuple(range(len(x.shape)))
        if self.reduction == "mean":
            return self.reduce_mean(x, axes)
        if self.reduction == "sum":
            return self.reduce_sum(x, axes)
        return x


class MSELoss(LossBase):
    """(logits - labels)^2, reduced; logits and labels broadcast against each other."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.sub = ops.Sub()
        self.square = ops.Square()

    def construct(self, logits: Tensor, labels: Tensor) -> Tensor:
        return self.get_loss(self.square(self.sub(logits, labels)))


class L1Loss(LossBase):
    """|logits - labels|, reduced. |d| is computed as max(d, -d) (its gradient is sign(d),
    0 where d == 0, as for `jnp.abs`)."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.sub = ops.Sub()
        self.neg = ops.Neg()
        self.maximum = ops.Maximum()

    def construct(self, logits: Tensor, labels: Tensor) -> Tensor:
        diff = self.sub(logits, labels)
        return self.get_loss(self.maximum(diff, self.neg(diff)))


class SoftmaxCrossEntropyWithLogits(LossBase):
    """Cross entropy between softmax(logits) and labels, logits (N, C).

    `sparse=False`: labels are (N, C) probabilities. `sparse=True`: labels are (N,) class ids,
    one-hot encoded internally; with `reduction='mean'` MindSpore uses the fused
    `SparseSoftmaxCrossEntropyWithLogits` op, and so do we. Default reduction 'none' (per-sample
    losses (N,)), as MindSpore."""

    def __init__(self, sparse: bool = False, reduction: str = "none") -> None:
        super().__init__(reduction)
        self.sparse = check_bool(sparse, "sparse", "SoftmaxCrossEntropyWithLogits")
        self.softmax_cross_entropy = ops.SoftmaxCrossEntropyWithLogits()
        self.sparse_softmax_cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.one_hot = ops.OneHot()

    def construct(self, logits: Tensor, labels: Tensor) -> Tensor:
        if len(logits.shape) != 2:
            raise _input_error(self, f"logits must be (N, C), got shape {logits.shape}")
        n, classes = logits.shape
        if self.sparse:
            if labels.dtype not in _INT_TYPES or tuple(labels.shape) != (n,):
                raise _input_error(
                    self,
                    f"with sparse=True labels must be int32/int64 class ids of shape ({n},), got "
                    f"{labels.dtype.value} {labels.shape}",
                )
            if self.reduction == "mean":
                return self.sparse_softmax_cross_entropy(logits, labels)
            labels = self.one_hot(
                labels, classes, _scalar(1.0, logits.dtype), _scalar(0.0, logits.dtype)
            )
        elif tuple(labels.shape) != (n, classes) or labels.dtype != logits.dtype:
            raise _input_error(
                self,
                f"with sparse=False labels must be {logits.dtype.value} probabilities of shape "
                f"({n}, {classes}), got {labels.dtype.value} {labels.shape}; pass sparse=True "
                "for class ids",
            )
        return self.get_loss(self.softmax_cross_entropy(logits, labels)[0])


class CrossEntropyLoss(LossBase):
    """Cross entropy of logits (N, C) against class ids (N,) or class probabilities (N, C).

    Follows the documented formula of MindSpore's (and PyTorch's) `CrossEntropyLoss`; the
    label-smoothing term is weighted and normalised as PyTorch does (MindSpore's implementation
    leaves it unweighted and divides it by N; the two agree without weights and ignored ids):

    * class ids y: l_i = -sum_c t_ic log softmax(x_i)_c with
      t_ic = v_i * w_c * ((1 - s) [c == y_i] + s / C), where w is `weight` (default ones),
      s = `label_smoothing` and v_i = 0 when y_i == `ignore_index` (or lies outside [0, C)),
      else 1. 'mean' divides sum_i l_i by sum_i v_i w_{y_i} (the number of counted samples
      without weights).
      If every sample is ignored, 'mean' is 0 / 0 = NaN (as PyTorch).
    * probabilities p: t_ic = w_c ((1 - s) p_ic + s / C); 'mean' divides by N.

    Each per-sample loss is one `SoftmaxCrossEntropyWithLogits` node on the target t (its
    gradient is exact for targets that do not sum to 1).
    """

    def __init__(
        self,
        weight: Any = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(reduction)
        owner = "CrossEntropyLoss"
        if weight is not None:
            arr = np.asarray(weight.asnumpy() if isinstance(weight, Tensor) else weight)
            if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "fiu":
                raise ValueError(
                    f"{owner}: weight must be a 1-D array of per-class weights, got "
                    f"{arr.dtype} {arr.shape}"
                )
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"{owner}: weight must be finite and >= 0")
            weight = arr.astype(np.float64)
        self.weight = weight
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
            raise TypeError(f"{owner}: ignore_index must be an int, got {ignore_index!r}")
        self.ignore_index = int(ignore_index)
        smoothing = check_number(label_smoothing, "label_smoothing", owner)
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"{owner}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
        self.label_smoothing = smoothing
        self.one_hot = ops.OneHot()
        self.softmax_cross_entropy = ops.SoftmaxCrossEntropyWithLogits()
        self.mul = ops.Mul()
        self.add = ops.Add()
        self.div = ops.RealDiv()
        self.expand_dims = ops.ExpandDims()

    def _class_weights(self, classes: int, dtype: DType) -> tuple[Tensor | None, Tensor | None]:
        """(w, ignore mask: ones with 0 at ignore_index) as constants; None where all ones."""
        if self.weight is not None and self.weight.shape != (classes,):
            raise _input_error(
                self, f"weight has {self.weight.shape[0]} entries but logits have {classes} classes"
            )
        weight = None if self.weight is None else Tensor(self.weight.astype(dtype.np))
        keep = None
        if 0 <= self.ignore_index < classes:
            mask = np.ones(classes, dtype.np)
            mask[self.ignore_index] = 0
            keep = Tensor(mask)
        return weight, keep

    def construct(self, logits: Tensor, labels: Tensor) -> Tensor:
        if len(logits.shape) != 2:
            raise _input_error(
                self, f"logits must be (N, C); got shape {logits.shape} (reshape them first)"
            )
        n, classes = logits.shape
        dtype = logits.dtype
        weight, keep = self._class_weights(classes, dtype)
        smoothing = self.label_smoothing
        if labels.dtype in _INT_TYPES:
            if tuple(labels.shape) != (n,):
                raise _input_error(
                    self, f"class-id labels must have shape ({n},), got {labels.shape}"
                )
            # Ids outside [0, C) (ignore_index=-100) one-hot to zero rows: they count nowhere.
            hot = self.one_hot(labels, classes, _scalar(1.0, dtype), _scalar(0.0, dtype))
            counted = hot if keep is None else self.mul(hot, keep)  # v_i [c == y_i]
            target = counted if weight is None else self.mul(counted, weight)
            if smoothing > 0.0:
                valid = self.expand_dims(self.reduce_sum(counted, (1,)), 1)  # v_i, (N, 1)
                spread = self.mul(valid, smoothing / classes)
                if weight is not None:
                    spread = self.mul(spread, weight)
                target = self.add(self.mul(target, 1.0 - smoothing), spread)
            losses = self.softmax_cross_entropy(logits, target)[0]
            if self.reduction == "mean":
                # sum_i v_i w_{y_i}; equals the mean's N when nothing is ignored or weighted.
                denominator = self.reduce_sum(
                    counted if weight is None else self.mul(counted, weight), (0, 1)
                )
                return self.div(self.reduce_sum(losses, (0,)), denominator)
            return self.get_loss(losses)
        if labels.dtype != dtype or tuple(labels.shape) != (n, classes):
            raise _input_error(
                self,
                f"labels must be class ids (int32/int64, shape ({n},)) or {dtype.value} "
                f"probabilities of shape ({n}, {classes}); got {labels.dtype.value} "
                f"{labels.shape}",
            )
        target = labels
        if smoothing > 0.0:
            target = self.add(self.mul(target, 1.0 - smoothing), smoothing / classes)
        if weight is not None:
            target = self.mul(target, weight)
        return self.get_loss(self.softmax_cross_entropy(logits, target)[0])


class WithLossCell(Cell):
    """`loss_fn(backbone(data), label)`: a network and its loss as one Cell."""

    def __init__(self, backbone: Cell, loss_fn: Cell) -> None:
        super().__init__(auto_prefix=False)
        for name, value in (("backbone", backbone), ("loss_fn", loss_fn)):
            if not isinstance(value, Cell):
                raise TypeError(
                    f"WithLossCell: {name} must be a Cell, got {type(value).__name__}"
                )
        self._backbone = backbone
        self._loss_fn = loss_fn

    def construct(self, data: Tensor, label: Tensor) -> Tensor:
        out = self._backbone(data)
        return self._loss_fn(out, label)

    @property
    def backbone_network(self) -> Cell:
        return self._backbone

    def finalize_parameter_names(self) -> None:
        """MindSpore's WithLossCell has `auto_prefix=False`: the network's parameters keep
        their own names (`layer1.weight`, not `_backbone.layer1.weight`)."""
        self._backbone.finalize_parameter_names()
        self._loss_fn.finalize_parameter_names()
        super().finalize_parameter_names()


class WithEvalCell(Cell):
    """MindSpore's `nn.WithEvalCell(network, loss_fn, add_cast_fp32=False)`: evaluation of a
    network with its loss, `construct(data, label)` -> (loss, outputs, label); with
    `add_cast_fp32` the outputs and the label are cast to float32 first."""

    def __init__(self, network: Cell, loss_fn: Cell, add_cast_fp32: bool = False) -> None:
        super().__init__(auto_prefix=False)
        for name, value in (("network", network), ("loss_fn", loss_fn)):
            if not isinstance(value, Cell):
                raise TypeError(
                    f"WithEvalCell: {name} must be a Cell, got {type(value).__name__}"
                )
        if not isinstance(add_cast_fp32, bool):
            raise TypeError(f"WithEvalCell: add_cast_fp32 must be a bool, got {add_cast_fp32!r}")
        self._network = network
        self._loss_fn = loss_fn
        self.add_cast_fp32 = add_cast_fp32

    def construct(self, data: Tensor, label: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        from pcompile.compiler.frontend import ops

        outputs = self._network(data)
        if self.add_cast_fp32:
            label = ops.cast(label, DType.float32)
            outputs = ops.cast(outputs, DType.float32)
        loss = self._loss_fn(outputs, label)
        return loss, outputs, label

    def finalize_parameter_names(self) -> None:
        """`auto_prefix=False`, as MindSpore's: the network's parameters keep their names."""
        self._network.finalize_parameter_names()
        self._loss_fn.finalize_parameter_names()
        super().finalize_parameter_names()
