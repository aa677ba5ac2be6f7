"""The state random ops draw from: one step counter per traced program.

A random op (`ops.Dropout`, `nn.Dropout`) draws its bits from its seeds, the counter's value
and each element's place in the whole tensor (ir/ops/random.py). The counter is a Parameter,
`random_step` (Int32 scalar, 0 before the first step, not trained), that every random op
advances by one and reads (`ops.assign_add`, compiler/frontend/assign.py): the step returns the new
value and the runtime stores it like any state, so the next step (and a run resumed from a
checkpoint) draws new bits, while the single-device program and every parallel plan draw the same
ones.

Seeds follow MindSpore's `Seed0` / `Seed1`: an op given either keeps them; with both 0 the op
takes the global seed (`set_seed`, 1 by default) as seed0 and its position among the program's
random ops as seed1. MindSpore then lets the device pick a seed at random; pcompile stays
deterministic (the same program trains the same way twice).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from pcompile.compiler.frontend.tensor import Parameter
from pcompile.ir.core import Value
from pcompile.ir.errors import PcompileError
from pcompile.ir.ops.random import COUNTER_NAME as _COUNTER_NAME

#: the counter's name in the program, its checkpoints and plan.json
COUNTER_NAME = _COUNTER_NAME


class _State:
    def __init__(self) -> None:
        self.counter: Parameter | None = None
        self.ops = 0  # random ops traced so far (the default seed1 of the next)


_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(tracer: Any) -> _State:
    state = _STATES.get(tracer)
    if state is None:
        state = _STATES[tracer] = _State()
    return state


def op_seeds(tracer: Any, seed0: int, seed1: int) -> tuple[int, int]:
    """The (seed0, seed1) of the next random op of the trace (see above)."""
    from pcompile.compiler.frontend.initializer import get_seed

    state = _state(tracer)
    position = state.ops
    state.ops += 1
    if seed0 == 0 and seed1 == 0:
        return int(get_seed()) % 2**32, position
    return seed0 % 2**32, seed1 % 2**32


def next_step(tracer: Any) -> Value:
    """The counter's value for one random op: the counter advanced by one (1 for the first
    random op of the first step)."""
    from pcompile.compiler.frontend.functional import assign_add

    state = _state(tracer)
    if state.counter is None:
        if any(p.name == COUNTER_NAME for p in tracer.graph.params):
            raise PcompileError(
                f"the network has a Parameter named {COUNTER_NAME!r}, the name of the step "
                "counter its random ops (ops.Dropout, nn.Dropout) keep; rename the Parameter")
        state.counter = Parameter(np.zeros((), np.int32), name=COUNTER_NAME,
                                  requires_grad=False, parallel_optimizer=False)
    # the advanced value: the Parameter's one user is the assignment (a scalar read by ops of
    # different device matrices would be a parameter with two layouts)
    advanced = assign_add(state.counter, 1)
    value: Value = advanced._value
    return value


def random_parameters(tracer: Any) -> dict[str, Parameter]:
    """The counter Parameter (by name) when the trace drew random bits, else nothing: the
    trace adds it to the program's parameters."""
    state = _STATES.get(tracer)
    if state is None or state.counter is None:
        return {}
    return {COUNTER_NAME: state.counter}
