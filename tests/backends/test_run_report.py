"""What a run reports (backends/run_report.py, the rank runtime, the launcher): the start-up
breakdown, metrics.jsonl, throughput units, model FLOPs and MFU, resume messages and honest step
counts. No assertion on a time's value: only on what is reported and its form."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from pcompile.backends import run_report
from pcompile.backends.launcher import LaunchResult, tail
from pcompile.tools.compile import compile as compile_model
from tests import ROOT
from tests.multiprocess import clean_env, mlp_source

HAVE_TENSORBOARDX = importlib.util.find_spec("tensorboardX") is not None
CLI = os.path.join(ROOT, "cli.py")

MODEL = mlp_source("((2, 1), (1, 1))", data='''
def labels():
    return (np.zeros((8, 8), np.float32),)
''')


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "mlp2.py"
    path.write_text(textwrap.dedent(MODEL))
    return str(path)


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("TPU v4", 275.0),
])
def test_known_devices_have_a_bf16_peak(kind, peak) -> None:
    assert run_report.peak_tflops(kind, "gpu") == peak


def test_unknown_devices_and_cpus_have_no_peak() -> None:
    assert run_report.peak_tflops("Some Future Accelerator", "gpu") is None
    assert run_report.peak_tflops("cpu", "cpu") is None
    line = run_report.summary_line(3, 1, 3, 1.0, 10.0, "tokens", 512, 10**12, "counted", None, 8)
    assert "MFU" not in line and "tokens/s" in line and "TFLOP/s" in line


def test_mfu_is_model_flops_over_the_peak_of_every_rank() -> None:
    # 989e12 FLOP in 1 s on 2 devices of 989 TFLOP/s: 50%
    line = run_report.summary_line(2, 1, 2, 2.0, 1000.0, "tokens", 4096, 989 * 10**12,
                                   "counted on the graph", 989.0, 2)
    assert "MFU 50.0% of 2 x 989 TFLOP/s bf16" in line, line


def test_token_ids_count_tokens_other_inputs_samples() -> None:
    assert run_report.throughput_unit([((4, 2048), "int32"), ((4, 2048), "int32")]) == (
        "tokens", 8192)
    assert run_report.throughput_unit([((16, 32), "float32")]) == ("samples", 16)
    assert run_report.throughput_unit([((8, 3, 32, 32), "bfloat16")]) == ("samples", 8)
    assert run_report.step_flops(0, 1000, "tokens", 10) == (60000, "6 x parameters x tokens")
    assert run_report.step_flops(0, 1000, "samples", 10) == (0, "")
    assert run_report.step_flops(7, 1000, "tokens", 10)[0] == 7


def test_metrics_records_parse_even_for_a_non_finite_loss() -> None:
    record = run_report.metrics_record(5, 1, 5, 0.25, 12.5, "tokens", 1000,
                                       {"lr": 0.1, "loss_scale": 1024.0, "overflow": False,
                                        "grad_norm": float("inf")})
    parsed = json.loads(run_report.metrics_line(record))
    assert parsed == {"step": 5, "epoch": 1, "step_in_epoch": 5, "loss": 0.25, "lr": 0.1,
                      "loss_scale": 1024.0, "overflow": False, "grad_norm": None,
                      "grad_norm_text": "inf", "step_time_ms": 12.5, "tokens_per_s": 80000.0}
    nan = json.loads(run_report.metrics_line(
        run_report.metrics_record(1, 1, 1, float("nan"), None, "samples", 8)))
    assert nan["loss"] is None and nan["loss_text"] == "nan"


def test_metrics_lines_name_their_run_and_a_resume_keeps_only_its_own(tmp_path) -> None:
    """Each metrics.jsonl line carries the run's id (issue 38: a file could mix two runs'
    lines); a resumed run keeps the lines of the run it continues, not another run's."""
    from types import SimpleNamespace

    import numpy as np

    from pcompile.backends.jax.rank_report import RankReport

    assert json.loads(run_report.metrics_line(run_report.metrics_record(
        3, 1, 3, 0.5, 10.0, "samples", 8, run="a1")))["run"] == "a1"
    lines = [{"run": "a1", "step": 1}, {"run": "b2", "step": 1}, {"run": "a1", "step": 2},
             {"run": "b2", "step": 2}, {"run": "a1", "step": 3}, {"step": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    module = SimpleNamespace(NUM_RANKS=1, PARAMS=(), LAYOUTS={})
    device = SimpleNamespace(device_kind="cpu", platform="cpu")
    mesh = SimpleNamespace(devices=np.array([device], dtype=object))
    RankReport(module, mesh, str(tmp_path), 2, 1, writes=True, run="a1")
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [{"run": "a1", "step": 1}, {"run": "a1", "step": 2}]


def test_the_startup_line_names_every_phase() -> None:
    line = run_report.startup_line({"imports": 2.0, "distributed": 0.5, "init": 1.0,
                                    "compile": 3.0, "first_step": 0.25, "other": 0.25,
                                    "total": 7.0})
    assert line.startswith("time to first step 7.00 s: ")
    for label in ("Python imports", "jax.distributed start-up", "parameter init",
                  "XLA compile", "first step"):
        assert label in line


def test_gloo_connection_lines_leave_the_echoed_tail_not_the_log(tmp_path) -> None:
    log = tmp_path / "run.log"
    text = ("parameters made\n"
            "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
            "ranks is : [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
            "connected peer ranks is : 1\n1\n"
            "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer "
            "ranks is : 3\nboom\n")
    log.write_text(text)
    assert tail(str(log)) == "parameters made\nboom\n"
    assert log.read_text() == text


def test_a_resumed_launch_counts_only_its_own_steps() -> None:
    result = LaunchResult(0, losses=["epoch: 1 step: 1, loss is 1"] * 28, resumed_from=25)
    assert result.trained == 3
    assert LaunchResult(0, losses=["x"] * 4).trained == 4


def test_a_terminal_gets_a_progress_bar_and_a_pipe_plain_lines() -> None:
    from rich.console import Console

    from pcompile.program.progress import LossMonitor, RichLossMonitor, run_monitor

    lines: list[str] = []
    plain = run_monitor(3, 1, lines.append, stream=io.StringIO())
    assert type(plain) is LossMonitor
    screen = io.StringIO()
    bar = RichLossMonitor(3, 1, console=Console(file=screen, force_terminal=True, width=100))
    for step in (1, 2, 3):
        bar(f"epoch: 1 step: {step}, loss is 0.{step}")
    bar.close()
    bar.close()  # twice is harmless
    assert "loss is 0.3" in screen.getvalue() and "3/3" in screen.getvalue()


def test_tensorboard_is_one_clear_message_when_tensorboardx_is_missing(monkeypatch,
                                                                       tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails
    with pytest.raises(RuntimeError, match=r"pip install 'pcompile\[tensorboard\]'"):
        run_report.tensorboard_writer(str(tmp_path))
    record = run_report.metrics_record(2, 1, 2, 0.5, 10.0, "samples", 8, {"overflow": True})
    assert run_report.tensorboard_scalars(record) == {
        "train/loss": 0.5, "train/overflow": 1.0, "train/step_time_ms": 10.0,
        "train/samples_per_s": 800.0}


def test_model_flops_are_counted_on_the_traced_graph(model_path, tmp_path) -> None:
    compile_model(model_path, devices=2, out_dir=str(tmp_path / "out"))
    text = (tmp_path / "out" / "program.py").read_text()
    # one (8, 16) x (16, 8) MatMul: 2 * 8 * 8 * 16 FLOPs forward, 3x for training
    assert f"MODEL_FLOPS = {3 * 2 * 8 * 8 * 16}  #" in text
    assert "LEARNING_RATE = 0.1  #" in text


def test_a_token_count_from_the_compile_wins_over_the_inputs_width() -> None:
    assert run_report.throughput_unit([((4, 17), "int32")], 64) == ("tokens", 64)
    assert run_report.throughput_unit([((4, 17), "int32")], 0) == ("tokens", 68)  # none counted
    assert run_report.throughput_unit([((4, 17), "float32")], 64) == ("samples", 4)
    assert run_report.throughput_unit([((4, 17), "int32")]) == ("tokens", 68)  # older programs


@pytest.mark.parametrize(("example", "tokens"), [("llama", 4 * 16), ("mixtral", 8 * 16)])
def test_llama_and_mixtral_report_their_learning_rate_and_the_tokens_they_train(
        tmp_path, example: str, tokens: int) -> None:
    """The network computes its own loss (optimizer() without loss()): the learning rate of
    the optimizer its training step holds is the program's; a sample of S + 1 = 17 token ids
    trains S = 16 tokens (the last id is only a label)."""
    compile_model(os.path.join(ROOT, "examples", f"{example}.py"), devices=8,
                  out_dir=str(tmp_path / "out"), dump_ranks="0")
    text = (tmp_path / "out" / "program.py").read_text()
    assert "LEARNING_RATE = 0.001  #" in text
    assert f"TOKENS_PER_STEP = {tokens}  #" in text


@pytest.mark.slow  # a rank program of Llama on 8 CPU devices (~10 s)
def test_a_llama_run_writes_its_learning_rate_and_trained_tokens_into_the_metrics(
        tmp_path) -> None:
    out = tmp_path / "out"
    compile_model(os.path.join(ROOT, "examples", "llama.py"), devices=8, out_dir=str(out),
                  dump_ranks="0")
    proc = subprocess.run([sys.executable, str(out / "program.py"), "--steps", "3",
                           "--no-checkpoint"], capture_output=True, text=True, env=clean_env(),
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["lr"] == 0.001, r
        # 4 samples of 16 trained tokens a step (not the 17 ids each holds)
        assert r["tokens_per_s"] * r["step_time_ms"] / 1000 == pytest.approx(64, rel=1e-3), r


# -- a rank program run, then resumed ------------------------------------------------------------


@pytest.mark.slow  # a multi-process run (~11 s of CPU)
def test_a_run_reports_its_start_up_metrics_and_a_resume_counts_its_own_steps(
        model_path, tmp_path) -> None:
    out = tmp_path / "out"
    compile_model(model_path, devices=2, out_dir=str(out))

    def run(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, str(out / "program.py"), *args],
            capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    board = tmp_path / "board"
    first = run("--steps", "4", "--log-every", "2",
                *(["--tensorboard", str(board)] if HAVE_TENSORBOARDX else []))
    assert "time to first step " in first and "XLA compile" in first, first
    assert "this run: 4 steps (1..4)" in first and "samples/s" in first, first
    assert "MFU" not in first  # CPU devices
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4]  # the first, every 2nd, the last
    for r in records:
        assert {"step", "epoch", "step_in_epoch", "loss", "lr", "step_time_ms",
                "samples_per_s"} <= set(r), r
        assert r["lr"] == 0.1
    if HAVE_TENSORBOARDX:  # an event file with the scalars' tags
        events = [board / f for f in os.listdir(board) if f.startswith("events.out.tfevents")]
        assert len(events) == 1, os.listdir(board)
        assert b"train/loss" in events[0].read_bytes()
    second = run("--steps", "6", "--resume")
    assert "resuming from step 4" in second, second
    assert "this run: 2 steps (5..6)" in second, second
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 5, 6]
    # one run: the resumed run continues the first and keeps its id
    assert len({r["run"] for r in records}) == 1, records
