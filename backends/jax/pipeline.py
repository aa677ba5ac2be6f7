"""A pipeline program as ONE JAX program over the whole mesh (see backends/jax/pipeline_plan.py).

`run_step(tables, units, arrays, float64)` is the per-device body (call it inside `shard_map`
over the mesh with the `stage` axis): for each tick, `lax.switch` on the device's stage runs
`units[s](label, env, params, me)` -- the nodes of stage s's unit at that tick -- with what the
stage holds (its registers, `PipelineTables.held`) and what just arrived; it returns the
registers written at this tick (its new values in those it writes, the others passed through)
and packs what it sends; then one `ppermute` per stage distance and dtype moves the sent
values along the stage axis. The registers no stage writes at a tick do not leave the
switch's operands, so a long-lived value is not copied.
After the last tick every device returns the step's outputs by name (the union of the
stages' outputs): its own stage's results, the inputs it was given for the others', and the
loss (computed by the last stage) on every device.

`unit_runner(plan, float64)` makes `units` from the plan's NodePlans (the in-process runner);
a generated program.py defines them as source (backends/jax/codegen.py). `JaxPipelineRunner`
runs a compiled pipeline program on N devices of this process with the interface of
`tools.runners.ParallelRunner`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pcompile.backends.jax.lowering import within_lowering
from pcompile.backends.jax.pipeline_plan import Held, PipelinePlan, PipelineTables, Slot
from pcompile.backends.jax.spmd import (
    apply_node,
    as_block,
    group_collective,
    local_pieces,
    make_mesh,
    promote_attrs,
    put_blocks,
)
from pcompile.ir.core import Constant
from pcompile.ir.lowering import LoweringOptions
from pcompile.ir.types import DType

if TYPE_CHECKING:
    from pcompile.compiler.driver.compiled import CompiledProgram

UnitFn = Callable[[str, dict[int, Any], Sequence[Any], Any], None]


def _np_dtype(name: str, float64: bool) -> Any:
    dtype = DType[name]
    return np.float64 if float64 and dtype.is_float else dtype.np


def _unpack(buffers: dict[str, Any], slots: Sequence[Slot], env: dict[int, Any]) -> None:
    for key, dtype, offset, shape in slots:
        size = int(np.prod(shape)) if shape else 1
        env[key] = lax.slice_in_dim(buffers[dtype], offset, offset + size).reshape(shape)


def _read(registers: Sequence[Any], held: Sequence[Held], env: dict[int, Any]) -> None:
    for key, r, *_ in held:
        env[key] = registers[r]


def _pack(sizes: dict[str, int], slots: Sequence[Slot], env: dict[int, Any],
          float64: bool) -> dict[str, Any]:
    parts: dict[str, list[Any]] = {dtype: [] for dtype in sizes}
    used = dict.fromkeys(sizes, 0)
    for key, dtype, _, shape in slots:
        parts[dtype].append(jnp.ravel(env[key]).astype(_np_dtype(dtype, float64)))
        used[dtype] += int(np.prod(shape)) if shape else 1
    out = {}
    for dtype, size in sizes.items():
        pad = size - used[dtype]
        if pad:
            parts[dtype].append(jnp.zeros((pad,), _np_dtype(dtype, float64)))
        out[dtype] = (jnp.concatenate(parts[dtype]) if len(parts[dtype]) > 1
                      else parts[dtype][0])
    return out


def _zeros(registers: Sequence[tuple[str, Sequence[int]]], float64: bool) -> list[Any]:
    return [jnp.zeros(tuple(shape), _np_dtype(dtype, float64)) for dtype, shape in registers]


def run_step(tables: PipelineTables | dict[str, Any], units: Sequence[UnitFn],
             arrays: Sequence[Any], axes: tuple[str, ...], float64: bool = False) -> list[Any]:
    """One step on this device (inside shard_map over the mesh axes `axes`, the stage axis
    first); `arrays`: the union parameters in order. Returns the step's outputs in
    `union_outputs` order."""
    tb = tables if isinstance(tables, PipelineTables) else PipelineTables(**tables)
    stage_axis = axes[0]
    me = lax.axis_index(axes)
    stage = lax.axis_index(stage_axis)
    params = tuple(arrays)
    carry = _zeros(tb.registers, float64)
    arrived: dict[int, dict[str, Any]] = {}
    for t in range(tb.ticks):
        branches = [_branch(tb, units, s, t, me, float64) for s in range(tb.stages)]
        written, sends = lax.switch(stage, branches, params, tuple(carry), arrived)
        for r, value in zip(tb.writes[t], written):
            carry[r] = value
        arrived = {}
        for d, bufs in sends.items():
            perm = [(s, s + d) for s in range(tb.stages) if 0 <= s + d < tb.stages]
            arrived[d] = {dt: lax.ppermute(b, stage_axis, perm) for dt, b in bufs.items()}
    return _outputs(tb, params, carry, stage, stage_axis, float64)


def _branch(tb: PipelineTables, units: Sequence[UnitFn], s: int, t: int, me: Any,
            float64: bool) -> Callable[..., Any]:
    """Stage s at tick t: read what it holds and unpack what arrived, run its unit, return
    the registers written at tick t (its new values where it writes, the rest as they
    were) and pack what it sends."""
    holds = tb.carry(s, t)
    mine = {r: (key, tb.registers[r][0]) for key, r, *_ in tb.written(s, t)}

    def run(params: Any, regs: tuple[Any, ...], came: dict[int, dict[str, Any]]) -> Any:
        env: dict[int, Any] = {}
        _read(regs, holds, env)
        for d, slots in tb.arrivals[t][s]:
            _unpack(came[d], slots, env)
        entry = tb.units[t][s]
        if entry is not None:
            units[s](entry[0], env, [params[i] for i in tb.params[s]], me)
        kept = tuple(jnp.asarray(env[mine[r][0]]).astype(_np_dtype(mine[r][1], float64))
                     if r in mine else regs[r] for r in tb.writes[t])
        sent = {d: _pack(sizes, tb.sends[t][d][s], env, float64)
                for d, sizes in tb.send_sizes[t].items()}
        return kept, sent

    return run


def _outputs(tb: PipelineTables, params: tuple[Any, ...], carry: list[Any], stage: Any,
             stage_axis: str, float64: bool) -> list[Any]:
    names = list(tb.union_outputs)
    index = {p[0]: i for i, p in enumerate(tb.union_params)}

    def branch(s: int) -> Callable[..., Any]:
        def run(params: Any, carry: Any) -> Any:
            env: dict[int, Any] = {}
            _read(carry, tb.carry(s, tb.ticks), env)
            mine = [params[i] for i in tb.params[s]]
            out = []
            for name in names:
                where = tb.outputs[s].get(name)
                if where is not None:
                    out.append(env[where[1]] if where[0] == "node" else mine[where[1]])
                elif name == "loss":
                    out.append(jnp.zeros((), _loss_dtype(tb, float64)))
                else:  # another stage's weight or state: as it came in
                    out.append(params[index[name]])
            return tuple(out)
        return run

    outs = list(lax.switch(stage, [branch(s) for s in range(tb.stages)], params,
                           tuple(carry)))
    if "loss" in names:  # every device reports the last stage's loss
        k = names.index("loss")
        outs[k] = lax.psum(outs[k], stage_axis)
    return outs


def _loss_dtype(tb: PipelineTables, float64: bool) -> Any:
    last = tb.stages - 1
    where = tb.outputs[last]["loss"]
    for key, r, *_ in tb.carry(last, tb.ticks):
        if where[0] == "node" and key == where[1]:
            return _np_dtype(tb.registers[r][0], float64)
    return np.float64 if float64 else np.float32


def pipeline_function(tables: PipelineTables | dict[str, Any], units: Sequence[UnitFn],
                      mesh: Mesh, float64: bool = False,
                      extra: Callable[[list[Any]], list[Any]] | None = None,
                      out_shapes: list[tuple[int, ...]] | None = None,
                      options: LoweringOptions | None = None) -> Callable[..., Any]:
    """`jit(shard_map(...))` of the step: arguments and results are the ranks' values as
    blocks of a global array (`spmd.blocked_shape`: along their first axis, sharded over every
    mesh axis in rank order), as `spmd.spmd_function`. `out_shapes` (a list) receives the
    results' local shapes when the step is traced. `options`: the lowering's (default:
    `default_lowering()`), current while the step traces."""
    axes = tuple(mesh.axis_names)
    params = tables.union_params if isinstance(tables, PipelineTables) else \
        tables["union_params"]
    scalars = [not tuple(shape) for _, _, shape, _ in params]

    def step(*args: Any) -> list[Any]:
        outs = run_step(tables, units, args, axes, float64)
        return outs if extra is None else extra(outs)

    traced = within_lowering(step, options)

    def per_device(*blocks: Any) -> tuple[Any, ...]:
        outs = [jnp.asarray(o) for o in
                traced(*[b.reshape(()) if scalar else b for b, scalar in zip(blocks, scalars)])]
        if out_shapes is not None:
            out_shapes[:] = [tuple(o.shape) for o in outs]
        return tuple(as_block(o) for o in outs)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                           check_vma=False)
    return jax.jit(mapped)


# -- units from the plan's node plans (the in-process runner) ------------------------------------


def unit_runner(plan: PipelinePlan, float64: bool = False) -> list[UnitFn]:
    """One function per stage that runs the nodes of a unit, from the stage's NodePlans."""
    return [_stage_runner(plan, s, float64) for s in range(plan.program.stages)]


def _stage_runner(plan: PipelinePlan, s: int, float64: bool) -> UnitFn:
    nodes = plan.nodes[s]
    if float64:
        for nd in nodes:
            nd.attrs = promote_attrs(nd.attrs)
            nd.variants = [promote_attrs(v) for v in nd.variants]
    consts = {(nd.index, i): _held(v.array, float64) for nd in nodes
              for i, v in enumerate(nd.node.operands) if isinstance(v, Constant)}
    tables = {(nd.index, i): _held(t, float64) for nd in nodes
              for i, t in nd.const_tables.items()}
    members = {entry[0]: entry[1] for row in plan.tables.units
               for entry in [row[s]] if entry is not None}
    intra, n = plan.intra_axes, plan.program.per_stage

    def run(label: str, env: dict[int, Any], params: Sequence[Any], me: Any) -> None:
        for k in members[label]:
            nd = nodes[k]
            if nd.kind == "recv":  # its value arrived (run_step unpacked it)
                continue
            args = []
            for i, (kind, idx) in enumerate(nd.operands):
                if kind == "node":
                    args.append(env[idx])
                elif kind == "param":
                    args.append(params[idx])
                elif (nd.index, i) in tables:
                    args.append(jnp.asarray(tables[(nd.index, i)])[me])
                else:
                    args.append(jnp.asarray(consts[(nd.index, i)]))
            if nd.kind == "send":  # run_step packs it after the unit
                env[nd.index] = args[0]
            elif nd.kind == "collective" and nd.collective is not None \
                    and nd.collective.axes is None:  # exact fallback, inside the stage
                c = nd.collective
                env[nd.index] = group_collective(
                    c.op, *args, all_axes=intra, members=jnp.asarray(c.members % n)[me],
                    position=jnp.asarray(c.positions)[me], **c.attrs)
            else:
                env[nd.index] = apply_node(nd, args, me, plan.mesh.names)

    return run


def _held(array: Any, float64: bool) -> np.ndarray:
    array = np.asarray(array)
    if float64 and (array.dtype.kind == "f" or array.dtype.name == "bfloat16"):
        return array.astype(np.float64)
    return array


# -- the runner ----------------------------------------------------------------------------------


class JaxPipelineRunner:
    """Runs a compiled pipeline program as one SPMD JAX program on N devices of this process
    (the interface of `tools.runners.ParallelRunner`: `run`, `step`, `values`,
    `global_value`)."""

    def __init__(self, program: CompiledProgram, devices: Sequence[Any] | None = None,
                 float64: bool = False) -> None:
        from pcompile.compiler.driver.runtime import initial_rank_values

        if float64 and not jax.config.read("jax_enable_x64"):
            raise RuntimeError("float64 evaluation needs jax_enable_x64")
        self.program = program
        self.float64 = float64
        state = program.state
        assert state.pipeline is not None and state.assignment is not None  # pipelined
        self.plan = PipelinePlan.build(state.pipeline.program)
        self.tables = self.plan.tables
        self.mesh = make_mesh(self.plan.mesh, devices)
        self.layouts = state.assignment.param_layouts
        self.n = self.plan.num_ranks
        initial = initial_rank_values(program)
        self._out_shapes: list[tuple[int, ...]] = []
        self._fn = pipeline_function(self.tables, unit_runner(self.plan, float64), self.mesh,
                                     float64, out_shapes=self._out_shapes)
        self.inputs = [p for p in self.tables.union_params if p[1] == "input"]
        self.stored = [p for p in self.tables.union_params if p[1] != "input"]
        self._state = {name: self._put({r: initial[r][name] for r in range(self.n)},
                                       shape, dtype)
                       for name, _, shape, dtype in self.stored}
        self._values_cache: list[dict[str, np.ndarray]] | None = None

    def _put(self, pieces: dict[int, np.ndarray], shape: tuple[int, ...], dtype: str) -> Any:
        return put_blocks(self.mesh, pieces, tuple(shape), _np_dtype(dtype, self.float64))

    def _call(self, arrays: list[np.ndarray]) -> list[Any]:
        from pcompile.passes.step_parallel import slice_array

        by_name = {p.name: a for p, a in zip(self.program.graph.inputs, arrays)}
        feeds = [self._put({r: slice_array(by_name[name], self.layouts[name], r)
                            for r in range(self.n)}, shape, dtype)
                 for name, _, shape, dtype in self.inputs]
        feeds += [self._state[name] for name, *_ in self.stored]
        return list(self._fn(*feeds))

    def run(self, arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
        outs = self._call(arrays)  # traced by now: _out_shapes holds the local shapes
        gathered = [local_pieces(o, self.mesh, shape) for o, shape in zip(outs, self._out_shapes)]
        return [[g[r] for g in gathered] for r in range(self.n)]

    def step(self, arrays: list[np.ndarray]) -> float:
        outs = self._call(arrays)
        names = self.tables.union_outputs
        for name, value in zip(names, outs):
            if name in self._state:
                self._state[name] = value
        self._values_cache = None
        losses = [float(v) for v in
                  local_pieces(outs[names.index("loss")], self.mesh, ()).values()]
        if max(losses) - min(losses) > 1e-5 * max(1.0, abs(losses[0])):
            raise AssertionError(f"ranks disagree on the loss: {losses}")
        return losses[0]

    @property
    def values(self) -> list[dict[str, np.ndarray]]:
        if self._values_cache is None:
            shapes = {name: shape for name, _, shape, _ in self.stored}
            pieces = {name: local_pieces(a, self.mesh, shapes[name])
                      for name, a in self._state.items()}
            self._values_cache = [{name: pieces[name][r] for name in pieces}
                                  for r in range(self.n)]
        return self._values_cache

    def global_value(self, name: str) -> np.ndarray:
        from pcompile.compiler.driver.runtime import assemble

        return assemble(self.program, name, self.layouts.get(name), self.values)
