"""All ranks' graphs as ONE JAX SPMD program (`shard_map` over a mesh of the ranks).

`SpmdPlan` (backends/jax/plan.py) checks that the rank graphs share one structure and records
what differs per rank. Here the plan becomes a body function that runs on every device of a
mesh: rank-dependent values (slice offsets, constants, attribute variants, fallback group
tables) are tables indexed by `lax.axis_index` of the mesh axes, never Python constants, so
every device (and every process under `jax.distributed`) runs the same HLO.

Collectives lower to `lax.psum`/`pmax`/`pmin`, `all_gather(tiled)`, `psum_scatter(tiled)` and
`all_to_all(tiled)` over the mesh axes whose variation gives exactly the node's groups (in
`rank_list` order). JAX's `axis_index_groups` is not used: `psum` with groups raises
NotImplementedError inside `shard_map` in this JAX, while sub-axes express every group that a
device matrix builds. Groups that no set of mesh axes gives use an exact fallback:
`all_gather` over all ranks, then each rank picks its group's members from a table (N/g times
the traffic of the grouped collective; `GroupCollective`).

The helpers below (`all_reduce`, `all_gather`, ..., `dyn_slice`) are the building blocks of both
this in-process lowering and the generated per-rank programs (`backends/jax/codegen.py`).

`JaxSpmdRunner(program)` runs a compiled program on N devices of this process (N virtual CPU
devices: set `jax.config.update("jax_num_cpu_devices", N)` before JAX initialises) with the
interface of `tools.runners.ParallelRunner`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pcompile.backends.jax.collectives import COLLECTIVES
from pcompile.backends.jax.lowering import within_lowering
from pcompile.backends.jax.plan import MeshSpec, NodePlan, SpmdLoweringError, SpmdPlan
from pcompile.ir.core import Constant
from pcompile.ir.lowering import LoweringOptions
from pcompile.ir.registry import get_op
from pcompile.ir.types import DType

if TYPE_CHECKING:
    from pcompile.compiler.driver.compiled import CompiledProgram

Axes = tuple[str, ...]


# -- collectives over mesh axes -----------------------------------------------------------------


def _each(fn: Callable[[Any], Any], xs: Sequence[Any]) -> Any:
    """Fused collectives take several operands and return a tuple."""
    outs = [fn(x) for x in xs]
    return outs[0] if len(outs) == 1 else tuple(outs)


def all_reduce(*xs: Any, axes: Axes, op: str = "sum") -> Any:
    """AllReduce over the ranks that vary along `axes`."""
    if not axes:
        return xs[0] if len(xs) == 1 else tuple(xs)
    if op == "sum":
        out = lax.psum(tuple(xs), axes)
        return out[0] if len(xs) == 1 else tuple(out)
    if op == "max":
        return _each(lambda x: lax.pmax(x, axes), xs)
    if op == "min":
        return _each(lambda x: lax.pmin(x, axes), xs)
    if op == "prod":
        return _each(lambda x: jnp.prod(lax.all_gather(x, axes), axis=0).astype(x.dtype), xs)
    raise SpmdLoweringError(f"AllReduce op {op!r} has no JAX lowering")


def all_gather(*xs: Any, axes: Axes) -> Any:
    """AllGather: concatenation along dim 0 in group order."""
    if not axes:
        return xs[0] if len(xs) == 1 else tuple(xs)
    return _each(lambda x: lax.all_gather(x, axes, tiled=True), xs)


def reduce_scatter(*xs: Any, axes: Axes, op: str = "sum") -> Any:
    """ReduceScatter: reduce, then block `i` of dim 0 to the i-th rank of the group."""
    if not axes:
        return xs[0] if len(xs) == 1 else tuple(xs)
    if op == "sum":
        return _each(lambda x: lax.psum_scatter(x, axes, tiled=True), xs)

    def other(x: Any) -> Any:
        total = all_reduce(x, axes=axes, op=op)
        size = x.shape[0] // _axes_size(axes)
        return lax.dynamic_slice_in_dim(total, lax.axis_index(axes) * size, size, 0)

    return _each(other, xs)


def all_to_all(*xs: Any, axes: Axes, split_dim: int, concat_dim: int) -> Any:
    """AlltoAll: block i of `split_dim` to the i-th rank; received blocks along `concat_dim`."""
    if not axes:
        return xs[0] if len(xs) == 1 else tuple(xs)
    return _each(lambda x: lax.all_to_all(x, axes, split_dim % x.ndim, concat_dim % x.ndim,
                                          tiled=True), xs)


def broadcast(*xs: Any, axes: Axes, root: int = 0) -> Any:
    """Broadcast: every rank of the group gets the `root`-th member's value."""
    if not axes:
        return xs[0] if len(xs) == 1 else tuple(xs)
    return _each(lambda x: lax.all_gather(x, axes)[root], xs)


def _axes_size(axes: Axes) -> int:
    return int(np.prod([lax.axis_size(a) for a in axes])) if axes else 1


# -- the exact fallback for groups that no mesh axes give ----------------------------------------


def group_members(x: Any, all_axes: Axes, members: Any) -> Any:
    """Every member's x, shape (g, *x.shape), in group order: gather from all ranks, pick."""
    every = lax.all_gather(x, all_axes)
    return jnp.take(every, members, axis=0)


_REDUCERS: dict[str, Callable[..., Any]] = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min,
                                            "prod": jnp.prod}


def group_all_reduce(parts: Any, x: Any, position: Any, op: str = "sum", **_: Any) -> Any:
    return _REDUCERS[op](parts, axis=0).astype(x.dtype)


def group_all_gather(parts: Any, x: Any, position: Any, **_: Any) -> Any:
    return parts.reshape((parts.shape[0] * x.shape[0],) + x.shape[1:])


def group_reduce_scatter(parts: Any, x: Any, position: Any, op: str = "sum", **_: Any) -> Any:
    total = group_all_reduce(parts, x, position, op)
    size = x.shape[0] // parts.shape[0]
    return lax.dynamic_slice_in_dim(total, position * size, size, 0)


def group_all_to_all(parts: Any, x: Any, position: Any, *, split_dim: int, concat_dim: int,
                     **_: Any) -> Any:
    g = parts.shape[0]
    split, concat = split_dim % x.ndim, concat_dim % x.ndim
    size = x.shape[split] // g
    mine = lax.dynamic_slice_in_dim(parts, position * size, size, split + 1)
    return jnp.concatenate([mine[j] for j in range(g)], axis=concat)


def group_broadcast(parts: Any, x: Any, position: Any, root_rank: int = 0, **_: Any) -> Any:
    return parts[root_rank]


def group_collective(prim: str, *xs: Any, all_axes: Axes, members: Any, position: Any,
                     **attrs: Any) -> Any:
    """Collective `prim` (IR op name) over an arbitrary group: `members` (this rank's group, a
    traced row of a table) and `position` (this rank's index in it). Exact; costs an
    all-gather over all ranks. The collective's row (`backends/jax/collectives.py`) names
    its `group_*` function above: f(every member's x in group order, x, position, **attrs)."""
    row = COLLECTIVES.get(prim)
    if row is None:
        raise SpmdLoweringError(f"no JAX lowering for collective {prim}")
    run = globals()[row.over_group]
    return _each(lambda x: run(group_members(x, all_axes, members), x, position, **attrs), xs)


# -- rank-dependent slices ---------------------------------------------------------------------


def rank_offsets(me: Any, base: tuple[int, ...],
                 terms: tuple[tuple[tuple[int, int, int], ...], ...]) -> tuple[Any, ...]:
    """A layout's slice offsets at traced rank `me` (`ir.rank.RankOffsets`): per dim,
    `base + sum((me // stride) % count * unit)`."""
    return tuple(jnp.asarray(b + sum(((me // s) % c) * u for s, c, u in ts), jnp.int32)
                 for b, ts in zip(base, terms))


def slice_starts(s: Any, me: Any) -> Any:
    """The offsets of SlicePlan `s` at traced rank `me`: computed, or read from its table."""
    if s.offsets is not None:
        return rank_offsets(me, s.offsets.base, s.offsets.terms)
    return jnp.asarray(s.starts)[me]


def dyn_slice(x: Any, starts: Any, span: tuple[int, ...], steps: tuple[int, ...]) -> Any:
    """StridedSlice at traced offsets `starts`: `span` elements, every `steps`-th kept."""
    out = lax.dynamic_slice(x, tuple(starts[i] for i in range(x.ndim)), span)
    if any(s != 1 for s in steps):
        out = out[tuple(slice(None, None, s) for s in steps)]
    return out


def zeros_after(x: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of `shape` in x's dtype that XLA can compute only once `x` is: a broadcast of
    `|s| * 0` (s one element of x, 0 where it is not finite; exactly +0).

    A gradient written into a zero buffer (`dynamic_update_slice`, in place) needs a buffer of
    its own. With constant zeros, XLA merges every such buffer of one shape into one
    broadcast and gives each user a copy, scheduled at the start of the step: each backward
    slice's full-size buffer then lives through the whole forward pass (on the Llama example
    on 8 ranks, most of the step's temporary memory and what recompute could not remove;
    docs/benchmarks.md). Depending on x, the buffer is made when the gradient arrives."""
    s = jnp.ravel(x)[0] if x.size else jnp.zeros((), x.dtype)
    zero = jnp.abs(jnp.where(jnp.isfinite(s), s, jnp.zeros_like(s))) * 0
    return jnp.broadcast_to(zero, shape)


def dyn_slice_grad(dy: Any, starts: Any, span: tuple[int, ...], steps: tuple[int, ...],
                   shape: tuple[int, ...]) -> Any:
    """StridedSliceGrad at traced offsets: zeros of `shape` with dy written into the slice
    (zeros made when dy is, `zeros_after`)."""
    if any(s != 1 for s in steps):
        dy = zeros_after(dy, span).at[tuple(slice(None, None, s) for s in steps)].set(dy)
    return lax.dynamic_update_slice(zeros_after(dy, shape), dy,
                                    tuple(starts[i] for i in range(len(shape))))


class LazyTable:
    """A per-rank table stored in a program's consts.npz (`data` is filled when it loads)."""

    def __init__(self, data: dict[str, np.ndarray], key: str) -> None:
        self.data = data
        self.key = key

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = np.asarray(self.data[self.key])
        return value if dtype is None else value.astype(dtype)


def pick(table: Any, me: Any) -> Any:
    """Row `me` (the traced rank index) of a per-rank table."""
    return jnp.asarray(np.asarray(table))[me]


def const(value: Any, dtype: str) -> Any:
    """A constant operand, `dtype` a DType member name ("float32", "int32", ...)."""
    return jnp.asarray(np.asarray(value, DType[dtype].np))


class _Ops:
    """`ops.MatMul(x, w, transpose_a=False, ...)`: the registry's JAX implementation of a
    primitive, by name (what generated programs call)."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        impl = get_op(name).jax
        if impl is None:
            raise SpmdLoweringError(f"{name} has no JAX implementation")
        return impl


ops = _Ops()


# -- lowering of a plan ------------------------------------------------------------------------


def promote_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """float64 evaluation: a float dtype attribute (a Cast's target, ...) becomes float64."""
    return {k: DType.float64 if isinstance(v, DType) and v.is_float else v
            for k, v in attrs.items()}


def lower_spmd(plan: SpmdPlan, float64: bool = False) -> Callable[..., list[Any]]:
    """The per-device body: `body(*local_arrays) -> list of local outputs`, arrays in graph
    parameter order. Call it inside `shard_map` over `make_mesh(plan.mesh)` (see
    `spmd_function`). `float64`: every float computed in float64 (needs `jax_enable_x64`), as
    the numpy interpreter's float64 mode does."""
    all_axes = plan.mesh.names
    nodes = plan.nodes
    if float64:
        for n in nodes:
            n.attrs = promote_attrs(n.attrs)
            n.variants = [promote_attrs(v) for v in n.variants]

    def held(array: np.ndarray) -> np.ndarray:
        array = np.asarray(array)
        if float64 and (array.dtype.kind == "f" or array.dtype.name == "bfloat16"):
            return array.astype(np.float64)
        return array

    consts = {(n.index, i): held(v.array) for n in nodes
              for i, v in enumerate(n.node.operands) if isinstance(v, Constant)}
    tables = {(n.index, i): held(t) for n in nodes for i, t in n.const_tables.items()}

    def body(*arrays: Any) -> list[Any]:
        me = lax.axis_index(all_axes)
        env: dict[int, Any] = {}

        def read(n: NodePlan, i: int, ref: tuple[str, int]) -> Any:
            kind, idx = ref
            if kind == "node":
                return env[idx]
            if kind == "param":
                return arrays[idx]
            table = tables.get((n.index, i))
            if table is not None:
                return jnp.asarray(table)[me]
            return jnp.asarray(consts[(n.index, i)])

        for n in nodes:
            args = [read(n, i, ref) for i, ref in enumerate(n.operands)]
            env[n.index] = _apply_joined(n, args, me, all_axes)
        outs = []
        for kind, idx in plan.outputs:
            outs.append(_materialise(env[idx]) if kind == "node" else arrays[idx])
        return outs

    return body


class _Joined:
    """A Concat of 1-D values not yet made: communication fusion's bucket
    (passes/comm_fusion.py: Reshape to 1-D, Concat, one AllReduce, Split or StridedSlices,
    Reshape back). Its AllReduce runs as one all-reduce of the parts themselves (`lax.psum`
    of a tuple: the same sums, without copying every gradient into a buffer and out again);
    a Split or StridedSlice that takes a part back gets it. Any other use makes the
    concatenation."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.offsets = [0]
        for p in parts:
            self.offsets.append(self.offsets[-1] + int(p.shape[0]))

    def make(self) -> Any:
        return jnp.concatenate(self.parts)


def _materialise(x: Any) -> Any:
    return x.make() if isinstance(x, _Joined) else x


def _apply_joined(n: NodePlan, args: list[Any], me: Any, all_axes: Axes) -> Any:
    """`apply_node`, with the fused AllReduce pattern of `_Joined` kept unmade."""
    if n.kind == "op" and n.op == "Concat" and len(args) > 1 and \
            n.attrs.get("axis") in (0, -1) and \
            all(isinstance(a, _Joined) or getattr(a, "ndim", None) == 1 for a in args):
        parts = [p for a in args for p in (a.parts if isinstance(a, _Joined) else [a])]
        if len({p.dtype for p in parts}) == 1:
            return _Joined(parts)
    if any(isinstance(a, _Joined) for a in args):
        joined = args[0]
        c = n.collective
        if (len(args) == 1 and isinstance(joined, _Joined) and n.kind == "collective"
                and c is not None and c.op == "AllReduce" and c.axes is not None
                and c.attrs.get("op", "sum") == "sum"):
            reduced = all_reduce(*joined.parts, axes=c.axes, op="sum")
            return _Joined(list(reduced) if len(joined.parts) > 1 else [reduced])
        if len(args) == 1 and isinstance(joined, _Joined) and n.kind == "op":
            offsets = joined.offsets
            if (n.op == "Split" and n.attrs.get("axis") in (0, -1)
                    and n.attrs.get("output_num") == len(joined.parts)
                    and len({int(p.shape[0]) for p in joined.parts}) == 1):
                return tuple(joined.parts)
            if (n.op == "StridedSlice" and tuple(n.attrs.get("strides", (1,))) == (1,)
                    and not any(v for k, v in n.attrs.items() if k.endswith("_mask"))):
                begin, end = tuple(n.attrs.get("begin", ())), tuple(n.attrs.get("end", ()))
                if len(begin) == 1 and len(end) == 1 and begin[0] in offsets:
                    i = offsets.index(begin[0])
                    if i < len(joined.parts) and offsets[i + 1] == end[0]:
                        return joined.parts[i]
        args = [_materialise(a) for a in args]
    return apply_node(n, args, me, all_axes)


def apply_node(n: NodePlan, args: list[Any], me: Any, all_axes: Axes) -> Any:
    """One node of the plan on this device (`me`: the traced rank index)."""
    if n.kind == "op":
        return get_op(n.op).jax(*args, **n.attrs)  # type: ignore[misc]
    if n.kind == "slice":
        s = n.slice
        assert s is not None
        return dyn_slice(args[0], slice_starts(s, me), s.span, s.steps)
    if n.kind == "slice_grad":
        s = n.slice
        assert s is not None
        return dyn_slice_grad(args[0], slice_starts(s, me), s.span, s.steps, s.shape)
    if n.kind == "switch":
        impl = get_op(n.op).jax
        assert impl is not None
        branches = [functools.partial(impl, **v) for v in n.variants]
        return lax.switch(jnp.asarray(n.variant, jnp.int32)[me], branches, *args)
    if n.kind == "collective":
        c = n.collective
        assert c is not None
        if c.axes is not None:
            return collective(c.op, *args, axes=c.axes, **c.attrs)
        return group_collective(c.op, *args, all_axes=all_axes,
                                members=jnp.asarray(c.members)[me],
                                position=jnp.asarray(c.positions)[me], **c.attrs)
    raise SpmdLoweringError(f"unknown node kind {n.kind}")


def collective(prim: str, *xs: Any, axes: Axes, **attrs: Any) -> Any:
    """A collective over mesh axes, by IR op name and attributes: the function its row
    (`backends/jax/collectives.py`) names, with the keywords the row gives."""
    row = COLLECTIVES.get(prim)
    if row is None:
        raise SpmdLoweringError(f"no JAX lowering for collective {prim}")
    return globals()[row.over_axes](*xs, axes=axes, **row.keywords(attrs))


# -- mesh, feeding, the jitted step --------------------------------------------------------------


def rank_devices(count: int) -> list[Any]:
    """The devices that run ranks 0..count-1: all devices ordered by (process, id)."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) < count:
        if devices and devices[0].platform != "cpu":
            raise SpmdLoweringError(
                f"the program has {count} ranks, one {devices[0].platform.upper()} each, but "
                f"JAX sees {len(devices)} {devices[0].platform.upper()}(s); compile for at "
                f"most {len(devices)} device(s), start the ranks on several machines "
                "(docs/running.md, 'GPUs'), or run on CPU devices (--platform cpu, or "
                "JAX_PLATFORMS=cpu with jax_num_cpu_devices)")
        raise SpmdLoweringError(
            f"the program has {count} ranks but JAX sees {len(devices)} device(s); on CPU set "
            f'jax.config.update("jax_num_cpu_devices", {count}) before JAX initialises, or run '
            f"{count} processes under jax.distributed"
        )
    if jax.process_count() > 1 and len(devices) != count:
        raise SpmdLoweringError(
            f"the program has {count} ranks but the {jax.process_count()} processes own "
            f"{len(devices)} devices in all"
        )
    return devices[:count]


def make_mesh(spec: MeshSpec, devices: Sequence[Any] | None = None) -> Mesh:
    devices = list(devices) if devices is not None else rank_devices(spec.size)
    return Mesh(np.array(devices, dtype=object).reshape(spec.sizes), spec.names)


def blocked_shape(n: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The global shape under which `n` ranks' values of local `shape` travel: their blocks
    along the first axis (a 0-d value: a 1-element block)."""
    shape = tuple(shape)
    return (n * shape[0], *shape[1:]) if shape else (n,)


def as_block(x: Any) -> Any:
    """A rank's value as its block of the global array (numpy or jax): itself, or a 0-d value
    as a 1-element vector."""
    return x if x.ndim else x.reshape((1,))


def spmd_function(body: Callable[..., Sequence[Any]], mesh: Mesh,
                  shapes: Sequence[Sequence[int]], donate_argnums: tuple[int, ...] = (),
                  check_vma: bool = True, out_shapes: list[tuple[int, ...]] | None = None,
                  options: LoweringOptions | None = None) -> jax.stages.Wrapped:
    """`jit(shard_map(...))` of a per-device body whose arguments have the local `shapes`:
    each argument and result is the concatenation of all ranks' values along their first axis
    (`blocked_shape`), sharded over every mesh axis in rank order, so that a device's block is
    its value as it is. (A new leading axis of size 1 would do too, but XLA then copies every
    donated buffer on the way in and every updated one on the way out: two copies of the
    parameters and optimizer state per step.) `donate_argnums`: arguments whose buffers the
    step may reuse (parameters and optimizer state that it returns updated).
    `check_vma=False` for a pipeline program, whose `lax.switch` branches (one per stage) run
    collectives over different axes. `out_shapes` (a list) receives the results' local shapes
    when the step is traced (every process traces it, backends/jax/shared_compile.py).
    `options`: the lowering's (default: `default_lowering()`, from the environment), current
    while the body traces."""
    axes = tuple(mesh.axis_names)
    scalars = [not tuple(s) for s in shapes]
    traced = within_lowering(body, options)

    def per_device(*blocks: Any) -> tuple[Any, ...]:
        if len(blocks) != len(scalars):
            raise SpmdLoweringError(f"the step takes {len(scalars)} arguments, got "
                                    f"{len(blocks)}")
        outs = [jnp.asarray(o) for o in
                traced(*[b.reshape(()) if scalar else b for b, scalar in zip(blocks, scalars)])]
        if out_shapes is not None:
            out_shapes[:] = [tuple(o.shape) for o in outs]
        return tuple(as_block(o) for o in outs)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                           check_vma=check_vma)
    return jax.jit(mapped, donate_argnums=donate_argnums)


def matmul_precision(name: str | None) -> Any:
    """A context with JAX's float32 matmul precision `name` (None or "default": unchanged)."""
    from contextlib import nullcontext

    if name in (None, "default"):
        return nullcontext()
    return jax.default_matmul_precision(name)


def rank_of_devices(mesh: Mesh) -> dict[Any, int]:
    return {d: r for r, d in enumerate(mesh.devices.flat)}


def put_blocks(mesh: Mesh, pieces: dict[int, np.ndarray], shape: tuple[int, ...],
                dtype: Any) -> jax.Array:
    """The global array (`blocked_shape`) of this process's ranks' pieces (`pieces[rank]`,
    each of local `shape`)."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if len(pieces) == mesh.size:  # every rank is in this process: one transfer
        joined = np.concatenate([as_block(np.asarray(pieces[r], dtype))
                                 for r in range(mesh.size)])
        return jax.device_put(joined, sharding)
    ranks = rank_of_devices(mesh)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    arrays = [jax.device_put(as_block(np.asarray(pieces[ranks[d]], dtype)), d) for d in local]
    return jax.make_array_from_single_device_arrays(blocked_shape(mesh.size, shape), sharding,
                                                    arrays)


def local_pieces(array: jax.Array, mesh: Mesh,
                 shape: Sequence[int] | None = None) -> dict[int, np.ndarray]:
    """This process's ranks' values of a global array (`blocked_shape`). `shape`: their local
    shape, which must be given where it may be 0-d (its block is a 1-element vector)."""
    ranks = rank_of_devices(mesh)
    out = {ranks[s.device]: np.asarray(s.data) for s in array.addressable_shards}
    if shape is not None:
        out = {r: v.reshape(tuple(shape)) for r, v in out.items()}
    return out


# -- the runner ------------------------------------------------------------------------------


class JaxSpmdRunner:
    """Runs a compiled program as one SPMD JAX program on N devices of this process and carries
    each rank's parameters and optimizer state across steps (on the devices). Same interface
    as `tools.runners.ParallelRunner`: `run(arrays)` -> per-rank outputs, `step(arrays)` ->
    loss, `values[r][name]`, `global_value(name)`. Each rank's initial blocks are made on its
    own device as a rank program makes them (`param_init`: `auto`, `device` or `host`), except
    in float64 and under `parameter_broadcast`."""

    def __init__(self, program: CompiledProgram, devices: Sequence[Any] | None = None,
                 float64: bool = False, matmul_precision: str | None = None,
                 param_init: str = "auto") -> None:
        from pcompile.compiler.driver.runtime import initial_rank_values

        if float64 and not jax.config.read("jax_enable_x64"):
            raise SpmdLoweringError("float64 evaluation needs jax_enable_x64")
        self.program = program
        self.float64 = float64
        self.matmul_precision = "highest" if float64 else matmul_precision
        state = program.state
        self.graphs = program.rank_graphs
        self.plan = SpmdPlan.build(self.graphs)
        self.mesh = make_mesh(self.plan.mesh, devices)
        initial: list[dict[str, np.ndarray]] | None
        if state.assignment is not None:
            self.layouts = state.assignment.param_layouts
            # Each rank's blocks are made on its own device (param_init) unless they are
            # wanted in float64 or copied from rank 0 (parameter_broadcast).
            initial = (initial_rank_values(program, float64)
                       if float64 or state.options.parameter_broadcast else None)
        else:
            self.layouts = {}
            initial = [{k: np.array(v, copy=True) for k, v in program.initial_values.items()}]
        graph = self.graphs[0]
        self._n_inputs = len(graph.inputs)
        self._stored = graph.params[self._n_inputs:]
        body = lower_spmd(self.plan, float64)
        shapes = [p.shape for p in graph.params]
        self._out_shapes = [v.shape for v in graph.outputs]
        self._fn = spmd_function(body, self.mesh, shapes)
        updated = set(program.output_names[1:])
        donate = tuple(self._n_inputs + i for i, p in enumerate(self._stored)
                       if p.name in updated)
        # The training step reuses the buffers of the values it returns updated.
        self._step_fn = spmd_function(body, self.mesh, shapes, donate)
        made = (self._made_on_devices(program, param_init)
                if initial is None else None)  # (None: the host's values, or another dtype)
        self._state = made or {p.name: self._put({r: v[p.name] for r, v in enumerate(
            initial if initial is not None else initial_rank_values(program))}, p)
            for p in self._stored}
        self._shapes = {p.name: p.shape for p in self._stored}
        self._values_cache: list[dict[str, np.ndarray]] | None = None

    def _made_on_devices(self, program: CompiledProgram, where: str) -> dict[str, jax.Array] | None:
        """Every stored value's global array, each rank's block made on its own device
        (`param_init.make_blocks`: the same values, bit for bit, as `initial_rank_values`);
        None where a value's dtype is not the parameter's (the host path casts it)."""
        from pcompile.backends.jax.param_init import make_blocks, mesh_blocks

        values = program.initial_values
        n = self.mesh.size
        jobs = []
        whole: dict[str, jax.Array] = {}  # made by one program for all devices
        for p in self._stored:
            source = values.source(p.name)
            if source.dtype is not p.dtype:
                return None
            layout = self.layouts.get(p.name)
            bounds = [layout.slice_bounds(r) if layout is not None and source.shape
                      else tuple((0, d) for d in source.shape) for r in range(n)]
            array = mesh_blocks(source, bounds, self.mesh, where)
            if array is not None:
                whole[p.name] = array
                continue
            jobs += [(source, b, self.mesh.devices.flat[r]) for r, b in enumerate(bounds)]
        made, _ = make_blocks(jobs, where)
        sharding = NamedSharding(self.mesh, P(tuple(self.mesh.axis_names)))
        out: dict[str, jax.Array] = {}
        for p in self._stored:
            if p.name in whole:
                out[p.name] = whole[p.name]
                continue
            out[p.name] = jax.make_array_from_single_device_arrays(
                blocked_shape(n, p.shape), sharding, made[:n])
            made = made[n:]
        return out

    def _put(self, pieces: dict[int, np.ndarray], param: Any) -> jax.Array:
        dtype = np.float64 if self.float64 and param.dtype.is_float else param.dtype.np
        return put_blocks(self.mesh, pieces, param.shape, dtype)

    def _slice(self, array: np.ndarray, name: str, rank: int) -> np.ndarray:
        from pcompile.passes.step_parallel import slice_array

        layout = self.layouts.get(name)
        return np.asarray(array) if layout is None else slice_array(array, layout, rank)

    def _feeds(self, arrays: list[np.ndarray]) -> list[jax.Array]:
        graph = self.graphs[0]
        n = self.plan.num_ranks
        feeds = [self._put({r: self._slice(a, p.name, r) for r in range(n)}, p)
                 for p, a in zip(graph.inputs, arrays)]
        return feeds + [self._state[p.name] for p in self._stored]

    def _call(self, arrays: list[np.ndarray], donate: bool = False) -> list[jax.Array]:
        feeds = self._feeds(arrays)
        with matmul_precision(self.matmul_precision):
            return list((self._step_fn if donate else self._fn)(*feeds))

    def lower(self, arrays: list[np.ndarray], donate: bool = True) -> Any:
        """The step (`donate`: the training step) lowered for global `arrays`
        (`jax.stages.Lowered`: `.as_text()`, `.compile().as_text()`), nothing run."""
        with matmul_precision(self.matmul_precision):
            return (self._step_fn if donate else self._fn).lower(*self._feeds(arrays))

    def _per_rank(self, outs: list[jax.Array]) -> list[list[np.ndarray]]:
        n = self.plan.num_ranks
        gathered = [local_pieces(o, self.mesh, shape) for o, shape in zip(outs, self._out_shapes)]
        return [[g[r] for g in gathered] for r in range(n)]

    def run(self, arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
        """One execution on global `arrays` (inputs then labels); per-rank outputs. Stored
        values are not updated."""
        return self._per_rank(self._call(arrays))

    def step(self, arrays: list[np.ndarray]) -> float:
        """One training step: returns the loss and keeps the new parameters and state (on the
        devices; the step donates the old ones)."""
        outs = self._call(arrays, donate=True)
        names = self.program.output_names
        for name, value in zip(names[1:], outs[1:]):
            if name in self._state:
                self._state[name] = value
        self._values_cache = None
        losses = [float(v) for v in local_pieces(outs[0], self.mesh, ()).values()]
        if self.program.state.parallel_mode == "data_parallel":
            return float(np.mean(np.asarray(losses, np.float64)))
        if max(losses) - min(losses) > 1e-5 * max(1.0, abs(losses[0])):
            from pcompile.ir.errors import PcompileError

            raise PcompileError(
                f"the ranks disagree on the loss of a step ({losses}), though every rank holds "
                "the whole loss: the plan is wrong; please report it with the model file")
        return losses[0]

    @property
    def values(self) -> list[dict[str, np.ndarray]]:
        if self._values_cache is None:
            n = self.plan.num_ranks
            pieces = {name: local_pieces(a, self.mesh, self._shapes[name])
                      for name, a in self._state.items()}
            self._values_cache = [{name: pieces[name][r] for name in pieces} for r in range(n)]
        return self._values_cache

    def global_value(self, name: str) -> np.ndarray:
        """Reassemble a parameter (or optimizer state) from the ranks' slices."""
        values = self.values
        layout = self.layouts.get(name)
        first = values[0][name]
        if layout is None or not first.shape:
            return first
        full = np.zeros(layout.shape, first.dtype)
        for rank, vals in enumerate(values):
            full[tuple(slice(b, e) for b, e in layout.slice_bounds(rank))] = vals[name]
        return full
