"""The parallel optimizer (`enable_parallel_optimizer`, ZeRO-like; reference §7).

A trainable parameter replicated over a group of k ranks is stored split further on dim 0
over a *shard group* of those ranks (all k, or `optimizer_weight_shard_size` consecutive
members), and so is its optimizer state. In the forward graph the slice is rebuilt by an
AllGather over the shard group; its vjp is a ReduceScatter, so each rank receives the summed
gradient of exactly the part it stores and updates only that part. Ranks that hold the same
part in different shard groups still all-reduce it (a mirror over the remaining group).

Eligible: `parallel_optimizer=True` on the Parameter, full size >= `parallel_optimizer_threshold`
KB, and dim 0 of its slice divisible by the shard-group size.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from pcompile.ir.core import Graph
from pcompile.ir.errors import PcompileError
from pcompile.ir.layout import TensorLayout, group_name, map_axes
from pcompile.passes.layouts import OptShard
from pcompile.passes.unit import CompileUnit, OptimizerShardOptions, ParameterFacts


def plan_optimizer_sharding(
    graph: Graph,
    layouts: dict[str, TensorLayout],
    params: Mapping[str, object],
    threshold_kb: int,
    shard_size: int,
    pinned: tuple[str, ...] | None = None,
) -> dict[str, OptShard]:
    """Decide which weights are stored sharded, and how. `pinned` (the shrunk check): exactly
    these weights, as the full-size plan decided by their sizes."""
    out: dict[str, OptShard] = {}
    for p in graph.weights:
        if not p.requires_grad or not p.shape:
            continue
        if pinned is not None:
            if p.name not in pinned:
                continue
            threshold_kb = 0
        owner = params.get(p.name)
        if owner is not None and (not getattr(owner, "parallel_optimizer", True)
                                  or getattr(owner, "layerwise_parallel", False)):
            continue
        if p.tensor_type.nbytes < threshold_kb * 1024:
            continue
        model = layouts[p.name]
        use = model.normalized()
        free = [a for a in range(len(use.dev_matrix)) if a not in use.used_axes]
        if not free:
            continue
        use, free = _refine_for(use, free, shard_size)
        axes = _shard_axes(use, free, shard_size, p.name)
        size = prod(use.dev_matrix[a] for a in axes)
        if size <= 1 or use.slice_shape[0] % size:
            if pinned is not None:
                raise PcompileError(
                    f"the shrunk copy cannot store {p.name} ({list(p.shape)}) sharded as the "
                    f"plan does (its first dim's slice {use.slice_shape[0]} over {size} "
                    "ranks); --check-shrunk with a smaller factor, or --force-check")
            continue
        dev = use.dev_matrix
        first = tuple(map_axes(use.tensor_map[0])) + tuple(len(dev) - 1 - a for a in axes)
        entry = first[0] if len(first) == 1 else first
        stored = TensorLayout(dev, (entry,) + tuple(use.tensor_map[1:]), use.shape)
        out[p.name] = OptShard(use, stored, axes, model)
    return out


def _refine_for(use: TensorLayout, free: list[int], shard_size: int
                ) -> tuple[TensorLayout, list[int]]:
    """Split a free device axis so that `shard_size` consecutive members of the replication
    group form trailing axes (e.g. [8] -> [4, 2] for groups of 2)."""
    if shard_size in (-1, 0):
        return use, free
    need = shard_size
    for a in reversed(free):
        size = use.dev_matrix[a]
        if need % size == 0:
            need //= size
            continue
        if size % need or need == 1:
            return use, free
        dev = list(use.dev_matrix)
        dev[a:a + 1] = [size // need, need]
        n_old = len(use.dev_matrix)

        def remap(v: int, n_old: int = n_old, a: int = a) -> int:
            # values count from the right: axes left of `a` move one further from the right
            return v + 1 if n_old - 1 - v < a else v

        tmap = tuple(tuple(remap(v) for v in e) if isinstance(e, tuple)
                     else (e if e == -1 else remap(e)) for e in use.tensor_map)
        refined = TensorLayout(tuple(dev), tmap, use.shape)
        return refined, [b for b in range(len(dev)) if b not in refined.used_axes]
    return use, free


def _shard_axes(use: TensorLayout, free: list[int], shard_size: int, name: str
                ) -> tuple[int, ...]:
    """All free axes (shard_size -1), or the trailing free axes whose sizes multiply to
    `shard_size` (consecutive members of the replication group)."""
    if shard_size in (-1, 0):
        return tuple(free)
    chosen: list[int] = []
    size = 1
    for a in reversed(free):
        if size == shard_size:
            break
        chosen.insert(0, a)
        size *= use.dev_matrix[a]
    if size != shard_size:
        total = prod(use.dev_matrix[a] for a in free)
        if shard_size >= total:
            return tuple(free)
        raise PcompileError(
            f"optimizer_weight_shard_size={shard_size} does not split the {total} ranks that "
            f"replicate parameter {name} (device axes {[use.dev_matrix[a] for a in free]}) "
            "into consecutive groups; use a product of trailing axis sizes or -1"
        )
    return tuple(chosen)


__all__ = ["plan_optimizer_sharding"]


def optimizer_sharding(unit: CompileUnit, layouts: dict[str, TensorLayout],
                       parameters: Mapping[str, ParameterFacts],
                       options: OptimizerShardOptions) -> dict[str, OptShard]:
    """The parallel optimizer's plan when `enable_parallel_optimizer` is set for training,
    recorded in the plan (`parallel_optimizer`); {} otherwise."""
    if not (unit.training and options.enabled):
        return {}
    assert unit.graph is not None
    plan = plan_optimizer_sharding(unit.graph, layouts, dict(parameters), options.threshold_kb,
                                   options.shard_size, options.pinned)
    unit.plan.parallel_optimizer = {
        name: {"stored_dev_matrix": list(s.stored.dev_matrix),
               "stored_tensor_map": [list(e) if isinstance(e, tuple) else e
                                     for e in s.stored.tensor_map],
               "stored_slice_shape": list(s.stored.slice_shape),
               "opt_shard_group": group_name(s.shard_group(0), unit.devices)}
        for name, s in plan.items()
    }
    return plan
