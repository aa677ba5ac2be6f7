"""The cost model in seconds: device profiles, collectives, ops and redistributions.

`--search ilp` minimises this model's step time and every plan reports it (`predict.py`).

**Device profile** (`DeviceProfile`): peak matrix throughput per dtype (FLOP/s), memory
bandwidth (B/s), memory capacity (B), GPUs per node, and two links, inside a node and between
nodes, each a bandwidth (B/s per GPU, one direction) and a per-hop latency (s). Built in:
`h100` and `h200` (SXM, 8 per node, NVLink 4, 400 Gb/s per GPU between nodes), `cpu` (this
project's CPU machine: one host, gloo over the loopback). A user's cluster is a JSON file with
the same fields (`load_profile`, docs/search.md).

**Collectives** (ring algorithms; g ranks, B bytes, link (bw, lat) of the widest span):

* AllReduce of B:       2 (g - 1) lat + 2 (g - 1) / g * B / bw      (`all_reduce_time`)
* AllGather to B * g:   (g - 1) lat + (g - 1) * B / bw              (`all_gather_time`)
* ReduceScatter of B:   (g - 1) lat + (g - 1) / g * B / bw          (`reduce_scatter_time`)
* AlltoAll of B:        (g - 1) lat + (g - 1) / g * B / bw          (`all_to_all_time`)

A group lies inside a node when the ranks it spans (largest stride x size of its device axes)
fit in `node_size`; otherwise it runs at the inter-node link.

**An op** (`op_time`), on one rank's slices: compute = max(FLOPs / peak(dtype), bytes read and
written / memory bandwidth) (a roofline), times 3 for a training step's matrix products
(forward, two backward products) and 2 for the rest. Communication follows the parallel
passes' convention for gradients (passes/cotangents.py): a value several ranks hold carries a
share of its cotangent on each, and shares are summed only where the program sums them, so an
op's communication is its forward AllReduce / ReduceScatter and, in training, their vjps (an
AllReduce; an AllGather), plus for every trainable weight it reads the mirror: an AllReduce of
the gradient slice over the ranks holding the same slice (the weight layout's repeat axes),
whether the computation is split over them (data parallelism) or repeated. Under the parallel
optimizer that AllReduce is a ReduceScatter of the gradient and an AllGather of the updated
weight over the same ranks (`_weight_sharded`). An embedding's shares may be summed on its
output instead, whichever moves fewer bytes (`plan_cotangent_reductions`). Not modeled (it only
moves fewer bytes): a forward AllReduce whose vjp is local because the cotangent is alike on
every rank (`replicated_cotangents`).

**A redistribution** (`redistribution_time`): each step of the planner's op list at its group's
link: a Concat is an AllGather (its backward a ReduceScatter), a Permute an AlltoAll each way, a
Split is local both ways (its vjp pads the cotangent share with zeros).

**Memory**: parameter slices x (weight + gradient + optimizer states) bytes, divided by the
slice's repeat count under the parallel optimizer (`param_memory`); plus the activations the
backward reads (each op's output slice, `ilp.Costs.memory`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from math import prod
from typing import Any

from pcompile.ir.core import GraphParam, Node, NodeResult, Value
from pcompile.ir.flops import node_flops
from pcompile.ir.layout import TensorLayout
from pcompile.ir.registry import Trait, has_trait
from pcompile.ir.sharding import OpSharding
from pcompile.ir.types import TensorType
from pcompile.passes.redistribution import plan_redistribution


class ProfileError(ValueError):
    """A device profile file that cannot be used (the message says which field)."""


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per GPU, one direction
    latency: float  # seconds per ring hop


@dataclass(frozen=True)
class DeviceProfile:
    """One device kind and the cluster it sits in (module docstring)."""

    name: str
    flops: tuple[tuple[str, float], ...]  # dtype name -> peak FLOP/s of matrix products
    memory_bandwidth: float
    memory: float
    node_size: int
    intra: Link
    inter: Link

    def peak(self, dtype: str) -> float:
        table = dict(self.flops)
        return table.get(dtype, table.get("float32", min(table.values())))

    def link(self, span: int) -> Link:
        """The link of a group whose ranks span `span` consecutive ranks."""
        return self.intra if span <= self.node_size else self.inter

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "flops": dict(self.flops),
                "memory_bandwidth": self.memory_bandwidth, "memory": self.memory,
                "node_size": self.node_size,
                "intra_node": {"bandwidth": self.intra.bandwidth,
                               "latency": self.intra.latency},
                "inter_node": {"bandwidth": self.inter.bandwidth,
                               "latency": self.inter.latency}}


_NVLINK4 = Link(bandwidth=450e9 * 0.8, latency=3e-6)  # 900 GB/s both ways, NCCL's ~80 %
_IB_400G = Link(bandwidth=50e9 * 0.9, latency=6e-6)  # 400 Gb/s per GPU
PROFILES: dict[str, DeviceProfile] = {
    # H100 SXM: 989 TFLOP/s dense bf16/fp16, 494 TF32 (JAX's default float32 matmul on GPU)
    "h100": DeviceProfile("h100", (("bfloat16", 989e12), ("float16", 989e12),
                                   ("float32", 494e12)),
                          3.35e12, 80e9, 8, _NVLINK4, _IB_400G),
    "h200": DeviceProfile("h200", (("bfloat16", 989e12), ("float16", 989e12),
                                   ("float32", 494e12)),
                          4.8e12, 141e9, 8, _NVLINK4, _IB_400G),
    # this project's CPU machine: XLA's CPU matmuls, gloo collectives over the loopback
    "cpu": DeviceProfile("cpu", (("bfloat16", 2e10), ("float16", 1e10), ("float32", 6e10)),
                         1e10, 16e9, 1 << 30, Link(2e9, 5e-5), Link(2e9, 5e-5)),
}
DEFAULT_PROFILE = "h100"


def _positive(data: dict[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ProfileError(f"{where}: {key!r} must be a positive number, got {value!r}")
    return float(value)


def profile_from_dict(data: Any, where: str = "device profile") -> DeviceProfile:
    """A profile from its JSON form (the fields of `DeviceProfile.as_dict`)."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a JSON object with the fields name, flops, "
                           "memory_bandwidth, memory, node_size, intra_node, inter_node")
    flops = data.get("flops")
    if not isinstance(flops, dict) or not flops:
        raise ProfileError(f"{where}: 'flops' must map dtype names (bfloat16, float16, "
                           "float32) to peak FLOP/s")
    links = []
    for key in ("intra_node", "inter_node"):
        link = data.get(key)
        if not isinstance(link, dict):
            raise ProfileError(f"{where}: {key!r} must be an object with bandwidth (bytes/s) "
                               "and latency (s)")
        links.append(Link(_positive(link, "bandwidth", f"{where} {key}"),
                          _positive(link, "latency", f"{where} {key}")))
    node_size = data.get("node_size")
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ProfileError(f"{where}: 'node_size' must be a positive integer (GPUs per node), "
                           f"got {node_size!r}")
    return DeviceProfile(str(data.get("name", "custom")),
                         tuple(sorted((str(k), _positive(flops, k, f"{where} flops"))
                                      for k in flops)),
                         _positive(data, "memory_bandwidth", where),
                         _positive(data, "memory", where), node_size, links[0], links[1])


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name, or a JSON file's."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    try:
        with open(name_or_path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ProfileError(f"device profile {name_or_path!r} is neither a built-in profile "
                           f"({', '.join(PROFILES)}) nor a file") from None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"device profile {name_or_path}: cannot read it as JSON ({exc})"
                           ) from None
    return profile_from_dict(data, name_or_path)


# -- collectives ----------------------------------------------------------------------------------


def all_reduce_time(nbytes: float, group: int, link: Link) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (group - 1) * link.latency + 2 * (group - 1) / group * nbytes / link.bandwidth


def all_gather_time(local_bytes: float, group: int, link: Link) -> float:
    if group <= 1 or local_bytes <= 0:
        return 0.0
    return (group - 1) * link.latency + (group - 1) * local_bytes / link.bandwidth


def reduce_scatter_time(nbytes: float, group: int, link: Link) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (group - 1) * link.latency + (group - 1) / group * nbytes / link.bandwidth


def all_to_all_time(nbytes: float, group: int, link: Link) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (group - 1) * link.latency + (group - 1) / group * nbytes / link.bandwidth


# -- rank-space axes ------------------------------------------------------------------------------

Axis = tuple[int, int]  # (stride in rank space, size)


def layout_axes(layout: TensorLayout) -> set[Axis]:
    """The device axes `layout` splits its tensor over, as (rank stride, size)."""
    dev = layout.dev_matrix
    out = set()
    for a in layout.used_axes:
        if dev[a] > 1:
            out.add((prod(dev[a + 1:]), dev[a]))
    return out


def group_of(axes: set[Axis] | list[Axis]) -> tuple[int, int]:
    """(group size, rank span) of a collective over `axes`."""
    size = prod(s for _, s in axes)
    span = max((st * s for st, s in axes), default=1)
    return size, span


def comm_axes(sharding: OpSharding, axes: tuple[int, ...], devices: int) -> set[Axis]:
    """The rank-space axes of a forward collective over the op's device-matrix `axes` (the
    matrix before the repeat, which MindSpore appends on the right)."""
    dev = sharding.dev_matrix
    repeat = max(devices // max(prod(dev), 1), 1)
    return {(prod(dev[a + 1:]) * repeat, dev[a]) for a in axes if dev[a] > 1}


# -- ops ------------------------------------------------------------------------------------------


@dataclass
class OpTime:
    """Seconds of one op (or edge) on one rank for one step."""

    compute: float = 0.0
    comm: float = 0.0
    comm_bytes: float = 0.0  # bytes each rank sends or receives, forward and backward
    # of which the weights' gradient collectives (the mirror, the parallel optimizer's): once
    # per step however many micro-batches the step runs (stages.py)
    weight_comm: float = 0.0
    weight_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.comm


def stored_param(value: Value) -> GraphParam | None:
    """The stored parameter `value` reads, through single-operand pass-through ops (Cast)."""
    while isinstance(value, NodeResult) and has_trait(value.node.op, Trait.VALUE_COPY) \
            and len(value.node.operands) == 1:
        value = value.node.operands[0]
    return value if isinstance(value, GraphParam) and value.kind != "input" else None


def differentiable(graph: Any) -> set[int]:
    """id() of the values a training step differentiates: trainable weights and the
    floating-point results computed from them (data, constants, masks and integer values
    have no gradient, so nothing is communicated for them in the backward)."""
    out: set[int] = set()
    for p in graph.params:
        if p.kind == "weight" and p.requires_grad:
            out.add(id(p))
    for node in graph.nodes:
        t = node.result.type
        floating = not isinstance(t, TensorType) or t.dtype.is_float
        if floating and any(id(v) in out for v in node.operands):
            out.add(id(node.result))
    return out


def _needs_grad(value: Value, grad: set[int] | None) -> bool:
    t = value.type
    if not isinstance(t, TensorType) or not t.dtype.is_float:
        return False
    if grad is not None:
        return id(value) in grad
    param = stored_param(value)
    if param is not None:
        return param.kind == "weight" and bool(param.requires_grad)
    return not (isinstance(value, GraphParam) and value.kind == "input")


def _bytes(layout: TensorLayout, itemsize: int) -> float:
    return float(prod(layout.slice_shape) * itemsize)


def op_time(node: Node, sharding: OpSharding, devices: int, profile: DeviceProfile,
            training: bool, grad: set[int] | None = None,
            parallel_optimizer: bool = False, owned: Collection[int] | None = None) -> OpTime:
    """One rank's seconds for `node` laid out by `sharding` (module docstring); `grad`: the
    values that get a gradient (`differentiable`; None: every floating input but data);
    `parallel_optimizer`: its weights are stored sharded over their repeat groups; `owned`:
    the operand indices whose weight gradient this op reduces (the weight's first user, where
    the weight is stored; None: every weight operand)."""
    in_types = [v.type for v in node.operands if isinstance(v.type, TensorType)]
    out_t = node.result.type
    out_types = [out_t] if isinstance(out_t, TensorType) else [
        t for t in getattr(out_t, "elements", ()) if isinstance(t, TensorType)]
    axes: set[Axis] = set()
    for lay in (*sharding.in_layouts, *sharding.out_layouts):
        axes |= layout_axes(lay)
    forward_axes: set[Axis] = set()
    for fc in sharding.forward:
        if fc.kind in ("AllReduce", "ReduceScatter"):
            forward_axes |= comm_axes(sharding, fc.axes, devices)
    axes |= forward_axes
    degree = prod(s for _, s in axes) if axes else 1
    moved = sum(_bytes(lay, t.dtype.itemsize) for lay, t in zip(sharding.in_layouts, in_types))
    moved += sum(_bytes(lay, t.dtype.itemsize)
                 for lay, t in zip(sharding.out_layouts, out_types))
    flops = node_flops(node) / degree
    dtype = in_types[0].dtype.name if in_types else "float32"
    matrix = flops > 0
    compute = max(flops / profile.peak(dtype), moved / profile.memory_bandwidth)
    if training:
        compute *= 3 if matrix else 2
    result = OpTime(compute=compute)
    # the parallel passes' convention (passes/cotangents.py): a value several ranks hold carries
    # a share of its cotangent on each; shares are summed where a forward collective's vjp
    # sums them (AllReduce <-> AllReduce, ReduceScatter <-> AllGather) and at each replicated
    # weight's mirror, nowhere else (a split's vjp is a zero pad)
    backward = training and (id(node.result) in grad if grad is not None else True)
    for fc in sharding.forward:
        if fc.kind not in ("AllReduce", "ReduceScatter") or not sharding.out_layouts:
            continue
        group, span = group_of(comm_axes(sharding, fc.axes, devices))
        if group <= 1:
            continue
        local = _bytes(sharding.out_layouts[0], out_types[0].dtype.itemsize)
        link = profile.link(span)
        times = 2 if backward else 1
        if fc.kind == "AllReduce":
            result.comm += times * all_reduce_time(local, group, link)
            result.comm_bytes += times * 2 * (group - 1) / group * local
        else:
            result.comm += reduce_scatter_time(local * group, group, link)
            result.comm_bytes += (group - 1) * local
            if backward:
                result.comm += all_gather_time(local, group, link)
                result.comm_bytes += (group - 1) * local
    if not training:
        return result
    operands = [v for v in node.operands if isinstance(v.type, TensorType)]
    index = [i for i, v in enumerate(node.operands) if isinstance(v.type, TensorType)]
    for i, value, lay in zip(index, operands, sharding.in_layouts):
        param = stored_param(value)
        if param is None or not _needs_grad(value, grad) or (owned is not None
                                                             and i not in owned):
            continue  # an activation: its cotangent shares are summed where its producer's are
        local = float(prod(lay.slice_shape) * param.tensor_type.dtype.itemsize)
        repeat = repeat_axes(lay)
        if parallel_optimizer:
            # the gradient reduce-scattered over the ranks holding the same slice, the updated
            # weight all-gathered over them
            comm, nbytes = result.comm, result.comm_bytes
            _weight_sharded(result, local, repeat, repeat, profile)
            result.weight_comm += result.comm - comm
            result.weight_bytes += result.comm_bytes - nbytes
            continue
        group, span = group_of(repeat)
        if group <= 1:
            continue
        # the mirror: the gradient's shares summed over the slice's holders; or, for a weight
        # that is the op's only differentiable input (an embedding's Gather), the shares summed
        # on the op's output over the axes both repeat, then the gradient over the rest
        # (passes/cotangents.py chooses whichever moves fewer bytes)
        full = all_reduce_time(local, group, profile.link(span))
        full_bytes = 2 * (group - 1) / group * local
        alone = not sharding.forward and len(out_types) == 1 and out_types[0].dtype.is_float \
            and not has_trait(node.op, Trait.VALUE_COPY) \
            and not any(v is not value and _needs_grad(v, grad) for v in operands)
        if alone:
            shared = repeat & repeat_axes(sharding.out_layouts[0])
            b_group, b_span = group_of(shared)
            a_group, a_span = group_of(repeat - shared)
            if b_group > 1:
                out_local = _bytes(sharding.out_layouts[0], out_types[0].dtype.itemsize)
                split_bytes = (2 * (b_group - 1) / b_group * out_local
                               + 2 * (a_group - 1) / a_group * local)
                if split_bytes < full_bytes:
                    full = (all_reduce_time(out_local, b_group, profile.link(b_span))
                            + all_reduce_time(local, a_group, profile.link(a_span)))
                    full_bytes = split_bytes
        result.comm += full
        result.comm_bytes += full_bytes
        result.weight_comm += full
        result.weight_bytes += full_bytes
    return result


def repeat_axes(layout: TensorLayout) -> set[Axis]:
    """The device axes (rank stride, size) a layout repeats its slice over."""
    dev = layout.dev_matrix
    return {(prod(dev[a + 1:]), dev[a]) for a in layout.repeat_axes if dev[a] > 1}


def _weight_sharded(result: OpTime, local: float, partial: set[Axis], repeat: set[Axis],
                    profile: DeviceProfile) -> None:
    """The parallel optimizer's traffic for one weight slice of `local` bytes: a
    ReduceScatter over the `partial` axes, then an AllGather over the `repeat` axes."""
    group, span = group_of(partial)
    if group > 1:
        result.comm += reduce_scatter_time(local, group, profile.link(span))
        result.comm_bytes += (group - 1) / group * local
    group, span = group_of(repeat)
    if group > 1:
        result.comm += all_gather_time(local / group, group, profile.link(span))
        result.comm_bytes += (group - 1) / group * local


def redistribution_time(src: TensorLayout, dst: TensorLayout, itemsize: int,
                        profile: DeviceProfile, training: bool,
                        enable_alltoall: bool = False) -> OpTime:
    """Seconds of turning `src` into `dst` (and, `training` (the value has a gradient), its
    cotangent back)."""
    plan = plan_redistribution(src, dst, enable_alltoall)
    out = OpTime()
    for op in plan.ops:
        size = float(prod(op.in_shape) * itemsize)
        link = profile.link(op.stride * op.count)
        if op.kind == "Concat":
            out.comm += all_gather_time(size, op.count, link)
            out.comm_bytes += (op.count - 1) * size
            if training:
                out.comm += reduce_scatter_time(size * op.count, op.count, link)
                out.comm_bytes += (op.count - 1) * size
        elif op.kind == "Permute":
            once = all_to_all_time(size, op.count, link)
            out.comm += once * (2 if training else 1)
            out.comm_bytes += (op.count - 1) / op.count * size * (2 if training else 1)
        elif op.kind == "Split":  # its vjp is a zero pad: no communication
            out.compute += size / op.count / profile.memory_bandwidth
        elif op.kind == "Reshape":
            out.compute += 2 * size / profile.memory_bandwidth
    return out


# -- memory ---------------------------------------------------------------------------------------


@dataclass
class Memory:
    """Bytes per rank by kind."""

    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def add(self, other: Memory, times: float = 1.0) -> None:
        self.weights += other.weights * times
        self.gradients += other.gradients * times
        self.optimizer += other.optimizer * times
        self.activations += other.activations * times

    def as_dict(self) -> dict[str, int]:
        return {"weights": round(self.weights), "gradients": round(self.gradients),
                "optimizer": round(self.optimizer), "activations": round(self.activations),
                "total": round(self.total)}


@dataclass(frozen=True)
class MemoryOptions:
    """What a parameter costs besides its slice: the optimizer's states per element (Adam: 2)
    in the parameter's dtype, and whether the parallel optimizer shards weights, gradients and
    states over the slice's repeat group."""

    optimizer_states: int = 2
    parallel_optimizer: bool = False
    training: bool = True


def param_memory(param: GraphParam, layout: TensorLayout, options: MemoryOptions) -> Memory:
    t = param.type
    assert isinstance(t, TensorType)
    local = float(prod(layout.slice_shape) * t.dtype.itemsize)
    trained = options.training and param.kind == "weight" and bool(param.requires_grad)
    share = layout.repeat_count if options.parallel_optimizer and trained else 1
    return Memory(weights=local / share,
                  gradients=local / share if trained else 0.0,
                  optimizer=local * options.optimizer_states / share if trained else 0.0)
