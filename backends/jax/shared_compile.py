"""One XLA compilation of a rank program for all the processes of a `jax.distributed` run.

Every process of an SPMD run compiles the same program (same HLO, same global device
assignment): N times the same work, on the same cores when the processes share a host (the
CPU runs of the tests, the GPUs of one node). `SharedStep` compiles it once:
process 0 lowers and compiles the step on its first call, serialises the executable
(`jax.experimental.serialize_executable`) and publishes it in the distributed runtime's
key-value store; every other process lowers the step itself (cheap: it checks that the
arguments are the ones compiled for) and loads the published executable instead of compiling.

Where an executable cannot be serialised (a backend without the support, constants hoisted
out of the program), process 0 publishes an empty value and every process compiles on its own,
as without sharing. A single-process run compiles as usual, and so does every process with
`PCOMPILE_SHARE_EXECUTABLE=0` (hosts whose devices differ, so that one executable does not
fit all).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: How long a process waits for process 0's executable (ms): process 0 may be compiling a
#: large program on shared cores; the rank runtime's own watchdog bounds the first step anyway.
WAIT_MS = 3_600_000


def _client() -> Any:
    """The distributed runtime's key-value client, or None outside a multi-process run."""
    import os

    import jax

    if jax.process_count() == 1 or os.environ.get("PCOMPILE_SHARE_EXECUTABLE") == "0":
        return None
    try:  # JAX keeps the client in a private module: without it, every process compiles
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed.global_state, "client", None)


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

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            self.compiled = self._compile(args)
        return self.compiled(*args)

    def _compile(self, args: tuple[Any, ...]) -> Any:
        import jax
        from jax.experimental.serialize_executable import deserialize_and_load, serialize

        lowered = self.jitted.lower(*args)
        client = _client()
        if client is None:
            return lowered.compile()
        key = f"pcompile/executable/{self.key}"
        if jax.process_index() == 0:
            compiled = lowered.compile()
            try:
                payload, _, _ = serialize(compiled)
            except (ValueError, NotImplementedError) as exc:
                log.info("the step's executable cannot be shared (%s); every process "
                         "compiles it", exc)
                payload = b""
            client.key_value_set_bytes(key, payload)
            return compiled
        payload = client.blocking_key_value_get_bytes(key, WAIT_MS)
        if not payload:
            return lowered.compile()
        compiled = deserialize_and_load(payload, lowered.in_tree, lowered.out_tree)
        self.shared = True
        return compiled
