"""The installed package lives under one name, `pcompile`: installed into a fresh virtual
environment next to PyPI's `ir` and `compiler` packages (whose top-level names are those of our
folders) and run beside a user's own `backends.py` and `cli/`, every example still compiles and
`python -m pcompile --version` works; removing `ir` and `compiler` again leaves pcompile whole.

It needs an index to install from (PyPI): when pip cannot reach one, the test is skipped with
pip's reason (a visible skip, `pytest -rs` prints it)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

from pcompile import __version__
from tests import ROOT

EXAMPLES = os.path.join(ROOT, "examples")

#: Flags each example compiles with (its docstring's command); the error example's message.
FLAGS = {
    "quickstart.py": ["--devices", "8", "--search", "sharding_propagation"],
    "gpt_block.py": ["--devices", "8", "--search", "recursive_programming"],
}
FAILS = {"shared_parameter_error.py": "has multiple users, but the TensorInfo are different"}

NO_INDEX = ("No matching distribution", "Could not find a version", "Failed to establish",
            "Temporary failure in name resolution", "Network is unreachable", "ProxyError",
            "Max retries exceeded", "connection", "Connection")


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)


def _env(venv: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("PCOMPILE_")}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    env["GPT_LAYERS"] = "2"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _digest(folder: str) -> str:
    h = hashlib.sha256()
    for base, dirs, files in sorted(os.walk(folder)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".pyc"):
                continue
            path = os.path.join(base, name)
            h.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


@pytest.mark.slow
def test_install_beside_colliding_packages(tmp_path) -> None:
    venv = str(tmp_path / "venv")
    made = _run([sys.executable, "-m", "venv", venv])
    assert made.returncode == 0, made.stderr
    python = os.path.join(venv, "bin", "python")
    env = _env(venv)
    others = _run([python, "-m", "pip", "install", "-q", "ir", "compiler"], env=env)
    if others.returncode != 0:
        why = (others.stderr or others.stdout).strip().splitlines()
        if any(word in others.stderr + others.stdout for word in NO_INDEX):
            pytest.skip("pip cannot install PyPI's ir and compiler: "
                        + (why[-1] if why else "no output"))
        raise AssertionError(f"pip install ir compiler failed:\n{others.stderr}")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                env=env).stdout.strip()
    before = {name: _digest(os.path.join(site, name)) for name in ("ir", "compiler")}
    installed = _run([python, "-m", "pip", "install", "-q", ROOT], env=env)
    assert installed.returncode == 0, installed.stderr
    # nothing of ours at the top level; theirs untouched
    assert os.path.isfile(os.path.join(site, "pcompile", "py.typed"))
    for name in ("backends", "passes", "cli.py"):
        assert not os.path.exists(os.path.join(site, name)), name
    assert {name: _digest(os.path.join(site, name)) for name in before} == before

    work = tmp_path / "work"
    shutil.copytree(EXAMPLES, work)
    (work / "backends.py").write_text('raise RuntimeError("the user\'s backends.py")\n')
    (work / "cli").mkdir()
    (work / "cli" / "__init__.py").write_text('raise RuntimeError("the user\'s cli")\n')
    where = _run([python, "-c", "import pcompile, ir, compiler; print(pcompile.__file__); "
                                "print(ir.__file__); print(compiler.__file__)"],
                 env=env, cwd=str(work))
    assert where.returncode == 0, where.stderr
    ours, theirs_ir, theirs_compiler = where.stdout.split()
    assert ours.startswith(site) and theirs_ir.startswith(site)
    assert theirs_compiler.startswith(site)

    version = _run([python, "-m", "pcompile", "--version"], env=env, cwd=str(work))
    assert version.returncode == 0 and version.stdout.strip() == f"pcompile {__version__}", \
        version.stdout + version.stderr

    pcompile = os.path.join(venv, "bin", "pcompile")
    examples = sorted(f for f in os.listdir(work) if f.endswith(".py") and f != "backends.py")
    assert len(examples) >= 8
    for example in examples:
        flags = FLAGS.get(example, ["--devices", "8"])
        proc = _run([pcompile, example, *flags, "--out", f"out_{example[:-3]}"], env=env,
                    cwd=str(work))
        if example in FAILS:
            assert proc.returncode == 1 and FAILS[example] in proc.stderr, proc.stderr
            assert "Traceback" not in proc.stderr
            continue
        assert proc.returncode == 0, f"{example}:\n{proc.stdout}\n{proc.stderr}"
        assert os.path.isfile(work / f"out_{example[:-3]}" / "plan.json")
    shown = _run([pcompile, "show", "out_quickstart", "--no-svg"], env=env, cwd=str(work))
    assert shown.returncode == 0 and "((2, 4), (4, 1))" in shown.stdout, shown.stderr

    # removing their packages leaves ours whole (it used to delete our ir/ files)
    removed = _run([python, "-m", "pip", "uninstall", "-y", "-q", "ir", "compiler"], env=env)
    assert removed.returncode == 0, removed.stderr
    again = _run([pcompile, "quickstart.py", *FLAGS["quickstart.py"], "--out", "again"],
                 env=env, cwd=str(work))
    assert again.returncode == 0, again.stderr
