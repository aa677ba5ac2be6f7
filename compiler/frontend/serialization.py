"""Pretrained weights: MindSpore's `load_checkpoint` and `load_param_into_net`, reading
safetensors (one file, or a Hugging Face index of shards) without loading the weights.

`load_checkpoint(path)` reads only the files' headers (names, dtypes, shapes, offsets) and
returns a dict of abstract Parameters, each a `PretrainedTensor`: a reference to one tensor of
one file. `load_param_into_net(net, params)` checks every shape and dtype against the network
(one `CheckpointLoadError` naming the parameter, the expected and the found shape and dtype)
and gives each parameter that reference as its data. Compiling then records, per parameter,
the file, tensor, the file's size, mtime and header digest in `params.json`
(backends/params.py); each rank reads only its slices at run time, memory-mapped through
safetensors' slice API (`safe_open(path).get_slice(name)[...]`). Nothing here holds a weight:
compile memory does not grow with the model's weights.

Format facts used (safetensors): 8 bytes little-endian header length N, then N bytes of JSON
`{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`, then the data. A Hugging
Face index (`model.safetensors.index.json`) is `{"metadata": {...}, "weight_map": {name:
shard file name}}`, the shards beside it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from pcompile.program.pretrained import (  # noqa: F401  (re-exported: the front end's names)
    HEADER_LIMIT,
    SAFETENSORS_DTYPES,
    CheckpointLoadError,
    PretrainedTensor,
    SafetensorsFile,
    StackedTensor,
    read_header,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, for a .safetensors file, a Hugging Face index
    (`*.index.json`, shards beside it) or a folder holding either (`model.safetensors.index
    .json`, `model.safetensors`, or a single `.safetensors` file)."""
    if path.endswith(".ckpt"):
        raise CheckpointLoadError(
            f"{path}: MindSpore .ckpt files are not read (no well-kept reader exists outside "
            "MindSpore); convert it to safetensors with MindSpore's ckpt_to_safetensors")
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if os.path.exists(os.path.join(path, INDEX_NAME)):
            return checkpoint_files(os.path.join(path, INDEX_NAME))
        if SINGLE_NAME in names:
            names = [SINGLE_NAME]
        if len(names) != 1:
            raise CheckpointLoadError(
                f"{path} holds {len(names) or 'no'} .safetensors files and no {INDEX_NAME}: "
                "name one file, or the index of its shards")
        return checkpoint_files(os.path.join(path, names[0]))
    if path.endswith(".json"):
        return _index_files(path)
    if not path.endswith(".safetensors"):
        raise CheckpointLoadError(f"{path}: expected a .safetensors file, a Hugging Face "
                                  f"index ({INDEX_NAME}) or a folder holding one")
    return {name: path for name in read_header(path).tensors}


def _index_files(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as exc:
        raise CheckpointLoadError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CheckpointLoadError(f"{path} is not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointLoadError(f"{path} is not a safetensors index (no weight_map)")
    folder = os.path.dirname(os.path.abspath(path))
    out = {}
    for name, shard in weight_map.items():
        if (not isinstance(shard, str) or os.path.isabs(shard) or os.sep in shard
                or shard in (".", "..") or not shard.endswith(".safetensors")):
            raise CheckpointLoadError(f"{path}: tensor {name} is in {shard!r}, not a "
                                      ".safetensors file beside the index")
        out[name] = os.path.join(folder, shard)
    return out


def load_checkpoint(ckpt_file_name: str, net: Any = None, strict_load: bool = False,
                    filter_prefix: str | Iterable[str] | None = None,
                    dec_key: Any = None, dec_mode: str = "AES-GCM",
                    specify_prefix: str | Iterable[str] | None = None,
                    choice_func: Callable[[str], bool] | None = None,
                    crc_check: bool = False, remove_redundancy: bool = False,
                    format: str = "safetensors",  # noqa: A002  (MindSpore's name)
                    name_map: Any = None,
                    ) -> dict[str, Any]:
    """MindSpore's `load_checkpoint`: {name: Parameter} of a safetensors checkpoint (a file,
    a Hugging Face index of shards, or a folder holding either). Only headers are read: each
    Parameter is abstract, a reference to its tensor, read slice by slice by the ranks.
    `filter_prefix` drops names starting with it, `specify_prefix` keeps only those,
    `choice_func(name)` keeps a name when true; given `net`, the parameters are loaded into
    it (`load_param_into_net`). Encrypted checkpoints (`dec_key`) are not supported.
    `name_map` (pcompile's): the checkpoint's names are another format's, renamed to the
    model's (compiler/frontend/name_maps.py: "llama", "mixtral", a NameMap or a dict {theirs:
    ours}); the filters see the checkpoint's names."""
    from pcompile.compiler.frontend.initializer import InitializedData
    from pcompile.compiler.frontend.tensor import Parameter

    if dec_key is not None:
        raise CheckpointLoadError("load_checkpoint: encrypted checkpoints (dec_key) are not "
                                  "supported")
    if format not in ("safetensors", "ckpt"):
        raise CheckpointLoadError(f"load_checkpoint: format {format!r}: expected "
                                  "'safetensors'")
    if not isinstance(ckpt_file_name, (str, os.PathLike)):
        raise CheckpointLoadError(f"load_checkpoint: ckpt_file_name must be a path, got "
                                  f"{type(ckpt_file_name).__name__}")
    path = os.path.abspath(os.fspath(ckpt_file_name))
    if not os.path.exists(path):
        raise CheckpointLoadError(f"load_checkpoint: {path} does not exist")
    drop = _prefixes(filter_prefix)
    keep = _prefixes(specify_prefix)
    headers: dict[str, SafetensorsFile] = {}
    params: dict[str, Any] = {}
    for name, file in sorted(checkpoint_files(path).items()):
        if drop and name.startswith(drop) or keep and not name.startswith(keep):
            continue
        if choice_func is not None and not choice_func(name):
            continue
        if file not in headers:
            headers[file] = read_header(file)
        if name not in headers[file].tensors:
            raise CheckpointLoadError(f"{file} has no tensor {name!r} (its index names it)")
        tensor = PretrainedTensor(headers[file], name)
        params[name] = Parameter(
            InitializedData(None, tensor.shape, tensor.dtype, None, tensor), name=name)
    if name_map is not None:
        from pcompile.compiler.frontend.name_maps import name_map as resolve

        params = resolve(name_map).from_theirs(params)
    if net is not None:
        load_param_into_net(net, params, strict_load=strict_load)
    return params


def _prefixes(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def load_param_into_net(net: Any, parameter_dict: Mapping[str, Any],
                        strict_load: bool = False, remove_redundancy: bool = False
                        ) -> tuple[list[str], list[str]]:
    """MindSpore's `load_param_into_net`: give every parameter of `net` whose name is in
    `parameter_dict` that value (a Parameter of `load_checkpoint`: a reference read by the
    ranks; or an array). Shapes must match; a floating dtype is converted to the
    parameter's (each rank converts its slice) unless `strict_load`, which wants the same
    dtype. Returns (parameters not loaded, checkpoint names not used)."""
    from pcompile.compiler.frontend.initializer import InitializedData
    from pcompile.compiler.frontend.tensor import Parameter, Tensor

    if not isinstance(parameter_dict, Mapping):
        raise CheckpointLoadError("load_param_into_net: parameter_dict must be a dict of "
                                  f"name -> Parameter, got {type(parameter_dict).__name__}")
    net.finalize_parameter_names()
    not_loaded: list[str] = []
    used: set[str] = set()
    for param in net.get_parameters():
        if param.name not in parameter_dict:
            not_loaded.append(param.name)
            continue
        value = parameter_dict[param.name]
        used.add(param.name)
        if isinstance(value, Parameter):
            source = value.source
        elif isinstance(value, Tensor):
            source = InitializedData.of_array(value.asnumpy())
        else:
            source = InitializedData.of_array(np.asarray(value))
        array = source.array
        where = (f"tensor {array.name} of {array.file.path}"
                 if isinstance(array, PretrainedTensor) else "the checkpoint's value")
        found_dtype = array.dtype if isinstance(array, PretrainedTensor) else source.dtype
        same_kind = found_dtype.is_float and param.dtype.is_float
        if tuple(source.shape) != tuple(param.shape) or (
                found_dtype is not param.dtype and (strict_load or not same_kind)):
            why = "" if tuple(source.shape) != tuple(param.shape) else (
                " (strict_load wants the same dtype)" if same_kind else
                " (only floating dtypes are converted)")
            raise CheckpointLoadError(
                f"load_param_into_net: parameter {param.name} expects shape "
                f"{tuple(param.shape)} {param.dtype.name}, {where} has shape "
                f"{tuple(source.shape)} {found_dtype.name}{why}")
        param.set_data(InitializedData(None, tuple(param.shape), param.dtype, None,
                                       source.array if source.array is not None
                                       else source.to_numpy()))
    unused = [name for name in parameter_dict if name not in used]
    return not_loaded, unused


SAVE_FORMAT = "pcompile-save/1"  # the metadata `format` of what save_checkpoint writes


def save_checkpoint(save_obj: Any, ckpt_file_name: str, integrated_save: bool = True,
                    async_save: bool = False, append_dict: Mapping[str, Any] | None = None,
                    enc_key: Any = None, enc_mode: str = "AES-GCM",
                    choice_func: Callable[[str], bool] | None = None,
                    crc_check: bool = False,
                    format: str = "safetensors",  # noqa: A002  (MindSpore's name)
                    **kwargs: Any) -> str:
    """MindSpore's `save_checkpoint(save_obj, ckpt_file_name, ...)` in its `format=
    "safetensors"` form: every parameter of `save_obj` (a Cell, a dict {name: Parameter,
    Tensor or array}, or MindSpore's list of {"name": ..., "data": ...}) with its value now
    (the initialiser's, or what `load_param_into_net` gave it), and `append_dict`'s entries,
    into one safetensors file under the parameters' names, which `load_checkpoint` reads
    back. A name without the `.safetensors` suffix gets it (MindSpore appends its format's);
    `.ckpt` is refused (MindSpore's own format is not written). Written atomically; an
    existing file is replaced only when an earlier save_checkpoint wrote it. Returns the
    path written. The whole model passes through host memory: for a trained model's values
    merge its run's checkpoints (`pcompile-merge DIR`) instead."""
    from safetensors.numpy import save_file

    from pcompile.compiler.frontend.nn.cell import Cell
    from pcompile.compiler.frontend.tensor import Tensor

    if enc_key is not None:
        raise CheckpointLoadError("save_checkpoint: encrypted checkpoints (enc_key) are not "
                                  "supported")
    if format not in ("safetensors", "ckpt"):
        raise CheckpointLoadError(f"save_checkpoint: format {format!r}: expected 'safetensors'")
    if not isinstance(ckpt_file_name, (str, os.PathLike)):
        raise CheckpointLoadError(f"save_checkpoint: ckpt_file_name must be a path, got "
                                  f"{type(ckpt_file_name).__name__}")
    path = os.path.abspath(os.fspath(ckpt_file_name))
    if path.endswith(".ckpt") or format == "ckpt":
        raise CheckpointLoadError(
            f"save_checkpoint: {ckpt_file_name}: pcompile writes safetensors (MindSpore's "
            "format='safetensors'), not MindSpore's .ckpt format; name the file "
            "NAME.safetensors (load_checkpoint and Hugging Face read it)")
    if not path.endswith(".safetensors"):
        path += ".safetensors"
    if isinstance(save_obj, Cell):
        save_obj.finalize_parameter_names()
        items: list[tuple[Any, Any]] = [(p.name, p) for p in save_obj.get_parameters()]
    elif isinstance(save_obj, Mapping):
        items = list(save_obj.items())
    elif isinstance(save_obj, (list, tuple)) and all(
            isinstance(e, Mapping) and "name" in e and "data" in e for e in save_obj):
        items = [(e["name"], e["data"]) for e in save_obj]
    else:
        raise CheckpointLoadError(
            f"save_checkpoint: save_obj must be a Cell, a dict of name -> Parameter/Tensor or "
            f"a list of {{'name': ..., 'data': ...}}, got {type(save_obj).__name__}")
    items += list((append_dict or {}).items())
    arrays: dict[str, np.ndarray] = {}
    for name, value in items:
        if not isinstance(name, str):
            raise CheckpointLoadError(f"save_checkpoint: a name must be a str, got {name!r}")
        if choice_func is not None and not choice_func(name):
            continue
        if name in arrays:
            raise CheckpointLoadError(f"save_checkpoint: two values are named {name!r}")
        array = value.asnumpy() if isinstance(value, Tensor) else np.asarray(value)
        arrays[name] = np.ascontiguousarray(array)
    _refuse_foreign(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        save_file(arrays, tmp, metadata={"format": SAVE_FORMAT})
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _refuse_foreign(path: str) -> None:
    """An existing `path` that save_checkpoint did not write is never replaced."""
    if not os.path.lexists(path):
        return
    try:
        stored = read_header(path)
        with open(stored.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(length)).get("__metadata__") or {}
    except (CheckpointLoadError, OSError, ValueError, struct.error):
        meta = {}
    if os.path.islink(path) or meta.get("format") != SAVE_FORMAT:
        raise CheckpointLoadError(f"save_checkpoint: {path} exists and save_checkpoint did not "
                                  "write it; name another file (pcompile never replaces a file "
                                  "it did not write)")
