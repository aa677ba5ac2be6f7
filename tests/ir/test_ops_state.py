"""Assign, AssignAdd and AssignSub (ir/ops/state.py): the new value of the variable against
numpy and JAX written directly (forward and gradients, `tests.op_harness.check_op`), the
shape rule (the variable keeps its shape) and MindSpore's element-wise sharding rule
(ArithmeticBase) against the oracle."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam
from pcompile.ir.errors import OpError
from pcompile.ir.types import DType, TensorType
from tests.e2e.test_parallel import draw_strategy, rnd, run_sharded
from tests.op_harness import check_op

REFERENCES = {
    "Assign": lambda x, y: jnp.broadcast_to(y, jnp.shape(x)) + 0 * x,
    "AssignAdd": lambda x, y: x + y,
    "AssignSub": lambda x, y: x - y,
}


@settings(max_examples=4, deadline=None)
@given(st.sampled_from(sorted(REFERENCES)),
       hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4),
       st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_assign_ops_match_numpy(op: str, shape: tuple[int, ...], drop: int, seed: int) -> None:
    """The new value, and gradients to the variable (none for Assign: it is overwritten) and
    to the value (summed over the dims it was broadcast along)."""
    rng = np.random.default_rng(seed)
    value_shape = shape[min(drop, len(shape)):]
    x = rng.standard_normal(shape).astype(np.float32)
    y = rng.standard_normal(value_shape).astype(np.float32)
    check_op(op, [x, y], {}, REFERENCES[op])


@pytest.mark.parametrize("op", sorted(REFERENCES))
def test_the_variable_keeps_its_shape_and_dtype(op: str) -> None:
    graph = Graph("g")
    x = graph.add_param(GraphParam(TensorType(DType.float32, (4,)), "x"))
    wide = graph.add_param(GraphParam(TensorType(DType.float32, (2, 4)), "wide"))
    half = graph.add_param(GraphParam(TensorType(DType.float16, (4,)), "half"))
    with pytest.raises(OpError, match=rf"{op}.*the value \(2, 4\) must broadcast to the "
                                      r"variable's shape \(4,\)"):
        Builder(graph)(op, x, wide)
    with pytest.raises(OpError, match=f"{op}.*one dtype"):
        Builder(graph)(op, x, half)


CASES = {
    "Assign": lambda: ([rnd((4, 8)), rnd((8,), 1)], {}),
    "AssignAdd": lambda: ([rnd((4, 8)), rnd((4, 8), 1)], {}),
    "AssignSub": lambda: ([rnd((2, 4, 6)), rnd((4, 1), 2)], {}),
}


@settings(max_examples=12, deadline=None)
@given(st.data(), st.sampled_from(sorted(CASES)), st.sampled_from([1, 2, 4, 8]))
def test_assign_rules_match_the_oracle(data: Any, case: str, devices: int) -> None:
    arrays, attrs = CASES[case]()
    strategy = draw_strategy(data.draw, case, arrays, attrs, devices)
    run_sharded(case, arrays, attrs, strategy, devices)
