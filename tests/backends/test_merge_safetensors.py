"""`pcompile-merge` writes safetensors with the model's parameter names (backends/merge_output.py):

* one file, read back by `safetensors.numpy.load_file`, equals the trained values (bfloat16,
  scalars and split tensors among them) and loads into a model with `load_checkpoint`;
* above `--max-shard-size`, shards and a Hugging Face `model.safetensors.index.json`, which
  `load_checkpoint` reads too; a re-merge into fewer shards removes only its own stale shards;
* `--weights-only` leaves the optimizer state out;
* checkpoints of another plan than the folder's (another model compiled into the same --out)
  are refused with one message;
* a foreign file at an output's place is never replaced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from pcompile.backends.checkpoint_files import write_checkpoint
from pcompile.backends.checkpoint_merge import main as merge_main
from pcompile.backends.merge_output import parse_size
from tests import ROOT

RANKS = 4


def layout(shape: list[int], dtype: str, tensor_map: list[int]) -> dict[str, Any]:
    return {"shape": shape, "dtype": dtype, "dev_matrix": [RANKS], "tensor_map": tensor_map}


LAYOUTS = {
    "dense.weight": layout([8, 6], "float32", [0, -1]),  # rows split over the 4 ranks
    "embedding": layout([4, 16], "bfloat16", [-1, 0]),  # columns split
    "norm.gamma": layout([6], "float32", [-1]),  # replicated
    "moments.dense.weight": layout([8, 6], "float32", [0, -1]),
    "global_step": layout([], "int32", []),
}


def trained() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    return {"dense.weight": w, "embedding": rng.standard_normal((4, 16)).astype(
                ml_dtypes.bfloat16),
            "norm.gamma": np.linspace(0.5, 1.5, 6, dtype=np.float32),
            "moments.dense.weight": w * 0.1, "global_step": np.array(7, np.int32)}


def write_run(out: Any, plan_id: str = "plan-a", step: int = 7) -> dict[str, np.ndarray]:
    """Per-rank checkpoints of a 4-rank run and the program.py line naming its plan."""
    full = trained()
    for r in range(RANKS):
        part = {"dense.weight": full["dense.weight"][2 * r:2 * r + 2],
                "embedding": full["embedding"][:, 4 * r:4 * r + 4],
                "norm.gamma": full["norm.gamma"],
                "moments.dense.weight": full["moments.dense.weight"][2 * r:2 * r + 2],
                "global_step": full["global_step"]}
        meta = {"step": step, "epoch": 1, "step_in_epoch": step, "rank": r,
                "num_ranks": RANKS, "plan_id": plan_id, "log": [], "layouts": LAYOUTS}
        write_checkpoint(str(out / "checkpoints"), r, step, part, meta)
    return full


def set_folder_plan(out: Any, plan_id: str) -> None:
    (out / "program.py").write_text(f"RANK = None\nNUM_RANKS = {RANKS}\nPLAN_ID = "
                                    f"{plan_id!r}\n")


def merge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint_merge", *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_merge_writes_safetensors_that_safetensors_reads(tmp_path: Any) -> None:
    from pcompile import load_checkpoint

    full = write_run(tmp_path)
    set_folder_plan(tmp_path, "plan-a")
    assert merge_main([str(tmp_path)]) == 0
    path = tmp_path / "merged_step_00000007.safetensors"
    merged = load_file(str(path))
    assert sorted(merged) == sorted(full)
    for name, value in full.items():
        assert merged[name].dtype == value.dtype and merged[name].tobytes() == value.tobytes()
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:  # the metadata names the merge and step
        assert f.metadata()["format"] == "pcompile-merge/1" and f.metadata()["step"] == "7"
    params = load_checkpoint(str(path), specify_prefix="dense.")
    assert np.array_equal(params["dense.weight"].source.to_numpy(), full["dense.weight"])
    # the same inputs give the same bytes
    first = path.read_bytes()
    assert merge_main([str(tmp_path)]) == 0 and path.read_bytes() == first


def test_shards_and_an_hf_index_above_the_threshold(tmp_path: Any) -> None:
    from pcompile import load_checkpoint

    full = write_run(tmp_path)
    out = tmp_path / "hf"
    assert merge_main([str(tmp_path), "--output", str(out), "--max-shard-size", "200B"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in full.values())
    for shard in shards:
        for name, value in load_file(str(out / shard)).items():
            assert index["weight_map"][name] == shard
            assert value.tobytes() == full[name].tobytes()
    params = load_checkpoint(str(out))
    assert sorted(params) == sorted(full)
    assert np.array_equal(params["embedding"].source.to_numpy(), full["embedding"])
    # a merge into one file replaces the index and its shards, which were its own; a user's
    # file in the folder stays
    (out / "notes.txt").write_text("mine")
    assert merge_main([str(tmp_path), "--output", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors", "notes.txt"]
    # the default output is a folder of shards when the merge passes the threshold
    assert merge_main([str(tmp_path), "--max-shard-size", "300B"]) == 0
    assert (tmp_path / "merged_step_00000007" / "model.safetensors.index.json").exists()


def test_weights_only_leaves_the_optimizer_state_out(tmp_path: Any, monkeypatch: Any) -> None:
    import pcompile.backends.checkpoint_merge as checkpoint

    full = write_run(tmp_path)
    # plan.json's kinds, without a compile: the weights are these two
    monkeypatch.setattr(checkpoint, "_weights", lambda out: {"dense.weight", "embedding"})
    assert merge_main([str(tmp_path), "--weights-only", "--output",
                       str(tmp_path / "w.safetensors")]) == 0
    merged = load_file(str(tmp_path / "w.safetensors"))
    assert sorted(merged) == ["dense.weight", "embedding"]
    assert np.array_equal(merged["dense.weight"], full["dense.weight"])


def test_checkpoints_of_another_plan_are_one_message(tmp_path: Any) -> None:
    """The quickstart's checkpoints next to the Llama plan: refused, nothing written."""
    write_run(tmp_path, plan_id="quickstart-plan")
    set_folder_plan(tmp_path, "llama-plan")
    proc = merge(str(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "written by plan quickstart-plan" in lines[0] and "holds plan llama-plan" in lines[0]
    assert not list(tmp_path.glob("merged_step_*"))
    proc = merge(str(tmp_path), "--step", "7")  # a step named explicitly: the same
    assert proc.returncode == 1 and "holds plan llama-plan" in proc.stderr


def test_a_foreign_file_is_never_replaced(tmp_path: Any) -> None:
    write_run(tmp_path)
    mine = tmp_path / "merged_step_00000007.safetensors"
    mine.write_bytes(b"the user's own file")
    proc = merge(str(tmp_path))
    assert proc.returncode == 1 and "not a file pcompile-merge wrote" in proc.stderr
    assert mine.read_bytes() == b"the user's own file"
    proc = merge(str(tmp_path), "--max-shard-size", "lots")
    assert proc.returncode == 1 and "--max-shard-size" in proc.stderr


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                       ("2GiB", 2 * 2**30), ("1234", 1234)])
def test_sizes_are_spelled_as_hugging_face_spells_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["9" * 400, "1" * 30 + "TiB", "0.1", "0B", "1e9"])
def test_an_impossible_shard_size_is_one_message(tmp_path, capsys, text: str) -> None:
    """A 400-digit size was an OverflowError traceback (float('9' * 400) is inf)."""
    assert merge_main([str(tmp_path), "--max-shard-size", text]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pcompile-merge: error: --max-shard-size ") and err.count("\n") == 1
    assert "Traceback" not in err and len(err) < 200
    assert parse_size("1.5KB") == 1500 and parse_size("18446744073709551615") == 2**64 - 1


@pytest.mark.slow  # a 2-rank run, a merge and a resumed run: ~20 s
def test_a_merge_into_the_run_folder_does_not_block_the_next_compile(tmp_path: Any) -> None:
    """`pcompile-merge DIR --output DIR/hf` (one file) and `DIR/hf_shards` (shards and index):
    the next compile into DIR, here a --resume, accepts them as pcompile's and keeps them."""
    from click.testing import CliRunner

    from pcompile.cli import main as cli_main

    out = tmp_path / "DIR"
    base = [os.path.join(ROOT, "examples", "quickstart.py"), "--devices", "2",
            "--parallel-mode", "data_parallel", "--no-check", "--out", str(out), "--run",
            "--checkpoint-every", "1"]
    first = CliRunner().invoke(cli_main, [*base, "--steps", "2"])
    assert first.exit_code == 0, first.output
    assert merge_main([str(out), "--output", str(out / "hf")]) == 0
    assert merge_main([str(out), "--output", str(out / "hf_shards"),
                       "--max-shard-size", "1KB"]) == 0
    merged = {p: p.read_bytes() for p in sorted(out.glob("hf*/*"))}
    assert len(merged) >= 3
    resumed = CliRunner().invoke(cli_main, [*base, "--steps", "3", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert "did not write" not in resumed.output
    assert {p: p.read_bytes() for p in sorted(out.glob("hf*/*"))} == merged
