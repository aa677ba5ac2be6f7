"""MindSpore's training callbacks as the rank programs call them (compiler/frontend/callbacks.py
`CallbackRunner`): the hooks' order and what `run_context.original_args()` holds, MindSpore's
older hook names, TimeMonitor's line, the options the built-in callbacks set, and mistakes as
one message. The runs themselves: tests/backends/test_callbacks_run.py."""

from __future__ import annotations

import numpy as np
import pytest

from pcompile.compiler.frontend.callbacks import (
    Callback,
    CallbackRunner,
    CheckpointConfig,
    LossMonitor,
    ModelCheckpoint,
    TimeMonitor,
    checked_callbacks,
    run_settings,
)
from pcompile.compiler.frontend.tensor import Tensor
from pcompile.ir.errors import PcompileError


class Recorder(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_begin(self, run_context) -> None:
        self.seen.append(("begin",))

    def epoch_begin(self, run_context) -> None:  # MindSpore's older name
        self.seen.append(("epoch_begin", run_context.original_args().cur_epoch_num))

    def on_train_step_begin(self, run_context) -> None:
        self.seen.append(("step_begin", run_context.original_args()["cur_step_num"]))

    def step_end(self, run_context) -> None:
        cb = run_context.original_args()
        self.seen.append(("step_end", cb.cur_epoch_num, cb.cur_step_num, cb.batch_num,
                          float(cb.net_outputs.asnumpy())))
        if cb.cur_step_num == 4:
            run_context.request_stop()

    def on_train_epoch_end(self, run_context) -> None:
        self.seen.append(("epoch_end", run_context.original_args().cur_epoch_num))

    def end(self, run_context) -> None:  # MindSpore's older name
        self.seen.append(("end", run_context.get_stop_requested()))


def _run(runner: CallbackRunner, steps: list[tuple[int, int]], losses: list[float]) -> None:
    """What backends/jax/rank_loop.py does: (epoch, step in epoch) per step."""
    runner.train_begin()
    for k, ((epoch, in_epoch), loss) in enumerate(zip(steps, losses)):
        if epoch != runner.epoch:
            runner.epoch_end()
            runner.epoch_begin(epoch)
        runner.step_begin(k + 1, epoch, in_epoch)
        runner.step_end(k + 1, epoch, in_epoch, Tensor(np.float32(loss)))
        if runner.stop_requested:
            break
    runner.epoch_end()
    runner.train_end()


def test_hooks_come_in_mindspores_order_with_the_run_context() -> None:
    recorder = Recorder()
    runner = CallbackRunner([recorder], "model.py", print, device_number=8)
    assert runner.per_step  # it has step hooks: each step is read back before the next
    _run(runner, [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2)], [0.5, 0.25, 0.125, 1.0, 2.0])
    assert recorder.seen == [
        ("begin",), ("epoch_begin", 1),
        ("step_begin", 1), ("step_end", 1, 1, 1, 0.5),
        ("step_begin", 2), ("step_end", 1, 2, 2, 0.25),
        ("step_begin", 3), ("step_end", 1, 3, 3, 0.125), ("epoch_end", 1),
        ("epoch_begin", 2), ("step_begin", 4), ("step_end", 2, 4, 3, 1.0),  # request_stop
        ("epoch_end", 2), ("end", True)]
    params = runner.context.original_args()
    assert params.device_number == 8 and params.mode == "train"
    assert params.list_callback == [recorder] and params.dataset_sink_mode is False


def test_the_built_in_callbacks_have_no_step_hooks_and_set_the_runs_options() -> None:
    callbacks = [LossMonitor(5), TimeMonitor(), ModelCheckpoint(
        config=CheckpointConfig(save_checkpoint_steps=10, keep_checkpoint_max=3))]
    assert not CallbackRunner(callbacks, "model.py", print).per_step  # steps stay asynchronous
    assert run_settings(callbacks) == {"print_every": 5, "checkpoint_every": 10,
                                       "keep_checkpoint_max": 3}
    assert run_settings([ModelCheckpoint()]) == {"checkpoint_every": 1,  # MindSpore's defaults
                                                 "keep_checkpoint_max": 5}
    assert run_settings([LossMonitor(0)]) == {"print_every": 0}


def test_time_monitor_prints_mindspores_line_per_epoch() -> None:
    said: list[str] = []
    monitor = TimeMonitor(data_size=100)
    runner = CallbackRunner([monitor], "model.py", said.append)
    _run(runner, [(1, 1), (1, 2), (2, 1)], [1.0, 1.0, 1.0])
    assert len(said) == 2
    for line in said:
        head, per_step = line.split(" ms, per step time: ")
        epoch_ms = float(head.removeprefix("Train epoch time: "))
        assert per_step.endswith(" ms")
    # the second epoch ran one step (the run's --steps ended it): its time per step is all of it
    assert said[1] == f"Train epoch time: {epoch_ms:5.3f} ms, per step time: {epoch_ms:5.3f} ms"


def test_mistakes_are_one_message() -> None:
    with pytest.raises(PcompileError, match=r"callbacks\(\) in m.py must return a list of "
                                            r"Callback objects .* got \['int'\]"):
        checked_callbacks([3], "m.py")
    assert checked_callbacks(None, "m.py") == []
    assert len(checked_callbacks(LossMonitor(), "m.py")) == 1

    class Broken(Callback):
        def on_train_step_end(self, run_context) -> None:
            raise KeyError("nope")

    runner = CallbackRunner([Broken()], "m.py", print)
    runner.train_begin()
    runner.epoch_begin(1)
    with pytest.raises(PcompileError, match=r"callback Broken.on_train_step_end in m.py failed: "
                                            r"KeyError: 'nope'"):
        runner.step_end(1, 1, 1, Tensor(np.float32(1.0)))


def test_an_epoch_ends_once() -> None:
    ends: list[int] = []

    class Ends(Callback):
        def epoch_end(self, run_context) -> None:
            ends.append(run_context.original_args().cur_epoch_num)
            run_context.request_stop()

    runner = CallbackRunner([Ends()], "m.py", print)
    runner.epoch_end()  # before any epoch: nothing
    runner.epoch_begin(1)
    runner.epoch_end()
    runner.epoch_end()  # the run stopped at the epoch's end, then ends: not twice
    assert ends == [1] and runner.stop_requested
