"""Pieces shared by the training-step benchmarks (jax_step_speed.py, gpu_step.py,
llama_step.py): interleaved timing of step functions, pcompile's parameter layouts as
`NamedSharding`s of the SPMD runner's mesh, and MindSpore's AdamWeightDecay written directly in
JAX for the hand-written baselines. Imported with benchmarks/ on `sys.path`; it does not import
JAX at module level, so a benchmark can configure JAX (virtual devices) first."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# nn.AdamWeightDecay as the examples build it (compiler/frontend/nn/optim.py): no bias correction.
ADAMW = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.01}


def time_steps(steps_fns: dict[str, Callable[[Any], Any]], batches: Sequence[Any], steps: int,
               rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step of each function in each of `rounds` interleaved rounds of `steps`
    steps (the machine is noisy: interleave, then take the median or the best), after
    `warmup` untimed (compiling) steps. Step k of a round takes `batches[k % len(batches)]`,
    so every function sees the same batches in the same order."""
    for step in steps_fns.values():
        for k in range(warmup):
            step(batches[k % len(batches)])
    seconds: dict[str, list[float]] = {name: [] for name in steps_fns}
    for _ in range(rounds):
        for name, step in steps_fns.items():
            start = time.perf_counter()
            for k in range(steps):
                step(batches[(warmup + k) % len(batches)])
            seconds[name].append((time.perf_counter() - start) / steps)
    return seconds


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, np.float64)))


def plan_sharding(layouts: dict[str, Any], name: str, runner: Any) -> Any:
    """The NamedSharding, on `runner`'s mesh (a JaxSpmdRunner), that holds tensor `name` as
    pcompile's plan lays it out (replicated when the plan has no layout for it)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layout = layouts.get(name)
    return layout_sharding(layout, runner) if layout is not None else NamedSharding(
        runner.mesh, P())


def layout_sharding(layout: Any, runner: Any) -> Any:
    """A `TensorLayout` as a NamedSharding of `runner`'s mesh."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pcompile.backends.jax.plan import layout_axes

    axes = layout_axes(layout, runner.plan.mesh)
    parts = [a if a is None or len(a) > 1 else a[0] for a in axes] if axes else []
    return NamedSharding(runner.mesh, P(*parts))


def split_adamw_state(values: dict[str, Any]) -> tuple[list[str], dict[str, Any], dict[str, Any],
                                                        dict[str, Any]]:
    """(parameter names, parameters, moment1, moment2) from pcompile's stored values (the
    optimizer's states are `moment1.<name>` and `moment2.<name>`)."""
    names = [k for k in values if not k.startswith(("moment1.", "moment2."))]
    return (names, {k: values[k] for k in names}, {k: values["moment1." + k] for k in names},
            {k: values["moment2." + k] for k in names})


def decays(name: str) -> bool:
    """MindSpore's default decay filter: no weight decay for 'beta' and 'gamma' parameters."""
    return "beta" not in name and "gamma" not in name


def adamw_update(params: dict[str, Any], m1: dict[str, Any], m2: dict[str, Any],
                 grads: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """One nn.AdamWeightDecay step (`ADAMW`) on dicts of arrays: (params, moment1, moment2)."""
    import jax.numpy as jnp

    b1, b2, eps = ADAMW["beta1"], ADAMW["beta2"], ADAMW["eps"]
    new_p, new_1, new_2 = {}, {}, {}
    for k in params:
        g = grads[k]
        new_1[k] = m1[k] * b1 + g * (1.0 - b1)
        new_2[k] = m2[k] * b2 + g * g * (1.0 - b2)
        update = new_1[k] / (jnp.sqrt(new_2[k]) + eps)
        if decays(k):
            update = update + params[k] * ADAMW["weight_decay"]
        new_p[k] = params[k] - update * ADAMW["lr"]
    return new_p, new_1, new_2
