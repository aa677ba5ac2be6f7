"""MindSpore's training callbacks, `mindspore.train.callback` (also `mindspore.train` and
`mindspore`): `Callback`, `RunContext`, `LossMonitor`, `TimeMonitor`, `CheckpointConfig`,
`ModelCheckpoint`.

A model file gives them as MindSpore's `Model.train(..., callbacks=[...])` takes them: a
module-level `callbacks()` returning a list (DESIGN.md, "Model file"; docs/running.md,
"Callbacks"). The rank programs (`pcompile MODEL.py --run`, `python DIR/program.py`) call them
at MindSpore's points (`CallbackRunner`): `on_train_begin`, `on_train_epoch_begin`,
`on_train_step_begin`, `on_train_step_end` (the step's loss read back), `on_train_epoch_end`,
`on_train_end`, each with a `RunContext` whose `original_args()` holds `cur_epoch_num`,
`cur_step_num` (over the whole run), `batch_num`, `net_outputs` (the loss, a Tensor), ...; and
`run_context.request_stop()` ends the run after the step. The built-in ones map onto the run's
own options (`run_settings`), which an option given on the command line overrides:

* `LossMonitor(per_print_times=k)`: a loss line every k steps (`--print-every k`; 0 prints
  none), in MindSpore's `epoch: E step: S, loss is L` form; a loss that is not finite stops the
  run (`--fail-on-nan`, on by default);
* `TimeMonitor(data_size=None)`: at each epoch's end MindSpore's line `Train epoch time: T ms,
  per step time: t ms` (the epoch's steps, or `data_size`, dividing);
* `ModelCheckpoint(prefix, directory, config=CheckpointConfig(save_checkpoint_steps=s,
  keep_checkpoint_max=m))`: a checkpoint every s steps (`--checkpoint-every s`), the newest m
  kept (`--keep-checkpoint-max m`); pcompile's checkpoints are per rank, in safetensors, under
  DIR/checkpoints (`pcompile-merge DIR` gathers them), whatever `prefix` and `directory` say.

`Model.train` (compiler/frontend/train_model.py) is not run: it names the command (`run_flags`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
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
    """MindSpore's `Callback`: a subclass overrides the hooks it needs. Each `on_train_*` hook
    calls MindSpore's older name (`begin`, `epoch_begin`, `step_begin`, `step_end`,
    `epoch_end`, `end`) unless overridden, as MindSpore's does, so either form works."""

    def run_flags(self) -> list[str]:
        """The `pcompile --run` options that give this callback's behaviour."""
        return []

    def on_train_begin(self, run_context: Any) -> None:
        """Before the first step."""
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: Any) -> None:
        """Before each epoch's first step."""
        self.epoch_begin(run_context)

    def on_train_step_begin(self, run_context: Any) -> None:
        """Before each step."""
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: Any) -> None:
        """After each step, its loss read back (`net_outputs`)."""
        self.step_end(run_context)

    def on_train_epoch_end(self, run_context: Any) -> None:
        """After each epoch's last step (or the run's last step, in its epoch)."""
        self.epoch_end(run_context)

    def on_train_end(self, run_context: Any) -> None:
        """After the last step."""
        self.end(run_context)

    # MindSpore's older names
    def begin(self, run_context: Any) -> None:
        """MindSpore's older `on_train_begin`."""

    def epoch_begin(self, run_context: Any) -> None:
        """MindSpore's older `on_train_epoch_begin`."""

    def step_begin(self, run_context: Any) -> None:
        """MindSpore's older `on_train_step_begin`."""

    def step_end(self, run_context: Any) -> None:
        """MindSpore's older `on_train_step_end`."""

    def epoch_end(self, run_context: Any) -> None:
        """MindSpore's older `on_train_epoch_end`."""

    def end(self, run_context: Any) -> None:
        """MindSpore's older `on_train_end`."""

    def __enter__(self) -> Callback:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class CallbackParams(dict):  # type: ignore[type-arg]
    """What `RunContext.original_args()` returns: MindSpore's callback parameters, read as
    attributes (`cb_params.cur_step_num`) or keys."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class RunContext:
    """MindSpore's `RunContext`: `original_args()` (the callback parameters),
    `request_stop()` (end the run after this step; every process must ask at the same step,
    or the others wait for it in their collectives) and `get_stop_requested()`."""

    def __init__(self, original_args: CallbackParams) -> None:
        self._original_args = original_args
        self._stop_requested = False

    def original_args(self) -> CallbackParams:
        return self._original_args

    def request_stop(self) -> None:
        self._stop_requested = True

    def get_stop_requested(self) -> bool:
        return self._stop_requested


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
    """`TimeMonitor(data_size=None, data_time=False)`: at each epoch's end, MindSpore's line
    `Train epoch time: T ms, per step time: t ms`, t = T over the epoch's steps (`batch_num`;
    `data_size` when that is unknown). Printed by the process that prints the loss lines."""

    def __init__(self, data_size: int | None = None, data_time: bool = False) -> None:
        self.data_size = None if data_size is None else _count(data_size, "TimeMonitor", 1)
        self.data_time = bool(data_time)
        self.epoch_time = time.time()

    def on_train_epoch_begin(self, run_context: Any) -> None:
        self.epoch_time = time.time()

    def on_train_epoch_end(self, run_context: Any) -> None:
        epoch_ms = (time.time() - self.epoch_time) * 1000
        params = run_context.original_args()
        # the epoch's steps (MindSpore's batch_num); a last epoch cut short by --steps: those run
        steps = params.get("epoch_steps_run") or params.get("batch_num")
        if not isinstance(steps, int) or steps < 1:
            steps = self.data_size
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"For 'TimeMonitor', step size must be positive integer, but got "
                             f"{steps}.")
        say = params.get("say") or print
        say(f"Train epoch time: {epoch_ms:5.3f} ms, per step time: {epoch_ms / steps:5.3f} ms")


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


def _items(callbacks: Callback | Iterable[Any] | None) -> list[Any]:
    if callbacks is None:
        return []
    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks)


def run_flags(callbacks: Callback | Iterable[Any] | None) -> list[str]:
    """The `pcompile --run` options that give `callbacks`' behaviour (others: none)."""
    return [flag for cb in _items(callbacks) if isinstance(cb, Callback)
            for flag in cb.run_flags()]


def run_settings(callbacks: Callback | Iterable[Any] | None) -> dict[str, int]:
    """The run options the built-in callbacks set (`print_every`, 0 for no loss lines;
    `checkpoint_every`; `keep_checkpoint_max`): the values of the options a run leaves at
    their defaults. The last callback of a kind decides."""
    settings: dict[str, int] = {}
    for cb in _items(callbacks):
        if isinstance(cb, LossMonitor):
            settings["print_every"] = cb.per_print_times
        elif isinstance(cb, ModelCheckpoint):
            if cb.config.save_checkpoint_steps:
                settings["checkpoint_every"] = cb.config.save_checkpoint_steps
            if cb.config.keep_checkpoint_max:
                settings["keep_checkpoint_max"] = cb.config.keep_checkpoint_max
    return settings


def checked_callbacks(value: Any, path: str) -> list[Callback]:
    """What a model file's `callbacks()` returned, as a list of Callback objects (a single one,
    a list or tuple, or None); anything else is one message."""
    items = [] if value is None else [value] if isinstance(value, Callback) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(cb, Callback)
                                                       for cb in items):
        got = [type(cb).__name__ for cb in items] if isinstance(items, (list, tuple)) else (
            type(items).__name__)
        raise PcompileError(f"callbacks() in {path} must return a list of Callback objects "
                            f"(pcompile.train.Callback and its subclasses: LossMonitor, "
                            f"TimeMonitor, ModelCheckpoint, or your own), got {got}")
    return list(items)


_STEP_HOOKS = ("on_train_step_begin", "on_train_step_end", "step_begin", "step_end")


class CallbackRunner:
    """Calls a run's callbacks at MindSpore's points (module docstring) with one `RunContext`
    (MindSpore's `_InternalCallbackParam` fields `cur_epoch_num`, `cur_step_num`, `batch_num`,
    `epoch_num`, `net_outputs`, `mode`, `dataset_sink_mode`, `parallel_mode`, `device_number`,
    `list_callback`; `batch_num` is the steps of an epoch once one is complete, before that
    the current epoch's steps so far; pcompile's `epoch_steps_run`: the steps of this epoch
    this run has trained, and `say`: how the built-in callbacks print). A callback that
    raises is one PcompileError naming it (`path`: the model file, for the line)."""

    def __init__(self, callbacks: list[Callback], path: str, say: Callable[[str], None],
                 **fields: Any) -> None:
        self.callbacks = callbacks
        self.path = path
        self.params = CallbackParams(cur_epoch_num=0, cur_step_num=0, batch_num=None,
                                     epoch_num=None, net_outputs=None, epoch_steps_run=0,
                                     mode="train",
                                     dataset_sink_mode=False, list_callback=callbacks,
                                     say=say, **fields)
        self.context = RunContext(self.params)
        self.epoch: int | None = None
        self._epoch_open = False
        self.epoch_steps = 0  # the largest step-in-epoch seen: an epoch's size once complete

    @property
    def per_step(self) -> bool:
        """Whether a callback has step hooks of its own: each step is then read back before
        the next starts, so its hooks come in MindSpore's order."""
        return any(getattr(type(cb), name) is not getattr(Callback, name)
                   for cb in self.callbacks for name in _STEP_HOOKS)

    @property
    def stop_requested(self) -> bool:
        return self.context.get_stop_requested()

    def _call(self, hook: str) -> None:
        from pcompile.compiler.frontend.model_file import call_user

        for cb in self.callbacks:
            call_user(getattr(cb, hook), f"callback {type(cb).__name__}.{hook}", self.path,
                      self.context)

    def train_begin(self) -> None:
        self._call("on_train_begin")

    def epoch_begin(self, epoch: int) -> None:
        self.epoch = self.params.cur_epoch_num = epoch
        self.params.epoch_steps_run = 0
        self._epoch_open = True
        self._call("on_train_epoch_begin")

    def step_begin(self, step: int, epoch: int, in_epoch: int) -> None:
        self._at(step, epoch, in_epoch)
        self.params.net_outputs = None
        self._call("on_train_step_begin")

    def step_end(self, step: int, epoch: int, in_epoch: int, loss: Any) -> None:
        self._at(step, epoch, in_epoch)
        self.params.net_outputs = loss
        self.params.epoch_steps_run = self.params.get("epoch_steps_run", 0) + 1
        self._call("on_train_step_end")

    def epoch_end(self) -> None:
        """The open epoch's end (once)."""
        if self._epoch_open:
            self._epoch_open = False
            self._call("on_train_epoch_end")

    def train_end(self) -> None:
        self._call("on_train_end")

    def _at(self, step: int, epoch: int, in_epoch: int) -> None:
        self.params.cur_step_num, self.params.cur_epoch_num = step, epoch
        self.epoch_steps = max(self.epoch_steps, in_epoch)
        self.params.batch_num = self.epoch_steps


# `mindspore.train` also holds Model and the checkpoint functions (loaded on first use)
_ELSEWHERE = {"Model": "pcompile.compiler.frontend.train_model",
              "save_checkpoint": "pcompile.compiler.frontend.serialization",
              "load_checkpoint": "pcompile.compiler.frontend.serialization",
              "load_param_into_net": "pcompile.compiler.frontend.serialization"}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        import importlib

        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    raise AttributeError(f"module 'pcompile.train' has no attribute {name!r}")
