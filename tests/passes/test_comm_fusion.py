"""Communication fusion (passes/comm_fusion.py, reference §6): bucketing, the rewrite of each
bucket into one collective, the report, and training results against the single-device
oracle.

The model is the reference's UT: 12 bias-free Dense(128, 128) weights (16384 elements each) on
4 devices, semi_auto_parallel with no strategies (data parallel: every gradient is all-reduced
over the 4 ranks)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np
import pytest

from pcompile.backends.numpy.simulate import _same_structure, run_ranks
from pcompile.compiler.config.context import context_override
from pcompile.compiler.config.pass_options import fusion_config, fusion_config_from_dict
from pcompile.compiler.driver.compiled import CompiledProgram
from pcompile.ir.builder import Builder
from pcompile.ir.core import Graph, GraphParam, Value
from pcompile.ir.parser import parse_graph
from pcompile.ir.printer import print_graph
from pcompile.ir.types import DType, TensorType
from pcompile.ir.verifier import verify
from pcompile.passes.comm_fusion import (
    MB_TO_ELEMENTS,
    CommFusionPass,
    FusionConfig,
    FusionReport,
    count_collectives,
    fuse_communication,
)
from pcompile.tools import oracle
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

MODEL = os.path.join(ROOT, "tests", "models", "fusion_dense.py")
DEVICES = 4
# Gradient order in the backward graph: the layer nearest the output first.
BACKWARD = [f"backbone{b}.fc{i}.weight" for b in (2, 1) for i in range(6, 0, -1)]
WEIGHTS = sorted(BACKWARD)
# Per rank before fusion: 12 gradient AllReduces, plus the loss mean's AllReduce (its vjp is a
# local Mul: every rank holds the loss alike, passes/cotangents.py).
BEFORE = 13
LOSS = 1  # the loss mean's AllReduce, never fused with gradients


def compile_dense(monkeypatch: pytest.MonkeyPatch, width: int = 128, ids: str = "",
                  **overrides: object) -> CompiledProgram:
    monkeypatch.setenv("FUSION_WIDTH", str(width))
    monkeypatch.setenv("FUSION_IDS", ids)
    # The driver fuses by default; compile unfused so each test applies its own config.
    overrides.setdefault("comm_fusion", {"openstate": False})
    return compile_model(MODEL, devices=DEVICES, dump=False, overrides=dict(overrides))


def fuse(program: CompiledProgram, config: FusionConfig) -> list[FusionReport]:
    fusion = CommFusionPass(config)
    fusion.apply(program.state)
    for graph in program.rank_graphs:
        verify(graph, allow_extra_attrs=True)
    assert _same_structure(program.rank_graphs)  # the simulator still runs ranks in lockstep
    return fusion.reports


def config(comm_fusion: dict | None = None, split: tuple[int, ...] = ()) -> FusionConfig:
    return fusion_config_from_dict(comm_fusion, split, world_size=DEVICES)


def gradient_allreduces(program: CompiledProgram, rank: int = 0) -> list[int]:
    """The fusion ids of rank `rank`'s AllReduces with a fusion id (the gradient ones)."""
    return [n.attrs["fusion"] for n in program.rank_graph(rank).nodes
            if n.op == "AllReduce" and n.attrs["fusion"] > 0]


def assert_oracle(program: CompiledProgram, steps: int = 2) -> None:
    report = oracle.check(program, steps=steps)
    assert report.ok(), (report.worst, report.losses)


# --------------------------------------------------------------------------------------------
# The reference UT: everything in one bucket
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "comm_fusion",
    [None, {"allreduce": {"mode": "auto", "config": None}},
     {"allreduce": {"mode": "size", "config": 32}}],
    ids=["default", "auto", "size32"],
)
def test_every_weight_in_one_bucket(monkeypatch: pytest.MonkeyPatch,
                                    comm_fusion: dict | None) -> None:
    program = compile_dense(monkeypatch)
    assert [count_collectives(g) for g in program.rank_graphs] == [BEFORE] * DEVICES
    reports = fuse(program, config(comm_fusion))
    for rank, report in enumerate(reports):
        assert report.parameter_fusion == dict.fromkeys(WEIGHTS, 1)
        assert report.collectives_before == BEFORE
        assert report.collectives_after == BEFORE - 11
        assert count_collectives(program.rank_graph(rank)) == BEFORE - 11
        assert gradient_allreduces(program, rank) == [1]
        (bucket,) = report.buckets
        assert bucket.kind == "AllReduce" and bucket.fusion == 1
        assert list(bucket.members) == BACKWARD
        assert bucket.elements == 12 * 16384 and bucket.nbytes == 12 * 16384 * 4
        assert bucket.rank_list == (0, 1, 2, 3) and bucket.fused
    assert_oracle(program, steps=3)


def test_fused_dump_names_the_bucket_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch)
    fuse(program, config())
    graph = program.rank_graph(0)
    text = print_graph(graph)
    (line,) = [ln for ln in text.splitlines() if "instance name: allreduce_fusion" in ln]
    assert "fusion: 1}" in line and "members: (backbone2.fc6.weight," in line
    assert f"bytes: {12 * 16384 * 4}" in line
    assert "Concat(" in text and "Split(" in text
    # The mirrors carry the bucket id too (MindSpore writes it on the mirror).
    assert {n.attrs["fusion"] for n in graph.nodes if n.op == "_MirrorOperator"} == {1}
    assert print_graph(parse_graph(text)) == text


# --------------------------------------------------------------------------------------------
# Size, index and per-parameter ids
# --------------------------------------------------------------------------------------------


def test_size_mode_is_mindsporess_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    # 256 x 256 = 65536 elements per weight, budget 1 MB = 262144 elements: the first bucket
    # takes 3 (the 4th does not fit in the 65536 left), later buckets 4 (the opener is not
    # subtracted), the last one the remaining weight.
    program = compile_dense(monkeypatch, width=256)
    (report, *_) = fuse(program, config({"allreduce": {"mode": "size", "config": 1}}))
    assert MB_TO_ELEMENTS == 262144
    assert [list(b.members) for b in report.buckets] == [
        BACKWARD[0:3], BACKWARD[3:7], BACKWARD[7:11], BACKWARD[11:]]
    assert [b.fusion for b in report.buckets] == [1, 2, 3, 4]
    assert [bool(b.fused) for b in report.buckets] == [True, True, True, False]
    assert report.parameter_fusion[BACKWARD[0]] == 1 and report.parameter_fusion[BACKWARD[11]] == 4
    assert report.collectives_after == LOSS + 4
    assert sorted(gradient_allreduces(program)) == [1, 2, 3, 4]
    assert_oracle(program)


def test_size_smaller_than_one_weight_gives_one_bucket_per_weight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 640 x 640 = 409600 elements per weight > the 1 MB budget (262144 elements): every weight
    # opens a bucket of its own, so nothing is fused.
    program = compile_dense(monkeypatch, width=640)
    (report, *_) = fuse(program, config({"allreduce": {"mode": "size", "config": 1}}))
    assert [list(b.members) for b in report.buckets] == [[w] for w in BACKWARD]
    assert not any(b.fused for b in report.buckets)
    assert report.collectives_after == report.collectives_before == BEFORE


@pytest.mark.parametrize("old_api", [False, True],
                         ids=["comm_fusion_index", "all_reduce_fusion_config"])
def test_index_mode_splits_where_told(monkeypatch: pytest.MonkeyPatch, old_api: bool) -> None:
    program = compile_dense(monkeypatch)
    cfg = (config(split=(3, 7)) if old_api
           else config({"allreduce": {"mode": "index", "config": [3, 7]}}))
    assert cfg.kinds["AllReduce"].mode == "index"
    reports = fuse(program, cfg)
    for report in reports:
        # Each index closes a segment (inclusive): gradients 0-3, 4-7, 8-11.
        assert [list(b.members) for b in report.buckets] == [
            BACKWARD[0:4], BACKWARD[4:8], BACKWARD[8:12]]
        assert report.parameter_fusion == {
            **dict.fromkeys(BACKWARD[0:4], 1), **dict.fromkeys(BACKWARD[4:8], 2),
            **dict.fromkeys(BACKWARD[8:12], 3)}
        assert report.collectives_after == LOSS + 3
    assert_oracle(program)


def test_index_beyond_the_gradient_count_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch)
    (report, *_) = fuse(program, config({"allreduce": {"mode": "index", "config": [5, 40]}}))
    assert [len(b.members) for b in report.buckets] == [6, 6]


def test_one_bucket_per_weight_with_parameter_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    # size mode cannot go below 1 MB (> one 16384-element weight); distinct ids split fully.
    ids = ";".join(f"backbone{b}.fc{i}={(b - 1) * 6 + i}" for b in (1, 2) for i in range(1, 7))
    program = compile_dense(monkeypatch, ids=ids)
    (report, *_) = fuse(program, config())
    expected = {f"backbone{b}.fc{i}.weight": (b - 1) * 6 + i for b in (1, 2) for i in range(1, 7)}
    assert report.parameter_fusion == expected
    assert not report.fused_buckets
    assert report.collectives_after == BEFORE
    assert_oracle(program)


def test_comm_fusion_zero_is_never_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch, ids="backbone1.fc3=0")
    (report, *_) = fuse(program, config())
    assert report.parameter_fusion["backbone1.fc3.weight"] == 0
    assert {v for k, v in report.parameter_fusion.items() if k != "backbone1.fc3.weight"} == {1}
    (bucket,) = report.buckets
    assert "backbone1.fc3.weight" not in bucket.members and len(bucket.members) == 11
    # Its own AllReduce is still there, unfused: the loss AllReduces + it + the fused one.
    zero = [n for n in program.rank_graph(0).nodes
            if n.op == "AllReduce" and n.operands[0].shape == (128, 128)]
    assert len(zero) == 1 and zero[0].attrs["fusion"] == 0
    assert report.collectives_after == LOSS + 1 + 1
    assert_oracle(program)


def test_set_comm_fusion_separates_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch, ids="backbone2=2")
    reports = fuse(program, config({"allreduce": {"mode": "size", "config": 32}}))
    for report in reports:
        assert report.parameter_fusion == {
            **{f"backbone1.fc{i}.weight": 1 for i in range(1, 7)},
            **{f"backbone2.fc{i}.weight": 2 for i in range(1, 7)}}
        assert [(b.fusion, b.user_fusion, len(b.members)) for b in report.buckets] == [
            (1, 1, 6), (2, 2, 6)]
        assert report.collectives_after == LOSS + 2
    assert sorted(gradient_allreduces(program)) == [1, 2]
    assert_oracle(program)


def test_openstate_false_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch)
    before = [print_graph(g, r) for r, g in enumerate(program.rank_graphs)]
    reports = fuse(program, config({"openstate": False}))
    assert [print_graph(g, r) for r, g in enumerate(program.rank_graphs)] == before
    assert reports[0].buckets == []
    assert reports[0].parameter_fusion == dict.fromkeys(WEIGHTS, 1)  # the users' ids


def test_pass_takes_the_contexts_config_and_fills_the_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch)
    with context_override(comm_fusion={"allreduce": {"mode": "index", "config": [5]}}):
        fusion = CommFusionPass(fusion_config())  # as the driver builds it
    assert fusion.name == "comm_fusion"
    fusion.apply(program.state)
    assert [len(b.members) for b in fusion.reports[0].buckets] == [6, 6]
    plan = program.state.plan["comm_fusion"]
    assert plan["collectives_per_rank"] == [{"before": BEFORE, "after": LOSS + 2}] * DEVICES
    assert plan["parameter_fusion"] == fusion.reports[0].parameter_fusion
    json.dumps(plan)  # plan.json material


def test_single_device_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_WIDTH", "128")
    program = compile_model(MODEL, devices=1, dump=False)
    before = print_graph(program.rank_graph(0))
    CommFusionPass(config()).apply(program.state)
    assert print_graph(program.rank_graph(0)) == before


def test_parallel_optimizer_gathers_and_scatters_fuse(monkeypatch: pytest.MonkeyPatch) -> None:
    program = compile_dense(monkeypatch, enable_parallel_optimizer=True)
    graph = program.rank_graph(0)
    assert count_collectives(graph, ["AllGather"]) == 12
    assert count_collectives(graph, ["ReduceScatter"]) == 12
    cfg = config({"allgather": {"mode": "auto", "config": None},
                  "reducescatter": {"mode": "size", "config": 32}})
    (report, *_) = fuse(program, cfg)
    graph = program.rank_graph(0)
    assert count_collectives(graph, ["AllGather"]) == 1
    assert count_collectives(graph, ["ReduceScatter"]) == 1
    assert set(report.fusion_ids("AllGather")) == set(WEIGHTS)
    assert report.fusion_ids("ReduceScatter") == dict.fromkeys(BACKWARD, 1)
    assert_oracle(program)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def test_config_from_context() -> None:
    cfg = config()
    assert cfg.openstate and set(cfg.kinds) == {"AllReduce"}
    assert cfg.kinds["AllReduce"].threshold_elements == 64 * 262144
    cfg = config({"allgather": {"mode": "size", "config": 16}})
    assert cfg.kinds["AllGather"].threshold_mb == 16
    assert "ReduceScatter" not in cfg.kinds
    assert config({"openstate": False}).enabled("AllReduce") is None


@pytest.mark.parametrize(
    ("comm_fusion", "exc", "words"),
    [
        ({"allreduce": {"mode": "size", "config": "30.12"}}, TypeError, "mode 'size'"),
        ({"openstate": "True"}, TypeError, "openstate"),
        ("allreduce", TypeError, "must be a dict"),
        ({"all": {"mode": "auto", "config": None}}, KeyError, "unknown key 'all'"),
        ({"allreduce": {"modes": "size", "config": 32}}, KeyError, "key 'mode'"),
        ({"allreduce": {"mode": "sizes", "config": 32}}, KeyError, "must be one of"),
        ({"allgather": {"mode": "index", "config": [2]}}, KeyError, "must be one of"),
    ],
)
def test_invalid_configs_are_rejected(comm_fusion: object, exc: type[Exception],
                                      words: str) -> None:
    with pytest.raises(exc) as info:
        fusion_config_from_dict(comm_fusion)  # type: ignore[arg-type]
    assert type(info.value) is exc
    assert "comm_fusion" in str(info.value) and words in str(info.value)


# --------------------------------------------------------------------------------------------
# Hand-built rank graphs: every kind, unequal sizes, dependencies
# --------------------------------------------------------------------------------------------

WORLD = (0, 1, 2, 3)


def rank_graphs(shapes: list[tuple[int, ...]],
                body: Callable[[Builder, list[Value], int], list[Value]]) -> list[Graph]:
    graphs = []
    for rank in WORLD:
        graph = Graph("synthetic")
        params = [graph.add_param(GraphParam(TensorType(DType.float32, s), f"x{i}", "input"))
                  for i, s in enumerate(shapes)]
        graph.outputs = body(Builder(graph), list(params), rank)
        verify(graph)
        graphs.append(graph)
    return graphs


def feeds(shapes: list[tuple[int, ...]]) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(7)
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in WORLD]


def comm(b: Builder, kind: str, x: Value, ranks: tuple[int, ...] = WORLD, fusion: int = 1,
         name: str = "", **attrs: object) -> Value:
    group = "world" if ranks == WORLD else f"g{ranks[0]}"
    return b.emit(kind, [x], {"group": group, "rank_list": ranks, "fusion": fusion, **attrs},
                  instance_name=name)


def check_same_results(shapes: list[tuple[int, ...]], body: Callable[..., list[Value]],
                       cfg: FusionConfig) -> tuple[list[Graph], FusionReport]:
    plain = rank_graphs(shapes, body)
    fused = rank_graphs(shapes, body)
    reports = [fuse_communication(g, cfg) for g in fused]
    for g in fused:
        verify(g)
    want = run_ranks(plain, feeds(shapes))
    got = run_ranks(fused, feeds(shapes))
    # A fused collective reduces each element over the same ranks in the same order as the
    # collectives it replaces (only the buffer around it changes): the results are bitwise equal.
    for w_rank, g_rank in zip(want, got):
        for w, g in zip(w_rank, g_rank):
            np.testing.assert_array_equal(g, w)
    return fused, reports[0]


ALL_KINDS = config({"allreduce": {"mode": "auto", "config": None},
                    "allgather": {"mode": "auto", "config": None},
                    "reducescatter": {"mode": "auto", "config": None}})


def test_every_kind_with_unequal_sizes() -> None:
    shapes = [(4, 3), (2, 5), (6,), (8, 2), (4, 3), ()]

    def body(b: Builder, x: list[Value], rank: int) -> list[Value]:
        outs = [comm(b, "AllReduce", v, name=f"ar{i}") for i, v in enumerate(x[:3])]
        outs += [b("Mul", comm(b, "AllReduce", x[5], name="scalar"), 2.0)]
        outs += [comm(b, "AllGather", v, name=f"ag{i}") for i, v in enumerate(x[:2])]
        outs += [comm(b, "ReduceScatter", v, name=f"rs{i}") for i, v in enumerate(x[3:5])]
        outs += [comm(b, "AllReduce", x[0], op="max", name="armax")]
        return outs

    graphs, report = check_same_results(shapes, body, ALL_KINDS)
    kinds = {(bk.kind, bk.members) for bk in report.buckets}
    assert kinds == {("AllReduce", ("ar0", "ar1", "ar2", "scalar")), ("AllGather", ("ag0", "ag1")),
                     ("ReduceScatter", ("rs0", "rs1")), ("AllReduce", ("armax",))}
    assert report.collectives_before == 9 and report.collectives_after == 4
    assert count_collectives(graphs[0], ["AllReduce"]) == 2  # sum bucket + the max one


def test_only_enabled_kinds_and_positive_ids_fuse() -> None:
    shapes = [(4, 2), (4, 2), (4, 2), (4, 2)]

    def body(b: Builder, x: list[Value], rank: int) -> list[Value]:
        return [comm(b, "AllReduce", x[0], fusion=0), comm(b, "AllReduce", x[1], fusion=0),
                comm(b, "AllGather", x[2]), comm(b, "AllGather", x[3])]

    graphs, report = check_same_results(shapes, body, config())
    assert report.buckets == [] and report.collectives_after == 4


def test_a_member_depending_on_another_goes_to_another_bucket() -> None:
    shapes = [(4, 2), (4, 2), (4, 2)]

    def body(b: Builder, x: list[Value], rank: int) -> list[Value]:
        a = comm(b, "AllReduce", x[0], name="a")
        c = comm(b, "AllReduce", b("Mul", a, 2.0), name="c")
        d = comm(b, "AllReduce", x[1], name="d")
        return [a, c, d, comm(b, "AllReduce", x[2], name="e")]

    _, report = check_same_results(shapes, body, config())
    assert [bk.members for bk in report.buckets] == [("a",), ("c", "d", "e")]


def test_fusing_never_creates_a_cycle_across_buckets() -> None:
    # a, c in the world group; b, d in pairs. c depends on b and d on a: fusing {a, c} makes
    # a's result depend on b, so {b, d} must then be split. a's user `ma` comes before c and
    # must move after the fused AllReduce.
    shapes = [(4, 3), (4, 3)]

    def body(b: Builder, x: list[Value], rank: int) -> list[Value]:
        pair = (0, 1) if rank < 2 else (2, 3)
        a = comm(b, "AllReduce", x[0], name="a")
        bb = comm(b, "AllReduce", x[1], pair, name="b")
        ma = b("Mul", a, 3.0)
        mb = b("Mul", bb, 2.0)
        c = comm(b, "AllReduce", mb, name="c")
        d = comm(b, "AllReduce", ma, pair, name="d")
        return [a, bb, c, d]

    graphs, report = check_same_results(shapes, body, config())
    assert [(bk.members, bool(bk.fused)) for bk in report.buckets] == [
        (("a", "c"), True), (("b",), False), (("d",), False)]
    assert report.collectives_after == 3
