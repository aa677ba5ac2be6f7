"""Strategy checkpoints (`strategy_ckpt_config`, reference §7) in MindSpore's two formats.

A checkpoint is one object (`checkpoint_data`):

```
{"current_stage": 1,
 "parallel_strategy_item": {"MatMul_w": {"stage": 0, "parallel_strategy": [[2, 4], [4, 1]]}},
 "parallel_layout_item": {"w": {"dev_matrix": [2, 4, 1], "tensor_map": [1, -1],
                                "tensor_shape": [32, 16], "field": 0,
                                "opt_weight_shard_step": 4, "opt_weight_shard_size": -1}}}
```

Strategy keys are `<PrimName>_<first parameter name>` (`strategy_key`), so only ops that
consume a parameter are saved; the first op with a key wins. Layout items hold every
parameter's layout (only trainable ones when `only_trainable_params`) and, where the parallel
optimizer stores the parameter split over a shard group (and
`optimizer_weight_shard_aggregated_save` is off, MindSpore's default), that group:
`opt_weight_shard_size` is the configured `optimizer_weight_shard_size` (-1: the whole group
of ranks holding the same slice) and `opt_weight_shard_step` the rank stride inside the
group; both are 0 for a parameter stored whole. `current_stage` counts saves as MindSpore's
does: one more than the loaded file's, 1 without one.

A file name ending in `.json` holds the object as compact JSON with sorted keys (MindSpore's
nlohmann::json text); any other name holds the protobuf message `ParallelStrategyMap` of
MindSpore's node_strategy.proto (`encode_protobuf` / `decode_protobuf`, written by hand: the
wire format of a few varint, string and nested fields). A layout whose dims are split over
several device axes is one `TensorMap` per dim there, as MindSpore writes it.

Loading maps keys back to the ops of the graph (`load_strategies`); in auto_parallel the loaded
strategies are configured strategies and override the search. Nothing here reads or writes a
file: the driver reads the load file before the passes and the checkpoint is written after the
compile (`compiler/driver/strategy_files.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pcompile.ir.core import Graph, GraphParam, Node
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout
from pcompile.ir.sharding import rule_for


def strategy_key(node: Node) -> str | None:
    """`<PrimName>_<first parameter name>`, or None when the op reads no parameter."""
    for operand in node.operands:
        if isinstance(operand, GraphParam) and operand.kind != "input":
            return f"{node.op}_{operand.name}"
    return None


def is_json(path: str) -> bool:
    """MindSpore's choice of format: JSON for a name ending in `.json`, else protobuf."""
    return path.endswith(".json")


def _strategy_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if rule_for(n.op) is not None]


def checkpoint_data(graph: Graph, assignment: Any, *, only_trainable: bool = True,
                    opt_shards: Mapping[str, tuple[int, int]] | None = None,
                    model_layouts: Mapping[str, TensorLayout] | None = None,
                    current_stage: int = 1,
                    node_stages: Mapping[Node, int] | None = None) -> dict[str, Any]:
    """The checkpoint of `assignment` (strategies and parameter layouts) on `graph`.
    `opt_shards`: parameter name -> (opt_weight_shard_size, opt_weight_shard_step) of the
    parameters the parallel optimizer stores split; `model_layouts`: their layouts as the
    strategies give them (the file records those, and the shard group apart); `node_stages`:
    node -> the pipeline stage the op runs in (0 without pipeline stages)."""
    items: dict[str, Any] = {}
    for node in _strategy_nodes(graph):
        key = strategy_key(node)
        sharding = assignment.sharding(node)
        if key is None or key in items or sharding is None:
            continue
        items[key] = {"stage": (node_stages or {}).get(node, 0),
                      "parallel_strategy": [list(s) for s in sharding.strategy]}
    layouts: dict[str, Any] = {}
    for p in graph.params:
        if p.kind == "input" or (only_trainable and not p.requires_grad):
            continue
        lay = (model_layouts or {}).get(p.name) or assignment.param_layouts.get(p.name)
        if lay is None:
            continue
        size, step = (opt_shards or {}).get(p.name, (0, 0))
        layouts[p.name] = {
            "dev_matrix": list(lay.dev_matrix),
            "tensor_map": [list(e) if isinstance(e, tuple) else e for e in lay.tensor_map],
            "tensor_shape": list(lay.shape),
            "field": 0,
            "opt_weight_shard_step": step,
            "opt_weight_shard_size": size,
        }
    return {"current_stage": current_stage, "parallel_strategy_item": items,
            "parallel_layout_item": layouts}


def encode(path: str, data: Mapping[str, Any]) -> bytes:
    """The bytes of checkpoint `data` in the format `path`'s name asks for."""
    if is_json(path):
        return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    return encode_protobuf(data)


def decode(path: str, raw: bytes) -> dict[str, Any]:
    """A checkpoint read back (either format); PcompileError when it is not one."""
    if is_json(path):
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PcompileError(f"strategy checkpoint {path!r} is not valid JSON: {exc}"
                                ) from None
        if not isinstance(data, dict):
            raise PcompileError(f"strategy checkpoint {path!r} is not a JSON object")
        return data
    try:
        return decode_protobuf(raw)
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise PcompileError(
            f"strategy checkpoint {path!r} is not a ParallelStrategyMap protobuf message "
            f"({exc}); a JSON checkpoint's name must end in .json") from None


def load_strategies(path: str, graph: Graph, data: Mapping[str, Any]) -> dict[Node, Any]:
    """Node -> strategy for every op of `graph` whose key checkpoint `data` (read from
    `path`) holds."""
    items = data.get("parallel_strategy_item")
    if not isinstance(items, dict):
        raise PcompileError(f"strategy checkpoint {path!r} has no 'parallel_strategy_item'")
    out: dict[Node, Any] = {}
    for node in _strategy_nodes(graph):
        key = strategy_key(node)
        if key is None or key not in items:
            continue
        try:
            strategy = tuple(tuple(int(c) for c in s)
                             for s in items[key]["parallel_strategy"])
        except (KeyError, TypeError, ValueError):
            raise PcompileError(f"strategy checkpoint {path!r}: item {key!r} has no valid "
                                "'parallel_strategy' (a list of lists of ints)") from None
        out[node] = strategy
    return out


# -- protobuf (proto2 wire format of node_strategy.proto's ParallelStrategyMap) ---------------
#
# ParallelStrategyMap: 1 current_stage (uint32), 2 parallel_strategy_item (repeated message),
#   3 parallel_layout_item (repeated message)
# ParallelStrategyItem: 1 node_name (string), 2 parallel_strategys {1 stage (uint32),
#   2 parallel_strategy (repeated {1 dim (repeated uint32)})}
# ParallelLayoutItem: 1 param_name (string), 2 parallel_layouts {1 dev_matrix (repeated
#   {1 dim uint32}), 2 tensor_map (repeated {1 dim int32}), 3 param_split_shape, 4
#   indices_offset (repeated {1 dim int64}), 5 field, 6 opt_weight_shard_step,
#   7 opt_weight_shard_size (int32)}
# Repeated scalars are unpacked (proto2's default); fields are written in number order.

_VARINT, _BYTES = 0, 2


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int32/int64 is its 64-bit two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _int_field(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _varint(value)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _key(number, _BYTES) + _varint(len(payload)) + payload


def _dims(values: Any) -> bytes:
    return b"".join(_int_field(1, int(v)) for v in values)


def encode_protobuf(data: Mapping[str, Any]) -> bytes:
    """Checkpoint `data` as a serialized `ParallelStrategyMap` (items in key order)."""
    out = bytearray(_int_field(1, int(data.get("current_stage", 0))))
    for name, item in sorted(data.get("parallel_strategy_item", {}).items()):
        strategys = _int_field(1, int(item.get("stage", 0))) + b"".join(
            _bytes_field(2, _dims(dims)) for dims in item["parallel_strategy"])
        out += _bytes_field(2, _bytes_field(1, name.encode()) + _bytes_field(2, strategys))
    for name, lay in sorted(data.get("parallel_layout_item", {}).items()):
        tmap = lay["tensor_map"]
        if any(isinstance(e, list) for e in tmap):  # one TensorMap per dim, as MindSpore
            maps = [e if isinstance(e, list) else [e] for e in tmap]
        else:
            maps = [tmap]
        layouts = (_bytes_field(1, _dims(lay["dev_matrix"]))
                   + b"".join(_bytes_field(2, _dims(m)) for m in maps)
                   + _bytes_field(3, b"") + _bytes_field(4, b"")
                   + _int_field(5, int(lay.get("field", 0)))
                   + _int_field(6, int(lay.get("opt_weight_shard_step", 0)))
                   + _int_field(7, int(lay.get("opt_weight_shard_size", 0))))
        out += _bytes_field(3, _bytes_field(1, name.encode()) + _bytes_field(2, layouts))
    return bytes(out)


def _fields(raw: bytes) -> list[tuple[int, Any]]:
    """(field number, int or bytes) of every field of one message."""
    out: list[tuple[int, Any]] = []
    pos = 0

    def varint() -> int:
        nonlocal pos
        value, shift = 0, 0
        while True:
            byte = raw[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value
            if shift > 70:
                raise ValueError("a varint longer than 10 bytes")

    while pos < len(raw):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            out.append((number, varint()))
        elif wire == _BYTES:
            size = varint()
            if pos + size > len(raw):
                raise ValueError("a field runs past the end of the message")
            out.append((number, raw[pos:pos + size]))
            pos += size
        else:
            raise ValueError(f"field {number} has wire type {wire}, which the message lacks")
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _dims_of(raw: bytes) -> list[int]:
    return [_signed(v) for n, v in _fields(raw) if n == 1]


def decode_protobuf(raw: bytes) -> dict[str, Any]:
    """A serialized `ParallelStrategyMap` as checkpoint data (the inverse of
    `encode_protobuf`); ValueError when the bytes are not one."""
    data: dict[str, Any] = {"current_stage": 0, "parallel_strategy_item": {},
                            "parallel_layout_item": {}}
    for number, value in _fields(raw):
        if number == 1 and isinstance(value, int):
            data["current_stage"] = value
        elif number == 2 and isinstance(value, bytes):
            name, stage, strategy = "", 0, []
            for n, v in _fields(value):
                if n == 1:
                    name = v.decode()
                elif n == 2:
                    for m, w in _fields(v):
                        if m == 1:
                            stage = w
                        elif m == 2:
                            strategy.append(_dims_of(w))
            data["parallel_strategy_item"][name] = {"stage": stage,
                                                    "parallel_strategy": strategy}
        elif number == 3 and isinstance(value, bytes):
            name = ""
            lay: dict[str, Any] = {"field": 0, "opt_weight_shard_step": 0,
                                   "opt_weight_shard_size": 0}
            maps: list[list[int]] = []
            for n, v in _fields(value):
                if n == 1:
                    name = v.decode()
                elif n == 2:
                    for m, w in _fields(v):
                        if m == 1:
                            lay["dev_matrix"] = _dims_of(w)
                        elif m == 2:
                            maps.append(_dims_of(w))
                        elif m in (5, 6, 7):
                            key = {5: "field", 6: "opt_weight_shard_step",
                                   7: "opt_weight_shard_size"}[m]
                            lay[key] = _signed(w)
            lay["tensor_map"] = (maps[0] if len(maps) == 1
                                 else [m[0] if len(m) == 1 else m for m in maps])
            data["parallel_layout_item"][name] = lay
        else:
            raise ValueError(f"unexpected field {number} in ParallelStrategyMap")
    return data
