"""Small cross-process agreements through JAX's coordination service.

Every exchange goes through the key-value store of the coordination service
(the one `jax.distributed.initialize` starts) with a timeout, so a process
that never arrives — crashed, or running a different program — turns into a
`ClusterTimeoutError` naming it, never a silent hang in a collective.

A process that will never arrive is named at once instead: one that ended
(`mark_exit`: its program finished, or failed) or whose main thread waits
in another exchange that this process has not reached (each waits for the
other: `if strategy.is_chief: model.save(...)` while the others went on to
`fit`). A main thread whose exchange takes longer than `_SLICE_MS` says
where it waits (`keras_dist/at/<process>`), which its peers read.
"""

import contextlib
import json
import threading
import time
from typing import Any

import jax

from keras_dist._private_api import _jax_private
from keras_dist.errors import ClusterTimeoutError, ProcessMismatchError

__all__ = [
    "DEFAULT_TIMEOUT",
    "allgather",
    "broadcast_from_chief",
    "channel",
    "mark_exit",
    "multi_process",
    "peers_failed",
    "set_timeout",
    "wait_for_exits",
]

# How long a wait runs before it looks for peers that will never arrive.
_SLICE_MS = 1000

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


def allgather(
    name: str, value: Any, *, timeout: float | None = None, rule: str = ""
) -> list:
    """Every process's `value` (JSON-able), indexed by process, on every process.

    Processes must call it with the same `name` the same number of times (the
    exchanges are numbered per name).

    Args:
        name: the exchange (numbered per name).
        value: this process's part.
        timeout: seconds to wait for every process; defaults to
            `CommunicationOptions.timeout_seconds` (300).
        rule: what every process must do here, for the error's message.

    Raises:
        ClusterTimeoutError: if a process does not reach this exchange within
            `timeout` seconds.
        ProcessMismatchError: at once, if a process that has not reached it
            ended, or waits in another exchange this process has not reached.
    """
    if not multi_process():
        return [value]
    timeout = _TIMEOUT["seconds"] if timeout is None else timeout
    count = _COUNTERS[name] = _COUNTERS.get(name, 0) + 1
    prefix = f"keras_dist/{name}/{count}/"
    client = _client()
    client.key_value_set(prefix + str(jax.process_index()), json.dumps(value))
    wait = _Wait(client, name, count, timeout, rule)
    try:
        values = [
            json.loads(wait.get(process)) for process in range(jax.process_count())
        ]
    finally:
        wait.done()
    # Everyone has read the previous exchange of this name (they wrote this one
    # after reading it): drop our key of it, so the store does not grow.
    if count > 1:
        with contextlib.suppress(Exception):
            client.key_value_delete(
                f"keras_dist/{name}/{count - 1}/{jax.process_index()}"
            )
    return values


class _Wait:
    """One process's wait in exchange `name` #`count`, in slices."""

    def __init__(self, client, name: str, count: int, timeout: float, rule: str):
        self.client, self.name, self.count, self.rule = client, name, count, rule
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.me = jax.process_index()
        self.main = threading.current_thread() is threading.main_thread()
        self.said_where = False

    def get(self, process: int) -> str:
        key = f"keras_dist/{self.name}/{self.count}/{process}"
        while True:
            left_ms = int((self.deadline - time.monotonic()) * 1000)
            try:
                return self.client.blocking_key_value_get(
                    key, max(1, min(left_ms, _SLICE_MS))
                )
            except Exception as error:  # JAX raises its own XlaRuntimeError.
                if left_ms <= _SLICE_MS:
                    raise self._timed_out(process, error) from error
            self._say_where()
            self._check_absent()

    def _say_where(self) -> None:
        if self.main and not self.said_where:
            self.said_where = True
            self.client.key_value_set(
                f"keras_dist/at/{self.me}", f"{self.name}/{self.count}"
            )

    def done(self) -> None:
        if self.said_where:
            with contextlib.suppress(Exception):
                self.client.key_value_delete(f"keras_dist/at/{self.me}")

    def _check_absent(self) -> None:
        """Raises if a process that has not arrived never will."""
        absent = {}
        for process in range(jax.process_count()):
            if _try_get(self.client, f"keras_dist/{self.name}/{self.count}/{process}"):
                continue
            ended = _try_get(self.client, f"keras_dist/exited/{process}")
            if ended is not None:
                absent[process] = f"{ended} without reaching it"
                continue
            where = _try_get(self.client, f"keras_dist/at/{process}")
            if self.main and where is not None and not self._reached(where):
                absent[process] = f"waits at `{where.rsplit('/', 1)[0]}` instead"
        if absent:
            raise self._not_called(absent)

    def _reached(self, where: str) -> bool:
        """Whether this process has reached (or passed) the exchange `where`."""
        name, _, count = where.rpartition("/")
        return _COUNTERS.get(name, 0) >= int(count)

    def _not_called(self, absent: dict) -> ProcessMismatchError:
        found = "; ".join(f"process {p} {why}" for p, why in sorted(absent.items()))
        return ProcessMismatchError(
            f"Process {self.me} of {jax.process_count()} waits at `{self.name}`, "
            f"which not every process reached: {found}. "
            + (self.rule or "Every process must run the same program.")
        )

    def _timed_out(self, process: int, error: Exception) -> ClusterTimeoutError:
        return ClusterTimeoutError(
            f"Process {process} did not reach `{self.name}` within "
            f"{self.timeout:g} s (this is process {self.me} of "
            f"{jax.process_count()}): {str(error)[:200]}. Every process must run "
            "the same program; check the log of that process (it may have failed "
            "or be stuck). " + self.rule
        ).with_traceback(None)


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception:  # Not found: JAX raises its XlaRuntimeError.
        return None


def mark_exit(how: str, *, within: float | None = None) -> None:
    """Tells the other processes this one has ended (`how`: "finished its
    program", "failed with ValueError, at step 12", "lost a peer"), so that
    their waits for it end at once; `within` seconds at most (a failing
    process: the coordination service may be the silent one)."""
    if not multi_process():
        return
    client = _jax_private.coordination_client()
    if client is None:
        return
    key = f"keras_dist/exited/{jax.process_index()}"

    def mark() -> None:
        with contextlib.suppress(Exception):
            client.key_value_set(key, how, allow_overwrite=True)

    _bounded(mark, within)


def _bounded(call, within: float | None) -> None:
    """`call()`, or, with `within`, on a daemon thread for at most that long."""
    if within is None:
        call()
        return
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(within)


def peers_failed(*, within: float) -> list[int]:
    """The other processes that ended on an error of their own (`mark_exit`
    "failed ..."; not "lost a peer"), as the coordination service says within
    `within` seconds (none if it does not answer)."""
    client = _jax_private.coordination_client()
    if not multi_process() or client is None:
        return []
    found: list[int] = []

    def read() -> None:
        with contextlib.suppress(Exception):
            for key, how in client.key_value_dir_get("keras_dist/exited/"):
                process = int(key.rsplit("/", 1)[-1])
                if how.startswith("failed") and process != jax.process_index():
                    found.append(process)

    _bounded(read, within)
    return sorted(found)


def wait_for_exits(seconds: float) -> list[int]:
    """Waits up to `seconds` for every other process to `mark_exit`; returns
    those that did not.

    Process 0 hosts JAX's coordination service: when it ends, JAX aborts
    every other process at its next poll (SIGABRT), perhaps before that
    process has printed the error it was raising too (an error the
    processes agreed on is raised on all of them at once). So process 0,
    failing, lets its peers end first, for a bounded time.
    """
    if not multi_process():
        return []
    client = _jax_private.coordination_client()
    if client is None:
        return []
    me = jax.process_index()
    waiting = [p for p in range(jax.process_count()) if p != me]
    deadline = time.monotonic() + seconds
    while waiting and time.monotonic() < deadline:
        waiting = [
            p for p in waiting if _try_get(client, f"keras_dist/exited/{p}") is None
        ]
        if waiting:
            time.sleep(0.05)
    return waiting


def broadcast_from_chief(name: str, value: Any, *, timeout: float | None = None):
    """The chief's (process 0's) `value`, on every process."""
    return allgather(name, value, timeout=timeout)[0]
