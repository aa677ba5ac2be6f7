"""Parameters at run time: `<out>/params.json`, how every rank makes its own slices.

A compile allocates no parameter: each parameter and optimizer state is abstract (its shape,
dtype, initializer and seed ticket, or the user's array; `compiler.initializer`). The manifest
`params.json` writes that down, one entry per stored value of the program:

    {"format": "pcompile-params/1",
     "params": {"w": {"kind": "weight", "shape": [16, 32], "dtype": "float32",
                      "init": {"initializer": "Normal", "args": {"sigma": 0.01, "mean": 0.0},
                               "ticket": [1, 0], "zero_rows": []}},
                "moments.w": {..., "init": {"initializer": "Zero", "args": {"value": 0}}},
                "table": {..., "init": {"file": "params/table.npy", "view": null}},
                "beta1_power": {..., "init": {"value": 1.0}}}}

A rank process reads it and generates only its own block of each value (`block(...)`): equal,
element for element, to the same block of the single-device initialisation. Arrays the user
gave are written once (not per rank) to `params/<name>.npy`, or referenced where they already
are (a memory-mapped `.npy`), and read block by block with `mmap_mode="r"`. Nothing here is
unpickled or evaluated: JSON, and `.npy` files loaded with `allow_pickle=False`.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pcompile.backends.checkpoint import portable
from pcompile.compiler.initializer import InitializedData, Initializer
from pcompile.ir.types import DType

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
    """Every value of `<out_dir>/params.json` as an abstract `InitializedData`."""
    path = os.path.join(out_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ParamsError(f"{path} is missing; compile again") from None
    except (OSError, ValueError) as exc:
        raise ParamsError(f"{path} is unreadable ({exc}); compile again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ParamsError(f"{path} is not a {FORMAT} manifest; compile again")
    out = {}
    for name, entry in data.get("params", {}).items():
        try:
            out[name] = _source(entry, out_dir)
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise ParamsError(f"{path}: parameter {name!r} cannot be used ({exc}); compile "
                              "again") from None
    return out


def _source(entry: Mapping[str, Any], out_dir: str) -> InitializedData:
    shape = tuple(int(d) for d in entry["shape"])
    dtype = DType[entry["dtype"]]
    init = entry["init"]
    zero_rows = tuple(int(r) for r in init.get("zero_rows", ()))
    if "initializer" in init:
        module = importlib.import_module("pcompile.compiler.initializer")
        cls = getattr(module, init["initializer"], None)
        if not (isinstance(cls, type) and issubclass(cls, Initializer)):
            raise ValueError(f"unknown initializer {init['initializer']!r}")
        obj = cls.__new__(cls)
        obj.__dict__.update(init["args"])  # the arguments it was created (and checked) with
        ticket = tuple(init["ticket"]) if init.get("ticket") is not None else None
        return InitializedData(obj, shape, dtype, ticket, zero_rows=zero_rows)  # type: ignore
    if "value" in init:
        array = np.asarray(init["value"], dtype=dtype.np).reshape(shape)
    else:
        path = init["npy"] if "npy" in init else os.path.join(out_dir, init["file"])
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        if init.get("view"):
            array = array.view(DType[init["view"]].np)
        if tuple(array.shape) != shape:
            raise ValueError(f"{path} holds shape {tuple(array.shape)}, expected {shape}")
    return InitializedData(None, shape, dtype, None, array, zero_rows)
