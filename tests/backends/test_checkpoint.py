"""Checkpoints (backends/checkpoint_files.py, backends/async_checkpoint.py): safetensors plus a JSON
index, bfloat16 bit-exact; every kind of damage is one clear message naming the file; resume
falls back to the newest step every rank holds intact; checkpoints of an older pcompile (.npz)
still load; a full disk is one message that names the failed write and the intact checkpoint;
pcompile-merge prints one line; leftovers of a killed write are cleaned; only checkpoints are
ever cleared."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from safetensors.numpy import load_file

from pcompile.backends.checkpoint_files import (
    META_KEY,
    CheckpointError,
    checkpoint_path,
    clear_checkpoints,
    read_checkpoint,
    resume_point,
    tensors_path,
    write_checkpoint,
)
from pcompile.backends.checkpoint_merge import merge_checkpoints
from pcompile.backends.npz_files import load_npz, save_npz
from tests import ROOT
from tests.multiprocess import clean_env

# w (4, 6) split over 2 ranks along dim 0: each rank holds (2, 6); b replicated.
LAYOUTS = {"w": {"shape": [4, 6], "dtype": "float32", "dev_matrix": [2], "tensor_map": [0, -1]},
           "b": {"shape": [6], "dtype": "float32", "dev_matrix": [2], "tensor_map": [-1]}}


def values(rank: int, step: int) -> dict[str, np.ndarray]:
    w = np.arange(24, dtype=np.float32).reshape(4, 6) + step
    return {"w": w[2 * rank: 2 * rank + 2], "b": np.full(6, step, np.float32)}


def meta_of(rank: int, step: int, ranks: int = 2) -> dict:
    return {"step": step, "epoch": 1, "step_in_epoch": step, "rank": rank, "num_ranks": ranks,
            "plan_id": "p1", "log": [], "layouts": LAYOUTS}


def write_steps(folder, steps=(2, 4), ranks=2) -> None:
    for step in steps:
        for r in range(ranks):
            write_checkpoint(str(folder), r, step, values(r, step), meta_of(r, step, ranks))


def write_old_checkpoint(folder, rank: int, step: int, arrays: dict, meta: dict) -> str:
    """A checkpoint as pcompile wrote them before the safetensors format: one .npz, the
    index (with a manifest of every array's shape, dtype.str and sha256) in `__meta__`."""
    meta = dict(meta)
    meta["arrays"] = {k: {"shape": list(a.shape), "dtype": a.dtype.str,
                          "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()}
                      for k, a in sorted(arrays.items())}
    path = os.path.join(str(folder), f"rank_{rank}", f"step_{step:08d}.npz")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_npz(path, {**arrays, META_KEY: np.array(json.dumps(meta, sort_keys=True))})
    return path


def data_of(path: str) -> str:
    return tensors_path(path)


def truncate(path: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def flip_last_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF  # the last tensor's data (same size: only the checksum can tell)
    open(path, "wb").write(bytes(data))


def damaged_header(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[8:12] = b"\xff\xfe\x00{"  # the JSON header of the safetensors file
    open(path, "wb").write(bytes(data))


def rewrite_index(change):
    def damage(index_path: str) -> None:
        index = json.loads(open(index_path).read())
        change(index)
        open(index_path, "w").write(json.dumps(index))
    return damage


def wrong_shape(path: str) -> None:
    """A consistent checkpoint (its manifest matches its tensors) whose tensor is not the
    rank's slice of its layout."""
    arrays, meta = read_checkpoint(path)
    arrays["w"] = np.zeros((3, 6), np.float32)
    os.unlink(path)
    write_checkpoint(os.path.dirname(os.path.dirname(path)), meta["rank"], meta["step"],
                     arrays, meta, keep=0)


def checksum_mismatch(path: str) -> None:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    arrays, _ = read_checkpoint(path)
    with safe_open(data_of(path), framework="np") as f:
        metadata = f.metadata()
    arrays["b"] = arrays["b"] + 1  # a valid file of the same size, the old manifest
    save_file(arrays, data_of(path), metadata=metadata)


def unlisted(path: str) -> None:
    rewrite_index(lambda index: index["arrays"].pop("b"))(path)


# damage, the file it damages (index or tensors), what the message says
DAMAGE = {
    "truncated": (lambda p: truncate(data_of(p)), data_of, "truncated or damaged"),
    "zero-length": (lambda p: open(data_of(p), "wb").close(), data_of, "is empty (0 bytes)"),
    "missing tensors": (lambda p: os.unlink(data_of(p)), data_of, "is missing"),
    "damaged header": (lambda p: damaged_header(data_of(p)), data_of, "truncated or damaged"),
    "flipped byte": (lambda p: flip_last_byte(data_of(p)), str, "do not match the checksum"),
    "index not JSON": (lambda p: open(p, "w").write("{half"), str, "index is not valid JSON"),
    "empty index": (lambda p: open(p, "w").close(), str, "is empty (0 bytes)"),
    "no manifest": (rewrite_index(lambda index: index.pop("arrays")), str, "no manifest"),
    "unlisted tensor": (unlisted, str, "does not list: b"),
    "wrong shape": (wrong_shape, str, "rank 1's slice is (2, 6)"),
    "checksum": (checksum_mismatch, str, "do not match the checksum"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_one_message_and_resume_falls_back(tmp_path, kind: str) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder)
    damage, named, message = DAMAGE[kind]
    path = checkpoint_path(str(folder), 1, 4)
    damage(path)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path, 1)
    assert named(path) in str(info.value) and message in str(info.value), str(info.value)
    point = resume_point(str(folder), 2)
    assert point.step == 2
    assert len(point.skipped) == 1 and point.skipped[0].startswith("step 4: rank 1: ")
    arrays, meta = read_checkpoint(checkpoint_path(str(folder), 1, 2), 1)
    assert meta["step"] == 2 and np.array_equal(arrays["w"], values(1, 2)["w"])


def test_many_tensors_are_verified_in_parallel_and_the_first_fault_is_named(tmp_path) -> None:
    """Reading hashes the tensors in a pool of threads: every tensor comes back as written,
    and with two of them damaged, reading and resuming name the first in name order, as a
    reader that checks one tensor after the other does."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {f"t{i:02d}": rng.standard_normal((64, 33)).astype(np.float32) for i in range(24)}
    layouts = {k: {"shape": [64, 33], "dtype": "float32", "dev_matrix": [1],
                   "tensor_map": [-1, -1]} for k in arrays}
    meta = {**meta_of(0, 3, 1), "layouts": layouts}
    folder = str(tmp_path / "checkpoints")
    path = write_checkpoint(folder, 0, 3, arrays, meta)
    got, _ = read_checkpoint(path, 0)
    assert list(got) == sorted(arrays) and all(np.array_equal(got[k], v)
                                               for k, v in arrays.items())
    with safe_open(data_of(path), framework="np") as f:
        metadata = f.metadata()
    damaged = {**arrays, "t07": arrays["t07"] + 1, "t19": arrays["t19"] + 1}
    save_file(damaged, data_of(path), metadata=metadata)  # the same size, the old manifest
    with pytest.raises(CheckpointError, match="t07: its contents do not match"):
        read_checkpoint(path, 0)
    point = resume_point(folder, 1)
    assert point.step is None and "t07: its contents" in point.skipped[0]


def test_a_checkpoint_is_safetensors_and_a_json_index(tmp_path) -> None:
    """Any safetensors reader opens the tensors; the index names each tensor's layout."""
    from safetensors.numpy import load_file

    write_steps(tmp_path, steps=(3,))
    index_path = checkpoint_path(str(tmp_path), 1, 3)
    assert index_path.endswith("rank_1/step_00000003.json")
    index = json.loads(open(index_path).read())
    assert index["format"] == "pcompile-checkpoint/2" and index["step"] == 3
    assert index["file"] == "step_00000003.safetensors"
    assert index["layouts"] == LAYOUTS and set(index["arrays"]) == {"w", "b"}
    assert index["bytes"] == os.path.getsize(tensors_path(index_path))
    tensors = load_file(tensors_path(index_path))
    for name, value in values(1, 3).items():
        np.testing.assert_array_equal(tensors[name], value)


def test_a_tensor_file_opened_alone_says_where_its_slices_sit(tmp_path) -> None:
    """Issue 38 item 11: each rank's .safetensors file carries, in its own metadata, every
    slice's global shape, offsets and layout (and step, rank, ranks, plan), so that the file
    alone is not taken for full tensors; reading checks it against the index."""
    from safetensors import safe_open

    from pcompile.backends.checkpoint_files import SLICES_KEY, slice_places

    write_steps(tmp_path, steps=(3,))
    data = tensors_path(checkpoint_path(str(tmp_path), 1, 3))
    with safe_open(data, framework="np") as f:
        header = f.metadata()
    assert {k: header[k] for k in ("step", "rank", "num_ranks", "plan_id")} == {
        "step": "3", "rank": "1", "num_ranks": "2", "plan_id": "p1"}
    places = slice_places(data)
    assert places["w"] == {"global_shape": [4, 6], "offsets": [2, 0], "slice_shape": [2, 6],
                           "dev_matrix": [2], "tensor_map": [0, -1]}
    assert places["b"]["offsets"] == [0] and places["b"]["global_shape"] == [6]
    # the slices put at their offsets make the global tensor
    whole = np.zeros((4, 6), np.float32)
    for r in range(2):
        path = tensors_path(checkpoint_path(str(tmp_path), r, 3))
        place = slice_places(path)["w"]
        with safe_open(path, framework="np") as f:
            block = f.get_tensor("w")
        (row, col) = place["offsets"]
        whole[row:row + block.shape[0], col:col + block.shape[1]] = block
    np.testing.assert_array_equal(whole, np.arange(24, dtype=np.float32).reshape(4, 6) + 3)
    # a tensor file whose own record disagrees with its index is one message
    from safetensors.numpy import save_file

    header = dict(header)
    moved = json.loads(header[SLICES_KEY])
    moved["w"]["offsets"] = [0, 0]
    header[SLICES_KEY] = json.dumps(moved)
    save_file(load_file(data), data, metadata=header)
    index_path = checkpoint_path(str(tmp_path), 1, 3)
    index = json.loads(open(index_path).read())
    index["bytes"] = os.path.getsize(data)
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(CheckpointError, match="offsets"):
        read_checkpoint(checkpoint_path(str(tmp_path), 1, 3), 1)


def test_tensors_round_trip_bit_exactly_in_every_dtype(tmp_path) -> None:
    """bfloat16 (ml_dtypes, stored as safetensors' BF16), float16, float64, integers, bools,
    scalars and empty tensors come back with their dtype, shape and bits."""
    import ml_dtypes
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 2**16, 64, dtype=np.uint16)
    arrays = {"bf": raw.view(ml_dtypes.bfloat16).reshape(8, 8),  # NaNs and subnormals too
              "h": rng.standard_normal(5).astype(np.float16),
              "d": rng.standard_normal((2, 3)),
              "i": np.arange(6, dtype=np.int32), "l": np.arange(3, dtype=np.int64),
              "u": np.arange(4, dtype=np.uint8), "t": np.array([True, False]),
              "s": np.array(2.5, np.float32), "e": np.zeros((0, 3), np.float32),
              "strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]}
    path = write_checkpoint(str(tmp_path), 0, 1, arrays, {"step": 1, "layouts": {}})
    back, _ = read_checkpoint(path)
    other = load_file(tensors_path(path))
    for name, value in arrays.items():
        for got in (back[name], other[name]):
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert got.tobytes() == np.ascontiguousarray(value).tobytes(), name


def test_old_npz_checkpoints_still_load_resume_and_merge(tmp_path) -> None:
    """Checkpoints of pcompile before the safetensors format: read and verified as before,
    resumed from, merged; a newer safetensors step is preferred, and the writer's pruning
    removes the old files like its own."""
    folder = tmp_path / "checkpoints"
    for r in range(2):
        write_old_checkpoint(folder, r, 2, values(r, 2), meta_of(r, 2))
    path = checkpoint_path(str(folder), 1, 2)
    assert path.endswith(".npz")
    arrays, meta = read_checkpoint(path, 1)
    assert meta["step"] == 2 and np.array_equal(arrays["w"], values(1, 2)["w"])
    assert resume_point(str(folder), 2).step == 2
    full, info = merge_checkpoints(str(tmp_path))
    assert info["step"] == 2 and np.array_equal(full["w"],
                                                np.arange(24, dtype=np.float32).reshape(4, 6) + 2)
    truncate(path)  # damage is one message, as for the new format
    with pytest.raises(CheckpointError, match="truncated or not an .npz file"):
        read_checkpoint(path, 1)
    write_steps(folder, steps=(4, 6))
    assert resume_point(str(folder), 2).step == 6
    assert sorted(os.listdir(folder / "rank_1")) == [
        "step_00000004.json", "step_00000004.safetensors", "step_00000006.json",
        "step_00000006.safetensors"]


def test_no_intact_step_and_a_missing_rank(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder, steps=(2, 4))
    os.unlink(checkpoint_path(str(folder), 0, 4))
    truncate(data_of(checkpoint_path(str(folder), 1, 2)))
    point = resume_point(str(folder), 2)
    assert point.step is None
    assert point.skipped[0] == "step 4: rank 0: no checkpoint"
    assert point.skipped[1].startswith("step 2: rank 1: ")


def merge_cli(out) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint_merge", str(out)],
                          capture_output=True, text=True, cwd=ROOT)


def test_merge_passes_over_a_damaged_step_and_says_so(tmp_path) -> None:
    write_steps(tmp_path / "checkpoints")
    flip_last_byte(data_of(checkpoint_path(str(tmp_path / "checkpoints"), 0, 4)))
    full, info = merge_checkpoints(str(tmp_path))
    assert info["step"] == 2
    assert np.array_equal(full["w"], np.arange(24, dtype=np.float32).reshape(4, 6) + 2)
    proc = merge_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "passed over step 4: rank 0:" in proc.stderr and "checksum" in proc.stderr
    merged = load_file(str(tmp_path / "merged_step_00000002.safetensors"))
    assert np.array_equal(merged["w"], full["w"])


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_merge_of_a_damaged_step_is_one_message(tmp_path, kind: str) -> None:
    write_steps(tmp_path / "checkpoints", steps=(4,))
    DAMAGE[kind][0](checkpoint_path(str(tmp_path / "checkpoints"), 1, 4))
    proc = merge_cli(tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("pcompile-merge: error: no step has an intact checkpoint")
    assert DAMAGE[kind][2] in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_killed_write_leaves_a_temp_file_that_the_next_write_removes(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder, steps=(2,))
    leftovers = [folder / "rank_0" / ".step_00000004.safetensors.tmp-0badf00d",
                 folder / "rank_0" / ".tmpAb3dE9",  # safetensors' own temporary file
                 folder / "rank_0" / "step_00000003.safetensors"]  # killed before its index
    for leftover in leftovers:
        leftover.write_bytes(b"half a checkpoint")
    assert resume_point(str(folder), 2).step == 2  # none of them is a checkpoint
    write_steps(folder, steps=(4,))
    assert sorted(os.listdir(folder / "rank_0")) == [
        "step_00000002.json", "step_00000002.safetensors", "step_00000004.json",
        "step_00000004.safetensors"]


def test_checkpoints_are_written_with_the_users_umask(tmp_path) -> None:
    old = os.umask(0o027)
    try:
        write_steps(tmp_path / "c", steps=(1,))
    finally:
        os.umask(old)
    index = checkpoint_path(str(tmp_path / "c"), 0, 1)
    for path in (index, tensors_path(index)):  # safetensors makes its files 0600
        assert os.stat(path).st_mode & 0o777 == 0o640


def test_clearing_checkpoints_deletes_nothing_else(tmp_path) -> None:
    folder = tmp_path / "checkpoints"
    write_steps(folder)
    (folder / "rank_0" / "notes.txt").write_text("mine")
    (folder / "README").write_text("mine")
    clear_checkpoints(str(folder))
    assert sorted(p.name for p in folder.rglob("*")) == ["README", "notes.txt", "rank_0"]


def test_bfloat16_arrays_keep_their_dtype_in_npz(tmp_path) -> None:
    """.npy writes bfloat16 as raw `V2` bytes: pcompile's .npz files (constants, outputs,
    merged checkpoints) store its bits and give the bfloat16 array back."""
    import ml_dtypes

    values = {"w": (np.arange(12, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16).reshape(3, 4),
              "m": np.ones(3, np.float32)}
    save_npz(str(tmp_path / "c.npz"), values)
    back = load_npz(str(tmp_path / "c.npz"))
    assert back["w"].dtype == ml_dtypes.bfloat16 and set(back) == {"w", "m"}
    assert back["w"].tobytes() == values["w"].tobytes()
    with zipfile.ZipFile(tmp_path / "c.npz") as zf:
        assert zf.testzip() is None


def test_a_full_disk_is_one_message_and_the_previous_checkpoint_stays(tmp_path,
                                                                      monkeypatch) -> None:
    """The background writer: a write that fails on a full disk (ENOSPC from safetensors, or
    from the index) keeps nothing of its step, says which write failed and which checkpoint
    is intact; the run's next write removes what it left."""
    import safetensors.numpy

    import pcompile.backends.checkpoint_files as checkpoint
    from pcompile.backends.async_checkpoint import AsyncCheckpointWriter, CheckpointWriteError

    folder = tmp_path / "checkpoints"
    said: list[str] = []
    writer = AsyncCheckpointWriter(str(folder), said.append)
    per_rank = lambda step: {r: (values(r, step), meta_of(r, step)) for r in range(2)}  # noqa
    writer.submit(2, per_rank(2), 0.01)
    writer.wait()
    assert said and said[0].startswith("checkpoint of step 2 (rank(s) 0..1): ") and " MB in " \
        in said[0], said
    before = {p.name: p.read_bytes() for p in (folder / "rank_1").iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for where, target in ((safetensors.numpy, "save_file"), (checkpoint, "atomic_write_text")):
        with monkeypatch.context() as patch:
            patch.setattr(where, target, full)
            writer = AsyncCheckpointWriter(str(folder), said.append, intact=2)
            writer.submit(4, per_rank(4), 0.01)
            with pytest.raises(CheckpointWriteError) as info:
                writer.wait()
        message = str(info.value)
        assert message == (f"the checkpoint of step 4 could not be written (rank 0, in "
                           f"{folder / 'rank_0'}: no space left on the device (the disk is "
                           "full)); nothing of it was kept, and the checkpoint of step 2 is "
                           "intact"), message
        assert writer.failure() is None  # reported once
        assert resume_point(str(folder), 2).step == 2
        assert {p.name: p.read_bytes() for p in (folder / "rank_1").iterdir()} == before
        read_checkpoint(checkpoint_path(str(folder), 0, 2), 0)
    writer = AsyncCheckpointWriter(str(folder), said.append, intact=2)
    writer.submit(4, per_rank(4), 0.01)
    writer.wait()  # and what the failed writes left is gone
    assert sorted(os.listdir(folder / "rank_0")) == [
        "step_00000002.json", "step_00000002.safetensors", "step_00000004.json",
        "step_00000004.safetensors"]


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_merge_streams_one_tensor_at_a_time(tmp_path, suffix: str) -> None:
    """pcompile-merge of 8 ranks x 12 tensors of 1 MiB (12 MiB in all) holds about one full
    tensor (plus its fill mask and one slice), never the model, and writes what
    merge_checkpoints returns."""
    import tracemalloc

    from pcompile.backends.checkpoint_merge import main as merge_main

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
        assert merge_main([str(tmp_path), "--output", str(tmp_path / f"m{suffix}")]) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the tensor being assembled and its bool mask (a quarter of it), the one being written,
    # the slice being read: about 2.5 tensors; the old merge held all 12
    assert peak < 4 * tensor < count * tensor, peak
    merged = (load_npz(str(tmp_path / "m.npz")) if suffix == ".npz"
              else load_file(str(tmp_path / "m.safetensors")))
    assert sorted(k for k in merged if k != META_KEY) == sorted(full)
    for name, value in full.items():
        assert np.array_equal(merged[name], value)


def test_the_module_path_of_older_installs_still_merges(tmp_path) -> None:
    """`pcompile.backends.checkpoint` is what the `pcompile-merge` entry point of older installs
    and `python -m` name: it still runs the merge."""
    import pcompile.backends.checkpoint as older
    from pcompile.backends import checkpoint_merge

    assert older.main is checkpoint_merge.main
    write_steps(tmp_path / "checkpoints", steps=(2,))
    proc = subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("merged step 2 of 2 ranks"), proc


def test_merge_never_replaces_a_file_it_did_not_write(tmp_path) -> None:
    write_steps(tmp_path / "checkpoints", steps=(2,))
    mine = tmp_path / "notes.npz"
    mine.write_bytes(b"the user's own file")
    proc = subprocess.run([sys.executable, "-m", "pcompile.backends.checkpoint_merge",
                           str(tmp_path), "--output", str(mine)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "not a file pcompile-merge wrote" in proc.stderr
    assert mine.read_bytes() == b"the user's own file"
    # its own output is replaced on a second merge
    assert merge_cli(tmp_path).returncode == 0
    assert merge_cli(tmp_path).returncode == 0


@pytest.mark.slow  # a multi-process run (~11 s of CPU)
def test_a_full_disk_in_a_rank_program_is_one_message_and_resume_works(tmp_path) -> None:
    """The rank program (2 ranks on 2 virtual CPU devices): its background write of the final
    checkpoint (step 4) fails as on a full disk; the run ends with exit status 2 and one line
    naming the failed write and the intact step 2, no traceback; --resume continues from
    step 2. Every checkpoint's megabytes and seconds are in the program's output (run.log)."""
    from pcompile.tools.compile import compile as compile_model

    out = tmp_path / "out"
    compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=2,
                  parallel_mode="data_parallel", out_dir=str(out))
    env = clean_env()
    run = [sys.executable, str(out / "rank_0" / "program.py"), "--checkpoint-every", "2"]
    proc = subprocess.run(run + ["--steps", "4"], capture_output=True, text=True, timeout=300,
                          env=dict(env, PCOMPILE_FAULT_INJECT="1:4:checkpoint-enospc"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    folder = out / "checkpoints" / "rank_0"
    assert errors == [
        f"pcompile ranks 0-1: error: the checkpoint of step 4 could not be written (rank 0, "
        f"in {folder}: no space left on the device (the disk is full)); nothing of it was "
        "kept, and the checkpoint of step 2 is intact"], proc.stderr
    assert "checkpoint of step 2 (rank(s) 0..1): " in proc.stdout, proc.stdout
    names = sorted(os.listdir(folder))
    assert names[1:] == ["step_00000002.json", "step_00000002.safetensors"], names
    assert names[0].startswith("run_") and names[0].endswith(".log"), names  # its train.log
    proc = subprocess.run(run + ["--steps", "4", "--resume"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("checkpoint of")]
    assert len(lines) == 1 and lines[0].startswith("checkpoint of step 4 (rank(s) 0..1): ")
    assert "the end of the run waited" in proc.stdout
    assert len((out / "rank_1" / "train.log").read_text().splitlines()) == 4


@pytest.mark.parametrize("step", ["four", 4.5, -1, True])
def test_merge_of_a_checkpoint_whose_step_is_not_an_integer_is_one_message(tmp_path,
                                                                          step) -> None:
    """A step in a checkpoint's metadata that is not a non-negative integer (hand-edited, or
    another tool's) is one message naming the file, not a traceback."""
    write_steps(tmp_path / "checkpoints", steps=(4,))
    for rank in (0, 1):
        index = checkpoint_path(str(tmp_path / "checkpoints"), rank, 4)
        meta = json.loads(open(index, encoding="utf-8").read())
        meta["step"] = step
        with open(index, "w", encoding="utf-8") as f:
            json.dump(meta, f)
    proc = merge_cli(tmp_path)
    assert proc.returncode == 1
    assert "its metadata's step is" in proc.stderr and "Traceback" not in proc.stderr


def test_the_final_checkpoint_reads_a_scalar_state_as_an_array() -> None:
    """A scalar state (a loss scale, a step counter) is a (1,) block on each device;
    the final checkpoint's view of it is a 0-d array, which safetensors and numpy accept (it
    was a numpy scalar: "object __array__ method not producing an array")."""
    from pcompile.backends.async_checkpoint import _DeviceView

    view = np.asarray(_DeviceView(np.array([2.5], np.float32), ()))
    assert view.shape == () and view.dtype == np.float32 and float(view) == 2.5
    assert np.asarray(_DeviceView(np.array([1, 2], np.int32), (2,))).shape == (2,)
