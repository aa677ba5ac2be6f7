"""data_parallel, hybrid_parallel (manual) and the gradient/loss options against the oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check, rounding_rtol
from pcompile.tools.runners import ParallelRunner, StandAloneRunner
from tests import ROOT

EXAMPLES = os.path.join(ROOT, "examples")


def sgd_model(tmp_path, extra: str = "", mode: str = "semi_auto_parallel", flag: str = ""):
    path = tmp_path / "sgd_model.py"
    path.write_text(f"""
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, set_seed
set_auto_parallel_context(parallel_mode="{mode}", dataset_strategy="data_parallel" {extra})

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [32, 16]), "w" {flag})
        self.w2 = Parameter(initializer("normal", [16, 16]), "w2")
        self.matmul = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul(x, self.w)), self.w2)

def model():
    set_seed(3)
    return Net()

def inputs():
    return (np.random.default_rng(0).random((16, 32)).astype(np.float32),)

def labels():
    return (np.random.default_rng(1).random((16, 16)).astype(np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, learning_rate=0.5)
""")
    return str(path)


def one_step_deltas(program) -> tuple[dict, dict]:
    """Parameter change after one step: parallel program vs the single-device program."""
    ref = compile_model(program.state.model_file.path, devices=1, dump=False)
    par, one = ParallelRunner(program), StandAloneRunner(ref, "numpy")
    for name in one.values:
        one.values[name] = np.array(program.initial_values[name], copy=True)
    _, _, arrays = next(batches(ref, 1))
    par.step(arrays)
    one.step(arrays)
    start = program.initial_values
    return ({n: par.global_value(n) - start[n] for n in ("w", "w2")},
            {n: one.values[n] - start[n] for n in ("w", "w2")})


def assert_delta_close(program, got: np.ndarray, want: np.ndarray, name: str) -> None:
    """One step's parameter change of the plan against the single-device one's, both in
    float32: a difference of two rounded values, so it is bounded by the float32 rounding
    bound (`rounding_rtol`) relative to the parameter's own magnitude, not the delta's."""
    bound = rounding_rtol(program, np.float32)
    scale = float(np.abs(program.initial_values[name]).max())
    np.testing.assert_allclose(got, want, rtol=bound, atol=bound * scale, err_msg=name)


@pytest.mark.parametrize("example", ["quickstart.py", pytest.param("layout_mlp.py",
                                                                   marks=pytest.mark.slow),
                                     "gpt_block.py"])
def test_data_parallel_with_gradients_mean_matches_single_device(example) -> None:
    program = compile_model(os.path.join(EXAMPLES, example), devices=8,
                            parallel_mode="data_parallel", dump=False,
                            overrides={"gradients_mean": True})
    graph = program.rank_graph(0)
    assert graph.inputs[0].shape[0] * 8 == program.graph.inputs[0].shape[0] * 8
    mirrors = [n for n in graph.nodes if n.op == "_MirrorOperator"]
    assert len(mirrors) == len(graph.weights)
    assert all(len(n.attrs["rank_list"]) == 8 and n.attrs["mean_flag"] for n in mirrors)
    report = check(program, steps=2)
    assert report.ok(), report.worst


def test_data_parallel_without_mean_sums_gradients(tmp_path) -> None:
    program = compile_model(sgd_model(tmp_path, mode="data_parallel"), devices=8, dump=False)
    par, one = one_step_deltas(program)
    for name in par:
        assert_delta_close(program, par[name], 8 * one[name], name)


@pytest.mark.slow
def test_hybrid_manual_parallel_matches_single_device(tmp_path) -> None:
    program = compile_model(os.path.join(EXAMPLES, "manual_parallel.py"), devices=8,
                            out_dir=str(tmp_path / "out"))
    assert program.state.parallel_mode == "hybrid_parallel"
    # Every rank's own trace is dumped in its folder.
    trace3 = (tmp_path / "out" / "rank_3" / "00_trace.ir").read_text()
    assert "begin: (12, 0, 0, 0)" in trace3
    # Each rank traced its own graph: rank 3 slices rows 12..16 of the batch.
    first = program.rank_graph(3).nodes[0]
    assert first.op == "StridedSlice" and first.attrs["begin"][0] == 12
    assert check(program, steps=2).ok()


def test_literal_manual_parallel_seed_runs_the_model_file_as_each_rank(tmp_path) -> None:
    """The seed's module-level `cur_rank = get_rank()` (after `init()`) must be each rank's
    own: the model file runs once per rank in hybrid_parallel, so rank 3 takes rows 12..16 and
    the first-step loss is the single-device loss over the whole batch."""
    program = compile_model(os.path.join(ROOT, "tests", "models",
                                         "manual_parallel_literal.py"), devices=8, dump=False)
    assert program.state.parallel_mode == "hybrid_parallel"
    for rank in (0, 3, 7):
        first = program.rank_graph(rank).nodes[0]
        assert first.op == "StridedSlice" and first.attrs["begin"][0] == 4 * rank
    report = check(program, steps=1)
    (par, one), = report.losses
    assert abs(par - one) <= report.bound * max(1.0, abs(one)), report.losses


def test_layerwise_parallel_parameter_gets_no_mirror(tmp_path) -> None:
    path = sgd_model(tmp_path, mode="data_parallel", flag=", layerwise_parallel=True")
    program = compile_model(path, devices=8, dump=False)
    params = {n.attrs["parameter"] for n in program.rank_graph(0).nodes
              if n.op == "_MirrorOperator"}
    assert params == {"w2"}


def test_semi_auto_gradients_mean_divides_mirrored_gradients(tmp_path) -> None:
    program = compile_model(sgd_model(tmp_path, extra=", gradients_mean=True"), devices=8,
                            dump=False)
    mirrors = {n.attrs["parameter"]: n for n in program.rank_graph(0).nodes
               if n.op == "_MirrorOperator"}
    assert mirrors["w"].attrs["mean_flag"] is True and mirrors["w"].attrs["dev_num"] == 2
    par, one = one_step_deltas(program)
    assert_delta_close(program, par["w"], one["w"] / 2, "w")
    assert_delta_close(program, par["w2"], one["w2"] / mirrors["w2"].attrs["dev_num"], "w2")


def test_semi_auto_without_loss_repeated_mean_counts_every_copy(tmp_path) -> None:
    program = compile_model(sgd_model(tmp_path, extra=", loss_repeated_mean=False"),
                            devices=8, dump=False)
    assert not any(n.op == "_VirtualDiv" for n in program.rank_graph(0).nodes)
    par, one = one_step_deltas(program)
    for name in par:
        assert_delta_close(program, par[name], 8 * one[name], name)
    default = compile_model(sgd_model(tmp_path), devices=8, dump=False)
    assert any(n.op == "_VirtualDiv" for n in default.rank_graph(0).nodes)
    assert check(default).ok()


def fp16_model(tmp_path, sync: bool) -> str:
    path = tmp_path / f"fp16_{sync}.py"
    path.write_text(f"""
import numpy as np
from pcompile import Parameter, initializer, nn, ops, set_auto_parallel_context, float16
set_auto_parallel_context(parallel_mode="semi_auto_parallel", gradient_fp32_sync={sync})

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(initializer("normal", [32, 16]), "w")
        self.cast = ops.Cast()
        self.cast_back = ops.Cast()
        self.matmul = ops.MatMul()

    def construct(self, x):
        w = self.cast(self.w, float16)
        return self.cast_back(self.matmul(x, w), np.float32)

def model():
    return Net()

def inputs():
    return (np.ones((16, 32), np.float16),)

def labels():
    return (np.ones((16, 16), np.float32),)

def loss():
    return nn.MSELoss()

def optimizer(params):
    return nn.SGD(params, 0.1)
""")
    return str(path)


@pytest.mark.parametrize("sync", [True, False])
def test_gradient_fp32_sync_places_the_mirror(tmp_path, sync) -> None:
    program = compile_model(fp16_model(tmp_path, sync), devices=8, dump=False)
    nodes = program.rank_graph(0).nodes
    mirror = next(n for n in nodes if n.op == "_MirrorOperator")
    cast = next(n for n in nodes if n.instance_name == "cast")
    if sync:
        assert mirror.operands[0].name == "w" and cast.operands[0] is mirror.result
        assert mirror.result.dtype.value == "Float32"
    else:
        assert mirror.operands[0] is cast.result and mirror.result.dtype.value == "Float16"
    grad_reduce = next(n for n in nodes if n.op == "AllReduce"
                       and n.scope.startswith("Gradients")
                       and n.attrs["rank_list"] == mirror.attrs["rank_list"]
                       and n.result.shape == mirror.result.shape)
    assert grad_reduce.result.dtype.value == ("Float32" if sync else "Float16")


def test_cross_batch_skips_the_forward_allreduce(tmp_path) -> None:
    path = tmp_path / "cb.py"
    path.write_text("""
import numpy as np
from pcompile import nn, ops, set_auto_parallel_context
set_auto_parallel_context(parallel_mode="semi_auto_parallel")

class Net(nn.Cell):
    def __init__(self, cross):
        super().__init__()
        self.mean = ops.ReduceMean(keep_dims=False).shard(((8, 1),))
        if cross:
            self.mean.add_prim_attr("cross_batch", True)

    def construct(self, x):
        return self.mean(x, 0)

CROSS = False
def model():
    return Net(CROSS)

def inputs():
    return (np.arange(64, dtype=np.float32).reshape(16, 4),)
""")
    plain = compile_model(str(path), devices=8, dump=False)
    assert [n.op for n in plain.rank_graph(0).nodes] == ["ReduceMean", "AllReduce", "RealDiv"]
    assert check(plain).ok()
    path.write_text(path.read_text().replace("CROSS = False", "CROSS = True"))
    cross = compile_model(str(path), devices=8, dump=False)
    assert [n.op for n in cross.rank_graph(0).nodes] == ["ReduceMean"]


def test_parameter_broadcast_copies_rank0_replicated_parameters(tmp_path) -> None:
    for flag in (False, True):
        program = compile_model(sgd_model(tmp_path, extra=f", parameter_broadcast={flag}"),
                                devices=8, dump=False)
        # Ranks that initialise a replicated parameter differently (as MindSpore processes
        # seeded apart do): rank 3's w2 is off by one before the broadcast.
        values = program.state.rank_values

        def perturbed(rank: int, values=values) -> dict:
            out = dict(values(rank))
            if rank == 3:
                out["w2"] = out["w2"] + 1.0
            return out

        program.state.rank_values = perturbed
        runner = ParallelRunner(program)
        same = np.array_equal(runner.values[3]["w2"], runner.values[0]["w2"])
        assert same is flag
