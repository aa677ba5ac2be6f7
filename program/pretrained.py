"""Pretrained tensors at run time: one tensor of a safetensors file (`PretrainedTensor`), or
tensors of several read as one (`StackedTensor`), read block by block, memory-mapped, never
as a whole unless asked; and the header reader that identifies a file (its size, mtime and
header digest). `compiler/frontend/serialization.py`'s `load_checkpoint` makes them at compile time;
`backends/params.py` checks a recorded reference against the file (`from_reference`) and
reads a rank's slices. This room imports only `ir/`: a rank reads its weights without
loading the front end.

Format facts used (safetensors): 8 bytes little-endian header length N, then N bytes of JSON
`{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`, then the data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcompile.ir.errors import PcompileError
from pcompile.ir.types import DType

SAFETENSORS_DTYPES: dict[str, DType] = {
    "F64": DType.float64, "F32": DType.float32, "F16": DType.float16, "BF16": DType.bfloat16,
    "I64": DType.int64, "I32": DType.int32, "U8": DType.uint8, "BOOL": DType.bool_,
}
HEADER_LIMIT = 100 * 2**20  # safetensors' own readers refuse larger headers


class CheckpointLoadError(PcompileError):
    """A pretrained checkpoint that cannot be loaded (the message says which and why)."""


@dataclass(frozen=True)
class SafetensorsFile:
    """A safetensors file's identity and table of contents, read from its header alone."""

    path: str  # absolute, links resolved
    size: int
    mtime_ns: int
    header_sha256: str
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]  # name -> (dtype code, shape)


def read_header(path: str) -> SafetensorsFile:
    """The header of the safetensors file `path` (a regular file; nothing past the header is
    read). Anything wrong is one `CheckpointLoadError` naming the file."""
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise CheckpointLoadError(f"cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointLoadError(f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointLoadError(f"{path} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", head)
            if length > min(HEADER_LIMIT, info.st_size - 8):
                raise CheckpointLoadError(f"{path} is not a safetensors file (its header "
                                          f"length {length} does not fit the file)")
            raw = f.read(length)
    finally:
        os.close(fd)
    try:
        table = json.loads(raw)
        if not isinstance(table, dict):
            raise ValueError("the header is not an object")
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, entry in table.items():
            if name == "__metadata__":
                continue
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            tensors[name] = (str(entry["dtype"]), shape)
            if not 0 <= begin <= end <= info.st_size - 8 - length:
                raise ValueError(f"tensor {name}'s data lies outside the file")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointLoadError(f"{path} is not a valid safetensors file ({exc})") from None
    return SafetensorsFile(real, info.st_size, info.st_mtime_ns,
                           hashlib.sha256(head + raw).hexdigest(), tensors)


class PretrainedTensor:
    """One tensor of a safetensors file, read block by block (`tensor[slices]`: only that
    block, memory-mapped) and never as a whole unless asked (`np.asarray`)."""

    __slots__ = ("file", "name", "code", "shape", "dtype")

    def __init__(self, file: SafetensorsFile, name: str) -> None:
        self.file, self.name = file, name
        self.code, self.shape = file.tensors[name]
        dtype = SAFETENSORS_DTYPES.get(self.code)
        if dtype is None:
            raise CheckpointLoadError(
                f"tensor {name} of {file.path} has dtype {self.code}, which pcompile does "
                f"not have (it has {', '.join(SAFETENSORS_DTYPES)})")
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, index: Any) -> np.ndarray:
        from safetensors import safe_open

        index = index if isinstance(index, tuple) else (index,)
        if not self.shape:
            with safe_open(self.file.path, framework="np") as f:
                whole: np.ndarray = np.asarray(f.get_tensor(self.name))
                part: np.ndarray = whole[index]
                return part
        with safe_open(self.file.path, framework="np") as f:
            return np.asarray(f.get_slice(self.name)[index])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[tuple(slice(0, d) for d in self.shape)]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def reference(self) -> dict[str, Any]:
        """What params.json records of it (backends/params.py checks it before any read)."""
        return {"safetensors": self.file.path, "tensor": self.name, "size": self.file.size,
                "mtime_ns": self.file.mtime_ns, "header_sha256": self.file.header_sha256,
                "stored_dtype": self.code, "stored_shape": list(self.shape)}

    @staticmethod
    def from_reference(ref: Mapping[str, Any]) -> PretrainedTensor:
        """The tensor a params.json entry names, if the file is still the one the compile
        saw: an absolute path without links, ending in .safetensors, a regular file of the
        recorded size, mtime and header digest, holding the tensor with the recorded dtype
        and shape. Anything else: ValueError saying what differs."""
        path = ref["safetensors"]
        if not isinstance(path, str) or not os.path.isabs(path) or not path.endswith(
                ".safetensors"):
            raise ValueError(f"safetensors {path!r} is not an absolute path to a "
                             ".safetensors file")
        if os.path.realpath(path) != path:
            raise ValueError(f"{path} is (or goes through) a link now; the compile recorded "
                             "the file itself")
        try:
            info = os.stat(path)
        except OSError as exc:
            raise OSError(f"{path}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if (info.st_size, info.st_mtime_ns) != (ref["size"], ref["mtime_ns"]):
            raise ValueError(f"the pretrained file {path} changed since the compile (size or "
                             "modification time)")
        try:
            file = read_header(path)
        except CheckpointLoadError as exc:
            raise ValueError(str(exc)) from None
        if file.header_sha256 != ref["header_sha256"]:
            raise ValueError(f"the pretrained file {path} changed since the compile (its "
                             "header)")
        name = ref["tensor"]
        if name not in file.tensors:
            raise ValueError(f"{path} has no tensor {name!r}")
        code, shape = file.tensors[name]
        if code != ref["stored_dtype"] or list(shape) != ref["stored_shape"]:
            raise ValueError(f"tensor {name} of {path} is {code} {list(shape)}, the compile "
                             f"saw {ref['stored_dtype']} {ref['stored_shape']}")
        return PretrainedTensor(file, name)

    def __repr__(self) -> str:
        return (f"PretrainedTensor({self.name!r} of {self.file.path}, shape={self.shape}, "
                f"dtype={self.code})")


class StackedTensor(PretrainedTensor):
    """Tensors of safetensors files read as one (compiler/frontend/name_maps.py): `members` stacked
    along a new first dim (`stack`; else the one member), each transposed (its dims reversed)
    when `transpose`. A block reads only the members it spans and, of each, only its part,
    memory-mapped, as PretrainedTensor does."""

    __slots__ = ("members", "transpose", "stack")

    def __init__(self, name: str, members: list[PretrainedTensor], transpose: bool = False,
                 stack: bool = True) -> None:
        if not members or (not stack and len(members) != 1):
            raise CheckpointLoadError(f"{name}: {len(members)} tensors to read as one")
        first = members[0]
        for other in members[1:]:
            if (other.code, other.shape) != (first.code, first.shape):
                raise CheckpointLoadError(
                    f"{name}: tensor {other.name} of {other.file.path} is {other.code} "
                    f"{list(other.shape)}, tensor {first.name} {first.code} "
                    f"{list(first.shape)}: the tensors stacked into one must agree")
        self.members, self.transpose, self.stack = list(members), bool(transpose), bool(stack)
        self.file, self.code, self.dtype = first.file, first.code, first.dtype
        self.name = (first.name if len(members) == 1
                     else f"{first.name} .. {members[-1].name}")
        part = tuple(first.shape[::-1]) if transpose else tuple(first.shape)
        self.shape = (len(members), *part) if stack else part

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        if self.stack:
            picked = range(len(self.members))[index[0]]
            rest = index[1:]
        else:
            picked, rest = range(1), index
        blocks = []
        for k in picked:
            member = self.members[k]
            if self.transpose:
                blocks.append(np.transpose(member[tuple(rest[::-1])]))
            else:
                blocks.append(member[tuple(rest)])
        if not self.stack:
            return blocks[0]
        if not blocks:
            width = [len(range(d)[i]) for d, i in zip(self.shape[1:], rest)]
            return np.zeros((0, *width), self.dtype.np)
        return np.stack(blocks)

    def reference(self) -> dict[str, Any]:
        """What params.json records: each member's reference, and how they make one."""
        return {"safetensors_stack": [m.reference() for m in self.members],
                "transpose": self.transpose, "stack": self.stack}

    @staticmethod
    def from_reference(ref: Mapping[str, Any]) -> StackedTensor:
        """The tensor a params.json entry names (each member checked as
        PretrainedTensor.from_reference checks it); ValueError saying what differs."""
        members = ref.get("safetensors_stack")
        if not isinstance(members, list) or not all(isinstance(m, dict) for m in members):
            raise ValueError("safetensors_stack is not a list of tensor references")
        try:
            return StackedTensor("a stacked tensor",
                                 [PretrainedTensor.from_reference(m) for m in members],
                                 bool(ref.get("transpose")), bool(ref.get("stack", True)))
        except CheckpointLoadError as exc:
            raise ValueError(str(exc)) from None

    def __repr__(self) -> str:
        return (f"StackedTensor({len(self.members)} of {self.file.path}, shape={self.shape}, "
                f"transpose={self.transpose})")
