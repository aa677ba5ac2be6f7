"""Per-rank checkpoints (sliced parameters and optimizer state) in safetensors with a JSON index,
the deterministic .npz files of constants and outputs, and `pcompile-merge`, which reassembles
full tensors from the ranks' slices.

Layout on disk (see docs/running.md):

    <out>/checkpoints/rank_<r>/step_<SSSSSSSS>.safetensors   rank r's tensors after step S
    <out>/checkpoints/rank_<r>/step_<SSSSSSSS>.json          its index

The `.safetensors` file holds rank r's slice of every stored tensor (weights and optimizer state,
keyed by graph-parameter name), in the tensors' own dtypes (bfloat16 as BF16), readable by any
safetensors reader. The index is JSON: format (`pcompile-checkpoint/2`), the tensors' file and
size, step, epoch, step in epoch, rank, number of ranks, plan id, the train.log lines so far,
every tensor's layout (global shape, dtype, device matrix, tensor map), so that merging needs
nothing else (plan.json's parameter layouts are cross-checked when present), and a manifest of
every tensor (its slice's shape, dtype and sha256).

Writes are atomic: the tensors go to a temporary name (`.step_<S>.safetensors.tmp-<token>`),
are fsynced and renamed; then the index the same way. The index is written last and is what
makes a step exist, so a write cut short at any point leaves no checkpoint under the final
names, and the previous ones as they were; leftovers (temporary files, tensors without an
index) are removed by the rank's next write. backends/async_checkpoint.py writes them from a
background thread while training goes on.

Reading verifies a checkpoint against its index and layouts: a missing, truncated, empty or
damaged file, an unreadable index, a tensor missing, extra or of another shape, dtype or
checksum than its manifest, or not the rank's slice of its layout raises `CheckpointError`
naming the file and the fault. `resume_point` picks the newest step that every rank holds
intact, and says which newer steps it passed over and why; `pcompile-merge` and `--resume` use
it. Checkpoints of pcompile before the safetensors format (`step_<S>.npz`, the index in its
`__meta__` member) are still read, verified the same way.

    pcompile-merge OUT_DIR [--step S] [--output FILE.npz]
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import secrets
import stat
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from safetensors import safe_open

META_KEY = "__meta__"
FORMAT = "pcompile-checkpoint/2"
_STEP_FILE = re.compile(r"^step_(\d+)\.(json|npz)$")  # an index, or a checkpoint before format 2
_DATA_FILE = re.compile(r"^step_(\d+)\.safetensors$")
# ours (`temp_name`), and the one safetensors' writer goes through (Rust's tempfile: .tmpXXXXXX)
_TEMP_FILE = re.compile(r"\.[^/]+\.tmp-[0-9a-f]+|\.tmp[A-Za-z0-9]{6}")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


# -- files -------------------------------------------------------------------------------------


def temp_name(path: str) -> str:
    """The temporary file an atomic write of `path` goes through: `.<name>.tmp-<token>` in the
    same folder (compiler/outdir.py and `clean_temp_files` recognise leftovers by this name)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp-{secrets.token_hex(4)}")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and os.replace (the
    user's umask applies to the file, as to any other)."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write(path: str, write: Callable[[Any], object]) -> None:
    """Call `write(f)` on a new temporary file in `path`'s folder, then fsync and os.replace it
    onto `path`; on any failure the temporary file is removed and `path` is untouched."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_fill(path: str, fill: Callable[[str], object],
                before_rename: Callable[[], object] | None = None) -> None:
    """`atomic_write` for writers that take a file name: `fill(tmp)` writes the temporary file,
    which then gets the user's umask (safetensors creates its files 0600), is fsynced and
    renamed onto `path`; on any failure it is removed and `path` is untouched."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = temp_name(path)
    try:
        fill(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:  # testing: a kill in the middle of the write
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask() sets it,
    which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def clean_temp_files(folder: str) -> list[str]:
    """Remove the temporary files of atomic writes in `folder` that were killed before their
    rename (call it before this process writes there; nobody else writes a rank's folder)."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return removed
    for name in names:
        if _TEMP_FILE.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


#: The .npz member naming the arrays stored as the bits of an extension dtype (bfloat16).
DTYPES_KEY = "__dtypes__"


def portable(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    """An array numpy's .npy format stores faithfully: extension dtypes (bfloat16, which .npy
    would write as raw `V2` bytes) as the unsigned integers of their bits, with the dtype's
    name to view them back."""
    if array.dtype.kind in "biufSU":
        return array, None
    from pcompile.ir.types import DType

    try:
        name = DType.from_any(array.dtype).name
    except TypeError:  # not an IR dtype (a metadata blob): stored as it is
        return array, None
    width = array.dtype.itemsize * 8
    return array.view(np.dtype(f"uint{width}")), name


def write_npz(f: Any, arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]
              ) -> None:
    """Write an .npz (readable by np.load) to the binary file `f`, member by member: fixed
    timestamps and sorted keys, so the same arrays always give the same bytes; bfloat16
    arrays keep their dtype (`portable`; `load_npz` restores it). Given an iterable of
    (key, array) pairs, they are written in the order given, one array held at a time
    (`pcompile-merge` streams a model larger than memory this way)."""
    items = sorted(arrays.items()) if isinstance(arrays, Mapping) else arrays
    members = _members(items)
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, array in members:
            info = zipfile.ZipInfo(key + ".npy", date_time=_FIXED_TIME)
            info.external_attr = 0o644 << 16
            # zipfile needs to know in advance whether a member passes the zip32 limit
            big = array.nbytes + 4096 > zipfile.ZIP64_LIMIT
            with zf.open(info, "w", force_zip64=big) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _members(items: Iterable[tuple[str, np.ndarray]]
                    ) -> Iterator[tuple[str, np.ndarray]]:
    """The members as written: extension dtypes as their bits (`portable`), then
    `__dtypes__` naming them."""
    views: dict[str, str] = {}
    for key, value in items:
        stored, view = portable(np.asarray(value))
        if view is not None:
            views[key] = view
        yield key, stored
    if views:
        yield DTYPES_KEY, np.frombuffer(json.dumps(views, sort_keys=True).encode(), np.uint8)


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """The bytes `write_npz` writes for `arrays`."""
    buf = io.BytesIO()
    write_npz(buf, arrays)
    return buf.getvalue()


def restore_dtypes(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Undo `portable` for the arrays an .npz's `__dtypes__` member names."""
    names = arrays.pop(DTYPES_KEY, None)
    if names is None:
        return arrays
    from pcompile.ir.types import DType

    for key, name in json.loads(bytes(names.astype(np.uint8)).decode()).items():
        if key in arrays:
            arrays[key] = arrays[key].view(DType[name].np)
    return arrays


def save_npz(path: str, arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]
             ) -> None:
    """`write_npz` to `path`, atomically (a temporary file in the same folder, then
    os.replace), streaming: nothing but the array being written is held."""
    atomic_write(path, lambda f: write_npz(f, arrays))


def load_npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return restore_dtypes({k: np.array(data[k]) for k in data.files})


class LazyNpz:
    """An .npz opened for reading one array at a time (`get`), bfloat16 restored; use as a
    context manager or `close()` it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._data = np.load(path, allow_pickle=False)
        self.files = [k for k in self._data.files if k != DTYPES_KEY]
        self._views: dict[str, str] = {}
        if DTYPES_KEY in self._data.files:
            raw = np.asarray(self._data[DTYPES_KEY]).astype(np.uint8)
            self._views = json.loads(bytes(raw).decode())

    def get(self, key: str) -> np.ndarray:
        array = np.asarray(self._data[key])  # a fresh array read from the file
        if key in self._views:
            from pcompile.ir.types import DType

            array = array.view(DType[self._views[key]].np)
        return array

    def close(self) -> None:
        self._data.close()

    def __enter__(self) -> LazyNpz:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- checkpoints -------------------------------------------------------------------------------


def checkpoint_path(folder: str, rank: int, step: int) -> str:
    """The file that stands for rank `rank`'s checkpoint of `step`: its index
    (`step_<S>.json`), or the .npz of an older pcompile when only that exists."""
    base = os.path.join(folder, f"rank_{rank}", f"step_{step:08d}")
    if not os.path.exists(base + ".json") and os.path.exists(base + ".npz"):
        return base + ".npz"
    return base + ".json"


def tensors_path(index: str) -> str:
    """The .safetensors file beside an index."""
    return index[:-len(".json")] + ".safetensors"


def rank_steps(folder: str, rank: int) -> list[int]:
    """Steps with a checkpoint index (or an older .npz) of `rank`, intact or not, ascending."""
    d = os.path.join(folder, f"rank_{rank}")
    if not os.path.isdir(d):
        return []
    return sorted({int(m.group(1)) for name in os.listdir(d) if (m := _STEP_FILE.match(name))})


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def _digest(array: np.ndarray) -> str:
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)  # no copy of the bytes
    return hashlib.sha256(raw.data).hexdigest()


@dataclass
class WriteReport:
    """What `write_checkpoint` wrote: the index, the bytes of both files, the seconds."""

    path: str
    nbytes: int
    seconds: float


def write_checkpoint(folder: str, rank: int, step: int, values: Mapping[str, np.ndarray],
                     meta: dict[str, Any], keep: int = 2) -> str:
    """Rank `rank`'s checkpoint after `step` (atomic; module docstring); keeps the newest
    `keep` steps per rank. The index gets `meta` and a manifest of every tensor (shape, dtype,
    sha256) that `read_checkpoint` verifies. Returns the index's path."""
    return write_checkpoint_report(folder, rank, step, values, meta, keep).path


def write_checkpoint_report(folder: str, rank: int, step: int,
                            values: Mapping[str, np.ndarray], meta: dict[str, Any],
                            keep: int = 2, before_rename: Callable[[], object] | None = None
                            ) -> WriteReport:
    """`write_checkpoint`, saying how many bytes it wrote and how long it took. Any failure
    (a full disk...) raises before the index exists: the step is not there, the previous
    steps are untouched."""
    import time

    from safetensors.numpy import save_file

    start = time.perf_counter()
    arrays = {k: np.asarray(v, order="C") for k, v in sorted(values.items())}  # 0-d stays 0-d
    index_path = os.path.join(folder, f"rank_{rank}", f"step_{step:08d}.json")
    data_path = tensors_path(index_path)
    os.makedirs(os.path.dirname(index_path), exist_ok=True)
    clean_temp_files(os.path.dirname(index_path))
    # hash (sha256 releases the GIL) while safetensors writes
    with ThreadPoolExecutor(max_workers=2) as pool:  # (threads inherit the caller's nice)
        digests = {k: pool.submit(_digest, a) for k, a in arrays.items()}
        atomic_fill(data_path, lambda tmp: save_file(
            arrays, tmp, metadata={"format": FORMAT, "step": str(step), "rank": str(rank)}),
            before_rename)
        manifest = {k: {"shape": list(a.shape), "dtype": a.dtype.name,
                        "sha256": digests[k].result()} for k, a in arrays.items()}
    index = dict(meta)
    index.update(format=FORMAT, file=os.path.basename(data_path),
                 bytes=os.path.getsize(data_path), arrays=manifest)
    text = json.dumps(index, sort_keys=True)
    atomic_write_text(index_path, text)
    _sync_folder(os.path.dirname(index_path))
    _prune(folder, rank, step, keep)
    nbytes = index["bytes"] + len(text.encode())
    return WriteReport(index_path, nbytes, time.perf_counter() - start)


def _sync_folder(folder: str) -> None:
    """fsync a folder, so that renames in it survive a crash of the machine."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prune(folder: str, rank: int, current: int, keep: int) -> None:
    """Keep the newest `keep` steps of `rank`; remove tensors that no index names (a write cut
    short between its two renames). An index goes before its tensors, so a half-removed step
    is never taken for a checkpoint."""
    d = os.path.join(folder, f"rank_{rank}")
    steps = rank_steps(folder, rank)
    old = set(steps[:-keep]) if keep > 0 else set()
    for name in sorted(os.listdir(d)):
        m = _STEP_FILE.match(name)
        if m and int(m.group(1)) in old:
            _unlink(os.path.join(d, name))
    for name in sorted(os.listdir(d)):
        m = _DATA_FILE.match(name)
        if m and int(m.group(1)) != current and not os.path.exists(
                os.path.join(d, name[:-len(".safetensors")] + ".json")):
            _unlink(os.path.join(d, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _regular_size(path: str) -> int:
    """The size of `path`, which must be a regular file (a FIFO or device is refused before
    anything opens it)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file")
    return info.st_size


class _NpzTensors:
    """The tensors and index of a checkpoint of an older pcompile (one .npz, the index in its
    `__meta__` member)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._npz = LazyNpz(path)
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{path} is truncated or not an .npz file ({exc})") from None
        except Exception as exc:  # noqa: BLE001  (a damaged file can fail in numpy or zipfile)
            raise CheckpointError(f"{path} is damaged: {type(exc).__name__}: {exc}") from None
        self.names = [k for k in self._npz.files if k != META_KEY]
        if META_KEY not in self._npz.files:
            self.close()
            raise CheckpointError(f"{path} has no metadata ({META_KEY}): not a pcompile "
                                  "checkpoint")
        try:
            self.index = json.loads(str(self.get(META_KEY)))
        except ValueError as exc:
            self.close()
            raise CheckpointError(f"{path}: its metadata is not valid JSON ({exc})") from None

    def get(self, name: str) -> np.ndarray:
        try:
            return self._npz.get(name)
        except zipfile.BadZipFile as exc:
            what = "corrupt" if "CRC" in str(exc) else "truncated or not an .npz file"
            raise CheckpointError(f"{self.path} is {what} ({exc})") from None
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{self.path} is damaged: {type(exc).__name__}: "
                                  f"{exc}") from None

    def close(self) -> None:
        self._npz.close()


class _SafetensorsTensors:
    """The tensors of a checkpoint (`step_<S>.safetensors`) and its index (`step_<S>.json`)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        import pcompile.ir.types  # noqa: F401  (registers bfloat16 with numpy: ml_dtypes)

        self.path = path
        try:
            with open(path, encoding="utf-8") as f:
                index = json.load(f)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:
            raise CheckpointError(f"{path}: the index is not valid JSON ({exc})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a {FORMAT} index")
        name = index.get("file")
        if not isinstance(name, str) or not _DATA_FILE.match(name):
            raise CheckpointError(f"{path}: the index names no tensor file of its own ({name!r})")
        self.data = os.path.join(os.path.dirname(path), name)
        if not os.path.exists(self.data):
            raise CheckpointError(f"{self.data} is missing (its index {path} names it)")
        size = _regular_size(self.data)
        if size == 0:
            raise CheckpointError(f"{self.data} is empty (0 bytes): its write was cut short")
        if index.get("bytes") not in (None, size):
            raise CheckpointError(f"{self.data} holds {size} bytes, its index says "
                                  f"{index.get('bytes')}: truncated or damaged")
        self._file: safe_open | None
        try:
            self._file = safe_open(self.data, framework="np")
            self.names = list(self._file.keys())
        except Exception as exc:  # noqa: BLE001  (SafetensorError or OSError)
            raise CheckpointError(f"{self.data} is truncated or damaged ({exc})") from None
        self.index = index

    def get(self, name: str) -> np.ndarray:
        try:
            assert self._file is not None, "read after close()"
            return self._file.get_tensor(name)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{self.data} is damaged: {type(exc).__name__}: "
                                  f"{exc}") from None

    def close(self) -> None:
        self._file = None


class CheckpointReader:
    """One rank's checkpoint opened for reading tensor by tensor (`array`, verified against the
    manifest when read): `pcompile-merge` holds one tensor at a time this way. Opening checks
    the files and the index; a fault raises `CheckpointError` naming the file and what."""

    def __init__(self, path: str, rank: int | None = None) -> None:
        self.path, self.rank = path, rank
        size = _regular_size(path)
        if size == 0:
            raise CheckpointError(f"{path} is empty (0 bytes): its write was cut short")
        self._source: _NpzTensors | _SafetensorsTensors = (
            _NpzTensors(path) if path.endswith(".npz") else _SafetensorsTensors(path))
        try:
            self.meta = self._meta()
        except BaseException:
            self.close()
            raise

    def _meta(self) -> dict[str, Any]:
        path, meta = self.path, self._source.index
        manifest = meta.get("arrays") if isinstance(meta, dict) else None
        if not isinstance(manifest, dict) or not isinstance(meta.get("layouts"), dict):
            raise CheckpointError(f"{path}: its metadata has no manifest of the arrays "
                                  "(written by another tool or an older pcompile)")
        extra = sorted(set(self._source.names) - set(manifest))
        if extra:
            raise CheckpointError(f"{path} holds arrays its manifest does not list: "
                                  f"{', '.join(extra)}")
        for key in ("step", "epoch", "step_in_epoch", "num_ranks"):
            value = meta.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise CheckpointError(f"{path}: its metadata's {key} is {value!r}, not a "
                                      "non-negative integer (damaged, or written by another "
                                      "tool)")
        return meta

    @property
    def names(self) -> list[str]:
        return sorted(self.meta["arrays"])

    def array(self, name: str) -> np.ndarray:
        """The array `name`, checked against its manifest entry and the rank's slice shape."""
        value = self._source.get(name) if name in self._source.names else None
        problem = _array_problem(name, value, self.meta["arrays"].get(name),
                                 self.meta["layouts"].get(name), self.rank)
        if problem:
            raise CheckpointError(f"{self.path}: {problem}")
        assert value is not None
        return value

    def close(self) -> None:
        if hasattr(self, "_source"):
            self._source.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_checkpoint(path: str, rank: int | None = None
                    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays and metadata of a checkpoint, verified against its manifest (every array
    present with its shape, dtype and checksum) and, given `rank`, against the slice shapes
    of the layouts it records. Anything wrong: `CheckpointError` saying what."""
    with CheckpointReader(path, rank) as reader:
        return {name: reader.array(name) for name in reader.names}, reader.meta


def _array_problem(name: str, array: np.ndarray | None, entry: Any, layout: Any,
                   rank: int | None) -> str:
    if array is None:
        return f"{name} is missing"
    if not isinstance(entry, dict):
        return f"the manifest entry of {name} is malformed"
    if list(array.shape) != entry.get("shape") or entry.get("dtype") not in (
            array.dtype.name, array.dtype.str):  # format 2 names the dtype, .npz gave .str
        return (f"{name} has shape {tuple(array.shape)} and dtype {array.dtype}, the manifest "
                f"says {entry.get('shape')} {entry.get('dtype')}")
    if _digest(array) != entry.get("sha256"):
        return f"{name}: its contents do not match the checksum in the manifest"
    if rank is not None and layout is not None and array.shape:
        try:
            want = tuple(e - b for b, e in _layout(layout).slice_bounds(rank))
        except Exception as exc:  # noqa: BLE001  (malformed layout metadata)
            return f"the layout of {name} is malformed ({exc})"
        if tuple(array.shape) != want:
            return f"{name} has shape {tuple(array.shape)}, rank {rank}'s slice is {want}"
    return ""


def checkpoint_problem(path: str, rank: int, plan_id: str | None = None) -> str:
    """Why rank `rank`'s checkpoint at `path` cannot be resumed from ('' if it can)."""
    if not os.path.exists(path):
        return "no checkpoint"
    try:
        with CheckpointReader(path, rank) as reader:
            for name in reader.names:  # verified one array at a time, none kept
                reader.array(name)
            meta = reader.meta
    except CheckpointError as exc:
        return str(exc)
    if plan_id is not None and meta.get("plan_id") != plan_id:
        return (f"{path} was written by plan {meta.get('plan_id')}, this program is plan "
                f"{plan_id}")
    return ""


@dataclass
class ResumePoint:
    """The newest step that every rank holds intact (None: none), and why newer ones were
    passed over."""

    step: int | None
    skipped: list[str] = field(default_factory=list)


def resume_point(folder: str, num_ranks: int, plan_id: str | None = None) -> ResumePoint:
    """The newest step for which every rank's checkpoint reads back intact (verified), with a
    line per newer step that was passed over (which rank, what is wrong)."""
    steps: set[int] = set()
    for r in range(num_ranks):
        steps.update(rank_steps(folder, r))
    point = ResumePoint(None)
    for step in sorted(steps, reverse=True):
        problems = [f"rank {r}: {why}" for r in range(num_ranks)
                    if (why := checkpoint_problem(checkpoint_path(folder, r, step), r, plan_id))]
        if not problems:
            point.step = step
            return point
        point.skipped.append(f"step {step}: " + "; ".join(problems))
    return point


def clear_checkpoints(folder: str) -> None:
    """Delete the checkpoints (and their leftover temporary files) of a previous run from
    `folder`, and nothing else: other files and the folders holding them stay."""
    if not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        sub = os.path.join(folder, name)
        if not (re.fullmatch(r"rank_\d+", name) and os.path.isdir(sub)):
            continue
        for f in os.listdir(sub):
            if _STEP_FILE.match(f) or _DATA_FILE.match(f) or _TEMP_FILE.fullmatch(f):
                os.unlink(os.path.join(sub, f))
        try:
            os.rmdir(sub)
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def layout_entry(layout: Any, shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
    """The JSON form of a TensorLayout (None: not split)."""
    if layout is None:
        return {"shape": list(shape), "dtype": dtype, "dev_matrix": [1],
                "tensor_map": [-1] * len(shape)}
    return {
        "shape": list(layout.shape),
        "dtype": dtype,
        "dev_matrix": list(layout.dev_matrix),
        "tensor_map": [list(e) if isinstance(e, tuple) else e for e in layout.tensor_map],
    }


def _layout(entry: Mapping[str, Any]) -> Any:
    from pcompile.ir.layout import TensorLayout

    tmap = tuple(tuple(e) if isinstance(e, list) else e for e in entry["tensor_map"])
    return TensorLayout(tuple(entry["dev_matrix"]), tmap, tuple(entry["shape"]))


# -- merge -------------------------------------------------------------------------------------


class MergeError(Exception):
    pass


def merge_checkpoints(out_dir: str, step: int | None = None,
                      folder: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`merged_tensors` gathered into a dict (for models that fit in memory)."""
    info, tensors = merged_tensors(out_dir, step, folder)
    return dict(tensors), info


def merged_tensors(out_dir: str, step: int | None = None, folder: str | None = None,
                   only: set[str] | None = None
                   ) -> tuple[dict[str, Any], Iterator[tuple[str, np.ndarray]]]:
    """The full tensors of every rank's checkpoint of `step` (default: the newest step every
    rank holds intact; `info["skipped"]` says which newer steps were passed over and why), as
    an iterator of (name, tensor) in name order that reads the ranks' slices of one tensor at
    a time: memory holds one full tensor, never the model. Checks every array against its
    manifest, that replicas of one slice agree bit for bit, that every element is held by
    some rank and that layouts match plan.json; a fault raises `MergeError` (while iterating
    for faults inside a tensor)."""
    folder = folder or os.path.join(out_dir, "checkpoints")
    plan_path = os.path.join(out_dir, "plan.json")
    plan = None
    if os.path.exists(plan_path):
        from pcompile.compiler.plan import PlanError, read_plan

        try:  # validated against its schema (compiler/plan.py)
            plan = read_plan(out_dir).model_dump(mode="json")
        except PlanError as exc:
            raise MergeError(str(exc)) from None
        num_ranks = int(plan["devices"])
    else:
        num_ranks = _count_ranks(folder)
    skipped: list[str] = []
    plan_id = folder_plan_id(out_dir)
    if plan_id is not None and step is None:
        _check_plan_id(folder, plan_id, out_dir)
    if step is None:
        point = resume_point(folder, num_ranks, plan_id)
        skipped = point.skipped
        if point.step is None:
            why = "".join(f"\n  {line}" for line in skipped)
            raise MergeError(f"no step has an intact checkpoint of all {num_ranks} ranks in "
                             f"{folder}{why}")
        step = point.step
    readers: list[CheckpointReader] = []
    try:
        for r in range(num_ranks):
            path = checkpoint_path(folder, r, step)
            if not os.path.exists(path):
                raise MergeError(f"rank {r} has no checkpoint of step {step} ({path})")
            readers.append(CheckpointReader(path, r))
            if readers[-1].meta.get("plan_id") != readers[0].meta.get("plan_id"):
                raise MergeError(f"rank {r}'s checkpoint belongs to another plan than rank 0's")
            if plan_id is not None and readers[-1].meta.get("plan_id") != plan_id:
                raise MergeError(_plan_mismatch(folder, readers[-1].meta.get("plan_id"),
                                                plan_id, out_dir))
    except CheckpointError as exc:
        for reader in readers:
            reader.close()
        raise MergeError(str(exc)) from None
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    meta0 = readers[0].meta
    info: dict[str, Any] = {k: meta0.get(k) for k in ("step", "epoch", "step_in_epoch",
                                                      "plan_id", "num_ranks")}
    info["skipped"] = skipped
    names = sorted({name for reader in readers for name in reader.names
                    if only is None or name in only})
    info["tensors"] = {}
    for name in names:  # dtype and global shape of each, known before any is merged
        entry = next(reader.meta["layouts"].get(name) for reader in readers
                     if name in reader.meta["arrays"])
        if not isinstance(entry, dict):
            raise MergeError(f"{readers[0].path}: the layout of {name} is missing")
        info["tensors"][name] = (_np_dtype(entry.get("dtype")),
                                 tuple(int(d) for d in entry.get("shape", ())))

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        try:
            for name in names:
                yield name, _merge_one(name, readers, plan)
        except CheckpointError as exc:
            raise MergeError(str(exc)) from None
        finally:
            for reader in readers:
                reader.close()

    return info, tensors()


def _merge_one(name: str, readers: list[CheckpointReader],
               plan: Mapping[str, Any] | None) -> np.ndarray:
    """Tensor `name` assembled from the slices the ranks hold."""
    full: np.ndarray | None = None
    filled: np.ndarray | None = None
    for r, reader in enumerate(readers):
        if name not in reader.meta["arrays"]:
            continue
        value = reader.array(name)
        entry = reader.meta["layouts"][name]
        _check_plan_layout(plan, name, entry)
        layout = _layout(entry)
        if full is None or filled is None:
            full = np.zeros(layout.shape, value.dtype)
            filled = np.zeros(layout.shape, bool)
        if not value.shape:  # a scalar (step counters): every rank holds it
            if filled.all() and not np.array_equal(full, value):
                raise MergeError(f"{name}: rank {r}'s value differs from another rank's")
            full[...] = value
            filled[...] = True
            continue
        index = tuple(slice(b, e) for b, e in layout.slice_bounds(r))
        if value.shape != full[index].shape:
            raise MergeError(f"{name}: rank {r} holds shape {value.shape}, its layout gives "
                             f"{full[index].shape}")
        seen = filled[index]
        if seen.any() and not np.array_equal(full[index][seen], value[seen]):
            raise MergeError(f"{name}: rank {r}'s replica differs from another rank's")
        full[index] = value
        filled[index] = True
    assert full is not None and filled is not None
    if not filled.all():
        raise MergeError(f"{name}: some elements are held by no rank")
    return full


def _np_dtype(name: Any) -> np.dtype:
    from pcompile.ir.types import DType

    try:
        return DType[name].np if name in DType.__members__ else np.dtype(name)
    except TypeError:
        raise MergeError(f"a layout names the dtype {name!r}") from None


_PLAN_LINE = re.compile(r"^PLAN_ID = '([0-9A-Za-z_-]*)'$", re.MULTILINE)


def folder_plan_id(out_dir: str) -> str | None:
    """The plan id of the compile in `out_dir` (the `PLAN_ID` line of its program.py, read as
    text), or None when it holds no rank program."""
    candidates = [os.path.join(out_dir, "program.py")]
    try:
        candidates += [os.path.join(out_dir, d, "program.py") for d in sorted(
            os.listdir(out_dir), key=lambda d: (len(d), d)) if re.fullmatch(r"rank_\d+", d)]
    except OSError:
        return None
    for path in candidates:
        try:
            with open(path, encoding="utf-8") as f:
                m = _PLAN_LINE.search(f.read(200_000))
        except (OSError, UnicodeDecodeError):
            continue
        if m:
            return m.group(1)
    return None


def _plan_mismatch(folder: str, found: Any, plan_id: str, out_dir: str) -> str:
    return (f"the checkpoints in {folder} were written by plan {found}, but {out_dir} now "
            f"holds plan {plan_id} (another model, or the model compiled again with other "
            "options); merge them against the compile that trained them (recompile that "
            "model and options into its own --out), or name the right checkpoints with "
            "--checkpoint-dir")


def _check_plan_id(folder: str, plan_id: str, out_dir: str) -> None:
    """One message when no checkpoint in `folder` belongs to the folder's plan."""
    found: list[str] = []
    for step in rank_steps(folder, 0):
        path = checkpoint_path(folder, 0, step)
        try:
            if path.endswith(".json"):
                with open(path, encoding="utf-8") as f:
                    meta = json.load(f)
            else:
                with CheckpointReader(path, 0) as reader:
                    meta = reader.meta
        except (OSError, ValueError, CheckpointError):
            continue
        if isinstance(meta, dict):
            if meta.get("plan_id") == plan_id:
                return
            found.append(str(meta.get("plan_id")))
    if found:
        raise MergeError(_plan_mismatch(folder, found[-1], plan_id, out_dir))


def _count_ranks(folder: str) -> int:
    ranks = [int(m.group(1)) for name in os.listdir(folder)
             if (m := re.match(r"^rank_(\d+)$", name))] if os.path.isdir(folder) else []
    if not ranks:
        raise MergeError(f"no rank checkpoints in {folder}")
    return max(ranks) + 1


def _check_plan_layout(plan: Mapping[str, Any] | None, name: str,
                       entry: Mapping[str, Any]) -> None:
    if not plan:
        return
    stored = dict(plan.get("parameters", {}).get(name) or {})
    shard = (plan.get("parallel_optimizer") or {}).get(name)
    if shard:  # the parallel optimizer stores the parameter split further
        stored["dev_matrix"] = shard["stored_dev_matrix"]
        stored["tensor_map"] = shard["stored_tensor_map"]
    if not stored or stored.get("kind") == "input":
        return
    if list(stored["shape"]) != list(entry["shape"]) or (
            _layout(entry) != _layout({"shape": stored["shape"],
                                       "dev_matrix": stored["dev_matrix"],
                                       "tensor_map": stored["tensor_map"]})):
        raise MergeError(f"{name}: the checkpoint's layout differs from plan.json's")


def _is_merge_output(path: str) -> bool:
    """Whether `path` is an .npz an earlier pcompile-merge wrote (its `__meta__` names a plan)."""
    try:
        with LazyNpz(path) as npz:
            meta = json.loads(str(npz.get(META_KEY))) if META_KEY in npz.files else None
    except Exception:  # noqa: BLE001  (anything unreadable is not ours)
        return False
    return isinstance(meta, dict) and "plan_id" in meta and "num_ranks" in meta


def merge_command() -> Any:
    """`pcompile-merge`'s command line (click, as `pcompile`'s)."""
    import click

    return click.Command(
        "pcompile-merge",
        help="Merge the per-rank checkpoints of a pcompile run into full tensors (safetensors, "
             "with the model's parameter names).",
        params=[
            click.Argument(["out_dir"]),
            click.Option(["--step"], type=int, default=None,
                         help="which step (default: the newest one every rank holds intact)"),
            click.Option(["--checkpoint-dir"], default=None,
                         help="where the rank checkpoints are (default OUT_DIR/checkpoints)"),
            click.Option(["--output"], default=None,
                         help="FILE.safetensors (one file), FILE.npz (pcompile's older format) "
                              "or a folder (model.safetensors, or shards and "
                              "model.safetensors.index.json); default "
                              "OUT_DIR/merged_step_<S>.safetensors, or the folder "
                              "OUT_DIR/merged_step_<S>/ when sharded"),
            click.Option(["--max-shard-size"], default=None,
                         help="largest shard of a folder output (e.g. 5GB, 500MB, 2GiB; default "
                              "5GB, Hugging Face's)"),
            click.Option(["--weights-only"], is_flag=True,
                         help="only the model's weights (plan.json kind 'weight'), not the "
                              "optimizer state"),
        ])


def _parse_merge_args(argv: list[str] | None) -> Any:
    """The options of `argv` (default sys.argv[1:]); --help and a usage error print and exit
    (status 0 and 2)."""
    import types

    import click

    try:
        with merge_command().make_context(
                "pcompile-merge", list(sys.argv[1:] if argv is None else argv)) as ctx:
            return types.SimpleNamespace(**ctx.params)
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None


def main(argv: list[str] | None = None) -> int:
    """`pcompile-merge OUT_DIR [--step S] [--output PATH] [--max-shard-size SIZE]
    [--weights-only]`."""
    from pcompile.backends.merge_output import DEFAULT_MAX_SHARD, parse_size

    args = _parse_merge_args(argv)
    try:
        max_shard = (parse_size(args.max_shard_size) if args.max_shard_size is not None
                     else DEFAULT_MAX_SHARD)
    except ValueError as exc:
        print(f"pcompile-merge: error: --max-shard-size {exc}", file=sys.stderr)
        return 1
    try:
        only = _weights(args.out_dir) if args.weights_only else None
        info, tensors = merged_tensors(args.out_dir, args.step, args.checkpoint_dir, only)
    except (MergeError, CheckpointError, OSError, ValueError, KeyError) as exc:
        print(f"pcompile-merge: error: {exc}", file=sys.stderr)
        return 1
    for line in info.pop("skipped"):
        print(f"pcompile-merge: passed over {line}", file=sys.stderr)
    layouts = info.pop("tensors")
    total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in layouts.values())
    base = os.path.join(args.out_dir, f"merged_step_{info['step']:08d}")
    output = args.output or (base + ".safetensors" if total <= max_shard else base)
    written = {"tensors": 0, "bytes": 0}

    def counted() -> Iterator[tuple[str, np.ndarray]]:
        # one tensor at a time into the output: the merge never holds the whole model
        for name, tensor in tensors:
            written["tensors"] += 1
            written["bytes"] += tensor.nbytes
            yield name, tensor

    try:
        if output.endswith(".npz"):
            if os.path.exists(output) and not _is_merge_output(output):
                raise MergeError(f"{output} exists and is not a file pcompile-merge wrote; "
                                 "name another --output (pcompile never replaces a file it "
                                 "did not write)")

            def with_meta() -> Iterator[tuple[str, np.ndarray]]:
                yield from counted()
                yield META_KEY, np.array(json.dumps(info, sort_keys=True))

            save_npz(output, with_meta())
            files = [output]
        else:
            from pcompile.backends.merge_output import Entry, write_merged

            entries = [Entry(name, dtype, shape) for name, (dtype, shape) in layouts.items()]
            metadata = {k: str(v) for k, v in sorted(info.items())}
            files = write_merged(output, entries, counted(), metadata, max_shard,
                                 folder=not output.endswith(".safetensors"))
    except (MergeError, CheckpointError, ValueError, KeyError) as exc:
        print(f"pcompile-merge: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pcompile-merge: error: cannot write {output}: {exc.strerror}", file=sys.stderr)
        return 1
    where = output if len(files) == 1 else f"{len(files) - 1} shards and {files[-1]}"
    print(f"merged step {info['step']} of {info['num_ranks']} ranks: {written['tensors']} "
          f"tensors, {written['bytes']} bytes -> {where}")
    return 0


def _weights(out_dir: str) -> set[str]:
    """plan.json's weights (what --weights-only keeps: no optimizer state)."""
    from pcompile.compiler.plan import PlanError, read_plan

    if not os.path.exists(os.path.join(out_dir, "plan.json")):
        raise MergeError(f"--weights-only needs {out_dir}/plan.json to tell weights apart")
    try:
        params = read_plan(out_dir).model_dump(mode="json").get("parameters", {})
    except PlanError as exc:
        raise MergeError(str(exc)) from None
    return {n for n, p in params.items() if (p or {}).get("kind") == "weight"}


if __name__ == "__main__":
    sys.exit(main())
