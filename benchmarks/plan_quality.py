"""Communication of each search's plan next to XLA GSPMD's plan for the same annotations.

Four training steps on 8 devices: the quickstart MLP (`matmul` annotated ((2, 4), (4, 1))), an
attention block (Megatron-style annotations: q/k/v column-split ((2, 1), (1, 4)), the output
projection row-split ((2, 4), (4, 1))), the GPT example with one layer (no annotation, batch split
by `dataset_strategy="data_parallel"`) and an embedding + LM head (table split on the hidden dim
((1, 8), (1, 1)), head ((1, 8), (8, 1)), `full_batch`).

For pcompile, every collective of rank 0's final graph (forward, backward, optimizer) counts;
for XLA, every collective of `jax.jit(step, in_shardings=..., out_shardings=...)
.lower(...).compile().as_text()` on 8 virtual CPU devices, where the step is the same model
written in JAX with the same annotations (`in_shardings` for inputs and annotated weights,
`with_sharding_constraint` on the annotated ops' operands; everything else is left to GSPMD).
Two numbers per plan: `payload` (bytes of the collectives' operands on one rank) and `ring`
(bytes one rank sends with ring algorithms: AllReduce 2(n-1)/n S, AllGather (n-1) S,
ReduceScatter and AlltoAll (n-1)/n S), both from `benchmarks/collective_bytes.py`. Prints one
JSON object.

    python benchmarks/plan_quality.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCHMARKS)
sys.path.insert(0, ROOT)
sys.path.insert(0, BENCHMARKS)

from collective_bytes import Collective, tally  # noqa: E402  (benchmarks/ on the path)

DEVICES = 8
MODES = [  # (label, parallel or search mode, extra environment)
    ("semi_auto_parallel", "semi_auto_parallel", {}),
    ("sharding_propagation", "sharding_propagation", {}),
    ("dynamic_programming", "dynamic_programming", {}),
    ("recursive_programming", "recursive_programming", {"MS_INTERFERED_SAPP": "0"}),
    ("recursive_programming+MS_INTERFERED_SAPP", "recursive_programming",
     {"MS_INTERFERED_SAPP": "1"}),
]

ATTENTION = '''
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(dataset_strategy="data_parallel")
B, S, H, HEADS = 8, 16, 32, 4
class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.wq = Parameter(initializer("normal", [H, H]), "wq")
        self.wk = Parameter(initializer("normal", [H, H]), "wk")
        self.wv = Parameter(initializer("normal", [H, H]), "wv")
        self.wo = Parameter(initializer("normal", [H, H]), "wo")
        self.mq = ops.MatMul().shard(((2, 1), (1, 4)))
        self.mk = ops.MatMul().shard(((2, 1), (1, 4)))
        self.mv = ops.MatMul().shard(((2, 1), (1, 4)))
        self.mo = ops.MatMul().shard(((2, 4), (4, 1)))
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.context = ops.BatchMatMul()
        self.scale = ops.Mul()
        self.softmax = ops.Softmax(-1)
        self.add = ops.Add()
    def heads(self, t):
        return self.transpose(self.reshape(t, (B, S, HEADS, H // HEADS)), (0, 2, 1, 3))
    def construct(self, x):
        q = self.heads(self.mq(x, self.wq))
        k = self.heads(self.mk(x, self.wk))
        v = self.heads(self.mv(x, self.wv))
        p = self.softmax(self.scale(self.scores(q, k), 0.35355339))
        c = self.reshape(self.transpose(self.context(p, v), (0, 2, 1, 3)), (B * S, H))
        return self.add(self.mo(c, self.wo), x)
def model():
    set_seed(1)
    return Attention()
def inputs():
    return (np.random.default_rng(0).standard_normal((B * S, H)).astype(np.float32),)
def labels():
    return (np.random.default_rng(1).standard_normal((B * S, H)).astype(np.float32),)
def loss():
    return nn.MSELoss()
def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
'''

EMBEDDING = open(os.path.join(ROOT, "tests", "models", "embedding_head.py"),
                 encoding="utf-8").read()

XLA = r'''
import json
import numpy as np
from collective_bytes import hlo_collectives
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
ALL = ("a", "b")
def S(*spec):
    return NamedSharding(mesh, P(*spec))
wsc = jax.lax.with_sharding_constraint
f32 = jnp.float32

def train(loss_fn, params, *data):
    value, grads = jax.value_and_grad(loss_fn)(params, *data)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

def mlp(p, x, y):
    h = jax.nn.relu(wsc(x, S("a", "b")) @ wsc(p["w"], S("b", None)))
    return jnp.mean((h @ p["w2"] - y) ** 2)

B, T, H, HEADS, V = 8, 16, 32, 4, 64
def heads(t, b=B):
    return t.reshape(b, T, HEADS, H // HEADS).transpose(0, 2, 1, 3)

def attention(p, x, y):
    xq = wsc(x, S("a", None))
    q, k, v = (heads(xq @ wsc(p[n], S(None, "b"))) for n in ("wq", "wk", "wv"))
    a = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) * 0.35355339, axis=-1)
    c = (a @ v).transpose(0, 2, 1, 3).reshape(B * T, H)
    out = wsc(c, S("a", "b")) @ wsc(p["wo"], S("b", None)) + x
    return jnp.mean((out - y) ** 2)

def xent(logits, labels):
    return jnp.mean(-jnp.sum(jax.nn.one_hot(labels, V) * jax.nn.log_softmax(logits), -1))

def embedding_head(p, tokens, labels):
    h = jnp.take(wsc(p["table"], S(None, ALL)), wsc(tokens, S()), axis=0).reshape(B * T, H)
    return xent(wsc(h, S(None, ALL)) @ wsc(p["head"], S(ALL, None)), labels)

def layer_norm(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * g + b

def dense(p, name, x):
    return x @ p[name + ".w"].T + p[name + ".b"]

def gpt(p, tokens, labels):
    x = jnp.take(p["embedding"], tokens, axis=0) + p["position"]
    h = layer_norm(x, p["ln1.g"], p["ln1.b"]).reshape(B * T, H)
    q, k, v = (heads(dense(p, n, h)) for n in ("q", "k", "v"))
    mask = jnp.triu(jnp.full((T, T), -1e4, f32), k=1)
    a = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) * 0.35355339 + mask, axis=-1)
    c = (a @ v).transpose(0, 2, 1, 3).reshape(B * T, H)
    x = x + dense(p, "proj", c).reshape(B, T, H)
    h = layer_norm(x, p["ln2.g"], p["ln2.b"]).reshape(B * T, H)
    h = dense(p, "fc2", jax.nn.gelu(dense(p, "fc1", h)))
    x = layer_norm(x + h.reshape(B, T, H), p["lnf.g"], p["lnf.b"])
    return xent(x.reshape(B * T, H) @ p["head"].T, labels)

def spec(shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)

gpt_params = {"embedding": (V, H), "position": (T, H), "head": (V, H)}
for n in ("ln1", "ln2", "lnf"):
    gpt_params[n + ".g"] = (H,)
    gpt_params[n + ".b"] = (H,)
for n, (o, i) in {"q": (H, H), "k": (H, H), "v": (H, H), "proj": (H, H), "fc1": (4 * H, H),
                  "fc2": (H, 4 * H)}.items():
    gpt_params[n + ".w"] = (o, i)
    gpt_params[n + ".b"] = (o,)

CASES = {
    "mlp": (mlp, {"w": ((32, 16), S("b", None)), "w2": ((16, 16), S())},
            [(spec((16, 32)), S(ALL, None)), (spec((16, 16)), S(ALL, None))]),
    "attention": (attention, {"wq": ((H, H), S(None, "b")), "wk": ((H, H), S(None, "b")),
                              "wv": ((H, H), S(None, "b")), "wo": ((H, H), S("b", None))},
                  [(spec((B * T, H)), S(ALL, None)), (spec((B * T, H)), S(ALL, None))]),
    "gpt_block": (gpt, {k: (v, S()) for k, v in gpt_params.items()},
                  [(spec((B, T), jnp.int32), S(ALL, None)),
                   (spec((B * T,), jnp.int32), S(ALL))]),
    "embedding_head": (embedding_head, {"table": ((V, H), S(None, ALL)),
                                        "head": ((H, V), S(ALL, None))},
                       [(spec((B, T), jnp.int32), S()), (spec((B * T,), jnp.int32), S())]),
}

result = {}
for name, (fn, params, data) in CASES.items():
    p_spec = {k: spec(s) for k, (s, _) in params.items()}
    p_shard = {k: sh for k, (_, sh) in params.items()}
    step = jax.jit(lambda p, *d, fn=fn: train(fn, p, *d),
                   in_shardings=(p_shard, *[sh for _, sh in data]),
                   out_shardings=(S(), p_shard))
    text = step.lower(p_spec, *[s for s, _ in data]).compile().as_text()
    result[name] = [(c.kind, c.operand_bytes, list(c.group), c.phase)
                    for c in hlo_collectives(text, 8)]
print(json.dumps(result))
'''


def summarise(items: list[Collective]) -> dict[str, Any]:
    found = tally(items)
    return {"collectives": {k: v["count"] for k, v in found.by_kind.items()},
            "payload_bytes": found.payload, "ring_bytes": found.ring}


def pcompile_plan(path: str, mode: str, env: dict[str, str]) -> dict[str, Any]:
    from pcompile.ir.registry import get_op
    from pcompile.tools.compile import compile as compile_model

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        kwargs: dict[str, Any] = ({"parallel_mode": mode} if mode == "semi_auto_parallel"
                                  else {"search_mode": mode})
        program = compile_model(path, devices=DEVICES, dump=False, **kwargs)
    except Exception as exc:  # noqa: BLE001  (reported, not raised)
        return {"status": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    items = []
    for node in program.rank_graph(0).nodes:
        if get_op(node.op).collective:
            size = sum(v.tensor_type.nbytes for v in node.operands)
            items.append(Collective(node.op, size, tuple(node.attrs.get("rank_list", (0,)))))
    out = summarise(items)
    if program.state.search is not None:
        out["objective"] = round(program.state.search.objective, 1)
    out["status"] = "ok"
    return out


def xla_plans() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [BENCHMARKS, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", XLA], capture_output=True, text=True,
                          timeout=600, env=env)
    if done.returncode != 0:
        return {"status": done.stderr.strip().splitlines()[-1][:300]}
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: summarise([Collective(k, size, tuple(group), phase)
                             for k, size, group, phase in items])
            for name, items in raw.items()}


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="plan-quality-")
    models = {}
    for name, text in (("attention", ATTENTION), ("embedding_head", EMBEDDING)):
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        models[name] = (path, {})
    models = {
        "mlp": (os.path.join(ROOT, "examples", "quickstart.py"), {}),
        "attention": models["attention"],
        "gpt_block": (os.path.join(ROOT, "examples", "gpt_block.py"),
                      {"GPT_LAYERS": "1", "GPT_BATCH": "8"}),
        "embedding_head": models["embedding_head"],
    }
    xla = xla_plans()
    results = {}
    for name, (path, env) in models.items():
        row = {label: pcompile_plan(path, mode, {**env, **extra})
               for label, mode, extra in MODES}
        row["xla_gspmd"] = xla.get(name, xla)
        results[name] = row
        print(name, json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "plan_quality", "devices": DEVICES, "results": results},
                     indent=1))


if __name__ == "__main__":
    main()
