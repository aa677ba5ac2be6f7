"""Which devices the rank processes run on: `--platform auto|cpu|gpu`.

* `cpu`: every process runs its ranks on virtual CPU devices (`jax_num_cpu_devices`), with gloo
  collectives between processes (what the launcher always did).
* `gpu`: one GPU per rank. `assign_devices(P, R, G)` gives process p of P the local GPUs of its
  ranks (ranks p*R/P ... (p+1)*R/P - 1 on GPUs p*R/P ...): a process that owns several ranks
  owns as many GPUs and runs them as one SPMD program. Fewer GPUs than ranks is refused before
  anything starts. The launcher passes each process its GPUs as `CUDA_VISIBLE_DEVICES` (mapped
  through the launcher's own `CUDA_VISIBLE_DEVICES`) and `PCOMPILE_LOCAL_DEVICE_IDS`
  (`jax.distributed.initialize(local_device_ids=...)`).
* `auto`: `gpu` when a GPU is visible, else `cpu`. The GPUs are counted in a child process
  (`count_gpus`), so that the process that compiles and checks never initialises a GPU backend:
  the memory JAX would preallocate there belongs to the rank processes.

Pure functions, except `count_gpus` (a subprocess) and `pin_parent_to_cpu` (this process's
JAX configuration).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping

from pcompile.ir.errors import PcompileError

PLATFORMS = ("auto", "cpu", "gpu")
GPU_PLATFORM = "cuda"  # JAX_PLATFORMS of a GPU rank process
LOCAL_DEVICE_IDS = "PCOMPILE_LOCAL_DEVICE_IDS"
PLATFORM_ENV = "PCOMPILE_PLATFORM"


def assign_devices(processes: int, ranks: int, gpus: int) -> list[tuple[int, ...]]:
    """Per process, the indices (among the visible GPUs) of the GPUs it runs: one per rank,
    process p owning the GPUs of ranks p*R/P ... (p+1)*R/P - 1."""
    if processes < 1 or ranks < 1:
        raise PcompileError(f"cannot place {ranks} rank(s) on {processes} process(es)")
    if ranks % processes:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise PcompileError(
            f"{ranks} ranks cannot be spread evenly over {processes} processes; choose one of "
            f"{', '.join(map(str, divisors))}")
    if gpus < ranks:
        raise PcompileError(
            f"the plan has {ranks} rank(s), one GPU each, but {gpus} GPU(s) are visible"
            f"{_visible_note()}; compile for at most {gpus} device(s) (--devices), start the "
            "ranks on several machines (docs/running.md, 'GPUs'), or run on CPU devices with "
            "--platform cpu")
    per = ranks // processes
    return [tuple(range(p * per, (p + 1) * per)) for p in range(processes)]


def _visible_note() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""


def visible_ids(env: Mapping[str, str], gpus: int) -> list[str]:
    """The physical names of the `gpus` GPUs this process sees, in JAX's order: the entries of
    `CUDA_VISIBLE_DEVICES` when it is set, else 0 .. gpus-1."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return [str(i) for i in range(gpus)]
    return [v.strip() for v in visible.split(",") if v.strip()][:gpus]


def process_env(base: Mapping[str, str], platform: str, devices: tuple[int, ...] | None,
                gpus: int = 0) -> dict[str, str]:
    """The environment of one rank process: `cpu` pins JAX to CPU (unless the caller chose
    JAX_PLATFORMS); `gpu` gives it exactly its GPUs (`devices`: indices among the visible
    ones) and their local ids for `jax.distributed`."""
    env = dict(base)
    env[PLATFORM_ENV] = platform
    if platform == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.pop(LOCAL_DEVICE_IDS, None)
        return env
    if platform != "gpu" or devices is None:
        raise ValueError(f"process_env: platform {platform!r} with devices {devices!r}")
    names = visible_ids(base, gpus)
    env["JAX_PLATFORMS"] = GPU_PLATFORM
    env["CUDA_VISIBLE_DEVICES"] = ",".join(names[d] for d in devices)
    env[LOCAL_DEVICE_IDS] = ",".join(str(i) for i in range(len(devices)))
    return env


def local_device_ids(env: Mapping[str, str]) -> list[int] | None:
    """`PCOMPILE_LOCAL_DEVICE_IDS` as `jax.distributed.initialize(local_device_ids=...)`."""
    text = env.get(LOCAL_DEVICE_IDS, "").strip()
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise PcompileError(f"{LOCAL_DEVICE_IDS}={text!r} is not a list of integers like "
                            "0,1") from None


_PROBE = ("import jax\n"
          "try:\n"
          "    print(len(jax.devices('gpu')))\n"
          "except RuntimeError:\n"
          "    print(0)\n")


def _gpu_plugin_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None
               for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm_plugin",
                            "jax_rocm60_plugin", "jax_plugins"))


def count_gpus(env: Mapping[str, str] | None = None, timeout: float = 120.0) -> int:
    """How many GPUs JAX sees, counted in a child process (this one initialises no GPU
    backend). 0 without a JAX GPU plugin, or when the child cannot tell."""
    if not _gpu_plugin_installed():
        return 0
    child = dict(os.environ if env is None else env)
    child.pop("JAX_PLATFORMS", None)
    child["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the probe holds no GPU memory
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=child, capture_output=True,
                              text=True, timeout=timeout, check=False)
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def resolve_platform(platform: str, counter: Callable[[], int] = count_gpus) -> tuple[str, int]:
    """(`cpu` or `gpu`, visible GPUs) for `--platform`; `gpu` without a GPU is refused."""
    if platform not in PLATFORMS:
        raise PcompileError(f"--platform {platform!r}: expected one of {', '.join(PLATFORMS)}")
    if platform == "cpu":
        return "cpu", 0
    gpus = counter()
    if platform == "gpu" and gpus == 0:
        raise PcompileError("--platform gpu: JAX sees no GPU on this machine (is a JAX GPU "
                            "plugin installed, e.g. `pip install jax[cuda12]`, and is "
                            "CUDA_VISIBLE_DEVICES right?); --platform cpu runs on CPU devices")
    return ("gpu" if gpus else "cpu"), gpus


def pin_parent_to_cpu() -> None:
    """This process (compile, check, in-process runs) computes with JAX on CPU only: set before
    JAX initialises a backend; a no-op when it already runs on CPU only."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" not in sys.modules:
        return
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # a backend is initialised already: it must be CPU
        pass
    backends = initialised_backends()
    if backends - {"cpu"}:
        raise PcompileError(f"JAX already initialised {sorted(backends)} in this process; run "
                            "pcompile in a fresh process")


def initialised_backends() -> set[str]:
    """The JAX backends this process has initialised (empty when none, or JAX not loaded)."""
    if "jax" not in sys.modules:
        return set()
    try:
        from jax._src import xla_bridge
    except ImportError:
        return set()
    return set(getattr(xla_bridge, "_backends", {}) or {})
