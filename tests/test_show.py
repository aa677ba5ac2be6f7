"""`pcompile show` / `pcompile diff` / `pcompile --version` (cli.py, compiler/inspection.py,
compiler/render.py): the quickstart's strategies and the layout grid of `w` over 8 ranks; the
communication totals equal the sum of the `bytes` annotations of the collectives in the
execute dumps; one message for a wrong plan, an op or rank that is not there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from pcompile import __version__
from pcompile.cli import main
from pcompile.compiler.inspection import comm_summary, comm_totals, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
COLLECTIVE_LINE = re.compile(r"= (AllReduce|AllGather|ReduceScatter|AlltoAll|Broadcast)\(")


def run_cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("show") / "out")
    code, output = run_cli([QUICKSTART, "--devices", "8", "--search", "sharding_propagation",
                            "--out", out, "--no-check"])
    assert code == 0, output
    return out


def _row(output: str, instance: str) -> str:
    lines = [line for line in output.splitlines() if f" {instance} " in line]
    assert lines, output
    return lines[0]


def test_show_quickstart_strategies_and_grid(quickstart: str) -> None:
    code, output = run_cli(["show", quickstart])
    assert code == 0, output
    # the seed's strategies (auto-parallel-quickstart.md): matmul configured, the rest searched
    assert "((2, 4), (4, 1))" in _row(output, "matmul")
    assert "((2, 4))" in _row(output, "relu")
    assert "((2, 4), (4, 1))" in _row(output, "matmul2")
    assert "in-edges from" in _row(output, "relu")  # the search's reason, with its cost
    # w [32, 16] over 8 ranks, split by rows over the "4" axis of [2, 4]: four row blocks,
    # each held by two ranks
    assert "w [32, 16]: dev [2, 4], map [0, -1]" in output  # MindSpore's normalised form
    for ranks, rows in (("0,4", "0:8"), ("1,5", "8:16"), ("2,6", "16:24"), ("3,7", "24:32")):
        assert f"ranks {ranks}" in output and f"[{rows}, 0:16]" in output
    svg = os.path.join(quickstart, "show", "w.svg")
    tree = ET.parse(svg)
    rects = [e for e in tree.iter() if e.tag.endswith("rect")]
    labels = [e.text for e in tree.iter() if e.tag.endswith("text")]
    background, blocks = rects[0], rects[1:]
    assert background.get("fill") == "white" and background.get("class") == "background"
    assert len(blocks) == 4 and "ranks 0,4" in labels and "ranks 3,7" in labels
    # each block's slice range, the range along each axis and the dims' names
    assert "[0:8, 0:16]" in labels and "[24:32, 0:16]" in labels
    assert "8:16" in labels and "0:16" in labels
    assert "dim 0 (32) \u2193" in labels and "dim 1 (16) \u2192" in labels


def _dump_bytes(out: str, rank: int) -> tuple[int, int]:
    """Sum of `bytes:` over the collective lines of rank r's execute dump, and how many of
    those lines there are."""
    (path,) = [os.path.join(out, f"rank_{rank}", f) for f in
               os.listdir(os.path.join(out, f"rank_{rank}")) if f.endswith("_execute.ir")]
    total = count = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if COLLECTIVE_LINE.search(line):
                found = re.findall(r"\bbytes: (\d+)", line)
                assert len(found) == 1, f"a collective without bytes: {line}"
                total += int(found[0])
                count += 1
    return total, count


def test_communication_totals_equal_execute_dumps(quickstart: str) -> None:
    plan = load(quickstart)
    assert plan.dump_ranks == list(range(8))
    for rank in plan.dump_ranks:
        rows = comm_summary(plan, rank)
        expected, count = _dump_bytes(quickstart, rank)
        assert count > 0
        assert comm_totals(rows)["total"] == expected
        assert sum(r.count for r in rows) == count
        assert sum(comm_totals(rows).get(p, 0) for p in ("forward", "backward",
                                                          "optimizer")) == expected
    code, output = run_cli(["show", quickstart, "--rank", "5", "--no-svg"])
    assert code == 0, output
    total, _ = _dump_bytes(quickstart, 5)
    assert f"total {total:,} bytes per step" in output
    assert "communication of rank 5" in output and "4,5,6,7" in output


def test_show_op_and_errors(quickstart: str, tmp_path) -> None:
    code, output = run_cli(["show", quickstart, "--op", "matmul2", "--no-svg"])
    assert code == 0, output
    assert "matmul2 input 0 [16, 16]: dev [2, 4, 1], map [2, 1]" in output
    assert "│ relu " not in output and "│ matmul " not in output
    code, output = run_cli(["show", quickstart, "--op", "matmul9"])
    assert code == 1 and "no op named 'matmul9'" in output and "matmul2" in output
    code, output = run_cli(["show", quickstart, "--tensor", "w9"])
    assert code == 1 and "no parameter named w9" in output
    code, output = run_cli(["show", quickstart, "--rank", "9", "--no-svg"])
    assert code == 1 and "rank 9 was not dumped" in output
    # an edited plan.json with a wrong field: one message, no traceback
    edited = tmp_path / "edited"
    edited.mkdir()
    data = json.loads(open(os.path.join(quickstart, "plan.json")).read())
    data["parameters"]["w"]["slice_shape"] = "8x16"
    (edited / "plan.json").write_text(json.dumps(data))
    code, output = run_cli(["show", str(edited)])
    assert code == 1 and output.startswith("pcompile: error: ")
    assert "parameters.w.slice_shape" in output and "Traceback" not in output


def test_diff_two_ranks(quickstart: str) -> None:
    code, output = run_cli(["diff", quickstart, "--ranks", "0,5"])
    assert code == 0, output
    assert "-  %" in output and "+  %" in output
    assert "rank_list: (0, 1, 2, 3)" in output and "rank_list: (4, 5, 6, 7)" in output
    assert re.search(r"\d+ line\(s\) differ between rank 0 and rank 5", output)
    code, output = run_cli(["diff", quickstart, "--ranks", "3,3"])
    assert code == 0 and "run the same" in output
    code, output = run_cli(["diff", quickstart, "--ranks", "0"])
    assert code == 2 and "--ranks" in output
    code, output = run_cli(["diff", quickstart, "--ranks", "0,1", "--pass", "nope"])
    assert code == 1 and "no dump of a pass named like 'nope'" in output


def test_version_and_default_command(tmp_path) -> None:
    code, output = run_cli(["--version"])
    assert code == 0 and output.strip() == f"pcompile {__version__}"
    proc = subprocess.run([sys.executable, "-m", "pcompile", "--version"], capture_output=True,
                          text=True, cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"pcompile {__version__}"
    # `pcompile MODEL.py` is `pcompile compile MODEL.py`
    outputs = []
    for i, prefix in enumerate(([], ["compile"])):
        out = tmp_path / f"out{i}"
        code, output = run_cli([*prefix, QUICKSTART, "--devices", "1", "--out", str(out)])
        assert code == 0, output
        outputs.append((out / "plan.json").read_text())
    assert outputs[0] == outputs[1]
    code, output = run_cli([])
    assert "show DIR" in output and "compile" in output


def test_a_recompile_drops_the_pictures_of_the_previous_plan(tmp_path) -> None:
    """`show` writes DIR/show/*.svg and lists them; a recompile into DIR removes exactly
    those (another model's pictures must not survive), and keeps a picture someone changed
    since and any other file of show/ (pcompile never deletes what it did not write)."""
    out = str(tmp_path / "out")
    args = [QUICKSTART, "--devices", "8", "--out", out, "--no-check", "--dump-ranks", "0"]
    assert run_cli(args)[0] == 0
    assert run_cli(["show", out])[0] == 0
    assert run_cli(["show", out, "--op", "matmul2"])[0] == 0  # the list grows
    show = os.path.join(out, "show")
    listed = json.loads(open(os.path.join(show, ".pcompile-show.json")).read())["files"]
    assert {"show/w.svg", "show/w2.svg", "show/_backbone.matmul2_input_0.svg"} <= set(listed)
    with open(os.path.join(show, "w2.svg"), "a") as f:
        f.write("<!-- edited -->\n")
    with open(os.path.join(show, "mine.svg"), "w") as f:
        f.write("<svg/>\n")
    code, output = run_cli(args)
    assert code == 0, output
    assert sorted(os.listdir(show)) == ["mine.svg", "w2.svg"]
    code, output = run_cli(args)  # and again: nothing of show's is left to drop
    assert code == 0 and sorted(os.listdir(show)) == ["mine.svg", "w2.svg"]
