"""MindSpore's high-level `Model(network, loss_fn, optimizer, amp_level=..., **kwargs)`, as far
as a compiler needs it: the training network it builds.

MindSpore's `Model` builds its training network with `amp.build_train_network(network,
optimizer, loss_fn, level=amp_level, boost_level=..., keep_batchnorm_fp32=...,
loss_scale_manager=...)` when it has an optimizer, `nn.WithLossCell(network, loss_fn)` when it
has only a loss, else the bare network; an `amp_level` other than O0 without an optimizer is an
error. A model file's `model()` may return such a `Model`: pcompile compiles its
`train_network`. `Model.train`, `eval` and `predict` run nothing: `pcompile model.py --run`
trains the compiled program.
"""

from __future__ import annotations

from typing import Any

from pcompile.compiler.frontend.amp import build_train_network
from pcompile.ir.errors import PcompileError

_KWARGS = ("keep_batchnorm_fp32", "loss_scale_manager")


class Model:
    """`Model(network, loss_fn=None, optimizer=None, metrics=None, eval_network=None,
    eval_indexes=None, amp_level="O0", boost_level="O0", **kwargs)`; kwargs:
    keep_batchnorm_fp32, loss_scale_manager (passed to `amp.build_train_network`)."""

    def __init__(self, network: Any, loss_fn: Any = None, optimizer: Any = None,
                 metrics: Any = None, eval_network: Any = None, eval_indexes: Any = None,
                 amp_level: str = "O0", boost_level: str = "O0", **kwargs: Any) -> None:
        from pcompile.compiler.frontend.nn.cell import Cell
        from pcompile.compiler.frontend.nn.loss import WithLossCell

        if not isinstance(network, Cell):
            raise TypeError(f"For 'Model', 'network' must be a Cell, but got "
                            f"{type(network).__name__}")
        for name in kwargs:
            if name not in _KWARGS:
                raise ValueError(f"For 'Model', unsupported argument {name!r}: valid are "
                                 f"{', '.join(_KWARGS)}")
        if optimizer is None and amp_level != "O0":
            raise ValueError("For 'Model', amp_level " f"{amp_level!r} needs an optimizer "
                             "(mixed precision is set up with the training step): give "
                             "'optimizer' or set amp_level='O0'")
        self.network = network
        self.metrics = metrics
        self.eval_network = eval_network
        self.eval_indexes = eval_indexes
        self.amp_level = amp_level
        if optimizer is not None:
            self._train_network = build_train_network(network, optimizer, loss_fn,
                                                      level=amp_level,
                                                      boost_level=boost_level, **kwargs)
        elif loss_fn is not None:
            self._train_network = WithLossCell(network, loss_fn)
        else:
            self._train_network = network

    @property
    def train_network(self) -> Any:
        """The cell pcompile compiles when `model()` returns this Model."""
        return self._train_network

    def _runs_nothing(self, *args: Any, **kwargs: Any) -> None:
        raise PcompileError("Model.train/eval/predict: pcompile compiles, it does not run a "
                            "Model; return the Model from model() and run `pcompile "
                            "model.py --run`")

    eval = predict = _runs_nothing

    def train(self, epoch: int, train_dataset: Any = None, callbacks: Any = None,
              dataset_sink_mode: bool = False, sink_size: int = -1, initial_epoch: int = 0,
              **kwargs: Any) -> None:
        """Not run here: one message naming the `pcompile --run` command that trains the
        same way (the steps of `epoch` epochs of `train_dataset` when it knows its size, and
        the options that give `callbacks`' behaviour: compiler/frontend/callbacks.py)."""
        from pcompile.compiler.frontend.callbacks import run_flags

        steps = "N"
        size = getattr(train_dataset, "get_dataset_size", None)
        if callable(size) and isinstance(epoch, int) and not isinstance(epoch, bool):
            per_epoch = size()
            if isinstance(per_epoch, int) and per_epoch > 0:
                steps = str(max(0, epoch - int(initial_epoch or 0)) * per_epoch)
        flags = " ".join(["--run", "--steps", steps, *run_flags(callbacks)])
        raise PcompileError(
            "Model.train: pcompile compiles, it does not run a Model: return the Model from "
            "model(), give the data set from dataset() and the callbacks from callbacks(), and "
            f"run `pcompile model.py {flags}` (the rank programs call the callbacks; those "
            "options are what the built-in ones set)")
