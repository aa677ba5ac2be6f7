"""Golden per-rank dumps: the execute graphs of three plans (one a pipeline), compared byte for
byte with the files under tests/golden/. Regenerate after an intended change with

    PCOMPILE_ACCEPT=1 python -m pytest tests/e2e/test_golden_dumps.py

and review the diff."""

from __future__ import annotations

import os

import pytest

from pcompile.tools.compile import compile as compile_model
from tests import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden")
CASES = [
    ("quickstart_semi", os.path.join("tests", "models", "quickstart_semi.py"), 8, None, [0, 5]),
    ("layout_mlp", os.path.join("examples", "layout_mlp.py"), 8, None, [0, 3]),
    # 4 pipeline stages x 2 devices, 4 micro-batches, 1F1B: the first and the last stage
    ("pipeline_mlp", os.path.join("examples", "pipeline_mlp.py"), 8, None, [0, 7]),
]


@pytest.mark.parametrize("name,model,devices,mode,ranks", CASES)
def test_golden_rank_dumps(name, model, devices, mode, ranks, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # source paths in dumps are relative to the working directory
    out = tmp_path / "out"
    compile_model(model, devices=devices, parallel_mode=mode, out_dir=str(out))
    for rank in ranks:
        dumps = sorted(f for f in os.listdir(out / f"rank_{rank}") if f.endswith(".ir"))
        for dump in (dumps[dumps.index(next(d for d in dumps if "step_parallel_end" in d))],
                     dumps[-1]):
            got = (out / f"rank_{rank}" / dump).read_text()
            path = os.path.join(GOLDEN, f"{name}.rank{rank}.{dump.split('_', 1)[1]}")
            if os.environ.get("PCOMPILE_ACCEPT"):
                with open(path, "w", encoding="utf-8") as f:
                    f.write(got)
            with open(path, encoding="utf-8") as f:
                want = f.read()
            assert got == want, f"{path} differs; rerun with PCOMPILE_ACCEPT=1 to update"
