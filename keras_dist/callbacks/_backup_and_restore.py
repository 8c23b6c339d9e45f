"""`BackupAndRestore`: resume an interrupted `fit` exactly where it stopped."""

import os

import jax
import keras

from keras_dist._checkpoint.pipeline import (
    TwoTierSaves,
    check_shared,
    check_writable_dir,
)
from keras_dist._checks import check_int
from keras_dist._private_api import _access
from keras_dist._private_api._access import step_counter
from keras_dist.callbacks._step_end import StepEnd
from keras_dist.cluster import _heartbeat
from keras_dist.cluster._preemption import PreemptionNotice
from keras_dist.data import _call
from keras_dist.strategies._base import strategy_of_model

__all__ = ["BackupAndRestore"]


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state; a restarted `fit` continues exactly.

    Beyond `keras.callbacks.BackupAndRestore` and tf.distribute's, which redo
    the interrupted epoch: the backup holds the weights, the optimizer state,
    the metric accumulators of the epoch, the random-generator states the
    model keeps in variables (dropout), the epoch and the step within it. A
    run killed at any step (even SIGKILL) and restarted with the same command
    replays the input pipeline up to that step — reading, not training — so
    every shuffle repeats, and ends with the weights of an uninterrupted run.
    On SIGTERM (preemption) it saves at the next step boundary and exits the
    process with status 0.

    Backups are Orbax checkpoint steps in `keras.callbacks.OrbaxCheckpoint`'s
    layout (atomic: written aside, then committed by a rename; the previous
    one is kept), each process writing the parts it holds. A backup that
    cannot be read is reported and the previous one used. Restoring onto
    another number of replicas or processes reshards the state onto the
    current strategy.

    Saves are asynchronous by default, with one process or several:
    training waits while Orbax copies the state to host memory, and
    Orbax's threads write the files. One save is in flight
    at a time (a newer one waits for the older). A background write that
    fails raises `kd.errors.CheckpointWriteError` (the path and the cause)
    on the training thread at the next step, save or the end of `fit`; the
    previous backup stays intact. A save in flight when `fit` ends, raises,
    or is preempted (SIGTERM) is finished before `fit` returns or the
    process exits.

    Exactness needs what an uninterrupted run needs to be reproducible: the
    same seeds set before `fit` (e.g. `keras.utils.set_random_seed`), and an
    input that can be iterated again (arrays, `tf.data`, `PyDataset`, Grain;
    not a one-shot generator).

    Example:

    ```python
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = make_model(); model.compile(...)
    model.fit(x, y, epochs=10, callbacks=[
        kd.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)])
    ```

    Args:
        backup_dir: directory of the backups (created; must be writable).
        save_freq: `"epoch"` or an int: back up every that many steps (and at
            every epoch end). Defaults to `"epoch"`.
        delete_checkpoint: delete the backups when `fit` completes. Defaults
            to `True`.
        save_before_preemption: on SIGTERM, back up at the next step boundary
            and exit. Defaults to `True`.
        async_save: write backups on a background thread. Defaults to
            `True`; `False` waits for each backup to be on disk.
        local_dir: a directory on storage each host has to itself
            (`/dev/shm/...` or a local disk; the same path on every host):
            the local tier. Every `local_save_freq` steps each process
            writes its own parts of the state to `local_dir/process_<p>` (the
            newest 2 kept), on a background thread; a restarted `fit`
            resumes from the newest step complete on every process, or, where
            a process lost its local tier (a replaced host), from a process
            that holds the whole state (replicated: Mirrored), or else from
            `backup_dir` (state split over processes). Defaults to None (no
            local tier).
        local_save_freq: steps between the local tier's saves (an int; with
            `local_dir`). Defaults to 10.

    Raises:
        ValueError: for an empty `backup_dir` or a bad `save_freq`.
        PermissionError: if `backup_dir` is not writable.
    """

    def __init__(
        self,
        backup_dir: "str | os.PathLike",
        *,
        save_freq: "str | int" = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = True,
        async_save: bool = True,
        local_dir: "str | os.PathLike | None" = None,
        local_save_freq: int = 10,
    ):
        super().__init__()
        if not isinstance(async_save, bool):
            raise TypeError(
                "`async_save` must be True or False. Received: "
                f"async_save={async_save!r}."
            )
        if not backup_dir:
            raise ValueError(
                "`backup_dir` must name a directory. Received: "
                f"backup_dir={backup_dir!r}."
            )
        if save_freq != "epoch":
            save_freq = check_int(
                save_freq, name="save_freq", meaning=' (steps) or "epoch"'
            )
        self.backup_dir = check_writable_dir(
            os.fspath(backup_dir), argument="backup_dir", orbax=True
        )
        self.save_freq = save_freq
        self.local_save_freq = check_int(
            local_save_freq, name="local_save_freq", meaning=" (steps)"
        )
        self.local_dir = None
        if local_dir is not None:
            self.local_dir = check_writable_dir(
                os.fspath(local_dir), argument="local_dir", local=True
            )
            if self.local_dir == self.backup_dir:
                raise ValueError(
                    "`local_dir` must be another directory than `backup_dir` (storage "
                    f"each host has to itself). Received: local_dir={local_dir!r}."
                )
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self.async_save = async_save
        self._store: TwoTierSaves | None = None
        self._preemption = PreemptionNotice()
        self._step_end = StepEnd()

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Before Orbax's first save, which would wait for a folder another
        # host made on its own disk.
        check_shared(self.backup_dir, argument="backup_dir", owner="BackupAndRestore")
        store = self._store = TwoTierSaves(
            self.backup_dir,
            self.local_dir,
            owner="BackupAndRestore",
            async_save=self.async_save,
        )
        self._epoch, self._step_in_epoch, self._resumed_metrics = 0, 0, None
        call = _call.active()
        self._fit_initial_epoch = call.initial_epoch if call is not None else 0
        strategy = strategy_of_model(self.model)
        self._replicas = strategy.num_replicas_in_sync if strategy else 1
        self._restore(call)
        store.prepare(self.model)
        self._global_step = step_counter(self.model.optimizer)
        _heartbeat.set_step(self._global_step)  # Where the launcher sees it.
        # Backups are numbered on the host from here (`StepEnd.step`), so a save
        # need not read the step counter (which waits for every step
        # dispatched): above the restored backup's number and any other.
        self._saved_number = max([self._global_step, *store.steps()])
        self._step_end.start(self.params.get("steps"), self._saved_number, call)
        if self.save_before_preemption:
            self._preemption.install()
        if call is not None:  # Keras skips on_train_end when fit raises.
            call.on_close(self._release)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self._resumed_metrics is not None:  # fit reset them; put them back.
            for v, value in zip(
                self.model.metrics_variables, self._resumed_metrics, strict=True
            ):
                v.assign(value)
            self._resumed_metrics = None
        else:
            self._step_in_epoch = 0
        self._saved_step = self._step_in_epoch
        self._step_end.reset()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        # The previous execution's end, handled here rather than in an
        # `on_train_batch_end` hook, which would make Keras wait for every
        # step (`_step_end.StepEnd`); the model's state is the same.
        finished = self._step_end.begin(batch)
        if finished is None:
            return
        self._step_in_epoch = finished + 1
        store = self._open_store()
        store.check()  # A background write that failed raises here.
        if self._preemption_noticed():
            self._save(self._epoch, self._step_in_epoch, finished)
            self._exit_preempted()
        if (
            isinstance(self.save_freq, int)  # Not "epoch".
            and self._steps_since_save() >= self.save_freq
        ):
            self._save(self._epoch, self._step_in_epoch, finished)
        if (
            store.local is not None
            and self._step_end.step(finished) - self._saved_number
            >= self.local_save_freq
        ):
            self._save(self._epoch, self._step_in_epoch, finished, local=True)

    def _exit_preempted(self) -> None:
        self._open_store().wait()  # On disk before the process exits.
        if jax.process_index() == 0:
            print(
                # Epochs counted from 1, as Keras's progress bar and
                # "resuming at epoch E, step S" count them.
                f"\nBackupAndRestore: preempted (SIGTERM); saved at epoch "
                f"{self._epoch + 1}, step {self._step_in_epoch} to "
                f"{self.backup_dir}; exiting.",
                flush=True,
            )
        self._preemption.uninstall()
        raise SystemExit(0)

    def _position(self, epoch: int, step: int) -> tuple[int, int]:
        """A backup after an epoch's last step resumes at the next epoch.

        (Keras cannot run an epoch without steps; that epoch's validation is
        not repeated, the weights are the same.)
        """
        steps = self.params.get("steps")
        if step and steps and step >= steps:
            return epoch + 1, 0
        return epoch, step

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        finished = self._step_end.epoch_end()  # The epoch's last execution.
        if finished is not None:
            self._step_in_epoch = finished + 1
        self._open_store().check()
        self._save(epoch + 1, 0, self._step_end.last)
        if finished is not None and self._preemption_noticed():
            self._exit_preempted()

    def on_train_end(self, logs: dict | None = None) -> None:
        store = self._store
        self._release()
        if self.delete_checkpoint and store is not None:
            store.delete()

    def _release(self) -> None:
        """Undoes what `on_train_begin` set up (also when `fit` raises)."""
        _access.set_initial_epoch(self.model, None)
        self._preemption.uninstall()
        store, self._store = self._store, None
        if store is not None:
            store.close()  # Finishes the saves in flight; raises if one failed.

    def _open_store(self) -> TwoTierSaves:
        """The store of this `fit` (from `on_train_begin` to `_release`)."""
        if self._store is None:
            raise RuntimeError(
                "BackupAndRestore is not in a running `fit`: its backup store opens "
                "in `on_train_begin` and closes when `fit` ends."
            )
        return self._store

    def _save(
        self, epoch: int, step: int, through: int | None, *, local: bool = False
    ) -> None:
        """Backs up the state after step index `through` of this epoch (to
        the local tier with `local`)."""
        # Counted on the host (`StepEnd.step`): the optimizer's step count,
        # unless a loss-scaling optimizer skipped steps (then higher), and
        # always above the backups in the directory.
        self._saved_number = self._step_end.step(through)
        epoch, position = self._position(epoch, step)
        meta = {
            "epoch": int(epoch),
            "step": int(position),
            "fit_initial_epoch": int(self._fit_initial_epoch),
            "num_replicas": self._replicas,
        }
        if not local:
            self._saved_step = step
        self._open_store().save(self.model, self._saved_number, meta=meta, local=local)

    def _steps_since_save(self) -> int:
        return self._step_in_epoch - self._saved_step

    def _restore(self, call: _call.CallState | None) -> None:
        meta = self._open_store().restore(self.model)
        if meta is None:
            return
        epoch, step = meta["epoch"], meta["step"]
        _access.set_initial_epoch(self.model, epoch)
        self._epoch, self._step_in_epoch = epoch, step
        if step:
            self._resumed_metrics = meta["metrics_values"]
        epochs = epoch - meta["fit_initial_epoch"]
        if call is not None and (epochs or step):
            call.resume = _call.ResumePlan(epochs=epochs, steps=step)
        if jax.process_index() == 0:
            where = ""
            if "local_step" in meta:
                source = meta["source"]
                where = f"the local tier's step {meta['local_step']}" + (
                    ", every process its own; "
                    if source is None
                    else f", from process {source}'s; "
                )
            print(
                f"BackupAndRestore: resuming at epoch {epoch + 1}, step {step} "
                f"({where}backup of {meta['num_replicas']} replicas).",
                flush=True,
            )

    def _preemption_noticed(self) -> bool:
        """SIGTERM noticed (with several processes: at an agreed step, where
        each saves, as Orbax saves are collective, and exits)."""
        if not self.save_before_preemption:
            return False
        # The optimizer's step numbers, which Orbax's own preemption checks
        # use too (the service needs one growing sequence).
        self._global_step += 1
        return self._preemption.reached(self._global_step)
