"""What `pcompile-merge` writes: safetensors, streamed one tensor at a time, in one file or, above
a size threshold, in shards with a Hugging Face index (`model.safetensors.index.json`).

The safetensors layout, written here directly so that no more than one tensor is held: 8 bytes
little-endian header length N, N bytes of JSON (`{name: {"dtype", "shape", "data_offsets"}},
"__metadata__": {str: str}}`, padded with spaces to a multiple of 8), then every tensor's bytes,
C order, little-endian, in the header's order. The header is known before any tensor is
merged (names, dtypes and global shapes come from the checkpoints' layouts). The index is
`{"metadata": {"total_size": bytes, ...}, "weight_map": {name: shard}}`, shards named
`model-00001-of-0000N.safetensors` beside it.

Every file is written to a temporary name and renamed when all are complete; the index last.
A file already at an output's place is replaced only when an earlier merge wrote it (its
metadata says `format: pcompile-merge/1`); shards that a previous merge into the same folder
listed and this one does not are removed after the new index is in place, if they are ours.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, BinaryIO

import numpy as np

from pcompile.backends.atomic_files import atomic_write_text, temp_name, try_unlink
from pcompile.compiler.driver.outdir import MERGE_FORMAT, MERGE_INDEX, is_merge_file

# The mark of what pcompile-merge writes lives with the output folder's rules, which keep such
# files wherever they are in a compile's --out (compiler/driver/outdir.py).
INDEX_NAME = MERGE_INDEX
SINGLE_NAME = "model.safetensors"
#: Hugging Face's default `max_shard_size` ("5GB", decimal).
DEFAULT_MAX_SHARD = 5 * 10**9
#: The largest file a safetensors header can describe (64-bit offsets).
MAX_FILE_BYTES = 2**64 - 1
_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
          "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
          "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40}


class MergeError(Exception):
    """Checkpoints that `pcompile-merge` cannot merge, or an output it cannot write."""


def parse_size(text: str) -> int:
    """Bytes of `5GB`, `500MB`, `2GiB` or a plain number (Hugging Face's spelling), computed
    exactly; ValueError for anything else, under one byte, or more than a safetensors file can
    address (its offsets are 64-bit)."""
    m = _SIZE.fullmatch(text.strip())
    shown = repr(text) if len(text) <= 32 else repr(text[:24] + "...") + f" ({len(text)} chars)"
    if not m:
        raise ValueError(f"{shown} is not a size such as 5GB, 500MB or 2GiB")
    size = int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if size < 1:
        raise ValueError(f"{shown} is less than one byte; give a size such as 5GB, 500MB or 2GiB")
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{shown} is more than a safetensors file can hold (2^64 - 1 bytes); "
                         "give a size such as 5GB, 500MB or 2GiB")
    return size


@dataclass(frozen=True)
class Entry:
    """One tensor of the output: name, dtype, global shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def code(self) -> str:
        code = _CODES.get(self.dtype.name)
        if code is None:
            raise MergeError(f"{self.name}: dtype {self.dtype} has no safetensors code")
        return code


def header_bytes(entries: Sequence[Entry], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header of a safetensors file holding `entries` in order."""
    table: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for e in entries:
        table[e.name] = {"dtype": e.code, "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def shard_plan(entries: Sequence[Entry], max_bytes: int) -> list[list[Entry]]:
    """Entries in order, cut into shards of at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _write_tensor(f: BinaryIO, entry: Entry, tensor: np.ndarray) -> None:
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise MergeError(f"{entry.name}: merged as {tensor.dtype} {tuple(tensor.shape)}, its "
                         f"layout says {entry.dtype} {entry.shape}")
    data = np.ascontiguousarray(tensor)
    if data.dtype.byteorder == ">":
        data = data.byteswap().view(data.dtype.newbyteorder("<"))
    f.write(data.reshape(-1).view(np.uint8).data)


def _refuse_foreign(path: str) -> None:
    if os.path.lexists(path) and not (os.path.isfile(path) and not os.path.islink(path)
                                      and is_merge_file(path)):
        raise MergeError(f"{path} exists and is not a file pcompile-merge wrote; name another "
                         "--output (pcompile never replaces a file it did not write)")


def write_merged(output: str, entries: Sequence[Entry],
                 tensors: Iterator[tuple[str, np.ndarray]], metadata: Mapping[str, str],
                 max_shard: int = DEFAULT_MAX_SHARD, folder: bool | None = None) -> list[str]:
    """Write the merged tensors (`tensors`, in `entries`' order) to `output`: one file when
    `output` ends in `.safetensors` (folder False); else a folder with `model.safetensors`, or
    shards and `model.safetensors.index.json` when they pass `max_shard` bytes. Returns the
    files written (the index last)."""
    meta = {"format": MERGE_FORMAT, **metadata}
    shards = shard_plan(entries, max_shard) if folder else [list(entries)]
    if folder:
        names = ([SINGLE_NAME] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                  for i in range(len(shards))])
        paths = [os.path.join(output, n) for n in names]
        index = os.path.join(output, INDEX_NAME) if len(shards) > 1 else None
    else:
        paths, index = [output], None
    for path in paths + ([index] if index else []):
        _refuse_foreign(path)
    old_index = os.path.join(output, INDEX_NAME) if folder else None
    stale = _listed_shards(old_index) if old_index else set()
    if folder and len(shards) == 1 and old_index and os.path.exists(old_index):
        _refuse_foreign(old_index)
    os.makedirs(os.path.dirname(os.path.abspath(paths[0])), exist_ok=True)
    temps: list[str] = []
    try:
        for path, shard in zip(paths, shards):
            tmp = temp_name(path)
            temps.append(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(header_bytes(shard, meta))
                for entry in shard:
                    name, tensor = next(tensors)
                    if name != entry.name:
                        raise MergeError(f"merged {name} where {entry.name} was expected")
                    _write_tensor(f, entry, tensor)
                f.flush()
                os.fsync(f.fileno())
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
        temps = []
    finally:
        for tmp in temps:
            try_unlink(tmp)
    written = list(paths)
    if index:
        weight_map = {e.name: os.path.basename(p) for p, shard in zip(paths, shards)
                      for e in shard}
        text = json.dumps({"metadata": {**meta, "total_size": sum(e.nbytes for e in entries)},
                           "weight_map": weight_map}, indent=2, sort_keys=True)
        atomic_write_text(index, text + "\n")
        written.append(index)
    elif old_index and os.path.exists(old_index) and is_merge_file(old_index):
        try_unlink(old_index)  # the previous merge's index; the folder holds one file now
    for name in sorted(stale - {os.path.basename(p) for p in paths}):
        path = os.path.join(output, name)
        if is_merge_file(path):
            try_unlink(path)
    return written


def _listed_shards(index: str) -> set[str]:
    """The shard names an earlier merge's index lists (none if it is not ours)."""
    if not os.path.exists(index) or not is_merge_file(index):
        return set()
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
    except (OSError, ValueError):
        return set()
    return {v for v in weight_map.values()
            if isinstance(v, str) and os.path.basename(v) == v and v.endswith(".safetensors")}
