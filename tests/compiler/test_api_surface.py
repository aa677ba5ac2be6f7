"""MindSpore API surface seen while porting its parallel tests (issue 36 cause 7): what
MindSpore accepts is accepted, and what it refuses is refused with its exception class."""

from __future__ import annotations

import numpy as np
import pytest

from pcompile import nn, ops
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check


def test_collectives_refuse_a_group_that_is_not_a_str() -> None:
    """MindSpore's test_alltoall: `AlltoAll(..., group=3)` is a TypeError (check_value_type of
    the group), as are non-int split arguments; every collective checks its group alike."""
    with pytest.raises(TypeError, match="'group' must be str"):
        ops.AlltoAll(split_count=8, split_dim=0, concat_dim=1, group=3)
    with pytest.raises(TypeError, match="'split_count' must be int"):
        ops.AlltoAll(split_count=8.0, split_dim=0, concat_dim=1)
    for make in (lambda: ops.AllReduce(group=1), lambda: ops.AllGather(group=None),
                 lambda: ops.ReduceScatter(group=2), lambda: ops.Broadcast(0, group=0)):
        with pytest.raises(TypeError, match="'group' must be str"):
            make()


def test_div_rounding_modes() -> None:
    """MindSpore's ops.div: "floor" is FloorDiv, "trunc" rounds the quotient toward zero,
    anything else a ValueError."""
    x = np.array([7.0, -7.0, 7.5, -0.5], np.float32)
    y = np.array([2.0, 2.0, -2.0, 3.0], np.float32)
    np.testing.assert_array_equal(ops.div(x, y, rounding_mode="floor").asnumpy(),
                                  [3.0, -4.0, -4.0, -1.0])
    np.testing.assert_array_equal(ops.div(x, y, rounding_mode="trunc").asnumpy(),
                                  [3.0, -3.0, -3.0, 0.0])
    np.testing.assert_allclose(ops.div(x, y).asnumpy(), x / y)
    with pytest.raises(ValueError, match="rounding_mode value should be None, 'floor' or"):
        ops.div(x, y, rounding_mode="round")


EVAL_MODEL = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(2)
        self.w = Parameter(initializer("normal", [8, 4]), "w")
        self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
    def construct(self, x):
        return self.matmul(x, self.w)
def model():
    return nn.WithEvalCell(Net(), nn.MSELoss(), add_cast_fp32=True)
def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((4, 8)).astype(np.float32),
            rng.standard_normal((4, 4)).astype(np.float32)]
"""


def test_with_eval_cell(tmp_path) -> None:
    """nn.WithEvalCell(network, loss_fn, add_cast_fp32): (loss, outputs, label), and a parallel
    compile of it computes what one device computes."""
    path = tmp_path / "eval.py"
    path.write_text(EVAL_MODEL)
    program = compile_model(str(path), devices=8, dump=False)
    assert len(program.graph.outputs) == 3  # loss, outputs, label
    assert check(program).ok()
    with pytest.raises(TypeError, match="loss_fn must be a Cell"):
        nn.WithEvalCell(nn.Dense(2, 2), "mse")


def test_max_and_embedding_of_auto_generate() -> None:
    """`ops.auto_generate.Max()(x)`: the largest element; `ops.auto_generate.Embedding()(input,
    weight)`: the rows of weight, its strategy in MindSpore's operand order."""
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    assert ops.auto_generate.Max()(x).asnumpy() == x.max()
    idx = np.array([[0, 2], [1, 1]], np.int32)
    np.testing.assert_array_equal(ops.auto_generate.Embedding()(idx, x).asnumpy(), x[idx])
    with pytest.raises(ValueError, match="padding_idx"):
        ops.auto_generate.Embedding()(idx, x, padding_idx=0)


EMBEDDING_MODEL = """
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(4)
        self.table = Parameter(initializer("normal", [16, 8]), "table")
        self.embedding = ops.auto_generate.Embedding().shard(((2, 1), (1, 4)))
        self.add = ops.auto_generate.AddExt().shard(((2, 1, 4), (2, 1, 4)))
        self.max = ops.auto_generate.Max()
    def construct(self, ids, y):
        h = self.add(self.embedding(ids, self.table), y, 0.5)
        return h * self.max(h)
def model():
    return Net()
def inputs():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 16, (4, 3)).astype(np.int32),
            rng.standard_normal((4, 3, 8)).astype(np.float32)]
def loss():
    return nn.MSELoss()
def labels():
    return [np.zeros((4, 3, 8), np.float32)]
def optimizer(params):
    return nn.SGD(params, learning_rate=0.1)
"""


def test_auto_generate_ops_train_like_one_device(tmp_path) -> None:
    path = tmp_path / "embedding.py"
    path.write_text(EMBEDDING_MODEL)
    program = compile_model(str(path), devices=8, dump=False)
    gather = next(n for n in program.graph.nodes if n.op == "Gather")
    assert program.state.assignment.sharding(gather).strategy == ((1, 4), (2, 1))
    assert check(program, steps=2).ok()


def test_a_missing_nn_name_is_one_message() -> None:
    """MindSpore's tests reached `nn.WithEvalCell` before pcompile had it: a missing name of
    `nn` says what it is and suggests the closest, as `ops` does (a bare AttributeError
    before)."""
    with pytest.raises(AttributeError, match=r"pcompile.nn has no 'WithEvalCel'.*nn.WithEvalCell"):
        nn.WithEvalCel  # noqa: B018
