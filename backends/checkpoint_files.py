"""Per-rank checkpoints (sliced parameters and optimizer state) in safetensors with a JSON index:
the files on disk, their atomic write, their verified read, and the step a run resumes from.

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

backends/checkpoint_merge.py (`pcompile-merge`) reassembles full tensors from the ranks' slices.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import zipfile
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pcompile.backends.atomic_files import (
    TEMP_FILE,
    atomic_fill,
    atomic_write_text,
    clean_temp_files,
    try_unlink,
)
from pcompile.backends.npz_files import LazyNpz

if TYPE_CHECKING:
    from safetensors import safe_open

META_KEY = "__meta__"
FORMAT = "pcompile-checkpoint/2"
_STEP_FILE = re.compile(r"^step_(\d+)\.(json|npz)$")  # an index, or a checkpoint before format 2
_DATA_FILE = re.compile(r"^step_(\d+)\.safetensors$")


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


def hash_threads() -> int:
    """Threads that hash a checkpoint's tensors (sha256 releases the GIL): half the cores, 2 to
    8."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


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
    # hash (sha256 releases the GIL) while safetensors writes (threads inherit the caller's nice)
    with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
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
            try_unlink(os.path.join(d, name))
    for name in sorted(os.listdir(d)):
        m = _DATA_FILE.match(name)
        if m and int(m.group(1)) != current and not os.path.exists(
                os.path.join(d, name[:-len(".safetensors")] + ".json")):
            try_unlink(os.path.join(d, name))


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
        value = self._read(name)
        self._raise(self._problem(name, value))
        assert value is not None
        return value

    def arrays(self, keep: bool = True) -> dict[str, np.ndarray]:
        """Every array, each checked as `array` does: read one after the other while a pool of
        threads hashes the ones read (`hash_threads`). The first fault in name order raises.
        `keep=False` verifies only: it holds a few arrays at a time and returns nothing."""
        out: dict[str, np.ndarray] = {}
        window = 2 * hash_threads()
        pending: deque[tuple[str, np.ndarray | None, Future[str]]] = deque()

        def settle() -> None:
            name, value, problem = pending.popleft()
            self._raise(problem.result())
            if keep:
                assert value is not None
                out[name] = value

        with ThreadPoolExecutor(max_workers=hash_threads()) as pool:
            for name in self.names:
                try:
                    value = self._read(name)
                except CheckpointError:  # the faults of the arrays before it come first
                    while pending:
                        settle()
                    raise
                pending.append((name, value, pool.submit(self._problem, name, value)))
                if len(pending) > window:
                    settle()
            while pending:
                settle()
        return out

    def _read(self, name: str) -> np.ndarray | None:
        return self._source.get(name) if name in self._source.names else None

    def _problem(self, name: str, value: np.ndarray | None) -> str:
        return _array_problem(name, value, self.meta["arrays"].get(name),
                              self.meta["layouts"].get(name), self.rank)

    def _raise(self, problem: str) -> None:
        if problem:
            raise CheckpointError(f"{self.path}: {problem}")

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
        return reader.arrays(), reader.meta


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
            want = tuple(e - b for b, e in entry_layout(layout).slice_bounds(rank))
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
            reader.arrays(keep=False)  # verified a few arrays at a time, none kept
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
            if _STEP_FILE.match(f) or _DATA_FILE.match(f) or TEMP_FILE.fullmatch(f):
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


def entry_layout(entry: Mapping[str, Any]) -> Any:
    from pcompile.ir.layout import TensorLayout

    tmap = tuple(tuple(e) if isinstance(e, list) else e for e in entry["tensor_map"])
    return TensorLayout(tuple(entry["dev_matrix"]), tmap, tuple(entry["shape"]))
