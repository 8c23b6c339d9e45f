"""Small cross-process agreements through JAX's coordination service.

Every exchange goes through the key-value store of the coordination service
(the one `jax.distributed.initialize` starts) with a timeout, so a process
that never arrives — crashed, or running a different program — turns into a
`ClusterTimeoutError` naming it, never a silent hang in a collective.
"""

import contextlib
import json
import time
from typing import Any

import jax

from keras_dist._keras_compat import _jax_private
from keras_dist.errors import ClusterTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "allgather",
    "broadcast_from_chief",
    "channel",
    "multi_process",
    "set_timeout",
]

DEFAULT_TIMEOUT = 300.0
_TIMEOUT = {"seconds": DEFAULT_TIMEOUT}
_COUNTERS: dict[str, int] = {}


def set_timeout(seconds: float) -> None:
    """The default wait of every exchange (`CommunicationOptions.timeout_seconds`)."""
    _TIMEOUT["seconds"] = float(seconds)


def channel(kind: str) -> str:
    """A new exchange name for one input pass or iterator.

    Channels are numbered in creation order, which is the same on every
    process (they are created by the same program on the main thread), so
    iterators whose exchanges run on prefetch threads never mix them up.
    """
    count = _COUNTERS[f"channel:{kind}"] = _COUNTERS.get(f"channel:{kind}", 0) + 1
    return f"{kind}-{count}"


def multi_process() -> bool:
    return jax.process_count() > 1


def _client():
    client = _jax_private.coordination_client()
    if client is None:
        raise RuntimeError(
            "This process has several JAX processes but no coordination client; "
            "join the cluster with `kd.cluster.initialize()` (or create a "
            "`MultiWorkerMirroredStrategy`) first."
        )
    return client


def allgather(name: str, value: Any, *, timeout: float | None = None) -> list:
    """Every process's `value` (JSON-able), indexed by process, on every process.

    Processes must call it with the same `name` the same number of times (the
    exchanges are numbered per name).

    Raises:
        ClusterTimeoutError: if a process does not reach this exchange within
            `timeout` seconds.
    """
    if not multi_process():
        return [value]
    timeout = _TIMEOUT["seconds"] if timeout is None else timeout
    count = _COUNTERS[name] = _COUNTERS.get(name, 0) + 1
    prefix = f"keras_dist/{name}/{count}/"
    client = _client()
    client.key_value_set(prefix + str(jax.process_index()), json.dumps(value))
    values = []
    deadline = time.monotonic() + timeout
    for process in range(jax.process_count()):
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            raw = client.blocking_key_value_get(prefix + str(process), left_ms)
        except Exception as error:  # JAX raises its own XlaRuntimeError here.
            raise ClusterTimeoutError(
                f"Process {process} did not reach `{name}` within {timeout:g} s "
                f"(this is process {jax.process_index()} of {jax.process_count()}): "
                f"{str(error)[:200]}. Every process must run the same program; "
                "check the log of that process (it may have failed or be stuck)."
            ) from error
        values.append(json.loads(raw))
    # Everyone has read the previous exchange of this name (they wrote this one
    # after reading it): drop our key of it, so the store does not grow.
    if count > 1:
        with contextlib.suppress(Exception):
            client.key_value_delete(
                f"keras_dist/{name}/{count - 1}/{jax.process_index()}"
            )
    return values


def broadcast_from_chief(name: str, value: Any, *, timeout: float | None = None):
    """The chief's (process 0's) `value`, on every process."""
    return allgather(name, value, timeout=timeout)[0]
