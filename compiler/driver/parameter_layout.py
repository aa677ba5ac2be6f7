"""MindSpore's `parameter_layout_dict`: the six-field layout of every graph parameter.

MindSpore's `Cell.parameter_layout_dict[name]` (`GetParameterLayoutFromGraph` in its
`parallel/graph_util/get_parallel_info.cc`) is a tuple

    (dev_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group)

* `dev_matrix`, `tensor_map`: the normalised layout (size-1 device axes removed, the map
  renumbered; reference §1.1), a multi-axis entry flattened into the list (`((2, 0), 1)` ->
  `[2, 0, 1]`, its extended layout);
* `slice_shape`: the model-parallel slice (before the parallel optimizer's split);
* `field_size`: 0 (field-split embeddings are not supported); `uniform_split`: True;
* `opt_shard_group`: the parallel optimizer's group name of the rank (its AllGather's group;
  `""` when the parameter is not optimizer-sharded).

Graph inputs are listed too, with the layout their data set gives them (full batch: replicated),
and optimizer states with their parameter's layout (MindSpore lists a parameter's clones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pcompile.ir.layout import TensorLayout, group_name, map_axes

if TYPE_CHECKING:
    from pcompile.compiler.driver.compiled import CompileState

ParameterLayout = tuple[list[int], list[int], list[int], int, bool, str]


def normalized_fields(layout: TensorLayout) -> tuple[list[int], list[int]]:
    """MindSpore's (device arrangement, tensor map) of `layout`: normalised, flattened."""
    norm = layout.normalized()
    tmap: list[int] = []
    for entry in norm.tensor_map:
        tmap.extend(map_axes(entry) if isinstance(entry, tuple) else (entry,))
    return list(norm.dev_matrix), tmap


def use_layout(state: CompileState, name: str) -> TensorLayout | None:
    """The layout a parameter is used with (an optimizer-sharded one is stored split further;
    MindSpore describes it by its use layout plus its shard group)."""
    shard = state.opt_shard.get(name)
    if shard is not None:
        return shard.model or shard.use  # type: ignore[no-any-return]
    if state.assignment is None:
        return None
    return state.assignment.param_layouts.get(name)


def parameter_layout_dict(state: CompileState, rank: int = 0) -> dict[str, ParameterLayout]:
    """MindSpore's six-field layout of every parameter and input, for `rank`."""
    out: dict[str, ParameterLayout] = {}
    graph = state.graph
    if graph is None or not state.parallel:
        return out
    for p in graph.params:
        layout = use_layout(state, p.name)
        if layout is None:
            continue
        dev, tmap = normalized_fields(layout)
        shard = state.opt_shard.get(p.name)
        group = group_name(shard.shard_group(rank), state.devices) if shard is not None else ""
        out[p.name] = (dev, tmap, list(layout.slice_shape), 0, True, group)
    layouts = state.assignment.param_layouts if state.assignment is not None else {}
    for name, owner in state.state_owners.items():  # optimizer states: their parameter's
        own = layouts.get(name)
        if own is not None and owner in layouts and own.shape != layouts[owner].shape:
            # a factored state (AdaFactor's row / column statistics) has its own layout
            dev, tmap = normalized_fields(own)
            out[name] = (dev, tmap, list(own.slice_shape), 0, True, "")
        elif owner in out:
            out[name] = out[owner]
    return out


def as_json(layouts: dict[str, ParameterLayout]) -> dict[str, list[Any]]:
    return {name: list(fields) for name, fields in layouts.items()}
