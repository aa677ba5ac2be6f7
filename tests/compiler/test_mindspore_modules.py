"""MindSpore's module paths (`from mindspore.ops import operations as P`, `import
mindspore.common.dtype as mstype`, `from mindspore.parallel._utils import _get_parallel_mode`,
...) spelled `pcompile...`: each resolves to the façade's own object, so model code written for
MindSpore needs only its imports changed; and the small MindSpore APIs such code calls
(`F.dtype`, `F.tuple_to_array`, `@constexpr`, `Cell.cls_name`, `Cell.add_flags`, a primitive
that is built but not implemented)."""

from __future__ import annotations

import importlib
import textwrap

import numpy as np
import pytest

import pcompile
from pcompile import nn, ops
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check


@pytest.mark.parametrize("module, name, expected", [
    ("pcompile.ops.operations", "MatMul", lambda: ops.MatMul),
    ("pcompile.ops.operations.nn_ops", "FlashAttentionScore", lambda: ops.FlashAttentionScore),
    ("pcompile.ops.operations._inner_ops", "SiLU", lambda: ops.SiLU),
    ("pcompile.ops.operations._sequence_ops", "TensorToScalar", lambda: ops.TensorToScalar),
    ("pcompile.communication.management", "get_group_size",
     lambda: pcompile.communication.get_group_size),
    ("pcompile.ops.functional", "cast", lambda: ops.cast),
    ("pcompile.common.dtype", "bfloat16", lambda: pcompile.bfloat16),
    ("pcompile.common.tensor", "Tensor", lambda: pcompile.Tensor),
    ("pcompile.common.parameter", "Parameter", lambda: pcompile.Parameter),
    ("pcompile.context", "ParallelMode", lambda: pcompile.ParallelMode),
    ("pcompile.parallel", "set_algo_parameters", lambda: pcompile.set_algo_parameters),
    ("pcompile.parallel.shard", "Layout", lambda: pcompile.Layout),
    ("pcompile.nn.layer", "Dense", lambda: nn.Dense),
    ("pcompile.nn.cell", "Cell", lambda: nn.Cell),
])
def test_a_mindspore_module_path_gives_the_facade_object(module, name, expected) -> None:
    assert getattr(importlib.import_module(module), name) is expected()


def test_from_import_spellings_and_attribute_chains() -> None:
    namespace: dict = {}
    exec("from pcompile.ops import operations as P\n"
         "from pcompile.ops import functional as F\n"
         "from pcompile.ops.primitive import constexpr\n"
         "import pcompile.common.dtype as mstype\n", namespace)
    assert namespace["P"]._inner_ops.SiLU is ops.SiLU  # MindSpore's P._inner_ops.SiLU()
    assert namespace["F"].zeros_like is ops.zeros_like
    assert namespace["mstype"].float32 in namespace["mstype"].number_type
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pcompile.ops.no_such_module")


def test_the_parallel_utils_read_the_context() -> None:
    from pcompile.parallel._utils import (
        _get_device_num,
        _get_parallel_mode,
        _get_pipeline_stages,
        _is_sharding_propagation,
    )

    pcompile.reset_auto_parallel_context()
    try:
        assert _get_parallel_mode() == pcompile.ParallelMode.STAND_ALONE
        pcompile.set_auto_parallel_context(parallel_mode="auto_parallel", device_num=8,
                                           search_mode="sharding_propagation",
                                           pipeline_stages=2)
        assert _get_parallel_mode() == pcompile.ParallelMode.AUTO_PARALLEL
        assert _is_sharding_propagation()
        assert (_get_device_num(), _get_pipeline_stages()) == (8, 2)
        pcompile.set_auto_parallel_context(search_mode="recursive_programming")
        assert not _is_sharding_propagation()
    finally:
        pcompile.reset_auto_parallel_context()


def test_functional_dtype_and_tuple_to_array() -> None:
    from pcompile.ops import functional

    assert functional.dtype(pcompile.Tensor(np.zeros(2, np.float16))) is pcompile.float16
    floats = functional.tuple_to_array((1e-8, 2))
    assert floats.dtype is pcompile.float32 and floats.shape == (2,)
    np.testing.assert_array_equal(floats.asnumpy(), np.float32([1e-8, 2]))
    assert functional.tuple_to_array((3, 4)).dtype is pcompile.int64
    for bad in ((), (1.0, "a"), 1.0):
        with pytest.raises(TypeError, match="tuple_to_array takes a non-empty tuple of numbers"):
            functional.tuple_to_array(bad)


def test_constexpr_returns_the_function_in_both_forms() -> None:
    def twice(x):
        return 2 * x

    assert ops.constexpr(twice) is twice
    assert ops.constexpr(reuse_result=False)(twice) is twice


def test_cell_cls_name_and_flags() -> None:
    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = nn.Dense(2, 2)

    block = Block()
    assert block.cls_name == "Block" and block.inner.cls_name == "Dense"
    block.add_flags(is_first_iteration=False)
    assert block.is_first_iteration is False and not hasattr(block.inner, "is_first_iteration")
    block.add_flags_recursive(use_past=True)
    assert block.use_past is True and block.inner.use_past is True


MODEL = textwrap.dedent('''
    import numpy as np
    from pcompile import nn, Parameter, set_auto_parallel_context
    from pcompile.ops import operations as P
    from pcompile.ops import functional as F
    import pcompile.common.dtype as mstype
    from pcompile.common.initializer import initializer
    from pcompile.context import ParallelMode
    from pcompile.parallel._utils import _get_parallel_mode

    set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4)


    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = Parameter(initializer("normal", (8, 16), mstype.float32), name="w")
            self.matmul = P.MatMul()
            self.unused = P.GatherD()  # built, never called: compiles
            # built by mindformers' TopkRouterV2 for paths a training step does not take
            self.argmax = P.ArgMaxWithValue(axis=-1, keep_dims=False).shard(((2, 1),))
            self.print = P.Print()
            self.tensor2scalar = P.TensorToScalar()
            self.semi = _get_parallel_mode() == ParallelMode.SEMI_AUTO_PARALLEL
            if self.semi:
                self.matmul.shard(((2, 1), (1, 2)))

        def construct(self, x):
            out = self.matmul(F.cast(x, mstype.float32), self.weight)
            CALL_GATHER_D
            return out * F.tuple_to_array((2.0,))


    def model():
        return Net()


    def inputs():
        return (np.ones((4, 8), np.float32),)
''')


def test_a_model_in_mindspore_spelling_compiles_and_checks(tmp_path) -> None:
    path = tmp_path / "ms_spelling.py"
    path.write_text(MODEL.replace("CALL_GATHER_D", "pass"))
    program = compile_model(str(path), devices=4, dump=False)
    report = check(program)
    assert report.ok(), report
    matmul = next(n for n in program.state.rank_graphs[0].nodes if n.op == "MatMul")
    assert matmul.result.type.shape == (2, 8)  # the ((2, 1), (1, 2)) split: the mode was read


@pytest.mark.parametrize("call, named", [
    ("out = self.unused(out, 1, out)", "GatherD 'unused'"),
    ("out = self.argmax(out)[1]", "ArgMaxWithValue 'argmax'"),
    ("self.print('x', out)", "Print 'print'"),
    ("out = out * self.tensor2scalar(out)", "TensorToScalar 'tensor2scalar'"),
])
def test_calling_an_unimplemented_primitive_is_one_message(tmp_path, call, named) -> None:
    path = tmp_path / "ms_unimplemented.py"
    path.write_text(MODEL.replace("CALL_GATHER_D", call))
    with pytest.raises(PcompileError) as info:
        compile_model(str(path), devices=4, dump=False)
    message = str(info.value)
    for part in (named, "pcompile has no rules for this MindSpore primitive",
                 "ms_unimplemented.py:", "docs/ops.md"):
        assert part in message, (part, message)
