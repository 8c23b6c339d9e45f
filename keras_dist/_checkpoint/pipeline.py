"""The one save pipeline: snapshot on the devices -> one background writer ->
atomic commit -> keep policy.

- **Snapshot** (`freeze`, on the training thread): the values to save,
  copied on their devices by one compiled program dispatched without
  waiting for the step computing them (the next step may donate the
  originals), or to host memory where the devices lack room. A replicated
  value is copied once; a value with parts on other processes is gathered
  (a collective). With several processes Orbax's asynchronous save takes
  its own snapshot (each process its parts).
- **One background writer** (`Writer`): one save in flight per callback; a
  failed write raises `kd.errors.CheckpointWriteError` (its path and
  cause) on the training thread at the next step, save or end of `fit`.
- **Atomic commit** (`atomic_write`): written under a temporary name,
  fsynced, renamed (Orbax commits a step directory the same way).
- **Keep policy**: `ModelCheckpoint`'s `max_to_keep` / `keep_period` for
  files, Orbax's preservation policies for its directories.

`StepEnd` gives the callbacks the end of each training execution without
making `fit` wait for it.
"""

import concurrent.futures
import contextlib
import functools
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

from keras_dist.errors import CheckpointWriteError

__all__ = [
    "Pending",
    "StepEnd",
    "Writer",
    "atomic_write",
    "check_writable_dir",
    "freeze",
    "prepare",
    "remove_stale_temps",
]

# Snapshot --------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _addressable_devices(sharding: jax.sharding.Sharding) -> tuple:
    return tuple(sharding.addressable_devices)


def _room_on_devices(values: list) -> bool:
    """Whether every device has room for a copy of its parts of `values`
    (devices that report no memory statistics, CPU's, are taken to)."""
    need: dict = {}
    for v in values:
        part = math.prod(v.sharding.shard_shape(v.shape)) * np.dtype(v.dtype).itemsize
        for device in _addressable_devices(v.sharding):
            need[device] = need.get(device, 0) + part
    for device, nbytes in need.items():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            continue
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if nbytes > 0.9 * free:
            return False
    return True


# A sharding -> the index, among a replicated value's addressable parts, of
# its part on this process's first device: looked up once per sharding.
_FIRST_REPLICA: dict = {}


def _first_replica(a: jax.Array) -> jax.Array:
    """`a`'s replica on this process's first device (no copy, no wait)."""
    index = _FIRST_REPLICA.get(a.sharding)
    if index is None:
        first = min(_addressable_devices(a.sharding), key=lambda d: d.id)
        index = [s.device for s in a.addressable_shards].index(first)
        if len(_FIRST_REPLICA) >= 1024:
            _FIRST_REPLICA.clear()
        _FIRST_REPLICA[a.sharding] = index
    return a.addressable_data(0) if index == 0 else a.addressable_shards[index].data


@jax.jit
def _copy(arrays: list) -> list:
    """New buffers with the values of `arrays`, laid out alike (a compiled
    program: dispatched without waiting for `arrays` to be computed).

    The zero added goes through an optimization barrier so that the adds
    stay adds: XLA:CPU runs a program estimated under 1000 flops inline, on
    the calling thread, once its inputs are ready; plain copies count 0
    flops, and the training thread then waited for the whole copy."""
    return [a + lax.optimization_barrier(jnp.zeros((), a.dtype)) for a in arrays]


def _plan(values: list) -> tuple[list, list, list]:
    """`freeze`'s plan: the values to copy (a replicated value's first
    replica; a value split over processes gathered to NumPy now), and the
    groups `(copied on the devices, members)`: one compiled copy per set of
    devices; values kept in host memory go to NumPy."""
    values = [v.value if isinstance(v, keras.Variable) else v for v in values]
    out = list(values)
    by_devices: dict = {}
    for i, v in enumerate(values):
        if not isinstance(v, jax.Array):
            continue
        if not v.is_fully_addressable:
            out[i] = np.asarray(multihost_utils.process_allgather(v, tiled=True))
            continue
        if v.is_fully_replicated and len(v.sharding.device_set) > 1:
            values[i] = v = _first_replica(v)
        on_device = getattr(v.sharding, "memory_kind", None) in (None, "device")
        key = (frozenset(d.id for d in v.sharding.device_set), on_device)  # type: ignore[attr-defined]
        by_devices.setdefault(key, []).append(i)
    groups = [
        (on_device and _room_on_devices([values[i] for i in members]), members)
        for (_, on_device), members in by_devices.items()
    ]
    return values, out, groups


def freeze(values: list, *, copy_local: bool = True) -> list:
    """`values` (variables or arrays) frozen without waiting for them: device
    copies, or host arrays. Values split over processes are gathered (every
    process must call this with the same values in the same order);
    `copy_local=False` (a process that writes nothing) only takes part in
    those gathers."""
    values, out, groups = _plan(values)
    if not copy_local:
        return out
    for on_device, members in groups:
        group = [values[i] for i in members]
        if on_device:
            copies = _copy(group)
        else:
            for a in group:
                a.copy_to_host_async()
            copies = [np.array(a, copy=True) for a in group]
        for i, copy in zip(members, copies, strict=True):
            out[i] = copy
    return [v if isinstance(v, (jax.Array, np.ndarray)) else np.asarray(v) for v in out]


def prepare(values: list) -> None:
    """Compiles the copies `freeze(values)` dispatches, copying nothing: when
    `fit` begins, not on the training thread at the first save (a
    compilation for each layout and size). Values with parts on other
    processes are left to the save (their gathers are collectives)."""
    plain = [v.value if isinstance(v, keras.Variable) else v for v in values]
    if any(isinstance(v, jax.Array) and not v.is_fully_addressable for v in plain):
        return
    values, _, groups = _plan(plain)
    for on_device, members in groups:
        if on_device:
            _copy.lower([values[i] for i in members]).compile()


# One background writer -------------------------------------------------------


class Pending(Protocol):
    """A write in flight: `done()` never waits; `result()` waits and raises
    the write's error."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class Writer:
    """One save in flight; its failure raised on the training thread.

    `submit(path, start)` first waits for the save in flight (its error
    raised), then calls `start()`, which begins the write and returns it
    (`Pending`). `write(path, fn)` runs `fn` on this writer's thread. A
    write's error is raised as `CheckpointWriteError` (naming its path and
    cause, and `kept`) by the next `check`, `submit`, `wait` or `close`.
    """

    def __init__(self, owner: str, kept: str):
        self.owner, self.kept = owner, kept
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: Pending | None = None
        self._path = ""

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, path: str, start: Callable[[], Pending | None]) -> None:
        self.wait()
        self._path = path
        self._pending = start()

    def write(self, path: str, fn: Callable[[], object]) -> None:
        """Runs `fn` on this writer's thread (after the save in flight)."""
        self.submit(path, lambda: self.in_background(fn))

    def in_background(self, fn: Callable[[], object]) -> Pending:
        """Starts `fn` on this writer's thread (a `start` of `submit`)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="keras_dist-checkpoint"
            )
        return self._executor.submit(fn)

    def check(self) -> None:
        """Raises the error of a finished write that failed; never waits."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Waits for the write in flight; raises `CheckpointWriteError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as error:
            raise CheckpointWriteError(
                f"{self.owner}: writing {self._path} failed in the background "
                f"({type(error).__name__}: {str(error)[:1000]}). {self.kept}"
            ) from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


# Atomic commit -----------------------------------------------------------------

# `atomic_write`'s temporary names: `.tmp-<12 hex digits>-<final name>`.
_TEMP = re.compile(r"^\.tmp-[0-9a-f]{12}-.+$")
# Temporary files older than this (before any write of this process) were
# left by an interrupted earlier run.
_STARTED = time.time()


def check_writable_dir(path: str, *, argument: str) -> str:
    """Creates `path` if needed and proves it is writable, or raises now.

    Raises:
        PermissionError: if the directory cannot be created or written.
    """
    directory = os.path.abspath(path or ".")
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".keras_dist-write-test-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise PermissionError(
            f"`{argument}` must be in a writable directory, checked before "
            f"training starts. Received: {argument}={path!r} ({error.strerror}: "
            f"{directory}). Pick a directory you can write to."
        ) from error
    return directory


def atomic_write(final_path: str, write: Callable[[str], object]) -> None:
    """Calls `write(tmp_path)`, fsyncs, then renames `tmp_path` to `final_path`.

    The temporary file sits in the same directory and ends with the same
    name (format checks on the suffix pass); a crash before the rename
    leaves the previous `final_path` untouched.
    """
    directory, name = os.path.split(os.path.abspath(final_path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex[:12]}-{name}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def remove_stale_temps(directory: str) -> list[str]:
    """Removes `atomic_write`'s temporary files an interrupted run left (named
    as it names them, last modified before this process started)."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if not (_TEMP.match(entry.name) and entry.is_file(follow_symlinks=False)):
                continue
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_mtime < _STARTED:
                    os.remove(entry.path)
                    removed.append(entry.path)
    return removed


# A step's end, without a wait ------------------------------------------------


class StepEnd:
    """The last step index of each finished training execution.

    Keras's `CallbackList` (JAX backend) runs `on_train_batch_end` hooks on a
    background thread, so the loop dispatches the next step while the
    devices run this one, unless a callback defines that hook without
    declaring `async_safe`: then every step waits for its logs. A
    checkpoint callback needs the training thread, not the logs: it calls
    `begin(batch)` from `on_train_batch_begin` and `epoch_end()` from
    `on_epoch_end`, each returning the last step index (in the epoch) of
    the execution (`steps_per_execution` steps) that finished since, or
    None; `reset()` from `on_epoch_begin`. The model's state there is the
    one that execution left.

    It also counts the steps this `fit` ran on the host, from the number
    `start` is given (`step`), so a save numbered by them need not read the
    optimizer's counter (which waits for every step dispatched). An epoch's
    short last execution counts to the epoch's end where the number of
    steps is known, as planned where it is not (as Keras's callbacks count).
    """

    def __init__(self) -> None:
        self._running: int | None = None  # The running execution's last step.
        self._first: int | None = None  # The epoch's first step in this fit.
        self._last: int | None = None  # The epoch's latest execution's last step.
        self._before = 0  # Steps of this fit's earlier epochs.
        self._steps: int | None = None  # Steps per epoch, if known.
        self._base = 0  # The step number `fit` began at.
        self._call: Any = None  # The running call's `CallState`.

    def start(self, steps_per_epoch: int | None, first_step: int, call=None) -> None:
        """A new `fit` (from `on_train_begin`, with `params["steps"]`, the step
        number it begins at and its `CallState`): counts from there."""
        self._running = self._first = self._last = None
        self._before = 0
        self._steps = steps_per_epoch
        self._base = first_step
        self._call = call

    def reset(self) -> None:
        if self._first is not None and self._last is not None:
            self._before += self._clipped(self._last) + 1 - self._first
        self._running = self._first = self._last = None

    def begin(self, batch: int) -> int | None:
        """The execution before the one starting at `batch` ended: its last step."""
        if self._first is None:
            self._first = batch
        end = None if self._call is None else self._call.last_end_step
        finished = self._running
        self._running = self._last = end if end is not None and end >= batch else batch
        return finished

    def epoch_end(self) -> int | None:
        """The epoch's last execution ended (if one ran since `begin`)."""
        finished, self._running = self._running, None
        return finished

    @property
    def last(self) -> int | None:
        """The last step index of the epoch's latest execution (None: none ran)."""
        return self._last

    def step(self, through: int | None) -> int:
        """The step number after step index `through` of this epoch (None:
        before this epoch)."""
        if through is None or self._first is None:
            return self._base + self._before
        return self._base + self._before + self._clipped(through) + 1 - self._first

    def _clipped(self, index: int) -> int:
        return min(index, self._steps - 1) if self._steps else index
