"""The JAX SPMD backend: all ranks as one shard_map program on 8 virtual CPU devices, checked
against the numpy simulator and the single-device oracle; the SPMD plan (mesh axes, fallback
groups); and the generated rank programs.

The device runs happen in a subprocess (tests/spmd_worker.py): `jax_num_cpu_devices` must be set
before JAX initialises, and this process may already have initialised it with one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pcompile.backends.jax.plan import (
    MeshSpec,
    SpmdLoweringError,
    SpmdPlan,
    align_groups,
    choose_mesh,
    distinct_orders,
    group_along,
)
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import FLOAT64_RTOL
from tests import ROOT
from tests.multiprocess import clean_env

EXAMPLE_CASES = [
    "quickstart.py:semi_auto_parallel",
    "layout_mlp.py:semi_auto_parallel",
    "dense_gelu_blocks.py:semi_auto_parallel",
    "gpt_block.py:semi_auto_parallel",
    "quickstart.py:data_parallel",
    "manual_parallel.py:hybrid_parallel",
]


def worker(*args: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.spmd_worker", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


@pytest.fixture(scope="module")
def examples_report() -> dict:
    return worker("examples")


# slow: one 8-device worker process runs six whole examples (~20 s); the synthetic, AdaFactor
# and training-form cases below and in test_training_forms_jax.py check the same lowering fast
@pytest.mark.slow
@pytest.mark.parametrize("case", EXAMPLE_CASES)
def test_spmd_equals_numpy_simulator_and_single_device(case: str, examples_report) -> None:
    result = examples_report[case]
    if "skipped" in result:
        pytest.skip(f"{case} does not compile for 8 devices: {result['skipped']}")
    assert "float32" not in result["dtypes"], result["dtypes"]
    assert_agrees_in_float64(result, case)
    assert result["mesh"] == [2, 2, 2]


def assert_agrees_in_float64(result: dict, what: str) -> None:
    """A `spmd_worker.compare` report: the JAX SPMD program, the numpy simulator and one device
    agree on every loss, parameter and state. Everything runs in float64, so a correct plan and
    lowering agree within the oracle's derived float64 bound (tools/oracle.py), whatever
    the numpy/jax build's summation order."""
    bound = FLOAT64_RTOL
    for jax_loss, numpy_loss, single_loss in result["losses"]:
        assert abs(jax_loss - numpy_loss) <= bound * max(1.0, abs(numpy_loss)), (what, result)
        assert abs(jax_loss - single_loss) <= bound * max(1.0, abs(single_loss)), (what, result)
    for against in ("vs_numpy", "vs_single"):
        assert result[against]["state"] <= bound, (what, against, result)
        assert result[against]["param"] <= bound, (what, against, result)


@pytest.mark.slow  # a multi-process run (~11 s of CPU)
def test_adafactor_spmd_equals_numpy_simulator_and_single_device() -> None:
    """nn.AdaFactor's row/column statistics and their group AllReduces lower to JAX: two
    steps agree with the numpy simulator and one device (float64), with and without the
    parallel optimizer."""
    report = worker("adafactor")
    assert set(report) == {"parallel_optimizer=False", "parallel_optimizer=True"}
    for case, result in report.items():
        assert result["optimizer"] == "AdaFactor" and result["fallback"] == 0, case
        assert_agrees_in_float64(result, case)


@pytest.mark.slow  # a multi-process run; tests/ir/test_ops_random.py checks the rule fast
def test_dropout_spmd_equals_numpy_simulator_and_single_device() -> None:
    """A split Dropout's bits in the JAX SPMD program (its offsets a per-rank constant table)
    are the single-device program's: two steps agree with numpy and one device (float64)."""
    report = worker("dropout")
    assert set(report) == {"semi_auto_parallel", "do_mask", "data_parallel"}
    for case, result in report.items():
        assert_agrees_in_float64(result, case)
        assert result["vs_single"]["state"] == 0.0, case  # random_step: 2 after two steps


# slow: reads the examples worker's report (above)
@pytest.mark.slow
def test_gpt_block_uses_dynamic_slices_and_mesh_axis_collectives(examples_report) -> None:
    result = examples_report["gpt_block.py:semi_auto_parallel"]
    assert result["kinds"].get("slice", 0) > 0 and result["kinds"].get("slice_grad", 0) > 0
    assert result["kinds"]["collective"] > 0 and result["fallback"] == 0


def test_fallback_groups_variants_and_rank_constants_match_the_simulator() -> None:
    report = worker("synthetic")
    assert all(report[c]["aligned"] == [True] * 8 for c in ("aligned_r1", "aligned_r0"))
    # (0, 3), (1, 2) is no set of mesh axes; (1, 0) is the mesh axis in reverse order.
    assert all(report[c]["aligned"] == [False] * 8
               for c in ("fallback_diagonal", "fallback_reversed"))
    for name, case in report.items():
        assert case["error"] <= 1e-6, (name, case)
        assert "switch" in case["kinds"], (name, case)


# -- the plan (no devices) ----------------------------------------------------------------------


def test_mesh_axes_of_device_matrix_groups() -> None:
    mesh = MeshSpec.from_sizes((2, 2, 2))
    assert group_along(mesh, 3, (1, 2)) == (0, 1, 2, 3)
    assert group_along(mesh, 3, (2, 0)) == (2, 6, 3, 7)  # axis 2 major, then axis 0
    # dev matrix (2, 4): groups along the axis of size 4 are the mesh axes r1, r2.
    groups = [tuple(range(4)) if r < 4 else tuple(range(4, 8)) for r in range(8)]
    assert align_groups(mesh, groups) == (1, 2)
    # the mirror groups (r, r + 4) of the quickstart's w
    assert align_groups(mesh, [(r % 4, r % 4 + 4) for r in range(8)]) == (0,)
    assert align_groups(mesh, [tuple(range(8))] * 8) == (0, 1, 2)
    assert align_groups(mesh, [(r,) for r in range(8)]) == ()
    # rank_list order other than row-major: another axis order, when one exists
    assert align_groups(mesh, [group_along(mesh, r, (2, 0)) for r in range(8)]) == (2, 0)
    assert align_groups(mesh, [(0, 3), (1, 2), (1, 2), (0, 3)] + [(4, 7), (5, 6), (5, 6),
                                                                   (4, 7)]) is None


def test_mesh_order_for_mixed_factors_aligns_the_collectives() -> None:
    # 12 ranks, groups along the axis of size 3 of a (4, 3) device matrix: the mesh must put the
    # factor 3 last (rank = 3 * a + b).
    groups = [tuple(range(3 * (r // 3), 3 * (r // 3) + 3)) for r in range(12)]
    mesh = choose_mesh(12, [groups])
    assert align_groups(mesh, groups) is not None
    assert mesh.sizes[-1] == 3


def test_mesh_orders_are_the_distinct_orders_of_the_primes() -> None:
    """The orders choose_mesh tries are sorted(set(permutations)) of the primes, made without
    making every permutation: 2048 devices (eleven 2s) have one order, and 40 million
    permutations of it."""
    import itertools

    for items in ([2, 2, 3, 3, 5], [2, 3, 5, 7, 11, 13, 17], [2] * 5 + [3, 3], [7], []):
        assert distinct_orders(items, 720) == sorted(set(itertools.permutations(items)))[:720]
    assert distinct_orders([2] * 11, 720) == [(2,) * 11]
    assert choose_mesh(2048, []).sizes == (2,) * 11


def test_plan_rejects_graphs_of_different_structure() -> None:
    a = compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=8,
                      parallel_mode="semi_auto_parallel", dump=False)
    b = compile_model(os.path.join(ROOT, "examples", "layout_mlp.py"), devices=8,
                      parallel_mode="semi_auto_parallel", dump=False)
    with pytest.raises(SpmdLoweringError, match="rank 1"):
        SpmdPlan.build([a.rank_graphs[0], b.rank_graphs[1]])


# -- generated rank programs ---------------------------------------------------------------------


def test_rank_programs_are_written_deterministically(tmp_path) -> None:
    model = os.path.join(ROOT, "examples", "quickstart.py")
    files = []
    for name in ("a", "b"):
        compile_model(model, devices=8, parallel_mode="semi_auto_parallel",
                      out_dir=str(tmp_path / name))
        files.append({f: (tmp_path / name / f).read_bytes()
                      for f in ["program.py", "params.json",
                                *(f"rank_{r}/program.py" for r in range(8))]})
    assert files[0] == files[1]
    shared = files[0]["program.py"].decode()
    assert "RANK = None" in shared and "NUM_RANKS = 8" in shared
    text = files[0]["rank_3/program.py"].decode()
    assert "RANK = 3" in text and "NUM_RANKS = 8" in text
    compile(text, "program.py", "exec")
    compile(shared, "program.py", "exec")
    # One comment per node of the execute dump, in its order, with this rank's values.
    rank3 = tmp_path / "a" / "rank_3"
    dump = (rank3 / sorted(f for f in os.listdir(rank3) if f.endswith(".ir"))[-1]).read_text()
    nodes = [line.split("(", 1)[0].strip() for line in dump.splitlines()
             if line.startswith("  %") and " = " in line]
    comments = [line.strip()[2:].split(" = ")[0] for line in text.splitlines()
                if line.strip().startswith("# %")]
    assert comments == nodes
    assert "#   this rank: begin (0, 0, 24), end (1, 8, 32)" in text
    assert "#   this rank: group (3, 7) (over mesh axes ('r0',))" in text
    # a layout's slice offsets are arithmetic on the rank (stride 1, 4 ranks, 8 per rank along
    # the last dim), not a table with a row per rank
    assert ("spmd.dyn_slice(v7, spmd.rank_offsets(me, (0, 0, 0), ((), (), ((1, 4, 8),))), "
            "(1, 8, 8), (1, 1, 1))") in text
    # The programs of all ranks are one program: they differ only in RANK, the docstring
    # and comments.
    def code(t: str) -> list[str]:  # after the docstring, without comments and RANK
        body = t.split("from __future__ import annotations", 1)[1]
        return [line for line in body.splitlines()
                if not line.lstrip().startswith("#") and not line.startswith("RANK = ")]

    assert code(text) == code(files[0]["rank_5/program.py"].decode()) == code(shared)


@pytest.mark.slow
def test_params_manifest_gives_each_rank_its_slice_of_the_initialisation(tmp_path) -> None:
    """No parameter values are written at compile time: params.json names each value's
    initializer and seed, and the block a rank makes from it equals that rank's slice of the
    single-device initialisation."""
    from pcompile.backends.params import read_manifest
    from pcompile.tools.runners import ParallelRunner

    out = tmp_path / "out"
    program = compile_model(os.path.join(ROOT, "examples", "gpt_block.py"), devices=8,
                            parallel_mode="semi_auto_parallel", out_dir=str(out))
    assert not list(out.rglob("params*.npz")) and not (out / "params").exists()
    sources = read_manifest(str(out))
    layouts = program.state.assignment.param_layouts
    runner = ParallelRunner(program)
    stored = [p for p in program.rank_graphs[0].params if p.kind != "input"]
    assert {p.name for p in stored} == set(sources)
    for name in ("embedding.embedding_table", "blocks.0.fc1.weight", "moment2.blocks.1.fc2.bias"):
        full = program.initial_values[name]
        for r in (0, 5):
            bounds = layouts[name].slice_bounds(r)
            block = sources[name].block(bounds)
            np.testing.assert_array_equal(block, full[tuple(slice(b, e) for b, e in bounds)])
            np.testing.assert_array_equal(block, runner.values[r][name])


def test_rank_program_runs_every_rank_in_one_process(tmp_path) -> None:
    """`python rank_0/program.py` without distributed settings: 8 virtual CPU devices."""
    from pcompile.compiler.driver.runtime import batches
    from pcompile.tools.runners import ParallelRunner

    out = tmp_path / "out"
    program = compile_model(os.path.join(ROOT, "examples", "quickstart.py"), devices=8,
                            parallel_mode="semi_auto_parallel", out_dir=str(out))
    env = clean_env()
    proc = subprocess.run([sys.executable, str(out / "rank_0" / "program.py"), "--steps", "3"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runner = ParallelRunner(program)
    want = [runner.step(arrays) for _, _, arrays in batches(program, 3)]
    for r in (0, 7):
        lines = (out / f"rank_{r}" / "train.log").read_text().splitlines()
        assert [line.rsplit(", loss is ", 1)[0] for line in lines] == [
            "epoch: 1 step: 1", "epoch: 1 step: 2", "epoch: 1 step: 3"]
        got = [float(line.rsplit(" ", 1)[1]) for line in lines]
        np.testing.assert_allclose(got, want, rtol=1e-5)
    assert os.path.exists(out / "checkpoints" / "rank_7" / "step_00000003.safetensors")
    assert os.path.exists(out / "checkpoints" / "rank_7" / "step_00000003.json")


@pytest.mark.slow
def test_a_fused_all_reduce_lowers_without_a_buffer() -> None:
    """Communication fusion's bucket (Reshape, Concat, AllReduce, Split/StridedSlice) runs as
    one psum of the gradients themselves (backends/jax/spmd.py `_Joined`): nothing is
    concatenated into a buffer and cut out again (XLA's all-reduce combiner makes the psum's
    parts one all-reduce); the float64 comparison checks its values. The quickstart's two
    cases only (data_parallel has a bucket): the worker for every example is slow."""
    report = worker("examples", "quickstart.py")
    fused = [case for case in report if report[case].get("fusion", {}).get("buckets")]
    assert fused, "no quickstart case has a fused AllReduce bucket"
    for case in fused:
        assert_agrees_in_float64(report[case], case)
        fusion = report[case]["fusion"]
        assert fusion["concatenate"] == 0, (case, fusion)
        assert len(fusion["all_reduce_operands"]) >= fusion["buckets"], (case, fusion)
