"""`BackupStore`: a model's whole training state in Orbax checkpoints."""

import os
import warnings

import jax
import numpy as np

from keras_dist._keras_compat._freeze import freeze, prepare
from keras_dist._keras_compat._orbax_private import without_preemption_queries
from keras_dist.callbacks import _raw_arrays
from keras_dist.callbacks._background import BackgroundWriter
from keras_dist.callbacks._orbax import (
    background_barriers,
    backup_type_handlers,
    collection_paused,
)
from keras_dist.errors import IncompatibleBackupError

__all__ = ["BackupStore", "IncompatibleBackupError", "variable_groups"]

GROUPS = ("trainable", "non_trainable", "optimizer", "metrics")
ITEM = "arrays"  # A one-process backup's arrays (`_raw_arrays.py`).


def variable_groups(model) -> dict[str, list]:
    return {
        "trainable": list(model.trainable_variables),
        "non_trainable": list(model.non_trainable_variables),
        "optimizer": list(model.optimizer.variables) if model.optimizer else [],
        "metrics": list(model.metrics_variables),
    }


class BackupStore:
    """Numbered backups in `directory`: atomic (Orbax), the previous one kept.

    A backup an interrupted run left half-written (Orbax's temporary
    `<step>.orbax-checkpoint-tmp-*` directory) is deleted when the store opens.

    A backup holds every variable of the model, its optimizer and metrics
    (uncompressed), plus a JSON `meta` dict (with each variable's path and
    shape, to refuse a backup of another model). With one process the arrays
    are their parts' raw bytes (`_raw_arrays.py`: 1.4-1.8x the CPU of the
    bytes' own write, a quarter to a half of Orbax's array format's); with
    several, each process writes the parts of split variables it holds
    (Orbax's PyTree format). Nothing is gathered whole, and either kind
    restores onto any layout and number of processes (so do the backups in
    Orbax's format that one process wrote before raw parts).

    With `async_save`, `save` freezes the state (copies on its devices, one
    dispatch that does not wait for the step computing it; on host when the
    devices lack room) and Orbax's save runs on keras_dist's writer thread,
    device -> host copies included; with several processes too (Orbax's
    barriers then go through JAX's coordination service, `_orbax.py`). One
    save is in flight at a time: a newer `save` first waits for the older. A
    write that failed in the background raises `CheckpointWriteError` (its
    path and cause) at the next `check`, `save`, `wait` or `close`; the
    backup it was writing is never committed, so the previous one is intact.
    """

    def __init__(self, directory: str, *, async_save: bool):
        import orbax.checkpoint as ocp

        self.directory = directory
        self.async_save = async_save
        self.pending: int | None = None  # The number of a save in flight.
        self._writer = None
        if async_save:
            background_barriers()
            self._writer = BackgroundWriter(
                "BackupAndRestore",
                f"The previous backup in {directory} is intact.",
                orbax=True,
            )
        self._manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=2,
                # Orbax's own asynchronous commit is not used: its save runs
                # on keras_dist's writer thread, which keeps one save in
                # flight and raises its error on the training thread.
                enable_async_checkpointing=False,
                create=True,
                # A backup an interrupted run left half-written (Orbax writes
                # `<step>.orbax-checkpoint-tmp-*` then renames) is deleted.
                cleanup_tmp_directories=True,
            ),
            item_handlers={
                # Uncompressed: zstd saves ~9% of a float state's bytes and
                # more than doubles a write's CPU time (the host's, shared
                # with training; benchmarks/README.md).
                # Without each array's sharding file; replica-parallel
                # writing only with several processes (`_orbax.py`).
                "state": ocp.PyTreeCheckpointHandler(
                    use_compression=False,
                    type_handler_registry=backup_type_handlers(),
                ),
                # One process: the parts' raw bytes (a fraction of the CPU).
                ITEM: _raw_arrays.handler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        without_preemption_queries(self._manager)

    def prepare(self, model) -> None:
        """Compiles an asynchronous save's copy of `model`'s state now (when
        `fit` begins), not on the training thread at the first save."""
        if self._writer is not None:
            prepare([v.value for vs in variable_groups(model).values() for v in vs])

    def save(self, model, number: int, meta: dict) -> None:
        groups = variable_groups(model)
        state = {name: [v.value for v in vs] for name, vs in groups.items()}
        meta = {
            **meta,
            "variables": {
                name: [[v.path, list(v.shape)] for v in vs]
                for name, vs in groups.items()
            },
        }
        self.wait()  # One save in flight: the older one first (and its error).
        if self._writer is None:
            self._write(number, state, meta)
            return
        frozen = iter(freeze([v for vs in state.values() for v in vs]))
        state = {name: [next(frozen) for _ in vs] for name, vs in state.items()}
        self.pending = number
        self._writer.submit(
            f"the backup of step {number} to "
            f"{os.path.join(self.directory, str(number))}",
            lambda: self._write(number, state, meta),
        )

    def _write(self, number: int, state: dict, meta: dict) -> None:
        import orbax.checkpoint as ocp

        if number in self._manager.all_steps():
            self._manager.delete(number)
        if jax.process_count() == 1:
            items = {ITEM: _raw_arrays.save_args(state)}
        else:
            items = {"state": ocp.args.PyTreeSave(state)}
        with collection_paused():
            self._manager.save(  # Synchronous: written and committed on return.
                number, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta))
            )

    def latest(self) -> int | None:
        """The newest backup's number (None: there is none)."""
        return self._manager.latest_step()

    def check(self) -> None:
        """Raises the error of a background write that failed, if one did.

        Raises:
            CheckpointWriteError: naming the backup's path and the cause.
        """
        if self._writer is None:
            return
        try:
            self._writer.check()
        finally:
            if not self._writer.pending:
                self.pending = None

    def wait(self) -> None:
        """Waits until the save in flight is on disk (committed).

        Raises:
            CheckpointWriteError: if it failed.
        """
        if self._writer is None:
            return
        self.pending = None
        self._writer.wait()

    def restore(self, model) -> dict | None:
        """Loads the newest readable backup into `model`; returns its meta.

        A backup that cannot be read is reported and the previous one tried;
        the state is laid out like the model's variables now are (so a
        backup of another number of replicas is resharded).

        Raises:
            IncompatibleBackupError: the backup was written by another model.
            RuntimeError: no backup can be read.
        """
        import orbax.checkpoint as ocp

        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            return None
        groups = variable_groups(model)
        abstract = {
            name: [
                jax.ShapeDtypeStruct(v.shape, v.value.dtype, sharding=v.value.sharding)
                for v in vs
            ]
            for name, vs in groups.items()
        }
        for number in steps:
            try:
                meta = self._manager.restore(
                    number, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
                )["meta"]
                self._check_compatible(meta, groups)
                state = self._restore_arrays(number, abstract)
            except IncompatibleBackupError:
                raise
            except Exception as error:  # A torn or corrupt backup: try an older one.
                warnings.warn(
                    f"BackupAndRestore: the backup of step {number} in "
                    f"{self.directory} cannot be read ({type(error).__name__}: "
                    f"{str(error)[:200]}); trying the previous one.",
                    stacklevel=3,
                )
                continue
            for name in GROUPS:
                for v, value in zip(groups[name], state[name], strict=True):
                    v.assign(value)
            meta["metrics_values"] = [np.asarray(v) for v in state["metrics"]]
            return meta
        raise RuntimeError(
            f"BackupAndRestore: none of the backups {steps} in {self.directory} "
            "can be read. Delete the directory to start from scratch."
        )

    def _restore_arrays(self, number: int, abstract: dict) -> dict:
        import orbax.checkpoint as ocp

        if os.path.isdir(os.path.join(self.directory, str(number), ITEM)):
            items = {ITEM: _raw_arrays.restore_args(abstract)}
        else:  # Several processes wrote it, or a keras_dist before raw arrays.
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
            items = {"state": ocp.args.PyTreeRestore(abstract, restore_args)}
        restored = self._manager.restore(number, args=ocp.args.Composite(**items))
        return restored[next(iter(items))]

    def _check_compatible(self, meta: dict, groups: dict) -> None:
        for name in GROUPS:
            saved = meta["variables"][name]
            current = [[v.path, list(v.shape)] for v in groups[name]]
            for (s_path, s_shape), (c_path, c_shape) in zip(
                saved, current, strict=False
            ):
                if s_shape != c_shape:
                    raise IncompatibleBackupError(
                        f"The backup in {self.directory} does not fit this model: "
                        f"variable {c_path!r} has shape {tuple(c_shape)} but the "
                        f"backup's {s_path!r} has shape {tuple(s_shape)}. Resume with "
                        "the model that wrote the backup, or delete the directory."
                    )
            if len(saved) != len(current):
                raise IncompatibleBackupError(
                    f"The backup in {self.directory} does not fit this model: it "
                    f"has {len(saved)} {name} variables, the model {len(current)}. "
                    "Resume with the model that wrote the backup, or delete the "
                    "directory."
                )

    def close(self) -> None:
        """Finishes the save in flight, then closes (raises its error, if any)."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.close()
            self._manager.close()
