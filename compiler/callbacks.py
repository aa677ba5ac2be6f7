"""MindSpore's training callbacks, `mindspore.train.callback` (also `mindspore.train` and
`mindspore`): `Callback`, `LossMonitor`, `TimeMonitor`, `CheckpointConfig`, `ModelCheckpoint`.

A ported script builds them for `Model.train(epoch, dataset, callbacks=[...])`. pcompile
compiles a model file and its run loop (`pcompile MODEL.py --run`, the rank programs) gives
their behaviour through options, so each callback says which (`run_flags`), and
`Model.train` names the command that runs the same training:

* `LossMonitor(per_print_times=k)`: a loss line every k steps (`--print-every k`; 0 prints
  none: `-q`), in MindSpore's `epoch: E step: S, loss is L` form;
* `TimeMonitor(data_size=None)`: the step time (always reported: the summary's ms/step after
  the first step, and `step_time_ms` of every line of metrics.jsonl);
* `ModelCheckpoint(prefix, directory, config=CheckpointConfig(save_checkpoint_steps=s,
  keep_checkpoint_max=m))`: a checkpoint every s steps (`--checkpoint-every s`), the newest m
  kept (`--keep-checkpoint-max m`); pcompile's checkpoints are per rank, in safetensors, under
  DIR/checkpoints (`pcompile-merge DIR` gathers them), whatever `prefix` and `directory` say.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pcompile.ir.errors import PcompileError

# `pcompile.train` is this module (pcompile/__init__.py's aliases); `__path__` lets
# `import pcompile.train.callback` (also this module) resolve
__path__: list[str] = []


def _count(value: Any, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"For '{what}', the value must be an int >= {least}, but got {value!r}")
    return int(value)


class Callback:
    """MindSpore's `Callback`: a subclass's `on_train_*` / `step_end` hooks are kept for the
    script's sake; pcompile's run loop does not call them (it runs compiled programs)."""

    def run_flags(self) -> list[str]:
        """The `pcompile --run` options that give this callback's behaviour."""
        return []

    def on_train_begin(self, run_context: Any) -> None:
        """Called by MindSpore before training; not by pcompile."""

    def on_train_epoch_begin(self, run_context: Any) -> None:
        """Called by MindSpore at each epoch's start; not by pcompile."""

    def on_train_step_begin(self, run_context: Any) -> None:
        """Called by MindSpore before each step; not by pcompile."""

    def on_train_step_end(self, run_context: Any) -> None:
        """Called by MindSpore after each step; not by pcompile."""

    def on_train_epoch_end(self, run_context: Any) -> None:
        """Called by MindSpore at each epoch's end; not by pcompile."""

    def on_train_end(self, run_context: Any) -> None:
        """Called by MindSpore after training; not by pcompile."""

    # MindSpore's older names
    begin = on_train_begin
    epoch_begin = on_train_epoch_begin
    step_begin = on_train_step_begin
    step_end = on_train_step_end
    epoch_end = on_train_epoch_end
    end = on_train_end


class LossMonitor(Callback):
    """`LossMonitor(per_print_times=1)`: the loss every `per_print_times` steps (0: never);
    pcompile's `--print-every` (the last step's line is always printed)."""

    def __init__(self, per_print_times: int = 1) -> None:
        self.per_print_times = _count(per_print_times, "LossMonitor", 0)

    def run_flags(self) -> list[str]:
        if self.per_print_times == 0:
            return ["-q"]
        return [] if self.per_print_times == 1 else ["--print-every", str(self.per_print_times)]


class TimeMonitor(Callback):
    """`TimeMonitor(data_size=None, data_time=False)`: the time of each step; pcompile
    always reports it (the summary, metrics.jsonl's `step_time_ms`)."""

    def __init__(self, data_size: int | None = None, data_time: bool = False) -> None:
        self.data_size = None if data_size is None else _count(data_size, "TimeMonitor", 1)
        self.data_time = bool(data_time)


class CheckpointConfig:
    """`CheckpointConfig(save_checkpoint_steps=1, save_checkpoint_seconds=0,
    keep_checkpoint_max=5, keep_checkpoint_per_n_minutes=0, integrated_save=True,
    async_save=False, ...)` (MindSpore's defaults). pcompile saves by steps and always in the
    background; time-based saving and encryption are not supported."""

    def __init__(self, save_checkpoint_steps: int = 1, save_checkpoint_seconds: int = 0,
                 keep_checkpoint_max: int = 5, keep_checkpoint_per_n_minutes: int = 0,
                 integrated_save: bool = True, async_save: bool = False,
                 saved_network: Any = None, append_info: Any = None, enc_key: Any = None,
                 enc_mode: str = "AES-GCM", exception_save: bool = False,
                 **kwargs: Any) -> None:
        self.save_checkpoint_steps = _count(save_checkpoint_steps, "CheckpointConfig", 0)
        self.keep_checkpoint_max = _count(keep_checkpoint_max, "CheckpointConfig", 0)
        if save_checkpoint_seconds or keep_checkpoint_per_n_minutes:
            raise PcompileError("CheckpointConfig: save_checkpoint_seconds and "
                                "keep_checkpoint_per_n_minutes are not supported; pcompile "
                                "checkpoints every save_checkpoint_steps steps")
        if enc_key is not None:
            raise PcompileError("CheckpointConfig: encrypted checkpoints (enc_key) are not "
                                "supported")
        self.integrated_save, self.async_save = bool(integrated_save), bool(async_save)
        self.saved_network, self.append_info = saved_network, append_info
        self.exception_save = bool(exception_save)


class ModelCheckpoint(Callback):
    """`ModelCheckpoint(prefix="CKP", directory=None, config=None)`: checkpoints every
    `config.save_checkpoint_steps` steps, the newest `config.keep_checkpoint_max` kept
    (`--checkpoint-every`, `--keep-checkpoint-max`); pcompile writes per-rank safetensors
    checkpoints under DIR/checkpoints."""

    def __init__(self, prefix: str = "CKP", directory: str | None = None,
                 config: CheckpointConfig | None = None, **kwargs: Any) -> None:
        if config is not None and not isinstance(config, CheckpointConfig):
            raise TypeError(f"For 'ModelCheckpoint', 'config' must be a CheckpointConfig, but "
                            f"got {type(config).__name__}")
        self.prefix, self.directory = prefix, directory
        self.config = config or CheckpointConfig()

    def run_flags(self) -> list[str]:
        flags = []
        if self.config.save_checkpoint_steps:
            flags += ["--checkpoint-every", str(self.config.save_checkpoint_steps)]
        if self.config.keep_checkpoint_max:
            flags += ["--keep-checkpoint-max", str(self.config.keep_checkpoint_max)]
        return flags


def run_flags(callbacks: Callback | Iterable[Any] | None) -> list[str]:
    """The `pcompile --run` options that give `callbacks`' behaviour (others: none)."""
    if callbacks is None:
        return []
    items = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
    return [flag for cb in items if isinstance(cb, Callback) for flag in cb.run_flags()]


# `mindspore.train` also holds Model and the checkpoint functions (loaded on first use)
_ELSEWHERE = {"Model": "pcompile.compiler.train_model",
              "save_checkpoint": "pcompile.compiler.serialization",
              "load_checkpoint": "pcompile.compiler.serialization",
              "load_param_into_net": "pcompile.compiler.serialization"}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    raise AttributeError(f"module 'pcompile.train' has no attribute {name!r}")
