"""Tile's sharding beyond one split per input dim (MindSpore's tile_info): multiples longer
than the input's rank (a strategy of len(multiples) values), an out_strategy or out Layout
that splits the copies of tiled dims, and Tile in auto_parallel (the searches' candidates).
Rules against the single-device oracle; MindSpore's test_tile.py networks, scaled down, train
on 8 ranks like one device (float64)."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcompile.ir.errors import OpError, PcompileError
from pcompile.ir.sharding import OpContext, is_power_of_two, rule_for
from pcompile.ir.types import DType, TensorType
from pcompile.passes.search.candidates import candidate_strategies
from pcompile.passes.step_parallel_begin import assign
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from tests.e2e.test_parallel import rnd
from tests.ir.test_parallel_ops import case_graph, run_sharded

CASES = [((2, 4), (2, 3, 1)), ((4, 3), (2, 2, 2)), ((2, 1, 6), (2, 1, 4, 1)),
         ((4, 2), (4, 1)), ((3,), (2, 4, 1))]


def _splits(draw: Any, extents: list[int], devices: int) -> tuple[int, ...]:
    remaining, split = devices, []
    for extent in extents:
        options = [c for c in range(1, remaining + 1) if remaining % c == 0 and extent % c == 0
                   and (not is_power_of_two(devices) or is_power_of_two(c))]
        c = draw(st.sampled_from(options))
        split.append(c)
        remaining //= c
    return tuple(split)


def _padded(shape: tuple[int, ...], reps: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * (len(reps) - len(shape)) + shape


@settings(max_examples=25, deadline=None)
@given(data=st.data(), devices=st.sampled_from([1, 2, 4, 8, 6]),
       case=st.sampled_from(range(len(CASES))), use_out=st.booleans())
def test_tile_strategies_of_every_multiple_match_the_oracle(data: Any, devices: int, case: int,
                                                            use_out: bool) -> None:
    """A strategy of len(multiples) values (copies of tiled dims split, input dims of
    multiple 1 split), given as in_strategy, or with the copies' splits in out_strategy and
    1s in in_strategy: outputs and the input's gradient equal the unsharded Tile's."""
    shape, reps = CASES[case]
    padded = _padded(shape, reps)
    split = _splits(data.draw, [m if m > 1 else d for m, d in zip(reps, padded)], devices)
    if use_out:
        in_split = tuple(1 if m > 1 else c for m, c in zip(reps, split))
        run_sharded("Tile", [rnd(shape)], {"multiples": reps}, (in_split,), devices,
                    out_strategy=(split,))
    else:
        run_sharded("Tile", [rnd(shape)], {"multiples": reps}, (split,), devices)


def test_tile_of_a_lower_rank_input_splits_the_new_dims_copies() -> None:
    """MindSpore's test_tile_output: x (8, 4, 2) tiled (4, 2, 2, 2) with strategy
    ((1, 2, 2, 2),): the copies of every dim split, the input whole on every rank."""
    x = TensorType(DType.float32, (8, 4, 2))
    out = TensorType(DType.float32, (4, 16, 8, 4))
    ctx = OpContext("Tile", [x], out, {"multiples": (4, 2, 2, 2)}, 8)
    sharding = rule_for("Tile").apply(ctx, ((1, 2, 2, 2),))
    assert sharding.in_layouts[0].slice_shape == (8, 4, 2)
    assert sharding.out_layouts[0].slice_shape == (4, 8, 4, 2)
    assert sharding.local_attrs == {"multiples": (4, 1, 1, 1)}
    run_sharded("Tile", [rnd((8, 4, 2))], {"multiples": (4, 2, 2, 2)}, ((1, 2, 2, 2),), 8)


@pytest.mark.parametrize("shape,reps,strategy,out_strategy,message", [
    ((4, 2), (3, 2, 1), ((2, 1, 2),), None, "dim 0 is tiled 3 times.*strategy value 2"),
    ((4, 2), (1, 2, 1), ((2, 1, 1),), None, "dim index 0.*cannot be divisible by strategy"),
    ((4, 2), (2, 2, 1), ((1, 2, 1, 1),), None, "has 4 values.*one per multiple: 3"),
    ((4, 2), (2, 1), ((2, 1),), ((1, 1),), "in_strategy splits its copies 2 ways but "
                                           "out_strategy 1"),
    ((4, 2), (2, 1), ((1, 2),), ((2, 1),), "splits dim 1 \\(multiple 1\\) 1 ways but "
                                           "in_strategy 2"),
])
def test_tile_strategies_that_mindspore_refuses(shape: tuple[int, ...], reps: tuple[int, ...],
                                                strategy: Any, out_strategy: Any,
                                                message: str) -> None:
    graph, _ = case_graph("Tile", [rnd(shape)], {"multiples": reps}, strategy, out_strategy)
    with pytest.raises(OpError, match=message):
        assign(graph, 8, "full_batch")


@pytest.mark.parametrize("shape,reps", [((16, 8, 4), (2, 2, 4, 2)), ((4, 2), (3, 1, 1)),
                                        ((1, 6), (4, 1)), ((5,), (2, 3))])
def test_tile_always_has_search_candidates(shape: tuple[int, ...],
                                           reps: tuple[int, ...]) -> None:
    """The searches enumerate one split per input dim; every Tile (multiples longer than
    the input's rank included) has candidates, the all-ones strategy first among them."""
    x = TensorType(DType.float32, shape)
    out_shape = tuple(m * d for m, d in zip(reps, _padded(shape, reps)))
    ctx = OpContext("Tile", [x], TensorType(DType.float32, out_shape), {"multiples": reps}, 8)
    candidates = candidate_strategies(ctx)
    assert candidates
    assert any(all(c == 1 for c in s.strategy[0]) for s in candidates)
    for sharding in candidates:
        assert sharding.out_layouts[0].shape == out_shape


# -- MindSpore's networks -----------------------------------------------------------------------

NET = """
import numpy as np
from pcompile import nn, ops, Parameter, Layout, initializer, set_seed, set_auto_parallel_context

set_auto_parallel_context(parallel_mode="{mode}", device_num=8,
                          dataset_strategy="full_batch"{search})
{layout}

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        set_seed(7)
        self.w = Parameter(initializer("normal", {w}), "w")
        self.tile = ops.Tile(){tile_shard}
        self.mul = ops.Mul(){mul_shard}

    def construct(self, x):
        {body}


def model():
    return Net()


def inputs():
    return (np.random.default_rng(0).standard_normal({x}).astype(np.float32),)


def labels():
    return (np.ones({out}, np.float32),)


def loss():
    return nn.MSELoss()


def optimizer(params):
    return nn.Momentum(params, learning_rate=0.1, momentum=0.9)
"""

_TILE_W = "return self.mul(x, self.tile(self.w, {reps}))"
_TILE_OUT = "return self.tile(self.mul(x, self.w), {reps})"
_LAYOUT = 'layout = Layout((2, 2, 2), ("dp", "cp", "mp"))'

# name: (body, w, x, out, reps, tile shard, mul shard, mode, layout)
NETS = {
    # test_layout_tile2: the copies of a size-1 dim split by the out layout
    "layout_out_splits_copies": (
        _TILE_W, (8, 1, 4), (8, 8, 4), (8, 8, 4), (1, 8, 1),
        '.shard(in_strategy=(layout("dp", "None", "mp"),), '
        'out_strategy=(layout("dp", "cp", "mp"),))',
        '.shard((layout("dp", "cp", "mp"), layout("dp", "cp", "mp")))', "semi", _LAYOUT),
    # test_layout_tile3: every dim tiled and split in the output only
    "layout_all_dims_tiled": (
        _TILE_W, (4, 2, 2), (8, 8, 4), (8, 8, 4), (2, 4, 2),
        '.shard(in_strategy=(layout("None", "None", "None"),), '
        'out_strategy=(layout("dp", "cp", "mp"),))',
        '.shard((layout("dp", "cp", "mp"), layout("dp", "cp", "mp")))', "semi", _LAYOUT),
    # test_layout_tile5: multiples longer than the input's rank
    "layout_longer_multiples": (
        _TILE_W, (2, 4), (8, 8, 8), (8, 8, 8), (8, 4, 2),
        '.shard(in_strategy=(layout("None", "None"),), '
        'out_strategy=(layout("dp", "cp", "mp"),))',
        '.shard((layout("dp", "cp", "mp"), layout("dp", "cp", "mp")))', "semi", _LAYOUT),
    # the tuple form of an out_strategy splitting copies
    "tuple_out_strategy": (
        _TILE_W, (4, 2, 2), (8, 8, 4), (8, 8, 4), (2, 4, 2),
        ".shard(in_strategy=((1, 1, 1),), out_strategy=((2, 2, 2),))",
        ".shard(((2, 2, 2), (2, 2, 2)))", "semi", ""),
    # test_tile_output: a strategy of len(multiples) values on a rank-3 input
    "longer_multiples_strategy": (
        _TILE_OUT, (8, 4, 2), (8, 4, 2), (4, 16, 8, 4), (4, 2, 2, 2),
        ".shard(((1, 2, 2, 2),))", ".shard(((2, 2, 2), (2, 2, 2)))", "semi", ""),
    # test_tile_auto_parallel: no strategy at all, multiples longer than the rank
    "auto_parallel_longer_multiples": (
        _TILE_OUT, (16, 8, 4), (16, 8, 4), (2, 32, 32, 8), (2, 2, 4, 2), "", "", "auto", ""),
}


def _write(tmp_path: Any, name: str, **replace: str) -> str:
    body, w, x, out, reps, tile_shard, mul_shard, mode, layout = NETS[name]
    text = NET.format(
        mode="semi_auto_parallel" if mode == "semi" else "auto_parallel",
        search="" if mode == "semi" else ", search_mode='sharding_propagation'",
        layout=layout, w=list(w), x=x, out=out, body=body.format(reps=reps),
        tile_shard=replace.get("tile_shard", tile_shard), mul_shard=mul_shard)
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("name", sorted(NETS))
def test_tile_networks_train_like_one_device(tmp_path: Any, name: str) -> None:
    """Two training steps on 8 simulated ranks give the single-device loss, gradients and
    parameters (float64); each rank tiles only its share of the copies."""
    program = compile_model(_write(tmp_path, name), dump=False)
    (node,) = program.graph.find("Tile")
    sharding = program.state.assignment.sharding(node)
    assert sharding is not None
    reps = NETS[name][4]
    local = program.rank_graph(0).find("Tile")[0]
    assert local.result.type.size * 8 >= node.result.type.size  # no rank tiles everything
    if NETS[name][5]:  # a strategy that splits copies
        assert sharding.local_attrs["multiples"] != reps
    report = check(program, steps=2)
    assert report.ok(), report.errors


@pytest.mark.parametrize("name,tile_shard,message", [
    # test_layout_tile4: an input dim whose multiple and size are both > 1 split
    ("layout_all_dims_tiled", '.shard(in_strategy=(layout("dp", "cp", "mp"),))',
     "dim 0 of the input should not be split"),
    # test_layout_tile6-like: the copies split by a non-divisor of the multiple
    ("layout_all_dims_tiled",
     '.shard(in_strategy=(layout("None", "None", "None"),), '
     'out_strategy=(layout(("dp", "cp"), "None", "mp"),))',
     "multiple 2 of output dim 0 is not divisible by its split 4"),
])
def test_tile_layouts_that_mindspore_refuses(tmp_path: Any, name: str, tile_shard: str,
                                            message: str) -> None:
    with pytest.raises(PcompileError, match=f"(?s)Tile.*{message}"):
        compile_model(_write(tmp_path, name, tile_shard=tile_shard), dump=False)


JAX_SCRIPT = """
import json, pathlib, sys, tempfile
import tests.spmd_worker as worker  # 8 virtual CPU devices, float64
from pcompile.tools.compile import compile as compile_model
from tests.ir import test_strided_slice_masks, test_tile_sharding
out = {}
for module in (test_strided_slice_masks, test_tile_sharding):
    for name in module.NETS:
        path = module._write(pathlib.Path(tempfile.mkdtemp()), name)
        out[name] = worker.compare(compile_model(path, dump=False), "")
print("REPORT " + json.dumps(out))
"""


@pytest.mark.slow  # one 8-device worker process runs the networks of both files (~15 s)
def test_masked_slice_and_tile_networks_on_jax_spmd() -> None:
    """The same networks (here and in test_strided_slice_masks.py) as JAX SPMD programs on 8
    virtual CPU devices: two steps agree with the numpy simulator and one device (float64)."""
    import json
    import os
    import subprocess
    import sys

    from tests import ROOT
    from tests.backends.test_jax_backend import assert_agrees_in_float64
    from tests.ir.test_strided_slice_masks import NETS as SLICE_NETS

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    report = json.loads(line[len("REPORT "):])
    assert set(report) == set(SLICE_NETS) | set(NETS)
    for name, result in report.items():
        assert result["fallback"] == 0, name
        assert_agrees_in_float64(result, name)
