"""The rooms' import arrows point down: ir/ <- passes/ <- program/ <- compiler/ <- backends/ <-
tools/ <- cli.py (DESIGN.md). program/ holds what a compile hands to the backends (the typed
`RankProgram`, which names the passes' pipeline program) and what a rank needs at run time
without the front end; its run-time pieces import ir/ only (issue 37 move 1)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests import ROOT

ABOVE_IR = ("pcompile.passes", "pcompile.program", "pcompile.compiler", "pcompile.backends",
            "pcompile.tools", "pcompile.cli")
ABOVE_PROGRAM = ABOVE_IR[2:]


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
    (compiler/config/pass_options.py) and traces user code itself (arrows point down)."""
    assert _upward("passes", ("pcompile.program", "pcompile.compiler", "pcompile.backends",
                              "pcompile.tools", "pcompile.cli")) == []


def test_the_compiler_never_imports_a_backend() -> None:
    """compiler/ compiles: `compile()` returns a `CompiledProgram` and writes and runs
    nothing; writing the rank programs, running and checking them are tools/'s (above the
    backends). Eager mode runs ops through `ir.interpret`."""
    assert _upward("compiler", ("pcompile.backends", "pcompile.tools", "pcompile.cli")) == []


def test_ir_and_backends_import_nothing_above_them() -> None:
    assert _upward("ir", ABOVE_IR) == []
    assert _upward("program", ABOVE_PROGRAM) == []
    # the run-time pieces (all of program/ but the RankProgram record) import ir/ only
    runtime = [found for found in _upward("program", ("pcompile.passes",) + ABOVE_PROGRAM)
               if not found.startswith(os.path.join("program", "rank_program.py"))]
    assert runtime == []
    assert _upward("backends", ("pcompile.tools", "pcompile.cli")) == []


def test_the_driver_loads_no_backend() -> None:
    code = ("import sys, pcompile.compiler.driver.driver, pcompile.compiler.driver.runtime; "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('pcompile.backends', 'pcompile.tools', 'jax'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_no_room_imports_another_rooms_privates() -> None:
    """A name imported from another room is public (no leading underscore): the rank runtime
    reads its data through the dataset spec written at compile time
    (`program.dataset.DatasetSpec`), not through the front end's internals."""
    rooms = ("ir", "program", "passes", "compiler", "backends", "tools")
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


def _loaded_after(code: str) -> list[str]:
    """The pcompile modules (and numpy, pydantic, jax, ml_dtypes) a fresh interpreter holds
    after running `code`."""
    probe = (f"{code}\nimport sys\nprint(' '.join(sorted(m for m in sys.modules if "
             "m.startswith(('pcompile', 'numpy', 'pydantic', 'jax', 'ml_dtypes')))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return out.split()


def test_version_and_help_load_no_front_end() -> None:
    """`pcompile --version` (and --help) import the command line only: not the front end
    (compiler/__init__.py loads its re-exports on first use), pydantic, numpy or JAX (issue 38
    item 14; 1.2-5 s before, about 0.15 s now)."""
    for flag in ("--version", "--help"):
        loaded = _loaded_after("from pcompile.cli import main\ntry:\n    main(['" + flag +
                               "'])\nexcept SystemExit:\n    pass")
        heavy = [m for m in loaded if m.startswith(("pcompile.compiler", "pcompile.ir",
                                                    "numpy", "pydantic", "jax", "ml_dtypes"))]
        assert heavy == [], (flag, heavy)


def test_the_facade_names_still_resolve() -> None:
    """Every re-export of compiler/__init__.py (lazy) is the object its module defines."""
    import pcompile.compiler as facade

    for name in facade.__all__:
        assert getattr(facade, name) is not None, name
    from pcompile.compiler.frontend.tensor import Parameter

    assert facade.Parameter is Parameter
    # the submodule compiler/frontend/initializer.py, once imported, does not shadow the function
    import pcompile.compiler.frontend.initializer as module_or_function  # noqa: F401

    assert callable(facade.initializer) and facade.initializer.__name__ == "initializer"
    assert sorted(set(facade.__all__) - set(dir(facade))) == []


def test_a_rank_programs_loss_lines_load_no_front_end() -> None:
    """The rank programs' logging, loss lines and read-backs (program/progress.py) load no
    module of pcompile.compiler and no pydantic (they did through compiler/__init__.py)."""
    loaded = _loaded_after(
        "import pcompile.backends.jax.rank_runtime\n"
        "from pcompile.program.progress import (LossMonitor, ReadBack, format_loss_line,\n"
        "                                        setup_logging)\n"
        "setup_logging(0)\n"
        "monitor = LossMonitor(2, 1, lambda line: None)\n"
        "queue = ReadBack(1, lambda items, last: [monitor(format_loss_line(1, k, 0.5))\n"
        "                                         for k in items])\n"
        "queue.dispatched(1, 1)\nqueue.flush(last=True)")
    assert [m for m in loaded if m.startswith(("pcompile.compiler", "pydantic"))] == []


def _imports_under(room: str) -> dict[str, set[str]]:
    """Module -> the modules under `room` it imports (module level, inside a function or under
    `if TYPE_CHECKING:`), read with `ast`: `from pcompile.passes import x` names the module x."""
    modules: dict[str, str] = {}
    for folder, _, files in os.walk(os.path.join(ROOT, room)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = "pcompile." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        edges[module] = {t for t in targets if t in modules and t != module}
    return edges


def test_no_import_cycle_among_the_passes() -> None:
    """No module under passes/ imports, directly or through others, one that imports it back
    (at module level, inside a function or for type checking alike): the layout helpers the
    search and step_parallel_begin share live in passes/layouts.py, the staged SPMD builder in
    step_parallel.py (issue 37 move 3). Importing a submodule also runs its package's
    __init__, which is not counted as an edge."""
    import networkx as nx

    graph = nx.DiGraph(_imports_under("passes"))
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == [], f"import cycles under passes/: {cycles}"


# compiler/'s rooms, lowest first (issue 37 move 5): a module imports from its own room or a
# lower one. The façade (compiler/__init__.py) reads the configuration and the front end only.
COMPILER_ROOMS = ("config", "frontend", "driver")


def _compiler_room(module: str) -> int:
    """The rank of a module under pcompile.compiler in COMPILER_ROOMS."""
    parts = module.split(".")
    assert len(parts) > 2 and parts[2] in COMPILER_ROOMS, f"{module} is in no room of compiler/"
    return COMPILER_ROOMS.index(parts[2])


def test_the_compilers_rooms_import_downward() -> None:
    """Inside compiler/ the arrows point one way: the driver (compile_program, the compile
    state, the plan, the output folder, the rank programs' data) imports the front end and the
    configuration; the front end (tracing, Tensor, Parameter, nn, ops, ...) imports the
    configuration; the configuration (context settings and the typed options they become)
    imports neither. Module level, inside a function and under TYPE_CHECKING alike."""
    edges = _imports_under("compiler")
    # every module but the façade lives in a room
    assert [m for m in edges if m != "pcompile.compiler" and m.split(".")[2:3] == []] == []
    upward = sorted(f"{module} -> {target}" for module, targets in edges.items()
                    if module != "pcompile.compiler" for target in targets
                    if target != "pcompile.compiler"
                    and _compiler_room(target) > _compiler_room(module))
    assert upward == []
    facade = {_compiler_room(t) for t in edges["pcompile.compiler"] if t != "pcompile.compiler"}
    assert facade <= {COMPILER_ROOMS.index("config"), COMPILER_ROOMS.index("frontend")}


def test_parameter_init_loads_no_front_end() -> None:
    """A rank makes its parameter blocks (the manifest, the initializers' math, pretrained
    tensors, the JAX generator) without loading the front end: the run-time pieces live in
    program/, which imports ir/ only (issue 37 move 1; compiler.initializer and
    compiler.serialization re-export them for model files)."""
    loaded = _loaded_after("import pcompile.backends.params\n"
                           "import pcompile.backends.jax.param_init")
    assert [m for m in loaded if m.startswith(("pcompile.compiler", "pydantic"))] == []
    assert "pcompile.program.initializers" in loaded


def _any_typed(folder_or_file: str) -> list[str]:
    """Every parameter or field annotated `state: Any` or `program: Any` under a path."""
    path = os.path.join(ROOT, folder_or_file)
    files = ([path] if path.endswith(".py") else
             [os.path.join(f, n) for f, _, names in os.walk(path) for n in names
              if n.endswith(".py")])
    found = []
    for name in files:
        for node in ast.walk(ast.parse(open(name).read())):
            target = (node.arg if isinstance(node, ast.arg) else
                      node.target.id if isinstance(node, ast.AnnAssign)
                      and isinstance(node.target, ast.Name) else None)
            annotation = getattr(node, "annotation", None)
            if (target in ("state", "program") and isinstance(annotation, ast.Name)
                    and annotation.id == "Any"):
                found.append(f"{os.path.relpath(name, ROOT)}:{node.lineno}: {target}: Any")
    return found


def test_nothing_above_the_compiler_takes_an_untyped_state() -> None:
    """What passes from the compiler to the backends and tools is typed: no parameter or
    field above the compiler is `state: Any` or `program: Any` (issue 37 move 1; 26 at its
    start). The code generators take the data-only `program.rank_program.RankProgram`, the
    pipeline plans `PipelineProgram`, the in-process runners and the shrunk check the
    `CompiledProgram`."""
    found = _any_typed("backends") + _any_typed("tools") + _any_typed("cli.py")
    assert found == []


@pytest.mark.xfail(strict=True, reason="issue 37 move 1: a rank program imports the model file "
                   "for its data, and the façade's context model loads pydantic")
def test_a_rank_programs_data_loads_no_pydantic() -> None:
    """A rank program reads its batches through the dataset spec written at compile time;
    reading them loads no pydantic (issue 37 move 1)."""
    model = os.path.join(ROOT, "examples", "quickstart.py")
    loaded = _loaded_after(
        "import numpy as np\n"
        "from pcompile.compiler.driver.runtime import DatasetSpec, spec_batches\n"
        f"spec = DatasetSpec({model!r}, 1, 1)\n"
        "expected = [('x', (16, 32), np.float32), ('y', (16, 16), np.float32)]\n"
        "next(iter(spec_batches(spec, expected, 1)))")
    assert [m for m in loaded if m.startswith("pydantic")] == []
