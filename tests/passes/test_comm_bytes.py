"""Bytes of collectives in two conventions (passes/comm_info.py): received (`bytes`) and sent
with ring algorithms (`ring_bytes`), in plan.json and `pcompile show`; and the HLO parsing
that benchmarks/plan_bytes.py and plan_quality.py share (benchmarks/collective_bytes.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
from click.testing import CliRunner

from pcompile.cli import main
from pcompile.ir.registry import CommFacts, all_ops, get_op, group_collectives
from pcompile.ir.types import DType, TensorType
from pcompile.passes.comm_fusion import FUSIBLE_OPS
from pcompile.passes.comm_info import collective_bytes, ring_bytes, ring_sent_ops
from pcompile.tools.inspection import comm_summary, comm_totals, load
from tests import ROOT

QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


@pytest.mark.parametrize("op, size, n, sent", [
    ("AllReduce", 1024, 4, 1536),  # 2 (n-1)/n S: ReduceScatter + AllGather
    ("AllReduce", 1024, 2, 1024),
    ("AllGather", 256, 4, 768),  # (n-1) S_in = (n-1)/n S_out
    ("ReduceScatter", 1024, 4, 768),  # (n-1)/n S_in
    ("AlltoAll", 1024, 8, 896),
    ("Broadcast", 100, 8, 100),
    ("Send", 64, 2, 64),
    ("Receive", 64, 2, 0),
    ("_MirrorOperator", 1024, 4, 1536),  # stands for its gradient AllReduce
    ("AllReduce", 1024, 1, 0),  # a group of one moves nothing
    ("AllGather", 256, 1, 0),
])
def test_ring_bytes(op: str, size: int, n: int, sent: int) -> None:
    assert ring_bytes(op, size, n) == sent


def test_allreduce_equals_its_reduce_scatter_and_all_gather() -> None:
    size, n = 4096, 8
    assert ring_bytes("AllReduce", size, n) == (
        ring_bytes("ReduceScatter", size, n) + ring_bytes("AllGather", size // n, n))
    assert set(ring_sent_ops()) >= {"AllReduce", "AllGather", "ReduceScatter", "AlltoAll",
                              "Broadcast", "Send", "Receive"}


def test_bytes_and_fusibility_are_facts_of_each_communication_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each communication op's block (ir/ops/comm.py, ir/ops/pipeline.py) declares what one rank
    receives and sends and whether comm_fusion buckets it; comm_info and comm_fusion keep no
    list of collective names but read those facts."""
    facts = {name: d.comm for name, d in all_ops().items() if d.comm is not None}
    assert set(facts) == {*group_collectives(), "Send", "Receive", "_MirrorOperator"}
    assert FUSIBLE_OPS == {"AllReduce": "allreduce", "AllGather": "allgather",
                           "ReduceScatter": "reducescatter"}
    piece, whole = TensorType(DType.float32, (4, 8)), TensorType(DType.float32, (16, 8))
    received = {op: collective_bytes(op, piece, whole, 4) for op in facts}
    assert received == {"AllReduce": 128, "AllGather": 384, "ReduceScatter": 1536,
                        "AlltoAll": 96, "Broadcast": 128, "_MirrorOperator": 128, "Send": 0,
                        "Receive": 512}  # as pipeline_split writes them (plan-json.md)
    # a changed fact is what the passes see
    alltoall = get_op("AlltoAll")
    assert alltoall.comm is not None
    monkeypatch.setattr(alltoall, "comm",
                        CommFacts(lambda i, o, n: 7 * n, lambda s, n: 5 * n, "alltoall"))
    assert ring_bytes("AlltoAll", 1024, 4) == 20
    assert collective_bytes("AlltoAll", piece, piece, 4) == 28
    assert set(ring_sent_ops()) == set(facts)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("bytes") / "out")
    result = CliRunner().invoke(main, [QUICKSTART, "--devices", "8", "--out", out, "--no-check",
                                       "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def test_plan_json_ring_bytes(quickstart: str) -> None:
    plan = load(quickstart)
    kinds = set()
    for rank in plan.dump_ranks:
        for row in plan.collectives[str(rank)]:
            n = len(row.rank_list)
            kinds.add(row.op)
            assert row.ring_bytes is not None
            if row.op in ("AllReduce", "_MirrorOperator"):  # received = the operand
                assert row.ring_bytes == 2 * (n - 1) * row.bytes // n, row
            elif row.op in ("ReduceScatter", "AlltoAll") or (
                    row.op == "AllGather" and "fused" not in row.reason):
                assert row.ring_bytes == row.bytes, row  # both count (n-1) pieces
    assert {"AllReduce", "_MirrorOperator"} <= kinds


def test_show_prints_both_conventions_per_phase(quickstart: str) -> None:
    plan = load(quickstart)
    rows = comm_summary(plan, 0)
    sent = comm_totals(rows, ring=True)
    expected = sum(c.ring_bytes or 0 for c in plan.collectives["0"]
                   if c.op != "_MirrorOperator")
    assert sent["total"] == expected > 0
    assert sum(sent.get(p, 0) for p in ("forward", "backward", "optimizer")) == expected
    received = comm_totals(rows)
    result = CliRunner().invoke(main, ["show", quickstart, "--no-svg"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the caption may wrap
    assert f"total {received['total']:,} bytes per step received" in text
    assert f"{sent['total']:,} sent with ring algorithms" in text
    assert f"backward {sent['backward']:,}" in text
    # the two columns' headers (rich pads a header to its widest number)
    assert re.search(r"┃ +received +┃", result.output) and re.search(r"┃ +sent +┃", result.output)


def _collective_bytes():
    """benchmarks/collective_bytes.py (benchmarks/ is not a package)."""
    if "collective_bytes" not in sys.modules:
        path = os.path.join(ROOT, "benchmarks", "collective_bytes.py")
        spec = importlib.util.spec_from_file_location("collective_bytes", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["collective_bytes"]


def test_hlo_collectives_groups_operands_and_phases() -> None:
    cb = _collective_bytes()
    text = "\n".join([
        '  %ar = f32[2,16,64]{2,1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},'
        '{4,5,6,7}}, to_apply=%add, metadata={op_name="jit(step)/jvp()/dot_general"}',
        '  %ag = bf16[8,32]{1,0} all-gather(%y), replica_groups=[4,2]<=[2,4]T(1,0), '
        'dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}',
        "  %rs = (f32[4]{0}, f32[2]{0}) reduce-scatter(%a, %b), replica_groups=mesh['dp'=2,"
        "'mp'=4] {'mp'}, dimensions={0}",
        "  %t = f32[] all-reduce(%c), replica_groups=mesh['dp'=2,'mp'=4] {'dp'}",
    ])
    found = cb.hlo_collectives(text, 8, rank=5)
    assert [(c.kind, c.operand_bytes, c.group, c.phase) for c in found] == [
        ("AllReduce", 8192, (4, 5, 6, 7), "forward"),
        ("AllGather", 256, (1, 5), "backward"),  # result 512 bytes over 2 ranks
        ("ReduceScatter", 96, (4, 5, 6, 7), "optimizer"),  # results 24 bytes x 4 ranks
        ("AllReduce", 4, (1, 5), "optimizer"),
    ]
    total = cb.tally(found)
    assert total.payload == 8192 + 256 + 96 + 4
    assert total.ring == 12288 + 256 + 72 + 4
    assert total.by_phase["backward"] == {"count": 1, "payload_bytes": 256, "ring_bytes": 256}


def _plan_bytes():
    """benchmarks/plan_bytes.py (it puts benchmarks/ on sys.path for collective_bytes)."""
    if "plan_bytes" not in sys.modules:
        path = os.path.join(ROOT, "benchmarks", "plan_bytes.py")
        spec = importlib.util.spec_from_file_location("plan_bytes", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["plan_bytes"]


def test_the_minimum_follows_how_the_vocabulary_is_split() -> None:
    """plan_bytes' Megatron minimum for the three vocabulary schemes of `--vocab-split`, from
    the tiny configuration's sizes (V = 128, h = 64, dp 2 x mp 4, float32, 32 tokens a rank):
    a replicated LM head trades its Vh/mp slice in the data-parallel gradient AllReduce for an
    AllReduce of the whole Vh over all 8 ranks; a vocabulary-split embedding adds the forward
    AllReduce of its output and reduces Vh/mp of the table instead of Vh."""
    from dataclasses import replace

    pb = _plan_bytes()
    c = pb.CONFIGS["tiny_dp2_mp4"]
    table, act = 4 * 128 * 64, 2 * 16 * 64 * 4
    head = pb.minimum_tally(c)["ring_bytes"]
    none = pb.minimum_tally(replace(c, vocab_split="none"))["ring_bytes"]
    both = pb.minimum_tally(replace(c, vocab_split="both"))["ring_bytes"]
    # AllReduce over dp = 2 sends S; over 8 ranks 7/4 S; over mp = 4 3/2 S
    assert none - head == 7 * table // 4 - table // 4
    assert both - head == 3 * act // 2 - (table - table // 4)
    assert c.env("MF_")["MF_VOCAB_EMB_DP"] == "1"
    assert replace(c, vocab_split="both").env()["LLAMA_VOCAB_EMB_DP"] == "0"
    assert set(c.env("MF_")) == {"MF_" + k for k in (
        "LAYERS", "HIDDEN", "HEADS", "KV_HEADS", "FFN", "VOCAB", "SEQ", "BATCH", "DTYPE", "MP",
        "SEQ_PARALLEL", "VOCAB_EMB_DP")}
