"""Orbax saves on keras_dist's writer thread, in one process or several.

Three things make Orbax's synchronous save safe on a thread beside the
training thread when several processes train together:

- **One Orbax thread per process** (`_background.BackgroundWriter(orbax=
  True)`): every process runs its callbacks' Orbax saves in the order the
  training thread submitted them, the same order everywhere; two managers
  saving at once would enter the same barriers in either order.
- **Barriers through the coordination service.** Orbax's barriers
  (`multihost.sync_global_processes`) run a device collective
  (`sync_global_devices`) unless Orbax's flag
  `experimental_orbax_use_distributed_barrier` is set. A collective issued
  from the writer thread interleaves with the training thread's collectives
  in another order on each process, and the processes hang (seen with 2
  local processes). With the flag, Orbax waits at barriers of JAX's
  coordination service, which need no device and time out (Orbax's 300 s),
  so a peer that died ends the save with an error instead of a hang.
- **No cyclic garbage collection during a write** (`collection_paused`).
  An Orbax save allocates enough short-lived Python objects to start
  Python's collector 17-20 times, and every 8-12 saves one of those is a
  full collection walking the ~500 000 objects of a process that imported
  Keras and JAX: 325-422 ms (a 96 MB backup's write: 110-390 ms of CPU)
  holding the GIL the training thread needs to dispatch its next step
  (`benchmarks/save_cost.py --no-gc-pause`). The objects a save frees are
  freed by their reference counts anyway, and the full collections do not
  move elsewhere: over 90 backups during `fit` none ran on any thread with
  the pause; without it 4 ran on the writer thread and 4 on the training
  thread (272-300 ms each; `save_cost.py --fit-steps 180`).
- **Arrays written plainly** (`backup_type_handlers`). Orbax's default
  array handler also writes each array's sharding (a JSON file, read only
  when a restore names no target sharding: keras_dist's restores always
  name the model's) and, with one process, splits each replicated array
  into a slice per replica on the devices (replica-parallel writing, which
  spreads a replicated array's writing over processes; with one process
  it adds a device slice per replica to every save). Without either, a
  ~100 MB Mirrored backup's write takes 109-116 ms of CPU against 251 ms
  (FSDP's, whose arrays are not replicated: about the same;
  `benchmarks/save_cost.py`, `backup` against `backup_orbax_defaults`).
- **No preemption queries.** Orbax's `CheckpointManager.save` asks JAX's
  preemption service `reached_preemption_sync_point(step)`. That service
  keeps the last step number it was asked about and, on a preemption,
  agrees on the next one; a query from the writer thread with the backup's
  (earlier) step number could make the processes agree on a step the
  training thread has passed, and `BackupAndRestore` would never see it.
  keras_dist's managers never ask; `BackupAndRestore` and
  `PreemptionCheckpointHandler` ask on the training thread, once a step.
"""

import contextlib
import gc
import threading

import jax

__all__ = [
    "background_barriers",
    "backup_type_handlers",
    "collection_paused",
]

_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"


def background_barriers() -> None:
    """With several processes, Orbax's barriers go through the coordination
    service (its flag `experimental_orbax_use_distributed_barrier`)."""
    if jax.process_count() == 1:
        return
    # Orbax defines the flag when `orbax.checkpoint` is imported.
    import orbax.checkpoint  # noqa: F401
    from absl import flags

    flag = flags.FLAGS[_BARRIER_FLAG]
    flag.value = True
    # Readable before absl parses the command line (absl reads a flag that
    # was not parsed only if it is marked as given); a later parse keeps it.
    flag.present = max(flag.present, 1)


_pause_lock = threading.Lock()
_pauses = 0  # Writes inside `collection_paused` now, on any thread.
_was_enabled = False  # Whether the first of them found the collector on.


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collector off for the block (for the process:
    it has no per-thread switch). Nested and concurrent blocks share one
    pause; the last to leave turns the collector back on, only if the first
    found it on (a program that turned it off keeps it off)."""
    global _pauses, _was_enabled
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()


def backup_type_handlers():
    """Orbax's type-handler registry for backups: arrays without their
    sharding file, replica-parallel writing only with several processes."""
    import numpy as np
    from orbax.checkpoint import type_handlers

    arrays = type_handlers.ArrayHandler(
        use_replica_parallel=jax.process_count() > 1,
        enable_write_sharding_file=False,
    )
    return type_handlers.create_type_handler_registry(
        (jax.Array, arrays), (np.ndarray, type_handlers.NumpyHandler())
    )
