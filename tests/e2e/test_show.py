"""`pcompile show` / `pcompile diff` / `pcompile --version` (cli.py, tools/inspection.py,
tools/render.py): the quickstart's strategies and the layout grid of `w` over 8 ranks; the
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
from pcompile.tools.inspection import comm_summary, comm_totals, load
from tests import ROOT

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


# -- readable at any width, real costs, one picture per instance, marked diffs ------

LLAMA = os.path.join(ROOT, "examples", "llama.py")
PIPELINE = os.path.join(ROOT, "examples", "pipeline_mlp.py")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """examples/llama.py at its tiny preset (its defaults), 8 devices."""
    out = str(tmp_path_factory.mktemp("show_llama") / "out")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("LLAMA_")}
    try:
        code, output = run_cli([LLAMA, "--devices", "8", "--out", out, "--no-check",
                                "--dump-ranks", "0"])
    finally:
        os.environ.update(saved)
    assert code == 0, output
    return out


def _table_rows(output: str) -> list[list[str]]:
    """The cells of the strategy table's first line per row (between its header and end)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        rows.append([cell.strip() for cell in line.split("│")[1:-1]])
    return rows


@pytest.mark.parametrize("width", [80, 120, 160, 200])
def test_show_names_every_op_whole_at_any_width(quickstart: str, llama: str,
                                                width: int) -> None:
    for out in (quickstart, llama):
        plan = load(out)
        code, output = run_cli(["show", out, "--no-svg", "--width", str(width)])
        assert code == 0, output
        assert max(map(len, output.splitlines())) <= width
        rows = [r for r in _table_rows(output) if r[0]]  # continuation lines have no op
        assert [(r[0], r[1]) for r in rows] == [(o.op, o.instance_name or "-")
                                                for o in plan.ops.values()]
        assert "scope" in output.split("┡")[0]  # instances told apart at every width


def test_show_op_rows_carry_their_scope(llama: str) -> None:
    code, output = run_cli(["show", llama, "--op", "matmul", "--no-svg", "--width", "80"])
    assert code == 0, output
    rows = _table_rows(output)
    assert len(rows) == 15 and all(r[:2] == ["MatMul", "matmul"] for r in rows)
    scopes = [r[3] for r in rows]
    assert len(set(scopes)) == 15
    assert "model.layers.0.attention.wq" in scopes and "lm_head" in scopes


def test_show_prints_the_costs_plan_json_has_never_inf(quickstart: str) -> None:
    plan = load(quickstart)
    assert plan.search is not None
    assert all(op.local_objective is None for op in plan.search.ops.values())  # propagation
    code, output = run_cli(["show", quickstart, "--no-svg", "--width", "200"])
    assert code == 0, output
    assert "inf" not in output
    for op in plan.search.ops.values():
        want = op.cost["objective"] + op.redistribution["objective"]
        assert re.search(rf"│ +{re.escape(f'{want:.6g}')} │", _row(output, op.instance_name))
    assert "—" in _row(output, "matmul")  # user-configured: no search cost
    assert "comm 0 comp 1792 fwd 0" in _row(output, "relu")  # the runner-up's terms


def test_op_pictures_one_per_instance_and_counted(llama: str) -> None:
    code, output = run_cli(["show", llama, "--op", "matmul", "--width", "200"])
    assert code == 0, output
    text = " ".join(output.split())
    assert "layout pictures: 30 written to" in text
    names = sorted(f for f in os.listdir(os.path.join(llama, "show")) if f.endswith(".svg"))
    assert "model.layers.1.feed_forward.w2.matmul_input_1.svg" in names
    matmul = [n for n in names if ".matmul_input_" in n]
    assert len(matmul) == 30
    titles = {ET.parse(os.path.join(llama, "show", n)).getroot()[1].text for n in matmul}
    assert len(titles) == 30  # each picture draws its own op's input


def test_every_weight_is_listed_and_the_undrawn_ones_said(llama: str) -> None:
    plan = load(llama)
    weights = [n for n, p in plan.parameters.items() if p.kind == "weight"]
    assert len(weights) > 8
    code, output = run_cli(["show", llama, "--no-svg", "--width", "80"])
    assert code == 0, output
    assert f"weights ({len(weights)})" in output
    assert all(f"│ {name} " in output for name in weights)
    text = " ".join(output.split())
    assert f"layout grids of the first 8 of {len(weights)} weights" in text
    assert "--all-weights" in text
    code, output = run_cli(["show", llama, "--all-weights", "--width", "200"])
    assert code == 0, output
    assert f"layout pictures: {len(weights)} written" in " ".join(output.split())
    assert "layout grids of the first" not in output


def test_weights_table_headers_name_their_columns(quickstart: str) -> None:
    """w is [32, 16], each rank holding an [8, 16] slice: the "shape" column says [32, 16]."""
    code, output = run_cli(["show", quickstart, "--no-svg", "--width", "200"])
    assert code == 0, output
    lines = output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("weights ("))
    header = [cell.strip() for cell in lines[at + 2].split("┃")[1:-1]]
    row = next(line for line in lines[at:] if line.startswith("│ w "))
    cells = dict(zip(header, (cell.strip() for cell in row.split("│")[1:-1])))
    assert cells["shape"] == "[32, 16]" and cells["slice shape"] == "[8, 16]"


def test_show_into_a_pipe_honours_columns(quickstart: str, monkeypatch) -> None:
    """`pcompile show DIR | less`: COLUMNS, else the terminal on stderr or stdin, else 160."""
    for columns in (80, 100):
        result = CliRunner().invoke(main, ["show", quickstart, "--no-svg"],
                                    env={"COLUMNS": str(columns)})
        assert result.exit_code == 0, result.output
        assert max(map(len, result.output.splitlines())) <= columns
    assert "not shown at 80 columns" in " ".join(
        CliRunner().invoke(main, ["show", quickstart, "--no-svg"],
                           env={"COLUMNS": "80"}).output.split())
    from pcompile.tools.render import PIPE_WIDTH, pipe_width

    monkeypatch.setattr(os, "isatty", lambda fd: False)
    assert pipe_width({}) == pipe_width({"COLUMNS": "x"}) == PIPE_WIDTH
    assert pipe_width({"COLUMNS": "20"}) == 40  # the narrowest layout --width allows
    monkeypatch.setattr(os, "isatty", lambda fd: fd == 2)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd: os.terminal_size((97, 30)))
    assert pipe_width({}) == 97 and pipe_width({"COLUMNS": "120"}) == 120


def test_diff_marks_the_differing_fields(quickstart: str) -> None:
    code, output = run_cli(["diff", quickstart, "--ranks", "0,5"])
    assert code == 0, output
    lines = output.splitlines()
    minus = next(i for i, line in enumerate(lines) if line.startswith("-") and
                 "rank_list: (0, 1, 2, 3)" in line and "AllGather" in line)
    guide, plus, plus_guide = lines[minus + 1], lines[minus + 2], lines[minus + 3]
    assert guide.startswith("?") and plus.startswith("+") and plus_guide.startswith("?")
    at = lines[minus].index("rank_list: (0, 1, 2, 3)") + len("rank_list: (")
    at_plus = plus.index("rank_list: (4, 5, 6, 7)") + len("rank_list: (")
    assert guide[at] == "^" and plus_guide[at_plus] == "^"  # 0 -> 4
    assert guide[at - 1] == " " and guide[at + 1] == " "  # the unchanged `(` and `,` are not
    # a line pair that differs in one number only is marked there only
    assert lines[lines.index("-rank: 0") + 1] == "?      ^"


def test_differing_spans_mark_whole_tokens() -> None:
    from pcompile.tools.inspection import differing_spans, marked_diff

    a, b = "group: 4-630, rank_list: (0, 1)", "group: 4-157, rank_list: (4, 5)"
    spans_a, spans_b = differing_spans(a, b)
    assert [a[s:e] for s, e in spans_a] == ["630", "0", "1"]
    assert [b[s:e] for s, e in spans_b] == ["157", "4", "5"]
    lines = ["-x = 1", "-y = 2", "+x = 3", "+y = 2 + 7", " z"]
    assert [(d.text, d.marks) for d in marked_diff(lines)] == [
        ("-x = 1", [(5, 6)]), ("+x = 3", [(5, 6)]),
        ("-y = 2", []), ("+y = 2 + 7", [(6, 10)]), (" z", [])]


def test_send_rows_count_the_bytes_they_send(tmp_path) -> None:
    out = str(tmp_path / "pipe")
    code, output = run_cli([PIPELINE, "--devices", "8", "--out", out, "--no-check",
                            "--dump-ranks", "0"])
    assert code == 0, output
    plan = load(out)
    sends = [c for c in plan.collectives["0"] if c.op == "Send"]
    assert sends and all((c.ring_bytes or 0) > 0 for c in sends)
    code, output = run_cli(["show", out, "--no-svg", "--width", "120"])
    assert code == 0, output
    header = next(line for line in output.splitlines() if "┃ collective" in line)
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    row = next(line for line in output.splitlines() if line.startswith("│ Send "))
    cells = dict(zip(columns, (c.strip() for c in row.split("│")[1:-1])))
    assert int(cells["sent"].replace(",", "")) == sum(c.ring_bytes or 0 for c in sends) > 0
    assert cells["received"] == "0"  # a Send receives nothing; what it moves is sent


def test_a_show_list_names_only_pictures_in_show(tmp_path) -> None:
    """The list is read as data: what it names outside show/*.svg, or in a malformed list, is
    never dropped by a recompile."""
    from pcompile.compiler.driver.outdir import SHOW_LIST, record_shown, shown_pictures

    (tmp_path / "show").mkdir()
    listed = tmp_path / SHOW_LIST
    for text in ("[1, 2]", "not json", json.dumps({"format": "pcompile-show/1", "files": {
            "plan.json": "0" * 64, "show/../plan.json": "0" * 64, SHOW_LIST: "0" * 64}})):
        listed.write_text(text)
        assert shown_pictures(str(tmp_path)) == set()
    listed.unlink()
    record_shown(str(tmp_path), {"show/a.svg": b"<svg/>"})
    (tmp_path / "show" / "a.svg").write_bytes(b"<svg/>")
    assert shown_pictures(str(tmp_path)) == {"show/a.svg", SHOW_LIST}


def test_show_and_the_compile_print_the_plans_prediction(tmp_path) -> None:
    """Every parallel plan states its predicted step time and memory (plan.json `prediction`):
    the compile prints it, `show` prints it, and a plan that does not fit the device's memory
    says so in one warning line with what would fit."""
    out = str(tmp_path / "out")
    code, output = run_cli([QUICKSTART, "--devices", "8", "--out", out, "--no-check"])
    assert code == 0, output
    assert "predicted on h100: step " in output and "memory per rank" in output
    code, shown = run_cli(["show", out])
    assert code == 0 and "predicted on h100: step " in shown and "does NOT fit" not in shown
    # one formatter: the compile's lines are show's (which wraps them to the terminal)
    printed = [line for line in output.splitlines() if line.startswith("predicted on ")]
    assert len(printed) == 1 and " ".join(printed[0].split()) in " ".join(shown.split())
    with open(os.path.join(out, "plan.json"), encoding="utf-8") as f:
        prediction = json.load(f)["prediction"]
    assert prediction["fits"] and prediction["memory"]["weights"] > 0
    tight = str(tmp_path / "tight")
    code, output = run_cli([QUICKSTART, "--devices", "8", "--out", tight, "--no-check",
                            "--device-memory", "1000"])
    assert code == 0, output
    warnings = [line for line in output.splitlines() if line.startswith("warning: the plan is")]
    assert len(warnings) == 1 and "more than the 0.00 GB" in warnings[0]
    code, shown = run_cli(["show", tight])
    assert "does NOT fit" in shown


@pytest.mark.slow
def test_a_transformer_plan_shows_its_bytes_against_megatrons_minimum(tmp_path) -> None:
    """plan.json `megatron_minimum` in the compile's summary and in show, the same line."""
    out = str(tmp_path / "out")
    code, output = run_cli([os.path.join(ROOT, "examples", "llama.py"), "--devices", "8",
                            "--out", out, "--no-check"])
    assert code == 0, output
    lines = [line for line in output.splitlines() if line.startswith("bytes: rank 0 sends")]
    assert len(lines) == 1 and "x Megatron-LM's minimum at dp 2 x mp 4, head split" in lines[0]
    code, shown = run_cli(["show", out])
    assert code == 0 and " ".join(lines[0].split()) in " ".join(shown.split())
