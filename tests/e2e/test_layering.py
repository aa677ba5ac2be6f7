"""The rooms' import arrows point down: ir/ <- passes/ <- compiler/ <- backends/ ... (DESIGN.md)."""

from __future__ import annotations

import os

from tests import ROOT


def test_no_pass_imports_the_front_end() -> None:
    """passes/ imports ir/ and itself only: the driver hands the passes typed options
    (compiler/pass_options.py) and traces user code itself (arrows point down)."""
    import ast

    passes = os.path.join(ROOT, "passes")
    upward = []
    for folder, _, files in os.walk(passes):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read())
            for node in ast.walk(tree):
                modules = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                           else [a.name for a in node.names] if isinstance(node, ast.Import)
                           else [])
                upward += [f"{os.path.relpath(path, ROOT)}: {m}" for m in modules
                           if m.startswith(("pcompile.compiler", "pcompile.backends",
                                            "pcompile.cli"))]
    assert upward == []
