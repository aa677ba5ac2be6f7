"""The shrunk check (tools/shrink.py, ir/dims.py): a plan checked op by op on a copy of its
model with the same graph and strategies and smaller dims."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from pcompile.ir import dims
from pcompile.ir.errors import PcompileError
from pcompile.ir.ops.shape import reshape_blocks
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import CHECK_BUDGET_BYTES, check_cost
from pcompile.tools.shrink import (
    choose_shrink,
    communication,
    compile_shrunk,
    plan_splits,
    shrunk_check,
)
from tests import ROOT

GPT = os.path.join(ROOT, "examples", "gpt_block.py")
LLAMA = os.path.join(ROOT, "examples", "llama.py")

#: A GPT layer stack of 7B-class width, sequence and vocabulary (two layers keep it quick).
LARGE_GPT = {"GPT_LAYERS": "2", "GPT_HIDDEN": "4096", "GPT_HEADS": "32", "GPT_SEQ": "2048",
             "GPT_VOCAB": "32000", "GPT_BATCH": "64"}


def _compile(path: str, devices: int, monkeypatch: pytest.MonkeyPatch, **env: str):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    search = "sharding_propagation" if path == GPT else None
    return compile_model(path, devices=devices, search_mode=search, dump=False)


def test_reshape_blocks() -> None:
    assert reshape_blocks((32, 16, 4096), (32, 16, 32, 128)) == [([0], [0]), ([1], [1]),
                                                                 ([2], [2, 3])]
    assert reshape_blocks((8, 16, 64), (128, 64)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_blocks((1, 6, 1, 4), (24,)) == [([1, 3], [0])]


@pytest.mark.parametrize("path,devices,env", [
    (GPT, 8, {}),
    (GPT, 64, {"GPT_BATCH": "64"}),
    (LLAMA, 8, {}),
    (LLAMA, 64, {"LLAMA_BATCH": "16"}),
])
def test_shrunk_check_passes(path: str, devices: int, env: dict[str, str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    program = _compile(path, devices, monkeypatch, **env)
    result = shrunk_check(program, factor=4)
    assert result.report.ok(), result.report.worst
    assert result.report.losses and result.report.errors
    shrunk = result.program
    # the copy is smaller and keeps every op and strategy (also checked by compile_shrunk)
    assert check_cost(shrunk) < check_cost(program)
    assert [n.op for n in shrunk.graph.nodes] == [n.op for n in program.graph.nodes]
    for full, small in zip(program.graph.nodes, shrunk.graph.nodes):
        assert (full.parallel is None) == (small.parallel is None)
        if full.parallel is not None:
            assert full.parallel.in_strategy == small.parallel.in_strategy


def test_shrink_keeps_every_split_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    program = _compile(LLAMA, 8, monkeypatch)
    shrink = choose_shrink(program, factor=8)
    positions = {id(n.result): i for i, n in enumerate(program.graph.nodes)}
    for value, elem, dim, k in plan_splits(program):
        old = dims.shapes_of(value.type)[elem][dim]
        if id(value) in positions:
            new = shrink.results[positions[id(value)]][elem][dim]
        elif hasattr(value, "name") and value.name in shrink.params:
            new = shrink.params[value.name][dim]
        else:
            continue
        assert new % k == 0 and new // k >= min(2, old // k), (value, dim, old, new, k)
    # some dims did shrink, and the token ids stay below the shrunk vocabulary
    vocab = program.graph.param("model.embedding_weight").shape[0]
    new_vocab = shrink.params["model.embedding_weight"][0]
    assert new_vocab < vocab and shrink.bounds["input_ids"] == new_vocab


@pytest.mark.slow
def test_large_plan_is_checked_shrunk_by_the_cli(tmp_path, monkeypatch) -> None:
    from pcompile.cli import main

    for key, value in LARGE_GPT.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(main, [GPT, "--devices", "64", "--search",
                                       "sharding_propagation", "--dump-ranks", "0",
                                       "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "check skipped" in result.output
    assert "shrunk check: factor" in result.output and "4096 -> " in result.output
    assert "worst relative error" in result.output


def test_large_llama_plan_shrinks_within_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    program = _compile(LLAMA, 64, monkeypatch, LLAMA_PRESET="llama2_7b", LLAMA_LAYERS="2",
                       LLAMA_SEQ="2048", LLAMA_BATCH="16")
    assert check_cost(program) > CHECK_BUDGET_BYTES
    shrink = choose_shrink(program)
    shrunk = compile_shrunk(program, shrink)
    assert check_cost(shrunk) <= CHECK_BUDGET_BYTES


def test_broken_plan_fails_the_shrunk_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan without its forward AllReduces (partial sums left unsummed) is caught."""
    from pcompile.passes.step_parallel import RankBuilder

    monkeypatch.setattr(RankBuilder, "forward_comm", lambda self, node, b, out, sharding: out)
    program = _compile(LLAMA, 8, monkeypatch)
    with pytest.raises(PcompileError, match="the plan is wrong"):
        shrunk_check(program, factor=4)


def test_missing_gradient_mirror_fails_the_shrunk_check(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Gradients of replicated parameters left without their AllReduce: every rank runs,
    the updated parameters differ from the single-device program's."""
    from pcompile.passes.step_parallel import RankBuilder

    monkeypatch.setattr(RankBuilder, "mirror_value", lambda self, local, param, user: local)
    program = _compile(GPT, 8, monkeypatch)
    result = shrunk_check(program, factor=4)
    assert not result.report.ok()
    assert result.report.worst[1] > 1e3 * result.report.bound


def test_op_without_a_rule_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    program = _compile(GPT, 8, monkeypatch)
    from pcompile.ir.registry import get_op

    monkeypatch.setattr(get_op("MatMul"), "dims", None)
    shrink = choose_shrink(program, factor=4)
    assert any("MatMul" in why and "no dimension rule" in why for why in shrink.kept)
    with pytest.raises(PcompileError, match="kept at full size by: MatMul .*no dimension rule"):
        choose_shrink(program, budget=1)


def test_a_reshape_that_regroups_dims_is_named() -> None:
    """[256, 48] -> [96, 32, 4] -> [128, 96]: no dim maps to a dim, so none shrinks alone."""
    program = compile_model(os.path.join(ROOT, "tests", "models", "reshape_chain.py"),
                            devices=8, dump=False)
    with pytest.raises(PcompileError, match=r"Reshape \(.*reshape_chain.py:25\) regroups dims "
                                            r"\[256, 48\] as \[96, 32, 4\]"):
        choose_shrink(program, budget=1)


@pytest.mark.parametrize("batch", ["8", "64"])
def test_data_parallel_plan_is_checked_shrunk(batch: str, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """data_parallel traces one rank's part of the batch, its single-device program the whole
    batch: both copies shrink alike (the whole batch stays a multiple of the ranks)."""
    monkeypatch.setenv("GPT_BATCH", batch)
    program = compile_model(GPT, devices=8, parallel_mode="data_parallel", dump=False)
    result = shrunk_check(program, factor=4)
    assert result.report.ok(), result.report.worst
    assert check_cost(result.program) < check_cost(program)
    reference = result.program.state.shrink.reference
    local = result.shrink.params["tokens"]
    assert reference.params["tokens"] == (local[0] * 8, *local[1:])
    assert local[1] < program.graph.param("tokens").shape[1]  # the sequence did shrink


def test_data_parallel_without_gradient_mirrors_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from pcompile.passes.step_parallel import RankBuilder

    monkeypatch.setenv("GPT_BATCH", "64")
    monkeypatch.setattr(RankBuilder, "mirror_value", lambda self, local, param, user: local)
    program = compile_model(GPT, devices=8, parallel_mode="data_parallel", dump=False)
    result = shrunk_check(program, factor=4)
    assert not result.report.ok()


def test_a_shrunk_copy_that_communicates_differently_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shrunk compile re-derives the communication on smaller shapes: if it differs from
    the plan's (here: its gradient mirrors are lost), the check is not about the plan."""
    from pcompile.passes.step_parallel import RankBuilder

    program = _compile(GPT, 8, monkeypatch)
    monkeypatch.setattr(RankBuilder, "mirror_value", lambda self, local, param, user: local)
    with pytest.raises(PcompileError, match=r"communicates differently from the plan.*every "
                                            r"rank's program, op \d+: the plan has "
                                            r"_MirrorOperator.*the shrunk copy Gather"):
        shrunk_check(program, factor=4)


def test_the_shrunk_copy_shards_what_the_plan_sharded() -> None:
    """A parameter over `parallel_optimizer_threshold` (KB) at full size but under it shrunk:
    the parallel optimizer's choice by size is the plan's, so the copy shards exactly the
    parameters the plan sharded (before, it left this one whole and the check refused), and
    the check passes."""
    program = compile_model(GPT, devices=8, parallel_mode="data_parallel", dump=False,
                            overrides={"enable_parallel_optimizer": True,
                                       "parallel_optimizer_config":
                                           {"parallel_optimizer_threshold": 8}})
    assert "embedding.embedding_table" in program.state.opt_shard
    result = shrunk_check(program, factor=4)
    assert result.report.ok(), result.report.worst
    assert set(result.program.state.opt_shard) == set(program.state.opt_shard)


PIPELINE_MLP = os.path.join(ROOT, "examples", "pipeline_mlp.py")


@pytest.mark.parametrize("path,env,search", [
    (PIPELINE_MLP, {}, None),
    (GPT, {"GPT_MICRO": "2"}, "sharding_propagation"),
    (GPT, {"GPT_MICRO": "4", "GPT_BATCH": "16", "GPT_SEQ": "32", "GPT_HIDDEN": "64"}, None),
])
def test_pipeline_plan_is_checked_shrunk(path: str, env: dict[str, str], search: str | None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced graph is one micro-batch, the single-device program the whole batch: the
    batch keeps its size (so do the micro-batches and their splits), the rest shrinks; the
    stages, sends and receives are the plan's (`same_communication`)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    overrides = {"pipeline_stages": 2} if path == GPT else {}
    mode = None if search else ("semi_auto_parallel" if path == GPT else None)
    program = compile_model(path, devices=8, search_mode=search, parallel_mode=mode,
                            overrides=overrides, dump=False)
    assert program.state.micro_batched and program.state.pipeline.stages > 1
    result = shrunk_check(program, factor=4)
    assert result.report.ok(), result.report.worst
    assert check_cost(result.program) < check_cost(program)
    shrunk = result.program.state
    assert shrunk.pipeline.stages == program.state.pipeline.stages
    assert shrunk.pipeline.micro_size == program.state.pipeline.micro_size
    for p in program.graph.inputs:  # the micro-batch and the whole batch keep their sizes
        if p.shape:
            assert result.shrink.params[p.name][0] == p.shape[0]
            assert shrunk.shrink.reference.params[p.name][0] == \
                p.shape[0] * program.state.pipeline.micro_size
    assert any(op in {"Send", "Receive"} for seq in
               communication(result.program) for op, _ in seq)


def test_modes_it_cannot_reproduce_are_refused() -> None:
    program = compile_model(os.path.join(ROOT, "examples", "manual_parallel.py"), devices=8,
                            dump=False)
    with pytest.raises(PcompileError, match="shrunk check reproduces semi_auto_parallel"):
        choose_shrink(program, factor=2)


def test_a_wrong_dimension_rule_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that lets a shape attribute go stale breaks the op's shape rule: one message."""
    program = _compile(GPT, 8, monkeypatch)
    monkeypatch.setattr(dims.rule_of("Reshape"), "rewrite", None)
    with pytest.raises(PcompileError, match="dimension rule in ir/ops is wrong.*Reshape"):
        compile_shrunk(program, choose_shrink(program, factor=4))


@pytest.mark.slow
def test_cli_check_shrunk_flag(tmp_path) -> None:
    from pcompile.cli import main

    runner = CliRunner()
    result = runner.invoke(main, [GPT, "--devices", "8", "--search", "sharding_propagation",
                                  "--check-shrunk", "4", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "shrunk check: factor 4, dims" in result.output
    assert "worst relative error" in result.output
    result = runner.invoke(main, [GPT, "--devices", "1", "--check-shrunk",
                                  "--out", str(tmp_path / "b")])
    assert result.exit_code == 1
    assert "--check-shrunk: the shrunk check checks parallel plans" in result.output


def test_shape_op_rules_keep_every_shape_rule() -> None:
    """Split, Concat, Tile, ExpandDims, Squeeze, Transpose, StridedSlice, reductions,
    BroadcastTo, Gather and OneHot shrunk together still infer what the shrink says (the
    verifier re-infers every node), and index inputs get the shrunk range."""
    import numpy as np

    from pcompile.ir.builder import Builder
    from pcompile.ir.core import Graph, GraphParam
    from pcompile.ir.types import DType, TensorType
    from pcompile.ir.verifier import verify

    g = Graph("net")
    x = g.add_param(GraphParam(TensorType(DType.float32, (8, 12, 16)), "x"))
    table = g.add_param(GraphParam(TensorType(DType.float32, (40, 16)), "table", "weight"))
    ids = g.add_param(GraphParam(TensorType(DType.int32, (8, 13)), "ids"))
    b = Builder(g)
    parts = b("Split", x, axis=1, output_num=2)
    y = b("Concat", b("TupleGetItem", parts, index=1), b("TupleGetItem", parts, index=0),
          axis=1)
    y = b("Tile", b("ExpandDims", y, axis=0), multiples=(2, 1, 1, 1))
    y = b("Transpose", b("ReduceSum", y, axis=(0,), keep_dims=True), perm=(0, 2, 1, 3))
    y = b("Squeeze", y, axis=(0,))
    tokens = b("StridedSlice", ids, begin=(0, 1), end=(8, 13), strides=(1, 1))
    emb = b("Gather", table, tokens, axis=0)
    hot = b("OneHot", tokens, depth=40)
    z = b("Add", b("Transpose", y, perm=(1, 0, 2)), emb)
    z = b("Add", z, b("BroadcastTo", b("ReduceMean", z, axis=(1,), keep_dims=True),
                      shape=(8, 12, 16)))
    g.outputs = [z, hot]
    verify(g)
    shrink = dims.shrink_graph(g, [], 4)
    shrink.apply(g)
    verify(g)
    # the split halves (6) divide by 3 at most (a dim never becomes 1): 12 -> 4; the ids keep
    # the one extra column the slice drops (13 -> 5)
    assert g.param("x").shape == (2, 4, 4) and g.param("table").shape == (10, 4)
    assert g.param("ids").shape == (2, 5) and shrink.bounds == {"ids": 10}
    assert hot.shape == (2, 4, 10)
    batch = shrink.shrink_input("ids", np.arange(8 * 13).reshape(8, 13))
    assert batch.shape == (2, 5) and batch.max() < 10
