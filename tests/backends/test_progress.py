"""Progress and logging (program/progress.py, the CLI's -v/-q, the rank programs' output):
pass-by-pass compile progress through the driver's hook, quiet when not a terminal, a warning
once however many ranks log it, loss lines every K steps with the step rate and time left,
and under a multi-process launcher only process 0 prints losses unless asked, other processes'
lines carrying `[rank r]`."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from pcompile.cli import main
from pcompile.program.progress import LossMonitor, log, setup_logging
from pcompile.tools.compile import compile as compile_model
from tests import ROOT
from tests.multiprocess import clean_env

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_levels() -> None:
    assert setup_logging(0, False, io.StringIO()) == logging.WARNING  # not a terminal
    assert setup_logging(0, False, _Tty()) == logging.INFO
    assert setup_logging(1, False, io.StringIO()) == logging.INFO
    assert setup_logging(2, False, io.StringIO()) == logging.DEBUG
    assert setup_logging(1, True, _Tty()) == logging.WARNING


def test_a_warning_is_printed_once() -> None:
    stream = io.StringIO()
    setup_logging(0, False, stream, prefix="[rank 3] ")
    for _ in range(8):  # e.g. once per rank graph
        logging.getLogger("pcompile.passes.comm_fusion").warning("split index %d ignored", 9)
    log.warning("another")
    assert stream.getvalue().splitlines() == ["[rank 3] pcompile: split index 9 ignored",
                                              "[rank 3] pcompile: another"]


def test_compile_progress_pass_by_pass(tmp_path) -> None:
    events: list[tuple[str, dict]] = []
    program = compile_model(QUICKSTART, devices=8, search_mode="sharding_propagation",
                            out_dir=str(tmp_path / "out"),
                            on_event=lambda event, **info: events.append((event, info)))
    passes = [info["name"] for event, info in events if event == "pass"]
    assert passes == [name for name, _ in program.timings]
    assert [e for e, _ in events][-2:] == ["write", "written"]
    assert events[-2][1]["ranks"] == 8
    # the CLI with -v prints them to stderr with the elapsed time
    result = CliRunner().invoke(main, [QUICKSTART, "--devices", "8", "--no-check", "-v",
                                       "--out", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert re.search(r"pcompile: \[ *\d+\.\d\d s\] pass 1/\d+ trace done in", result.output)
    assert "wrote " in result.output and "writing " in result.output
    # not a terminal and no -v: no progress lines; -q: not even the pass table
    quiet = CliRunner().invoke(main, [QUICKSTART, "--devices", "8", "--no-check", "-q",
                                      "--out", str(tmp_path / "q")])
    assert quiet.exit_code == 0 and "pass 1/" not in quiet.output
    assert "pass trace" not in quiet.output and quiet.output.startswith("compiled ")
    plain = CliRunner().invoke(main, [QUICKSTART, "--devices", "8", "--no-check",
                                      "--out", str(tmp_path / "p")])
    assert "pass 1/" not in plain.output and "pass trace" in plain.output


def test_loss_monitor_interval_rate_and_eta() -> None:
    printed: list[str] = []
    stream = io.StringIO()
    setup_logging(1, False, stream)
    monitor = LossMonitor(steps=7, per_print=3, echo=printed.append)
    for step in range(1, 8):
        monitor(f"epoch: 1 step: {step}, loss is 0.5")
    monitor("a message that is not a loss line")
    assert printed == ["epoch: 1 step: 3, loss is 0.5", "epoch: 1 step: 6, loss is 0.5",
                       "epoch: 1 step: 7, loss is 0.5", "a message that is not a loss line"]
    progress = stream.getvalue()
    assert "step 7/7" in progress and "steps/s" in progress and "left" in progress


def test_run_prints_every_k_steps(tmp_path) -> None:
    result = CliRunner().invoke(main, [QUICKSTART, "--devices", "1", "--out", str(tmp_path),
                                       "--no-check", "--run", "--steps", "5",
                                       "--print-every", "2"])
    assert result.exit_code == 0, result.output
    printed = [line for line in result.output.splitlines() if line.startswith("epoch:")]
    assert [line.split(",")[0] for line in printed] == \
        ["epoch: 1 step: 2", "epoch: 1 step: 4", "epoch: 2 step: 1"]
    logged = (tmp_path / "rank_0" / "train.log").read_text().splitlines()
    assert len(logged) == 5  # the log keeps every step
    bad = CliRunner().invoke(main, [QUICKSTART, "--print-every", "2"])
    assert bad.exit_code == 2 and "--print-every" in bad.output and "--run" in bad.output


@pytest.mark.slow
def test_only_process_zero_prints_losses(tmp_path) -> None:
    """Two processes started with torchrun's variables (as mpirun/srun would start them): process
    0 prints every second loss line; process 1 prints no loss line unless --all-ranks, and its
    lines carry [rank r]."""
    from pcompile.backends.launcher import free_port

    out = tmp_path / "out"
    compile_model(QUICKSTART, devices=2, parallel_mode="data_parallel", out_dir=str(out))

    def job(*flags: str) -> list[str]:
        port = str(free_port())
        procs = [subprocess.Popen(
            [sys.executable, str(out / "program.py"), "--steps", "4", "--no-checkpoint",
             *flags],
            env=clean_env("RANK", "WORLD_SIZE", RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
            for r in range(2)]
        outputs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stdout + stderr
            # gloo's own connection message is not ours to prefix
            outputs.append("".join(line for line in stdout.splitlines(keepends=True)
                                   if not line.startswith("[Gloo]")))
        return outputs

    zero, one = job("--print-every", "2")
    assert [line.split(",")[0] for line in zero.splitlines() if "loss is" in line] == \
        ["epoch: 1 step: 2", "epoch: 1 step: 4"]
    assert "loss is" not in one
    assert one.strip() and all(line.startswith("[rank 1] ") for line in one.splitlines())
    zero, one = job("--all-ranks")
    assert len([line for line in one.splitlines() if line.startswith("[rank 1] epoch: ")]) == 4
    assert not any(line.startswith("[rank") for line in zero.splitlines())


def test_a_terminal_gets_one_display_of_the_steps(monkeypatch) -> None:
    """On a terminal the bar is the only per-step display: no `step k/N` log lines beside it
    (they glued to the bar and repeated steps); it shows each step as it is reached; messages
    logged meanwhile go above it; -q or a stderr that is no terminal get plain lines."""
    from rich.console import Console

    from pcompile.program.progress import RichLossMonitor, run_monitor

    logged = _Tty()
    setup_logging(0, False, logged)  # a terminal: INFO
    assert type(run_monitor(3, 1, print, stream=_Tty(), err=_Tty())) is RichLossMonitor
    assert type(run_monitor(3, 1, print, stream=io.StringIO(), err=_Tty())) is RichLossMonitor
    assert type(run_monitor(3, 1, print, stream=_Tty(), err=io.StringIO())) is LossMonitor
    setup_logging(0, True, logged)  # -q
    assert type(run_monitor(3, 1, print, stream=_Tty(), err=_Tty())) is LossMonitor

    setup_logging(0, False, logged)
    screen = io.StringIO()
    bar = RichLossMonitor(20, 1, console=Console(file=screen, force_terminal=True, width=80))
    for step in range(1, 21):
        bar(f"epoch: 1 step: {step}, loss is 0.{step}")
        assert f"{step}/20" in screen.getvalue()  # drawn now, not at the next refresh
        if step == 10:
            log.warning("a message in the middle of the run")
    bar.close()
    text = screen.getvalue()
    assert "a message in the middle of the run" in text
    assert len(re.findall(r"epoch: 1 step: \d+, loss is", text)) == 20
    assert "pcompile: step" not in logged.getvalue() + text
    assert "a message" not in logged.getvalue()  # above the bar, not into it
    log.warning("after the run")
    assert "after the run" in logged.getvalue()  # the handler writes to its stream again


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_run_on_a_terminal_prints_each_step_once(tmp_path) -> None:
    """`pcompile --run --steps 20` on an 80-column terminal: the 20 loss lines and one bar, no
    per-step stderr line (it was 102 lines, the bar glued to `pcompile: step k/20` lines)."""
    primary, secondary = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pcompile", QUICKSTART, "--devices", "1", "--no-check",
         "--out", str(tmp_path / "out"), "--run", "--steps", "20"],
        stdin=secondary, stdout=secondary, stderr=secondary, cwd=str(tmp_path),
        env=clean_env(COLUMNS="80", LINES="40", TERM="xterm"))
    os.close(secondary)
    screen = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        screen += chunk
    os.close(primary)
    assert proc.wait(timeout=300) == 0, screen.decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    assert "pcompile: step" not in text, text
    assert len(re.findall(r"epoch: \d+ step: \d+, loss is", text)) == 20, text
    assert "20/20" in text and text.index("20/20") < text.index("20 steps in"), text
