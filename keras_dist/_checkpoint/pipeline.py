"""The one save pipeline: snapshot on the devices -> one background writer ->
atomic commit -> keep policy.

- **Snapshot** (`freeze`, on the training thread): the values to save,
  copied on their devices in one compiled, asynchronously dispatched
  program (the training thread does not wait for the step computing them,
  and the next step may donate the originals), or to host memory when the
  devices lack room. A replicated value is copied once, on each process's
  first device; a value with parts on other processes is gathered (a
  collective every process runs in the same order). Orbax takes its own
  snapshot: its asynchronous save copies the state to the host and returns.
- **One background writer** (`Writer`): one save in flight per callback
  (a newer save waits for the older); a write that failed raises
  `kd.errors.CheckpointWriteError` (its path and cause) on the training
  thread at the next step, save or the end of `fit`. It runs Keras's file
  writing on a thread of its own, or watches Orbax's asynchronous save.
- **Atomic commit** (`atomic_write`): a file is written under a temporary
  name in its directory, fsynced and renamed (Orbax commits a step
  directory the same way); a crash leaves the previous checkpoint intact.
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
import threading
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
    "offloaded",
    "prepare",
    "remove_stale_temps",
    "run_job",
    "start_writer_process",
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
    `fit` begins, not on the training thread at the first save (1.5 s on 8
    CPU devices for 56 arrays, 973 MB). Values with parts on other
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

    def write(self, path: str, fn: Callable[[], None]) -> None:
        """Runs `fn` on this writer's thread (after the save in flight)."""
        self.submit(path, lambda: self.in_background(fn))

    def in_background(self, fn: Callable[[], None]) -> Pending:
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


# The writer process ------------------------------------------------------------
#
# h5py and Orbax's Python hold Python's lock while they write (150-220 ms
# per 96 MB on this box): on a thread of the training process they stall
# the training loop as long. On Linux they run in a process of their own
# (one per training process, started with the first checkpoint callback):
# the writer thread copies the snapshot into shared memory (a memfd; numpy's
# and JAX's copies release the lock), sends the job and waits for its
# answer. `KERAS_DIST_CHECKPOINT_WRITER=thread` (and other platforms) run
# the same jobs on the writer thread. The process ignores SIGINT and
# SIGTERM (the training process finishes the save in flight on them) and
# exits as soon as the training process is gone.


class _Slot:
    """An array's place in the shared buffer."""

    def __init__(self, offset: int, shape: tuple, dtype: np.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype


def offloaded() -> bool:
    return (
        hasattr(os, "memfd_create")
        and os.environ.get("KERAS_DIST_CHECKPOINT_WRITER", "process") != "thread"
    )


def run_job(job: tuple) -> Any:
    """Runs `job` (`_execute`'s) in the writer process, or on this thread."""
    if not offloaded():
        return _execute(job)
    global _process
    with _process_lock:
        if _process is None or _process.proc.poll() is not None:
            _process = _Process()
        process = _process
    return process.run(job)


def start_writer_process() -> None:
    """Starts the writer process now (Keras's import there takes seconds)."""
    if offloaded():
        global _process
        with _process_lock:
            if _process is None or _process.proc.poll() is not None:
                _process = _Process()


class _Process:
    def __init__(self) -> None:
        import multiprocessing.connection
        import socket
        import subprocess
        import sys

        ours, theirs = socket.socketpair()
        self._life_r, self._life_w = os.pipe()  # EOF there: we are gone.
        root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
        env["CUDA_VISIBLE_DEVICES"] = ""  # No accelerator's memory taken there.
        env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
        code = "from keras_dist._checkpoint import pipeline as p; p._main({}, {})"
        code = code.format(theirs.fileno(), self._life_r)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=(theirs.fileno(), self._life_r),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        os.close(self._life_r)
        self._socket = ours
        self._conn = multiprocessing.connection.Connection(os.dup(ours.fileno()))
        self._lock = threading.Lock()
        self._ready = False
        self._memfd, self._size, self._map = -1, 0, None

    def _answer(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    "keras_dist's checkpoint writer process exited (status "
                    f"{self.proc.returncode}) before answering"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    "keras_dist's checkpoint writer process did not start "
                    f"in {timeout} s"
                )
        kind, value = self._conn.recv()
        if kind == "error":
            name, message = value
            error_type = getattr(__import__("builtins"), name, None)
            if not (isinstance(error_type, type) and issubclass(error_type, Exception)):
                error_type = type(name, (RuntimeError,), {})
            raise error_type(message)
        return value

    def run(self, job: tuple) -> Any:
        import mmap
        from multiprocessing import reduction

        with self._lock:
            if not self._ready:
                self._answer(timeout=600)
                self._ready = True
            arrays: list = []
            job = _map(lambda x: _slot(x, arrays) if _shared(x) else x, job)
            size = sum(s.nbytes for _, s in arrays) + 64 * len(arrays)
            grown = size > self._size
            if grown:  # A new buffer (the old one's pages freed).
                if self._map is not None:
                    self._map.close()
                    os.close(self._memfd)
                self._size = max(size, 2 * self._size)
                self._memfd = os.memfd_create("keras_dist-checkpoint")
                os.ftruncate(self._memfd, self._size)
                self._map = mmap.mmap(self._memfd, self._size)
            offset = 0
            for _, a in arrays:
                if isinstance(a, jax.Array):
                    a.copy_to_host_async()
            for slot, a in arrays:
                slot.offset = offset
                _copy_into(np.ndarray(slot.shape, slot.dtype, self._map, offset), a)
                offset += -(-a.nbytes // 64) * 64
            self._conn.send((job, self._size if grown else None))
            if grown:
                reduction.send_handle(self._conn, self._memfd, self.proc.pid)
            return self._answer(timeout=None)


def _slot(x, arrays: list) -> _Slot:
    slot = _Slot(0, tuple(x.shape), np.dtype(x.dtype))
    arrays.append((slot, x))
    return slot


def _copy_into(dest: np.ndarray, a) -> None:
    """`a`'s values into `dest`, each part once (no gather on the host)."""
    if isinstance(a, jax.Array) and not a.is_fully_replicated:
        for shard in a.addressable_shards:
            if shard.replica_id == 0:
                dest[shard.index] = np.asarray(shard.data)
    else:
        np.copyto(dest, np.asarray(a))


def _shared(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and np.dtype(x.dtype).kind in "biufcV"


def _map(fn: Callable, obj):
    """`fn` on the leaves of nested dicts, lists and tuples (orders kept)."""
    if isinstance(obj, dict):
        return {k: _map(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, v) for v in obj)
    return fn(obj)


_process: _Process | None = None
_process_lock = threading.Lock()
_checkpointers: dict = {}  # The writer's Orbax checkpointers, by store.


def _execute(job: tuple) -> Any:
    """A write: ("keras", path, entries, config_json, metadata_json,
    assets_dir): a `.weights.h5` / `.keras` file; ("orbax", store, directory,
    options, step, payload): a step of an Orbax store (returns the steps it
    keeps); ("close", store)."""
    kind, *args = job
    if kind == "keras":
        from keras_dist._keras_compat._saving import Snapshot, write_snapshot

        path, *parts = args
        snap = Snapshot(*parts)
        atomic_write(path, lambda tmp: write_snapshot(snap, tmp))
        return None
    from keras_dist._checkpoint.orbax_store import checkpointer

    store, *args = args
    if kind == "close":
        if store in _checkpointers:
            _checkpointers.pop(store).close()
        return None
    directory, options, step, payload = args
    if store not in _checkpointers:
        _checkpointers[store] = checkpointer(directory, **options)
    saver = _checkpointers[store]
    saver.save_checkpointables(step, payload)
    return sorted(c.step for c in saver.checkpoints)


def _view(shared, x):
    return np.ndarray(x.shape, x.dtype, shared, x.offset) if isinstance(x, _Slot) else x


def _main(fd: int, life: int) -> None:
    """The writer process: runs the jobs it is sent, one at a time."""
    import mmap
    import multiprocessing.connection
    import signal
    from multiprocessing import reduction

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)  # EFBIG: an error, not a kill.
    threading.Thread(
        target=lambda: (os.read(life, 1), os._exit(1)), daemon=True
    ).start()
    conn = multiprocessing.connection.Connection(fd)
    # Imported before "ready": the first save does not wait for them.
    import keras_dist._checkpoint.orbax_store
    import keras_dist._keras_compat._saving  # noqa: F401

    conn.send(("ok", None))
    shared = None
    while True:
        try:
            job, size = conn.recv()
        except EOFError:
            return
        if size is not None:
            memfd = reduction.recv_handle(conn)
            shared = mmap.mmap(memfd, size)
            os.close(memfd)
        job = _map(functools.partial(_view, shared), job)
        try:
            conn.send(("ok", _execute(job)))
        except Exception as error:
            conn.send(("error", (type(error).__name__, str(error))))
        del job


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
