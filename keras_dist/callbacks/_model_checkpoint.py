"""`ModelCheckpoint` that only the chief writes, atomically, in the background;
its `filepath` checked before training (`_filepath_checks.py`)."""

import contextlib
import os
import time
from typing import Any

import jax
import keras
from jax.experimental import multihost_utils

from keras_dist._checkpoint import storage
from keras_dist._checkpoint.orbax_store import GROUPS, WEIGHTS
from keras_dist._checkpoint.pipeline import (
    KerasFileSaves,
    OrbaxSaves,
    check_shared,
    check_writable_dir,
    save_once,
    written_everywhere,
)
from keras_dist._checks import check_int
from keras_dist._private_api._access import step_counter
from keras_dist._private_api._hooks import ModelCheckpointHooks
from keras_dist._private_api._keras_saving import model_files
from keras_dist._private_api._state import originals
from keras_dist.callbacks._filepath_checks import (
    check_filepath_keys,
    check_monitor,
    checked_filepath,
    formats_logs,
)
from keras_dist.callbacks._lr_control import plain_learning_rate
from keras_dist.callbacks._step_end import StepEnd
from keras_dist.data import _call

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(ModelCheckpointHooks):
    """Keras's `ModelCheckpoint`, safe with many processes and crashes.

    Same arguments and behaviour as `keras.callbacks.ModelCheckpoint`
    (`monitor`, `save_best_only`, `save_weights_only`, `mode`, `save_freq`
    including integer steps, `{epoch}` and metric formatting), plus:

    - only the chief (process 0) writes; the other processes write nothing;
    - each file is written to a temporary name in the same directory, then
      renamed: a crash mid-write leaves the previous file intact;
    - temporary files an interrupted earlier run left are removed when
      training begins;
    - `max_to_keep` deletes the oldest checkpoints beyond that number;
    - a `checkpoint` file in the directory lists them, newest last, for
      `kd.callbacks.latest_checkpoint(directory)`;
    - the directory is checked for writing when the callback is created;
    - saves are asynchronous (`async_save=True`, the default): the training
      thread waits only for the state's device -> host copy, a background
      thread writes the file (the one `save_weights`/`save` writes). One
      save is in flight at a time (a newer one waits for the older). A
      background write that fails raises `kd.errors.CheckpointWriteError`
      (its path and cause) on the training thread at the next step, save or
      the end of `fit`; the previous checkpoint is intact. A save in flight
      when `fit` ends, raises or is preempted finishes first;
    - `sharded=True` writes Orbax checkpoints instead (`filepath` is their
      directory, one subdirectory per training step): each process writes
      the parts of the state it holds, nothing is gathered on one host
      (asynchronous, with one process or several). The layout is
      `keras.callbacks.OrbaxCheckpoint`'s: `model.load_weights` reads it (by
      names) and `kd.callbacks.load_checkpoint` onto any mesh (by order);
      `latest_checkpoint` finds Keras's too;
    - keep policies: `max_to_keep`, `keep_period` (a checkpoint of a step
      that is a multiple of it is never deleted), and
      `save_interval_seconds` (also save at the first step end after that
      many seconds: for preemptible machines).

    A tf.distribute-style prefix without a suffix (`"ckpt_{epoch}"`) gets
    `.weights.h5` with `save_weights_only=True` and `.keras` otherwise.

    Example:

    ```python
    ckpt = kd.callbacks.ModelCheckpoint("ckpts/ckpt_{epoch}", save_weights_only=True)
    model.fit(x, y, epochs=3, callbacks=[ckpt])
    model.load_weights(kd.callbacks.latest_checkpoint("ckpts"))
    ```

    Args:
        filepath: where to save; may contain `{epoch}`, `{batch}` and log
            keys. With `sharded=True`, the directory of the checkpoints.
        max_to_keep: keep at most this many checkpoints (oldest deleted).
            Defaults to `None`: keep all.
        keep_period: also keep every checkpoint of a training step (the
            optimizer's iterations) that is a multiple of this.
        save_interval_seconds: also save at the first step end this many
            seconds after the previous save (or the start of training).
        async_save: write in the background. Defaults to `True`; `False`
            waits for each file to be on disk (a legacy `.h5` model file is
            always written synchronously).
        sharded: write Orbax checkpoints, each process its own parts.
        **kwargs: the arguments of `keras.callbacks.ModelCheckpoint`.

    Raises:
        ValueError: if `filepath` has a suffix that does not match
            `save_weights_only` (or has `{}` keys with `sharded=True`), or a
            count or interval is not positive.
        PermissionError: if the directory of `filepath` is not writable.
    """

    def __init__(
        self,
        filepath: "str | os.PathLike",
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        save_interval_seconds: float | None = None,
        async_save: bool = True,
        sharded: bool = False,
        **kwargs: Any,
    ) -> None:
        filepath = storage.served(filepath, argument="filepath")
        weights_only = kwargs.get("save_weights_only", False)
        for name, flag in (("async_save", async_save), ("sharded", sharded)):
            if not isinstance(flag, bool):
                raise TypeError(
                    f"`{name}` must be True or False. Received: {name}={flag!r}."
                )
        filepath = checked_filepath(
            filepath, weights_only=weights_only, sharded=sharded
        )
        if max_to_keep is not None:
            max_to_keep = check_int(max_to_keep, name="max_to_keep", meaning=" or None")
        if keep_period is not None:
            keep_period = check_int(keep_period, name="keep_period", meaning=" or None")
        if save_interval_seconds is not None and not (
            isinstance(save_interval_seconds, (int, float))
            and not isinstance(save_interval_seconds, bool)
            and save_interval_seconds > 0
        ):
            raise ValueError(
                "`save_interval_seconds` must be a positive number of seconds or "
                f"None. Received: save_interval_seconds={save_interval_seconds!r}."
            )
        placeholder = filepath
        if sharded:  # Keras's checks want a file name.
            placeholder = "checkpoint" + (".weights.h5" if weights_only else ".keras")
        super().__init__(placeholder, **kwargs)
        self.filepath = filepath
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        self.save_interval_seconds = save_interval_seconds
        self.async_save = async_save
        self.sharded = sharded
        self.directory = check_writable_dir(
            filepath if sharded else (storage.dirname(filepath) or "."),
            argument="filepath",
            orbax=sharded,
        )
        # The save route: Keras's files, or (sharded) Orbax's, opened by `fit`.
        self._saves: KerasFileSaves | OrbaxSaves | None = None
        if not sharded:
            self._saves = KerasFileSaves(
                self.directory,
                owner="ModelCheckpoint",
                async_save=async_save,
                max_to_keep=max_to_keep,
                keep_period=keep_period,
                loadable=plain_learning_rate,
            )
        self._files: dict | None = None  # Keras's JSON and assets (sharded).
        self._last_save = time.monotonic()
        self._step_end = StepEnd()
        self._logs_each_step = self.save_freq != "epoch" and (
            self.save_best_only or formats_logs(filepath)
        )
        if self._logs_each_step:  # Keras's hook: the step's logs, each step.
            self.on_train_batch_end = self._after_execution

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        if isinstance(self._saves, KerasFileSaves):
            check_filepath_keys(self.filepath, self.model)  # Before epoch 1 trains.
            self._saves.begin(
                self.model, with_config=not self.save_weights_only, chief=_is_chief()
            )
            self._saves.write_index(done=False, chief=_is_chief())
        else:
            check_shared(self.directory, argument="filepath", owner="ModelCheckpoint")
            self._saves = OrbaxSaves(
                self.directory,
                owner="ModelCheckpoint",
                async_save=self.async_save,
                max_to_keep=self.max_to_keep,
                keep_period=self.keep_period,
            )
            self._saves.store.prepare(self.model, self._groups)
            # Keras's model JSON and assets, made once a `fit`, here: making
            # them waits for every step dispatched (it reads the learning
            # rate). A model Keras cannot serialize fails at the first save,
            # as with Keras's `OrbaxCheckpoint`.
            self._files = None
            with contextlib.suppress(Exception):
                self._files = self._model_files()
        self._last_save = time.monotonic()
        # Steps are counted on the host from here, so a save need not read
        # the step counter (which waits for every step dispatched).
        call = _call.active()
        self._step_end.start(
            self.params.get("steps"), step_counter(self.model.optimizer), call
        )
        if call is not None:  # Keras skips on_train_end when fit raises.
            call.on_close(self._finish)

    # No per-step hook: Keras's makes `fit` wait for every step, even with
    # `save_freq="epoch"` (`_step_end.StepEnd`). An execution's end is handled at
    # the next one's begin, or at the epoch's end. Only when the step's logs
    # name the file or decide the save (`save_best_only`) with an integer
    # `save_freq` does `__init__` put Keras's per-step hook back.
    on_train_batch_end = keras.callbacks.Callback.on_train_batch_end

    def _after_execution(self, batch: int, logs: dict | None) -> None:
        """Keras's per-step checks and save, then the write and interval checks."""
        keras.callbacks.ModelCheckpoint.on_train_batch_end(self, batch, logs)
        self._check()  # A background write that failed raises here.
        interval = self.save_interval_seconds
        if interval is not None and self._interval_passed(interval):
            self.save_checkpoint(self.current_epoch, batch, logs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_begin(epoch, logs)
        self._step_end.reset()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        finished = self._step_end.begin(batch)
        if finished is not None and not self._logs_each_step:
            self._after_execution(finished, {})

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        finished = self._step_end.epoch_end()
        if finished is not None and not self._logs_each_step:
            self._after_execution(finished, {})
        super().on_epoch_end(epoch, logs)
        self._check()

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        error = None
        try:
            self._finish()
            if isinstance(self._saves, KerasFileSaves):
                # The marker `kd.callbacks.SidecarEvaluator` stops on.
                self._saves.write_index(done=True, chief=_is_chief())
        except BaseException as failure:
            error = failure
        # `fit` returns on every process once the chief's files are there
        # (the program may read them next: `latest_checkpoint`).
        written_everywhere(error, what=f"the checkpoints in {self.directory!r}")

    def wait(self) -> None:
        """Waits until the save in flight is on disk.

        Raises:
            kd.errors.CheckpointWriteError: if it failed.
        """
        if self._saves is not None:
            self._saves.wait()

    def _check(self) -> None:
        if self._saves is not None:
            self._saves.check()

    def _finish(self) -> None:
        """Finishes the save in flight (raises its error); idempotent."""
        saves = self._saves
        if isinstance(saves, OrbaxSaves):  # Opened by the next `fit`.
            self._saves = None
        if saves is not None:
            saves.close()

    @property
    def _groups(self) -> tuple:
        return WEIGHTS if self.save_weights_only else tuple(GROUPS)

    def _model_files(self) -> dict | None:
        """Keras's model JSON and assets (None: weights only)."""
        if self.save_weights_only:
            return None
        with plain_learning_rate(self.model):  # Loadable without keras_dist.
            return model_files(self.model)

    def _interval_passed(self, interval: float) -> bool:
        due = time.monotonic() - self._last_save >= interval
        if jax.process_count() > 1:  # The chief's clock decides for all.
            due = bool(multihost_utils.broadcast_one_to_all(int(due)))
        return due

    def save_checkpoint(self, epoch: int, batch: int | None, logs: dict | None) -> None:
        """Saves where and when Keras's `ModelCheckpoint` would: in the background."""
        if self.save_best_only and batch is None:
            check_monitor(self.monitor, logs)
        filepath = self.keras_file_path(epoch, batch, logs)
        if not self.keras_should_save(epoch, batch, logs, filepath):
            return
        self._last_save = time.monotonic()
        self.model.jax_state_sync()  # The state a running `fit` holds.
        step = self._step_end.step(self._step_end.last if batch is None else batch)
        if self.sharded:
            if not isinstance(self._saves, OrbaxSaves):  # Opened by on_train_begin.
                raise RuntimeError("ModelCheckpoint(sharded=True) saves only in `fit`.")
            if self._files is None:
                self._files = self._model_files()
            path = self._saves.save(
                self.model, step, groups=self._groups, files=self._files
            )
            if path is not None and self.verbose > 0:
                print(f"\nEpoch {epoch + 1}: saving model to {path}")
            return
        if not isinstance(self._saves, KerasFileSaves):  # Made by __init__.
            raise RuntimeError("ModelCheckpoint lost its file saves: make a new one.")
        chief = _is_chief()
        if chief and storage.isdir(filepath):
            raise IsADirectoryError(
                f"ModelCheckpoint cannot write to {filepath!r}: it is a directory. "
                "Give `filepath` a file name, e.g. 'ckpts/ckpt_{epoch}.weights.h5'."
            )
        if filepath.endswith(".weights.h5" if self.save_weights_only else ".keras"):
            self._saves.save(
                self.model,
                filepath,
                epoch=epoch,
                step=step,
                with_config=not self.save_weights_only,
                chief=chief,
            )
        else:  # A legacy `.h5` model: Keras's own writer, on every process.
            self._saves.wait()  # An earlier background write first.
            self._write_legacy(filepath)
            self._saves.kept(filepath, epoch=epoch, step=step, chief=chief)
        if self.verbose > 0 and chief and not self._saves.pending:
            print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")

    def _write_legacy(self, filepath: str) -> None:
        keras_save = originals["Model.save"]
        with plain_learning_rate(self.model):  # Loadable without keras_dist.
            save_once(
                self.model,
                filepath,
                lambda p: keras_save(self.model, p, overwrite=True),
                weights_only=False,
                method="ModelCheckpoint's model.save",
            )


def _is_chief() -> bool:
    """Whether this process writes the files (process 0)."""
    return jax.process_index() == 0
