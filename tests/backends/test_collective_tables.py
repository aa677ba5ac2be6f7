"""Each backend keeps one table of the collectives it runs, a row per collective: the numpy
simulator (backends/numpy/simulate.py `COLLECTIVES`) and the JAX backend
(backends/jax/collectives.py `COLLECTIVES`, read by the SPMD lowering and the code generator).
A collective declared in ir/ops/comm.py without its rows, or a row of no collective, fails here."""

from __future__ import annotations

import inspect

import pytest

from pcompile.backends.jax import collectives as jax_table
from pcompile.backends.numpy import simulate
from pcompile.ir.registry import get_op, group_collectives


def test_every_collective_has_one_row_in_each_backend() -> None:
    declared = set(group_collectives())
    assert declared == {"AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "Broadcast"}
    assert set(simulate.COLLECTIVES) == declared
    assert set(jax_table.COLLECTIVES) == declared


def test_jax_rows_name_spmd_functions_and_declared_attributes() -> None:
    spmd = pytest.importorskip("pcompile.backends.jax.spmd")
    for name, row in jax_table.COLLECTIVES.items():
        assert set(row.attrs) <= set(get_op(name).attrs), name
        over_axes, over_group = getattr(spmd, row.over_axes), getattr(spmd, row.over_group)
        assert "axes" in inspect.signature(over_axes).parameters, name
        assert list(inspect.signature(over_group).parameters)[:3] == ["parts", "x", "position"]
        # the keywords it gives are the function's own
        attrs = get_op(name).full_attrs({})
        kept = {k: v for k, v in attrs.items() if k in row.attrs}
        assert set(row.keywords(kept)) <= set(inspect.signature(over_axes).parameters), name

