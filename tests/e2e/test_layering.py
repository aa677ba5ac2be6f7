"""The rooms' import arrows point down: ir/ <- passes/ <- compiler/ <- backends/ <- tools/ <-
cli.py (DESIGN.md)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests import ROOT

ABOVE_IR = ("pcompile.passes", "pcompile.compiler", "pcompile.backends", "pcompile.tools",
            "pcompile.cli")


def _upward(room: str, above: tuple[str, ...]) -> list[str]:
    """Every import (module level or inside a function) under `room` of a module in `above`."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, room)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read())
            for node in ast.walk(tree):
                modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                           else [a.name for a in node.names] if isinstance(node, ast.Import)
                           else [])
                found += [f"{os.path.relpath(path, ROOT)}: {m}" for m in modules
                          if m.startswith(above)]
    return found


def test_no_pass_imports_the_front_end() -> None:
    """passes/ imports ir/ and itself only: the driver hands the passes typed options
    (compiler/pass_options.py) and traces user code itself (arrows point down)."""
    assert _upward("passes", ("pcompile.compiler", "pcompile.backends", "pcompile.tools",
                              "pcompile.cli")) == []


def test_the_compiler_never_imports_a_backend() -> None:
    """compiler/ compiles: `compile()` returns a `CompiledProgram` and writes and runs
    nothing; writing the rank programs, running and checking them are tools/'s (above the
    backends). Eager mode runs ops through `ir.interpret`."""
    assert _upward("compiler", ("pcompile.backends", "pcompile.tools", "pcompile.cli")) == []


def test_ir_and_backends_import_nothing_above_them() -> None:
    assert _upward("ir", ABOVE_IR) == []
    assert _upward("backends", ("pcompile.tools", "pcompile.cli")) == []


def test_the_driver_loads_no_backend() -> None:
    code = ("import sys, pcompile.compiler.driver, pcompile.compiler.runtime; "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('pcompile.backends', 'pcompile.tools', 'jax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_no_room_imports_another_rooms_privates() -> None:
    """A name imported from another room is public (no leading underscore): the rank runtime
    reads its data through the dataset spec written at compile time
    (`compiler.runtime.DatasetSpec`), not through the front end's internals."""
    rooms = ("ir", "passes", "compiler", "backends", "tools")
    found = []
    for room in rooms:
        for folder, _, files in os.walk(os.path.join(ROOT, room)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                for node in ast.walk(ast.parse(open(path).read())):
                    if not isinstance(node, ast.ImportFrom) or not node.module:
                        continue
                    parts = node.module.split(".")
                    if parts[0] != "pcompile" or len(parts) < 2 or parts[1] == room:
                        continue
                    found += [f"{os.path.relpath(path, ROOT)}: {node.module}.{a.name}"
                              for a in node.names if a.name.startswith("_")]
    assert found == []
