"""One XLA compilation of a rank program for all the processes of a `jax.distributed` run.

Every process of an SPMD run compiles the same program (same HLO, same global device
assignment): N times the same work, on the same cores when the processes share a host (the
CPU runs of the tests, the GPUs of one node). `SharedStep` compiles it once:
process 0 lowers and compiles the step on its first call, serialises the executable
(`jax.experimental.serialize_executable`) and publishes it in the distributed runtime's
key-value store; every other process lowers the step itself (cheap: it checks that the
arguments are the ones compiled for) and loads the published executable instead of compiling.

**Trust.** Loading an executable unpickles it, and the coordinator's key-value store does not
authenticate who writes into it. So process 0 publishes, beside the executable, a digest of
its bytes bound to this run (the step's key, which holds the plan's id, the coordinator's
address and the number of processes), and every other process checks it before deserialising,
refusing with one message (`SharedExecutableError`) on a mismatch:

* with a shared secret (`PCOMPILE_SHARE_KEY`, which the launcher sets to a fresh random value
  for each run, in the environment of its ranks only) the digest is an HMAC-SHA256 under it:
  a writer that does not hold the secret cannot forge it;
* without one, the executable is shared only when the coordinator is on the loopback (the
  rank program then binds it there, backends/cluster.py, so the store is out of the network's
  reach), with a plain SHA-256: it catches a damaged or mixed-up executable, but not another
  local user who writes both the executable and its digest into the store;
* without a secret and with a coordinator other hosts can reach (mpirun, SLURM, a routable
  `--coordinator`), nothing is shared: every process compiles its own. Give every process the
  same `PCOMPILE_SHARE_KEY` to share it there.

Where an executable cannot be serialised (a backend without the support, constants hoisted
out of the program), process 0 publishes an empty value and every process compiles on its own,
as without sharing. A single-process run compiles as usual, and so does every process with
`PCOMPILE_SHARE_EXECUTABLE=0` (hosts whose devices differ, so that one executable does not
fit all).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from typing import Any

from pcompile.backends.jax.rank_process import RankError

log = logging.getLogger(__name__)

#: How long a process waits for process 0's executable (ms): process 0 may be compiling a
#: large program on shared cores; the rank runtime's own watchdog bounds the first step anyway.
WAIT_MS = 3_600_000
#: The secret the digest is keyed with (the launcher sets a fresh one for every run).
SHARE_KEY_ENV = "PCOMPILE_SHARE_KEY"


class SharedExecutableError(RankError):
    """The executable in the key-value store is not the one process 0 published."""


def _global_state() -> Any:
    """JAX's distributed state, or None outside a multi-process run (or with sharing off)."""
    import os

    import jax

    if jax.process_count() == 1 or os.environ.get("PCOMPILE_SHARE_EXECUTABLE") == "0":
        return None
    try:  # JAX keeps the client in a private module: without it, every process compiles
        from jax._src import distributed
    except ImportError:
        return None
    state = distributed.global_state
    return state if getattr(state, "client", None) is not None else None


def _client() -> Any:
    """The distributed runtime's key-value client, or None outside a multi-process run."""
    state = _global_state()
    return None if state is None else state.client


def share_key() -> bytes | None:
    """What the digest is keyed with: the shared secret, b"" for a plain SHA-256 (no secret, a
    coordinator on the loopback), None when the executable must not be shared (no secret, a
    coordinator other hosts can reach): module docstring."""
    import os

    from pcompile.backends.cluster import is_loopback

    secret = os.environ.get(SHARE_KEY_ENV)
    if secret:
        return secret.encode("utf-8")
    state = _global_state()
    if state is not None and is_loopback(getattr(state, "coordinator_address", None)):
        return b""
    return None


def digest(payload: bytes, key: str, secret: bytes, run: str) -> str:
    """The hex digest of an executable's bytes bound to its key and to the run: HMAC-SHA256
    under `secret`, or SHA-256 when `secret` is empty."""
    message = b"\0".join([b"pcompile-executable/1", key.encode(), run.encode()]) + b"\0"
    if secret:
        mac = hmac.new(secret, message, hashlib.sha256)
        mac.update(payload)
        return mac.hexdigest()
    return hashlib.sha256(message + payload).hexdigest()


def _run_id() -> str:
    import jax

    state = _global_state()
    address = getattr(state, "coordinator_address", None) if state is not None else None
    return f"{address}/{jax.process_count()}"


_made = 0  # SharedSteps made by this process: every process makes them in the same order


class SharedStep:
    """`jitted` (a `jax.jit` function), compiled once for all processes on its first call
    (`name`: what it is, for the key); later calls run the executable."""

    def __init__(self, jitted: Any, name: str) -> None:
        global _made
        _made += 1
        self.jitted = jitted
        self.key = f"{_made}/{name}"
        self.compiled: Any = None
        self.shared = False  # whether this process loaded process 0's executable
        self.compile_seconds = 0.0  # lowering and compiling (or loading process 0's)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            start = time.perf_counter()
            self.compiled = self._compile(args)
            self.compile_seconds = time.perf_counter() - start
        return self.compiled(*args)

    def _compile(self, args: tuple[Any, ...]) -> Any:
        import jax
        from jax.experimental.serialize_executable import deserialize_and_load, serialize

        lowered = self.jitted.lower(*args)
        client = _client()
        if client is None:
            return lowered.compile()
        key = f"pcompile/executable/{self.key}"
        secret = share_key()
        if jax.process_index() == 0:
            compiled = lowered.compile()
            payload = b""
            if secret is None:
                log.info("the coordinator is reachable from other hosts and %s is not set: "
                         "every process compiles the step itself", SHARE_KEY_ENV)
            else:
                try:
                    payload, _, _ = serialize(compiled)
                except (ValueError, NotImplementedError) as exc:
                    log.info("the step's executable cannot be shared (%s); every process "
                             "compiles it", exc)
                    payload = b""
            # The digest first: a process that sees the executable finds its digest there.
            client.key_value_set(f"{key}/digest", digest(payload, key, secret or b"",
                                                         _run_id()))
            client.key_value_set_bytes(key, payload)
            return compiled
        if secret is None:  # process 0 publishes nothing to share either (same coordinator)
            return lowered.compile()
        payload = client.blocking_key_value_get_bytes(key, WAIT_MS)
        if not payload:
            return lowered.compile()
        published = client.blocking_key_value_get(f"{key}/digest", WAIT_MS)
        if not hmac.compare_digest(str(published), digest(payload, key, secret, _run_id())):
            keyed = (f"HMAC-SHA256 keyed with {SHARE_KEY_ENV}" if secret
                     else "SHA-256")
            raise SharedExecutableError(
                f"the compiled step in the coordinator's key-value store ({key}, "
                f"{len(payload)} bytes) does not match the digest process 0 published with it "
                f"({keyed}); refusing to load it. Something other than process 0 wrote into "
                f"this job's store, or the processes were started with different "
                f"{SHARE_KEY_ENV} values or different plans. Start the job again "
                "(PCOMPILE_SHARE_EXECUTABLE=0 makes every process compile its own)")
        compiled = deserialize_and_load(payload, lowered.in_tree, lowered.out_tree)
        self.shared = True
        return compiled
