"""Which process of a multi-process job this is: the launcher conventions a rank program honours.

`resolve_identity(flags, env)` reads, first found wins:

1. flags `--num-processes N --process-id I [--coordinator HOST:PORT]`;
2. `PCOMPILE_NUM_PROCESSES` / `PCOMPILE_PROCESS_ID` (`PCOMPILE_COORDINATOR`);
3. torchrun: `WORLD_SIZE` / `RANK`, coordinator `MASTER_ADDR:MASTER_PORT` (the port after
   `MASTER_PORT` under torchrun's elastic agent, which serves its own store on `MASTER_PORT`);
4. msrun / MindSpore dynamic cluster: `MS_WORKER_NUM` / `MS_NODE_ID` with `MS_ROLE=MS_WORKER`,
   coordinator `MS_SCHED_HOST:MS_SCHED_PORT` (the `MS_SCHED` process has nothing to run);
5. MindSpore's `RANK_SIZE` / `RANK_ID`, coordinator from 2 or 3;
6. PMI (MPICH, Intel MPI): `PMI_SIZE` / `PMI_RANK`, coordinator from 2 or 3;
7. JAX's own cluster detection (`jax.distributed`'s cluster environments: Open MPI 4, SLURM,
   ...), which also finds the coordinator unless `PCOMPILE_COORDINATOR` names one;
8. Open MPI that JAX does not detect (Open MPI 5): `OMPI_COMM_WORLD_SIZE` /
   `OMPI_COMM_WORLD_RANK`, coordinator from 2 or 3;
9. nothing: one process.

From 3 on, every convention present must agree on the number of processes and this process's
id, and a world size pcompile cannot use (one without its rank variable, or from a launcher it
does not know) is refused: a process never runs every rank on its own while others do too.

Where process 0's coordinator listens (`coordinator_bind_address`): JAX binds every interface
by default (`[::]:PORT`), which a job over several hosts needs. A coordinator address on the
loopback (`127.0.0.1:PORT`, `localhost:PORT`, `[::1]:PORT`: the launcher's, or a local run by
hand) means every process is on this machine, since no other host can reach that address:
then it listens on that address only, out of reach of the network. Under mpirun or SLURM
(JAX's cluster detection) or with a routable address nothing changes.

Which address gloo (CPU collectives between processes) uses (`collectives_address`): gloo
binds and advertises the address its host name resolves to, and many hosts map their name to
the loopback (`127.0.1.1` on Debian): the other hosts then cannot reach it. With a routable
coordinator, a process uses the address it reaches the coordinator from instead.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass


class IdentityError(Exception):
    """The environment describes a job pcompile cannot join (one clear message)."""


@dataclass(frozen=True)
class Identity:
    num_processes: int
    process_id: int
    coordinator: str | None  # None with jax_detects: jax.distributed finds it
    source: str
    jax_detects: bool = False
    scheduler: bool = False  # msrun's MS_SCHED process: no ranks to run


@dataclass(frozen=True)
class _Found:
    size: int
    rank: int
    source: str
    coordinator: str | None = None
    jax_detects: bool = False


# World sizes set by launchers whose rank variables pcompile does not read.
_UNSUPPORTED = ("MV2_COMM_WORLD_SIZE", "JSM_NAMESPACE_SIZE", "HOROVOD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")
_HOW = ("set PCOMPILE_NUM_PROCESSES, PCOMPILE_PROCESS_ID and PCOMPILE_COORDINATOR (or pass "
        "--num-processes, --process-id, --coordinator); see docs/running.md")


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise IdentityError(f"environment variable {name}={value!r} is not an integer") from None


def _master(env: Mapping[str, str], torchrun: bool = False) -> str | None:
    addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT")
    if not addr or port is None:
        return None
    if torchrun and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        port += 1  # torchrun's agent serves its TCPStore on MASTER_PORT itself
    return f"{addr}:{port}"


def _pair(env: Mapping[str, str], size_var: str, rank_var: str, what: str,
          coordinator: str | None) -> _Found | None:
    size, rank = _int(env, size_var), _int(env, rank_var)
    if size is None and rank is None:
        return None
    if size is None or rank is None:
        have, lack = (size_var, rank_var) if size is not None else (rank_var, size_var)
        raise IdentityError(
            f"{what}: {have}={env[have]} is set but {lack} is not, so pcompile cannot tell "
            f"which process this is; {_HOW}")
    return _Found(size, rank, f"{what} ({size_var}={size}, {rank_var}={rank})", coordinator)


def _msrun(env: Mapping[str, str]) -> _Found | None | str:
    role = env.get("MS_ROLE")
    if role is None and env.get("MS_WORKER_NUM") is None:
        return None
    if role == "MS_SCHED":
        return "scheduler"
    size = _int(env, "MS_WORKER_NUM")
    if role not in (None, "MS_WORKER") or size is None:
        raise IdentityError(f"msrun: MS_ROLE={role!r} with MS_WORKER_NUM="
                            f"{env.get('MS_WORKER_NUM')!r} is not a worker pcompile can run; "
                            f"{_HOW}")
    rank = _int(env, "MS_NODE_ID")
    if rank is None:
        rank = _int(env, "RANK_ID")
    if rank is None:
        raise IdentityError(
            f"msrun: MS_WORKER_NUM={size} but no fixed rank (MS_NODE_ID is unset: msrun lets "
            "its scheduler number the workers, which pcompile does not use); start msrun with "
            f"--node_rank, or {_HOW}")
    host, port = env.get("MS_SCHED_HOST"), _int(env, "MS_SCHED_PORT")
    coordinator = f"{host}:{port}" if host and port is not None else None
    return _Found(size, rank, f"msrun (MS_WORKER_NUM={size}, MS_NODE_ID={rank})", coordinator)


def jax_cluster() -> _Found | None:
    """The job JAX's `jax.distributed` cluster detection sees (Open MPI, SLURM, ...), if any."""
    try:
        from jax._src import clusters
    except ImportError:  # a JAX without the cluster registry: nothing detected
        return None
    for env in getattr(clusters.ClusterEnv, "_cluster_types", []):
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if not env.is_env_present():
                continue
            size, rank = int(env.get_process_count()), int(env.get_process_id())
        except Exception:  # noqa: BLE001  (a half-present environment is not a cluster)
            continue
        name = getattr(env, "name", "") or env.__name__
        return _Found(size, rank, f"{name} (JAX cluster detection)", None, jax_detects=True)
    return None


def resolve_identity(num_processes: int | None, process_id: int | None,
                     coordinator: str | None, env: Mapping[str, str],
                     detect: bool = True) -> Identity:
    """This process's place in the job (module docstring); `detect=False` skips JAX's cluster
    detection (which reads the real environment)."""
    coordinator = coordinator or env.get("PCOMPILE_COORDINATOR") or None
    if num_processes is not None or process_id is not None:
        if num_processes is None or process_id is None:
            raise IdentityError("give both --num-processes and --process-id")
        return _checked(Identity(num_processes, process_id, coordinator, "flags"))
    own = _pair(env, "PCOMPILE_NUM_PROCESSES", "PCOMPILE_PROCESS_ID", "PCOMPILE_* environment",
                coordinator)
    if own is not None:
        return _checked(Identity(own.size, own.rank, coordinator, own.source))
    msrun = _msrun(env)
    if msrun == "scheduler":
        return Identity(1, 0, None, "msrun (MS_ROLE=MS_SCHED)", scheduler=True)
    master = _master(env)
    found = [f for f in (
        _pair(env, "WORLD_SIZE", "RANK", "torchrun", _master(env, torchrun=True)),
        msrun if isinstance(msrun, _Found) else None,
        _pair(env, "RANK_SIZE", "RANK_ID", "MindSpore", master),
        _pair(env, "PMI_SIZE", "PMI_RANK", "PMI", master),
        jax_cluster() if detect else None,
        # Open MPI that JAX does not detect (Open MPI 5 has no OMPI_MCA_orte_hnp_uri):
        _pair(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI", master),
    ) if f is not None]
    multi = [f for f in found if f.size > 1]
    if not multi:
        for var in _UNSUPPORTED:
            size = _int(env, var)
            if size is not None and size > 1:
                raise IdentityError(
                    f"{var}={size}: this process is one of {size} started by a launcher whose "
                    f"rank variables pcompile does not read; {_HOW}")
        return Identity(1, 0, coordinator, found[0].source if found else "single process")
    first = multi[0]
    for other in found:
        if (other.size, other.rank) != (first.size, first.rank):
            raise IdentityError(
                f"launchers disagree: {first.source} but {other.source}; {_HOW}")
    where = coordinator or first.coordinator
    if where is None and not first.jax_detects:
        raise IdentityError(
            f"{first.source}: {first.size} processes but no coordinator address; set "
            "PCOMPILE_COORDINATOR=HOST:PORT (or MASTER_ADDR and MASTER_PORT): the address "
            "process 0 listens on")
    return _checked(Identity(first.size, first.rank, where, first.source,
                             jax_detects=where is None))


def _checked(identity: Identity) -> Identity:
    if identity.num_processes < 1 or not 0 <= identity.process_id < identity.num_processes:
        raise IdentityError(f"process id {identity.process_id} is not in "
                            f"[0, {identity.num_processes}) ({identity.source})")
    return identity


def is_loopback(address: str | None) -> bool:
    """Whether HOST:PORT names this machine's loopback (a literal address or `localhost`; no
    name is resolved: a host name may map to 127.0.1.1 here and to a routable address on the
    other hosts of a job)."""
    if not address:
        return False
    if address.startswith("["):  # [IPv6]:PORT
        host = address[1:address.find("]")]
    elif address.count(":") == 1:  # HOST:PORT
        host = address.split(":")[0]
    else:  # a bare host or IPv6 address
        host = address
    host = host.lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def coordinator_bind_address(coordinator: str | None) -> str | None:
    """Where process 0's coordinator listens: the coordinator address itself when it is on the
    loopback (every process is on this machine), else None (JAX's default: every interface,
    which processes on other hosts need)."""
    return coordinator if is_loopback(coordinator) else None


def bind_kwargs(coordinator: str | None) -> dict[str, str]:
    """`jax.distributed.initialize` arguments for `coordinator_bind_address` (empty where JAX's
    default applies, or where this JAX predates the argument)."""
    bind = coordinator_bind_address(coordinator)
    if bind is None:
        return {}
    import inspect

    import jax

    if "coordinator_bind_address" not in inspect.signature(jax.distributed.initialize).parameters:
        return {}
    return {"coordinator_bind_address": bind}


def _split(address: str) -> tuple[str, int] | None:
    """(host, port) of HOST:PORT or [IPv6]:PORT; None without a port."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = address.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def collectives_address(coordinator: str | None) -> str | None:
    """The address of this host that reaches `coordinator` (a routable HOST:PORT), for gloo to
    bind and advertise; None on the loopback (one machine: gloo's default is right), without a
    coordinator, or when no route is found. No packet is sent: a UDP socket is only connected
    (the kernel chooses the source address by its routes)."""
    if not coordinator or is_loopback(coordinator):
        return None
    parts = _split(coordinator)
    if parts is None:
        return None
    try:
        infos = socket.getaddrinfo(parts[0], parts[1], type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, where in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(where)
                local = str(probe.getsockname()[0])
        except OSError:
            continue
        if not ipaddress.ip_address(local.split("%")[0]).is_unspecified:
            return local
    return None
