"""`initialize`: the only caller of `jax.distributed.initialize`."""

import atexit
import math
import os
import re
import sys
from types import TracebackType
from typing import Any

import jax

from keras_dist._backend import backend_started, jax_option, size_cpu_thread_pool
from keras_dist._private_api import _jax_private
from keras_dist.cluster import _heartbeat, _sync
from keras_dist.cluster._environment import check_address, resolve, tell_launcher
from keras_dist.cluster._heartbeat import PeerWatch, timeout_from_environment
from keras_dist.cluster._rendezvous import roll_call
from keras_dist.cluster._resolver import ClusterResolver
from keras_dist.errors import ClusterTimeoutError
from keras_dist_run._health import RESTART_EXIT_CODE

__all__ = ["RESTART_EXIT_CODE", "backend_started", "initialize", "is_initialized"]

_STATE: dict = {}


def is_initialized() -> bool:
    """Whether this process has joined a multi-process JAX cluster.

    Example:

    ```python
    if not kd.cluster.is_initialized():
        kd.cluster.initialize()
    ```
    """
    return bool(_STATE.get("joined")) or jax.process_count() > 1


# How long a failing process 0 waits for its peers to end first.
_PEERS_GRACE_S = 10.0


def _exit_fast_on_errors() -> None:
    """An uncaught exception ends the process at once: status 1, or
    `RESTART_EXIT_CODE` (75) when it is the loss of a peer.

    After `jax.distributed.initialize`, a normal interpreter exit waits (up
    to 300 s) at a shutdown barrier for every peer; a process that failed
    must not wait for peers that will never get there. The launcher (or the
    cluster scheduler) then sees the failure and stops the others. A process
    whose collective or coordination call failed because a peer vanished
    (killed, its host gone) or stopped answering exits 75: nothing wrong
    with its own program, the group must restart; a scheduler's rules can
    retry 75 and fail the job on 1 (docs/guides/failures.md).

    Process 0, whose failure is its own (not a lost peer), first waits up to
    `_PEERS_GRACE_S` for its peers to end: it hosts JAX's coordination
    service, whose end aborts them, and an error the processes agreed on
    (`ProcessMismatchError`) is being raised on each of them too; a peer
    that is not failing learns at its next exchange that process 0 failed.
    """
    previous = sys.excepthook

    def hook(
        kind: type[BaseException],
        value: BaseException,
        traceback: TracebackType | None,
    ) -> None:
        previous(kind, value, traceback)
        lost = lost_a_peer(value)
        _heartbeat.record_failure(kind, value, traceback, lost_a_peer=lost)
        status = RESTART_EXIT_CODE if lost else 1
        if lost and _sync.peers_failed(within=2.0):
            # A peer's own error took it away: a bug, and every process of
            # the job says so (a scheduler reads the highest status).
            status = 1
        step = _heartbeat.PROGRESS.step
        at = f" at step {step:,}" if step else ""
        _sync.mark_exit(
            "lost a peer"
            if lost
            else f"failed with {kind.__name__}{at} on {_heartbeat.HOST}",
            within=2.0,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        if not lost and jax.process_index() == 0:
            _sync.wait_for_exits(_PEERS_GRACE_S)
        os._exit(status)

    sys.excepthook = hook


# How XLA's runtime errors begin (a status code), and what JAX's collectives
# (Gloo on CPU, NCCL on GPU) and its coordination service say when a peer is
# gone or silent.
_STATUS = re.compile(r"^(UNKNOWN|UNAVAILABLE|DEADLINE_EXCEEDED|INTERNAL|ABORTED): ")
_PEER_LOST = (
    "gloo",
    "nccl",
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "coordination service",
    "heartbeat",
    "barrier timed out",
)


def lost_a_peer(error: BaseException | None) -> bool:
    """Whether `error` (or an error it came from) is a collective or a
    coordination call that failed because another process is gone: a
    `ClusterTimeoutError`, or an XLA runtime error (JAX raises it as a
    `ValueError` or `JaxRuntimeError`) naming a failed collective or the
    coordination service."""
    for _ in range(10):
        if error is None:
            return False
        if isinstance(error, ClusterTimeoutError):
            return True
        message = str(error)
        if _STATUS.match(message) and any(s in message.lower() for s in _PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


def _check_timeout(timeout: Any) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            "`timeout` must be a number of seconds, e.g. 300. Received: "
            f"timeout={timeout!r} of type {type(timeout).__name__}."
        )
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(
            "`timeout` must be a positive, finite number of seconds. Received: "
            f"timeout={timeout!r}."
        )


def _joined_by_jax() -> bool:
    return _jax_private.coordination_client() is not None


def initialize(
    resolver: ClusterResolver | None = None,
    *,
    timeout: float = 300.0,
    implementation: str = "auto",
) -> ClusterResolver:
    """Joins this process to its JAX cluster (once), after printing the topology.

    Resolves the cluster (`resolve`: explicit > TF_CONFIG > SLURM >
    keras-dist-run > JAX's detection > single process). With one process it
    does nothing; a TF_CONFIG `evaluator` (outside the training cluster)
    joins nothing either: its strategies run on its local devices. Otherwise
    it selects the gloo collectives on CPU, prints
    `process / count / coordinator / local devices`, and calls
    `jax.distributed.initialize` with `timeout`.

    Example:

    ```python
    resolver = kd.cluster.initialize(timeout=120)  # before any JAX computation
    print(resolver.process_id, "of", resolver.num_processes)
    # kd.MultiWorkerMirroredStrategy() calls it for you.
    ```

    Args:
        resolver: the cluster; defaults to auto-detection.
        timeout: seconds to wait for the coordinator and every peer.
        implementation: CPU collectives: `"auto"` or `"gloo"` (gloo), `"mpi"`.

    Returns:
        The resolved cluster.

    Raises:
        ClusterTimeoutError: if the coordinator or a peer does not answer
            within `timeout` (names the address).
        ProcessMismatchError: if the processes describe the cluster
            differently (another `num_processes`, the same process id twice).
        TypeError: if `timeout` is not a number.
        ValueError: if `timeout` is not positive.
        RuntimeError: if JAX already started its devices in this process
            before the cluster was joined.
    """
    _check_timeout(timeout)
    if "resolver" in _STATE:
        return _STATE["resolver"]
    if _joined_by_jax():  # The program called jax.distributed.initialize itself.
        resolver = ClusterResolver(
            None, jax.process_count(), jax.process_index(), source="jax"
        )
        _STATE.update(resolver=resolver, joined=True)
        return resolver
    resolver = resolve(resolver)
    check_address(resolver)
    if resolver.num_processes == 1:
        return resolver  # Nothing to join; a later call may still join a cluster.
    if resolver.process_id is None and resolver.task_type == "evaluator":
        # Outside the training cluster: runs on its own devices, joins nothing.
        print(
            "keras_dist: this process is the evaluator, not part of the "
            f"training cluster ({resolver.num_processes} processes): running "
            "locally.",
            file=sys.stderr,
            flush=True,
        )
        return resolver
    if resolver.process_id is None and resolver.source != "jax":
        raise RuntimeError(
            f"This process ({resolver.task_type}:{resolver.task_id}) is not part of "
            "the training cluster (TF_CONFIG evaluator); it cannot join it. Run "
            "evaluation without a multi-worker strategy."
        )
    if backend_started():
        raise RuntimeError(
            "JAX already started its devices in this process, so it can no longer "
            "join a cluster. Create the strategy (or call "
            "`kd.cluster.initialize()`) before any other JAX or Keras computation."
        )
    platforms = jax_option("jax_platforms")
    local = platforms or "default backend"
    if platforms in (None, "", "cpu") or "cpu" in str(local):
        jax.config.update(
            "jax_cpu_collectives_implementation",
            "gloo" if implementation == "auto" else implementation,
        )
    print(
        f"keras_dist: joining as {resolver.describe()}; waiting up to {timeout:g} s "
        "for all processes.",
        file=sys.stderr,
        flush=True,
    )
    if resolver.source == "keras-dist-run":
        tell_launcher("joining", resolver.process_id)
    if resolver.source != "jax":  # Every process there, or a named error.
        timeout = roll_call(resolver, timeout)
    kwargs: dict[str, Any] = {}
    if resolver.source != "jax":
        kwargs = {
            "coordinator_address": resolver.coordinator_address,
            "num_processes": resolver.num_processes,
            "process_id": resolver.process_id,
        }
    size_cpu_thread_pool()  # Before the backend starts (jax_num_cpu_devices).
    watch = 0.0 if resolver.source == "keras-dist-run" else timeout_from_environment()
    if watch:  # JAX's own heartbeat must not abort a process before ours names why.
        kwargs["heartbeat_timeout_seconds"] = max(100, int(watch) + 60)
    try:
        jax.distributed.initialize(initialization_timeout=int(timeout), **kwargs)
    except Exception as error:  # JAX raises several types for this.
        raise ClusterTimeoutError(
            f"Could not join the cluster at coordinator {resolver.coordinator_address} "
            f"as {resolver.describe()} within {timeout:g} s: {error}. Check that "
            "every process started with the same cluster description and that the "
            "coordinator address is reachable from this host."
        ) from error
    _STATE.update(resolver=resolver, joined=True)
    if resolver.source == "keras-dist-run":
        tell_launcher("joined", resolver.process_id)
        _heartbeat.start(resolver.process_id)
    elif watch:  # No launcher: the peers watch each other (the store's beats).
        client = _jax_private.coordination_client()
        PeerWatch(client, jax.process_index(), jax.process_count(), watch).start()
    _exit_fast_on_errors()
    # Before JAX's shutdown barrier (registered earlier, so run later).
    atexit.register(_sync.mark_exit, "finished its program")
    print(
        f"keras_dist: joined: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} local / {jax.device_count()} global "
        f"{jax.devices()[0].platform} devices.",
        file=sys.stderr,
        flush=True,
    )
    return resolver
