"""The docs match the tool: every fenced ```bash and ```python block of README.md and docs/*.md
is extracted and run. The rule (also in README.md, "Docs are tested"):

* Untagged blocks are output, file listings and formats: not run. ```bash and ```python blocks
  are run, in a scratch folder holding `examples/`, `benchmarks/` and a copy of `docs/`.
* Leading `NAME=value` words are environment variables given to the command.
* Placeholders: `MODEL.py`/`model.py` is examples/quickstart.py, `DIR` a folder of the scratch
  folder; `--steps N` runs 2 steps.
* A synopsis (a line with `[optional]` groups or `a|b` alternatives) is checked for its flags:
  every `--flag` it names must be one the command accepts.
* Cluster commands (`mpirun`, `srun`, `torchrun`, `msrun`, and rank programs given a
  coordinator or a process count) are checked for syntax and flags: the rank program's own
  argument parser must accept them.
* Not run: `pip install`, `ruff`, `mypy` and `python -m pytest` (what CI runs), and any line
  carrying the visible marker "(not run by the doc test: <reason>)".
* Commands that train (`--run`, a rank program, `pcompile-merge`) run in the slow test.
* A ```python block runs as written, with the imports it shows and nothing else (a reader
  copies it); the blocks of one file share a namespace, in order, as the page is read. A block
  that defines `model()` and `inputs()` is a model file: it is written to a file as it is and
  compiled with `pcompile FILE --devices 8 --search sharding_propagation`.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
from click.testing import CliRunner

from pcompile.cli import main
from tests import ROOT

DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FENCE = re.compile(r"^ *```(\w*)[^\n]*\n(.*?)^ *```", re.M | re.S)
NOT_RUN = "(not run by the doc test:"
CLUSTER = ("mpirun", "srun", "torchrun", "msrun")
SETUP = (("pip",), ("ruff",), ("mypy",), ("python", "-m", "pytest"))


@dataclass
class Block:
    path: str
    lang: str
    text: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(lang: str) -> list[Block]:
    out = []
    for path in DOCS:
        text = open(os.path.join(ROOT, path), encoding="utf-8").read()
        for m in FENCE.finditer(text):
            if m.group(1) == lang:  # blocks inside list items are indented
                out.append(Block(path, lang, textwrap.dedent(m.group(2)),
                                 text[:m.start()].count("\n") + 1))
    return out


def commands(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments kept (for the marker)."""
    out: list[str] = []
    pending = ""
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if out and raw[:1].isspace() and line.strip().startswith("["):
            out[-1] += " " + line.strip()  # a synopsis continued on an indented line
            continue
        if line.strip() and not line.strip().startswith("#"):
            out.append(line.strip())
    return out


def split_comment(command: str) -> tuple[str, str]:
    """(command, comment) at the first ` #` outside quotes."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise AssertionError(f"not valid shell syntax: {command} ({exc})") from None
    code = " ".join(shlex.quote(t) if t not in ("&&",) else t for t in tokens)
    comment = command[command.index("#"):] if "#" in command else ""
    return code, comment


ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `NAME=value` words (environment variables the command is given) and the rest."""
    env = {}
    while argv and ASSIGNMENT.match(argv[0]):
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    return env, argv


def kind(argv: list[str], line: str) -> str:
    argv = split_env(argv)[1]
    if any(tuple(argv[:len(s)]) == s for s in SETUP):
        return "setup"
    if re.search(r"\[|\S\|\S", line):
        return "synopsis"
    if argv[0] in CLUSTER:
        return "cluster"
    if argv[0] == "python" and len(argv) > 1 and argv[1].endswith("program.py"):
        if any(a in argv for a in ("--coordinator", "--num-processes", "--process-id")):
            return "cluster"
        return "train"
    if argv[0] == "pcompile-merge":
        return "train"
    if argv[0] == "pcompile" and "--run" in argv:
        return "train"
    return "run"


def substitute(argv: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if arg in ("MODEL.py", "model.py"):
            arg = "examples/quickstart.py"
        arg = re.sub(r"^DIR(?=/|$)", "DIR", arg)
        if i > 0 and argv[i - 1] == "--steps":
            arg = "2"
        out.append(arg)
    return out


def every_command() -> list[tuple[Block, str]]:
    return [(b, c) for b in blocks("bash") for c in commands(b)]


# -- flag checks ---------------------------------------------------------------------------------


def _click_options(name: str | None) -> set[str]:
    command = main.commands[name or "compile"]
    opts: set[str] = set()
    for param in command.params:
        opts.update(param.opts)
        opts.update(param.secondary_opts)
    opts.update(("-h", "--help"))
    return opts


def rank_program_options() -> set[str]:
    from pcompile.backends.jax.rank_process import rank_command

    opts: set[str] = {"--help"}
    for param in rank_command(8).params:
        opts.update(param.opts)
        opts.update(param.secondary_opts)
    return opts


def merge_options() -> set[str]:
    from pcompile.backends.checkpoint_merge import merge_command

    opts: set[str] = {"--help"}
    for param in merge_command().params:
        opts.update(param.opts if param.param_type_name == "option" else ())
        opts.update(param.secondary_opts)
    return opts


def documented_flags(line: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", line.split(" #")[0]))


def check_synopsis(line: str, where: str) -> None:
    words = line.replace("[", " ").replace("]", " ").split()
    program = words[0]
    flags = documented_flags(line)
    if program == "pcompile":
        sub = words[1] if len(words) > 1 and words[1] in main.commands else None
        known = _click_options(sub) | {"--version"}
    elif program == "pcompile-merge":
        known = merge_options()
    elif program == "python" and words[1].endswith("program.py"):
        known = rank_program_options()
    else:
        raise AssertionError(f"{where}: a synopsis of {program}, which the test does not know")
    unknown = sorted(flags - known)
    assert not unknown, f"{where}: {line}\n  documents flags the tool does not have: {unknown}"


def check_cluster(argv: list[str], where: str) -> None:
    """The program and its flags after the launcher's own options."""
    program = next((i for i, a in enumerate(argv) if a.endswith("program.py")), None)
    assert program is not None, f"{where}: a cluster command without a rank program"
    from pcompile.backends.jax.rank_process import parse_args

    try:
        parse_args(argv[program + 1:], 8)
    except SystemExit as exc:
        raise AssertionError(f"{where}: the rank program refuses {argv[program + 1:]}") from exc


# -- running ---------------------------------------------------------------------------------------


@pytest.fixture()
def scratch(tmp_path, monkeypatch) -> str:
    for name in ("examples", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return str(tmp_path)


def run_command(argv: list[str], where: str) -> None:
    env, argv = split_env(argv)
    if argv[0] == "pcompile":
        result = CliRunner().invoke(main, argv[1:], env=env)
        assert result.exit_code == 0, f"{where}: {shlex.join(argv)}\n{result.output}"
        return
    exe = {"python": sys.executable,
           "pcompile-merge": os.path.join(os.path.dirname(sys.executable), "pcompile-merge")}
    assert argv[0] in exe, f"{where}: the doc test does not know how to run {argv[0]}"
    proc = subprocess.run([exe[argv[0]], *argv[1:]], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, f"{where}: {shlex.join(argv)}\n{proc.stdout}{proc.stderr}"


def _commands_of(kinds: tuple[str, ...]) -> list[tuple[str, list[str], str]]:
    out = []
    for block, line in every_command():
        for part in line.split(" && "):
            code, comment = split_comment(part)
            if NOT_RUN in comment or not code:
                continue
            argv = substitute(shlex.split(code))
            k = kind(argv, part)
            if k in kinds:
                out.append((block.where(), argv, part))
    return out


def test_the_rule_finds_commands() -> None:
    kinds = {kind(substitute(shlex.split(split_comment(p)[0])), p)
             for _, line in every_command() for p in line.split(" && ")
             if split_comment(p)[0]}
    assert {"run", "train", "synopsis", "cluster", "setup"} <= kinds
    assert len(blocks("python")) >= 5


def test_synopses_and_cluster_commands() -> None:
    checked = 0
    for where, argv, line in _commands_of(("synopsis", "cluster")):
        if kind(argv, line) == "synopsis":
            check_synopsis(line, where)
        else:
            check_cluster(argv, where)
        checked += 1
    assert checked >= 8


@pytest.mark.slow  # ~100 s: every compile command of the docs
def test_commands_run(scratch: str) -> None:
    """Commands about a compiled DIR (show, diff) find the quickstart compiled there."""
    run_command(["pcompile", "examples/quickstart.py", "--devices", "8", "--search",
                 "sharding_propagation", "--out", "DIR", "--no-check"], "setup")
    ran = 0
    for where, argv, _ in _commands_of(("run",)):
        run_command(argv, where)
        ran += 1
    assert ran >= 8
    # what the documented commands wrote is the tool's (e.g. the schema equals docs/'s)
    assert open("docs/plan.schema.json").read() == open(
        os.path.join(ROOT, "docs", "plan.schema.json")).read()


@pytest.mark.slow
def test_training_commands_run(scratch: str) -> None:
    """--run commands (2 steps), rank programs on their own and pcompile-merge, on a DIR
    compiled and trained first (the docs' commands need one)."""
    result = CliRunner().invoke(main, ["examples/quickstart.py", "--devices", "8", "--search",
                                       "sharding_propagation", "--out", "DIR", "--no-check",
                                       "--run", "--steps", "2"])
    assert result.exit_code == 0, result.output
    ran = 0
    for where, argv, _ in _commands_of(("train",)):
        if argv[0] == "pcompile" and "--out" not in argv:
            argv = [*argv, "--out", "trained"]
        run_command(argv, where)
        ran += 1
    assert ran >= 3


def test_python_blocks(scratch: str) -> None:
    by_file: dict[str, list[Block]] = {}
    for block in blocks("python"):
        by_file.setdefault(block.path, []).append(block)
    models = 0
    for found in by_file.values():
        from pcompile.compiler.config.context import reset_auto_parallel_context, reset_context

        namespace: dict = {"__name__": "__doc__"}
        for block in found:
            defines = re.search(r"^def model\(", block.text, re.M) and re.search(
                r"^def inputs\(", block.text, re.M)
            if defines:
                models += 1
                model = os.path.join(scratch, f"doc_model_{models}.py")
                with open(model, "w", encoding="utf-8") as f:
                    f.write(block.text)
                result = CliRunner().invoke(main, [model, "--devices", "8", "--search",
                                                   "sharding_propagation", "--out",
                                                   f"doc_model_{models}"])
                assert result.exit_code == 0, f"{block.where()}: the model file does not " \
                                              f"compile:\n{result.output}"
                continue
            try:
                exec(compile(block.text, block.where(), "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{block.where()}: {type(exc).__name__}: {exc}") from exc
        reset_auto_parallel_context()
        reset_context()
    assert models >= 1


def test_output_folders_of_the_docs_are_ignored() -> None:
    """Following the docs must not leave files that `ruff check .` lints (the rank programs of
    an --out folder are Python): every --out folder a documented command names is in
    .gitignore (ruff honours it), and so is the default ./saved_graph."""
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        ignored = {line.strip().strip("/") for line in f if line.strip()
                   and not line.startswith("#")}
    folders = {"saved_graph"}
    for _, argv, _ in _commands_of(("run", "train")):
        if "--out" in argv:
            folder = argv[argv.index("--out") + 1]
            if folder != "DIR":
                folders.add(folder.strip("/").split("/")[0])
    assert {"pipe", "pipe_run", "llama_run"} <= folders
    assert not folders - ignored, f"not in .gitignore: {sorted(folders - ignored)}"
