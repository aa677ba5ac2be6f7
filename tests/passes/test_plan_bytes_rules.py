"""Planning rules that keep a plan at the bytes its scheme needs:

* a strategy-less Cast is transparent: it takes its input's layout, so a Cast between two
  model-parallel ops inserts no collective;
* layouts flow through Reshape chains: a chain whose shapes allow it keeps the split (no
  collective), one whose shapes do not redistributes once;
* partial cotangents are reduced once, on the right group: the Llama of `examples/llama.py`
  has exactly Megatron-LM's activation collectives per layer (2 AllReduce forward, 2 backward,
  over the model-parallel group), its embedding table's gradient is reduced over the
  data-parallel group (its output's cotangent is summed over the model-parallel group once),
  and the small norm weights keep the one all-rank AllReduce that moves fewer bytes;
* with `enable_alltoall`, experts fed by an index Gather (mindformers' MoEV2 dispatches so)
  exchange their slots with one AlltoAll each way and direction, never an AllGather.

Every plan here is checked against the single-device program by the float64 oracle."""

from __future__ import annotations

import json
import os
import textwrap
from collections import Counter
from typing import Any

import pytest

from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests import ROOT

LLAMA = os.path.join(ROOT, "examples", "llama.py")

HEADER = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="{dataset}")
"""

FOOTER = """
def model():
    set_seed(2)
    return Net()
def inputs():
    return (np.random.default_rng(0).standard_normal(X_SHAPE).astype(np.float32),)
def labels():
    return (np.random.default_rng(1).standard_normal(Y_SHAPE).astype(np.float32),)
def loss():
    return nn.MSELoss()
def optimizer(params):
    return nn.SGD(params, 1e-2)
"""


def _compile(tmp_path: Any, body: str, dataset: str = "full_batch"
             ) -> tuple[Any, dict[str, Any]]:
    path = tmp_path / "model.py"
    path.write_text(HEADER.format(dataset=dataset) + textwrap.dedent(body) + FOOTER)
    out = tmp_path / "out"
    program = compile_model(str(path), devices=8, out_dir=str(out), dump_ranks="0")
    plan = json.loads((out / "plan.json").read_text())
    return program, plan


def _collectives(plan: dict[str, Any], rank: str = "0") -> list[dict[str, Any]]:
    """The collectives a rank runs (mirrors are the identity; their AllReduce is listed)."""
    return [c for c in plan["collectives"][rank] if c["op"] != "_MirrorOperator"]


def _network_forward(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Rank 0's forward collectives inside the network (not the loss cell's mean)."""
    return [c for c in _collectives(plan) if c["phase"] == "forward" and "_backbone" in c["node"]]


def _assert_oracle(program: Any) -> None:
    report = check(program, steps=2)
    assert report.ok(), f"worst {report.worst}, losses {report.losses}"


MLP = """
    X_SHAPE, Y_SHAPE = ({rows}, 32), ({rows}, 32)
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1 = Parameter(initializer("normal", [32, 64]), "w1")
            self.w2 = Parameter(initializer("normal", [64, 32]), "w2")
            self.up = ops.MatMul().shard(((2, 1), (1, 4)))
            self.relu = ops.ReLU().shard(((2, 4),))
            self.down = ops.MatMul().shard(((2, 4), (4, 1)))
            self.cast_in = ops.Cast()
            self.cast_out = ops.Cast()
            self.add = ops.Add().shard(((8, 1), (8, 1)))
"""


def test_a_strategy_less_cast_between_two_model_parallel_ops_moves_nothing(
        tmp_path: Any) -> None:
    """Column-split MatMul -> Cast -> ReLU (column-split) -> Cast -> row-split MatMul: the
    only collective of the forward pass is the row-split MatMul's reduction."""
    program, plan = _compile(tmp_path, MLP.format(rows=16) + """
        def construct(self, x):
            h = self.cast_in(self.up(x, self.w1), "float16")
            h = self.cast_out(self.relu(h), "float32")
            return self.down(h, self.w2)
    """)
    forward = _network_forward(plan)
    # the loss splits the rows over all 8 ranks: the partial sums are reduce-scattered
    assert [(c["op"], len(c["rank_list"])) for c in forward] == [("ReduceScatter", 4)], forward
    casts = [e for name, e in plan["ops"].items() if "Cast" in name]
    assert len(casts) == 2 and all(e["in_strategy"] == [[2, 4]] for e in casts), casts
    _assert_oracle(program)


MERGE_HEADS = """
    B, S, N, D = 4, 8, 4, 8
    X_SHAPE, Y_SHAPE = (B * S, N * D), (B * S, N * D)
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.wq = Parameter(initializer("normal", [N * D, N * D]), "wq")
            self.wo = Parameter(initializer("normal", [N * D, N * D]), "wo")
            self.q = ops.MatMul().shard(((2, 1), (1, 4)))
            self.heads = ops.Transpose().shard(((2, 1, 4, 1),))
            self.merge = ops.Transpose().shard(((2, 4, 1, 1),))
            self.o = ops.MatMul().shard(((2, 4), (4, 1)))
            self.reshape = ops.Reshape()
        def construct(self, x):
            q = self.reshape(self.q(x, self.wq), (B, S, N, D))
            q = self.merge(self.heads(q, (0, 2, 1, 3)), (0, 2, 1, 3))
            q = self.reshape(q, MIDDLE)
            return self.o(self.reshape(q, (B * S, N * D)), self.wo)
"""


def test_a_reshape_chain_keeps_the_split_its_shapes_allow(tmp_path: Any) -> None:
    """Merging heads (B, S, N, D) -> (B, S, N*D) -> (B*S, N*D) keeps the head split through
    the chain: no collective before the row-split MatMul (the middle Reshape used to be laid
    out replicated, an AllGather over every rank)."""
    program, plan = _compile(tmp_path, "MIDDLE = (4, 8, 32)\n" + textwrap.dedent(MERGE_HEADS))
    forward = _network_forward(plan)
    assert [(c["op"], len(c["rank_list"])) for c in forward] == [("ReduceScatter", 4)], forward
    _assert_oracle(program)


def test_a_reshape_chain_its_shapes_break_redistributes_once(tmp_path: Any) -> None:
    """(B, S, N, D) split on B and N -> (B, S*N, D) cannot keep the N split (S before it is
    whole): the chain gathers the head split once (the batch split is kept), then slices
    back to what the MatMul wants."""
    program, plan = _compile(tmp_path, "MIDDLE = (4, 32, 8)\n" + textwrap.dedent(MERGE_HEADS))
    forward = _network_forward(plan)
    gathers = [c for c in forward if c["op"] == "AllGather"]
    assert [c["rank_list"] for c in gathers] == [[0, 1, 2, 3]], forward
    assert [c["op"] for c in forward if c["op"] != "AllGather"] == ["ReduceScatter"], forward
    _assert_oracle(program)


def _llama_plan(monkeypatch: Any, tmp_path: Any, devices: int, **env: str
                ) -> tuple[Any, dict[str, Any]]:
    for name in [n for n in os.environ if n.startswith("LLAMA_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(f"LLAMA_{name}", value)
    program = compile_model(LLAMA, devices=devices, out_dir=str(tmp_path / "out"),
                            dump_ranks="0")
    return program, json.loads((tmp_path / "out" / "plan.json").read_text())


@pytest.mark.parametrize("devices,flash,dtype", [(8, "1", "bfloat16"), (8, "0", "float32"),
                                                 (16, "1", "float32")])
def test_llama_moves_megatrons_collectives(monkeypatch: Any, tmp_path: Any, devices: int,
                                            flash: str, dtype: str) -> None:
    """Outside the loss (mindformers' vocabulary-parallel cross-entropy and its masks), rank
    0 runs per layer 2 AllReduces over the model-parallel group forward and 2 backward, one
    more backward for the embedding's output, and the gradient reductions: split weights
    and the embedding table over the data-parallel group, the norm weights over all ranks
    (their gradient is a few hundred bytes). Nothing is gathered or scattered."""
    layers, mp = 2, 4
    dp = devices // mp
    program, plan = _llama_plan(monkeypatch, tmp_path, devices, FLASH=flash, DTYPE=dtype,
                                LAYERS=str(layers))
    outside = [c for c in _collectives(plan) if "loss-CrossEntropyLoss" not in c["node"]]
    mp_group = list(range(mp))
    activations = Counter((c["phase"], c["op"]) for c in outside if c["rank_list"] == mp_group)
    assert activations == {("forward", "AllReduce"): 2 * layers,
                           ("backward", "AllReduce"): 2 * layers + 1}, activations
    kinds = Counter((c["op"], len(c["rank_list"])) for c in outside
                    if c["rank_list"] != mp_group)
    assert set(kinds) <= {("AllReduce", dp), ("AllReduce", devices)}, kinds
    mirrors = {c["reason"].split()[3]: len(c["rank_list"]) for c in plan["collectives"]["0"]
               if c["op"] == "_MirrorOperator" and c["reason"].startswith("gradient of")}
    assert mirrors["model.embedding_weight"] == dp
    assert all(size == devices for name, size in mirrors.items() if "norm" in name)
    assert all(size == dp for name, size in mirrors.items()
               if name.endswith("weight") and "norm" not in name), mirrors
    _assert_oracle(program)


def _ring_bytes(collectives: list[dict[str, Any]]) -> float:
    """Bytes rank 0 sends with ring algorithms (`bytes` is what it receives: AllReduce the
    tensor, AllGather and ReduceScatter the (n - 1) other blocks)."""
    total = 0.0
    for c in collectives:
        n = len(c["rank_list"])
        total += 2 * (n - 1) / n * c["bytes"] if c["op"] == "AllReduce" else c["bytes"]
    return total


def _saved_norm_bytes(program: Any) -> int:
    """Bytes of the activations the norms and residual adds compute in the forward pass that
    the backward pass reads (what the step keeps of those regions between the two; their
    weights, behind mirrors, are not activations)."""
    from pcompile.passes.recompute import saved_forward_values

    total = 0
    for value in saved_forward_values(program.rank_graph(0)):
        node = value.node
        if node.op != "_MirrorOperator" and (
                "norm-LlamaRMSNorm" in node.scope
                or (node.op == "Add" and node.scope.endswith("LlamaDecodeLayer"))):
            types = getattr(value.type, "elements", None) or (value.type,)
            total += sum(t.nbytes for t in types)
    return total


@pytest.mark.parametrize("batch", [pytest.param("2", marks=pytest.mark.slow), "16"])
def test_sequence_parallel_moves_the_same_bytes_in_a_quarter_of_the_memory(
        monkeypatch: Any, tmp_path: Any, batch: str) -> None:
    """mindformers' `use_seq_parallel` (LLAMA_SEQ_PARALLEL=1): per layer 2 AllGathers and 2
    ReduceScatters over mp in each direction instead of 2 AllReduces (the same ring bytes,
    but for the LM head's gather and the embedding's cotangent sum), and the norms' and
    residuals' activations the backward pass keeps divided by mp. One sequence per
    data-parallel rank splits the sequence ((dp, mp, 1), batch 2), several split the batch."""
    layers, mp = 2, 4
    sizes = dict(LAYERS=str(layers), BATCH=batch, SEQ="32", DTYPE="float32")
    base, base_plan = _llama_plan(monkeypatch, tmp_path / "base", 8, **sizes)
    seq, seq_plan = _llama_plan(monkeypatch, tmp_path / "sp", 8, SEQ_PARALLEL="1", **sizes)
    mp_group = list(range(mp))
    layer = [c for c in _collectives(seq_plan) if "LlamaDecodeLayer" in c["node"]]
    kinds = Counter((c["phase"], c["op"]) for c in layer if c["rank_list"] == mp_group)
    assert kinds == {("forward", "AllGather"): 2 * layers,
                     ("forward", "ReduceScatter"): 2 * layers,
                     ("backward", "AllGather"): 2 * layers,
                     ("backward", "ReduceScatter"): 2 * layers}, kinds
    assert not [c for c in layer if c["rank_list"] != mp_group]
    sent = {name: _ring_bytes([c for c in _collectives(plan) if "loss-" not in c["node"]])
            for name, plan in (("base", base_plan), ("sp", seq_plan))}
    head = [c for c in _collectives(seq_plan) if "lm_head" in c["node"]]
    activation = sum(c["bytes"] for c in head if c["phase"] == "forward") * mp / (mp - 1)
    assert sent["base"] <= sent["sp"] <= sent["base"] + 2 * 1.5 * activation, sent
    assert _saved_norm_bytes(seq) * mp == _saved_norm_bytes(base)
    _assert_oracle(seq)


def test_a_replicated_loss_after_a_row_parallel_matmul_needs_no_backward_all_reduce(
        tmp_path: Any) -> None:
    """The LM head's partial logits are all-reduced over the 8 ranks and the loss is computed
    alike on all of them, so every rank holds the same cotangent share of the logits: the
    AllReduce's vjp is that share times 8, a local Mul (as XLA does), not a second AllReduce
    of the logits."""
    program = compile_model(os.path.join(ROOT, "tests", "models", "embedding_head.py"),
                            devices=8, out_dir=str(tmp_path / "out"), dump_ranks="0",
                            overrides={"parallel_mode": "auto_parallel",
                                       "search_mode": "sharding_propagation"})
    graph = program.rank_graph(0)
    reduces = [n for n in graph.nodes if n.op == "AllReduce"]
    forward = [n for n in reduces if not n.scope.startswith("Gradients")]
    assert [n.attrs.get("replicated_cotangent") for n in forward] == [True]
    assert forward[0].result.type.shape == (16 * 8, 64)
    assert not [n for n in reduces if n.scope.startswith("Gradients")]
    _assert_oracle(program)


def test_an_all_reduce_whose_result_is_split_again_keeps_its_backward_all_reduce() -> None:
    """The quickstart's row-split MatMul feeds a ReLU split over other ranks: the cotangent
    shares differ between the ranks of the AllReduce's group, so they are summed."""
    program = compile_model(os.path.join(ROOT, "tests", "models", "quickstart_semi.py"),
                            devices=8, dump=False)
    graph = program.rank_graph(0)
    matmul = [n for n in graph.nodes if n.op == "AllReduce"
              and not n.scope.startswith("Gradients")
              and str(n.parallel.reason).startswith("forward: MatMul")]
    assert matmul and not any(n.attrs.get("replicated_cotangent") for n in matmul)
    backward = [n for n in graph.nodes if n.op == "AllReduce"
                and "vjp of AllReduce: forward: MatMul" in str(n.parallel.reason)]
    assert len(backward) == len(matmul)
    _assert_oracle(program)


def test_a_sum_every_user_takes_a_block_of_is_reduce_scattered(tmp_path: Any) -> None:
    """A row-parallel MatMul whose sum feeds a data-parallel residual ((8, 1): each rank takes
    its 1/8 of the rows, the rows the MatMul's mp group shares) reduce-scatters the partial
    sums instead of all-reducing them and slicing (half the bytes), and its vjp gathers the
    cotangent instead of all-reducing it."""
    program, plan = _compile(tmp_path, MLP.format(rows=64) + """
        def construct(self, x):
            return self.add(self.down(self.relu(self.up(x, self.w1)), self.w2), x)
    """, dataset="data_parallel")
    mp_group = [0, 1, 2, 3]
    over_mp = [(c["phase"], c["op"]) for c in _collectives(plan) if c["rank_list"] == mp_group]
    # the input gathered for the column-parallel MatMul; the row-parallel sum scattered, and
    # its cotangent gathered back (the input needs no gradient)
    assert over_mp == [("forward", "AllGather"), ("forward", "ReduceScatter"),
                       ("backward", "AllGather")], over_mp
    _assert_oracle(program)


@pytest.mark.parametrize("search", [pytest.param("sharding_propagation", marks=pytest.mark.slow),
                                    "recursive_programming"])
def test_the_searches_look_through_casts(monkeypatch: Any, tmp_path: Any, search: str) -> None:
    """Under a search, mindformers' Llama (every MatMul configured, its Casts not) gets the
    semi-auto plan's bytes: the searches give a strategy-less Cast no strategy of its own (it
    keeps its input's layout; a weight's Cast takes its configured user's), where they used to
    pick layouts for the Casts that the neighbours then gathered back (4.5x the bytes)."""
    _, semi = _llama_plan(monkeypatch, tmp_path / "semi", 8, DTYPE="float32")
    program = compile_model(LLAMA, devices=8, out_dir=str(tmp_path / "search"), dump_ranks="0",
                            overrides={"parallel_mode": "auto_parallel", "search_mode": search})
    searched = json.loads((tmp_path / "search" / "plan.json").read_text())
    assert _ring_bytes(_collectives(searched)) == _ring_bytes(_collectives(semi))
    casts = [name for name in searched["search"]["ops"] if "/Cast-" in name]
    assert not casts, casts
    _assert_oracle(program)


def test_the_shrunk_check_reduces_the_cotangents_the_plan_reduces(monkeypatch: Any,
                                                                   tmp_path: Any) -> None:
    """Where the embedding's cotangents are summed is a choice by byte sizes; the shrunk
    check's copy is compiled with the plan's choice (forced), not its own at smaller sizes, so
    it communicates as the plan does."""
    from pcompile.passes.cotangents import plan_cotangent_reductions
    from pcompile.tools.shrink import choose_shrink, pin_plan, shrunk_check

    program, _ = _llama_plan(monkeypatch, tmp_path, 8, DTYPE="float32")
    state = program.state
    assert state.reduced_parameters == ("model.embedding_weight",)
    none = plan_cotangent_reductions(state.graph, state.assignment, (), forced=())
    assert not none.param_axes and not none.outputs
    norm = plan_cotangent_reductions(state.graph, state.assignment, (),
                                     forced=("model.norm_out.weight",))
    assert not norm.param_axes  # its RmsNorm reads a float activation too: never applies
    assert pin_plan(program, choose_shrink(program, factor=2)).reduced_parameters == \
        ("model.embedding_weight",)
    assert shrunk_check(program, factor=2).report.ok()


def test_an_index_dispatched_expert_exchange_is_one_all_to_all_each_way(tmp_path: Any) -> None:
    """Experts fed by an index Gather (each group's slots pick tokens of that group, as a
    sort-based router dispatches them): with the groups split by dp = 8 and the experts by
    ep = 8, moving the split from the group axis to the expert axis through a Transpose is one
    AlltoAll, the move back another, and their vjps one each; the slots are never gathered
    and the experts' weight, held whole by no two ranks, needs no gradient reduction."""
    program, plan = _compile(tmp_path, """
        from pcompile import Tensor, set_auto_parallel_context
        set_auto_parallel_context(enable_alltoall=True)
        G, T, H, E, C = 8, 4, 8, 8, 2
        X_SHAPE, Y_SHAPE = (G, T, H), (G, E * C, H)
        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.w = Parameter(initializer("normal", [E, H, H]), "w")
                self.scale = Parameter(initializer("ones", [H]), "scale")
                self.mul = ops.Mul().shard(((8, 1, 1), (1,)))
                # slot (g, e, c) reads token (3 e + c) mod T of its group g
                self.position = Tensor(np.broadcast_to(
                    3 * np.arange(E)[:, None] + np.arange(C), (G, E, C)).astype(np.float32))
                self.wrap = ops.Mod().shard(((8, 1, 1), ()))
                self.cast = ops.Cast()
                self.reshape = ops.Reshape()
                self.take = ops.Gather(batch_dims=1).shard(((8, 1, 1), (8, 1, 1)))
                self.to_experts = ops.Transpose().shard(((1, 1, 8, 1, 1),))
                self.expert = ops.BatchMatMul().shard(((1, 8, 1, 1), (8, 1, 1)))
                self.to_groups = ops.Transpose().shard(((1, 1, 8, 1, 1),))
            def construct(self, x):
                index = self.cast(self.wrap(self.position, float(T)), "int32")
                x = self.mul(x, self.scale)  # the tokens need their cotangent
                slots = self.reshape(self.take(x, index, 1), (1, G, E, C, H))
                slots = self.to_experts(slots, (0, 2, 1, 3, 4))       # (1, E, G, C, H)
                out = self.expert(self.reshape(slots, (1, E, G * C, H)), self.w)
                out = self.to_groups(self.reshape(out, (1, E, G, C, H)), (0, 2, 1, 3, 4))
                return self.reshape(out, (G, E * C, H))
    """)
    kinds = Counter((c["phase"], c["op"]) for c in _collectives(plan))
    # besides the exchanges: the loss's mean over the groups and scale's gradient, no more
    assert kinds == Counter({("forward", "AlltoAll"): 2, ("backward", "AlltoAll"): 2,
                             ("forward", "AllReduce"): 1, ("backward", "AllReduce"): 1}), kinds
    reduced = [c["reason"] for c in _collectives(plan) if c["phase"] == "backward"
               and c["op"] == "AllReduce"]
    assert "parameter scale" in reduced[0], reduced
    exchange = 1 * 8 * 2 * 8 * 4  # a rank's slots, [1, E / 8, G, C, H] float32
    assert {c["bytes"] for c in _collectives(plan) if c["op"] == "AlltoAll"} == {
        exchange * 7 // 8}  # it keeps its own 1/8
    _assert_oracle(program)
