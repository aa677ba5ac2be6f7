"""Checkpoint verification (backends/checkpoint.py): every kind of damage is one clear message
naming the file, resume falls back to the newest step every rank holds intact, pcompile-merge
prints one line, leftovers of a killed write are cleaned, only checkpoints are ever cleared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from pcompile.backends.checkpoint import (
    META_KEY,
    CheckpointError,
    checkpoint_path,
    clear_checkpoints,
    load_npz,
    merge_checkpoints,
    read_checkpoint,
    resume_point,
    save_npz,
    write_checkpoint,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# w (4, 6) split over 2 ranks along dim 0: each rank holds (2, 6); b replicated.
LAYOUTS = {"w": {"shape": [4, 6], "dtype": "float32", "dev_matrix": [2], "tensor_map": [0, -1]},
           "b": {"shape": [6], "dtype": "float32", "dev_matrix": [2], "tensor_map": [-1]}}


def values(rank: int, step: int) -> dict[str, np.ndarray]:
    w = np.arange(24, dtype=np.float32).reshape(4, 6) + step
    return {"w": w[2 * rank: 2 * rank + 2], "b": np.full(6, step, np.float32)}


def write_steps(folder, steps=(2, 4), ranks=2) -> None:
    for step in steps:
        for r in range(ranks):
            meta = {"step": step, "epoch": 1, "step_in_epoch": step, "rank": r,
                    "num_ranks": ranks, "plan_id": "p1", "log": [], "layouts": LAYOUTS}
            write_checkpoint(str(folder), r, step, values(r, step), meta)


def truncate(path: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def zero_length(path: str) -> None:
    open(path, "wb").close()


def bad_crc(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    i = data.index(b"\x93NUMPY")  # the first member's array data follows its header
    data[i + 200] ^= 0xFF
    open(path, "wb").write(bytes(data))


def no_metadata(path: str) -> None:
    arrays = load_npz(path)
    del arrays[META_KEY]
    save_npz(path, arrays)


def wrong_shape(path: str) -> None:
    """A consistent file (its manifest matches its arrays) whose array is not the rank's slice
    of its layout."""
    arrays = load_npz(path)
    meta = json.loads(str(arrays.pop(META_KEY)))
    arrays["w"] = np.zeros((3, 6), np.float32)
    os.unlink(path)
    write_checkpoint(os.path.dirname(os.path.dirname(path)), meta["rank"], meta["step"],
                     arrays, meta, keep=0)


def checksum_mismatch(path: str) -> None:
    arrays = load_npz(path)
    arrays["b"] = arrays["b"] + 1  # rewritten with a valid zip CRC, the old manifest
    save_npz(path, arrays)


DAMAGE = {
    "truncated": (truncate, "truncated or not an .npz file"),
    "zero-length": (zero_length, "is empty (0 bytes)"),
    "bad CRC": (bad_crc, "corrupt"),
    "missing metadata": (no_metadata, "has no metadata"),
    "wrong shape": (wrong_shape, "rank 1's slice is (2, 6)"),
    "checksum": (checksum_mismatch, "do not match the checksum"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_one_message_and_resume_falls_back(tmp_path, kind: str) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder)
    damage, message = DAMAGE[kind]
    path = checkpoint_path(str(folder), 1, 4)
    damage(path)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path, 1)
    assert path in str(info.value) and message in str(info.value)
    point = resume_point(str(folder), 2)
    assert point.step == 2
    assert len(point.skipped) == 1 and point.skipped[0].startswith("step 4: rank 1: ")
    arrays, meta = read_checkpoint(checkpoint_path(str(folder), 1, 2), 1)
    assert meta["step"] == 2 and np.array_equal(arrays["w"], values(1, 2)["w"])


def test_no_intact_step_and_a_missing_rank(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder, steps=(2, 4))
    os.unlink(checkpoint_path(str(folder), 0, 4))
    truncate(checkpoint_path(str(folder), 1, 2))
    point = resume_point(str(folder), 2)
    assert point.step is None
    assert point.skipped[0] == "step 4: rank 0: no checkpoint"
    assert point.skipped[1].startswith("step 2: rank 1: ")


def merge_cli(out) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint", str(out)],
                          capture_output=True, text=True, cwd=ROOT)


def test_merge_passes_over_a_damaged_step_and_says_so(tmp_path) -> None:
    write_steps(tmp_path / "checkpoints")
    bad_crc(checkpoint_path(str(tmp_path / "checkpoints"), 0, 4))
    full, info = merge_checkpoints(str(tmp_path))
    assert info["step"] == 2
    assert np.array_equal(full["w"], np.arange(24, dtype=np.float32).reshape(4, 6) + 2)
    proc = merge_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "passed over step 4: rank 0:" in proc.stderr and "corrupt" in proc.stderr
    assert (tmp_path / "merged_step_00000002.npz").exists()


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_merge_of_a_damaged_step_is_one_message(tmp_path, kind: str) -> None:
    write_steps(tmp_path / "checkpoints", steps=(4,))
    DAMAGE[kind][0](checkpoint_path(str(tmp_path / "checkpoints"), 1, 4))
    proc = merge_cli(tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("pcompile-merge: error: no step has an intact checkpoint")
    assert DAMAGE[kind][1] in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_killed_write_leaves_a_temp_file_that_the_next_write_removes(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder, steps=(2,))
    leftover = folder / "rank_0" / ".step_00000004.npz.tmp-0badf00d"
    leftover.write_bytes(b"half a checkpoint")
    assert resume_point(str(folder), 2).step == 2  # a temp file is no checkpoint
    write_steps(folder, steps=(4,))
    assert sorted(os.listdir(folder / "rank_0")) == ["step_00000002.npz", "step_00000004.npz"]


def test_checkpoints_are_written_with_the_users_umask(tmp_path) -> None:
    old = os.umask(0o027)
    try:
        write_steps(tmp_path / "c", steps=(1,))
    finally:
        os.umask(old)
    assert os.stat(checkpoint_path(str(tmp_path / "c"), 0, 1)).st_mode & 0o777 == 0o640


def test_clearing_checkpoints_deletes_nothing_else(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder)
    (folder / "rank_0" / "notes.txt").write_text("mine")
    (folder / "README").write_text("mine")
    clear_checkpoints(str(folder))
    assert sorted(p.name for p in folder.rglob("*")) == ["README", "notes.txt", "rank_0"]


def test_a_member_with_a_bad_crc_is_detected_by_zipfile_itself(tmp_path) -> None:
    """The bad-CRC case above damages array data inside the zip: zipfile's own check finds
    it (the damage function does not also break the zip structure)."""
    write_steps(tmp_path, steps=(1,))
    path = checkpoint_path(str(tmp_path), 0, 1)
    bad_crc(path)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is not None


def test_bfloat16_arrays_keep_their_dtype_in_npz_and_checkpoints(tmp_path) -> None:
    """.npy writes bfloat16 as raw `V2` bytes: pcompile's .npz files store its bits and give the
    bfloat16 array back (constants, checkpoints of bf16 parameters and states)."""
    import ml_dtypes

    from pcompile.backends.checkpoint import load_npz, save_npz

    values = {"w": (np.arange(12, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(3, 4),
              "m": np.ones(3, np.float32)}
    save_npz(str(tmp_path / "c.npz"), values)
    back = load_npz(str(tmp_path / "c.npz"))
    assert back["w"].dtype == ml_dtypes.bfloat16 and set(back) == {"w", "m"}
    np.testing.assert_array_equal(back["w"].astype(np.float32), values["w"].astype(np.float32))
    path = write_checkpoint(str(tmp_path / "ckpt"), 0, 1, values, {"step": 1, "layouts": {}})
    arrays, _ = read_checkpoint(path, None)
    assert arrays["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(arrays["w"].astype(np.float32),
                                  values["w"].astype(np.float32))


def test_merge_streams_one_tensor_at_a_time(tmp_path) -> None:
    """pcompile-merge of 8 ranks x 12 tensors of 1 MiB (12 MiB in all) holds about one full
    tensor (plus its fill mask and one slice), never the model, and writes what
    merge_checkpoints returns."""
    import tracemalloc

    from pcompile.backends.checkpoint import main as merge_main

    ranks, rows, cols, count = 8, 512, 512, 12
    layout = {"shape": [rows, cols], "dtype": "float32", "dev_matrix": [ranks],
              "tensor_map": [0, -1]}
    layouts = {f"t{i:02d}": layout for i in range(count)}
    rng = np.random.default_rng(0)
    full = {name: rng.standard_normal((rows, cols)).astype(np.float32) for name in layouts}
    part = rows // ranks
    for r in range(ranks):
        meta = {"step": 1, "epoch": 1, "step_in_epoch": 1, "rank": r, "num_ranks": ranks,
                "plan_id": "p", "log": [], "layouts": layouts}
        write_checkpoint(str(tmp_path / "checkpoints"), r, 1,
                         {n: v[r * part:(r + 1) * part] for n, v in full.items()}, meta)
    tensor = rows * cols * 4
    tracemalloc.start()
    try:
        assert merge_main([str(tmp_path), "--output", str(tmp_path / "m.npz")]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the tensor being assembled and its bool mask (a quarter of it), the one being written,
    # the slice being read: about 2.5 tensors; the old merge held all 12
    assert peak < 4 * tensor < count * tensor, peak
    merged = load_npz(str(tmp_path / "m.npz"))
    assert sorted(k for k in merged if k != META_KEY) == sorted(full)
    for name, value in full.items():
        assert np.array_equal(merged[name], value)


def test_merge_never_replaces_a_file_it_did_not_write(tmp_path) -> None:
    write_steps(tmp_path / "checkpoints", steps=(2,))
    mine = tmp_path / "notes.npz"
    mine.write_bytes(b"the user's own file")
    proc = subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint", str(tmp_path),
                           "--output", str(mine)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "not a file pcompile-merge wrote" in proc.stderr
    assert mine.read_bytes() == b"the user's own file"
    # its own output is replaced on a second merge
    assert merge_cli(tmp_path).returncode == 0
    assert merge_cli(tmp_path).returncode == 0
