"""Placement of ranks on devices (backends/placement.py, `--platform`): the device assignment
for P processes x R ranks x G GPUs, the refusal of too few GPUs before anything starts, each
rank process's environment, and a parent process that initialises no backend but the CPU.
No GPU is needed: the GPU count is injected, and launched "processes" are a stand-in that
records its environment."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from pcompile.backends.launcher import LaunchError, launch
from pcompile.backends.placement import (
    assign_devices,
    local_device_ids,
    process_env,
    resolve_platform,
    visible_ids,
)
from pcompile.ir.errors import PcompileError
from pcompile.tools.compile import compile as compile_model
from tests import ROOT
from tests.multiprocess import mlp_source

CLI = os.path.join(ROOT, "cli.py")


@pytest.mark.parametrize("processes, ranks, gpus, want", [
    (8, 8, 8, [(r,) for r in range(8)]),
    (2, 8, 8, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    (1, 4, 8, [(0, 1, 2, 3)]),  # more GPUs than ranks: the first ones
    (4, 4, 6, [(0,), (1,), (2,), (3,)]),
    (1, 1, 1, [(0,)]),
])
def test_assignment_one_gpu_per_rank(processes, ranks, gpus, want) -> None:
    got = assign_devices(processes, ranks, gpus)
    assert got == want
    flat = [d for ids in got for d in ids]
    assert len(flat) == ranks and len(set(flat)) == ranks  # each rank its own GPU


def test_assignment_too_few_gpus_is_one_clear_error() -> None:
    with pytest.raises(PcompileError) as err:
        assign_devices(2, 8, 4)
    text = str(err.value)
    assert "8 rank(s), one GPU each, but 4 GPU(s) are visible" in text
    assert "--platform cpu" in text and "--devices" in text


def test_assignment_uneven_processes() -> None:
    with pytest.raises(PcompileError, match="cannot be spread evenly over 3 processes; choose "
                                            "one of 1, 2, 4, 8"):
        assign_devices(3, 8, 8)


def test_process_env_gpu_maps_through_visible_devices() -> None:
    base = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "JAX_PLATFORMS": "cpu", "X": "1"}
    env = process_env(base, "gpu", (2, 3), gpus=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert env["PCOMPILE_LOCAL_DEVICE_IDS"] == "0,1"
    assert env["JAX_PLATFORMS"] == "cuda" and env["PCOMPILE_PLATFORM"] == "gpu"
    assert env["X"] == "1" and base["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # base untouched
    assert local_device_ids(env) == [0, 1]
    assert visible_ids({}, 3) == ["0", "1", "2"]


def test_process_env_cpu_keeps_todays_behaviour() -> None:
    env = process_env({"PCOMPILE_LOCAL_DEVICE_IDS": "0"}, "cpu", None)
    assert env["JAX_PLATFORMS"] == "cpu" and env["PCOMPILE_PLATFORM"] == "cpu"
    assert "PCOMPILE_LOCAL_DEVICE_IDS" not in env
    assert local_device_ids(env) is None


def test_resolve_platform() -> None:
    assert resolve_platform("auto", lambda: 0) == ("cpu", 0)
    assert resolve_platform("auto", lambda: 2) == ("gpu", 2)
    assert resolve_platform("gpu", lambda: 8) == ("gpu", 8)
    assert resolve_platform("cpu", lambda: 8) == ("cpu", 0)  # never counts
    with pytest.raises(PcompileError, match="--platform gpu: JAX sees no GPU"):
        resolve_platform("gpu", lambda: 0)


MODEL = mlp_source("((4, 1), (1, 1))")

# Stands in for the Python interpreter: records its environment and arguments, exits 0.
RECORDER = """#!/bin/sh
pid=""
prev=""
for a in "$@"; do
  if [ "$prev" = "--process-id" ]; then pid="$a"; fi
  prev="$a"
done
env > "{out}/env_$pid.txt"
"""


@pytest.fixture(scope="module")
def compiled4(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("place")
    model = folder / "mlp4.py"
    model.write_text(textwrap.dedent(MODEL))
    out = folder / "out"
    compile_model(str(model), devices=4, out_dir=str(out))
    return str(out)


def _recorder(tmp_path) -> str:
    script = tmp_path / "python"
    script.write_text(RECORDER.format(out=tmp_path))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _envs(tmp_path) -> dict[int, dict[str, str]]:
    out = {}
    for path in tmp_path.glob("env_*.txt"):
        pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        out[int(path.stem.split("_")[1])] = dict(pairs)
    return out


def test_launcher_gives_each_process_its_gpus(compiled4, tmp_path) -> None:
    base = dict(os.environ, CUDA_VISIBLE_DEVICES="4,5,6,7")
    result = launch(compiled4, steps=1, processes=2, platform="gpu", gpus=4,
                    python=_recorder(tmp_path), env=base, echo=lambda line: None)
    assert result.code == 0
    envs = _envs(tmp_path)
    assert sorted(envs) == [0, 1]
    assert [envs[p]["CUDA_VISIBLE_DEVICES"] for p in (0, 1)] == ["4,5", "6,7"]
    assert [envs[p]["PCOMPILE_LOCAL_DEVICE_IDS"] for p in (0, 1)] == ["0,1", "0,1"]
    assert {envs[p]["JAX_PLATFORMS"] for p in (0, 1)} == {"cuda"}


def test_launcher_cpu_processes_run_on_cpu(compiled4, tmp_path) -> None:
    base = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = launch(compiled4, steps=1, processes=4, platform="cpu",
                    python=_recorder(tmp_path), env=base, echo=lambda line: None)
    assert result.code == 0
    envs = _envs(tmp_path)
    assert sorted(envs) == [0, 1, 2, 3]
    assert all(e["JAX_PLATFORMS"] == "cpu" and e["PCOMPILE_PLATFORM"] == "cpu"
               for e in envs.values())
    assert not any("PCOMPILE_LOCAL_DEVICE_IDS" in e for e in envs.values())


def test_launcher_refuses_too_few_gpus_before_starting(compiled4, tmp_path) -> None:
    info = os.path.join(compiled4, "launch.json")
    if os.path.exists(info):
        os.unlink(info)
    with pytest.raises(LaunchError, match="4 rank\\(s\\), one GPU each, but 2 GPU\\(s\\)"):
        launch(compiled4, steps=1, platform="gpu", gpus=2, python=_recorder(tmp_path),
               echo=lambda line: None)
    assert not list(tmp_path.glob("env_*.txt")) and not os.path.exists(info)


def test_cli_platform_gpu_without_gpu_is_one_message(compiled4, tmp_path) -> None:
    model = os.path.join(os.path.dirname(compiled4), "mlp4.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, CLI, model, "--devices", "4", "--no-check",
                           "--out", str(tmp_path / "o"), "--run", "--platform", "gpu"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    if "JAX sees no GPU" not in done.stderr:  # a machine with a GPU: nothing to refuse
        pytest.skip("this machine has a GPU: --platform gpu is not refused")
    assert done.returncode == 1
    assert done.stderr.startswith("pcompile: error: --platform gpu: JAX sees no GPU")
    assert "Traceback" not in done.stderr


PARENT = """
import json, os, sys
os.environ.pop("JAX_PLATFORMS", None)
from pcompile.cli import main
from pcompile.backends.placement import initialised_backends
try:
    main({args!r}, standalone_mode=False)
except SystemExit as exc:
    assert not exc.code, exc.code
import jax
print(json.dumps({{"backends": sorted(initialised_backends()),
                  "devices": sorted({{d.platform for d in jax.devices()}}),
                  "env": os.environ.get("JAX_PLATFORMS")}}))
"""


@pytest.mark.slow
def test_parent_initialises_only_the_cpu_backend(compiled4, tmp_path) -> None:
    """compile + check + an in-process run (1 device) and a launched run (4 ranks): the
    parent's JAX is pinned to the CPU before anything initialises a backend."""
    model = os.path.join(os.path.dirname(compiled4), "mlp4.py")
    for devices in ("1", "4"):
        args = [model, "--devices", devices, "--out", str(tmp_path / devices), "-q", "--run",
                "--steps", "2", "--platform", "auto"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PCOMPILE_")}
        env.pop("JAX_PLATFORMS", None)
        done = subprocess.run([sys.executable, "-c", PARENT.format(args=args)],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        # 1 device: the check and the training ran JAX here (on CPU); 4 ranks: the check ran
        # on the numpy simulator and the ranks in their own processes, so JAX may be untouched
        want = ["cpu"] if devices == "1" else []
        assert seen == {"backends": want, "devices": ["cpu"], "env": "cpu"}, (devices, seen)
