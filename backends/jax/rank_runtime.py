"""What a generated `<out>/rank_<r>/program.py` runs (`main`): process identity,
`jax.distributed`, the rank mesh, then each program's loop. Its rooms:
backends/jax/rank_process.py (command line, identity, errors and exit statuses, heartbeat and
watchdog), backends/jax/rank_loop.py (parameters, data, the training loop, checkpoints) and
backends/jax/rank_report.py (train.log, metrics.jsonl, the start-up line and the summary).

Identity: backends/cluster.py (flags, `PCOMPILE_*`, torchrun, msrun, MindSpore's
`RANK_ID`/`RANK_SIZE`, PMI, then JAX's own cluster detection for Open MPI and SLURM; nothing:
one process runs every rank on N virtual CPU devices). With P processes, process p runs ranks
p*N/P ... (p+1)*N/P - 1 (one each when P = N); started as another rank's program it
re-executes its own rank's program (so `mpirun -n 8 python out/rank_0/program.py` works).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

from pcompile.backends.jax.peer_watch import INTERVAL as PEER_INTERVAL
from pcompile.backends.jax.peer_watch import peer_watch
from pcompile.backends.jax.rank_loop import RankRunner
from pcompile.backends.jax.rank_process import (
    DISK_ERRNOS,
    EXIT_COORDINATOR_PORT,
    EXIT_NONFINITE,
    HEARTBEAT_FD,
    ON_STOP,
    Heartbeat,
    NonFiniteLossError,
    RankError,
    Watchdog,
    chosen_platform,
    exit_on_sigterm,
    output_path,
    parse_args,
    placed_device_ids,
    process_start,
    resolve_identity,
    say_safely,
    write_error,
)


def main(module: ModuleType | Sequence[ModuleType], argv: list[str] | None = None) -> int:
    """Run the rank program `module` (a generated program.py); returns the exit status.
    Several programs of the same number of ranks (a sequence): trained one after the other
    with the same arguments, after one `jax.distributed` start-up (each in its own output
    folder); the first failure ends the process."""
    modules = [module] if isinstance(module, ModuleType) else list(module)
    heartbeat = Heartbeat()

    def label() -> str:  # the ranks this process runs, once it knows them
        return getattr(modules[0], "LABEL", None) or "pcompile rank program"

    watch: dict[str, Any] = {}  # the PeerWatch and AbortGuard of a job started by hand
    try:
        return _main(modules, argv, heartbeat, watch)
    except RankError as exc:
        message, code = f"{label()}: error: {exc}", 2
    except NonFiniteLossError as exc:
        message, code = f"{label()}: error: {exc}", EXIT_NONFINITE
    except KeyboardInterrupt:
        message, code = f"{label()}: interrupted", 130
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            message, code = _failure(exc, label(), watch)
        else:  # a file the run writes (its output, when no other names itself) is full
            what = exc.filename if exc.filename else output_path()
            message, code = f"{label()}: error: {write_error(str(what), exc)}", 2
    except Exception as exc:  # any failure of a rank: report it and leave at once
        message, code = _failure(exc, label(), watch)
    heartbeat.failed(message)
    if "guard" in watch:  # this process says why it ends itself
        watch["guard"].done()
    if "peer" in watch:
        watch["peer"].failed(message)
    say_safely(message)
    # Exit without the interpreter's shutdown: jax.distributed's atexit hook waits for the
    # other processes, which may be stuck in a collective with this one.
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # a full disk under the output
        pass
    os._exit(code)


def _failure(exc: BaseException, label: str, watch: dict[str, Any]) -> tuple[str, int]:
    """The message and status of an unexpected failure. A collective that failed because
    another process of a job started by hand went away is that process's loss, in one line:
    the peer watch names it (and ends this process) within its deadline."""
    peer = watch.get("peer")
    if peer is not None and _collective_failure(exc):
        peer.wait_for_verdict(peer.timeout + 3 * PEER_INTERVAL)
    import traceback

    try:
        traceback.print_exc()
    except (OSError, ValueError):  # a full disk under the output
        pass
    return f"{label}: failed ({type(exc).__name__}: {exc})", 1


#: what XLA's runtime errors say when a collective's peer went away (gloo, NCCL, sockets)
_PEER_GONE = ("gloo", "nccl", "connection", "socket", "peer", "unavailable", "broken pipe")


def _collective_failure(exc: BaseException) -> bool:
    """A runtime error of XLA's that a peer's loss explains (a collective whose peer went
    away), not one of the program's own (out of memory, a bad shape)."""
    text = str(exc).lower()
    return ("gloo" in text or type(exc).__name__ in ("XlaRuntimeError", "JaxRuntimeError")
            and any(word in text for word in _PEER_GONE))


def _main(modules: list[ModuleType], argv: list[str] | None, heartbeat: Heartbeat,
          watch: dict[str, Any]) -> int:
    num_ranks = int(modules[0].NUM_RANKS)
    if any(int(m.NUM_RANKS) != num_ranks for m in modules):
        raise RankError("the programs run by one process must have the same number of ranks: "
                        + ", ".join(f"{m.__file__} has {m.NUM_RANKS}" for m in modules))
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw_argv, num_ranks)
    identity = resolve_identity(args, dict(os.environ))
    if identity.scheduler:
        print(f"pcompile rank program: {identity.source} runs no ranks (pcompile's process 0 "
              "is the coordinator); exiting", file=sys.stderr)
        return 0
    nproc, pid, coordinator = identity.num_processes, identity.process_id, identity.coordinator
    if num_ranks % nproc:
        raise RankError(f"{num_ranks} ranks cannot be spread evenly over {nproc} processes "
                        f"({identity.source})")
    per_process = num_ranks // nproc
    my_ranks = list(range(pid * per_process, (pid + 1) * per_process))
    label = (f"pcompile rank {my_ranks[0]}" if per_process == 1
             else f"pcompile ranks {my_ranks[0]}-{my_ranks[-1]}")
    for module in modules:
        module.LABEL = label  # type: ignore[attr-defined]  # a module takes any attribute
    from pcompile.program.progress import setup_logging

    setup_logging(args.verbose, prefix="" if pid == 0 else f"[rank {my_ranks[0]}] ")

    watchdog = Watchdog(label)
    watchdog.arm(args.startup_timeout, "distributed start-up")
    import jax

    platform = chosen_platform(args)
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    if platform != "gpu" and per_process > 1:  # only CPU devices are virtual
        try:
            jax.config.update("jax_num_cpu_devices", per_process)
        except RuntimeError as exc:  # JAX already initialised in this process
            raise RankError(str(exc)) from exc
    if args.matmul_precision != "default":
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    started = process_start()
    timings = {"start": started, "imports": time.time() - started}
    if nproc > 1:
        if platform != "gpu":  # GPUs talk over NCCL, CPU devices over gloo
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            _gloo_address(coordinator)
        kwargs: dict[str, Any] = {"initialization_timeout": int(args.startup_timeout)}
        if coordinator is not None:
            from pcompile.backends.cluster import bind_kwargs

            kwargs.update(coordinator_address=coordinator, num_processes=nproc, process_id=pid)
            kwargs.update(bind_kwargs(coordinator))  # all local: listen on the loopback only
        local_ids = placed_device_ids()
        if local_ids is not None:  # the launcher's placement (else JAX's: by local rank)
            kwargs["local_device_ids"] = local_ids
        # else: JAX's own cluster detection (SLURM, Open MPI) finds everything
        if pid != 0 and not os.environ.get(HEARTBEAT_FD) and args.heartbeat_timeout > 0:
            # started by hand: process 0's death is one line, not jaxlib's C++ abort
            from pcompile.backends.jax.abort_guard import start_abort_guard

            guard = start_abort_guard(label, _process_name(0, per_process), coordinator,
                                      per_process, verbose=args.verbose > 0)
            if guard is not None:
                watch["guard"] = guard
        heartbeat.set(phase="connect")
        connecting = time.perf_counter()
        startup = None
        if coordinator is not None and not os.environ.get(HEARTBEAT_FD):
            # started by hand: a process that never connects is named, or at least counted
            from pcompile.backends.jax.startup_watch import StartupWatch

            startup = StartupWatch(pid, nproc, coordinator, label, _process_name(0, per_process),
                                   args.heartbeat_timeout, say_safely,
                                   explain=watchdog.explain).start()
        try:
            jax.distributed.initialize(**kwargs)
        except Exception as exc:
            if pid == 0 and "Failed to start RPC server" in str(exc):
                print(f"{label}: error: the coordinator cannot listen on "
                      f"{coordinator} (address in use?): {exc}", file=sys.stderr)
                return EXIT_COORDINATOR_PORT
            raise
        finally:
            if startup is not None:
                startup.stop()
                watchdog.explain("")
        timings["distributed"] = time.perf_counter() - connecting
        exit_on_sigterm(label)
        if jax.process_index() != pid:
            raise RankError(f"JAX numbers this process {jax.process_index()}, expected {pid} "
                            f"({identity.source})")
        # started by hand, the processes watch each other (the launcher watches its own)
        peer = peer_watch(pid, nproc, per_process, label, coordinator, args.heartbeat_timeout)
        if peer is not None:
            watch["peer"] = peer
            ON_STOP.append(peer.failed)
            if "guard" in watch:  # the watch's own line comes first: the helper says nothing
                peer.before_exit.append(watch["guard"].done)
    code = _train(modules, args, num_ranks, my_ranks, watchdog, heartbeat, timings)
    if "guard" in watch:
        watch["guard"].done()
    if "peer" in watch:
        watch["peer"].finished()
    return code


def _process_name(process: int, per_process: int) -> str:
    """`process p (rank r)` or `process p (ranks r-s)`, as the peer watch names them."""
    first = process * per_process
    ranks = (f"rank {first}" if per_process == 1
             else f"ranks {first}-{first + per_process - 1}")
    return f"process {process} ({ranks})"


class _GlooAt:
    """jaxlib's module as JAX's CPU backend sees it, whose gloo collectives bind and advertise
    `address` (backends/cluster.py `collectives_address`) unless told otherwise."""

    def __init__(self, real: Any, address: str) -> None:
        self._real = real
        self._address = address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def make_gloo_tcp_collectives(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 2 and kwargs.get("hostname") is None and kwargs.get("interface") is None:
            kwargs["hostname"] = self._address
        return self._real.make_gloo_tcp_collectives(*args, **kwargs)


def _gloo_address(coordinator: str | None) -> None:
    """With a routable coordinator, gloo uses the address this host reaches it from, not the
    one its host name resolves to (often the loopback, which the other hosts cannot reach).
    Where this JAX makes its gloo collectives otherwise, nothing changes."""
    from pcompile.backends.cluster import collectives_address

    address = collectives_address(coordinator)
    if address is None:
        return
    try:
        from jax._src import xla_bridge
    except ImportError:
        return
    real = getattr(xla_bridge, "_jax", None)
    make = getattr(real, "make_gloo_tcp_collectives", None)
    if make is None or "hostname" not in (make.__doc__ or "") or isinstance(real, _GlooAt):
        return
    xla_bridge._jax = _GlooAt(real, address)


def _train(modules: list[ModuleType], args: SimpleNamespace, num_ranks: int,
           my_ranks: list[int], watchdog: Watchdog, heartbeat: Heartbeat,
           timings: dict[str, float] | None = None) -> int:
    import jax

    from pcompile.backends.jax.plan import MeshSpec
    from pcompile.backends.jax.spmd import make_mesh, rank_devices

    code = 0
    for module in modules:
        # `<out>/program.py` runs any rank (RANK is None); `<out>/rank_<r>/program.py` is the
        # same program commented with rank r's values.
        out_dir = os.path.dirname(os.path.abspath(str(module.__file__)))
        if module.RANK is not None:
            out_dir = os.path.dirname(out_dir)
        spec = MeshSpec(tuple(n for n, _ in module.MESH), tuple(s for _, s in module.MESH))
        mesh = make_mesh(spec, rank_devices(num_ranks))
        local = [r for r, d in enumerate(mesh.devices.flat)
                 if d.process_index == jax.process_index()]
        if local != my_ranks:
            raise RankError(f"this process owns devices of ranks {local}, expected {my_ranks}")
        watchdog.arm(args.startup_timeout, "start-up")
        code = RankRunner(module, mesh, local, out_dir, args, watchdog, heartbeat,
                       dict(timings or {})).run()
        if code:
            break
        timings = None  # the next program's start-up is its own: no imports, no start-up
    # jax.distributed's exit waits for every process; do not wait for ever.
    watchdog.arm(args.timeout, "shutdown")
    return code
