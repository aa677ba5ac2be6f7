"""Sharding rules of the primitives a mindformers-style Llama needs, against the single-device
oracle: hypothesis draws a device count and a strategy the rule allows, runs the op sharded on
every simulated rank (forward and input gradients) and compares with the unsharded op."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_parallel import draw_strategy, rnd, run_sharded

DEVICES = st.sampled_from([1, 2, 4, 8, 16])
RULE_EXAMPLES = settings(max_examples=12, deadline=None,
                         suppress_health_check=list(HealthCheck))


def ints(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 3, shape).astype(np.int32)


def bools(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random(shape) < 0.5


CASES: dict[str, Any] = {
    "NotEqual": lambda: ([ints((4, 8)), ints((8,), 2)], {}),
    "Equal": lambda: ([ints((4, 8)), ints((4, 8), 2)], {}),
    "LessEqual": lambda: ([rnd((4, 8)), rnd((4, 1), 2)], {}),
    "GreaterEqual": lambda: ([rnd((4, 8)), rnd((4, 8), 2)], {}),
    "LogicalAnd": lambda: ([bools((4, 8)), bools((1, 8), 2)], {}),
    "LogicalOr": lambda: ([bools((4, 8)), bools((4, 8), 2)], {}),
    "LogicalNot": lambda: ([bools((4, 8))], {}),
    "Select": lambda: ([bools((4, 8)), rnd((4, 8)), rnd((8,), 2)], {}),
    "SiLU": lambda: ([rnd((8, 4))], {}),
}


@pytest.mark.parametrize("op", sorted(CASES))
@RULE_EXAMPLES
@given(data=st.data(), devices=DEVICES)
def test_rule_matches_the_oracle(op: str, data: Any, devices: int) -> None:
    arrays, attrs = CASES[op]()
    strategy = draw_strategy(data.draw, op, arrays, attrs, devices)
    run_sharded(op, arrays, attrs, strategy, devices)
