"""MindSpore's training surface that ported scripts reach for (issue 38 item 15):
`save_checkpoint(net, path)`, the callbacks `LossMonitor`, `TimeMonitor`, `CheckpointConfig`,
`ModelCheckpoint` where MindSpore has them (`mindspore`, `mindspore.train`,
`mindspore.train.callback`), and `Model.train`, which names the `pcompile --run` command (with
the options that give the callbacks' behaviour) instead of running."""

from __future__ import annotations

import numpy as np
import pytest

import pcompile
import pcompile.dataset as ds
from pcompile import (
    CheckpointConfig,
    LossMonitor,
    Model,
    ModelCheckpoint,
    Parameter,
    TimeMonitor,
    initializer,
    load_checkpoint,
    load_param_into_net,
    nn,
    ops,
    save_checkpoint,
    set_seed,
)
from pcompile.compiler.frontend.serialization import CheckpointLoadError
from pcompile.ir.errors import PcompileError


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.w = Parameter(initializer("normal", [4, 3]), "w")
        self.b = Parameter(initializer("zeros", [3]), "b")
        self.matmul = ops.MatMul()
        self.add = ops.Add()

    def construct(self, x):
        return self.add(self.matmul(x, self.w), self.b)


def test_the_callbacks_import_where_mindspore_has_them() -> None:
    import pcompile.train as train
    import pcompile.train.callback as callback
    import pcompile.train.serialization as serialization

    assert train.LossMonitor is callback.LossMonitor is LossMonitor is pcompile.train.LossMonitor
    assert callback.ModelCheckpoint is ModelCheckpoint and train.Model is Model
    assert train.save_checkpoint is serialization.save_checkpoint is save_checkpoint
    with pytest.raises(ValueError, match="LossMonitor"):
        LossMonitor(-1)
    with pytest.raises(PcompileError, match="save_checkpoint_seconds"):
        CheckpointConfig(save_checkpoint_seconds=60)


def test_model_train_names_the_run_that_gives_its_callbacks_behaviour() -> None:
    set_seed(1)
    data = ds.NumpySlicesDataset({"x": np.zeros((8, 4), np.float32),
                                  "y": np.zeros((8, 3), np.float32)}).batch(2)
    model = Model(Net(), nn.MSELoss(), nn.SGD(Net().trainable_params(), 0.1))
    config = CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=4)
    callbacks = [LossMonitor(2), TimeMonitor(), ModelCheckpoint("net", "ckpt", config)]
    with pytest.raises(PcompileError) as info:
        model.train(2, data, callbacks=callbacks)
    assert ("pcompile model.py --run --steps 8 --print-every 2 --checkpoint-every 3 "
            "--keep-checkpoint-max 4`") in str(info.value)


def test_save_checkpoint_writes_what_load_checkpoint_reads(tmp_path) -> None:
    set_seed(5)
    net = Net()
    path = save_checkpoint(net, str(tmp_path / "net"), append_dict={"epoch": np.int64(3)})
    assert path == str(tmp_path / "net.safetensors")
    set_seed(6)
    other = Net()
    assert not np.array_equal(other.w.asnumpy(), net.w.asnumpy())
    params = load_checkpoint(path)
    assert sorted(params) == ["b", "epoch", "w"]
    not_loaded, unused = load_param_into_net(other, params)
    assert not_loaded == [] and unused == ["epoch"]
    assert np.array_equal(other.w.asnumpy(), net.w.asnumpy())
    # MindSpore's list form and choice_func; the file it wrote is replaced
    save_checkpoint([{"name": "w", "data": net.w}, {"name": "b", "data": net.b}], path,
                    choice_func=lambda name: name == "w")
    assert sorted(load_checkpoint(path)) == ["w"]
    with pytest.raises(CheckpointLoadError, match="not MindSpore's .ckpt"):
        save_checkpoint(net, str(tmp_path / "net.ckpt"))
    foreign = tmp_path / "mine.safetensors"
    foreign.write_bytes(b"precious")
    with pytest.raises(CheckpointLoadError, match="never replaces a file it did not write"):
        save_checkpoint(net, str(foreign))
    assert foreign.read_bytes() == b"precious"
