"""Device-resident training and matmul precision: the JAX runners keep parameters
and optimizer state on the device and donate them to the step, with results bit-equal to a
step that carries them in numpy; `--log-every N` reads losses back every N steps and still logs
every step; the check and the op tests run JAX matmuls at `highest` precision."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from pcompile.backends.jax import lower_graph
from pcompile.backends.jax.spmd import JaxSpmdRunner
from pcompile.compiler.driver.runtime import batches
from pcompile.program.progress import ReadBack
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT

CLI = os.path.join(ROOT, "cli.py")
EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 4


def _numpy_carried(program, steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """The step as it ran before: jit without donation, values carried in numpy."""
    graph = program.rank_graphs[0]
    fn = jax.jit(lower_graph(graph))
    n = len(graph.inputs)
    values = {k: np.array(v, copy=True) for k, v in program.initial_values.items()}
    losses = []
    for _, _, arrays in batches(program, steps):
        outs = [np.asarray(o) for o in fn(*arrays[:n], *[values[p.name]
                                                           for p in graph.params[n:]])]
        for name, value in zip(program.output_names[1:], outs[1:]):
            values[name] = value
        losses.append(float(outs[0]))
    return losses, values


# gpt_block.py (~9 s) runs in the slow step; quickstart.py checks the same runner fast
@pytest.mark.parametrize("example", ["quickstart.py",
                                     pytest.param("gpt_block.py", marks=pytest.mark.slow)])
def test_standalone_runner_device_resident_bit_equal(example) -> None:
    program = compile_model(os.path.join(EXAMPLES, example), devices=1, dump=False)
    want_losses, want_values = _numpy_carried(program, STEPS)
    runner = StandAloneRunner(program, "jax")
    before = dict(runner.values.device)  # type: ignore[attr-defined]
    losses = [runner.step(arrays) for _, _, arrays in batches(program, STEPS)]
    assert losses == want_losses  # bit-equal
    for name, want in want_values.items():
        assert np.array_equal(runner.values[name], want), name
    # the step donated the stored values it returns updated: their first buffers are gone
    updated = set(program.output_names[1:])
    donated = [name for name in before if name in updated]
    assert donated and all(before[name].is_deleted() for name in donated)
    assert all(isinstance(a, jax.Array) for a in runner.values.device.values())  # type: ignore


def test_standalone_runner_values_can_be_set() -> None:
    """`values[name] = array` (the oracle sets the parallel program's initial values)."""
    program = compile_model(os.path.join(EXAMPLES, "quickstart.py"), devices=1, dump=False)
    runner = StandAloneRunner(program, "jax")
    runner.values["w"] = np.zeros_like(program.initial_values["w"])
    _, _, arrays = next(batches(program, 1))
    ref = StandAloneRunner(program, "numpy")
    ref.values["w"] = np.zeros_like(program.initial_values["w"])
    assert abs(runner.step(arrays) - ref.step(arrays)) <= 1e-6 * max(1.0, abs(ref.step(arrays)))


def test_spmd_runner_donates_and_matches() -> None:
    program = compile_model(os.path.join(EXAMPLES, "quickstart.py"), devices=1, dump=False)
    want_losses, want_values = _numpy_carried(program, STEPS)
    runner = JaxSpmdRunner(program)
    before = dict(runner._state)
    losses = [runner.step(arrays) for _, _, arrays in batches(program, STEPS)]
    assert losses == want_losses
    for name, want in want_values.items():
        if name in runner.values[0]:
            assert np.array_equal(runner.values[0][name], want), name
    assert any(a.is_deleted() for a in before.values())


def test_matmul_precision_reaches_the_step() -> None:
    program = compile_model(os.path.join(EXAMPLES, "quickstart.py"), devices=1, dump=False)
    _, _, arrays = next(batches(program, 1))
    highest = StandAloneRunner(program, "jax", matmul_precision="highest")
    default = StandAloneRunner(program, "jax")
    check = StandAloneRunner(program, "jax", float64=True)  # the check's runner
    assert "HIGHEST" in highest.lowered_text(arrays)
    with jax.default_matmul_precision("default"):  # whatever other tests set globally
        assert "HIGHEST" not in default.lowered_text(arrays)
    assert "HIGHEST" in check.lowered_text(arrays) and "f64" in check.lowered_text(arrays)


def test_op_harness_references_run_at_highest_precision() -> None:
    import tests.op_harness  # noqa: F401  (its settings)

    assert jax.config.jax_default_matmul_precision == "highest"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, CLI, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def _loss_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("epoch: ")]


@pytest.mark.slow
def test_log_every_logs_every_step(tmp_path) -> None:
    """In-process (1 device) and a rank program: --log-every 3 reads back every 3 steps and
    logs the same lines, bit for bit, as --log-every 1; --print-every still picks lines."""
    model = os.path.join(EXAMPLES, "quickstart.py")
    one = _cli(model, "--devices", "1", "--out", str(tmp_path / "a"), "--no-check", "-q",
               "--run", "--steps", "7")
    three = _cli(model, "--devices", "1", "--out", str(tmp_path / "b"), "--no-check", "-q",
                 "--run", "--steps", "7", "--log-every", "3", "--print-every", "2",
                 "--matmul-precision", "highest")
    assert one.returncode == 0 and three.returncode == 0, one.stderr + three.stderr
    lines = _loss_lines(one.stdout)
    assert len(lines) == 7
    assert _loss_lines(three.stdout) == [lines[i] for i in (1, 3, 5, 6)]  # 2, 4, 6 and the last
    log = (tmp_path / "b" / "rank_0" / "train.log").read_text().splitlines()
    assert log == lines
    program = tmp_path / "a" / "program.py"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ran = subprocess.run([sys.executable, str(program), "--steps", "7", "--log-every", "3",
                          "--no-checkpoint"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert _loss_lines(ran.stdout) == lines



@pytest.mark.parametrize(("every", "order"), [
    (1, ["call 1", "call 2", "read 1", "call 3", "read 2", "call 4", "read 3", "read 4"]),
    (2, ["call 1", "call 2", "call 3", "read 1", "read 2", "call 4", "read 3", "read 4"]),
])
def test_a_loss_is_read_back_once_the_next_step_runs(monkeypatch, every: int,
                                                     order: list[str]) -> None:
    """`pcompile --run` on one device: each --log-every group of losses is read back after
    the step that follows it has been handed to the device (the device never waits for the
    host between steps), the last ones at the end; every loss is still logged, in order."""
    from pcompile.tools.run import RunOptions, train_here

    program = compile_model(os.path.join(EXAMPLES, "quickstart.py"), devices=1, dump=False)
    events: list[str] = []
    real = StandAloneRunner.step_async

    class Loss:
        def __init__(self, value, k: int) -> None:
            self.value, self.k = value, k

        def __float__(self) -> float:
            events.append(f"read {self.k}")
            return float(self.value)

    def step_async(self, arrays):
        k = sum(e.startswith("call") for e in events) + 1
        events.append(f"call {k}")
        return Loss(real(self, arrays), k)

    monkeypatch.setattr(StandAloneRunner, "step_async", step_async)
    class Monitor(list):  # the run's display: called with each loss line, closed at the end
        def __call__(self, line: str) -> None:
            self.append(line)

        def close(self) -> None:
            pass

    logged = Monitor()
    train_here(program, RunOptions(steps=STEPS, log_every=every), logged, print)
    assert events == order
    monkeypatch.undo()
    from pcompile.program.progress import format_loss_line

    fresh = StandAloneRunner(program, "jax")
    assert logged == [format_loss_line(epoch, step, fresh.step(arrays))
                      for epoch, step, arrays in batches(program, STEPS)]


@pytest.mark.parametrize(("every", "order"), [
    (1, ["call 1", "read 1", "call 2", "call 3", "read 2", "call 4", "read 3", "call 5",
         "read 4", "read 5"]),
    (3, ["call 1", "read 1", "call 2", "call 3", "call 4", "read 2", "read 3", "call 5",
         "read 4", "read 5"]),
])
def test_a_rank_program_reads_a_loss_back_once_the_next_step_runs(tmp_path, every: int,
                                                                  order: list[str]) -> None:
    """A rank program (`program.py`, run in its own process): the first loss is read back at
    once (the time to first step), then each --log-every group once the step after it is
    dispatched, the rest at the end."""
    compile_model(os.path.join(EXAMPLES, "quickstart.py"), devices=1,
                  out_dir=str(tmp_path / "out"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ran = subprocess.run([sys.executable, "-m", "tests.readback_worker",
                          str(tmp_path / "out" / "program.py"), "--steps", "5", "--log-every",
                          str(every), "--no-checkpoint", "--quiet"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1]) == order


@pytest.mark.parametrize(("every", "first", "steps", "order"), [
    (1, False, 3, ["call 1", "call 2", "read 1", "call 3", "read 2", "read 3"]),
    (2, True, 5, ["call 1", "read 1", "call 2", "call 3", "read 2", "call 4", "call 5",
                  "read 3", "read 4", "read 5"]),
    (4, False, 5, ["call 1", "call 2", "call 3", "call 4", "call 5", "read 1", "read 2",
                   "read 3", "read 4", "read 5"]),
])
def test_read_back_reads_each_group_after_the_next_dispatch(every: int, first: bool, steps: int,
                                                            order: list[str]) -> None:
    events: list[str] = []
    lasts: list[bool] = []

    def read(items: list[int], last: bool) -> None:
        events.extend(f"read {k}" for k in items)
        lasts.append(last)

    queue = ReadBack(every, read, first_at_once=first)
    for k in range(1, steps + 1):
        events.append(f"call {k}")
        queue.dispatched(k, k)
    queue.flush(last=True)
    queue.flush(last=True)  # nothing left: no empty read
    assert events == order
    assert lasts[-1] and not any(lasts[:-1])
