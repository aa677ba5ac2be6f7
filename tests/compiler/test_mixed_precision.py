"""Mixed precision, MindSpore-style: `Cell.to_float(dtype)` and `amp.auto_mixed_precision`
(O0-O3) put Casts into the traced graph where MindSpore puts them (visible in the dumps), keep
float32 master weights and optimizer state, pass the float64 oracle check of a parallel plan,
and train the GPT example in bfloat16 close to its float32 training."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.ir.types import DType
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT

GPT = open(os.path.join(ROOT, "examples", "gpt_block.py"), encoding="utf-8").read()

WRAPPERS = {
    "to_float": "return _base_model().to_float(bfloat16)",
    "O0": 'return amp.auto_mixed_precision(_base_model(), "O0", bfloat16)',
    "O1": 'return amp.auto_mixed_precision(_base_model(), "O1", bfloat16)',
    "O2": 'return amp.auto_mixed_precision(_base_model(), "O2", bfloat16)',
    "O3": 'return amp.auto_mixed_precision(_base_model(), "O3", bfloat16)',
    "O2_fp16": 'return amp.auto_mixed_precision(_base_model(), "O2", float16)',
}


def gpt_file(tmp_path, how: str) -> str:
    """The GPT example (1 layer) with its network converted by `how`."""
    text = (GPT + "\n\nfrom pcompile import amp, bfloat16, float16\n\n_base_model = model\n\n\n"
            f"def model():\n    {WRAPPERS[how]}\n")
    path = tmp_path / f"gpt_{how}.py"
    path.write_text(text)
    return str(path)


@pytest.fixture(autouse=True)
def one_layer(monkeypatch) -> None:
    monkeypatch.setenv("GPT_LAYERS", "1")


def _operand_dtypes(graph, op: str, scope: str = "") -> list[list[DType]]:
    return [[v.type.dtype for v in n.operands if hasattr(v.type, "dtype")]
            for n in graph.nodes if n.op == op and scope in n.scope]


def _casts(graph) -> list:
    return [n for n in graph.nodes if n.op == "Cast"]


def test_to_float_casts_every_float_operand_and_keeps_master_weights(tmp_path) -> None:
    program = compile_model(gpt_file(tmp_path, "to_float"), devices=1,
                            out_dir=str(tmp_path / "out"))
    graph = program.traced.graph
    for op in ("MatMul", "BatchMatMul", "Add", "LayerNorm", "Gather"):
        for dtypes in _operand_dtypes(graph, op, "_backbone-GPT"):  # the network, not the loss
            assert all(d == DType.bfloat16 for d in dtypes if d.is_float), (op, dtypes)
    # parameters and optimizer state stay float32; each use of a weight is a Cast
    weights = [p for p in program.graph.params if p.kind != "input"]
    assert weights and all(p.type.dtype == DType.float32 for p in weights)
    cast_params = {n.operands[0].name for n in _casts(graph)
                   if n.attrs.get("dst_type") == DType.bfloat16
                   and getattr(n.operands[0], "kind", None) == "weight"}
    assert cast_params == {p.name for p in graph.params if p.kind == "weight"}
    dump = (tmp_path / "out" / "rank_0" / "00_trace.ir").read_text()
    assert "Cast(%para" in dump and "dst_type: BFloat16" in dump


def test_amp_levels_place_casts_like_mindspore(tmp_path) -> None:
    graphs = {lvl: compile_model(gpt_file(tmp_path, lvl), devices=1, dump=False).traced.graph
              for lvl in ("O0", "O1", "O2", "O3")}
    assert not _casts(graphs["O0"])
    # O1: the white list (MatMul, BatchMatMul, Dense) computes in bfloat16, the rest float32
    o1 = graphs["O1"]
    for op in ("MatMul", "BatchMatMul"):
        assert all(d == DType.bfloat16 for ds in _operand_dtypes(o1, op) for d in ds)
    assert all(d == DType.float32 for ds in _operand_dtypes(o1, "LayerNorm") for d in ds)
    assert all(d == DType.float32 for ds in _operand_dtypes(o1, "Softmax") for d in ds)
    # O2: everything in bfloat16 but the black list (LayerNorm keeps float32)
    o2 = graphs["O2"]
    assert all(d == DType.float32 for ds in _operand_dtypes(o2, "LayerNorm") for d in ds)
    assert all(d == DType.bfloat16 for ds in _operand_dtypes(o2, "Softmax") for d in ds)
    # O3: everything in bfloat16
    o3 = graphs["O3"]
    assert all(d == DType.bfloat16 for ds in _operand_dtypes(o3, "LayerNorm") for d in ds)
    # O2 and O3: the network's output is cast back to float32 before the loss
    for lvl in ("O2", "O3"):
        loss_in = _operand_dtypes(graphs[lvl], "SoftmaxCrossEntropyWithLogits") or \
            _operand_dtypes(graphs[lvl], "LogSoftmax")
        assert loss_in and all(ds[0] == DType.float32 for ds in loss_in), (lvl, loss_in)


def test_amp_bad_arguments() -> None:
    from pcompile import amp, nn

    with pytest.raises(ValueError, match="amp_level"):
        amp.auto_mixed_precision(nn.Dense(2, 2), "O4")
    with pytest.raises(ValueError, match="dtype"):
        amp.auto_mixed_precision(nn.Dense(2, 2), "O2", np.int32)
    with pytest.raises(ValueError, match="dst_type"):
        nn.Dense(2, 2).to_float(np.int32)


def test_parallel_plan_with_amp_passes_the_oracle(tmp_path) -> None:
    program = compile_model(gpt_file(tmp_path, "O2"), devices=4,
                            parallel_mode="auto_parallel", search_mode="sharding_propagation",
                            dump=False)
    report = check(program, steps=1)
    assert report.ok(), report.worst


@pytest.mark.slow
@pytest.mark.parametrize("how, dtype", [("O2", "bfloat16"), ("O3", "bfloat16"),
                                        ("O2_fp16", "float16")])
def test_low_precision_training_follows_float32(tmp_path, how, dtype) -> None:
    """20 steps of the GPT example in low precision against float32, from the same initial
    values and batches. Stated tolerance: every loss within eps of the low-precision type
    (bfloat16 2^-7, float16 2^-10) relative to the float32 loss. Why it holds: the master
    weights, the optimizer and (O2/O3) the loss stay float32, so the runs differ by rounding the
    operands of each op to the low type, a relative perturbation of at most eps/2 per operand,
    which the batch-mean cross-entropy averages rather than amplifies over 20 Adam steps (the
    updates are normalised). Measured on this model: 2.2e-4 (O2 bf16), 1.6e-3 (O3 bf16),
    4.7e-5 (O2 fp16)."""
    import ml_dtypes

    eps = float(ml_dtypes.finfo(DType[dtype].np).eps)
    fp32 = compile_model(gpt_file(tmp_path, "O0"), devices=1, dump=False)
    low = compile_model(gpt_file(tmp_path, how), devices=1, dump=False)
    a, b = StandAloneRunner(fp32, "jax"), StandAloneRunner(low, "jax")
    for k, (_, _, arrays) in enumerate(batches(fp32, 20)):
        want, got = a.step(arrays), b.step(arrays)
        assert abs(got - want) <= eps * abs(want), (k + 1, got, want, eps)
    assert all(np.asarray(b.values[p.name]).dtype == np.float32
               for p in low.graph.params if p.kind != "input")


def test_low_precision_graph_numpy_agrees_with_jax(tmp_path) -> None:
    """The check of a bfloat16 program: numpy and JAX in float64 (Casts included)."""
    bf16 = compile_model(gpt_file(tmp_path, "O2"), devices=1, dump=False)
    _, _, arrays = next(batches(bf16, 1))
    n = StandAloneRunner(bf16, "numpy", float64=True).run(arrays)
    j = StandAloneRunner(bf16, "jax", float64=True).run(arrays)
    assert abs(float(n[0]) - float(j[0])) <= 2.0 ** -26 * max(1.0, abs(float(n[0])))


# -- amp.build_train_network: amp_level as MindSpore spells it for training --------------------

BUILD = """\
import numpy as np
from pcompile import amp, nn, ops, Parameter, initializer, set_seed, set_auto_parallel_context
from pcompile import float16, float32

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(3)
        self.w1 = Parameter(initializer("normal", [16, 32]), "w1")
        self.w2 = Parameter(initializer("normal", [32, 16]), "w2")
        self.matmul1 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.matmul2 = ops.MatMul().shard(((2, 4), (4, 1)))
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.w1)), self.w2)


def model():
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    return amp.build_train_network(net, opt, {args})


def dataset():
    rng = np.random.default_rng(0)
    for _ in range(40):
        yield (rng.standard_normal((16, 16)).astype(np.float32),
               rng.standard_normal((16, 16)).astype(np.float32))


def inputs():
    return next(iter(dataset()))
"""


def build_file(tmp_path, args: str, name: str = "build.py") -> str:
    path = tmp_path / name
    path.write_text(BUILD.format(args=args))
    return str(path)


def test_build_train_network_o2_is_float16_with_a_dynamic_loss_scale(tmp_path) -> None:
    """O2 (MindSpore's table): network float16, the loss_fn float32, a
    TrainOneStepWithLossScaleCell with DynamicLossScaleManager()'s cell (2^24, 2, 2000); the
    plan passes the float64 oracle and the dumps show the Casts and the loss scale."""
    out = tmp_path / "out"
    program = compile_model(build_file(tmp_path, 'nn.MSELoss(), level="O2"'), devices=8,
                            out_dir=str(out))
    graph = program.traced.graph
    for dtypes in _operand_dtypes(graph, "MatMul"):
        assert dtypes == [DType.float16, DType.float16]
    # the loss (MSELoss) reads the network's output cast back to float32
    assert all(d == DType.float32 for ds in _operand_dtypes(graph, "Square") for d in ds)
    assert program.output_names[:3] == ["loss", "w1", "w2"]
    assert {"moments.w1", "moments.w2", "scale_sense", "current_iterator_step",
            "last_overflow_iterator_step"} <= set(program.output_names)
    assert float(np.asarray(program.initial_values["scale_sense"])) == 2.0 ** 24
    assert {"current_iterator_step", "last_overflow_iterator_step"} <= set(
        program.initial_values)
    assert_plan_ok(program)
    trace = (out / "rank_0" / "00_trace.ir").read_text()
    assert "dst_type: Float16" in trace and "dst_type: Float32" in trace
    step = next(p for p in sorted((out / "rank_0").iterdir()) if "train_step" in p.name)
    text = step.read_text()
    assert "scale_sense" in text and "current_iterator_step" in text


def assert_plan_ok(program) -> None:
    report = check(program, steps=2)
    assert report.ok(), report.worst


def test_build_train_network_o2_float16_backs_off_like_mindspore(tmp_path) -> None:
    """Run in float16 as compiled: 2^24 times the float16 output gradient (|2 (out - y) / 256|
    of order 1e-2 on these data) exceeds float16's 65504, so the first steps overflow: each is
    skipped (parameters unchanged) and halves the scale, until a scale fits and the step
    updates; the scales follow MindSpore's update rule on the observed overflows."""
    from tests.compiler.test_training_forms import dynamic_scale_reference

    program = compile_model(build_file(tmp_path, 'nn.MSELoss(), level="O2"'), devices=1,
                            dump=False)
    runner = StandAloneRunner(program, "numpy")
    overflows, scales = [], []
    with np.errstate(all="ignore"):
        for _, _, arrays in batches(program, 20):
            before = np.array(runner.values["w1"])
            runner.step(arrays)
            overflow = bool(runner.values["output1"])
            overflows.append(overflow)
            scales.append(float(runner.values["scale_sense"]))
            assert np.array_equal(runner.values["w1"], before) == overflow
    assert overflows[0] and not all(overflows)
    assert scales == dynamic_scale_reference(2.0 ** 24, 2.0, 2000, overflows)
    assert np.asarray(runner.values["w1"]).dtype == np.float32  # master weights


@pytest.mark.parametrize("args, step_cell, low", [
    ('nn.MSELoss(), level="O3"', "TrainOneStepCell", DType.float16),
    ('nn.MSELoss(), level="O0"', "TrainOneStepCell", None),
    ('nn.MSELoss(), level="O2", loss_scale_manager=None', "TrainOneStepCell", DType.float16),
    ('nn.MSELoss(), level="O3", loss_scale_manager=amp.FixedLossScaleManager(1024.0)',
     "TrainOneStepWithLossScaleCell", DType.float16),
    ('nn.MSELoss(), level="O2", cast_model_type=float32', "TrainOneStepWithLossScaleCell",
     None),
])
def test_build_train_network_levels_and_overrides(tmp_path, args, step_cell, low) -> None:
    program = compile_model(build_file(tmp_path, args), devices=8, dump=False)
    assert type(program.state.model_file.model()).__name__ == step_cell
    casts = _casts(program.traced.graph)
    if low is None:
        assert not casts
    else:
        assert all(ds == [low, low] for ds in _operand_dtypes(program.traced.graph, "MatMul"))
    assert ("scale_sense" in program.initial_values) == (step_cell != "TrainOneStepCell")
    assert_plan_ok(program)


def test_build_train_network_bad_arguments() -> None:
    from pcompile import amp, nn

    net = nn.Dense(2, 2)
    opt = nn.SGD(net.trainable_params(), 0.1)
    with pytest.raises(ValueError, match="level"):
        amp.build_train_network(net, opt, level="O4")
    with pytest.raises(ValueError, match="unsupported argument 'dtype'"):
        amp.build_train_network(net, opt, level="O2", dtype="float16")
    with pytest.raises(TypeError, match="optimizer"):
        amp.build_train_network(net, None, level="O2")
    with pytest.raises(TypeError, match="loss_scale_manager"):
        amp.build_train_network(net, opt, level="O2", loss_scale_manager=128.0)
    with pytest.raises(ValueError, match="boost_level"):
        amp.build_train_network(net, opt, level="O2", boost_level="O1")


# -- gradient_fp32_sync: where the gradient mirror sits relative to amp's Casts --------------

@pytest.mark.parametrize("sync", [True, False])
def test_gradient_fp32_sync_places_the_mirror_of_an_amp_network(tmp_path, sync) -> None:
    """MindSpore: the mirror sits next to the float32 parameter (its gradient is all-reduced
    after the Cast's gradient brought it back to float32) unless gradient_fp32_sync=False,
    where it follows the Cast to float16 (a float16 AllReduce, half the bytes). Either way the
    plan computes what one device computes (float64 oracle), and the dumps show it."""
    out = tmp_path / "out"
    program = compile_model(build_file(tmp_path, 'nn.MSELoss(), level="O2"'), devices=8,
                            out_dir=str(out), overrides={"gradient_fp32_sync": sync})
    nodes = program.rank_graph(0).nodes
    mirrors = [n for n in nodes if n.op == "_MirrorOperator"]
    assert sorted(n.attrs["parameter"] for n in mirrors) == ["w1", "w2"]
    low = DType.float16
    for mirror in mirrors:
        (src,) = mirror.operands
        if sync:
            assert getattr(src, "kind", None) == "weight"
            assert mirror.result.dtype == DType.float32
        else:
            assert src.node.op == "Cast" and src.node.attrs["dst_type"] == low
            assert mirror.result.dtype == low
        # the gradients' AllReduce over the mirror's group (fused into one by comm_fusion)
        grads = [n for n in nodes if n.op == "AllReduce" and n.scope.startswith("Gradients")
                 and n.attrs["rank_list"] == mirror.attrs["rank_list"]]
        assert grads and all(g.result.dtype == (DType.float32 if sync else low) for g in grads)
    dump = (out / "rank_0" / "02_step_parallel_end.ir").read_text()
    assert ("_MirrorOperator(%para" in dump) == sync
    assert_plan_ok(program)



@pytest.mark.parametrize("sync, mirrors", [(True, 1), (False, 2)])
def test_gradient_fp32_sync_with_a_weight_used_twice(tmp_path, sync, mirrors) -> None:
    """A weight read by two MatMuls: amp casts each use, so with gradient_fp32_sync=False each
    Cast has its own mirror (two low-precision all-reduces, whose sum is the all-reduce of the
    summed gradient); with True the weight has one mirror. Both pass the float64 oracle."""
    text = BUILD.replace('self.w2 = Parameter(initializer("normal", [32, 16]), "w2")', "")
    text = text.replace('[16, 32]), "w1"', '[16, 16]), "w1"')
    text = text.replace("self.w1)), self.w2)", "self.w1)), self.w1)")
    path = tmp_path / "twice.py"
    path.write_text(text.format(args='nn.MSELoss(), level="O2"'))
    program = compile_model(str(path), devices=8, dump=False,
                            overrides={"gradient_fp32_sync": sync})
    assert len([n for n in program.rank_graph(0).nodes if n.op == "_MirrorOperator"]) == mirrors
    assert_plan_ok(program)

MODEL_FORM = """\
import numpy as np
from pcompile import Model, amp, nn
{net}

def model():
    net = Net()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    return Model(net, nn.MSELoss(), opt, amp_level="O2"{extra})
"""


@pytest.mark.parametrize("extra, scaled", [("", True), (", loss_scale_manager=None", False)])
def test_model_amp_level_builds_the_same_training_step(tmp_path, extra, scaled) -> None:
    """`Model(net, loss_fn, opt, amp_level="O2")` returned by model() compiles the network
    MindSpore's Model trains (amp.build_train_network at that level): the same dumps as
    build_train_network, the oracle check passes."""
    net = BUILD.split("def model")[0]
    data = "def dataset" + BUILD.split("def dataset")[1]
    path = tmp_path / "model_form.py"
    path.write_text(MODEL_FORM.format(net=net, extra=extra) + "\n\n" + data)
    program = compile_model(str(path), devices=8, out_dir=str(tmp_path / "a"))
    compile_model(build_file(tmp_path, 'nn.MSELoss(), level="O2"' + extra), devices=8,
                  out_dir=str(tmp_path / "b"))
    assert ("scale_sense" in program.initial_values) == scaled
    for name in ("00_trace.ir", "03_train_step.ir"):
        a = (tmp_path / "a" / "rank_0" / name).read_text()
        b = (tmp_path / "b" / "rank_0" / name).read_text()
        # the dumps name their model file (source lines): compare the graphs, not the paths
        strip = re.compile(r"# In file .*")
        assert strip.sub("", a) == strip.sub("", b), name
    assert_plan_ok(program)


def test_model_bad_arguments() -> None:
    from pcompile import Model, nn
    from pcompile.ir.errors import PcompileError

    net = nn.Dense(2, 2)
    with pytest.raises(ValueError, match="needs an optimizer"):
        Model(net, nn.MSELoss(), amp_level="O2")
    with pytest.raises(ValueError, match="unsupported argument 'acc_level'"):
        Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.1), acc_level="O1")
    with pytest.raises(PcompileError, match="--run"):
        Model(net).train(1, None)
    assert Model(net).train_network is net
