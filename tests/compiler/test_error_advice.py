"""Mistakes a newcomer makes in a model file, each ending in one message that points at the
cause and says what to do (the quickstart example, edited one way each)."""

from __future__ import annotations

import os

import pytest

from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

QUICKSTART = open(os.path.join(ROOT, "examples", "quickstart.py")).read()

CASES = {
    "labels_differ": (
        ("label_data = np.random.rand(batch_size, out_dim)",
         "label_data = np.random.rand(batch_size, out_dim + 1)"),
        ["Sub 'sub'", "the network's output (16, 16) and the labels label (16, 17) from "
         "dataset()'s first batch", "make the labels match the output"]),
    "too_many_inputs": (
        ("    return (np.zeros((BATCH_SIZE, IN_DIM), np.float32),)",
         "    return (np.zeros((BATCH_SIZE, IN_DIM), np.float32), np.zeros(2, np.float32))"),
        ["inputs() in", "returns 2 array(s), but Net.construct takes 1 (x)"]),
    "if_on_a_tensor": (
        ("        out = self.relu(out)",
         "        if out.sum() > 0:\n            out = self.relu(out)"),
        ["the truth value of a traced tensor is unknown at compile time", "ops.select",
         "quickstart_if_on_a_tensor.py:59"]),
    "missing_op": (
        ("        self.relu = ops.ReLU()", "        self.relu = ops.Relu()"),
        ["pcompile.ops has no primitive 'Relu' (did you mean ops.ReLU", "docs/ops.md"]),
    "dtype_mismatch": (
        ("    return (np.zeros((BATCH_SIZE, IN_DIM), np.float32),)",
         "    return (np.zeros((BATCH_SIZE, IN_DIM), np.float16),)"),
        ["operands must have one dtype, got Float16, Float32", "ops.Cast()",
         "arrays of the parameters' dtype"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mistake_gets_one_message_with_its_cause_and_fix(tmp_path, case: str) -> None:
    (old, new), wanted = CASES[case]
    assert old in QUICKSTART
    path = tmp_path / f"quickstart_{case}.py"
    path.write_text(QUICKSTART.replace(old, new))
    with pytest.raises(PcompileError) as info:
        compile_model(str(path), devices=8, dump=False)
    message = str(info.value)
    for part in wanted:
        assert part in message, (part, message)


def test_a_device_count_the_strategy_does_not_divide_says_what_would(tmp_path) -> None:
    with pytest.raises(PcompileError) as info:
        compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=3, dump=False)
    message = str(info.value)
    assert "the strategy requires 8 devices, but the device number of this stage is 3" in message
    assert "Compile for a multiple of 8 devices (--devices 8 or 16, ...)" in message



@pytest.mark.parametrize("devices", [4, 16])
def test_a_layout_for_another_device_count_is_shown_as_written_with_advice(devices) -> None:
    """A Layout strategy whose device matrix is not the device count: the message shows the
    Layout as the model file spells it (not its dict) and says which count would do."""
    with pytest.raises(PcompileError) as info:
        compile_model(os.path.join(ROOT, "examples", "layout_mlp.py"), devices=devices,
                      dump=False)
    message = str(info.value)
    assert (f"accumulate value 8 does not equal to the device number in one stage {devices}; "
            "compile for 8 devices (--devices 8)") in message
    assert ('strategy (Layout((2, 2, 2), ("dp", "sp", "mp"))("mp", ("sp", "dp")), '
            'Layout((2, 2, 2), ("dp", "sp", "mp"))(("sp", "dp"), "None"))') in message
    assert "device_matrix'" not in message
