"""The `--out` folder: what pcompile owns in it, how a compile replaces it, and its lock.

The guarantees (docs/running.md, "The output folder"):

* Every compile writes a manifest, `.pcompile-manifest.json`, listing each file and folder it
  wrote. A later compile replaces exactly what the manifest lists, nothing else.
* Run outputs (what `--run`, the rank programs and `pcompile-merge` write: `rank_<r>/train.log`,
  `rank_<r>/run.log`, `rank_<r>/outputs.npz`, `launch.json`, `metrics.jsonl`,
  `checkpoints/rank_<r>/step_*` (`.safetensors` and `.json`, or an older pcompile's `.npz`)
  and `checkpoints/rank_<r>/run_<id>.log`,
  `merged_step_*.safetensors` (or `.npz`) and the shards and index in `merged_step_*/`;
  `pcompile show`'s pictures `show/*.svg`; the traces of `--profile-steps`,
  `profile/rank_<r>/plugins/profile/<time>/*.xplane.pb` and `*.trace.json.gz`) survive a
  recompile: they are carried into the new
  folder. So do, wherever in the folder they are, TensorBoard's event files
  (`events.out.tfevents.*`, from `--tensorboard DIR/tb`) and what pcompile-merge wrote
  (`.safetensors` files and `model.safetensors.index.json` whose metadata says
  `format: pcompile-merge/1`, from `pcompile-merge DIR --output DIR/hf`). Runs write files,
  never links: a symbolic link at a run output's place is not carried (the launcher would
  otherwise write through it).
* Every compile writes `.gitignore` (`*`) into the folder: git does not track it and ruff (which
  honours .gitignore files inside a git repository) does not lint its rank programs, wherever
  `--out` is in a clone.
* Except `pcompile show`'s own pictures: they draw the plan they were made from, so a
  recompile drops them. `show` lists each picture it writes, with its digest, in
  `show/.pcompile-show.json`; a recompile removes exactly the pictures listed there whose
  content is still what `show` wrote (and that list); any other file in `show/` is carried.
* Anything else in the folder is foreign: the compile refuses, naming it, and changes nothing.
  A non-empty folder without a manifest is entirely foreign.
* A compile writes into a staging folder beside `--out` (`.<name>.pcompile-new-<id>`) and swaps
  it in with two renames, so a failed or killed compile leaves `--out` as it was. The next
  compile into the same `--out` removes a killed compile's staging folder (or finishes its swap)
  when it carries pcompile's mark (`.pcompile-staging` while incomplete, then its manifest); a
  folder of the same name without either is the user's and stays.
* One pcompile at a time per `--out`: the lock `.<name>.pcompile-lock` beside it (an advisory
  `flock`, released by the kernel when its holder dies), held by a compile while it writes and by
  `--run` from the compile to the end of the run.

`write_output_folder(out)` is the one entry point of the driver; `out_lock(out)` is re-entrant
within a process, so the CLI can hold it across compile and run.
"""

from __future__ import annotations

import errno
import fcntl
import filecmp
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pcompile.ir.errors import PcompileError

MANIFEST = ".pcompile-manifest.json"
MANIFEST_FORMAT = "pcompile-output-folder/1"
_STAGING_MARK = ".pcompile-staging"  # present while a staging folder is incomplete

# Files that runs write into the folder (relative, '/'-separated), and the folders holding them.
_RUN_OUTPUT = re.compile(
    r"launch\.json|metrics\.jsonl|merged_step_\d+\.(?:npz|safetensors)"
    r"|merged_step_\d+/(?:model(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json)"
    r"|rank_\d+/(?:train\.log|run\.log|outputs\.npz)"
    r"|checkpoints/rank_\d+/(?:step_\d+\.(?:safetensors|json|npz)|run_[A-Za-z0-9_-]{1,64}\.log)"
    r"|show/[A-Za-z0-9._-]+\.svg"
    r"|show/\.pcompile-show\.json"
    r"|profile/rank_\d+/plugins/profile/[0-9_]+/[A-Za-z0-9._-]+\.(?:xplane\.pb|trace\.json\.gz)"
)
_RUN_FOLDER = re.compile(r"rank_\d+|checkpoints|checkpoints/rank_\d+|show|merged_step_\d+"
                         r"|profile(?:/rank_\d+(?:/plugins(?:/profile(?:/[0-9_]+)?)?)?)?")
# A temporary file of an atomic write (backends/atomic_files.py `atomic_write_bytes`) that was
# killed before its rename: `.<name>.tmp-<token>` next to `<name>`.
_TEMP = re.compile(r"(?P<dir>(?:[^/]+/)*)\.(?P<name>[^/]+)\.tmp-[A-Za-z0-9_]+")
# safetensors' own temporary file (Rust's tempfile) of a checkpoint write that was killed
_SAFETENSORS_TEMP = re.compile(r"checkpoints/rank_\d+/\.tmp[A-Za-z0-9]{6}")
# TensorBoard's event files (tensorboardX's name), wherever --tensorboard put them in the folder
_BOARD_FILE = re.compile(r"(?:[^/]+/)*events\.out\.tfevents\.[^/]+")
MERGE_FORMAT = "pcompile-merge/1"  # the metadata `format` of what pcompile-merge writes
MERGE_INDEX = "model.safetensors.index.json"
IGNORE_FILE = ".gitignore"
IGNORE_TEXT = ("# Written by pcompile: this output folder is generated (the rank programs, dumps, "
               "run outputs).\n# Neither git nor ruff looks inside it.\n*\n")
SHOWN = 8  # foreign entries named in a message
SHOW_LIST = "show/.pcompile-show.json"  # the pictures `pcompile show` wrote (and their digests)
_SHOW_FORMAT = "pcompile-show/1"


def is_run_output(rel: str) -> bool:
    """A file that runs write (kept across recompiles)."""
    return _RUN_OUTPUT.fullmatch(rel) is not None


def is_merge_file(path: str) -> bool:
    """Whether `path` is a safetensors file or an index that pcompile-merge wrote (its metadata
    says `format: pcompile-merge/1`; backends/merge_output.py writes them)."""
    try:
        with open(path, "rb") as f:
            if path.endswith(".json"):
                meta = json.load(f).get("metadata", {})
            else:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 * 2**20:
                    return False
                meta = json.loads(f.read(length)).get("__metadata__", {})
    except Exception:  # noqa: BLE001  (anything unreadable is not pcompile-merge's)
        return False
    return isinstance(meta, dict) and meta.get("format") == MERGE_FORMAT


def is_run_file(root: str, rel: str) -> bool:
    """`rel` in the folder `root` is a run output: by its name (`is_run_output`), or, at any
    place, a TensorBoard event file or a file pcompile-merge wrote (not a link)."""
    if is_run_output(rel) or _BOARD_FILE.fullmatch(rel):
        return True
    path = os.path.join(root, rel)
    return (rel.endswith((".safetensors", "/" + MERGE_INDEX)) or rel == MERGE_INDEX) and (
        not os.path.islink(path) and is_merge_file(path))


def is_temp_leftover(rel: str) -> bool:
    """The temporary file of a killed atomic write of a run output (removed by the next run)."""
    if _SAFETENSORS_TEMP.fullmatch(rel):
        return True
    m = _TEMP.fullmatch(rel)
    return m is not None and is_run_output(m.group("dir") + m.group("name"))


# -- pcompile show's pictures -------------------------------------------------------------------


def _digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _read_show_list(out: str) -> dict[str, str]:
    try:
        with open(os.path.join(out, SHOW_LIST), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != _SHOW_FORMAT:
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    return {rel: digest for rel, digest in files.items()
            if isinstance(rel, str) and isinstance(digest, str) and is_run_output(rel)
            and rel.startswith("show/") and rel != SHOW_LIST}


def record_shown(out: str, written: dict[str, bytes]) -> None:
    """Add the pictures `pcompile show` just wrote (relative path -> content) to the list."""
    files = _read_show_list(out)
    files.update({rel: hashlib.sha256(data).hexdigest() for rel, data in written.items()})
    text = json.dumps({"format": _SHOW_FORMAT, "files": dict(sorted(files.items()))},
                      indent=0) + "\n"
    write_file_atomic(os.path.join(out, SHOW_LIST), text.encode("utf-8"))


def shown_pictures(out: str) -> set[str]:
    """The files of `out/show/` that pcompile show wrote and nobody changed since (with the
    list itself): what a recompile drops."""
    listed = _read_show_list(out)
    if not listed:
        return set()
    mine = {rel for rel, digest in listed.items()
            if not os.path.islink(os.path.join(out, rel))
            and _digest(os.path.join(out, rel)) == digest}
    return mine | {SHOW_LIST}


def write_file_atomic(path: str, data: bytes) -> None:
    """Write `path` through a temporary file and a rename: a link at `path` is replaced, never
    written through."""
    folder, name = os.path.split(path)
    temp = os.path.join(folder, f".{name}.tmp-{secrets.token_hex(4)}")
    try:
        with open(temp, "xb") as f:
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        if os.path.lexists(temp):
            os.unlink(temp)
        raise


# -- paths -------------------------------------------------------------------------------------


def resolve(out_dir: str) -> str:
    """The absolute, symlink-free path of an --out value (one clear message when unusable)."""
    if not out_dir or not out_dir.strip():
        raise PcompileError("--out is empty; give the folder to write the dumps and plan into")
    path = os.path.realpath(os.path.expanduser(out_dir))
    if os.path.dirname(path) == path:
        raise PcompileError(f"--out {out_dir!r} is the root folder; give a folder of its own")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PcompileError(f"--out {out_dir!r}: {existing} is a file, not a folder")
    return path


def check_writable_folder(folder: str, flag: str) -> None:
    """A folder a run will create or write into (`--tensorboard DIR`): one PcompileError now
    when it cannot (a file in the way, no permission, a read-only file system). It creates and
    removes a folder in DIR, or in the nearest folder above it that exists; nothing stays."""
    path = os.path.realpath(os.path.expanduser(folder))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PcompileError(f"{flag} {folder}: {existing} is a file, not a folder; give a "
                            "folder the run can create or write in")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pcompile-probe-", dir=existing))
    except OSError as exc:
        raise _os_error(f"write {flag} {folder}: no folder can be made in", existing,
                        exc) from None


def _beside(out: str, kind: str) -> str:
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.pcompile-{kind}")


def lock_path(out: str) -> str:
    return _beside(out, "lock")


def _os_error(what: str, path: str, exc: OSError) -> PcompileError:
    reason = exc.strerror or str(exc)
    hint = " (check its permissions)" if exc.errno in (errno.EACCES, errno.EPERM,
                                                     errno.EROFS) else ""
    return PcompileError(f"cannot {what} {path}: {reason}{hint}")


# -- the lock ----------------------------------------------------------------------------------


@dataclass
class _Held:
    fd: int
    path: str
    depth: int


_HELD: dict[str, _Held] = {}


@contextmanager
def out_lock(out_dir: str) -> Iterator[str]:
    """Hold the lock of `out_dir` (re-entrant in this process); yields the resolved path.
    Another process holding it: one clear `PcompileError` naming that process."""
    out = resolve(out_dir)
    held = _HELD.get(out)
    if held is not None:
        held.depth += 1
    else:
        parent = os.path.dirname(out)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise _os_error("create the folder", parent, exc) from None
        held = _HELD[out] = _Held(_acquire(lock_path(out), out), lock_path(out), 1)
    try:
        yield out
    finally:
        held.depth -= 1
        if held.depth == 0:
            del _HELD[out]
            try:
                os.unlink(held.path)  # while still holding it: see _acquire
            except OSError:
                pass
            os.close(held.fd)


def _acquire(path: str, out: str) -> int:
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            raise _os_error("write beside --out, creating the lock file", path, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise PcompileError(
                f"--out {out} is in use by another pcompile ({holder}); wait for it to finish "
                "or choose another --out") from None
        # The holder before us may have unlinked the file between our open and our flock:
        # then we locked a file nobody else will see; take the one at `path` instead.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if same:
            program = os.path.basename(sys.argv[0]) if sys.argv else "python"
            if program == "__main__.py":
                program = "python -m pcompile"
            command = " ".join([program, *sys.argv[1:]])
            info = f"pid {os.getpid()}: {command}"
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode("utf-8", "replace")[:4000], 0)
            return fd
        os.close(fd)
    raise PcompileError(f"cannot lock --out {out}: the lock file {path} keeps changing")


# -- manifest and foreign files ----------------------------------------------------------------


@dataclass
class Manifest:
    files: list[str]
    folders: list[str]


def _safe_rel(rel: object) -> bool:
    return (isinstance(rel, str) and bool(rel) and not rel.startswith("/")
            and all(part not in ("", ".", "..") for part in rel.split("/")))


def read_manifest(out: str) -> Manifest | None:
    """The folder's manifest; None when there is none or it is not one pcompile wrote."""
    try:
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return None
    files, folders = data.get("files"), data.get("folders")
    if not (isinstance(files, list) and isinstance(folders, list)
            and all(_safe_rel(x) for x in files + folders)):
        return None
    return Manifest(list(files), list(folders))


def _scan(root: str) -> tuple[list[str], list[str]]:
    """(files, folders) under `root`, relative and '/'-separated; links count as files."""
    files: list[str] = []
    folders: list[str] = []

    def walk(path: str, rel: str) -> None:
        with os.scandir(path) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    folders.append(name)
                    walk(entry.path, name + "/")
                else:
                    files.append(name)

    walk(root, "")
    return files, folders


def foreign_entries(out: str) -> list[str]:
    """What in `out` pcompile did not write (folders end in '/')."""
    if not os.path.isdir(out):
        return []
    manifest = read_manifest(out)
    owned = set(manifest.files) if manifest else set()
    owned_folders = set(manifest.folders) if manifest else set()
    files, folders = _scan(out)
    bad = [f for f in files
           if not ((f == MANIFEST and manifest is not None) or f in owned
                   or is_run_file(out, f) or is_temp_leftover(f))]
    for d in folders:
        if d in owned_folders or _RUN_FOLDER.fullmatch(d):
            continue
        if not any(x.startswith(d + "/") for x in files):  # an empty folder nobody listed
            bad.append(d + "/")
    return bad


def check_owned(out: str, shown_as: str) -> None:
    """Refuse a folder that holds anything pcompile did not write, naming it."""
    bad = foreign_entries(out)
    if not bad:
        return
    names = ", ".join(bad[:SHOWN]) + (f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else "")
    why = "" if read_manifest(out) else f" (it has no pcompile manifest {MANIFEST})"
    raise PcompileError(
        f"output folder {shown_as!r} holds files that pcompile did not write{why}: {names}; "
        "pcompile would not delete them: move them away or choose another --out")


# -- replacing the folder ----------------------------------------------------------------------


@contextmanager
def write_output_folder(out_dir: str) -> Iterator[str]:
    """Yield an empty staging folder for a compile's outputs; when the block ends normally,
    it replaces `out_dir` (run outputs carried over, a manifest written). On an exception
    `out_dir` is left as it was."""
    with out_lock(out_dir) as out:
        clean_leftovers(out)
        check_owned(out, out_dir)
        staging = _beside(out, f"new-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(staging, 0o777)  # the user's umask applies
            open(os.path.join(staging, _STAGING_MARK), "wb").close()
            with open(os.path.join(staging, IGNORE_FILE), "w", encoding="utf-8") as f:
                f.write(IGNORE_TEXT)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise _os_error("write beside --out, creating", staging, exc) from None
        try:
            yield staging
            _complete(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        try:
            _swap(staging, out)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise _os_error("replace the output folder", out, exc) from None


def _complete(staging: str, out: str) -> None:
    """Manifest, carried run outputs; then the staging folder is complete (mark removed)."""
    files, folders = _scan(staging)
    files = [f for f in files if f != _STAGING_MARK]
    manifest = {"format": MANIFEST_FORMAT, "files": files, "folders": folders}
    with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=0)
        f.write("\n")
    if os.path.isdir(out):
        old_files, _ = _scan(out)
        dropped = shown_pictures(out)  # they picture the previous plan
        for rel in old_files:
            src = os.path.join(out, rel)
            # A symbolic link is no run output (runs write files): it is not carried over, so
            # that no later run writes through it into a file outside --out.
            if (is_run_file(out, rel) and not os.path.islink(src) and rel not in dropped
                    and not os.path.lexists(os.path.join(staging, rel))):
                _link_or_copy(src, os.path.join(staging, rel))
    os.unlink(os.path.join(staging, _STAGING_MARK))


def _link_or_copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _swap(staging: str, out: str) -> None:
    if not os.path.exists(out):
        os.rename(staging, out)
        return
    old = _beside(out, f"old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except OSError:
        os.rename(old, out)  # put the previous folder back before reporting
        raise
    try:
        _retire(old, out)
    except OSError as exc:  # the new folder is in place; the old one waits for the next compile
        warnings.warn(f"could not remove the previous contents of {out} from {old}: {exc}",
                      RuntimeWarning, stacklevel=2)


def _retire(old: str, out: str) -> None:
    """Delete what pcompile owns in the replaced folder `old`; anything else (written there
    after the carry-over) moves into `out`, so nothing pcompile did not write is deleted."""
    manifest = read_manifest(old)
    owned = set(manifest.files) if manifest else set()
    owned |= shown_pictures(old)  # pcompile show's, unchanged: not carried (`_complete`)
    files, folders = _scan(old)
    for rel in _manifest_last(files):
        path, new = os.path.join(old, rel), os.path.join(out, rel)
        if rel in owned or rel == MANIFEST or is_temp_leftover(rel) or (
                is_run_file(old, rel) and (os.path.islink(path) or _same_file(path, new))):
            os.unlink(path)  # a link at a run output's place: not carried (`_complete`)
        elif not os.path.lexists(new):
            os.makedirs(os.path.dirname(new), exist_ok=True)
            os.rename(path, new)
    _remove_emptied(old, folders, f"the previous contents of {out} that could not be moved "
                                  f"back are kept in {old}")


def _same_file(a: str, b: str) -> bool:
    try:
        if os.path.samestat(os.lstat(a), os.lstat(b)):
            return True
        return filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False


def _discard(staging: str) -> None:
    """Delete a complete staging folder whose swap never began (`out` is still the previous
    compile): what its manifest lists and the run outputs carried into it; anything else (not
    written by that compile) stays, and so does the folder then."""
    manifest = read_manifest(staging)
    owned = set(manifest.files) if manifest else set()
    files, folders = _scan(staging)
    for rel in _manifest_last(files):
        if rel in owned or rel == MANIFEST or is_run_file(staging, rel):
            os.unlink(os.path.join(staging, rel))
    _remove_emptied(staging, folders, f"kept {staging}: it holds files pcompile did not write")


def _manifest_last(files: list[str]) -> list[str]:
    """`files` with the manifest last: a retire or discard killed part-way leaves a folder that
    still has its manifest, so the next compile recognises it and finishes the job."""
    return sorted(files, key=lambda rel: rel == MANIFEST)


def _remove_emptied(root: str, folders: list[str], kept: str | None) -> None:
    """Remove `root` and its sub`folders` (deepest first) where they are empty; warn `kept`
    (unless None) when `root` itself is not."""
    for rel in reversed(folders):
        try:
            os.rmdir(os.path.join(root, rel))
        except OSError:
            pass
    try:
        os.rmdir(root)
    except OSError:
        if kept is not None:
            warnings.warn(kept, RuntimeWarning, stacklevel=3)


def clean_leftovers(out: str) -> None:
    """Staging and replaced folders of a killed compile into `out` (call with the lock held:
    then no other pcompile is writing them). An incomplete staging folder (it holds the staging
    mark) is removed; a complete one (a pcompile manifest, its mark removed) whose swap was cut
    short replaces the missing `out`, or is discarded when `out` is there; a replaced folder
    (with a manifest) is retired. A folder that merely has such a name, with neither mark nor
    manifest, is not pcompile's and is left alone, unless it holds no file at all (what a
    retire or discard killed after its last file leaves): its empty folders are removed."""
    parent, name = os.path.dirname(out), os.path.basename(out)
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return
    prefix = f".{name}.pcompile-"
    staged = [os.path.join(parent, e) for e in entries if e.startswith(prefix + "new-")]
    olds = [os.path.join(parent, e) for e in entries if e.startswith(prefix + "old-")]
    for path in staged:
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if os.path.lexists(os.path.join(path, _STAGING_MARK)):
            shutil.rmtree(path, ignore_errors=True)  # pcompile's, killed while writing it
        elif read_manifest(path) is None:
            _remove_if_empty(path)  # neither mark nor manifest: its files are not pcompile's
        elif not os.path.exists(out):
            os.rename(path, out)  # the compile had finished; only its swap was cut short
        else:
            _discard(path)
    for path in olds:
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        if read_manifest(path) is None:
            _remove_if_empty(path)
            continue
        if os.path.exists(out):
            _retire(path, out)
        else:
            os.rename(path, out)


def _remove_if_empty(root: str) -> None:
    """Remove `root` when it holds folders only (no file, no link): nothing is deleted."""
    try:
        files, folders = _scan(root)
    except OSError:
        return
    if not files:
        _remove_emptied(root, folders, None)
