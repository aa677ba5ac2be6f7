"""Pipeline parallelism: plans equal single-device training (float64 oracle) for a
4-stage x 2-way model-parallel MLP and the GPT example on 2 and 4 stages, micro sizes 1, 2, 4,
GPipe and 1F1B; Send/Receive pairs in the dumps; the schedules; plan.json; one message per
mistake. The JAX runs (8 virtual devices, 8 processes) are in
tests/backends/test_pipeline_jax.py."""

from __future__ import annotations

import json
import math
import os
import textwrap

import pytest

from pcompile.ir.errors import PcompileError
from pcompile.ir.parser import parse_graph
from pcompile.passes.pipeline_schedule import unit_sequence
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

MLP = os.path.join(ROOT, "examples", "pipeline_mlp.py")
GPT = os.path.join(ROOT, "examples", "gpt_block.py")


def mlp(monkeypatch, micro: int = 4, scheduler: str = "1f1b", **kwargs):
    monkeypatch.setenv("PIPE_MICRO", str(micro))
    monkeypatch.setenv("PIPE_SCHEDULER", scheduler)
    kwargs.setdefault("dump", False)
    return compile_model(MLP, devices=8, **kwargs)


def gpt(monkeypatch, stages: int, micro: int, scheduler: str, interleave: bool = False,
        **kwargs):
    monkeypatch.setenv("GPT_MICRO", str(micro))
    monkeypatch.setenv("GPT_BATCH", "16")
    kwargs.setdefault("dump", False)
    return compile_model(GPT, devices=8, parallel_mode="semi_auto_parallel",
                         overrides={"pipeline_stages": stages,
                                    "pipeline_config": {"pipeline_scheduler": scheduler,
                                                        "pipeline_interleave": interleave}},
                         **kwargs)


# -- the oracle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_mlp_four_stages_two_way_model_parallel_trains_like_one_device(monkeypatch, micro,
                                                                        scheduler) -> None:
    program = mlp(monkeypatch, micro, scheduler)
    pipe = program.state.pipeline.program
    assert (pipe.stages, pipe.per_stage, pipe.micro) == (4, 2, micro)
    assert [program.rank_graphs[r] is pipe.graphs[r // 2] for r in range(8)] == [True] * 8
    report = check(program, steps=3)
    assert report.ok(), (report.losses, report.worst)
    # every weight and its momentum were compared, each held by one stage
    assert {n for n in report.errors if not n.startswith("moments.")} == {
        f"blocks.{i}.w{j}" for i in range(4) for j in (1, 2)}


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro", [1, 2, 4])
@pytest.mark.parametrize("stages", [2, 4])
def test_gpt_example_trains_like_one_device(monkeypatch, stages, micro, scheduler) -> None:
    program = gpt(monkeypatch, stages, micro, scheduler)
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.worst)
    # AdamWeightDecay's global state (beta powers) is kept by every stage that updates weights
    pipe = program.state.pipeline.program
    assert all(len(s) == 1 for n, s in pipe.param_stages.items() if "." in n)


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro", [1, 4, 8])
def test_interleaved_mlp_trains_like_one_device(monkeypatch, micro, scheduler) -> None:
    """4 stages x 2 chunks (pipeline_segment 0 and 1) x 2-way model parallel: stage s holds
    blocks s and s + 4, and the activations go round the stages twice."""
    monkeypatch.setenv("PIPE_CHUNKS", "2")
    monkeypatch.setenv("PIPE_BATCH", "32")
    program = mlp(monkeypatch, micro, scheduler)
    pipe = program.state.pipeline.program
    assert (pipe.stages, pipe.chunks, pipe.micro) == (4, 2, micro)
    assert {name: stages for name, stages in pipe.param_stages.items()
            if name.startswith("blocks.") and name.endswith("w1")} == {
        f"blocks.{i}.w1": [i % 4] for i in range(8)}
    # the last stage of segment 0 sends to the first stage of segment 1
    assert {(t.src, t.dst) for t in pipe.transfers} >= {(3, 0), (0, 3)}
    report = check(program, steps=3)
    assert report.ok(), (report.losses, report.worst)
    sched = pipe.schedule
    if micro % 4 == 0:  # whole groups of S micro-batches: the ideal interleaved bubble
        assert sched.num_ticks == 2 * (micro * 2 + 4 - 1)
        assert sched.bubble == pytest.approx((4 - 1) / (micro * 2 + 4 - 1))


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_interleaved_gpt_trains_like_one_device(monkeypatch, micro, scheduler) -> None:
    monkeypatch.setenv("GPT_LAYERS", "6")
    program = gpt(monkeypatch, 2, micro, scheduler, interleave=True)
    pipe = program.state.pipeline.program
    assert pipe.chunks == 2
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.worst)


def test_interleaved_stages_with_the_parallel_optimizer(monkeypatch) -> None:
    """4 stages x 2 chunks, each stage 2-way data parallel: the parallel optimizer shards every
    chunk's weights over its stage, and gradient_accumulation_shard reduce-scatters each
    micro-batch's gradient instead of the step's."""
    monkeypatch.setenv("PIPE_CHUNKS", "2")
    monkeypatch.setenv("PIPE_MP", "1")

    def scatters(shard: bool) -> int:
        program = mlp(monkeypatch, 2, "1f1b", overrides={
            "enable_parallel_optimizer": True,
            "parallel_optimizer_config": {"parallel_optimizer_threshold": 0,
                                          "gradient_accumulation_shard": shard}})
        assert program.state.pipeline.program.chunks == 2
        report = check(program, steps=2)
        assert report.ok(), (report.losses, report.worst)
        return sum(1 for g in program.state.graphs for n in g.nodes if n.op == "ReduceScatter")

    assert scatters(True) > scatters(False) > 0


def test_segment_config_and_micro_batch_interleaved_in_an_interleaved_pipeline(tmp_path) -> None:
    text = TWO_STAGES.replace(
        "nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)",
        "nn.PipelineCell(nn.MicroBatchInterleaved(nn.WithLossCell(Net(), nn.MSELoss()), 2), "
        "micro_size=MICRO, stage_config={'l1': 0, 'l2': 1}, segment_config={'l1': 0, 'l2': 1})"
    ).replace("        self.l1.pipeline_stage = STAGE1\n        self.l2.pipeline_stage = STAGE2\n",
              "").replace("def labels():\n    return (np.zeros((BATCH, 8), np.float32),)", DATASET)
    program = compile_model(write_model(tmp_path, text, batch=16, context=INTERLEAVE),
                            devices=4, dump=False)
    pipe = program.state.pipeline.program
    assert pipe.chunks == 2 and pipe.param_stages["l1.weight"] == [0]
    assert pipe.param_stages["l2.weight"] == [1]
    assert len(pipe.schedule.units[1].sequence) == 2 * 2 * 2  # F and B, 2 micro, 2 chunks
    assert check(program, steps=2).ok()


@pytest.mark.slow
def test_interleaved_dumps_name_the_chunk_of_every_unit(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PIPE_CHUNKS", "2")
    out = tmp_path / "out"
    mlp(monkeypatch, 4, "1f1b", dump=True, out_dir=str(out))
    sends, receives = {}, {}
    for r in range(8):
        graph = parse_graph((out / f"rank_{r}" / "08_execute.ir").read_text())
        assert graph.attrs["pipeline_chunks"] == 2
        units = {(n.parallel.micro, n.parallel.chunk)
                 for n in graph.nodes if n.parallel is not None and n.parallel.micro is not None}
        assert units == {(k, c) for k in range(4) for c in range(2)}
        for node in graph.nodes:
            if node.op in ("Send", "Receive"):
                key = "dest_rank" if node.op == "Send" else "src_rank"
                side = sends if node.op == "Send" else receives
                side[(r, node.attrs["sr_tag"])] = (node.attrs[key], node.parallel.micro)
    assert sends and len(sends) == len(receives)
    for (r, tag), (dest, micro) in sends.items():
        assert abs(dest - r) in (2, 6)  # a neighbouring stage, or round from 3 to 0
        assert receives[(dest, tag)] == (r, micro)
    info = json.loads((out / "plan.json").read_text())["pipeline"]
    assert info["chunks"] == 2
    assert info["per_stage"][0]["units"][:2] == [{"tick": 0, "unit": "F0c0"},
                                                 {"tick": 1, "unit": "F1c0"}]
    from click.testing import CliRunner

    from pcompile.cli import main

    shown = CliRunner().invoke(main, ["show", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "pipeline schedule: 1f1b interleaved, 4 stages x 2 device(s), 2 chunks" in shown.output
    assert "stage 3  .    .    .    F0c0 F1c0 F2c0 F3c0 F0c1 B0c1 F1c1" in shown.output
    assert "ideal (S-1)/(m*v+S-1) = 27.3%" in shown.output


def test_micro_batches_without_stages_accumulate_gradients(monkeypatch) -> None:
    monkeypatch.setenv("PIPE_MICRO", "4")
    program = compile_model(MLP, devices=8, dump=False, overrides={"pipeline_stages": 1})
    assert not program.state.pipelined and program.state.micro_batched
    assert len(program.state.graphs) == 1
    assert check(program, steps=2).ok()


def test_gradient_communication_happens_once_per_step(monkeypatch) -> None:
    """_MirrorMicroStepOperator: the mirror is shared by the micro-batches, so its AllReduce
    runs once on the accumulated gradient, whatever the micro size."""

    def gradient_allreduces(micro: int) -> tuple[int, int, int]:
        """(AllReduce nodes of the backward shared by the micro-batches, weight gradients
        they carry (members when fused), AllReduce nodes of one micro-batch's backward)."""
        program = gpt(monkeypatch, 2, micro, "1f1b")
        nodes = [n for g in program.state.graphs for n in g.nodes
                 if n.op == "AllReduce" and n.scope.startswith("Gradients/")]
        per_micro = [n for n in nodes if n.parallel.micro is not None]
        shared = [n for n in nodes if n.parallel.micro is None]
        carried = sum(len(n.parallel.members or ()) or 1 for n in shared)
        return len(shared), carried, len(per_micro)

    once = gradient_allreduces(1)
    weights = len([p for p in compile_model(GPT, devices=1, dump=False).graph.weights])
    assert once[1] == weights  # every weight's gradient, all replicated (data parallel)
    # the mirrors' AllReduces do not multiply with the micro-batches; the vjp of a forward
    # AllReduce (the loss's partial sums over the batch) belongs to each micro-batch
    assert gradient_allreduces(4) == (once[0], once[1], 4 * once[2])


def test_gradient_accumulation_shard_reduce_scatters_every_micro_batch(tmp_path) -> None:
    path = write_model(tmp_path, TWO_STAGES, context="enable_parallel_optimizer=True, "
                       "parallel_optimizer_config={'parallel_optimizer_threshold': 0, "
                       "'gradient_accumulation_shard': SHARD}")

    def scatters(shard: bool) -> int:
        program = compile_model(path, devices=4, dump=False, overrides={
            "parallel_optimizer_config": {"gradient_accumulation_shard": shard}})
        assert check(program, steps=2).ok()
        return sum(1 for g in program.state.graphs for n in g.nodes if n.op == "ReduceScatter")

    assert scatters(True) == 2 * scatters(False) > 0  # micro_size 2


# -- dumps --------------------------------------------------------------------------------------


def test_dumps_show_send_receive_pairs_and_micro_batches(monkeypatch, tmp_path) -> None:
    out = tmp_path / "out"
    mlp(monkeypatch, 2, "1f1b", dump=True, out_dir=str(out))
    sends, receives = {}, {}
    for r in range(8):
        text = (out / f"rank_{r}" / "08_execute.ir").read_text()
        graph = parse_graph(text)
        assert graph.attrs["pipeline_stage"] == r // 2
        micro = {n.parallel.micro for n in graph.nodes if n.parallel is not None}
        assert {0, 1} <= micro
        for node in graph.nodes:
            if node.op == "Send":
                sends[(r, node.attrs["sr_tag"])] = (node.attrs["dest_rank"],
                                                    node.attrs["shape"], node.attrs["dtype"])
            elif node.op == "Receive":
                receives[(r, node.attrs["sr_tag"])] = (node.attrs["src_rank"],
                                                       node.attrs["shape"], node.attrs["dtype"])
    assert sends and len(sends) == len(receives)
    for (r, tag), (dest, shape, dtype) in sends.items():
        assert abs(dest - r) == 2  # the same position of the neighbouring stage
        assert receives[(dest, tag)] == (r, shape, dtype)
    plan = json.loads((out / "plan.json").read_text())
    info = plan["pipeline"]
    assert info["stages"] == 4 and info["micro_size"] == 2 and info["scheduler"] == "1f1b"
    assert [s["ranks"] for s in info["per_stage"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(info["transfers"]) == len(sends) // 2  # one transfer per pair of positions
    assert plan["inputs"][0]["shape"] == [16, 32]  # the whole batch


def test_cli_draws_the_schedule(monkeypatch, tmp_path) -> None:
    from click.testing import CliRunner

    from pcompile.cli import main

    monkeypatch.setenv("PIPE_MICRO", "2")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", MLP, "--devices", "8", "--out", str(out),
                                       "--no-check"])
    assert result.exit_code == 0, result.output
    assert "pipeline schedule: 1f1b, 4 stages x 2 device(s), 2 micro-batch(es)" in result.output
    assert "stage 3  .  .  .  F0 B0 F1 B1" in result.output
    assert "bubble: 60.0% of stage-ticks idle (ideal (S-1)/(m+S-1) = 60.0%)" in result.output
    shown = CliRunner().invoke(main, ["show", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "stage 0  F0 F1 .  .  .  .  .  B0 .  B1" in shown.output


# -- schedules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stages,micro,chunks", [(2, 1, 1), (2, 4, 1), (4, 2, 1), (4, 8, 1),
                                                 (2, 4, 2), (4, 8, 2), (4, 2, 3), (3, 6, 4)])
def test_schedules_run_every_unit_once_and_1f1b_holds_fewer_micro_batches(stages, micro,
                                                                          chunks) -> None:
    for s in range(stages):
        gpipe = unit_sequence("gpipe", stages, s, micro, chunks)
        one = unit_sequence("1f1b", stages, s, micro, chunks)
        assert sorted(gpipe) == sorted(one) == sorted(
            [(p, k, c) for p in "FB" for k in range(micro) for c in range(chunks)])
        for seq in (gpipe, one):  # a chunk's backward after its forward
            assert all(seq.index(("F", k, c)) < seq.index(("B", k, c))
                       for k in range(micro) for c in range(chunks))
        flight = max(sum(1 if p == "F" else -1 for p, _, _ in one[:i + 1])
                     for i in range(len(one)))
        if chunks == 1:
            assert flight == min(stages - s, micro)
        else:  # Megatron-LM's warm-up: 2(S-1-s) + (v-1)S chunk-units, then one more
            assert flight == min(2 * (stages - 1 - s) + (chunks - 1) * stages + 1,
                                 micro * chunks)


def unit_ticks(stages: int, micro: int, chunks: int, scheduler: str) -> dict | None:
    """Earliest ticks of every stage's units when chunk g * S + s of micro-batch k needs
    chunk g * S + s - 1's forward (and + 1's backward) of k, one unit per tick and stage;
    None when the stages wait on each other in a cycle."""
    deps = {}
    for s in range(stages):
        seq = unit_sequence(scheduler, stages, s, micro, chunks)
        for i, (phase, k, c) in enumerate(seq):
            need = {(s, seq[i - 1])} if i else set()
            u = c * stages + s
            if phase == "F" and u > 0:
                need.add(((u - 1) % stages, ("F", k, (u - 1) // stages)))
            elif phase == "B":
                last = u == stages * chunks - 1
                need.add((s, ("F", k, c)) if last else
                         ((u + 1) % stages, ("B", k, (u + 1) // stages)))
            deps[(s, (phase, k, c))] = need
    done: dict = {}
    while len(done) < len(deps):
        ready = [x for x in deps if x not in done and deps[x] <= done.keys()]
        if not ready:
            return None
        for x in ready:
            done[x] = max((done[d] + 1 for d in deps[x]), default=0)
    return done


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_interleaved_schedules_never_deadlock_and_reach_the_ideal_bubble(stages, chunks) -> None:
    for micro in range(1, 3 * stages + 1):
        for scheduler in ("gpipe", "1f1b"):
            ticks = unit_ticks(stages, micro, chunks, scheduler)
            refused = scheduler == "1f1b" and chunks > 1 and micro > stages and micro % stages
            if refused:  # check_interleave refuses these: the stages wait on each other
                continue
            assert ticks is not None, (stages, micro, chunks, scheduler)
            span = 1 + max(ticks.values())
            bubble = 1 - 2 * micro * chunks / span
            ideal = (stages - 1) / (micro * chunks + stages - 1)
            if micro % stages == 0 or chunks == 1:
                assert bubble == pytest.approx(ideal), (stages, micro, chunks, scheduler)
            else:  # a partial group of micro-batches leaves stages idle
                assert bubble >= ideal - 1e-12


@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_ticks_give_the_ideal_bubble_and_1f1b_needs_less_memory(monkeypatch, micro) -> None:
    monkeypatch.setenv("PIPE_BATCH", "32")
    for scheduler in ("gpipe", "1f1b"):
        sched = mlp(monkeypatch, micro, scheduler).state.pipeline.program.schedule
        assert sched.num_ticks == 2 * (micro + 4 - 1)
        assert sched.bubble == pytest.approx(sched.ideal_bubble)
        assert sched.in_flight["gpipe"] == [micro] * 4
        assert sched.in_flight["1f1b"] == [min(4 - s, micro) for s in range(4)]
        gp, one = sched.held_bytes["gpipe"], sched.held_bytes["1f1b"]
        assert all(a <= b for a, b in zip(one, gp))
        assert (one[-1] < gp[-1]) == (micro > 1)


# -- mistakes -----------------------------------------------------------------------------------

TWO_STAGES = """
import numpy as np
from pcompile import nn, ops, set_auto_parallel_context, set_seed

set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=STAGES,
                          CONTEXT)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(16, 16)
        self.l2 = nn.Dense(16, 8)
        self.l1.pipeline_stage = STAGE1
        self.l2.pipeline_stage = STAGE2

    def construct(self, x):
        return self.l2(self.l1(x))


def model():
    set_seed(2)
    return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)


def inputs():
    return (np.zeros((BATCH, 16), np.float32),)


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)


def labels():
    return (np.zeros((BATCH, 8), np.float32),)
"""


def write_model(tmp_path, text: str, *, stages: int = 2, stage1: int = 0, stage2: int = 1,
                micro: int = 2, batch: int = 8, context: str = "", shard: bool = False,
                name: str = "pipe.py") -> str:
    source = (textwrap.dedent(text).replace("STAGES", str(stages))
              .replace("STAGE1", str(stage1)).replace("STAGE2", str(stage2))
              .replace("MICRO", str(micro)).replace("BATCH", str(batch))
              .replace("CONTEXT", context).replace("SHARD", str(shard)))
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def error_of(path: str, devices: int = 4, **kwargs) -> str:
    with pytest.raises(PcompileError) as info:
        compile_model(path, devices=devices, dump=False, **kwargs)
    return str(info.value)


def test_a_cell_with_no_stage_is_named(tmp_path) -> None:
    text = TWO_STAGES.replace("        self.l2.pipeline_stage = STAGE2\n", "")
    message = error_of(write_model(tmp_path, text))
    assert "cell `l2` (Dense), which has no pipeline stage" in message
    assert "net.l2.pipeline_stage = s" in message and "0 <= s < 2" in message
    assert "MatMul" in message and "pipe.py" in message  # the op and its source line


def test_stages_out_of_order_are_named(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, stage1=1, stage2=0))
    assert message.startswith("pipeline stages out of order:")
    assert "in stage 0 reads the output of" in message and "in stage 1" in message


def test_a_stage_beyond_pipeline_stages_is_refused(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, stage2=2))
    assert "cell `l2` (Dense) has pipeline_stage 2, but the stages are 0..1" in message


def test_an_empty_stage_is_refused(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, stages=4, stage2=1), devices=8)
    assert "pipeline_stages=4: stage 2 has no op (stages used: 0, 1)" in message


def test_a_stage_count_that_does_not_divide_the_devices_is_refused(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, stages=3))
    assert "pipeline_stages=3 does not divide the 4 devices" in message
    assert "use one of 1, 2, 4" in message


def test_a_micro_size_that_does_not_divide_the_batch_is_refused(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, micro=3))
    assert "nn.PipelineCell(micro_size=3)" in message and "x (8, 16)" in message
    assert "8 is not divisible by 3" in message and "among 1, 2, 4, 8" in message


def test_a_micro_batch_the_stage_cannot_split_is_refused(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, micro=8))
    assert "micro-batches of 1 rows" in message and "over the 2 devices of a stage" in message
    assert "multiple of micro_size x 2 = 16" in message


def test_a_weight_shared_between_stages_is_refused(tmp_path) -> None:
    """l2 (stage 1) reads l1's weight (stage 0): a tied weight across stages."""
    text = TWO_STAGES.replace(
        "self.l2 = nn.Dense(16, 8)",
        "self.l2 = nn.Dense(16, 16)\n        self.l2.weight = self.l1.weight").replace(
        "(BATCH, 8)", "(BATCH, 16)")
    message = error_of(write_model(tmp_path, text))
    assert "parameter 'l1.weight' is used in stages 0" in message
    assert "a weight belongs to one pipeline stage" in message


@pytest.mark.parametrize("config,expected", [
    ("pipeline_config={'pipeline_scheduler': 'seqpipe'}", "pipeline_scheduler='seqpipe'"),
])
def test_unimplemented_pipeline_configs_are_refused(tmp_path, config, expected) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES, context=config))
    assert expected in message and "not implemented" in message


def segments(first: int, second: int) -> str:
    return TWO_STAGES.replace("        self.l2.pipeline_stage = STAGE2\n",
                              "        self.l2.pipeline_stage = STAGE2\n"
                              f"        self.l1.pipeline_segment = {first}\n"
                              f"        self.l2.pipeline_segment = {second}\n")


def test_pipeline_segments_need_pipeline_interleave(tmp_path) -> None:
    message = error_of(write_model(tmp_path, segments(0, 1)))
    assert "cell `l2` (Dense) has pipeline_segment 1, but pipeline_config " \
           "pipeline_interleave is False" in message


INTERLEAVE = "pipeline_config={'pipeline_interleave': True}"


def test_segments_out_of_order_are_named(tmp_path) -> None:
    """l1 in stage 0 segment 1 feeds l2 in stage 1 segment 0: backwards in (segment, stage)."""
    message = error_of(write_model(tmp_path, segments(1, 0), context=INTERLEAVE))
    assert "in stage 1 segment 0 reads the output of" in message
    assert "in stage 0 segment 1" in message and "in the order (segment, stage)" in message


def test_an_interleaved_loss_outside_the_last_chunk_is_refused(tmp_path) -> None:
    """l1 on stage 1 segment 0, l2 (and the loss after it) on stage 0 segment 1: the loss is
    computed on stage 0, not the last stage."""
    message = error_of(write_model(tmp_path, segments(0, 1), stage1=1, stage2=0,
                                   context=INTERLEAVE))
    assert "the loss is not computed in the last stage" in message
    assert "in the last stage and its last segment" in message


def test_interleaved_1f1b_needs_whole_groups_of_micro_batches(tmp_path) -> None:
    """l1 on stage 0, l2 on stage 1, both in segment 1: chunks 2 and 3 of 4."""
    path = write_model(tmp_path, segments(1, 1), micro=3, batch=12, context=INTERLEAVE)
    message = error_of(path)
    assert "micro_size must be a multiple of 2 (or at most 2); micro_size=3" in message
    assert "pipeline_scheduler 'gpipe'" in message
    gpipe = "pipeline_config={'pipeline_interleave': True, 'pipeline_scheduler': 'gpipe'}"
    program = compile_model(write_model(tmp_path, segments(1, 1), micro=3, batch=12,
                                        context=gpipe, name="gpipe.py"),
                            devices=4, dump=False)
    assert program.state.pipeline.program.chunks == 2 and check(program, steps=2).ok()


def test_pipeline_stages_need_an_auto_or_semi_auto_mode(tmp_path) -> None:
    message = error_of(write_model(tmp_path, TWO_STAGES), parallel_mode="data_parallel")
    assert "needs parallel_mode semi_auto_parallel or auto_parallel" in message


def test_pipeline_inference_is_refused(tmp_path) -> None:
    text = TWO_STAGES.replace(
        "return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)",
        "return Net()").replace("def optimizer(params):", "def _unused(params):")
    assert "pipeline parallelism trains" in error_of(write_model(tmp_path, text))


def test_pipeline_cell_with_loss_function_is_refused(tmp_path) -> None:
    text = TWO_STAGES + "\n\ndef loss():\n    return nn.MSELoss()\n"
    assert "remove loss()" in error_of(write_model(tmp_path, text))


def test_a_training_step_cell_in_a_pipeline_is_refused(tmp_path) -> None:
    """A network computing its own loss with optimizer() and no loss() trains as
    nn.TrainOneStepCell, which pipeline stages do not take (yet)."""
    text = TWO_STAGES.replace(
        "return nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)",
        "return nn.WithLossCell(Net(), nn.MSELoss())")
    message = error_of(write_model(tmp_path, text))
    assert "pipeline_stages=2" in message and "training step cell (TrainOneStepCell" in message


def test_inputs_split_differently_are_refused(tmp_path) -> None:
    path = write_model(tmp_path, TWO_STAGES,
                       context="dataset_strategy=((2, 1), (1, 1))")
    message = error_of(path)
    assert "x 2 ways" in message and "label 1 ways" in message


def test_pipeline_cell_arguments_are_checked() -> None:
    from pcompile import nn

    net = nn.Dense(4, 4)
    with pytest.raises(TypeError, match="micro_size' must be integer"):
        nn.PipelineCell(net, 2.0)
    with pytest.raises(ValueError, match="must be large than 0"):
        nn.PipelineCell(net, 0)
    with pytest.raises(TypeError, match="must be a Cell"):
        nn.PipelineCell(lambda x: x, 2)
    with pytest.raises(KeyError, match="names cells the network does not have: nope"):
        nn.PipelineCell(nn.WithLossCell(net, nn.MSELoss()), 2, stage_config={"nope": 1})
    with pytest.raises(ValueError, match="interleave_num' must be large than 0"):
        nn.MicroBatchInterleaved(net, 0)
    with pytest.raises(TypeError, match="pipeline_stage' must be int"):
        net.pipeline_stage = "1"
    with pytest.raises(ValueError, match="can not be less than 0"):
        net.pipeline_stage = -1
    cell = nn.PipelineCell(nn.WithLossCell(nn.SequentialCell([nn.Dense(4, 4)]), nn.MSELoss()),
                           2, stage_config={"0": 1}, segment_config={"_backbone.0": 0})
    assert cell.network.backbone_network[0].pipeline_stage == 1


def test_micro_batch_interleaved_in_a_pipeline_trains_like_one_device(tmp_path) -> None:
    text = TWO_STAGES.replace(
        "nn.PipelineCell(nn.WithLossCell(Net(), nn.MSELoss()), micro_size=MICRO)",
        "nn.PipelineCell(nn.MicroBatchInterleaved(nn.WithLossCell(Net(), nn.MSELoss()), 2), "
        "micro_size=MICRO, stage_config={'l1': 0, 'l2': 1})").replace(
        "        self.l1.pipeline_stage = STAGE1\n        self.l2.pipeline_stage = STAGE2\n", "")
    text = text.replace("def labels():\n    return (np.zeros((BATCH, 8), np.float32),)",
                        DATASET)
    program = compile_model(write_model(tmp_path, text, batch=16), devices=4, dump=False)
    assert check(program, steps=2).ok()


DATASET = """def dataset():
    rng = np.random.default_rng(0)
    for _ in range(4):
        yield (rng.standard_normal((BATCH, 16)).astype(np.float32),
               rng.standard_normal((BATCH, 8)).astype(np.float32))"""


# -- search ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("search", ["sharding_propagation", "recursive_programming",
                                    "dynamic_programming"])
@pytest.mark.parametrize("interleave", [False, True])
def test_auto_parallel_searches_within_each_stage(monkeypatch, search, interleave) -> None:
    """auto_parallel with pipeline stages: every strategy is chosen for the stage's devices
    (each layout's device matrix has 8 / 2 = 4 devices), and the plan trains like one device;
    also with interleaved stages (2 chunks per stage)."""
    monkeypatch.setenv("GPT_MICRO", "2")
    monkeypatch.setenv("GPT_BATCH", "16")
    program = compile_model(GPT, devices=8, dump=False, parallel_mode="auto_parallel",
                            search_mode=search, overrides={
                                "pipeline_stages": 2,
                                "pipeline_config": {"pipeline_interleave": interleave}})
    assert program.state.pipeline.program.chunks == (2 if interleave else 1)
    assert program.state.pipelined and program.state.stage_devices == 4
    layouts = program.state.assignment.param_layouts
    assert layouts and {math.prod(lay.dev_matrix) for lay in layouts.values()} == {4}
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.worst)


def test_a_pipeline_cell_takes_its_labels_from_inputs_when_nothing_else_gives_them(
        tmp_path) -> None:
    """MindSpore's tests compile nn.PipelineCell(WithLossCell(net, loss)) on (data, label):
    without labels() or dataset(), the arrays of inputs() after the network's own arguments
    are its loss's labels."""
    source = open(os.path.join(ROOT, "examples", "pipeline_mlp.py")).read()
    old_inputs = "    return (np.zeros((BATCH, HIDDEN), np.float32),)"
    assert old_inputs in source and "\ndef dataset():" in source
    source = source.replace("\ndef dataset():", "\ndef unused_dataset():").replace(
        old_inputs, "    rng = np.random.default_rng(3)\n"
                    "    return tuple(rng.standard_normal((BATCH, HIDDEN)).astype(np.float32)\n"
                    "                 for _ in range(2))")
    path = tmp_path / "pipeline_labels_in_inputs.py"
    path.write_text(source)
    program = compile_model(str(path), devices=8, dump=False)
    assert [p.name for p in program.graph.inputs] == ["x", "label"]
    report = check(program, steps=2)
    assert report.ok(), report.worst
    assert report.losses[0][0] > 0
