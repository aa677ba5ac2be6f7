"""Strategy checkpoints (`strategy_ckpt_config`, reference §7), JSON in MindSpore's layout.

```
{"current_stage": 0,
 "parallel_strategy_item": {"MatMul_w": {"stage": 0, "parallel_strategy": [[2, 4], [4, 1]]}},
 "parallel_layout_item": {"w": {"dev_matrix": [2, 4, 1], "tensor_map": [1, -1],
                                "tensor_shape": [32, 16], "field": 0,
                                "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}
```

Strategy keys are `<PrimName>_<first parameter name>` (`strategy_key`), so only ops that
consume a parameter are saved; the first op with a key wins. Layout items hold every
parameter's layout (only trainable ones when `only_trainable_params`). Loading maps keys back
to the ops of the graph (`load_strategies`); in auto_parallel the loaded strategies are
configured strategies and override the search. MindSpore writes protobuf for other file
extensions; pcompile only reads and writes `.json`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pcompile.ir.core import Graph, GraphParam, Node
from pcompile.ir.errors import PcompileError
from pcompile.ir.sharding import rule_for


def strategy_key(node: Node) -> str | None:
    """`<PrimName>_<first parameter name>`, or None when the op reads no parameter."""
    for operand in node.operands:
        if isinstance(operand, GraphParam) and operand.kind != "input":
            return f"{node.op}_{operand.name}"
    return None


def _check_json(path: str, what: str) -> None:
    if not path.endswith(".json"):
        raise PcompileError(
            f"strategy_ckpt_config {what} {path!r}: pcompile reads and writes strategy "
            "checkpoints as JSON only; use a file name ending in .json"
        )


def _strategy_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if rule_for(n.op) is not None]


def save_checkpoint(path: str, graph: Graph, assignment: Any, only_trainable: bool = True
                    ) -> dict[str, Any]:
    """Write the strategies and parameter layouts of `assignment`; returns the JSON object."""
    _check_json(path, "save_file")
    items: dict[str, Any] = {}
    for node in _strategy_nodes(graph):
        key = strategy_key(node)
        sharding = assignment.sharding(node)
        if key is None or key in items or sharding is None:
            continue
        items[key] = {"stage": 0,
                      "parallel_strategy": [list(s) for s in sharding.strategy]}
    layouts: dict[str, Any] = {}
    for p in graph.params:
        if p.kind == "input" or (only_trainable and not p.requires_grad):
            continue
        lay = assignment.param_layouts[p.name]
        layouts[p.name] = {
            "dev_matrix": list(lay.dev_matrix),
            "tensor_map": [list(e) if isinstance(e, tuple) else e for e in lay.tensor_map],
            "tensor_shape": list(lay.shape),
            "field": 0,
            "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0,
        }
    data = {"current_stage": 0, "parallel_strategy_item": items,
            "parallel_layout_item": layouts}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    return data


def load_strategies(path: str, graph: Graph) -> dict[int, Any]:
    """id(node) -> strategy for every op of `graph` whose key the checkpoint holds."""
    _check_json(path, "load_file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise PcompileError(f"cannot read strategy checkpoint {path!r}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise PcompileError(f"strategy checkpoint {path!r} is not valid JSON: {exc}") from None
    items = data.get("parallel_strategy_item")
    if not isinstance(items, dict):
        raise PcompileError(f"strategy checkpoint {path!r} has no 'parallel_strategy_item'")
    out: dict[int, Any] = {}
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
        out[id(node)] = strategy
    return out
