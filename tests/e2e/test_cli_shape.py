"""The command line only parses and prints (issue 37 move 5): the run and check orchestration
live in tools/ (tools/command.py, tools/run.py, tools/checks.py), the launch and the one-rank
run in backends/ (launcher.py `run_launched`, jax/in_process.py `train_in_process`), the run's
options are a typed frozen `RunOptions` (backends/run_options.py), and `compile` names one
thing."""

from __future__ import annotations

import ast
import dataclasses
import os

import pytest

from tests import ROOT


def test_cli_is_short_and_defines_no_run_or_check() -> None:
    """cli.py is under 350 lines (960 before) and defines no run loop, launch or check."""
    text = open(os.path.join(ROOT, "cli.py")).read()
    assert len(text.splitlines()) < 350
    names = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    assert not {n for n in names if n.startswith(("_train", "_launch", "_check_"))
                and n != "_check_run_flags"}, names


def test_run_options_are_typed_and_frozen() -> None:
    """--run's options travel as a frozen dataclass (a dict before); a name it lacks is a
    TypeError, not a silently ignored key; the rank programs' flags come from it."""
    from pcompile.backends.run_options import RunOptions

    options = RunOptions(steps=3, log_every=2, tensorboard="/tb")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.steps = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunOptions(stepz=3)  # type: ignore[call-arg]
    assert options.rank_flags() == ["--matmul-precision", "default", "--log-every", "2",
                                    "--tensorboard", "/tb"]
    assert options.launched(parallel=False)  # --tensorboard: the rank programs write it
    assert not RunOptions().launched(parallel=False) and RunOptions().launched(parallel=True)


def test_one_name_per_meaning_of_compile() -> None:
    """`pcompile.compile` (tools/compile.py) compiles and writes; the driver's compile, which
    writes nothing, is `compile_program` (both were `compile`)."""
    import pcompile
    from pcompile.compiler.driver import driver
    from pcompile.tools import compile as facade

    assert not hasattr(driver, "compile")
    assert driver.compile_program.__name__ == "compile_program"
    assert pcompile.compile is facade.compile
