"""A dropless mixture of experts as mindformers' MoEV3 computes its experts (issue 35 item 4,
tests/models/dropless_moe.py): `ops.AlltoAllV` with counts the step computes, `GroupedMatmul`
over the received counts, `MoveTo`; on a batch where some experts get no tokens and some more
than a capacity-based plan would keep, 8 ranks (experts split over them) train like one device:
the float64 oracle in one process, and 8 JAX processes (slow)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from pcompile.compiler.driver.runtime import batches
from pcompile.tools.compile import compile as compile_model
from pcompile.tools.oracle import check
from pcompile.tools.runners import StandAloneRunner
from tests import ROOT
from tests.multiprocess import clean_env

MODEL = os.path.join(ROOT, "tests", "models", "dropless_moe.py")
CAPACITY_FACTOR = 1.5


def _expert_counts() -> tuple[np.ndarray, int]:
    """The first step's tokens per expert (numpy, from the model file's router and batch) and
    the capacity mindformers' MoEV2 would give an expert: ceil(k N capacity_factor / E)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_dropless_moe_data", MODEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x, _ = module.data(0)
    tokens = x.reshape(-1, module.HIDDEN)
    chosen = np.argsort(-(tokens @ module.router_init()), axis=1, kind="stable")[:, :module.TOP_K]
    counts = np.bincount(chosen.ravel(), minlength=module.EXPERTS)
    capacity = math.ceil(module.TOP_K * len(tokens) * CAPACITY_FACTOR / module.EXPERTS)
    return counts, capacity


def test_the_batch_leaves_experts_empty_and_overflows_others() -> None:
    counts, capacity = _expert_counts()
    assert counts.min() == 0 and counts.max() > capacity, (counts, capacity)


def test_dropless_moe_on_8_ranks_trains_like_one_device() -> None:
    """Three steps on 8 simulated ranks against one device in float64 (the oracle's bound):
    every loss, weight and gradient. Each rank runs one expert (GroupedMatmul on a (1, h, f)
    slice) and exchanges the tokens with one AlltoAll of padded buffers per AlltoAllV."""
    program = compile_model(MODEL, devices=8, dump=False)
    graph = program.rank_graph(3)
    gmm = [n for n in graph.nodes if n.op == "GroupedMatmul"]
    assert gmm and all(n.operands[1].shape[0] == 1 for n in gmm)
    assert any(n.op == "AlltoAll" and len(n.attrs["rank_list"]) == 8 for n in graph.nodes)
    report = check(program, steps=3)
    assert report.ok(), report


@pytest.mark.slow
def test_8_processes_train_like_one_device(tmp_path: Any) -> None:
    """`pcompile tests/models/dropless_moe.py --devices 8 --run` (8 JAX processes, float32):
    every rank reports the same loss, within t x eps x K of the float64 single-device program at
    step t (K the longest reduction, test_llama's rule)."""
    steps = 3
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "pcompile", MODEL, "--devices", "8", "--out", str(out),
         "--run", "--steps", str(steps), "--no-check", "--dump-ranks", "0"],
        capture_output=True, text=True, env=clean_env(), timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every rank reports the same loss" in proc.stdout
    lines = (out / "rank_0" / "train.log").read_text().splitlines()
    got = [float(line.rsplit(" ", 1)[1]) for line in lines]
    one = compile_model(MODEL, devices=1, dump=False)
    runner = StandAloneRunner(one, "numpy", float64=True)
    want = [runner.step(a) for _, _, a in batches(one, steps)]
    longest = max(max(v.type.shape, default=1) for node in one.graph.nodes
                  for v in node.operands if hasattr(v.type, "shape"))
    eps = 2.0 ** -23
    assert len(got) == steps
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= step * eps * longest * abs(w), (step, g, w)


def test_the_program_writer_keeps_same_bytes_of_other_shapes_apart() -> None:
    """One consts.npz key per stored array: equal bytes of another shape or dtype get their
    own (the AlltoAllVs' (64, 1) and (1, 64) iotas)."""
    from types import SimpleNamespace

    from pcompile.backends.jax.program_writer import StatementWriter

    writer = SimpleNamespace(consts={})
    column, row = np.arange(64, dtype=np.int32).reshape(64, 1), np.arange(64, dtype=np.int32)
    keys = [StatementWriter._store(writer, "const.k", a)  # type: ignore[arg-type]
            for a in (column, row.reshape(1, 64), column, column.view(np.float32))]
    assert keys[0] == keys[2] == "const.k" and len(set(keys)) == 3, keys
    assert writer.consts[keys[3]].dtype == np.float32
    assert [writer.consts[k].shape for k in keys] == [(64, 1), (1, 64), (64, 1), (64, 1)]


@pytest.mark.slow
def test_constants_of_the_same_bytes_and_other_shapes_are_stored_apart(tmp_path: Any) -> None:
    """The AlltoAllVs' iotas (64, 1) and (1, 64) hold the same bytes: the rank program's
    consts.npz keeps both shapes (one key for both made a rank broadcast (1, 8) against the
    wrong one)."""
    compile_model(MODEL, devices=8, out_dir=str(tmp_path / "out"), dump=True)
    program = (tmp_path / "out" / "program.py").read_text()
    with np.load(tmp_path / "out" / "consts.npz") as consts:
        iotas = {consts[k].shape for k in consts.files
                 if consts[k].size == 64 and np.array_equal(consts[k].ravel(), np.arange(64))}
        assert {(64, 1), (1, 64)} <= iotas, iotas
        assert all(f"DATA[{k!r}]" in program for k in consts.files if k.startswith("const."))
