"""The lowering's options reach the op implementations (ops read no environment): attention's
fused-kernel choice follows `LoweringOptions.fused_attention`, which the JAX lowering makes
current while the ops run, from `PCOMPILE_ATTENTION` unless given."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pcompile.backends.jax.lowering import default_lowering, lower_graph
from pcompile.ir.lowering import LoweringOptions, current_lowering, lowering
from pcompile.ir.ops import attention
from tests.ir.test_attention_causal import _training_graph, causal

DIMS = attention.AttentionDims(1, 8, 8, 2, 2, 16, "BSH")


def test_fused_attention_follows_the_lowering(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    assert attention._implementation(np.float16, DIMS, False) == "cudnn"
    with lowering(LoweringOptions(fused_attention=False)):
        assert attention._implementation(np.float16, DIMS, False) == "xla"
    assert attention._implementation(np.float16, DIMS, False) == "cudnn"


@pytest.mark.parametrize(("env", "fused"), [("", True), ("xla", False)])
def test_the_jax_lowering_makes_its_options_current(monkeypatch: pytest.MonkeyPatch, env: str,
                                                    fused: bool) -> None:
    """Attention asks for the current options while the lowered graph is traced: the
    environment's (through `default_lowering`) or the ones given; none outside."""
    monkeypatch.setenv("PCOMPILE_ATTENTION", env)
    assert default_lowering().fused_attention is fused
    seen: list[bool] = []
    original = attention._implementation

    def spy(*args: Any) -> Any:
        seen.append(current_lowering().fused_attention)
        return original(*args)

    monkeypatch.setattr(attention, "_implementation", spy)
    graph, arrays = _training_graph(np.float32, "BNSD", causal(), seed=0)
    lower_graph(graph)(*arrays)
    assert seen and set(seen) == {fused}
    seen.clear()
    lower_graph(graph, options=LoweringOptions(fused_attention=not fused))(*arrays)
    assert seen and set(seen) == {not fused}
    assert current_lowering() == LoweringOptions()  # nothing leaks out of a lowering


@pytest.mark.parametrize(("env", "fused"), [("", True), ("xla", False)])
def test_spmd_programs_trace_inside_a_lowering(monkeypatch: pytest.MonkeyPatch, env: str,
                                               fused: bool) -> None:
    """The SPMD step (JaxSpmdRunner, the generated rank programs) and the pipeline step trace
    their body inside a lowering: the environment's options, and a memo for the trace."""
    import jax

    from pcompile.backends.jax.pipeline import pipeline_function
    from pcompile.backends.jax.spmd import spmd_function
    from pcompile.ir.lowering import lowering_memo

    monkeypatch.setenv("PCOMPILE_ATTENTION", env)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    seen: list[tuple[bool, bool]] = []

    def body(*arrays: Any) -> list[Any]:
        seen.append((current_lowering().fused_attention, lowering_memo() is not None))
        return list(arrays)

    spmd_function(body, mesh, [(2,)])(np.ones(2, np.float32))
    tables = {"union_params": [("x", "input", (2,), "float32")]}
    monkeypatch.setattr("pcompile.backends.jax.pipeline.run_step",
                        lambda tables, units, args, axes, float64: body(*args))
    pipeline_function(tables, [], mesh)(np.ones(2, np.float32))
    assert seen == [(fused, True), (fused, True)]
    assert lowering_memo() is None  # nothing outlives the trace
