"""Parameters at run time: `<out>/params.json`, how every rank makes its own slices.

A compile allocates no parameter: each parameter and optimizer state is abstract (its shape,
dtype, initializer and seed ticket, or the user's array; `program.initializers`). The manifest
`params.json` writes that down, one entry per stored value of the program:

    {"format": "pcompile-params/1",
     "params": {"w": {"kind": "weight", "shape": [16, 32], "dtype": "float32",
                      "init": {"initializer": "Normal", "args": {"sigma": 0.01, "mean": 0.0},
                               "ticket": [1, 0], "zero_rows": []}},
                "moments.w": {..., "init": {"initializer": "Zero", "args": {"value": 0}}},
                "table": {..., "init": {"file": "params/table.npy", "view": null}},
                "emb": {..., "init": {"safetensors": "/abs/model.safetensors",
                                      "tensor": "model.embed_tokens.weight", "size": ...,
                                      "mtime_ns": ..., "header_sha256": "...",
                                      "stored_dtype": "BF16", "stored_shape": [...]}},
                "beta1_power": {..., "init": {"value": 1.0}}}}

A rank process reads it and generates only its own block of each value (`block(...)`): equal,
element for element, to the same block of the single-device initialisation. Arrays the user
gave are written once (not per rank) to `params/<name>.npy`, or referenced where they already
are (a memory-mapped `.npy`), and read block by block with `mmap_mode="r"`. Nothing here is
unpickled or evaluated: JSON, and `.npy` files loaded with `allow_pickle=False`.

Pretrained weights (`load_checkpoint`, compiler/frontend/serialization.py) are recorded as
references to a tensor of a safetensors file, never copied: the file the model file named (its
absolute path with links resolved), its size, modification time and header digest, and the tensor's
stored dtype and shape. This is the one way a read leaves the output folder besides `npy`, and
it is confined to what the compile saw: a rank refuses the entry unless the path is absolute,
link-free, ends in `.safetensors`, is a regular file of the recorded size, mtime and header
digest, and holds that tensor with that dtype and shape; it then reads only its slices
(`safe_open(...).get_slice(name)[...]`, memory-mapped), converted to the parameter's dtype.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pcompile.backends.npz_files import portable
from pcompile.ir.types import DType
from pcompile.program.initializers import InitializedData, Initializer, One, Zero
from pcompile.program.pretrained import PretrainedTensor, StackedTensor

FORMAT = "pcompile-params/1"
MANIFEST = "params.json"
INLINE_LIMIT = 16  # arrays with at most this many elements are written into the manifest


class ParamsError(Exception):
    """The manifest or one of its arrays cannot be used (the message says which and why)."""


def _file_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "param"
    out, k = base, 1
    while out.lower() in taken:
        k += 1
        out = f"{base}_{k}"
    taken.add(out.lower())
    return out


def _init_entry(source: InitializedData, name: str, folder: str, taken: set[str]
                ) -> dict[str, Any]:
    zero_rows = list(source.zero_rows)
    if source.init is not None:
        return {"initializer": type(source.init).__name__, "args": dict(vars(source.init)),
                "ticket": list(source.ticket) if source.ticket is not None else None,
                "zero_rows": zero_rows}
    array = source.array
    assert array is not None
    if isinstance(array, PretrainedTensor):  # a reference, whatever its size: never read here
        return {**array.reference(), "zero_rows": zero_rows}
    if array.size <= INLINE_LIMIT and np.asarray(array).dtype.kind in "biuf":
        return {"value": np.asarray(array).tolist(), "zero_rows": zero_rows}
    path = getattr(array, "filename", None)
    if isinstance(array, np.memmap) and path and _whole_npy(path, array):
        return {"npy": os.path.abspath(path), "zero_rows": zero_rows}
    stored, view = portable(np.ascontiguousarray(array))
    rel = f"params/{_file_name(name, taken)}.npy"
    os.makedirs(os.path.join(folder, "params"), exist_ok=True)
    with open(os.path.join(folder, rel), "wb") as f:
        np.lib.format.write_array(f, stored, allow_pickle=False)
    return {"file": rel, "view": view, "zero_rows": zero_rows}


def _whole_npy(path: str, array: np.ndarray) -> bool:
    """True when `array` is an entire .npy file mapped by np.load(mmap_mode=...)."""
    try:
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        return False
    return (mapped.shape == array.shape and mapped.dtype == array.dtype
            and getattr(array, "offset", None) == getattr(mapped, "offset", None))


def write_manifest(folder: str, entries: Sequence[tuple[str, str, InitializedData]]) -> None:
    """Write `params.json` (and the arrays it needs) into `folder`; `entries` are
    (name, kind, source) of every stored value of the program."""
    taken: set[str] = set()
    params = {}
    for name, kind, source in entries:
        params[name] = {"kind": kind, "shape": list(source.shape), "dtype": source.dtype.name,
                        "init": _init_entry(source, name, folder, taken)}
    # One value per line (json's indented form goes through its slow pure-Python encoder and
    # spreads a 7B model's 1,500 entries over 30,000 lines).
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}"
                       for name, entry in params.items())
    text = f'{{\n "format": {json.dumps(FORMAT)},\n "params": {{\n{rows}\n }}\n}}'
    if not params:
        text = json.dumps({"format": FORMAT, "params": {}})
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        f.write(text + "\n")


def read_manifest(out_dir: str) -> dict[str, InitializedData]:
    """Every value of `<out_dir>/params.json` as an abstract `InitializedData`. Anything wrong
    with an entry (a type, an initializer's argument, a file outside the folder or not a
    regular file) is one `ParamsError` naming the parameter."""
    path = os.path.join(out_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ParamsError(f"{path} is missing; compile again") from None
    except (OSError, ValueError) as exc:
        raise ParamsError(f"{path} is unreadable ({exc}); compile again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(
            data.get("params", {}), dict):
        raise ParamsError(f"{path} is not a {FORMAT} manifest; compile again")
    out = {}
    for name, entry in data.get("params", {}).items():
        try:
            out[name] = _source(entry, out_dir)
        except (KeyError, TypeError, ValueError, AttributeError, OSError) as exc:
            what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ParamsError(f"{path}: parameter {name!r} cannot be used ({what}); compile "
                              "again") from None
    return out


def check_program(out_dir: str, sources: Mapping[str, InitializedData],
                  expected: Mapping[str, tuple[Sequence[int], str]]) -> None:
    """Every value the program stores (`expected`: name -> global shape, dtype name) against
    its params.json entry (`read_manifest`): one `ParamsError` naming the first that is
    missing or of another shape or dtype (a manifest from another compile, or edited), before
    any rank makes a block of it."""
    path = os.path.join(out_dir, MANIFEST)
    for name, (shape, dtype) in expected.items():
        source = sources.get(name)
        if source is None:
            raise ParamsError(f"{path} has no entry for {name}; compile again")
        if tuple(source.shape) != tuple(shape):
            raise ParamsError(f"{path}: parameter {name!r} has shape {list(source.shape)}, "
                              f"the program's is {list(shape)}; compile again")
        if source.dtype.name != DType.from_any(dtype).name:
            raise ParamsError(f"{path}: parameter {name!r} is {source.dtype.name}, the "
                              f"program's is {dtype}; compile again")


def _source(entry: Mapping[str, Any], out_dir: str) -> InitializedData:
    if not isinstance(entry, dict) or not isinstance(entry.get("init"), dict):
        raise TypeError("its entry is not an object with an init")
    shape = tuple(_int(d, "a dim of its shape") for d in entry["shape"])
    if any(d < 0 for d in shape):
        raise ValueError(f"its shape {list(shape)} has a negative dim")
    dtype = DType[entry["dtype"]]
    init = entry["init"]
    zero_rows = tuple(_int(r, "a zero row") for r in init.get("zero_rows", ()))
    if "initializer" in init:
        obj = _initializer(init["initializer"], init.get("args", {}))
        obj.check(shape)
        ticket = init.get("ticket")
        if ticket is not None:
            if not (isinstance(ticket, list) and len(ticket) == 2):
                raise TypeError(f"its ticket {ticket!r} is not [seed, counter]")
            ticket = tuple(_int(t, "its ticket") for t in ticket)
            if not (0 <= ticket[0] < 2**64 and ticket[1] >= 0):
                raise ValueError(f"its ticket {list(ticket)} is out of range")
        elif obj.random:
            raise ValueError(f"{type(obj).__name__} draws random numbers but has no ticket")
        return InitializedData(obj, shape, dtype, ticket, zero_rows=zero_rows)
    array: np.ndarray | PretrainedTensor
    if "value" in init:
        array = np.asarray(init["value"], dtype=dtype.np).reshape(shape)
    elif "safetensors_stack" in init:  # compiler/frontend/name_maps.py: one of several tensors
        array = StackedTensor.from_reference(init)
        if tuple(array.shape) != shape:
            raise ValueError(f"the tensors stacked from {array.file.path} have shape "
                             f"{array.shape}, the parameter {shape}")
    elif "safetensors" in init:
        array = PretrainedTensor.from_reference(init)
        if tuple(array.shape) != shape:
            raise ValueError(f"tensor {array.name} of {array.file.path} has shape "
                             f"{array.shape}, the parameter {shape}")
    else:
        path = _array_file(init, out_dir)
        stored: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
        if init.get("view"):
            stored = stored.view(DType[init["view"]].np)
        if tuple(stored.shape) != shape:
            raise ValueError(f"{path} holds shape {tuple(stored.shape)}, expected {shape}")
        array = stored
    return InitializedData(None, shape, dtype, None, array, zero_rows)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} is {value!r}, not an integer")
    return value


def _initializer(name: Any, args: Any) -> Initializer:
    """The initializer `name` made again from `args` by its constructor, which checks every
    argument as it did for the model (a wrong type or value is one message here, not a
    traceback when a rank makes its values)."""
    from pcompile.program import initializers

    cls = getattr(initializers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, Initializer) and cls is not Initializer):
        raise ValueError(f"unknown initializer {name!r}")
    if not isinstance(args, dict):
        raise TypeError(f"the arguments of {name} are {args!r}, not an object")
    plain = cls()  # Zero and One take no arguments: theirs are fixed
    if cls in (Zero, One):
        if args != vars(plain):
            raise ValueError(f"{name} takes the arguments {vars(plain)}, got {args}")
        return plain
    try:
        obj = cls(**args)
    except (TypeError, ValueError) as exc:  # a missing or unknown argument, a wrong value
        text = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
        raise type(exc)(text) from None
    if set(args) != set(vars(obj)):
        raise TypeError(f"{name} takes the arguments {', '.join(vars(obj))}, got "
                        f"{', '.join(args) or 'none'}")
    return obj


def _array_file(init: Mapping[str, Any], out_dir: str) -> str:
    """The .npy a value is read from: `file`, inside the output folder (no `..` or link out of
    it), or `npy`, an absolute path (a memory-mapped array the model gave); either must be a
    regular file (a FIFO or device would block or never end)."""
    if "npy" in init:
        path = init["npy"]
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"npy {path!r} is not an absolute path")
    else:
        rel = init["file"]
        if not isinstance(rel, str) or os.path.isabs(rel):
            raise ValueError(f"file {rel!r} is not a path relative to the output folder")
        folder = os.path.realpath(out_dir)
        path = os.path.realpath(os.path.join(folder, rel))
        if os.path.commonpath([folder, path]) != folder:
            raise ValueError(f"file {rel!r} is outside the output folder {folder}")
    try:
        info = os.stat(path)
    except OSError as exc:
        raise OSError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    return path
