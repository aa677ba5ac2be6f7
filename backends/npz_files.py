"""Deterministic .npz files (readable by `np.load`): fixed timestamps and sorted keys, so
the same arrays always give the same bytes, written member by member (streaming), atomically;
bfloat16 and other extension dtypes keep their dtype through a `__dtypes__` member. The
constants of a compile (`consts.npz`), inference outputs and older checkpoints use them.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from pcompile.backends.atomic_files import atomic_write

_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


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
