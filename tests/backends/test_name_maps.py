"""Name maps between Hugging Face checkpoints and model files (compiler/frontend/name_maps.py; issue
38 item 12): `load_checkpoint(path, name_map=...)` renames (and, for Mixtral's experts, stacks
and transposes) without reading a tensor, each rank then reading only its slices;
`pcompile-merge DIR --names ...` writes a run's tensors under Hugging Face's names; both
built-in maps (Llama, Mixtral) invert each other, and a user's map is a dict or a JSON file."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pcompile import load_checkpoint
from pcompile.backends.checkpoint_files import write_checkpoint
from pcompile.backends.checkpoint_merge import main as merge_main
from pcompile.compiler.frontend.name_maps import LLAMA, MIXTRAL, NameMap, NameMapError, name_map
from pcompile.compiler.frontend.serialization import PretrainedTensor
from pcompile.tools.compile import compile as compile_model
from tests import ROOT

MIXTRAL_FILE = os.path.join(ROOT, "examples", "mixtral.py")
# examples/mixtral.py's tiny preset
LAYERS, HIDDEN, KV, FFN, VOCAB, EXPERTS = 2, 64, 32, 128, 128, 8


def hf_mixtral_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny Mixtral's weights under Hugging Face's names (MixtralForCausalLM)."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.05 * rng.standard_normal(shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN, base=1),
           "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": w(HIDDEN, base=1),
            p + "post_attention_layernorm.weight": w(HIDDEN, base=1),
            p + "self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
            p + "block_sparse_moe.gate.weight": w(EXPERTS, HIDDEN),
        })
        for e in range(EXPERTS):
            q = f"{p}block_sparse_moe.experts.{e}."
            out.update({q + "w1.weight": w(FFN, HIDDEN), q + "w3.weight": w(FFN, HIDDEN),
                        q + "w2.weight": w(HIDDEN, FFN)})
    return out


def test_the_built_in_maps_go_both_ways() -> None:
    hf = hf_mixtral_tensors()
    ours = MIXTRAL.from_theirs(hf)
    assert len(ours) == 3 + LAYERS * 10  # the experts' 3 x 8 tensors per layer stacked in 3
    w1 = ours["layers.1.moe.experts.w1"]
    assert w1.shape == (EXPERTS, HIDDEN, FFN)
    assert np.array_equal(w1[3], hf["model.layers.1.block_sparse_moe.experts.3.w1.weight"].T)
    back = dict(pair for name, value in ours.items() for pair in MIXTRAL.to_theirs(name, value))
    assert sorted(back) == sorted(hf)
    assert all(np.array_equal(back[n], hf[n]) for n in hf)
    assert MIXTRAL.their_shapes("moments.layers.0.moe.experts.w2", (EXPERTS, FFN, HIDDEN))[5] \
        == ("moments.model.layers.0.block_sparse_moe.experts.5.w2.weight", (HIDDEN, FFN))
    # Llama: names only; a checkpoint without lm_head ties it to the embedding table
    llama = LLAMA.from_theirs({"model.embed_tokens.weight": 1,
                               "model.layers.7.mlp.down_proj.weight": 2, "rotary.inv_freq": 3})
    assert llama == {"model.embedding_weight": 1, "model.layers.7.feed_forward.w2.weight": 2,
                     "rotary.inv_freq": 3, "lm_head.weight": 1}
    assert name_map({"a.{i}.x": "b.{i}.y"}).from_theirs({"a.3.x": 5}) == {"b.3.y": 5}
    with pytest.raises(NameMapError, match="the built-in ones are llama, mixtral"):
        name_map("gpt2")
    with pytest.raises(NameMapError, match="no e = 1"):
        MIXTRAL.from_theirs({"model.layers.0.block_sparse_moe.experts.0.w1.weight": hf[
            "model.layers.0.block_sparse_moe.experts.0.w1.weight"],
            "model.layers.0.block_sparse_moe.experts.2.w1.weight": hf[
            "model.layers.0.block_sparse_moe.experts.2.w1.weight"]})


def _no_read(self: Any, index: Any) -> Any:
    raise AssertionError(f"compiling read tensor {self.name}")


def test_a_hugging_face_mixtral_loads_each_ranks_slices(monkeypatch: Any, tmp_path) -> None:
    """examples/mixtral.py with MIXTRAL_PRETRAINED, 8 devices (experts split 8 ways): the
    compile reads no tensor; each rank's initial values are its slices of the renamed,
    stacked, transposed tensors; params.json records a reference to each expert's tensor."""
    hf = hf_mixtral_tensors()
    path = tmp_path / "hf" / "model.safetensors"
    path.parent.mkdir()
    save_file(hf, str(path))
    for name in [n for n in os.environ if n.startswith(("MIXTRAL_", "LLAMA_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MIXTRAL_PRETRAINED", str(path))
    monkeypatch.setenv("MIXTRAL_DTYPE", "float32")
    with monkeypatch.context() as m:
        m.setattr(PretrainedTensor, "__getitem__", _no_read)
        program = compile_model(MIXTRAL_FILE, devices=8, out_dir=str(tmp_path / "out"),
                                dump_ranks="0")
    full = MIXTRAL.from_theirs(hf)
    layouts = program.state.assignment.param_layouts
    for rank in (0, 5):
        values = program.state.rank_values(rank)
        for name, want in full.items():
            bounds = layouts[name].slice_bounds(rank) if name in layouts else [
                (0, d) for d in want.shape]
            assert np.array_equal(values[name], want[tuple(slice(b, e) for b, e in bounds)]), \
                (rank, name)
    entry = json.loads((tmp_path / "out" / "params.json").read_text())
    init = entry["params"]["layers.0.moe.experts.w2"]["init"]
    assert init["transpose"] and len(init["safetensors_stack"]) == EXPERTS
    from pcompile.backends.params import read_manifest

    source = read_manifest(str(tmp_path / "out"))["layers.0.moe.experts.w2"]
    assert np.array_equal(source.block(((2, 4), (0, FFN), (8, 16))),
                          full["layers.0.moe.experts.w2"][2:4, :, 8:16])


def test_merge_writes_hugging_face_names(tmp_path, capsys) -> None:
    """pcompile-merge --names mixtral: a run's stacked expert weights (split over 2 ranks by
    expert) come out as one tensor per expert under Hugging Face's names, transposed, and the
    optimizer state keeps its prefix; load_checkpoint(name_map="mixtral") reads them back."""
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((2, 3, 4)).astype(np.float32)
    norm = rng.standard_normal(3).astype(np.float32)
    layouts = {"layers.0.moe.experts.w1": {"shape": [2, 3, 4], "dtype": "float32",
                                           "dev_matrix": [2], "tensor_map": [0, -1, -1]},
               "moments.layers.0.moe.experts.w1": {"shape": [2, 3, 4], "dtype": "float32",
                                                   "dev_matrix": [2], "tensor_map": [0, -1, -1]},
               "norm_out.weight": {"shape": [3], "dtype": "float32", "dev_matrix": [2],
                                   "tensor_map": [-1]}}
    folder = tmp_path / "checkpoints"
    for r in range(2):
        write_checkpoint(str(folder), r, 1, {"layers.0.moe.experts.w1": w1[r:r + 1],
                                             "moments.layers.0.moe.experts.w1": w1[r:r + 1] * 2,
                                             "norm_out.weight": norm},
                         {"step": 1, "epoch": 1, "step_in_epoch": 1, "rank": r,
                          "num_ranks": 2, "plan_id": "p1", "layouts": layouts})
    out = tmp_path / "hf.safetensors"
    assert merge_main([str(tmp_path), "--names", "mixtral", "--output", str(out)]) == 0
    got = load_file(str(out))
    hf = "model.layers.0.block_sparse_moe.experts.{e}.w1.weight"
    assert sorted(got) == sorted([hf.format(e=0), hf.format(e=1), "model.norm.weight",
                                  "moments." + hf.format(e=0), "moments." + hf.format(e=1)])
    assert np.array_equal(got[hf.format(e=1)], w1[1].T)
    assert np.array_equal(got["moments." + hf.format(e=0)], 2 * w1[0].T)
    back = load_checkpoint(str(out), name_map="mixtral",
                           filter_prefix="moments.")["layers.0.moe.experts.w1"]
    assert np.array_equal(back.asnumpy(), w1)
    names = tmp_path / "names.json"
    names.write_text(json.dumps({"rules": [{"theirs": "final_norm", "ours": "norm_out.weight"}]}))
    assert merge_main([str(tmp_path), "--names", str(names), "--output",
                       str(tmp_path / "own.safetensors"), "--weights-only"]) == 1
    assert "plan.json" in capsys.readouterr().err  # --weights-only needs the plan's kinds
    assert merge_main([str(tmp_path), "--names", str(names), "--output",
                       str(tmp_path / "own.safetensors")]) == 0
    assert "final_norm" in load_file(str(tmp_path / "own.safetensors"))
    assert merge_main([str(tmp_path), "--names", "gpt2"]) == 1
    assert "built-in name maps are llama, mixtral" in capsys.readouterr().err


def test_a_user_map_as_json() -> None:
    names = NameMap.from_json(json.dumps({"rules": [
        {"theirs": "h.{i}.mlp.c_fc.weight", "ours": "blocks.{i}.fc.weight", "transpose": True}],
        "ties": {}}))
    assert names.their_shapes("blocks.2.fc.weight", (3, 5)) == [("h.2.mlp.c_fc.weight", (5, 3))]
    with pytest.raises(NameMapError, match="same"):
        NameMap({"a.{i}": "b"})
