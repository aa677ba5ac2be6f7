"""Per-rank checkpoints (sliced parameters and optimizer state) in safetensors with a JSON index:
the files on disk, their atomic write, their verified read, the pruning of old ones, and the
step a run resumes from.

Layout on disk (see docs/running.md):

    <out>/checkpoints/rank_<r>/step_<SSSSSSSS>.safetensors   rank r's tensors after step S
    <out>/checkpoints/rank_<r>/step_<SSSSSSSS>.json          its index
    <out>/checkpoints/rank_<r>/run_<id>.log                  rank r's train.log lines of run <id>

The `.safetensors` file holds rank r's slice of every stored tensor (weights and optimizer state,
keyed by graph-parameter name), in the tensors' own dtypes (bfloat16 as BF16), readable by any
safetensors reader; its own metadata says what it holds (`file_metadata`: step, rank, number of
ranks, plan, run, and each slice's global shape, offsets and layout under `pcompile.slices`), so
that the file opened alone is not mistaken for full tensors (`slice_places` reads it; reading
checks it against the index). The index is JSON: format (`pcompile-checkpoint/2`), the
tensors' file and size, step, epoch, step in epoch, rank, number of ranks, plan id, the run
that wrote it (`run`, an id, and `written`, the time), how many train.log lines the step had
and their sha256
(`log_lines`, `log_sha256`: the lines themselves are appended once to the run's log beside it,
so an index has the same size at step 10 and at step 10^6), every tensor's layout (global
shape, dtype, device matrix, tensor map), so that merging needs nothing else (plan.json's
parameter layouts are cross-checked when present), and a manifest of every tensor (its slice's
shape, dtype and sha256).

Writes are atomic: the tensors go to a temporary name (`.step_<S>.safetensors.tmp-<token>`),
are fsynced and renamed; then the index the same way. The index is written last and is what
makes a step exist, so a write cut short at any point leaves no checkpoint under the final
names, and the previous ones as they were; leftovers (temporary files, tensors without an
index) are removed by the rank's next write. backends/async_checkpoint.py writes them from a
background thread while training goes on.

Pruning (`prune_checkpoints`, after each write) keeps, of the writing run's steps up to the
one written, the newest `keep` and the newest that every rank is known to hold (`complete`: one
rank's failed write never leaves the ranks without a common step); another run's checkpoints
(a fresh run started in a folder that holds an earlier run's) are removed only once the writing
run has a step that every rank holds, and never the other way round.

Reading verifies a checkpoint against its index and layouts: a missing, truncated, empty or
damaged file, an unreadable or malformed index (a field of the wrong type, a step or rank other
than its file name and folder say, a tensor file of another step), a tensor missing, extra or
of another shape, dtype or checksum than its manifest, or not the rank's slice of its layout,
or a run log that no longer holds the step's lines raises `CheckpointError` naming the file and
the fault. `resume_point` picks the newest checkpoint (by the time it was written) that every
rank holds intact from one run, and says which newer ones it passed over and why;
`pcompile-merge` and `--resume` use it. Checkpoints of pcompile before the safetensors format
(`step_<S>.npz`, the index in its `__meta__` member) are still read, verified the same way, and
so are indexes that still carry the train.log lines themselves (`log`).

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
from collections.abc import Callable, Mapping, Sequence
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
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a run's id: also part of its log's file name
_RUN_LOG = re.compile(r"^run_([A-Za-z0-9_-]{1,64})\.log$")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def run_log_path(folder: str, rank: int, run: str) -> str:
    """Rank `rank`'s train.log lines of run `run`, appended by each of its checkpoints."""
    return os.path.join(folder, f"rank_{rank}", f"run_{run}.log")


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
    """What `write_checkpoint` wrote: the index, the bytes of both files, the seconds; and the
    steps of other runs that its pruning removed (this run now has a step on every rank)."""

    path: str
    nbytes: int
    seconds: float
    superseded: list[int] = field(default_factory=list)


def write_checkpoint(folder: str, rank: int, step: int, values: Mapping[str, np.ndarray],
                     meta: dict[str, Any], keep: int = 2) -> str:
    """Rank `rank`'s checkpoint after `step` (atomic; module docstring); keeps the newest
    `keep` steps per rank. The index gets `meta` and a manifest of every tensor (shape, dtype,
    sha256) that `read_checkpoint` verifies. Returns the index's path."""
    return write_checkpoint_report(folder, rank, step, values, meta, keep).path


def write_checkpoint_report(folder: str, rank: int, step: int,
                            values: Mapping[str, np.ndarray], meta: dict[str, Any],
                            keep: int | None = 2,
                            before_rename: Callable[[], object] | None = None,
                            complete: int | None = None) -> WriteReport:
    """`write_checkpoint`, saying how many bytes it wrote and how long it took. Any failure
    (a full disk...) raises before the index exists: the step is not there, the previous
    steps are untouched. `complete`: the newest step of this run (`meta["run"]`) that every
    rank is known to hold; pruning keeps it, and removes other runs' checkpoints only when it
    is given (module docstring). `keep=None`: no pruning (the caller prunes with
    `prune_checkpoints`)."""
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
        header = file_metadata(step, rank, meta, arrays)
        atomic_fill(data_path, lambda tmp: save_file(arrays, tmp, metadata=header),
                    before_rename)
        manifest = {k: {"shape": list(a.shape), "dtype": a.dtype.name,
                        "sha256": digests[k].result()} for k, a in arrays.items()}
    index = dict(meta)
    index.update(format=FORMAT, file=os.path.basename(data_path),
                 bytes=os.path.getsize(data_path), arrays=manifest)
    text = json.dumps(index, sort_keys=True)
    atomic_write_text(index_path, text)
    _sync_folder(os.path.dirname(index_path))
    run = meta.get("run")
    superseded = [] if keep is None else prune_checkpoints(
        folder, rank, step, keep, run if isinstance(run, str) else None, complete)
    nbytes = index["bytes"] + len(text.encode())
    return WriteReport(index_path, nbytes, time.perf_counter() - start, superseded)


SLICES_KEY = "pcompile.slices"  # the tensor file's own metadata: where each slice sits


def file_metadata(step: int, rank: int, meta: Mapping[str, Any],
                  arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """The `.safetensors` file's own metadata (strings, as safetensors stores them): format,
    step, rank, number of ranks, plan and run, and under `pcompile.slices` (JSON) the place of
    every tensor's slice in its global tensor (`global_shape`, `offsets`: the slice's first
    index along each dim, `dev_matrix` and `tensor_map` of its layout), so that the file opened
    alone says what it holds: rank r's `slice_shape` block at `offsets` of a `global_shape`
    tensor, not a full tensor of that shape."""
    header = {"format": FORMAT, "step": str(step), "rank": str(rank)}
    for key in ("num_ranks", "plan_id", "run"):
        if meta.get(key) is not None:
            header[key] = str(meta[key])
    layouts = meta.get("layouts")
    if isinstance(layouts, Mapping):
        places = {}
        for name, array in arrays.items():
            entry = layouts.get(name)
            if entry is None or _layout_problem(entry):
                continue
            try:
                bounds = entry_layout(entry).slice_bounds(rank)
            except Exception:  # noqa: BLE001  (a rank outside the layout's devices)
                continue
            places[name] = {"global_shape": list(entry["shape"]),
                            "offsets": [lo for lo, _ in bounds],
                            "slice_shape": list(array.shape),
                            "dev_matrix": list(entry["dev_matrix"]),
                            "tensor_map": list(entry["tensor_map"])}
        header[SLICES_KEY] = json.dumps(places, sort_keys=True, separators=(",", ":"))
    return header


def slice_places(path: str) -> dict[str, dict[str, Any]]:
    """The places a `.safetensors` checkpoint file gives its slices (`file_metadata`), read
    from the file alone: {name: {global_shape, offsets, slice_shape, dev_matrix, tensor_map}};
    {} for a file written before they were recorded. A file that is no safetensors file, or
    whose record is not JSON, raises CheckpointError."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as f:
            header = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001  (SafetensorError or OSError)
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
    return _places(path, header)


def _places(path: str, header: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    text = header.get(SLICES_KEY)
    if text is None:
        return {}
    try:
        places = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path}: its {SLICES_KEY} metadata is not JSON ({exc})") from None
    if not isinstance(places, dict) or not all(isinstance(v, dict) for v in places.values()):
        raise CheckpointError(f"{path}: its {SLICES_KEY} metadata is not a table of slices")
    return places


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


def index_run(path: str) -> str | None:
    """The run that wrote the checkpoint at `path` (None: written before runs had ids, or an
    index that cannot be read: `read_checkpoint` says why)."""
    header = _index_header(path)
    run = header.get("run")
    return run if isinstance(run, str) else None


def _index_header(path: str) -> dict[str, Any]:
    """A JSON index's fields as they are, unverified ({} for an .npz or an unreadable one)."""
    if not path.endswith(".json"):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def run_steps(folder: str, rank: int) -> dict[int, str | None]:
    """Rank `rank`'s steps and the run that wrote each (`index_run`)."""
    return {step: index_run(checkpoint_path(folder, rank, step))
            for step in rank_steps(folder, rank)}


def prune_checkpoints(folder: str, rank: int, current: int, keep: int, run: str | None,
                      complete: int | None) -> list[int]:
    """After rank `rank` wrote step `current` of `run`: keep, of this run's steps up to
    `current`, the newest `keep` and `complete` (the newest that every rank holds); remove the
    older ones, and other runs' steps once `complete` is known (returned); remove tensors that
    no index names (a write cut short between its two renames) and the logs of runs with no
    checkpoint left. An index goes before its tensors, so a half-removed step is never taken
    for a checkpoint. Steps of this run after `current` (written before a resume from an
    earlier step) stay: the resumed run writes them again as it reaches them."""
    d = os.path.join(folder, f"rank_{rank}")
    runs = run_steps(folder, rank)
    mine = sorted(s for s, r in runs.items() if r == run and s <= current)
    old = set(mine[:-keep]) if keep > 0 else set()  # keep=0: all of them
    if complete is not None:  # (a step resumed from an older pcompile's has no run: kept too)
        old.update(s for s, r in runs.items() if r != run)
    old -= {current, complete}
    others = sorted(s for s in old if runs[s] != run)
    for name in sorted(os.listdir(d)):
        m = _STEP_FILE.match(name)
        if m and int(m.group(1)) in old:
            try_unlink(os.path.join(d, name))
    left = {r for s, r in runs.items() if s not in old}
    for name in sorted(os.listdir(d)):
        m = _DATA_FILE.match(name)
        if m and int(m.group(1)) != current and not os.path.exists(
                os.path.join(d, name[:-len(".safetensors")] + ".json")):
            try_unlink(os.path.join(d, name))
        log = _RUN_LOG.match(name)
        if log and log.group(1) != run and log.group(1) not in left:
            try_unlink(os.path.join(d, name))
    return others


def append_run_log(folder: str, rank: int, run: str, lines: Sequence[str]) -> None:
    """Append `lines` to rank `rank`'s log of run `run` and fsync it."""
    if not lines:
        return
    path = run_log_path(folder, rank, run)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def restart_run_log(folder: str, rank: int, run: str, lines: Sequence[str]) -> None:
    """Rank `rank`'s log of run `run` made to hold exactly `lines` (a resumed run: the lines up
    to its step; later ones are written again), atomically; with no lines, no file (a fresh
    run's appears with its first checkpoint)."""
    path = run_log_path(folder, rank, run)
    if not lines:
        try_unlink(path)
        return
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def log_digest(lines: Sequence[str]) -> Any:
    """The running sha256 of train.log lines (`log_sha256` of an index): update it with
    `add_log_lines`."""
    digest = hashlib.sha256()
    add_log_lines(digest, lines)
    return digest


def add_log_lines(digest: Any, lines: Sequence[str]) -> None:
    for line in lines:
        digest.update((line + "\n").encode())


def checkpoint_log(path: str, meta: Mapping[str, Any]) -> list[str]:
    """The train.log lines of the checkpoint at `path` (read with its `meta`): from the run's
    log beside it, checked against the index's count and sha256 (`CheckpointError` when it
    holds fewer lines or others), or, from an older index, the lines it carries."""
    if "log_lines" not in meta:
        return list(meta.get("log") or [])
    count, want = meta["log_lines"], meta["log_sha256"]
    log = run_log_path(os.path.dirname(os.path.dirname(path)), int(meta["rank"]), meta["run"])
    lines: list[str] = []
    try:
        if count:
            _regular_size(log)
            with open(log, encoding="utf-8", newline="\n") as f:
                for line in f:
                    if len(lines) == count:
                        break
                    lines.append(line[:-1] if line.endswith("\n") else line)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{log}: cannot read it ({exc})") from None
    if len(lines) < count:
        raise CheckpointError(f"{log} holds {len(lines)} train.log lines, the checkpoint of "
                              f"step {meta['step']} ({path}) needs {count}")
    if log_digest(lines).hexdigest() != want:
        raise CheckpointError(f"{log}: its first {count} lines are not the train.log of the "
                              f"checkpoint of step {meta['step']} ({path}): changed or damaged")
    return lines


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
            stored = self._file.metadata() or {}
        except Exception as exc:  # noqa: BLE001  (SafetensorError or OSError)
            raise CheckpointError(f"{self.data} is truncated or damaged ({exc})") from None
        self.stored = stored  # what the tensor file itself says it is (step, rank)
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
        for key in ("step", "epoch", "step_in_epoch", "num_ranks", "rank", "log_lines"):
            value = meta.get(key)
            if value is not None and not _count(value):
                raise CheckpointError(f"{path}: its metadata's {key} is {value!r}, not a "
                                      "non-negative integer (damaged, or written by another "
                                      "tool)")
        problem = _place_problem(path, meta, self.rank) or _fields_problem(meta)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
        if isinstance(self._source, _SafetensorsTensors):
            own = os.path.basename(tensors_path(path))
            named = os.path.basename(self._source.data)
            if named != own and _STEP_FILE.match(os.path.basename(path)):
                raise CheckpointError(f"{path}: the index names the tensor file {named}, not "
                                      f"its own {own} (an index moved or copied from another "
                                      "step)")
        stored = getattr(self._source, "stored", {})
        for key in ("step", "rank", "num_ranks", "plan_id", "run"):
            if key in stored and key in meta and stored[key] != str(meta[key]):
                raise CheckpointError(f"{path}: its tensor file holds the tensors of {key} "
                                      f"{stored[key]}, the index says {key} {meta[key]}")
        data = getattr(self._source, "data", path)
        problem = _places_problem(_places(data, stored) if stored else {}, meta)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
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


def _places_problem(places: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    """Where the tensor file's own record of its slices (`file_metadata`) disagrees with the
    index's layouts ('' when they agree, or the file has no record). A slice whose shape is not
    the one the index's layout gives the rank is left to the array's own check, which names
    the shapes."""
    layouts = meta.get("layouts") or {}
    rank = meta.get("rank")
    if not isinstance(rank, int) or not _count(rank) or not isinstance(layouts, Mapping):
        return ""
    for name, place in sorted(places.items()):
        entry = layouts.get(name)
        if not isinstance(entry, Mapping):
            return f"its tensor file places a slice of {name}, which the index has no layout of"
        if _layout_problem(entry):
            continue  # the index's own checks name it
        try:
            bounds = entry_layout(entry).slice_bounds(rank)
        except Exception:  # noqa: BLE001
            continue
        if place.get("slice_shape") != [hi - lo for lo, hi in bounds]:
            continue
        offsets = [lo for lo, _ in bounds]
        if (place.get("global_shape") != entry.get("shape")
                or place.get("dev_matrix") != entry.get("dev_matrix")
                or place.get("tensor_map") != entry.get("tensor_map")):
            return (f"its tensor file says {name} is a slice of a {place.get('global_shape')} "
                    f"tensor laid out as {place.get('dev_matrix')}/{place.get('tensor_map')}, "
                    f"the index says {entry.get('shape')} as {entry.get('dev_matrix')}/"
                    f"{entry.get('tensor_map')}")
        if place.get("offsets") != offsets:
            return (f"its tensor file places {name}'s slice at offsets {place.get('offsets')}, "
                    f"rank {rank}'s slice of the index's layout is at {offsets}")
    return ""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _place_problem(path: str, meta: Mapping[str, Any], rank: int | None) -> str:
    """Whether the index is the one its file name and folder say (`step_<S>` in `rank_<r>`):
    an index of another step or rank put in its place is not taken for it."""
    named = _STEP_FILE.match(os.path.basename(path))
    if named and meta.get("step") is not None and meta["step"] != int(named.group(1)):
        return (f"the index is of step {meta['step']}, its file name says step "
                f"{int(named.group(1))} (an index moved or copied from another step)")
    folder = re.fullmatch(r"rank_(\d+)", os.path.basename(os.path.dirname(path)))
    where = rank if rank is not None else (int(folder.group(1)) if folder else None)
    if where is not None and meta.get("rank") is not None and meta["rank"] != where:
        return (f"the index is rank {meta['rank']}'s, but it is in rank {where}'s place (an "
                "index moved or copied from another rank)")
    if meta.get("num_ranks") is not None and where is not None and where >= meta["num_ranks"]:
        return f"rank {where} is not one of its {meta['num_ranks']} ranks"
    return ""


def _fields_problem(meta: Mapping[str, Any]) -> str:
    """What is malformed in an index's fields beyond the manifest (a hand-edited or crafted
    index that is valid JSON): the run, the log, the layouts."""
    run = meta.get("run")
    if run is not None and not (isinstance(run, str) and RUN_ID.fullmatch(run)):
        return f"its run id {run!r} is not 1 to 64 letters, digits, '-' or '_'"
    written = meta.get("written")
    if written is not None and (isinstance(written, bool)
                                or not isinstance(written, (int, float))):
        return f"its time of writing {written!r} is not a number"
    if "log_lines" in meta:
        if not _count(meta["log_lines"]):
            return f"its log_lines {meta['log_lines']!r} is not a non-negative integer"
        if not (isinstance(meta.get("log_sha256"), str) and _SHA256.fullmatch(meta["log_sha256"])):
            return f"its log_sha256 {meta.get('log_sha256')!r} is not a sha256 in hex"
        if run is None or meta.get("rank") is None:
            return "it counts train.log lines (log_lines) but names no run or rank"
    log = meta.get("log")
    if log is not None and not (isinstance(log, list) and all(isinstance(x, str) for x in log)):
        return f"its train.log lines (log) are {type(log).__name__}, not a list of strings"
    for name, entry in meta["layouts"].items():
        why = _layout_problem(entry)
        if why:
            return f"the layout of {name} is malformed ({why})"
    return ""


def _np_dtype(name: str) -> Any:
    """The numpy dtype of a layout's dtype name (ir.types.DType's), or None."""
    from pcompile.ir.types import DType

    try:
        return DType.from_any(name).np
    except (TypeError, ValueError, KeyError):
        return None


def _layout_problem(entry: Any) -> str:
    """Why a layout's JSON form (`layout_entry`) is malformed ('' if it is not)."""
    if not isinstance(entry, dict):
        return f"{type(entry).__name__}, not an object"
    shape, dev, tmap = entry.get("shape"), entry.get("dev_matrix"), entry.get("tensor_map")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        return f"shape {shape!r} is not a list of non-negative integers"
    if not (isinstance(dev, list) and dev and all(_count(d) and d > 0 for d in dev)):
        return f"device matrix {dev!r} is not a list of positive integers"
    if not (isinstance(tmap, list) and len(tmap) == len(shape)):
        return f"tensor map {tmap!r} does not have one entry per dim of {shape}"
    for e in tmap:
        axes = e if isinstance(e, list) else [e]
        if not all(isinstance(a, int) and not isinstance(a, bool) and -1 <= a < len(dev)
                   for a in axes):
            return f"tensor map {tmap!r} names an axis outside the device matrix {dev}"
    if not (isinstance(entry.get("dtype"), str) and _np_dtype(entry["dtype"]) is not None):
        return f"dtype {entry.get('dtype')!r} is not a dtype"
    try:
        entry_layout(entry)
    except Exception as exc:  # noqa: BLE001  (the layout model's own checks)
        return str(exc)
    return ""


def program_problem(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], rank: int,
                    expected: Mapping[str, Mapping[str, Any]]) -> str:
    """Why a checkpoint of rank `rank` (its verified `meta` and `arrays`) does not fit the
    program that resumes from it ('' if it does): `expected` is the program's layout entry
    (`layout_entry`) of every value the rank holds; each must be in the checkpoint with that
    layout and dtype, its tensor the rank's slice."""
    for name, want in expected.items():
        got = meta["layouts"].get(name)
        if got is None or name not in arrays:
            return f"it holds no {name}"
        for key in ("shape", "dtype", "dev_matrix", "tensor_map"):
            if got.get(key) != want[key]:
                return (f"{name} has {key.replace('_', ' ')} {got.get(key)} in the checkpoint, "
                        f"{want[key]} in this program")
        bounds = entry_layout(want).slice_bounds(rank)
        shape = tuple(e - b for b, e in bounds)
        array = arrays[name]
        if tuple(array.shape) != shape and not (shape == () and array.size == 1):
            return (f"{name} is stored with shape {tuple(array.shape)}, rank {rank}'s "
                    f"slice of its layout is {shape}")
        if array.dtype != _np_dtype(want["dtype"]):
            return f"{name} is stored as {array.dtype}, this program holds {want['dtype']}"
    return ""


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
    if rank is not None and layout is not None:
        try:
            want = tuple(e - b for b, e in entry_layout(layout).slice_bounds(rank))
        except Exception as exc:  # noqa: BLE001  (malformed layout metadata)
            return f"the layout of {name} is malformed ({exc})"
        if tuple(array.shape) != want and not (want == () and array.size == 1):
            return f"{name} has shape {tuple(array.shape)}, rank {rank}'s slice is {want}"
    return ""


def checkpoint_problem(path: str, rank: int, plan_id: str | None = None) -> str:
    """Why rank `rank`'s checkpoint at `path` cannot be resumed from ('' if it can): its files
    and index (`CheckpointReader`), its train.log lines (`checkpoint_log`), its plan."""
    if not os.path.exists(path):
        return "no checkpoint"
    try:
        with CheckpointReader(path, rank) as reader:
            reader.arrays(keep=False)  # verified a few arrays at a time, none kept
            meta = reader.meta
        checkpoint_log(path, meta)
    except CheckpointError as exc:
        return str(exc)
    if plan_id is not None and meta.get("plan_id") != plan_id:
        return (f"{path} was written by plan {meta.get('plan_id')}, this program is plan "
                f"{plan_id}")
    return ""


@dataclass
class ResumePoint:
    """The newest step that every rank holds intact (None: none), the run that wrote it, and
    why newer ones were passed over."""

    step: int | None
    skipped: list[str] = field(default_factory=list)
    run: str | None = None


def resume_point(folder: str, num_ranks: int, plan_id: str | None = None) -> ResumePoint:
    """The newest checkpoint (by the time it was written; by step for checkpoints that do not
    say) for which every rank's checkpoint reads back intact (verified) and all of them were
    written by one run, with a line per newer step that was passed over (which rank, what is
    wrong)."""
    steps: set[int] = set()
    for r in range(num_ranks):
        steps.update(rank_steps(folder, r))
    order = []
    for step in steps:
        heads = [_index_header(checkpoint_path(folder, r, step)) for r in range(num_ranks)]
        times = [h["written"] for h in heads if isinstance(h.get("written"), (int, float))
                 and not isinstance(h.get("written"), bool)]
        order.append((max(times, default=0.0), step))
    point = ResumePoint(None)
    for _, step in sorted(order, reverse=True):
        problems = [f"rank {r}: {why}" for r in range(num_ranks)
                    if (why := checkpoint_problem(checkpoint_path(folder, r, step), r, plan_id))]
        runs = [index_run(checkpoint_path(folder, r, step)) for r in range(num_ranks)]
        if not problems and len(set(runs)) > 1:
            problems = ["its ranks' checkpoints are of different runs (" + ", ".join(
                f"rank {r}: {run or 'no run id'}" for r, run in enumerate(runs)) + ")"]
        if not problems:
            point.step, point.run = step, runs[0]
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
            if (_STEP_FILE.match(f) or _DATA_FILE.match(f) or _RUN_LOG.match(f)
                    or TEMP_FILE.fullmatch(f)):
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
