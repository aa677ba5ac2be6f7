"""examples/deepseek.py with pipeline stages (issue 35 item 6: the v3_671b preset's 16 stages of
mindformers' pretraining yaml): the placement (embedding first, the decoder layers by
mindformers' LayerSetting counts with the yaml's offset, norm, LM head and loss last), the
tiny model on 2 stages of 4 devices computing one device's first step (one micro-batch: with
more, the routing groups and capacities are each micro-batch's, as in mindformers, and the
expert load adds up over the micro-batches; after the first step the single-device program's
bias moves, the pipelined one's does not), and 4 micro-batches compiling to rank programs."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests.e2e.test_deepseek import DEEPSEEK, knobs


def _example(monkeypatch: Any, **env: str) -> Any:
    knobs(monkeypatch, **env)
    spec = importlib.util.spec_from_file_location("_deepseek_pipeline_test", DEEPSEEK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_yaml_offset_places_62_layers_on_16_stages(monkeypatch: Any) -> None:
    """61 decoder layers + 1 MTP over 16 stages: 62 // 16 = 3 each plus the yaml's offset
    [1] * 15 + [-1] (mindformers' LayerSetting): 4 layers on stages 0-14, 2 on the last."""
    ds = _example(monkeypatch, PRESET="v3_671b", MTP="1")
    assert ds.PIPELINE_STAGES == 16 and ds.MICRO_BATCHES == 32
    assert ds.stage_layers(16) == [4] * 15 + [2]
    ds = _example(monkeypatch, PRESET="v3_671b")  # without MTP the last stage lacks it
    assert ds.stage_layers(16) == [4] * 15 + [1]
    ds = _example(monkeypatch, PRESET="v3_671b", PP="8")  # no offset for 8: the remainder
    assert ds.stage_layers(8) == [8] * 5 + [7] * 3
    ds = _example(monkeypatch, PRESET="v3_671b", PP_OFFSET="1,-1")
    with pytest.raises(ValueError, match="DEEPSEEK_PP_OFFSET=1,-1 has 2 entries for 16"):
        ds.stage_layers(16)


@pytest.mark.slow  # two compiles on 8 devices and a float64 check (~6 s of CPU)
def test_two_stages_train_like_one_device(monkeypatch: Any, tmp_path: Any) -> None:
    knobs(monkeypatch, PP="2", MICRO="1")
    program = compile_model(DEEPSEEK, devices=8, dump=False)
    assert program.state.pipelined
    # one step: under stages the aux-loss-free bias does not move between steps (mindformers'
    # TopkBiasBalanceCallback, which the step does not run), the single-device program's does
    report = check(program, steps=1)
    assert report.ok(), (report.losses, report.worst)
    knobs(monkeypatch, PP="2", MICRO="4")
    out = tmp_path / "out"
    program = compile_model(DEEPSEEK, devices=8, out_dir=str(out), dump_ranks="0,4")
    assert (out / "rank_0" / "program.py").exists() and (out / "rank_4" / "program.py").exists()
    stage0 = {n.scope for n in program.state.graphs[0].nodes}
    assert any("/0-DecodeLayer" in s for s in stage0)
    assert not any("/1-DecodeLayer" in s or "lm_head" in s for s in stage0)




def test_the_yaml_recompute_list_recomputes_each_stages_first_layers(monkeypatch: Any) -> None:
    """recompute_config.recompute [3, 4, ..., 4, 3, 2, 0] of the pretraining yaml (v3_671b's
    default at 16 stages): the first n layers of each stage are recomputed (mindformers'
    LayerSetting), with 4 layers on stages 0-14 and 1 on the last; a list of another length is
    refused, 0 and 1 are no list."""
    from types import SimpleNamespace

    ds = _example(monkeypatch, PRESET="v3_671b")
    assert ds.stage_recompute(16) == (3,) + (4,) * 12 + (3, 2, 0)
    marked: list[int] = []
    layers = [SimpleNamespace(recompute=lambda i=i: marked.append(i)) for i in range(61)]
    ds.recompute_layers(SimpleNamespace(model=SimpleNamespace(layers=layers)), 16)
    starts = [4 * s for s in range(16)]
    assert marked == [starts[s] + k for s, n in enumerate(ds.stage_recompute(16))
                      for k in range(n)]
    assert ds.stage_recompute(8) is None  # the yaml's list is for its 16 stages
    assert _example(monkeypatch, PRESET="v3_671b", RECOMPUTE="0").stage_recompute(16) is None
    assert _example(monkeypatch).stage_recompute(2) is None  # tiny: no list
    ds = _example(monkeypatch, RECOMPUTE="1,0")
    assert ds.stage_recompute(2) == (1, 0)
    with pytest.raises(ValueError, match="DEEPSEEK_RECOMPUTE=1,0: 0, 1, or one count"):
        ds.stage_recompute(16)


@pytest.mark.slow  # two compiles on 8 devices and a float64 check (~5 s of CPU)
def test_a_recompute_list_under_two_stages_trains_like_one_device(monkeypatch: Any) -> None:
    """DEEPSEEK_RECOMPUTE=1,0 (was refused: recompute with pipeline stages): stage 0's layer is
    recomputed in its backward units, the float64 check passes, and stage 0 holds fewer
    activation bytes than without recompute, stage 1 as many."""
    knobs(monkeypatch, PP="2", MICRO="1")
    plain = compile_model(DEEPSEEK, devices=8, dump=False).state.pipeline.program
    knobs(monkeypatch, PP="2", MICRO="1", RECOMPUTE="1,0")
    program = compile_model(DEEPSEEK, devices=8, dump=False)
    pipe = program.state.pipeline.program
    copies = [[n for n in g.nodes if n.attrs.get("duplicated")] for g in pipe.graphs]
    assert copies[0] and not copies[1]
    before, after = plain.schedule.held_bytes["1f1b"], pipe.schedule.held_bytes["1f1b"]
    assert after[0] < before[0] and after[1] == before[1]
    report = check(program, steps=1)
    assert report.ok(), (report.losses, report.worst)
