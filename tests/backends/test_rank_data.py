"""What a rank program does with its data and its read-backs while it runs (issue 38 items 7,
21 and 25): a data mistake (a short or wrong-shape batch, a token id outside the vocabulary, a
generator that raises, an exhausted iterator, `sys.exit()` in `dataset()`) is one line naming
the batch, the ranks, what is wrong and what would be valid, never a traceback; a `dataset()`
that blocks is reported as reading its next batch; long `--log-every` groups never leave more
than `compiler.runtime.IN_FLIGHT` steps unfinished on a device (a process holding several ranks
deadlocked past XLA's CPU queue of 32)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pcompile.compiler.runtime import IN_FLIGHT, ReadBack
from tests import ROOT
from tests.multiprocess import clean_env


def pcompile(model: str, out, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pcompile", model, "--out", str(out),
                           "--no-check", *args], capture_output=True, text=True,
                          env=clean_env(), cwd=ROOT, timeout=timeout)


# -- item 25: --log-every N >= 40 with several ranks per process ---------------------------------


@pytest.mark.parametrize("first", [False, True])
def test_read_back_leaves_at_most_depth_steps_unfinished(first: bool) -> None:
    """With `wait`, however long the --log-every groups, at most `depth` dispatched steps are
    neither waited for nor read back; every step is still read, once, in order."""
    done: set[int] = set()
    read: list[int] = []
    waited: list[int] = []

    def on_read(items: list[int], last: bool) -> None:
        read.extend(items)
        done.update(items)

    def on_wait(item: int) -> None:
        assert item not in done
        waited.append(item)
        done.add(item)

    queue = ReadBack(40, on_read, first_at_once=first, wait=on_wait, depth=8)
    for k in range(1, 101):
        queue.dispatched(k, k)
        assert k - len(done) <= 8, (k, sorted(done)[-3:])
    queue.flush(last=True)
    assert read == list(range(1, 101))
    assert waited == sorted(waited) and waited
    assert IN_FLIGHT < 32  # below XLA's CPU queue per device


SLOW_STEP = '''
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [512, 512]), "w")
        self.w2 = Parameter(initializer("normal", [512, 512]), "w2")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 2)))
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul().shard(((2, 2), (2, 1)))

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul(x, self.w)), self.w2)


def model():
    set_seed(3)
    return Net()


def inputs():
    return (np.zeros((1024, 512), np.float32),)


def labels():
    return (np.zeros((1024, 512), np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.01, momentum=0.9)
'''


# slow: a multi-process launch of 105 steps (20-40 s here; on the code before the fix it sat
# until --timeout)
@pytest.mark.slow
def test_a_long_log_every_with_two_ranks_per_process_finishes(tmp_path) -> None:
    path = tmp_path / "slow_step.py"
    path.write_text(textwrap.dedent(SLOW_STEP))
    ran = pcompile(str(path), tmp_path / "out", "--devices", "4", "--run", "--steps", "105",
                   "--processes", "2", "--log-every", "100", "--timeout", "60", "--quiet",
                   timeout=400)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    log = (tmp_path / "out" / "rank_0" / "train.log").read_text().splitlines()
    assert len(log) == 105 and log[-1].startswith("epoch: 1 step: 105, loss is "), log[-3:]
