"""`Cell.recompute()` / `Primitive.recompute()` inside nn.PipelineCell with pipeline stages (it
was refused): each recomputed forward op is computed again in its own stage, in the backward
unit of its micro-batch, so a stage holds the recomputed blocks' inputs from a micro-batch's
forward to its backward instead of every activation; the step trains like one device (float64
oracle). The JAX pipeline program: tests/pipeline_worker.py's recompute_1f1b (slow)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pcompile.passes.pipeline_schedule import node_label, positions, unit_sequence
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

MODEL = os.path.join(ROOT, "tests", "models", "pipeline_recompute.py")


def _compile(monkeypatch: Any, micro: int, devices: int, scheduler: str = "1f1b",
             mark: str = "full", chunks: int = 1) -> Any:
    monkeypatch.setenv("PIPE_RC_CHUNKS", str(chunks))
    monkeypatch.setenv("PIPE_RC_MICRO", str(micro))
    monkeypatch.setenv("PIPE_RC_SCHEDULER", scheduler)
    monkeypatch.setenv("PIPE_RC_MARK", mark)
    return compile_model(MODEL, devices=devices, dump=False)


@pytest.mark.parametrize("micro,devices,scheduler,chunks",
                         [(2, 4, "1f1b", 1), (4, 8, "gpipe", 1), (4, 4, "1f1b", 1),
                          (2, 8, "gpipe", 1), (4, 4, "1f1b", 2)])
def test_recompute_in_a_pipeline_trains_like_one_device(monkeypatch: Any, micro: int,
                                                        devices: int, scheduler: str,
                                                        chunks: int) -> None:
    """Two stages of 2 or 4 devices, 2 to 4 micro-batches, 1F1B and GPipe, interleaved (2
    chunks a stage) or not, every block recomputed: two steps equal the single-device
    program's (float64); every recomputed copy and every checkpoint's Depend runs in its
    stage's backward unit of its micro-batch (and chunk), and no copy crosses stages."""
    program = _compile(monkeypatch, micro, devices, scheduler, chunks=chunks)
    assert "recompute" in [name for name, _ in program.timings]
    pipe = program.state.pipeline.program
    for s, graph in enumerate(pipe.graphs):
        sequence = unit_sequence(scheduler, 2, s, micro, chunks)
        where = positions(graph, sequence)
        copies = [n for n in graph.nodes if n.attrs.get("duplicated")]
        assert copies, f"stage {s} recomputes nothing"
        for node in copies:
            assert node.parallel is not None and node.parallel.micro is not None
            assert sequence[where[node]] == (
                "B", node.parallel.micro, node.parallel.chunk or 0), node
        depends = [n for n in graph.nodes if n.instance_name == "recompute_depend"]
        assert depends and all(
            node_label(n) == ("B", n.parallel.micro, n.parallel.chunk or 0) for n in depends)
    sent = [n for g in pipe.graphs for n in g.nodes if n.op == "Send"]
    assert not any(n.operands[0].node.attrs.get("duplicated") for n in sent)
    report = check(program, steps=2)
    assert report.ok(), (report.losses, report.worst)


@pytest.mark.parametrize("mark", ["full", "selective"])
def test_recompute_lowers_the_activations_each_stage_holds(monkeypatch: Any, mark: str) -> None:
    """The schedule's held activations per stage (plan.json's pipeline section) drop under
    both schedules, and the stages exchange the same values as without recompute."""
    plain = _compile(monkeypatch, 4, 4, mark="none").state.pipeline.program
    recomputed = _compile(monkeypatch, 4, 4, mark=mark).state.pipeline.program
    for name in ("1f1b", "gpipe"):
        before = plain.schedule.held_bytes[name]
        after = recomputed.schedule.held_bytes[name]
        assert all(a < b for a, b in zip(after, before)), (name, before, after)
        held = [s["activation_bytes"][name] for s in recomputed.describe()["per_stage"]]
        assert held == after
    assert [(t.src, t.dst, t.shape) for t in plain.transfers] == [
        (t.src, t.dst, t.shape) for t in recomputed.transfers]
