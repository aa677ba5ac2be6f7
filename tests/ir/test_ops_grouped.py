"""GroupedMatmul (mindformers' MoEV3 `use_gmm`): values and gradients against JAX written
directly (`tests/op_harness.py`) for counts where some experts get no rows and the last rows
belong to none; its sharding rule against the unsharded op; a row split refused with one
message."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from pcompile.ir.errors import OpError
from pcompile.passes.step_parallel_begin import assign
from tests.ir.test_parallel_ops import case_graph, run_sharded
from tests.op_harness import check_op

ROWS, K, N, EXPERTS = 7, 4, 6, 4
# expert 0: rows 0-1, expert 1: none, expert 2: rows 2-5, expert 3: none; row 6: no expert
GROUP_LIST = np.array([2, 2, 6, 6], np.int64)


def _reference(x: Any, weight: Any, group_list: Any) -> Any:
    """Row m times the matrix of the first expert whose end is past m; zero after the last."""
    rows = jnp.arange(x.shape[0])
    expert = jnp.searchsorted(group_list, rows, side="right")
    chosen = weight[jnp.clip(expert, 0, weight.shape[0] - 1)]
    out = jnp.einsum("mk,mkn->mn", x, chosen)
    return jnp.where((expert < weight.shape[0])[:, None], out, 0).astype(x.dtype)


def _arrays(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((ROWS, K)).astype(np.float32),
            rng.standard_normal((EXPERTS, K, N)).astype(np.float32), GROUP_LIST]


@pytest.mark.parametrize("group_list", [GROUP_LIST, np.array([0, 3, 3, 7], np.int32)])
def test_grouped_matmul(group_list: np.ndarray) -> None:
    """Forward (numpy interpreter and jax.lax.ragged_dot) and both gradients (dx through the
    transposed weight, dw through GroupedMatmulWeightGrad) against the masked einsum."""
    x, w, _ = _arrays()
    check_op("GroupedMatmul", [x, w, group_list], {}, _reference)


@pytest.mark.parametrize("strategy", [((1, 2), (1, 2, 4), (1,)), ((1, 1), (1, 1, 8), (1,)),
                                      ((1, 4), (1, 4, 1), (1,))])
def test_grouped_matmul_rule_matches_the_oracle(strategy: Any) -> None:
    """K split (the result all-reduced) and N split on 8 simulated ranks: every output and
    gradient equals one device's (float64)."""
    x = np.random.default_rng(1).standard_normal((ROWS, 8)).astype(np.float32)
    w = np.random.default_rng(2).standard_normal((EXPERTS, 8, 8)).astype(np.float32)
    run_sharded("GroupedMatmul", [x, w, GROUP_LIST], {}, strategy, 8)


def test_grouped_matmul_row_split_is_refused() -> None:
    x, w, groups = _arrays()
    x = np.zeros((8, K), np.float32)
    graph, _ = case_graph("GroupedMatmul", [x, w, groups], {}, ((2, 1), (1, 1, 1), (1,)))
    with pytest.raises(OpError) as info:
        assign(graph, 2, "full_batch")
    assert "the grouped rows and the expert dim" in str(info.value)
