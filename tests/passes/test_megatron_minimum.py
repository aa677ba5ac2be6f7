"""plan.json's `megatron_minimum` (passes/search/megatron.py): the transformer is recognised from
the compiled graph, the scheme follows the plan's layouts, the minimum is benchmarks/plan_bytes.py's
formula, and the plan's ring bytes are rank 0's collectives; and the prediction's bytes
(passes/search/time_model.py) follow the same convention as the plan's collectives."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pcompile.passes.search.megatron import (
    Transformer,
    TransformerSizes,
    minimum_ring_bytes,
    minimum_terms,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile(monkeypatch: Any, path: str, devices: int, **env: str) -> Any:
    from pcompile.compiler.driver.driver import compile_program

    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return compile_program(os.path.join(ROOT, "examples", path), devices=devices, dump=False)


def _ring_bytes(program: Any) -> int:
    from pcompile.passes.comm_info import is_communication, node_ring_bytes

    return sum(node_ring_bytes(n) for n in program.state.rank_graphs[0].nodes
               if is_communication(n) and n.op != "_MirrorOperator")


@pytest.mark.parametrize("mp", [1, 2, 4])
def test_llama_hand_plans_against_their_minimum(monkeypatch: Any, mp: int) -> None:
    """mindformers' strategies at dp = 8 / mp: the scheme is recognised at that width, the
    plan's bytes are rank 0's, at least the minimum, within 1% of it (the scalar loss
    reductions and the norms' gradients are all it adds), and the best scheme on 8 devices
    moves no more than the plan's own."""
    from pcompile.compiler.driver.plan import build_plan

    program = _compile(monkeypatch, "llama.py", 8, LLAMA_MP=str(mp), LLAMA_BATCH="8")
    found = build_plan(program.state).megatron_minimum
    assert found is not None and found.scheme is not None and found.best_scheme is not None
    assert (found.scheme.dp, found.scheme.mp) == (8 // mp, mp)
    assert found.scheme.head_split == (mp > 1) and not found.scheme.embedding_split
    assert found.ring_bytes == _ring_bytes(program)
    assert found.minimum_ring_bytes is not None and found.ratio is not None
    assert found.minimum_ring_bytes <= found.ring_bytes <= 1.01 * found.minimum_ring_bytes
    assert found.best_minimum_ring_bytes is not None
    assert found.best_minimum_ring_bytes <= found.minimum_ring_bytes
    # the prediction counts every collective of these plans; what it does not model (local
    # vjps of AllReduces whose cotangent is alike on every rank) only moves fewer bytes
    assert found.ring_bytes <= program.state.plan["prediction"]["communication_bytes"]


def test_models_it_does_not_know_get_none(monkeypatch: Any) -> None:
    from pcompile.compiler.driver.plan import build_plan

    program = _compile(monkeypatch, "mixtral.py", 8)  # routed experts: not Megatron's layer
    assert build_plan(program.state).megatron_minimum is None


def _sizes(**kw: Any) -> TransformerSizes:
    base = dict(layers=2, hidden=64, kv=32, ffn=128, vocab=128, tokens=64, act_bytes=4,
                dp=1, mp=1)
    return TransformerSizes(**{**base, **kw})


def test_the_formula() -> None:
    """One device moves nothing; with mp = 4 alone the activations' AllReduces (4 per layer,
    one for the LM head's input gradient, three float32 cross-entropy reductions per token)
    are all there is."""
    assert minimum_ring_bytes(_sizes()) == 0
    c = _sizes(mp=4)
    act = c.tokens * c.hidden * c.act_bytes
    ring = 2 * 3 / 4  # ring AllReduce over 4
    expected = ring * ((4 * c.layers + 1) * act + 3 * 4 * c.tokens)
    assert minimum_ring_bytes(c) == pytest.approx(expected, abs=len(minimum_terms(c)))
    # sequence parallelism adds the embedding output's gradient, gathered over mp
    sp = minimum_ring_bytes(_sizes(mp=4, seq_parallel=True)) - minimum_ring_bytes(c)
    assert sp == 3 * act // 4


def test_valid_schemes_divide() -> None:
    model = Transformer(_sizes(tokens=8 * 16, kv=32), devices=8, batch=2, plan_mp=1)
    assert model.scheme is None  # 8 replicas of a batch of 2
    widths = {(s.dp, s.mp) for s in model.schemes()}
    assert widths == {(2, 4), (1, 8)}
    assert all(s.tokens * s.dp == 8 * 16 for s in model.schemes())


@pytest.mark.parametrize("search", [
    None, "ilp", "sharding_propagation", "recursive_programming",
    pytest.param("dynamic_programming", marks=pytest.mark.slow)])
def test_predicted_bytes_bound_the_plans_own(monkeypatch: Any, search: str | None) -> None:
    """Every plan's prediction (plan.json `prediction.communication_bytes`) counts what its
    collectives move: at least rank 0's ring bytes. The cost model leaves out only savings of
    the passes (an AllReduce's vjp made local where the cotangent is alike on every rank, an
    AllReduce turned ReduceScatter before a split, an embedding's shares summed after its
    Cast), so a plan moving more than predicted is a collective the model misses."""
    from pcompile.compiler.driver.driver import compile_program
    from pcompile.passes.comm_info import is_communication, node_ring_bytes

    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LLAMA_LAYERS", "2")
    monkeypatch.setenv("LLAMA_BATCH", "2")
    if search is not None:
        monkeypatch.setenv("LLAMA_STRATEGIES", "none")
    program = compile_program(os.path.join(ROOT, "examples", "llama.py"), devices=8,
                              dump=False, search_mode=search,
                              overrides={"device_memory_capacity": 4e5} if search == "ilp"
                              else None)
    actual = sum(node_ring_bytes(n) for n in program.state.rank_graphs[0].nodes
                 if is_communication(n) and n.op != "_MirrorOperator")
    assert actual <= program.state.plan["prediction"]["communication_bytes"]
