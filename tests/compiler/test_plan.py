"""plan.json as a contract (compiler/driver/plan.py): it round-trips through its pydantic model, an
edited plan.json with a wrong field is refused with one message by every reader (`pcompile
show`, the launcher, `pcompile-merge`), and docs/plan.schema.json is the generated schema."""

from __future__ import annotations

import json
import os

import pytest

from pcompile.backends.checkpoint_merge import main as merge_main
from pcompile.backends.launcher import LaunchError, launch
from pcompile.compiler.driver.plan import (
    SCHEMA_VERSION,
    Plan,
    PlanError,
    parse_plan,
    plan_text,
    read_plan,
    schema_text,
)
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("plan") / "out")
    compile_model(QUICKSTART, devices=8, search_mode="sharding_propagation", out_dir=out)
    return out


def _edit(out: str, tmp_path, change) -> str:
    """A copy of plan.json in a fresh folder, changed by `change(data)`."""
    with open(os.path.join(out, "plan.json"), encoding="utf-8") as f:
        data = json.load(f)
    change(data)
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "plan.json").write_text(json.dumps(data))
    return str(folder)


def test_round_trip(compiled: str) -> None:
    text = open(os.path.join(compiled, "plan.json"), encoding="utf-8").read()
    plan = read_plan(compiled)
    assert plan.schema_version == SCHEMA_VERSION
    assert plan_text(plan) == text  # file -> model -> file is the identity
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert plan.devices == 8 and plan.search_mode == "sharding_propagation"
    assert plan.dump_ranks == list(range(8)) and sorted(plan.collectives, key=int) == \
        [str(r) for r in range(8)]
    row = plan.collectives["0"][0]
    assert row.phase in ("forward", "backward", "optimizer") and row.reason


@pytest.mark.parametrize("change, named", [
    (lambda d: d.update(devices="eight"), "devices"),
    (lambda d: d["parameters"]["w"].update(dev_matrix="2,4"), "parameters.w.dev_matrix"),
    (lambda d: d["parameters"]["w"].update(tensor_map=[1]), "tensor_map"),
    (lambda d: d.update(devise=8), "devise"),
    (lambda d: d["ops"][next(iter(d["ops"]))].update(in_strategy=[[0, 4]]), "in_strategy"),
    (lambda d: d["collectives"]["0"][0].update(rank_list=[0, 9]), "beyond devices 8"),
    (lambda d: d.update(parallel_mode="auto"), "parallel_mode"),
    (lambda d: d.pop("parameters"), "parameters"),
])
def test_wrong_field_refused(compiled: str, tmp_path, change, named: str) -> None:
    folder = _edit(compiled, tmp_path, change)
    with pytest.raises(PlanError) as info:
        read_plan(folder)
    message = str(info.value)
    assert named in message and "plan schema" in message and "\n" not in message


def test_other_schema_version_refused(compiled: str, tmp_path) -> None:
    folder = _edit(compiled, tmp_path, lambda d: d.update(schema_version=SCHEMA_VERSION + 1))
    with pytest.raises(PlanError, match="schema_version 2; this pcompile reads version 1"):
        read_plan(folder)


def test_readers_refuse_a_wrong_plan(compiled: str, tmp_path, capsys) -> None:
    folder = _edit(compiled, tmp_path, lambda d: d.update(devices=-1))
    # pcompile-merge: one message, exit status 1
    assert merge_main([folder]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pcompile-merge: error: ") and "devices" in err
    assert "Traceback" not in err
    # the launcher refuses before starting anything
    with pytest.raises(LaunchError, match="devices"):
        launch(folder, steps=1)


def test_missing_plan_is_one_message(tmp_path) -> None:
    with pytest.raises(PlanError, match="holds no plan.json; compile first"):
        read_plan(str(tmp_path))
    with pytest.raises(PlanError, match="unreadable"):
        (tmp_path / "plan.json").write_text("{not json")
        read_plan(str(tmp_path))


def test_parse_plan_names_where(compiled: str) -> None:
    with pytest.raises(PlanError, match="somewhere.json does not match"):
        parse_plan({"devices": 2}, "somewhere.json")


def test_checked_in_schema_is_generated() -> None:
    """docs/plan.schema.json is `python -m pcompile.compiler.driver.plan --schema` (regenerate it
    with `python -m pcompile.compiler.driver.plan --schema docs/plan.schema.json`)."""
    path = os.path.join(ROOT, "docs", "plan.schema.json")
    with open(path, encoding="utf-8") as f:
        assert f.read() == schema_text()
