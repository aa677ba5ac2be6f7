"""What a rank program does with its data and its read-backs while it runs (issue 38 items 7,
21 and 25): a data mistake (a short or wrong-shape batch, a token id outside the vocabulary, a
generator that raises, an exhausted iterator, `sys.exit()` in `dataset()`) is one line naming
the batch, the ranks, what is wrong and what would be valid, never a traceback; a `dataset()`
that blocks is reported as reading its next batch; long `--log-every` groups never leave more
than `program.progress.IN_FLIGHT` steps unfinished on a device (a process holding several ranks
deadlocked past XLA's CPU queue of 32)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pcompile.program.progress import IN_FLIGHT, ReadBack
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


# -- items 7 and 21: data mistakes at run time ----------------------------------------------------

# an embedding lookup of 32 rows, fed ids [8, 5] (sliced to [8, 4]); batch 3 holds BAD at [5, 1]
VOCAB = '''
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_seed


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.table = Parameter(initializer("normal", [32, 8]), "table")
        self.w = Parameter(initializer("normal", [8, 8]), "w")
        self.embedding = ops.Gather()
        self.slice = ops.StridedSlice()
        self.mean = ops.ReduceMean()
        self.matmul = ops.MatMul()

    def construct(self, ids):
        tokens = self.slice(ids, (0, 0), (8, 4), (1, 1))
        return self.matmul(self.mean(self.embedding(self.table, tokens, 0), 1), self.w)


def model():
    set_seed(3)
    return Net()


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)


def dataset():
    rng = np.random.default_rng(7)
    for k in range(4):
        ids = rng.integers(0, 32, (8, 5)).astype(np.int32)
        if k == 2:
            ids[5, 1] = BAD
        yield IDS, rng.standard_normal((8, 8)).astype(np.float32)


def inputs():
    return next(iter(dataset()))[:1]
'''


def vocab_model(tmp_path, ids: str = "ids", bad: int = 40):
    path = tmp_path / "vocab.py"
    path.write_text(VOCAB.replace("IDS", ids).replace("BAD", str(bad)))
    return path


ROWS = "(rng.standard_normal((ROWS, 16)).astype(np.float32), " \
       "rng.standard_normal((ROWS, 8)).astype(np.float32))"


def third_batch(third: str, count: int = 4) -> str:
    return f'''
def dataset():
    rng = np.random.default_rng(7)
    for k in range({count}):
        if k == 2:
            {third}
        yield {ROWS.replace("ROWS", "8")}
'''


MISTAKES = {
    "short": (third_batch(f"yield {ROWS.replace('ROWS', '5')}"),
              "batch 3 of epoch 1 (step 3 of the run): x has shape (5, 16); the program was "
              "compiled for (8, 16): yield only whole batches of 8 rows"),
    "raises": (third_batch("raise OSError('shard 3 is unreadable')"),
               "reading batch 3 of epoch 1 (step 3 of the run): dataset() in "),
    "exit": (third_batch("import sys; sys.exit(3)"),
             "reading batch 3 of epoch 1 (step 3 of the run): dataset() in "),
    "used-up": (f'''
rng = np.random.default_rng(7)
DATA = iter([{ROWS.replace("ROWS", "8")} for _ in range(3)])


def dataset():
    return DATA
''', "gives no batch in epoch 2, where the run needs step 4 (epochs restart dataset()): it "
     "returned an iterator that epoch 1 used up"),
}


# slow: each a two-process launch (10-20 s here)
@pytest.mark.slow
@pytest.mark.parametrize("case", [*MISTAKES, "vocabulary"])
def test_a_data_mistake_in_a_run_is_one_line(tmp_path, case: str) -> None:
    """Through the launcher, two processes of two ranks each: the mistake in the third batch
    (the fourth step's missing one) is one line naming the ranks, the batch, what is wrong and
    what is valid; no traceback anywhere in the output."""
    from tests.multiprocess import mlp_source

    if case == "vocabulary":
        path = vocab_model(tmp_path)
        expected = ("batch 3 of epoch 1 (step 3 of the run): ids holds id 40 at [5, 1]; the "
                    "program uses it in Gather 'embedding' at ")
        flags = ["--parallel-mode", "semi_auto_parallel"]
    else:
        data, expected = MISTAKES[case]
        path = tmp_path / "net.py"
        path.write_text(mlp_source("((2, 1), (1, 1))", data=data))
        flags = []
    ran = pcompile(str(path), tmp_path / "out", "--devices", "4", *flags, "--run", "--steps",
                   "5", "--processes", "2", "--timeout", "60")
    output = ran.stdout + ran.stderr
    assert ran.returncode != 0, output
    assert "Traceback" not in output, output
    said = [line for line in output.splitlines() if " failed first: " in line]
    assert len(said) == 1 and expected in said[0], output
    assert said[0].startswith("pcompile launcher: ranks ") and "(process " in said[0]
    for r in (0, 2):  # the rank programs' own logs: the one line, no traceback
        assert "Traceback" not in (tmp_path / "out" / f"rank_{r}" / "run.log").read_text()


BLOCKS = '''
import time


def dataset():
    rng = np.random.default_rng(7)
    for k in range(100):
        if k == 4:
            time.sleep(1000)
        yield (rng.standard_normal((8, 16)).astype(np.float32),
               rng.standard_normal((8, 8)).astype(np.float32))
'''


# slow: a two-process launch that waits out a --timeout of 10 s
@pytest.mark.slow
def test_a_blocked_dataset_is_named_not_a_collective(tmp_path) -> None:
    from tests.multiprocess import mlp_source

    path = tmp_path / "net.py"
    path.write_text(mlp_source("((2, 1), (1, 1))", data=BLOCKS))
    ran = pcompile(str(path), tmp_path / "out", "--devices", "4", "--run", "--steps", "8",
                   "--processes", "2", "--timeout", "10")
    output = ran.stdout + ran.stderr
    assert ran.returncode != 0, output
    assert ("no rank got its next batch within 10 s (--timeout): every rank is reading the "
            "batch of step 5 from dataset(); dataset() is blocked") in output, output
    assert "collective" not in output, output
