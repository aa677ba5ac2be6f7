"""Starting from pretrained weights (compiler/frontend/serialization.py, backends/params.py):

* a safetensors file saved with Hugging Face Llama names loads into examples/llama.py (tiny
  preset) through its name map: on 8 devices each rank's initial parameters are exactly its
  slices of the file, on one device the whole tensors; bf16 weights convert to the float32
  parameters; an HF index of shards reads the same;
* the loaded model computes what Hugging Face's Llama computes (a numpy transcription of
  `LlamaForCausalLM`'s forward: rotate-half rotary embedding, grouped-query attention,
  SwiGLU), which pins the name map and the rotary convention;
* compiling reads no weight: params.json records references (file, tensor, size, mtime,
  header digest), and a rank refuses a reference whose file changed or that points elsewhere;
* a wrong shape (and a wrong dtype under strict_load) is one message naming the parameter,
  the expected and the found shape and dtype;
* (slow) 8 rank processes read their slices from the file: their first loss is the
  single-device loss of the pretrained weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pcompile.compiler.driver.runtime import batches
from pcompile.compiler.frontend.serialization import CheckpointLoadError, PretrainedTensor
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT

LLAMA = os.path.join(ROOT, "examples", "llama.py")
# the tiny preset: layers, hidden, heads, kv heads, FFN, vocabulary
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 64, 8, 4, 128, 128


def hf_llama_tensors(seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """A tiny Llama's weights under Hugging Face's names."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def w(*shape: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.05 * rng.standard_normal(shape)).astype(dtype)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "model.norm.weight": w(HIDDEN, base=1),
           "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": w(HIDDEN, base=1),
            p + "post_attention_layernorm.weight": w(HIDDEN, base=1),
            p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
        })
    return out


def knobs(monkeypatch: Any, **env: str) -> None:
    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(f"LLAMA_{name}", value)


def hf_to_llama(tensors: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's names -> examples/llama.py's (the built-in name map it loads with)."""
    from pcompile.compiler.frontend.name_maps import LLAMA as LLAMA_NAMES

    return LLAMA_NAMES.from_theirs(tensors)


@pytest.fixture
def hf_file(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    tensors = hf_llama_tensors()
    path = str(tmp_path / "hf" / "model.safetensors")
    os.makedirs(os.path.dirname(path))
    save_file(tensors, path)
    return path, tensors


def rank_blocks(program: Any, rank: int, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Rank `rank`'s slice of every tensor of `full`, by the plan's layouts."""
    layouts = program.state.assignment.param_layouts if program.state.assignment else {}
    out = {}
    for name, value in full.items():
        layout = layouts.get(name)
        bounds = layout.slice_bounds(rank) if layout is not None else [(0, d) for d in
                                                                        value.shape]
        out[name] = value[tuple(slice(b, e) for b, e in bounds)]
    return out


@pytest.mark.parametrize("devices", [1, 8])
def test_hf_llama_checkpoint_loads_each_ranks_slices(monkeypatch: Any, hf_file: Any,
                                                     devices: int) -> None:
    path, tensors = hf_file
    knobs(monkeypatch, PRETRAINED=path)
    # compiling reads headers only: no tensor data
    monkeypatch.setattr(PretrainedTensor, "__getitem__", _no_read)
    program = compile_model(LLAMA, devices=devices, dump=False)
    monkeypatch.undo()
    knobs(monkeypatch, PRETRAINED=path)
    full = hf_to_llama(tensors)
    assert len(full) == 9 * LAYERS + 3
    for rank in range(devices):
        values = program.state.rank_values(rank)
        for name, want in rank_blocks(program, rank, full).items():
            assert values[name].dtype == np.float32
            assert np.array_equal(values[name], want), (rank, name)


def _no_read(self: Any, index: Any) -> Any:
    raise AssertionError(f"compiling read tensor {self.name}")


def test_bf16_shards_of_an_hf_index_convert_to_the_float32_parameters(monkeypatch: Any,
                                                                       tmp_path: Any) -> None:
    import ml_dtypes

    tensors = hf_llama_tensors(dtype=ml_dtypes.bfloat16)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {n: f for f, part in shards.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    knobs(monkeypatch, PRETRAINED=str(tmp_path))
    program = compile_model(LLAMA, devices=8, dump=False)
    full = {k: v.astype(np.float32) for k, v in hf_to_llama(tensors).items()}
    for name, want in rank_blocks(program, 5, full).items():
        assert np.array_equal(program.state.rank_values(5)[name], want), name


def hf_llama_loss(t: dict[str, np.ndarray], ids: np.ndarray, theta: float = 10000.0,
                  eps: float = 1e-5) -> float:
    """Hugging Face LlamaForCausalLM's forward in float64 numpy (rotate_half rotary embedding,
    repeat_kv, SwiGLU), with examples/llama.py's loss (the mean over tokens that are not
    padding)."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    head_dim, rep = HIDDEN // HEADS, HEADS // KV_HEADS
    tokens, labels = ids[:, :-1], ids[:, 1:]
    batch, seq = tokens.shape

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1)

    def heads(x: np.ndarray, n: int) -> np.ndarray:
        return x.reshape(batch, seq, n, head_dim).transpose(0, 2, 1, 3)

    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    freqs = np.outer(np.arange(seq), inv_freq)
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs,
                                                                                  freqs], -1))
    causal = np.triu(np.full((seq, seq), -np.inf), 1)
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = heads(h @ t[p + "self_attn.q_proj.weight"].T, HEADS)
        k = heads(h @ t[p + "self_attn.k_proj.weight"].T, KV_HEADS)
        v = heads(h @ t[p + "self_attn.v_proj.weight"].T, KV_HEADS)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, HIDDEN)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[
            p + "mlp.down_proj.weight"].T
    logits = rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    mask = (tokens != 0) & (labels != -100)
    return float((nll * mask).sum() / mask.sum())


@pytest.mark.parametrize("flash", ["1", "0"])
def test_loaded_llama_computes_what_hugging_face_llama_computes(monkeypatch: Any, hf_file: Any,
                                                                flash: str) -> None:
    path, tensors = hf_file
    knobs(monkeypatch, PRETRAINED=path, DTYPE="float32", FLASH=flash)
    one = compile_model(LLAMA, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    (_, _, arrays), = batches(one, 1)
    loss = float(np.asarray(runner.step(arrays)).reshape(-1)[0])
    want = hf_llama_loss(tensors, arrays[0])
    assert abs(loss - want) <= 1e-6 * abs(want), (loss, want)


def test_a_wrong_shape_is_one_message(monkeypatch: Any, tmp_path: Any) -> None:
    tensors = hf_llama_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][
        :96]
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    knobs(monkeypatch, PRETRAINED=path)
    with pytest.raises(PcompileError) as info:
        compile_model(LLAMA, devices=8, dump=False)
    text = str(info.value)
    assert "parameter model.layers.1.feed_forward.w3.weight expects shape (128, 64) float32" \
        in text and "model.layers.1.mlp.up_proj.weight" in text and "(96, 64)" in text
    assert "\n" not in text


def test_cli_shape_mismatch_is_one_message_and_strict_dtype(tmp_path: Any) -> None:
    """On the command line: one message, no traceback; strict_load refuses a bf16 tensor for a
    float32 parameter (without it, it converts)."""
    import ml_dtypes

    from pcompile import Parameter, load_checkpoint, load_param_into_net, nn
    from pcompile.compiler.frontend.initializer import initializer

    path = str(tmp_path / "w.safetensors")
    save_file({"w": np.ones((4, 2), ml_dtypes.bfloat16)}, path)
    model = tmp_path / "m.py"
    model.write_text(
        "import numpy as np\n"
        "from pcompile import Parameter, initializer, load_checkpoint, load_param_into_net, "
        "nn, ops\n"
        "class Net(nn.Cell):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = Parameter(initializer('normal', (4, 3)), 'w')\n"
        "        self.matmul = ops.MatMul()\n"
        "    def construct(self, x):\n"
        "        return self.matmul(x, self.w)\n"
        "def model():\n"
        "    net = Net()\n"
        f"    load_param_into_net(net, load_checkpoint({path!r}))\n"
        "    return net\n"
        "def inputs():\n"
        "    return (np.ones((2, 4), np.float32),)\n")
    proc = subprocess.run([sys.executable, "-m", "pcompile", str(model), "--devices", "1",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    assert "parameter w expects shape (4, 3) float32, tensor w of " in proc.stderr
    assert "has shape (4, 2) bfloat16" in proc.stderr

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w = Parameter(initializer("normal", (4, 2)), "w")

    net = Net()
    with pytest.raises(CheckpointLoadError, match="strict_load wants the same dtype"):
        load_param_into_net(net, load_checkpoint(path), strict_load=True)
    assert load_param_into_net(net, load_checkpoint(path)) == ([], [])
    assert np.array_equal(net.w.source.to_numpy(), np.ones((4, 2), np.float32))


def test_params_json_references_and_their_confinement(monkeypatch: Any, hf_file: Any,
                                                      tmp_path: Any) -> None:
    """params.json records the file (absolute, links resolved), the tensor, size, mtime and
    header digest, twice the same bytes; a rank refuses a changed file, a link, another
    path or another tensor, each as one ParamsError."""
    from pcompile.backends.params import ParamsError, read_manifest

    path, tensors = hf_file
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    knobs(monkeypatch, PRETRAINED=str(link))
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        compile_model(LLAMA, devices=8, out_dir=str(out), dump_ranks="0")
    manifest = (outs[0] / "params.json").read_bytes()
    assert manifest == (outs[1] / "params.json").read_bytes()
    entry = json.loads(manifest)["params"]["model.embedding_weight"]["init"]
    assert entry["safetensors"] == os.path.realpath(path)
    assert entry["tensor"] == "model.embed_tokens.weight"
    assert entry["size"] == os.path.getsize(path) and len(entry["header_sha256"]) == 64
    sources = read_manifest(str(outs[0]))
    assert np.array_equal(sources["model.embedding_weight"].block(((8, 16), (0, 64))),
                          tensors["model.embed_tokens.weight"][8:16])
    data = json.loads(manifest)

    def refused(change: dict[str, Any], match: str) -> None:
        edited = json.loads(json.dumps(data))
        edited["params"]["model.embedding_weight"]["init"].update(change)
        (outs[1] / "params.json").write_text(json.dumps(edited))
        with pytest.raises(ParamsError, match=match):
            read_manifest(str(outs[1]))

    refused({"safetensors": str(link)}, "link")
    refused({"safetensors": "model.safetensors"}, "not an absolute path")
    refused({"safetensors": "/etc/passwd"}, "not an absolute path to a .safetensors")
    refused({"tensor": "model.norm.weight"}, "the compile saw")
    refused({"tensor": "no.such.tensor"}, "has no tensor")
    refused({"mtime_ns": entry["mtime_ns"] + 1}, "changed since the compile")
    os.utime(path, ns=(entry["mtime_ns"], entry["mtime_ns"] + 5))
    (outs[1] / "params.json").write_bytes(manifest)
    with pytest.raises(ParamsError, match="changed since the compile"):
        read_manifest(str(outs[1]))


@pytest.mark.slow
def test_8_rank_processes_start_from_the_pretrained_weights(monkeypatch: Any, hf_file: Any,
                                                            tmp_path: Any) -> None:
    path, _ = hf_file
    knobs(monkeypatch, PRETRAINED=path, DTYPE="float32", FLASH="0")
    one = compile_model(LLAMA, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    (_, _, arrays), = batches(one, 1)
    want = float(np.asarray(runner.step(arrays)).reshape(-1)[0])
    out = tmp_path / "run"
    env = dict(os.environ, LLAMA_PRETRAINED=path, LLAMA_DTYPE="float32", LLAMA_FLASH="0")
    proc = subprocess.run([sys.executable, "-m", "pcompile", LLAMA, "--devices", "8",
                           "--out", str(out), "--no-check", "--run", "--steps", "1"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = (out / "rank_0" / "train.log").read_text().splitlines()[0]
    loss = float(line.rsplit(" ", 1)[1])
    assert abs(loss - want) <= 1e-4 * abs(want), (loss, want)


def test_load_file_of_hf_names_roundtrip(hf_file: Any) -> None:
    """load_checkpoint on a file: every tensor as an abstract Parameter of the file's shape and
    dtype; values only when asked."""
    from pcompile import load_checkpoint

    path, tensors = hf_file
    params = load_checkpoint(path, filter_prefix="model.layers.1.")
    assert sorted(params) == sorted(n for n in tensors if not n.startswith("model.layers.1."))
    p = params["model.norm.weight"]
    assert p.shape == (HIDDEN,) and np.array_equal(p.source.to_numpy(),
                                                   load_file(path)["model.norm.weight"])
