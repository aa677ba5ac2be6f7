"""`Cell.recompute()` and `Primitive.recompute()`: which nodes are marked (MindSpore: every
primitive of the cell except its outputs; a primitive's own setting wins), the `recompute`
pass (the backward pass reads recomputed copies, never the forward values they repeat), the
same training as without recompute (8 devices against one; numpy against JAX), and the
compiled JAX step keeping less memory."""

from __future__ import annotations

import os
import textwrap
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.ir.core import NodeResult
from pcompile.passes.recompute import is_backward, recomputable
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL, check, relative_error
from pcompile.tools.runners import StandAloneRunner

MODEL = """
import numpy as np
from pcompile import nn, ops, Parameter, initializer, set_seed, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = Parameter(initializer("xavier_uniform", [16, 64]))
        self.w2 = Parameter(initializer("xavier_uniform", [64, 16]))
        self.up = ops.MatMul().shard(((2, 1), (1, 4)))
        self.act = ops.GeLU().shard(((2, 4),))
        self.down = ops.MatMul().shard(((2, 4), (4, 1)))
        self.add = ops.Add().shard(((2, 1), (2, 1)))

    def construct(self, x):
        return self.add(x, self.down(self.act(self.up(x, self.w1)), self.w2))


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(2)
        self.blocks = nn.CellList([Block() for _ in range({layers})])
        {mark}
        self.loss = nn.MSELoss()

    def construct(self, x, y):
        for block in self.blocks:
            x = block(x)
        return self.loss(x, y)


def model():
    return Net()


def inputs():
    rng = np.random.default_rng(0)
    return (rng.standard_normal(({batch}, 16)).astype(np.float32),
            rng.standard_normal(({batch}, 16)).astype(np.float32))


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""

FULL = "for b in self.blocks:\n            b.recompute()"
SELECTIVE = "for b in self.blocks:\n            b.act.recompute()"


def write(tmp_path: Any, mark: str, name: str, layers: int = 2, batch: int = 16) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(MODEL.format(mark=mark or "pass", layers=layers,
                                                 batch=batch)))
    return str(path)


def marks(program: Any) -> dict[str, bool]:
    return {f"{n.scope.rsplit('/', 1)[-1]}/{n.instance_name}": n.attrs.get("recompute") is True
            for n in program.graph.nodes if n.instance_name in ("up", "act", "down", "add")}


def test_cell_recompute_marks_everything_but_the_outputs(tmp_path: Any) -> None:
    program = compile_model(write(tmp_path, FULL, "full.py"), devices=8, dump=False)
    for name, marked in marks(program).items():
        assert marked == (not name.endswith("/add")), name  # the block's output is kept
    selective = compile_model(write(tmp_path, SELECTIVE, "sel.py"), devices=8, dump=False)
    assert {k for k, v in marks(selective).items() if v} == {"0-Block/act", "1-Block/act"}


def test_a_primitive_setting_wins_inside_a_recomputed_cell(tmp_path: Any) -> None:
    mark = FULL + "\n        self.blocks[0].up.recompute(False)"
    program = compile_model(write(tmp_path, mark, "m.py"), devices=8, dump=False)
    got = marks(program)
    assert got["0-Block/up"] is False and got["1-Block/up"] is True and got["0-Block/act"]


def test_nested_cells_recompute_their_outputs_too(tmp_path: Any) -> None:
    """recompute() on the whole stack: each block's output is inside the stack, so only the
    stack's own output (the loss) is kept."""
    mark = "self.blocks.recompute()"
    program = compile_model(write(tmp_path, mark, "m.py"), devices=1, dump=False)
    assert all(marks(program).values())


@pytest.mark.parametrize("mark", [FULL, SELECTIVE])
def test_backward_reads_recomputed_copies_and_trains_like_one_device(
        tmp_path: Any, mark: str) -> None:
    path = write(tmp_path, mark, "m.py")
    program = compile_model(path, devices=8, out_dir=str(tmp_path / "out"))
    assert "recompute" in [name for name, _ in program.timings]
    graph = program.rank_graph(0)
    copies = [n for n in graph.nodes if n.attrs.get("duplicated")]
    assert copies and all(n.attrs.get("recompute") or n.op == "TupleGetItem" for n in copies)
    for node in graph.nodes:
        if is_backward(node):
            for value in node.operands:
                assert not (isinstance(value, NodeResult) and recomputable(value.node)), node
    assert [f for f in sorted(os.listdir(tmp_path / "out" / "rank_0")) if "recompute" in f] == [
        "04_recompute.ir"]
    text = (tmp_path / "out" / "rank_0" / "04_recompute.ir").read_text()
    assert "duplicated: true" in text and "recompute_depend" in text
    assert check(program, steps=2).ok()


def test_recompute_computes_the_same_step(tmp_path: Any) -> None:
    """The same values as without recompute (numpy, float64), and JAX equals numpy."""
    from pcompile.backends.jax import lower_graph
    from pcompile.backends.jax.lowering import x64

    plain = compile_model(write(tmp_path, "", "plain.py"), devices=1, dump=False)
    full = compile_model(write(tmp_path, FULL, "full.py"), devices=1, dump=False)
    _, _, arrays = next(batches(plain, 1))
    a = StandAloneRunner(plain, "numpy", float64=True)
    b = StandAloneRunner(full, "numpy", float64=True)
    assert a.step(arrays) == b.step(arrays)
    for name in a.values:
        assert np.array_equal(a.values[name], b.values[name]), name
    import jax

    graph = full.rank_graphs[0]
    feeds = list(arrays) + [np.asarray(full.initial_values[p.name], np.float64)
                            for p in graph.params[len(graph.inputs):]]
    want = StandAloneRunner(full, "numpy", float64=True).run(arrays)
    with x64():
        got = jax.jit(lower_graph(graph, float64=True))(*feeds)
    for g, w in zip(got, want):
        assert relative_error(np.asarray(g), w) <= FLOAT64_RTOL


def test_the_compiled_step_keeps_less_memory(tmp_path: Any) -> None:
    """XLA's temporary buffers of the jitted step: without recompute every block's activations
    (batch 512: two 512 x 64 float32 values per block) live until the backward pass; with
    it only the blocks' inputs do, so the step needs less, and the recomputed MatMuls are not
    merged back into the forward ones."""
    import jax

    from pcompile.backends.jax import lower_graph

    sizes = {}
    for name, mark in (("plain", ""), ("full", FULL)):
        program = compile_model(write(tmp_path, mark, f"{name}.py", layers=4, batch=512),
                                devices=1, dump=False)
        graph = program.rank_graphs[0]
        specs = [jax.ShapeDtypeStruct(p.shape, p.dtype.np) for p in graph.params]
        compiled = jax.jit(lower_graph(graph)).lower(*specs).compile()
        sizes[name] = (compiled.memory_analysis().temp_size_in_bytes,
                       compiled.as_text().count(" dot("))
    assert sizes["full"][0] < sizes["plain"][0]
    assert sizes["full"][1] > sizes["plain"][1]


def test_recompute_in_the_loss_cell_form(tmp_path: Any) -> None:
    source = textwrap.dedent(MODEL.format(mark=FULL, layers=2, batch=16))
    source = source.replace("        return self.loss(x, y)", "        return x")
    source = source.replace("    def construct(self, x, y):", "    def construct(self, x):")
    source = source.replace("            rng.standard_normal((16, 16)).astype(np.float32))",
                            ")\n\n\ndef labels():\n    return (np.zeros((16, 16), np.float32),)"
                            "\n\n\ndef loss():\n    return nn.MSELoss()")
    path = tmp_path / "loss_form.py"
    path.write_text(source)
    program = compile_model(str(path), devices=8, dump=False)
    names = [name for name, _ in program.timings]
    assert names.index("autodiff") < names.index("recompute") < names.index("optimizer")
    assert check(program, steps=2).ok()


def test_bad_arguments() -> None:
    from pcompile import nn, ops

    with pytest.raises(TypeError, match="mode must be a bool"):
        ops.MatMul().recompute(1)
    with pytest.raises(TypeError, match="unexpected keyword"):
        nn.Dense(2, 2).recompute(bogus=True)
    nn.Dense(2, 2).recompute(mp_comm_recompute=False)
