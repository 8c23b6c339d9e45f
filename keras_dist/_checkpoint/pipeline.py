"""The one save pipeline: callback -> pipeline -> engine.

A save is an engine's snapshot on the training thread, a write by one
`Writer` (one save in flight; its failure raised as
`kd.errors.CheckpointWriteError` on the training thread at the next step,
save or end of `fit`; `async_save=False` is the same route without the
thread), then the engine's commit, kept by Orbax's keep policy:

- `KerasFileSaves`: `ModelCheckpoint`'s `.weights.h5` / `.keras` files
  (`keras_files.py`), then the `checkpoint` index.
- `OrbaxSaves`: `BackupAndRestore`, `ModelCheckpoint(sharded=True)`,
  `PreemptionCheckpointHandler` (`orbax_store.py`).
- `LocalSaves`: `BackupAndRestore`'s local tier, each process's own parts
  (`local_tier.py`).

`TwoTierSaves` is the backup both `BackupAndRestore` and
`PreemptionCheckpointHandler` keep: an `OrbaxSaves` every process writes
and, with `local_dir`, each host's `LocalSaves`; one Orbax save in flight
of either, a restore from the newer. Keras's `model.save`/`save_weights`
(and Keras's own `ModelCheckpoint`, which calls them) under a strategy take
`save_once` (from `_seams/_save_calls.py`): the same snapshot and the same
atomic commit as `KerasFileSaves`, on the caller's thread.
"""

import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import jax

from keras_dist._checkpoint import keras_files, local_tier, storage
from keras_dist._checkpoint.orbax_store import (
    GROUPS,
    OrbaxStore,
    keep_policy,
    preserved,
)
from keras_dist.cluster import _heartbeat, _sync
from keras_dist.errors import CheckpointWriteError, ProcessMismatchError

__all__ = [
    "STATE_FILE",
    "KerasFileSaves",
    "LocalSaves",
    "OrbaxSaves",
    "TwoTierSaves",
    "Writer",
    "check_shared",
    "check_writable_dir",
    "save_once",
    "written_everywhere",
]

# `KerasFileSaves`'s index of its files, newest last.
STATE_FILE = "checkpoint"


# One writer ------------------------------------------------------------------


_PROGRESS = _heartbeat.PROGRESS
_blocking = [0]  # Saves' calls under way on the training thread.


def _blocks(method: Callable) -> Callable:
    """The training thread's time in `method` is a checkpoint block (the
    launcher's goodput), counted once however the calls nest."""

    @functools.wraps(method)
    def timed(*args, **kwargs):
        if _blocking[0]:
            return method(*args, **kwargs)
        _blocking[0] += 1
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _blocking[0] -= 1
            _PROGRESS.checkpoint_s += time.perf_counter() - started

    return timed


class Pending(Protocol):
    """A write in flight: `done()` never waits; `result()` waits and raises
    the write's error."""

    def done(self) -> bool: ...

    def result(self) -> Any: ...


class Writer:
    """One save in flight; its failure raised on the training thread.

    `submit(path, start)` first waits for the save in flight (its error
    raised), then calls `start()`, which begins the write and returns it
    (`Pending`). `write(path, fn)` runs `fn` on this writer's thread, or
    with `background=False` at once (then `submit` waits too). A
    write's error is raised as `CheckpointWriteError` (naming its path and
    cause, and `intact`: what a failure leaves) by the next `check`,
    `submit`, `wait` or `close`.
    """

    def __init__(self, owner: str, intact: str, *, background: bool = True):
        self.owner, self.intact, self.background = owner, intact, background
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
        if not self.background:
            self.wait()

    def write(self, path: str, fn: Callable[[], object]) -> None:
        """Runs `fn` on this writer's thread (after the save in flight)."""
        self.submit(path, lambda: self._start(fn))

    def _start(self, fn: Callable[[], object]) -> Pending:
        if self.background:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="keras_dist-checkpoint"
                )
            return self._executor.submit(fn)
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            done.set_result(fn())
        except Exception as error:
            done.set_exception(error)
        return done

    def check(self) -> None:
        """Raises the error of a finished write that failed; never waits."""
        if self._pending is not None and self._pending.done():
            self.wait()

    @_blocks
    def wait(self) -> None:
        """Waits for the write in flight; raises `CheckpointWriteError` if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as error:
            where = " in the background" if self.background else ""
            raise CheckpointWriteError(
                f"{self.owner}: writing {self._path} failed{where} "
                f"({type(error).__name__}: {str(error)[:1000]}). {self.intact}"
            ) from error

    @_blocks
    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def check_writable_dir(
    path: str, *, argument: str, orbax: bool = False, local: bool = False
) -> str:
    """Creates `path` if needed and proves it is writable, or raises now;
    returns it as the pipeline keeps it (local: absolute; a URL as given).
    `orbax`: Orbax writes there (which has no S3 store); `local`: each
    host's own storage (no URL).

    Raises:
        ValueError: a URL no installed library serves (`storage.check`), or
            (`orbax`) on `s3://`, or (`local`) any URL.
        PermissionError: if the directory (or the bucket) cannot be created
            or written.
    """
    if local and storage.is_remote(path):
        raise ValueError(
            f"`{argument}` is each host's own storage (a local disk, /dev/shm), "
            f"not a URL. Received: {argument}={path!r}. Keep the bucket for "
            "the persistent tier (`backup_dir`) and give each host a local "
            f"folder as `{argument}`."
        )
    directory = storage.check(path or ".", argument=argument, orbax=orbax)
    probe = storage.join(directory, f".keras_dist-write-test-{uuid.uuid4().hex}")
    try:
        if storage.is_remote(directory):
            storage.write_whole(probe, _write_probe, "probe")
        else:
            os.makedirs(directory, exist_ok=True)
            _write_probe(probe)
        storage.remove(probe)
    except OSError as error:
        raise PermissionError(
            f"`{argument}` must be in a writable directory, checked before "
            f"training starts. Received: {argument}={path!r} "
            f"({error.strerror or type(error).__name__ + ': ' + str(error)}: "
            f"{directory}). Pick a directory you can write to."
        ) from error
    return directory


# How long a process looks for the chief's token (a network file system may
# show a new file to other hosts a moment later).
SHARED_WAIT_S = 5.0


def check_shared(directory: str, *, argument: str, owner: str) -> None:
    """Every process sees the same `directory`, or every process raises.

    Where every process reads and writes one folder (Orbax's backups and
    sharded checkpoints: its primary host makes a step's folder, the others
    wait to see it), a folder on each host's own disk would hang the first
    save. The chief writes a token there, every process looks for it (up to
    `SHARED_WAIT_S`), and the processes agree through the coordination
    service: within seconds, the same error on every process, naming the
    processes that do not see it. One process: nothing to check.

    Raises:
        ProcessMismatchError: a process does not see the chief's token.
    """
    if not _sync.multi_process():
        return
    chief = jax.process_index() == 0
    token = _sync.broadcast_from_chief(
        "shared-storage", uuid.uuid4().hex if chief else None
    )
    path = storage.join(directory, f".keras_dist-shared-{token}")
    error = None
    if chief:
        try:
            if storage.is_remote(path):
                storage.write_whole(path, _write_probe, "token")
            else:
                _write_probe(path)
        except OSError as failure:
            error = f"{type(failure).__name__}: {failure}"
    written = _sync.allgather("shared-storage", error)[0]
    if written is not None:
        raise CheckpointWriteError(
            f"{owner}: the chief (process 0) could not write to `{argument}` "
            f"{directory!r} ({written})."
        )
    deadline = time.monotonic() + SHARED_WAIT_S
    seen = storage.exists(path)
    while not seen and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = storage.exists(path)
    everyone = _sync.allgather(
        "shared-storage", {"seen": seen, "host": socket.gethostname()}
    )
    if chief:
        storage.remove(path)
    blind = [p for p, view in enumerate(everyone) if not view["seen"]]
    if blind:
        named = ", ".join(f"process {p} (host {everyone[p]['host']})" for p in blind)
        raise ProcessMismatchError(
            f"{owner}: `{argument}` must be one folder every process sees, but "
            f"{named} {'does' if len(blind) == 1 else 'do'} not see the file "
            f"process 0 (host {everyone[0]['host']}) wrote in {directory!r} "
            f"within {SHARED_WAIT_S:g} s: the path is on storage each host has "
            f"to itself. Put `{argument}` on storage every host mounts (NFS, a "
            "bucket such as gs://...), or keep each host's own disk for "
            "`local_dir` (BackupAndRestore's local tier)."
        )


def _write_probe(path: str) -> None:
    with open(path, "w") as f:
        f.write("ok")


# Keras's files ---------------------------------------------------------------


@dataclasses.dataclass
class _Kept:
    """A file written, as Orbax's policies read a checkpoint."""

    path: str
    epoch: int
    step: int
    time: datetime.datetime
    metrics: dict | None = None


class KerasFileSaves(Writer):
    """`ModelCheckpoint`'s Keras files in `directory`: snapshot, write, keep.

    Only the chief (`chief=True`: process 0) writes; with several processes
    every process takes the snapshot's gathers. `loadable(model)` is a
    context in which Keras's walk saves a model loadable without keras_dist
    (its plain learning rate). `max_to_keep` / `keep_period`: Orbax's keep policy.
    """

    def __init__(
        self,
        directory: str,
        *,
        owner: str,
        async_save: bool,
        max_to_keep: int | None,
        keep_period: int | None,
        loadable: Callable[[Any], contextlib.AbstractContextManager],
    ):
        super().__init__(
            owner, "The previous checkpoint is intact.", background=async_save
        )
        self.directory = directory
        self._policy = (
            keep_policy(max_to_keep, keep_period)
            if max_to_keep or keep_period
            else None
        )
        self._loadable = loadable
        self._kept: list[_Kept] = []
        self._recorded: keras_files.Snapshot | None = None

    def begin(self, model, *, with_config: bool, chief: bool) -> None:
        """When `fit` begins: stale temporary files removed; Keras's saving
        walk kept for this `fit` and its copies compiled (not on the training
        thread at the first save)."""
        if chief:  # Writes an earlier run interrupted.
            keras_files.remove_stale_temps(self.directory)
        self._release_walk()
        optimizer = getattr(model, "optimizer", None)
        if not model.built or (optimizer is not None and not optimizer.built):
            return
        # Every process, as a save walks (the walk may create variables).
        with self._loadable(model):
            walk = keras_files.record(model, with_config=with_config)
        keras_files.prepare_snapshot(walk)
        if keras_files.reusable(walk):
            self._recorded = walk
        else:
            walk.release()

    @_blocks
    def save(
        self, model, path: str, *, epoch: int, step: int, with_config: bool, chief: bool
    ) -> None:
        """Saves `model` to `path`: the state frozen here, written by the
        writer (in the background unless `async_save=False`)."""
        error = None
        try:
            walk = self._recorded
            if walk is None:
                with self._loadable(model):  # Loadable without keras_dist.
                    walk = keras_files.record(model, with_config=with_config)
                if keras_files.reusable(walk):
                    self._recorded = walk
            # Every process: values split over processes are gathered (the
            # others copy nothing: only the chief writes).
            snap = keras_files.snapshot(
                model, with_config=with_config, recorded=walk, copy_local=chief
            )
            if not chief:
                snap.release()
            else:

                def write() -> None:
                    keras_files.write(snap, path)
                    self.kept(path, epoch=epoch, step=step, chief=True)

                self.write(path, write)
        except BaseException as failure:
            if self.background:
                raise
            error = failure
        if not self.background:  # Every process returns when written.
            written_everywhere(error, what=repr(path))

    def kept(self, path: str, *, epoch: int, step: int, chief: bool) -> None:
        """Adds a file the chief wrote to the index; deletes what the policy
        drops (the other processes keep no index)."""
        if not chief:
            return
        path = path if storage.is_remote(path) else os.path.abspath(path)
        self._kept = [k for k in self._kept if k.path != path]
        now = datetime.datetime.now(datetime.UTC)
        self._kept.append(_Kept(path, int(epoch), int(step), now))
        if self._policy is not None:
            keep = preserved(self._policy, self._kept)
            for k, kept in list(zip(self._kept, keep, strict=True)):
                if not kept:
                    self._kept.remove(k)
                    storage.remove(k.path)
        self.write_index(done=False, chief=chief)

    def write_index(self, *, done: bool, chief: bool) -> None:
        """The `checkpoint` index: newest last, each file's epoch, `done`
        (once `fit` has ended: `SidecarEvaluator`'s stop marker)."""
        if not chief or not self._kept:
            return
        names = [
            storage.basename(k.path)
            for k in self._kept
            if storage.dirname(k.path) == self.directory
        ]
        epochs = {storage.basename(k.path): k.epoch for k in self._kept}
        state = {
            "latest": storage.basename(self._kept[-1].path),
            "all": names,
            "epochs": {name: epochs[name] for name in names},
            "done": done,
        }
        keras_files.atomic_write_json(storage.join(self.directory, STATE_FILE), state)

    @_blocks
    def close(self) -> None:
        """Finishes the save in flight (raises its error); idempotent."""
        try:
            super().close()
        finally:
            self._release_walk()

    def _release_walk(self) -> None:
        recorded, self._recorded = self._recorded, None
        if recorded is not None:
            recorded.release()  # Its assets' temporary directory.


# Orbax checkpoints -----------------------------------------------------------


class _StoreSaves(Writer):
    """A writer whose `close` closes its `store` too."""

    store: Any

    @_blocks
    def close(self) -> None:
        try:
            super().close()
        finally:
            self.store.close()


class OrbaxSaves(_StoreSaves):
    """An `OrbaxStore`'s saves through one writer.

    `what` ("backup") names them in errors; `async_save=False` waits for
    each save to be committed.
    """

    def __init__(
        self,
        directory: str,
        *,
        owner: str,
        what: str = "checkpoint",
        async_save: bool = True,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
    ):
        super().__init__(
            owner,
            f"The previous {what} in {directory} is intact."
            if what == "backup"
            else f"The earlier {what}s in {directory} are intact.",
            background=async_save,
        )
        self.store = OrbaxStore(
            directory, owner=owner, keep=keep_policy(max_to_keep, keep_period)
        )
        self.what = what

    @_blocks
    def save(
        self,
        model,
        step: int,
        *,
        groups: tuple = tuple(GROUPS),
        files: dict | None = None,
        meta: dict | None = None,
    ) -> str | None:
        """Saves `groups` of `model`'s state tree as `step`; returns its
        directory, or None if that step is saved already (an epoch's end
        right after a save)."""
        payload = self.store.payload(model, groups=groups, files=files, meta=meta)
        self.wait()  # One save in flight (and its error raised).
        if step in self.store.steps():
            return None
        path = storage.join(self.store.directory, str(step))
        label = f"the {self.what} of step {step} to {path}"
        if jax.process_count() == 1:
            # Orbax's asynchronous save copies the state to the host before
            # it returns: a wait for every step dispatched (`python
            # benchmarks/save_cost.py` times a save's parts). A snapshot on
            # the devices instead, and Orbax's save on the writer thread.
            payload = self.store.frozen(payload)
            self.write(label, lambda: self.store.save(step, payload))
        else:  # Orbax's save runs collectives: on the training thread.
            self.submit(label, lambda: self.store.save_async(step, payload))
        return path


class LocalSaves(_StoreSaves):
    """`BackupAndRestore`'s local tier: this process's parts of the state in
    `directory/process_<p>`, the newest 2 kept; Orbax's asynchronous save
    (it copies the state to the host on the training thread, then writes;
    `local_tier.py`)."""

    def __init__(self, directory: str, *, owner: str):
        self.directory = os.path.join(directory, f"process_{jax.process_index()}")
        super().__init__(
            owner, f"The previous local backup in {self.directory} is intact."
        )
        local_tier.quiet()
        self.store = local_tier.Store(self.directory, owner=owner)

    @_blocks
    def save(
        self, model, step: int, *, meta: dict, groups: tuple = tuple(GROUPS)
    ) -> str | None:
        """Saves this process's parts of `groups` as `step` (None: saved
        already)."""
        self.wait()
        if step in self.store.steps():
            return None
        values = [v.value for v in local_tier.variables(model, groups)]
        described = local_tier.record(model, local_tier.parts(values), meta, groups)
        path = os.path.join(self.directory, str(step))
        tree = {str(i): a for i, a in enumerate(values)}
        self.submit(
            f"the local backup of step {step} to {path}",
            lambda: self.store.save_async(step, tree, described),
        )
        return path

    def restore(
        self, model, persistent_newest: int | None, groups: tuple = tuple(GROUPS)
    ) -> dict | None:
        """Loads the newest local backup at least as new as the persistent
        tier's (every process together); returns its meta (with `local_step`
        and `source`), or None: restore the persistent tier's. Local steps
        newer than the one restored are deleted (their numbers come again)."""
        choice = local_tier.choose(model, self.store, persistent_newest, groups)
        if choice is not None:
            meta = local_tier.load(model, self.store, choice, groups)
            meta.update(local_step=choice.step, source=choice.source)
        stale = [s for s in self.store.steps() if choice is None or s > choice.step]
        for step in stale:  # Here alone (Orbax's deletion has a barrier).
            shutil.rmtree(os.path.join(self.directory, str(step)), ignore_errors=True)
        if stale:
            self.store.reload()
        return meta if choice is not None else None


# Two tiers ---------------------------------------------------------------------


class TwoTierSaves:
    """A backup in two tiers: the persistent one in `directory` (Orbax's
    checkpoints every process writes, on storage every host sees: the
    newest 2 kept) and, with `local_dir`, each host's own (`LocalSaves`).

    One Orbax save in flight, of either tier (Orbax's saves share
    process-wide state: two at once collide); a restore takes the newest
    local backup at least as new as the persistent tier's, else the
    persistent tier's. `groups`: the state saved (`orbax_store.GROUPS`).
    """

    def __init__(
        self,
        directory: str,
        local_dir: str | None,
        *,
        owner: str,
        async_save: bool,
        groups: tuple = tuple(GROUPS),
    ):
        self.directory, self.groups = directory, groups
        self.persistent = OrbaxSaves(
            directory,
            owner=owner,
            what="backup",
            async_save=async_save,
            max_to_keep=2,
        )
        self.local = LocalSaves(local_dir, owner=owner) if local_dir else None

    def steps(self) -> list[int]:
        """The persistent tier's steps, oldest first."""
        return self.persistent.store.steps()

    def prepare(self, model) -> None:
        """Compiles the persistent tier's snapshot (not at the first save)."""
        self.persistent.store.prepare(model, self.groups)

    def save(self, model, step: int, *, meta: dict, local: bool = False) -> None:
        """Saves `model`'s state (as a running `fit` holds it) as `step`, to
        the local tier with `local` (nothing without one)."""
        if local and self.local is None:
            return
        model.jax_state_sync()
        if local:
            self.persistent.wait()
            self.local.save(model, step, meta=meta, groups=self.groups)  # type: ignore[union-attr]
            return
        if self.local is not None:
            self.local.wait()
        self.persistent.save(model, step, groups=self.groups, meta=meta)

    def restore(self, model) -> dict | None:
        """Loads the newest backup into `model` (every process together);
        returns its meta (a local one's with `local_step` and `source`), or
        None if there is none."""
        if self.local is not None:
            steps = self.steps()
            meta = self.local.restore(
                model, max(steps) if steps else None, groups=self.groups
            )
            if meta is not None:
                return meta
        return self.persistent.store.restore(model)

    def check(self) -> None:
        """Raises the error of a finished write of either tier; never waits."""
        self.persistent.check()
        if self.local is not None:
            self.local.check()

    def wait(self) -> None:
        """Waits for the save in flight (either tier); raises its error."""
        if self.local is not None:
            self.local.wait()
        self.persistent.wait()

    def close(self) -> None:
        """Finishes the saves in flight (raises their error); idempotent."""
        try:
            if self.local is not None:
                self.local.close()
        finally:
            self.persistent.close()

    def delete(self) -> None:
        """Deletes the backups: the persistent tier by the chief, each
        host's local tier by its own process (after `close`)."""
        if jax.process_index() == 0 and storage.isdir(self.directory):
            storage.rmtree(self.directory)
        if self.local is not None:
            storage.rmtree(self.local.directory)


# Keras's save calls: saved by every process, written once --------------------

_SINGLE_FILES = (".weights.h5", ".keras", ".h5", ".hdf5")


def save_once(
    model,
    filepath: str,
    save: Callable[[str], object],
    *,
    weights_only: bool,
    method: str,
    overwrite: bool = True,
    snapshot_format: bool = True,
) -> None:
    """`save(path)` (Keras's function, bound to its other arguments) as one
    save of every process; `filepath` written once, by the chief.

    The processes first agree that each is saving (a process that is not,
    as in `if strategy.is_chief: model.save(...)`, is named at once, not
    waited for in a gather). Every process then takes the walk and the
    gathers of values split across processes (`snapshot`); the chief
    `write`s. A format the snapshot does not write (legacy `.h5`, sharded
    `.weights.json`, an unzipped or `hf://` model, a file Keras would ask
    before overwriting) is Keras's own `save` on every process, the others
    writing into a scratch directory. Every process returns when the file
    is complete, or raises (the chief's error on the others). One process:
    `atomic_write` around `save` (Keras's file under a temporary name,
    renamed: a crash leaves the previous file).

    `method` names the call in messages (`"model.save_weights"`);
    `snapshot_format`: the call leaves the file to the snapshot's writer
    (no `max_shard_size`, zipped, not `hf://`).

    Raises:
        ProcessMismatchError: if a process is not saving (names it).
        CheckpointWriteError: on the other processes, if the chief's write
            failed (its error).
    """
    path = os.fspath(filepath)
    single = path.endswith(_SINGLE_FILES) and not path.startswith("hf://")
    # Into a folder that exists (else Keras's own error: it makes none).
    atomic = (
        single
        and (overwrite or not storage.exists(path))
        and (storage.is_remote(path) or os.path.isdir(os.path.dirname(path) or "."))
    )
    if jax.process_count() == 1:
        if atomic:
            keras_files.atomic_write(path, save)
        else:
            save(path)
        return
    rule = (
        f"Call `{method}` on every process: keras_dist saves once, the chief "
        "(process 0) writes the file and the others wait for it."
    )
    _sync.allgather("save", {"method": method}, rule=rule)
    chief = jax.process_index() == 0
    suffix = ".weights.h5" if weights_only else ".keras"
    error = None
    try:
        if atomic and snapshot_format and path.endswith(suffix):
            _write_snapshot(model, path, weights_only=weights_only, chief=chief)
        elif chief:
            keras_files.atomic_write(path, save) if atomic else save(path)
        else:
            with tempfile.TemporaryDirectory(prefix="keras_dist-scratch-") as scratch:
                save(os.path.join(scratch, os.path.basename(path) or "file"))
    except BaseException as failure:
        error = failure
    written_everywhere(error, what=f"{path!r} for `{method}`", rule=rule)


def written_everywhere(
    error: BaseException | None, *, what: str, rule: str = ""
) -> None:
    """Every process returns once the chief's files are complete: raises
    `error` (this process's), or on the others the chief's.

    Every process calls it after its part of a save (`error`: what that
    part raised, or None).

    Raises:
        CheckpointWriteError: on a process other than the chief, if the
            chief's part failed (its error).
    """
    if jax.process_count() > 1:
        outcome = None if error is None else f"{type(error).__name__}: {error}"[:500]
        outcomes = _sync.allgather("save-done", outcome, rule=rule)
    else:
        outcomes = [None]
    if error is not None:
        raise error
    if outcomes[0] is not None:
        raise CheckpointWriteError(
            f"The chief (process 0) could not write {what}: {outcomes[0]}. "
            "See the chief's log."
        )


def _write_snapshot(model, path: str, *, weights_only: bool, chief: bool) -> None:
    """Every process: the walk and the gathers; the chief: the file."""
    snap = keras_files.snapshot(model, with_config=not weights_only, copy_local=chief)
    if chief:
        keras_files.write(snap, path)
    else:
        snap.release()
