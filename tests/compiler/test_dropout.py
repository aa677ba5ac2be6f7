"""Dropout trained for real (compiler/frontend/ops.py's Dropout, compiler/frontend/dropout.py,
compiler/frontend/random_state.py): `ops.Dropout` and `nn.Dropout` with MindSpore's arguments, a
step counter that draws new bits every step, and parallel plans that train exactly like one device
under the same seed."""

from __future__ import annotations

import numpy as np
import pytest

from pcompile import Parameter, Tensor, nn, ops, set_seed
from pcompile.compiler.driver.runtime import batches
from pcompile.compiler.frontend.initializer import get_seed
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner

# MindSpore's tests/ut/python/parallel/test_dropout.py: Mul, two P.Dropout(0.5) and two ReLU
# under one strategy, trained by TrainOneStepCell with Momentum (16 devices, full batch).
MINDSPORE_NET = """
import numpy as np
from pcompile import Parameter, Tensor, nn, ops, set_auto_parallel_context
set_auto_parallel_context(dataset_strategy="full_batch")
S1, S2 = {s1}, {s2}
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.mul = ops.Mul().shard(S1) if S1 else ops.Mul()
        self.dropout1 = ops.Dropout(keep_prob=0.5).shard(S2) if S2 else ops.Dropout(0.5)
        self.relu = ops.ReLU().shard(S2) if S2 else ops.ReLU()
        self.dropout2 = ops.Dropout(keep_prob=0.5).shard(S2) if S2 else ops.Dropout(0.5)
        self.relu2 = ops.ReLU().shard(S2) if S2 else ops.ReLU()
        w = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
        self.mul_weight = Parameter(Tensor(w), "w1")
    def construct(self, x, b):
        out = self.mul(x, self.mul_weight)
        out, _ = self.dropout1(out)
        out = self.relu(out)
        out, _ = self.dropout2(out)
        return self.relu2(out)
def model():
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate={lr}, momentum=0.9)
    return nn.TrainOneStepCell(net, opt)
def inputs():
    rng = np.random.default_rng(1)
    return [rng.standard_normal((128, 64)).astype(np.float32),
            np.ones((128, 64), np.float32)]
"""

CASES = {  # MindSpore's five: mode, Mul's strategy, the Dropouts' and ReLUs' strategy
    "data_parallel": ("semi_auto_parallel", ((16, 1), (16, 1)), ((16, 1),)),
    "model_parallel": ("semi_auto_parallel", ((1, 16), (1, 16)), ((1, 16),)),
    "mixed_parallel": ("semi_auto_parallel", ((4, 4), (4, 4)), ((4, 4),)),
    "auto_parallel": ("auto_parallel", None, None),
    "repeat_calc": ("semi_auto_parallel", ((4, 4), (4, 4)), ((2, 4),)),
}


def compile_case(tmp_path, name: str):
    mode, s1, s2 = CASES[name]
    path = tmp_path / f"dropout_{name}.py"
    path.write_text(MINDSPORE_NET.format(s1=s1, s2=s2, lr=0.1))
    search = "sharding_propagation" if mode == "auto_parallel" else None
    return compile_model(str(path), devices=16, parallel_mode=mode, search_mode=search,
                         dump=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mindspore_dropout_networks_compile(tmp_path, name: str) -> None:
    program = compile_case(tmp_path, name)
    drops = [n for n in program.graph.nodes if n.op == "Dropout"]
    assert len(drops) == 2 and {n.attrs["keep_prob"] for n in drops} == {0.5}
    if CASES[name][2] is not None:
        split = CASES[name][2][0]
        assert all(program.state.assignment.sharding(n).strategy[0] == split for n in drops)
    # each op draws from its own step of the counter and its own seeds
    assert len({(n.attrs["seed0"], n.attrs["seed1"]) for n in drops}) == 2
    assert "random_step" in program.initial_values


@pytest.mark.parametrize("name", ["mixed_parallel", "repeat_calc"])
def test_dropout_trains_like_one_device(tmp_path, name: str) -> None:
    """Two steps of a split Dropout (ranks that repeat a block included) equal one device's:
    the same elements are dropped on every rank as in the single-device program, and the
    counter has advanced by one per Dropout call per step."""
    program = compile_case(tmp_path, name)
    report = check(program, steps=2)
    assert report.ok(), report
    assert "random_step" in report.params


def test_every_step_draws_new_bits(tmp_path) -> None:
    path = tmp_path / "one.py"
    path.write_text(MINDSPORE_NET.format(s1=None, s2=None, lr=0.0))  # weights stay
    program = compile_model(str(path), devices=1, dump=False)
    graph = program.graph
    counter = next(p for p in graph.params if p.name == "random_step")
    assert counter.shape == () and not counter.requires_grad
    # the counter's one reader is its advance; each Dropout reads an advanced value
    advances = [n for n in graph.nodes if n.op == "AssignAdd"]
    assert [u.op for u, _ in counter.uses] == ["AssignAdd"] and len(advances) == 2
    drops = [n for n in graph.nodes if n.op == "Dropout"]
    assert [d.operands[1] for d in drops] == [a.result for a in advances]
    runner = StandAloneRunner(program, "numpy")
    losses = [runner.step(arrays) for _, _, arrays in batches(program, 3)]
    assert int(runner.values["random_step"]) == 6  # two Dropouts a step
    # the same batch and weights (learning rate 0): other elements dropped each step
    assert len(set(losses)) == 3


def test_ops_dropout_arguments_and_eager_call() -> None:
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    out, mask = ops.Dropout(keep_prob=0.8, Seed0=3, Seed1=4)(x)
    mask = mask.asnumpy()
    assert set(np.unique(mask)) <= {0.0, 1.0}
    np.testing.assert_array_equal(out.asnumpy(), (x * np.float32(1 / 0.8)) * mask)
    with pytest.raises(TypeError, match="keep_prob"):
        ops.Dropout(keep_prob=1)
    with pytest.raises(ValueError, match=r"range \(0, 1\]"):
        ops.Dropout(keep_prob=0.0)
    with pytest.raises(TypeError, match="Seed0"):
        ops.Dropout(0.5, Seed0=1.5)


def test_seeds_follow_mindspore() -> None:
    """Seed0 = Seed1 = 0: the global seed and the op's place among the random ops (MindSpore's
    `_get_graph_seed` with a global seed); given seeds are kept."""
    from pcompile.compiler.driver.trace_model import trace_cell
    from pcompile.compiler.frontend.nn.layers import Dropout as NnDropout

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = ops.Dropout(0.5)
            self.b = ops.Dropout(0.5, Seed0=7, Seed1=9)
            self.c = NnDropout(p=0.2)

        def construct(self, x):
            return self.c(self.b(self.a(x)[0])[0])

    set_seed(5)
    net = Net()
    net.set_train(True)
    graph, _ = trace_cell(net, np.zeros((4, 4), np.float32))
    seeds = [(n.attrs["seed0"], n.attrs["seed1"]) for n in graph.nodes if n.op == "Dropout"]
    assert get_seed() == 5 and seeds == [(5, 0), (7, 9), (5, 2)]


def test_nn_dropout_mindspore_arguments() -> None:
    assert nn.Dropout().p == 0.5  # MindSpore's default: p=0.5
    assert nn.Dropout(keep_prob=0.9).keep_prob == 0.9
    assert nn.Dropout(p=0.1).keep_prob == pytest.approx(0.9)
    with pytest.raises(TypeError, match="keep_prob"):
        nn.Dropout(keep_prob=1)
    with pytest.raises(ValueError, match="p must be"):
        nn.Dropout(p=1.0)


DATA_PARALLEL_NET = """
import numpy as np
from pcompile import nn, ops
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(p=0.5)
        self.dense = nn.Dense(4, 2)
    def construct(self, x):
        return self.dense({body})
def model():
    return Net()
def inputs():
    return [np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)]
def labels():
    return [np.ones((16, 2), np.float32)]
def loss():
    return nn.MSELoss()
def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_data_parallel_dropout_trains_like_one_device(tmp_path) -> None:
    """data_parallel traces each rank's own rows: a Dropout there draws its rows' bits of the
    whole batch's tensor (its offsets a rank constant: rank r's rows begin at r * 2), so two
    steps on 8 ranks equal one device's; the counter's AssignAdd reads no batch and is the same
    on every rank, so it is not refused as a batch-dependent assignment is (it was refused)."""
    path = tmp_path / "dp.py"
    path.write_text(DATA_PARALLEL_NET.format(body="self.drop(x)"))
    program = compile_model(str(path), devices=8, parallel_mode="data_parallel", dump=False)
    drop = next(n for n in program.graph.nodes if n.op == "Dropout")
    assert drop.attrs["global_shape"] == (16, 4) and drop.operands[0].shape == (2, 4)
    assert [tuple(drop.operands[2].array_at(r)) for r in (0, 3)] == [(0, 0), (6, 0)]
    report = check(program, steps=2)
    assert report.ok(), report


def test_data_parallel_dropout_off_the_batch_dim_is_refused(tmp_path) -> None:
    """A random op whose dim 0 is not the batch's (here the transposed rows) has no known
    place in the whole tensor when each rank traces its own rows: one message naming the mode
    that works."""
    from pcompile.ir.errors import PcompileError

    path = tmp_path / "dp_t.py"
    path.write_text(DATA_PARALLEL_NET.format(
        body="ops.transpose(self.drop(ops.transpose(x, (1, 0))), (1, 0))"))
    with pytest.raises(PcompileError, match=r"Dropout at .* in data_parallel mode.*dim 0 must "
                                            r"be the batch's.*semi_auto_parallel"):
        compile_model(str(path), devices=8, parallel_mode="data_parallel", dump=False)


def test_a_parameter_named_like_the_counter_is_refused() -> None:
    from pcompile.compiler.driver.trace_model import trace_cell
    from pcompile.ir.errors import PcompileError

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((4,), np.float32)), "random_step")
            self.drop = ops.Dropout(0.5)

        def construct(self, x):
            return self.drop(x * self.w)[0]

    with pytest.raises(PcompileError, match="named 'random_step'"):
        trace_cell(Net(), np.ones((2, 4), np.float32))
