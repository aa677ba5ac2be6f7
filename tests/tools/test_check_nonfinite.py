"""The check on data that is not finite : NaN matches NaN, so a NaN or
infinite reference verifies nothing; the CLI says so in one message and exits non-zero, with no
numpy warning. Finite results from non-finite inputs (an additive -inf mask) still check."""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest
from click.testing import CliRunner

from pcompile.cli import main
from pcompile.tools.oracle import OracleReport, describe_nonfinite, relative_error

TRAINING = """
import numpy as np
from pcompile import Parameter, nn, ops

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
        self.w = Parameter(w, "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 1)))

    def construct(self, x):
        return self.matmul(x, self.w)

def model():
    return Net()

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)

def dataset():
    x = np.ones((8, 8), np.float32)
    x[0, 0] = {bad}
    yield x, np.zeros((8, 8), np.float32)

def inputs():
    return (next(dataset())[0],)
"""

MASKED = """
import numpy as np
from pcompile import Parameter, nn, ops

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
        self.w = Parameter(w, "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 1)))
        self.add = ops.Add()
        self.softmax = ops.Softmax()

    def construct(self, x, mask):
        return self.softmax(self.add(self.matmul(x, self.w), mask))

def model():
    return Net()

def inputs():
    mask = np.zeros((8, 8), np.float32)
    mask[:, 4:] = {fill}
    return (np.ones((8, 8), np.float32), mask)
"""


def run(tmp_path, source: str, devices: int) -> tuple[int, str, list[str]]:
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent(source))
    args = [str(model), "--devices", str(devices), "--out", str(tmp_path / "out"), "-q"]
    if devices > 1:
        args += ["--parallel-mode", "semi_auto_parallel"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    numpy_warnings = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                      and "encountered" in str(w.message)]
    return result.exit_code, result.output, numpy_warnings


@pytest.mark.parametrize("bad, shown", [("np.nan", "1 NaN"), ("np.inf", "1 +inf")])
@pytest.mark.parametrize("devices", [2, 1])
def test_nonfinite_data_is_inconclusive_not_a_pass(tmp_path, bad: str, shown: str,
                                                   devices: int) -> None:
    code, output, numpy_warnings = run(tmp_path, TRAINING.format(bad=bad), devices)
    assert code != 0, output
    assert "worst relative error" not in output
    assert output.count("check inconclusive") == 1
    assert "nothing was verified" in output and "not finite" in output
    assert f"input x{' of step 1' if devices > 1 else ''}: {shown} of 64 elements" in output
    assert "--no-check" in output
    assert numpy_warnings == []


def test_nonfinite_initial_value_is_inconclusive_and_blames_the_model(tmp_path) -> None:
    source = TRAINING.format(bad="1.0").replace(
        'self.w = Parameter(w, "w")', 'w[2, 3] = np.nan\n        self.w = Parameter(w, "w")')
    code, output, _ = run(tmp_path, source, 2)
    assert code != 0 and "check inconclusive" in output
    assert "The inputs are finite, so the model or its initial parameter values" in output


def test_finite_results_from_an_infinite_mask_still_check(tmp_path) -> None:
    for devices in (2, 1):
        code, output, numpy_warnings = run(tmp_path, MASKED.format(fill="-np.inf"), devices)
        assert code == 0, output
        assert "input mask" in output and "32 -inf of 64 elements" in output
        assert "so the check holds" in output and numpy_warnings == []


def test_nan_outputs_of_inference_are_inconclusive(tmp_path) -> None:
    code, output, numpy_warnings = run(tmp_path, MASKED.format(fill="np.nan"), 2)
    assert code != 0 and "check inconclusive" in output and "output 0" in output
    assert numpy_warnings == []


def test_relative_error_and_descriptions() -> None:
    nan = float("nan")
    assert relative_error(np.array([nan, 1.0]), np.array([nan, 1.0])) == 0.0
    assert relative_error(np.array([nan, 1.0]), np.array([2.0, 1.0])) == float("inf")
    assert relative_error(np.array([np.inf]), np.array([-np.inf])) == float("inf")
    assert describe_nonfinite("x", np.arange(4)) is None
    assert describe_nonfinite("loss", np.float64(nan)) == "loss is nan"
    assert describe_nonfinite("w", np.array([nan, np.inf, -np.inf, 1.0], np.float32)) == (
        "w: 1 NaN, 1 +inf, 1 -inf of 4 elements")
    assert OracleReport().verified


def test_a_parameter_that_starts_and_stays_infinite_is_data_not_a_failure(tmp_path) -> None:
    """A -inf mask held as a non-trainable parameter is compared like the rest: its infinite
    elements are the user's, unchanged by the step, so the check holds (with a note)."""
    source = TRAINING.format(bad="1.0").replace(
        'self.w = Parameter(w, "w")',
        'self.w = Parameter(w, "w")\n'
        '        mask = np.zeros((8, 8), np.float32)\n'
        '        mask[:, 6:] = -np.inf\n'
        '        self.mask = Parameter(mask, "mask", requires_grad=False)\n'
        '        self.add = ops.Add()\n'
        '        self.softmax = ops.Softmax()').replace(
        "return self.matmul(x, self.w)",
        "return self.softmax(self.add(self.matmul(x, self.w), self.mask))")
    code, output, numpy_warnings = run(tmp_path, source, 2)
    assert code == 0, output
    assert "the initial value of mask: 16 -inf of 64 elements" in output
    assert "so the check holds" in output and numpy_warnings == []
