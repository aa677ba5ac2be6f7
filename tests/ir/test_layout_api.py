"""`Layout`: the examples of reference §1.4 and the validation errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pcompile.compiler.config.layout import Layout, LayoutSpec


def test_reference_to_dict_example() -> None:
    got = Layout((2, 2, 2), ("dp", "sp", "mp"))("dp", "mp").to_dict()
    assert got == {
        "device_matrix": (2, 2, 2),
        "tensor_map": (2, 0),
        "interleaved_parallel": False,
        "alias_name": ("dp", "sp", "mp"),
        "rank_list": [0, 1, 2, 3, 4, 5, 6, 7],
    }
    assert list(got) == [
        "device_matrix",
        "tensor_map",
        "interleaved_parallel",
        "alias_name",
        "rank_list",
    ]
    assert type(got["rank_list"]) is list


def test_reference_multi_axis_examples() -> None:
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert layout(("dp", "sp"), "None").tensor_map == ((2, 1), -1)
    assert layout("mp", ("sp", "dp")).tensor_map == (0, (1, 2))


def test_seed_spellings() -> None:
    by_name = Layout((2, 2, 2), name=("dp", "sp", "mp"))
    positional = Layout((2, 2, 2), ("dp", "sp", "mp"))
    keyword = Layout((2, 2, 2), alias_name=("dp", "sp", "mp"))
    assert by_name == positional == keyword
    in_strategy = (by_name("mp", ("sp", "dp")), by_name(("sp", "dp"), "None"))
    out_strategy = (by_name(("mp", "sp", "dp"), "None"),)
    assert in_strategy[1].tensor_map == ((1, 2), -1)
    assert out_strategy[0].tensor_map == ((0, 1, 2), -1)
    layout2 = Layout((8,), ("tp",))
    assert layout2("None", "tp").tensor_map == (-1, 0)
    assert layout2("tp", "None").to_dict()["rank_list"] == list(range(8))


def test_spec_is_immutable_hashable_and_helpful() -> None:
    layout = Layout((2, 4), ("dp", "mp"))
    spec = layout("dp", "mp")
    assert isinstance(spec, LayoutSpec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.tensor_map = (0, 1)  # type: ignore[misc]
    assert spec == layout("dp", "mp")
    assert len({spec, layout("dp", "mp"), layout("mp", "dp")}) == 2
    assert spec.shard_strategy == (2, 4)
    assert layout(("dp", "mp"), "None").shard_strategy == (8, 1)
    assert spec.device_num == 8 and spec.ndim == 2
    spec.to_dict()["rank_list"].append(99)
    assert spec.to_dict()["rank_list"] == list(range(8))


def test_repr() -> None:
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert repr(layout) == "Layout((2, 2, 2), ('dp', 'sp', 'mp'))"
    assert repr(layout("mp", ("sp", "dp"))) == (
        "Layout((2, 2, 2), ('dp', 'sp', 'mp'))('mp', ('sp', 'dp'))"
    )
    permuted = Layout((2,), ("dp",), rank_list=[1, 0])
    assert "rank_list=[1, 0]" in repr(permuted)
    assert "rank_list=[1, 0]" in repr(permuted("dp"))


def test_rank_list() -> None:
    layout = Layout((2, 2), ("dp", "mp"), [3, 2, 1, 0])
    assert layout.rank_list == [3, 2, 1, 0]
    assert layout("dp", "mp").to_dict()["rank_list"] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="4 devices"):
        Layout((2, 2), ("dp", "mp"), [0, 1, 2])
    with pytest.raises(ValueError, match="unique"):
        Layout((2, 2), ("dp", "mp"), [0, 1, 1, 2])
    with pytest.raises(TypeError):
        Layout((2, 2), ("dp", "mp"), "0123")
    with pytest.raises(TypeError):
        Layout((2, 2), ("dp", "mp"), [0, 1, 2, 3.0])
    with pytest.raises(ValueError):
        Layout((2, 2), ("dp", "mp"), [0, 1, 2, -3])


def test_interleaved_parallel() -> None:
    layout = Layout((2, 4, 2), ("dp", "mp", "interleaved_parallel"))
    spec = layout(("dp", "interleaved_parallel"), "mp")
    assert spec.tensor_map == ((2, 0), 1)
    assert spec.to_dict()["interleaved_parallel"] is True
    assert spec.to_dict()["rank_list"] == list(range(8))  # the virtual axis is no device
    with pytest.raises(ValueError, match="last"):
        Layout((2, 2, 2), ("interleaved_parallel", "dp", "mp"))


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        (((2, 2), ("dp",)), {}, ValueError, "one name per axis"),
        (((2, 2), ("dp", "dp")), {}, ValueError, "unique"),
        (((2, 2), ("dp", "None")), {}, ValueError, "None"),
        (((2, 0), ("dp", "mp")), {}, ValueError, "> 0"),
        (((2, -2), ("dp", "mp")), {}, ValueError, "> 0"),
        (((), ()), {}, ValueError, "empty"),
        ((8, ("dp",)), {}, TypeError, "device_matrix"),
        (((2, 2.0), ("dp", "mp")), {}, TypeError, "ints"),
        (((2, True), ("dp", "mp")), {}, TypeError, "ints"),
        (((2, 2), "dpmp"), {}, TypeError, "alias_name"),
        (((2, 2), ("dp", 1)), {}, TypeError, "strings"),
        (((2, 2), ("dp", "")), {}, ValueError, "empty"),
        (((2, 2),), {}, TypeError, "axis names"),
        (((2, 2), ("dp", "mp")), {"name": ("a", "b")}, TypeError, "once"),
    ],
)
def test_layout_errors(args: tuple, kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        Layout(*args, **kwargs)


@pytest.mark.parametrize(
    ("tensor_map", "exc", "match"),
    [
        (("dp", "dp"), ValueError, "more than once"),
        ((("dp", "sp"), "sp"), ValueError, "more than once"),
        ((("dp", "dp"),), ValueError, "more than once"),
        (("xp",), ValueError, "unknown alias 'xp'"),
        (((),), ValueError, "empty"),
        ((None,), TypeError, "None"),
        ((1,), TypeError, "alias"),
    ],
)
def test_call_errors(tensor_map: tuple, exc: type, match: str) -> None:
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    with pytest.raises(exc, match=match):
        layout(*tensor_map)


def test_none_may_repeat_and_layout_needs_a_map_for_to_dict() -> None:
    layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
    assert layout("None", "None", "dp").tensor_map == (-1, -1, 2)
    with pytest.raises(ValueError, match="tensor map"):
        layout.to_dict()


@st.composite
def layouts_and_maps(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[str, ...], list[Any]]:
    n = draw(st.integers(1, 5))
    dims = tuple(draw(st.lists(st.sampled_from([1, 2, 4]), min_size=n, max_size=n)))
    names = tuple(f"a{i}" for i in range(n))
    order = draw(st.permutations(list(names)))
    entries: list[Any] = []
    i = 0
    while i < len(order):
        k = draw(st.integers(0, 3))
        if k == 0:
            entries.append("None")
            i += 0 if draw(st.booleans()) else 1  # "None" entries do not consume aliases
            if len(entries) > 8:
                break
            continue
        chunk = order[i : i + k]
        entries.append(chunk[0] if len(chunk) == 1 and draw(st.booleans()) else tuple(chunk))
        i += k
    return dims, names, entries


@given(layouts_and_maps())
def test_tensor_map_counts_axes_from_the_right(case: tuple) -> None:
    dims, names, entries = case
    spec = Layout(dims, names)(*entries)
    n = len(names)
    for entry, value in zip(entries, spec.tensor_map):
        if entry == "None":
            assert value == -1
        elif isinstance(entry, tuple):
            assert value == tuple(n - 1 - names.index(a) for a in entry)
        else:
            assert value == n - 1 - names.index(entry)
    for entry, count in zip(entries, spec.shard_strategy):
        used = () if entry == "None" else (entry if isinstance(entry, tuple) else (entry,))
        expected = 1
        for alias in used:
            expected *= dims[names.index(alias)]
        assert count == expected
