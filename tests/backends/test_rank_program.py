"""The typed, data-only program a compile hands to the code generators (program/rank_program.py,
issue 37 move 1): it holds no front-end object, cannot be changed, and the rank programs are
written from it alone."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pcompile.backends.jax.codegen import rank_artifacts
from pcompile.program.rank_program import RankProgram
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def _objects(value: object, seen: set[int]) -> list[object]:
    """`value` and everything it holds (containers, dataclasses, objects' attributes), each
    once; graphs and nodes are the IR's and are not walked into."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    out = [value]
    if type(value).__module__.startswith("pcompile.ir"):
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out += _objects(k, seen) + _objects(v, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            out += _objects(v, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            out += _objects(getattr(value, f.name), seen)
    elif hasattr(value, "__slots__"):
        for name in value.__slots__:
            if hasattr(value, name):
                out += _objects(getattr(value, name), seen)
    return out


def test_the_rank_program_holds_no_front_end_object_and_writes_the_programs(tmp_path) -> None:
    program = compile_model(QUICKSTART, devices=8, dump=False)
    rank_program = program.rank_program
    assert isinstance(rank_program, RankProgram)
    front = sorted({type(o).__module__ + "." + type(o).__name__
                    for o in _objects(rank_program, set())
                    if type(o).__module__.startswith("pcompile.compiler")})
    assert front == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        rank_program.training = False  # type: ignore[misc]
    assert rank_program.training and rank_program.parallel_mode == "auto_parallel"
    assert rank_program.model_path == QUICKSTART
    assert rank_program.output_names == program.output_names
    assert [name for name, _, _ in rank_program.stored_values()] == [
        p.name for p in program.rank_graphs[0].params if p.kind != "input"]
    assert rank_program.run_report.dataset is not None
    for r in rank_program.dump_ranks:  # where the dumps would be (none: dump=False)
        (tmp_path / f"rank_{r}").mkdir()
    files = rank_artifacts(rank_program, str(tmp_path))
    assert "program.py" in files and b"MODEL_FLOPS = " in files["program.py"]
