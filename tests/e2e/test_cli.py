"""End-to-end tests of the command line on the examples and on broken model files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from pcompile.cli import main
from pcompile.ir.parser import parse_graph
from pcompile.ir.printer import print_graph
from tests import ROOT

EXAMPLES = ["quickstart.py", "layout_mlp.py", "manual_parallel.py", "dense_gelu_blocks.py",
            "gpt_block.py"]


def run_cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_compiles_dumps_and_backends_agree(example: str, tmp_path) -> None:
    out = tmp_path / "out"
    code, output = run_cli([os.path.join(ROOT, "examples", example), "--devices", "1",
                            "--out", str(out)])
    assert code == 0, output
    assert "first step loss (float64): numpy" in output
    files = sorted(f for f in os.listdir(out / "rank_0") if f.endswith(".ir"))
    assert files == ["00_trace.ir", "01_autodiff.ir", "02_optimizer.ir", "03_execute.ir"]
    for name in files:
        text = (out / "rank_0" / name).read_text()
        assert print_graph(parse_graph(text, name)) == text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["devices"] == 1 and plan["training"] is True
    assert plan["outputs"][0] == "loss"


def test_dumps_are_byte_identical(tmp_path) -> None:
    model = os.path.join(ROOT, "examples", "quickstart.py")
    texts = []
    for name in ("a", "b"):
        code, output = run_cli([model, "--devices", "1", "--out", str(tmp_path / name),
                                "--no-check"])
        assert code == 0, output
        texts.append({f: (tmp_path / name / "rank_0" / f).read_bytes()
                      for f in os.listdir(tmp_path / name / "rank_0")})
    assert texts[0] == texts[1]


def test_quickstart_training_lowers_the_loss(tmp_path) -> None:
    code, output = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--devices", "1",
                            "--out", str(tmp_path / "o"), "--run", "--steps", "40"])
    assert code == 0, output
    log = (tmp_path / "o" / "rank_0" / "train.log").read_text().splitlines()
    assert len(log) == 40
    assert log[0].startswith("epoch: 1 step: 1, loss is ")
    assert log[4].startswith("epoch: 2 step: 1, loss is ")
    losses = [float(line.rsplit(" ", 1)[1]) for line in log]
    assert losses[-1] < 0.5 * losses[0]


def write_model(tmp_path, body: str) -> str:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_shape_error_names_op_scope_line_and_shapes(tmp_path) -> None:
    model = write_model(tmp_path, """
        import numpy as np
        from pcompile import nn, ops, Parameter

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.w = Parameter(np.ones((8, 4), np.float32), "w")
                self.matmul = ops.MatMul()

            def construct(self, x):
                return self.matmul(x, self.w)

        def model():
            return Net()

        def inputs():
            return (np.ones((2, 5), np.float32),)
    """)
    out = tmp_path / "out"
    code, output = run_cli([model, "--out", str(out)])
    assert code == 1
    assert "MatMul 'matmul'" in output
    assert "scope Default" in output
    assert "model.py:12" in output
    assert "(2, 5)" in output and "(8, 4)" in output
    assert not out.exists()


def test_import_error_is_one_clear_message(tmp_path) -> None:
    model = write_model(tmp_path, "import numpy as np\nraise RuntimeError('boom')\n")
    code, output = run_cli([model])
    assert code == 1
    assert "failed to import: RuntimeError: boom" in output
    assert "model.py:2" in output
    assert "Traceback" not in output


def test_missing_model_function(tmp_path) -> None:
    model = write_model(tmp_path, "def inputs():\n    return ()\n")
    code, output = run_cli([model])
    assert code == 1 and "must define model()" in output


def test_malformed_strategy_is_a_type_error_at_the_line(tmp_path) -> None:
    model = write_model(tmp_path, """
        import numpy as np
        from pcompile import nn, ops

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.relu = ops.ReLU().shard(((2.0, 1),))

            def construct(self, x):
                return self.relu(x)

        def model():
            return Net()

        def inputs():
            return (np.ones((4, 4), np.float32),)
    """)
    code, output = run_cli([model])
    assert code == 1
    assert "TypeError" in output and "float" in output and "model.py:8" in output


def test_strategy_of_wrong_rank_names_the_op(tmp_path) -> None:
    model = write_model(tmp_path, """
        import numpy as np
        from pcompile import nn, ops

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.relu = ops.ReLU().shard(((2, 1, 1),))

            def construct(self, x):
                return self.relu(x)

        def model():
            return Net()

        def inputs():
            return (np.ones((4, 4), np.float32),)
    """)
    code, output = run_cli([model])
    assert code == 1
    assert "ReLU 'relu'" in output and "rank 2" in output and "model.py:11" in output


def test_unknown_context_option(tmp_path) -> None:
    model = write_model(tmp_path, """
        from pcompile import set_auto_parallel_context
        set_auto_parallel_context(device_nums=8)
        def model():
            pass
        def inputs():
            return ()
    """)
    code, output = run_cli([model])
    assert code == 1
    assert "device_nums" in output and "device_num" in output


def test_pipeline_stages_without_staged_cells_says_so(tmp_path) -> None:
    out = tmp_path / "out"
    model = tmp_path / "pipelined.py"
    model.write_text(open(os.path.join(ROOT, "examples", "quickstart.py")).read()
                     + "\nfrom compiler import set_auto_parallel_context as _s\n"
                       "_s(pipeline_stages=2)\n")
    code, output = run_cli([str(model), "--devices", "8", "--parallel-mode",
                            "semi_auto_parallel", "--out", str(out)])
    assert code == 1
    assert "stage 0 has no op" in output and "pipeline_stage = s" in output
    assert not out.exists()


def test_failed_compile_keeps_previous_output(tmp_path) -> None:
    out = tmp_path / "out"
    code, _ = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--out", str(out),
                       "--no-check"])
    assert code == 0
    before = sorted(os.listdir(out / "rank_0"))
    bad = write_model(tmp_path, "def model():\n    raise ValueError('nope')\n"
                                "def inputs():\n    return ()\n")
    code, output = run_cli([bad, "--out", str(out)])
    assert code == 1 and "nope" in output
    assert sorted(os.listdir(out / "rank_0")) == before


def test_refuses_to_overwrite_foreign_folder(tmp_path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    code, output = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--out",
                            str(foreign), "--no-check"])
    assert code == 1 and "did not write" in output
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_semi_auto_parallel_on_8_devices_checks_the_oracle(tmp_path) -> None:
    out = tmp_path / "out"
    code, output = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--devices", "8",
                            "--parallel-mode", "semi_auto_parallel", "--out", str(out)])
    assert code == 0, output
    assert "parallel plan vs single device (float64): worst relative error" in output
    assert sorted(os.listdir(out)) == [".gitignore", ".pcompile-manifest.json", "params.json",
                                       "plan.json", "program.py"] + [f"rank_{r}" for r in range(8)]
    names = sorted(f for f in os.listdir(out / "rank_3") if f.endswith(".ir"))
    assert names == ["00_trace.ir", "01_step_parallel_begin.ir", "02_step_parallel_end.ir",
                     "03_autodiff.ir", "04_optimizer.ir", "05_comm_fusion.ir", "06_execute.ir"]
    for r in range(8):
        for name in names:
            text = (out / f"rank_{r}" / name).read_text()
            assert print_graph(parse_graph(text, name)) == text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["parameters"]["w"]["dev_matrix"] == [2, 4]  # normalised, as MindSpore
    assert plan["parameters"]["w"]["slice_shape"] == [8, 16]
    assert any(c["op"] == "AllReduce" for c in plan["collectives"]["0"])


def test_console_script_entry_point(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", os.path.join(ROOT, "examples", "quickstart.py"),
         "--devices", "1", "--out", str(tmp_path / "o"), "--no-check"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "compiled" in proc.stdout


def test_search_with_another_parallel_mode_is_refused(tmp_path) -> None:
    code, output = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--devices", "8",
                            "--search", "dynamic_programming", "--parallel-mode",
                            "semi_auto_parallel", "--out", str(tmp_path / "o")])
    assert code == 1 and "--search dynamic_programming chooses strategies in auto_parallel" \
        in output


def test_bad_flag_values_exit_2(tmp_path) -> None:
    code, output = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--devices", "0"])
    assert code == 2 and "--devices" in output
    code, output = run_cli([os.path.join(ROOT, "examples", "quickstart.py"), "--search", "bfs"])
    assert code == 2 and "bfs" in output


def test_parallel_outputs_are_byte_identical(tmp_path) -> None:
    model = os.path.join(ROOT, "examples", "quickstart.py")
    trees = []
    for name in ("a", "b"):
        code, output = run_cli([model, "--devices", "8", "--search", "sharding_propagation",
                                "--out", str(tmp_path / name), "--no-check"])
        assert code == 0, output
        root = tmp_path / name
        trees.append({str(p.relative_to(root)): p.read_bytes()
                      for p in sorted(root.rglob("*")) if p.is_file()})
    assert trees[0].keys() == trees[1].keys()
    assert any(k.endswith("program.py") for k in trees[0])
    different = [k for k in trees[0] if trees[0][k] != trees[1][k]]
    assert not different, different


def test_error_inside_construct_is_one_message(tmp_path) -> None:
    model = write_model(tmp_path, """
        import numpy as np
        from pcompile import nn, ops

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.relu = ops.ReLU()

            def construct(self, x):
                return self.relu(x) + self.missing

        def model():
            return Net()

        def inputs():
            return (np.ones((4, 4), np.float32),)
    """)
    code, output = run_cli([model])
    assert code == 1
    assert "Net.construct()" in output and "AttributeError" in output
    assert "model.py:11" in output and "Traceback" not in output
