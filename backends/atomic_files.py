"""Files written atomically: through a temporary file in the same folder (`temp_name`),
fsynced, then renamed onto the final name, so that a write cut short at any point leaves the
previous file as it was; `clean_temp_files` removes the leftovers of killed writes.
Checkpoints, their indexes, train.log, metrics.jsonl and merged outputs are written this way.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from typing import Any

# ours (`temp_name`), and the one safetensors' writer goes through (Rust's tempfile: .tmpXXXXXX)
TEMP_FILE = re.compile(r"\.[^/]+\.tmp-[0-9a-f]+|\.tmp[A-Za-z0-9]{6}")


def temp_name(path: str) -> str:
    """The temporary file an atomic write of `path` goes through: `.<name>.tmp-<token>` in the
    same folder (compiler/driver/outdir.py and `clean_temp_files` recognise leftovers by this
    name)."""
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
        try_unlink(tmp)
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
        if TEMP_FILE.fullmatch(name):
            try:
                os.unlink(os.path.join(folder, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def try_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
