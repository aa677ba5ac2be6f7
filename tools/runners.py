"""Running a compiled program in one process: one step on the numpy interpreter or the JAX
lowering (`StandAloneRunner`), every rank on the numpy simulator (`ParallelRunner`), with the
parameters and optimizer state carried across steps. (The rank programs, one process per rank,
are `backends.jax`'s; `backends.jax.spmd.JaxSpmdRunner` runs them as one SPMD program.)"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np

from pcompile.compiler.driver.compiled import CompiledProgram
from pcompile.compiler.driver.runtime import (
    assemble,
    held_copy,
    initial_rank_values,
    rank_local_reductions,
)
from pcompile.ir.errors import PcompileError


class DeviceValues(MutableMapping[str, Any]):
    """A runner's parameters and optimizer state held on the device (JAX arrays): reading a
    value copies it to the host once (until it changes), setting one puts it on the device."""

    def __init__(self, values: dict[str, np.ndarray], float64: bool = False) -> None:
        self.float64 = float64
        self.device: dict[str, Any] = {}
        self._host: dict[str, np.ndarray] = {}
        for name, value in values.items():
            self[name] = value

    @staticmethod
    def initial(program: CompiledProgram, where: str = "auto") -> DeviceValues:
        """The program's initial values made on the default device (`param_init.make_blocks`:
        bit for bit the host's values, at device speed; `where`: auto, device or host)."""
        import jax

        from pcompile.backends.jax.param_init import make_blocks

        values = program.initial_values
        names = list(values)
        sources = [values.source(name) for name in names]
        device = jax.devices()[0]
        made, _ = make_blocks([(s, tuple((0, d) for d in s.shape), device) for s in sources],
                              where)
        out = DeviceValues({})
        for name, source, array in zip(names, sources, made):
            out.device[name] = array.reshape(source.shape)
        return out

    def _x64(self) -> Any:
        from contextlib import nullcontext

        from pcompile.backends.jax.lowering import x64

        return x64() if self.float64 else nullcontext()

    def __getitem__(self, name: str) -> np.ndarray:
        host = self._host.get(name)
        if host is None:
            host = self._host[name] = np.asarray(self.device[name])
        return host

    def __setitem__(self, name: str, value: Any) -> None:
        import jax

        with self._x64():
            self.device[name] = jax.device_put(np.asarray(value))
        self._host.pop(name, None)

    def update_device(self, name: str, array: Any) -> None:
        """A step's new value, already on the device."""
        self.device[name] = array
        self._host.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self.device[name]
        self._host.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.device)

    def __len__(self) -> int:
        return len(self.device)

class StandAloneRunner:
    """Runs the single-device program on numpy or JAX and carries parameters across steps.
    `float64=True` evaluates every float in float64 (the oracle's mode; JAX runs it under
    `backends.jax.lowering.x64`, at matmul precision `highest`).

    On JAX the parameters and optimizer state stay on the device between steps (`values` is a
    `DeviceValues`); the jitted training step donates them, and `step_async` returns the loss
    without waiting for it. `matmul_precision` (`default`, `high`, `highest`; None: JAX's
    setting) is JAX's float32 matmul precision for the steps. On JAX (not in float64) the
    initial values are made on the device (`param_init`: `auto`, `device` or `host`, as a rank
    program's `--param-init`), bit for bit the host's."""

    def __init__(self, program: CompiledProgram, backend: str = "numpy",
                 float64: bool = False, matmul_precision: str | None = None,
                 param_init: str = "auto") -> None:
        if backend not in ("numpy", "jax"):
            raise ValueError(f"unknown backend {backend!r}")
        self.program = program
        self.backend = backend
        self.float64 = float64
        self.matmul_precision = "highest" if float64 else matmul_precision
        self.graph = program.rank_graphs[0]
        on_device = backend == "jax" and not float64
        held = ({} if on_device else
                {k: held_copy(v, float64) for k, v in program.initial_values.items()})
        self.values: MutableMapping[str, Any] = held
        self._run_fn: Any = None
        self._step_fn: Any = None
        if backend == "jax":
            import jax

            from pcompile.backends.jax import lower_graph

            self.values = (DeviceValues.initial(program, param_init) if on_device
                           else DeviceValues(held, float64))
            lowered = lower_graph(self.graph, float64=float64)
            n = len(self.graph.inputs)
            updated = set(program.output_names[1:])
            donate = tuple(i for i, p in enumerate(self.graph.params)
                           if i >= n and p.name in updated)
            self._run_fn = jax.jit(lowered)
            self._step_fn = jax.jit(lowered, donate_argnums=donate)

    def _context(self) -> Any:
        """JAX's settings for a call: float64 evaluation, the matmul precision."""
        from contextlib import ExitStack

        import jax

        stack = ExitStack()
        if self.float64:
            from pcompile.backends.jax.lowering import x64

            stack.enter_context(x64())
        if self.matmul_precision not in (None, "default"):
            stack.enter_context(jax.default_matmul_precision(self.matmul_precision))
        return stack

    def _feeds(self, arrays: list[np.ndarray]) -> list[Any]:
        graph = self.graph
        n = len(graph.inputs)
        values = self.values
        stored = ([values.device[p.name] for p in graph.params[n:]]
                  if isinstance(values, DeviceValues)
                  else [values[p.name] for p in graph.params[n:]])
        return list(arrays[:n]) + stored

    def lowered_text(self, arrays: list[np.ndarray]) -> str:
        """The StableHLO of the training step (JAX), as it runs (settings included)."""
        return str(self.lower(arrays).as_text())

    def lower(self, arrays: list[np.ndarray]) -> Any:
        """The training step (JAX) lowered for `arrays` as it runs (`jax.stages.Lowered`:
        `.as_text()`, `.compile().as_text()`), nothing run."""
        with self._context():
            return self._step_fn.lower(*self._feeds(arrays))

    def run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """One execution; the stored values are not updated."""
        feeds = self._feeds(arrays)
        if self.backend == "numpy":
            from pcompile.backends.numpy import run_graph

            return [np.asarray(o) for o in run_graph(self.graph, feeds, float64=self.float64)]
        with self._context():
            return [np.asarray(o) for o in self._run_fn(*feeds)]

    def step_async(self, arrays: list[np.ndarray]) -> Any:
        """One training step: keeps the updated parameters and state (on the device, for
        JAX) and returns the loss as the backend holds it (a JAX array is not waited for)."""
        names = self.program.output_names
        if self.backend == "numpy":
            outs: list[Any] = self.run(arrays)
            for name, value in zip(names[1:], outs[1:]):
                self.values[name] = value
            return outs[0]
        with self._context():
            outs = list(self._step_fn(*self._feeds(arrays)))
        values = self.values
        assert isinstance(values, DeviceValues)
        for name, value in zip(names[1:], outs[1:]):
            values.update_device(name, value)
        return outs[0]

    def step(self, arrays: list[np.ndarray]) -> float:
        """One training step: returns the loss and keeps the updated parameters and state."""
        return float(self.step_async(arrays))

class ParallelRunner:
    """Runs every rank's graph in one process on the numpy simulator and carries each rank's
    parameters and optimizer state across steps (`float64`: every float in float64)."""

    def __init__(self, program: CompiledProgram, float64: bool = False) -> None:
        self.program = program
        self.float64 = float64
        state = program.state
        assert state.assignment is not None, "not a parallel program"
        self.layouts = state.assignment.param_layouts
        self.graphs = program.rank_graphs
        self.values = initial_rank_values(program, float64)

    def feeds(self, rank: int, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Rank `rank`'s graph parameters: its slices of the global `arrays` (the program's
        inputs in order; a pipeline stage reads those it uses), then its stored values."""
        from pcompile.passes.step_parallel import slice_array

        graph = self.graphs[rank]
        by_name = {p.name: a for p, a in zip(self.program.graph.inputs, arrays)}
        inputs = graph.inputs
        out = [slice_array(by_name[p.name], self.layouts[p.name], rank) for p in inputs]
        return out + [self.values[rank][p.name] for p in graph.params[len(inputs):]]

    def run(self, arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
        from pcompile.backends.numpy.simulate import run_ranks

        feeds = [self.feeds(r, arrays) for r in range(len(self.graphs))]
        if self.program.state.pipelined:
            from pcompile.backends.numpy.pipeline import run_pipeline

            pipeline = self.program.state.pipeline
            assert pipeline is not None
            outs = run_pipeline(pipeline.program, feeds, self.float64)
        else:
            outs = run_ranks(self.graphs, feeds, self.float64)
        return [[np.asarray(o) for o in rank_outs] for rank_outs in outs]

    def step(self, arrays: list[np.ndarray]) -> float:
        outs = self.run(arrays)
        for rank, rank_outs in enumerate(outs):
            names = list(self.graphs[rank].attrs["outputs"])
            for name, value in zip(names, rank_outs):
                if name != "loss":
                    self.values[rank][name] = value
        if self.program.state.pipelined:  # the last stage computes the loss
            outs = [o for r, o in enumerate(outs) if "loss" in self.graphs[r].attrs["outputs"]]
        losses = [float(o[0]) for o in outs]
        if (self.program.state.parallel_mode == "data_parallel"
                or rank_local_reductions(self.program)):
            # Each rank's loss is its own (its batch in data_parallel; its part of a
            # cross_batch reduction): report their mean, the global loss of a mean loss.
            return float(np.mean(np.asarray(losses, np.float64)))
        if max(losses) - min(losses) > 1e-5 * max(1.0, abs(losses[0])):
            raise PcompileError(
                f"the ranks disagree on the loss of a step ({losses}), though every rank holds "
                "the whole loss: the plan is wrong; please report it with the model file"
            )
        return losses[0]

    def global_value(self, name: str) -> np.ndarray:
        """Reassemble a parameter (or optimizer state) from the ranks' slices (with pipeline
        stages, the ranks of the first stage that holds it)."""
        return assemble(self.program, name, self.layouts.get(name), self.values)
