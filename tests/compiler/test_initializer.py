"""`initializer`: reproducibility, laziness, statistics, dtypes and errors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.frontend.initializer import (
    Constant,
    HeUniform,
    InitializedData,
    Normal,
    One,
    TruncatedNormal,
    Uniform,
    XavierUniform,
    Zero,
    get_seed,
    initializer,
    set_seed,
)
from pcompile.ir.types import DType


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    set_seed(1)
    yield
    set_seed(1)


def test_default_seed_is_one() -> None:
    assert get_seed() == 1
    set_seed(7)
    assert get_seed() == 7


def test_same_seed_same_arrays() -> None:
    set_seed(3)
    first = [initializer("normal", [8, 4]).asnumpy(), initializer("uniform", [5]).asnumpy()]
    set_seed(3)
    second = [initializer("normal", [8, 4]).asnumpy(), initializer("uniform", [5]).asnumpy()]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_counter_and_seed_change_values() -> None:
    a = initializer("normal", [16]).asnumpy()
    b = initializer("normal", [16]).asnumpy()  # next counter value
    assert not np.array_equal(a, b)
    set_seed(2)
    c = initializer("normal", [16]).asnumpy()
    assert not np.array_equal(a, c)


def test_values_fixed_at_call_time_not_materialisation_time() -> None:
    x = initializer("normal", [4, 4])
    y = initializer("normal", [4, 4])
    late_y = y.asnumpy()
    set_seed(99)
    initializer("normal", [4, 4]).asnumpy()
    np.testing.assert_array_equal(x.asnumpy(), x.asnumpy())
    np.testing.assert_array_equal(np.asarray(y), late_y)
    set_seed(1)
    np.testing.assert_array_equal(initializer("normal", [4, 4]).init_data(), x.to_numpy())


def test_constant_inits_take_no_ticket() -> None:
    a = initializer("normal", [4])
    set_seed(1)
    initializer("zeros", [4])
    initializer(0.5, [4])
    b = initializer("normal", [4])
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_lazy_object_interface() -> None:
    x = initializer("normal", [784, 512], DType.float32)
    assert isinstance(x, InitializedData)
    assert x.shape == (784, 512) and x.dtype is DType.float32
    assert x.ndim == 2 and x.size == 784 * 512 and x.nbytes == 784 * 512 * 4 and len(x) == 784
    arr = np.asarray(x)
    assert arr.dtype == np.float32 and arr.shape == (784, 512)
    assert "Normal" in repr(x)


@pytest.mark.parametrize(
    ("dtype", "np_dtype"),
    [
        (DType.float32, np.float32),
        (DType.float16, np.float16),
        ("float16", np.float16),
        (np.float32, np.float32),
        (np.dtype(np.int32), np.int32),
        (DType.bfloat16, DType.bfloat16.np),
    ],
)
def test_dtypes(dtype: object, np_dtype: object) -> None:
    arr = initializer("ones", [2, 3], dtype).asnumpy()
    assert arr.dtype == np.dtype(np_dtype)  # type: ignore[call-overload]
    assert (arr.astype(np.float32) == 1).all()


def test_bad_dtype() -> None:
    with pytest.raises(TypeError):
        initializer("ones", [2], "complex64")


def test_normal_statistics() -> None:
    arr = initializer("normal", [200, 500]).asnumpy().astype(np.float64)
    assert abs(arr.mean()) < 2e-4
    assert abs(arr.std() - 0.01) < 2e-4
    arr = initializer(Normal(sigma=0.5, mean=2.0), [100_000]).asnumpy().astype(np.float64)
    assert abs(arr.mean() - 2.0) < 0.01 and abs(arr.std() - 0.5) < 0.01


def test_uniform_statistics() -> None:
    arr = initializer("uniform", [100_000]).asnumpy()
    assert arr.min() >= -0.07 and arr.max() <= 0.07
    assert abs(arr.std() - 0.07 / math.sqrt(3)) < 1e-3
    arr = initializer(Uniform(scale=2.0), [1000]).asnumpy()
    assert arr.min() >= -2 and arr.max() <= 2 and arr.max() > 1.5


def test_xavier_and_he_bounds() -> None:
    arr = initializer("xavier_uniform", [64, 32]).asnumpy()
    bound = math.sqrt(6 / (64 + 32))
    assert np.abs(arr).max() <= bound and np.abs(arr).max() > 0.9 * bound
    arr = initializer(XavierUniform(gain=2.0), [8, 4, 3, 3]).asnumpy()
    bound = 2.0 * math.sqrt(6 / (4 * 9 + 8 * 9))
    assert np.abs(arr).max() <= bound and np.abs(arr).max() > 0.8 * bound
    arr = initializer("he_uniform", [64, 32]).asnumpy()
    bound = math.sqrt(2.0) * math.sqrt(3 / 32)
    assert np.abs(arr).max() <= bound and np.abs(arr).max() > 0.9 * bound
    arr = initializer(HeUniform(mode="fan_out"), [64, 32]).asnumpy()
    assert np.abs(arr).max() <= math.sqrt(6 / 64)
    with pytest.raises(ValueError, match="2 dimensions"):
        initializer("xavier_uniform", [16])


def test_truncated_normal() -> None:
    arr = initializer("truncatednormal", [100_000]).asnumpy().astype(np.float64)
    assert abs(arr.std() - 0.01) < 5e-4
    arr = initializer(TruncatedNormal(sigma=1.0, a=-1.0, b=1.0), [50_000]).asnumpy()
    assert arr.min() >= -1.0 and arr.max() <= 1.0
    assert 0.5 < arr.std() < 0.6  # std of N(0,1) truncated to [-1, 1] is about 0.54
    with pytest.raises(ValueError):
        TruncatedNormal(sigma=0.01, a=1.0, b=2.0)  # no mass there
    with pytest.raises(ValueError):
        TruncatedNormal(a=1.0, b=-1.0)


@pytest.mark.parametrize(
    ("init", "value"),
    [
        ("zeros", 0),
        ("zero", 0),
        ("ones", 1),
        ("One", 1),
        (Zero(), 0),
        (One(), 1),
        (3, 3),
        (2.5, 2.5),
        (Constant(-1), -1),
        (Zero, 0),
    ],
)
def test_constants(init: object, value: float) -> None:
    arr = initializer(init, (3, 2)).asnumpy()
    assert arr.shape == (3, 2) and (arr == value).all()


def test_names_are_case_insensitive_and_int_shape() -> None:
    assert initializer("Normal", 5).shape == (5,)
    assert initializer("XAVIER_UNIFORM", [4, 4]).shape == (4, 4)


def test_array_init() -> None:
    data = np.arange(6, dtype=np.float64).reshape(2, 3)
    x = initializer(data, [2, 3])
    data[0, 0] = 100  # the initializer keeps its own copy
    arr = x.asnumpy()
    assert arr.dtype == np.float32 and arr[0, 0] == 0 and arr[1, 2] == 5
    assert initializer(data).shape == (2, 3)
    with pytest.raises(ValueError, match="shape"):
        initializer(data, [3, 2])


@pytest.mark.parametrize(
    ("init", "shape", "exc", "match"),
    [
        ("norml", [2], ValueError, "normal, zeros, ones"),
        ("normal", None, ValueError, "shape"),
        ("normal", [2, 0], ValueError, "> 0"),
        ("normal", [2, -1], ValueError, "> 0"),
        ("normal", [2.0], TypeError, "ints"),
        ("normal", "2", TypeError, "shape"),
        (object(), [2], TypeError, "init"),
        ([1, 2], [2], TypeError, "init"),
    ],
)
def test_errors(init: object, shape: object, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        initializer(init, shape)  # type: ignore[arg-type]


def test_initializer_object_validation() -> None:
    with pytest.raises(ValueError):
        Normal(sigma=0)
    with pytest.raises(TypeError):
        Uniform(scale="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        HeUniform(mode="fan")
    assert Normal(0.02) == Normal(sigma=0.02) and Normal(0.02) != Normal(0.03)


def test_set_seed_validation() -> None:
    with pytest.raises(TypeError):
        set_seed("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        set_seed(-1)


@pytest.mark.parametrize("init", ["normal", "uniform", "xavier_uniform", "he_uniform",
                                  "truncatednormal", "ones", 0.5])
def test_any_block_equals_the_same_block_of_the_whole(init: object) -> None:
    """Each rank materialises only its slice: generating a block on its own gives exactly the
    block of the whole tensor (counter-based generator), for every split of every dim."""
    data = initializer(init, [12, 10, 6], DType.float32)
    whole = data.asnumpy()
    for bounds in [((0, 12), (0, 10), (0, 6)), ((3, 6), (0, 10), (0, 6)),
                   ((0, 12), (5, 10), (0, 6)), ((4, 8), (2, 7), (3, 6)),
                   ((11, 12), (9, 10), (5, 6))]:
        block = data.block(bounds)
        np.testing.assert_array_equal(block, whole[tuple(slice(lo, hi) for lo, hi in bounds)])
    with pytest.raises(ValueError, match="outside"):
        data.block(((0, 13), (0, 10), (0, 6)))


def test_a_block_does_not_allocate_the_whole_tensor() -> None:
    """A 1 GB parameter: one 1/256 block is generated in memory proportional to the block (the
    generator works in chunks of 2^19 elements with ~20 8-byte temporaries each, ~100 MB at
    most), never the whole tensor."""
    import tracemalloc

    data = initializer("normal", [16384, 16384], DType.float32)
    tracemalloc.start()
    try:
        block = data.block(((0, 1024), (1024, 2048)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert block.shape == (1024, 1024)
    assert peak < 0.15 * data.nbytes, f"peak {peak} bytes for a {data.nbytes}-byte tensor"


def test_mindspore_common_initializer_spelling() -> None:
    """`from pcompile.common.initializer import Normal, initializer` (MindSpore's
    `mindspore.common.initializer`) gives the same classes and function, so the values are
    those of `pcompile.initializer`."""
    import importlib
    import sys

    import pcompile.common

    module = importlib.import_module("pcompile.common.initializer")
    assert module is sys.modules["pcompile.compiler.frontend.initializer"]
    assert pcompile.common.initializer is module
    ours = {"Normal": Normal, "Uniform": Uniform, "TruncatedNormal": TruncatedNormal,
            "Zero": Zero, "One": One, "Constant": Constant, "XavierUniform": XavierUniform,
            "HeUniform": HeUniform, "initializer": initializer}
    namespace: dict[str, object] = {}
    exec(f"from pcompile.common.initializer import {', '.join(ours)}, Initializer", namespace)
    for name, value in ours.items():
        assert namespace[name] is value, name
    assert issubclass(Normal, namespace["Initializer"])  # type: ignore[arg-type]
    set_seed(5)
    make: Any = namespace["initializer"]
    spelled = make(namespace["Normal"](0.02), [4, 3], DType.float32)  # type: ignore[operator]
    set_seed(5)
    np.testing.assert_array_equal(spelled.asnumpy(),
                                  initializer(Normal(0.02), [4, 3], DType.float32).asnumpy())
