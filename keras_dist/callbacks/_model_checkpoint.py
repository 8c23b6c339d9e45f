"""`ModelCheckpoint` that only the chief writes, atomically; `latest_checkpoint`."""

import json
import os
import tempfile
import warnings

import jax
import keras

from keras_dist._checks import check_int
from keras_dist.callbacks._checkpoint_keys import check_filepath_keys, check_monitor
from keras_dist.callbacks._chief import is_chief
from keras_dist.callbacks._files import (
    atomic_write,
    check_writable_dir,
    remove_stale_temps,
)
from keras_dist.callbacks._lr_control import plain_learning_rate

__all__ = ["ModelCheckpoint", "latest_checkpoint"]

STATE_FILE = "checkpoint"
_SUFFIXES = (".weights.h5", ".keras", ".h5")


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
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
    - the directory is checked for writing when the callback is created.

    A tf.distribute-style prefix without a suffix (`"ckpt_{epoch}"`) gets
    `.weights.h5` with `save_weights_only=True` and `.keras` otherwise.

    Example:

    ```python
    ckpt = kd.callbacks.ModelCheckpoint("ckpts/ckpt_{epoch}", save_weights_only=True)
    model.fit(x, y, epochs=3, callbacks=[ckpt])
    model.load_weights(kd.callbacks.latest_checkpoint("ckpts"))
    ```

    Args:
        filepath: where to save; may contain `{epoch}`, `{batch}` and log keys.
        max_to_keep: keep at most this many checkpoints (oldest deleted).
            Defaults to `None`: keep all.
        **kwargs: the arguments of `keras.callbacks.ModelCheckpoint`.

    Raises:
        ValueError: if `filepath` has a suffix that does not match
            `save_weights_only`, or `max_to_keep` is not a positive int.
        PermissionError: if the directory of `filepath` is not writable.
    """

    def __init__(self, filepath, *, max_to_keep: int | None = None, **kwargs):
        filepath = os.fspath(filepath)
        weights_only = kwargs.get("save_weights_only", False)
        if not filepath.endswith(_SUFFIXES) and "." not in os.path.basename(filepath):
            filepath += ".weights.h5" if weights_only else ".keras"
        expected = (".weights.h5",) if weights_only else (".keras", ".h5")
        if not filepath.endswith(expected) or (
            not weights_only and filepath.endswith(".weights.h5")
        ):
            raise ValueError(
                f"`filepath` must end in {' or '.join(expected)} with "
                f"save_weights_only={weights_only}. Received: filepath={filepath!r}."
            )
        if max_to_keep is not None:
            max_to_keep = check_int(max_to_keep, name="max_to_keep", meaning=" or None")
        super().__init__(filepath, **kwargs)
        self.max_to_keep = max_to_keep
        self.directory = check_writable_dir(
            os.path.dirname(filepath) or ".", argument="filepath"
        )
        self._kept: list[str] = []
        self._epochs: dict[str, int] = {}

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        check_filepath_keys(self.filepath, self.model)  # Before epoch 1 trains.
        if is_chief():  # Temporary files of writes an earlier run interrupted.
            remove_stale_temps(self.directory)
        self._write_index(done=False)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        # The marker `kd.callbacks.SidecarEvaluator` stops on.
        self._write_index(done=True)

    def _save_model(self, epoch, batch, logs):
        if self.save_best_only and batch is None:
            check_monitor(self.monitor, logs)
        filepath = self._get_file_path(epoch, batch, logs)
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        if not is_chief():
            if jax.process_count() > 1:
                # Saving runs collectives (JAX checks values across processes):
                # every process takes part; the others write to a scratch dir.
                with tempfile.TemporaryDirectory() as scratch:
                    self._write(os.path.join(scratch, os.path.basename(filepath)))
            return
        if os.path.isdir(filepath):
            raise IsADirectoryError(
                f"ModelCheckpoint cannot write to {filepath!r}: it is a directory. "
                "Give `filepath` a file name, e.g. 'ckpts/ckpt_{epoch}.weights.h5'."
            )
        self._write(filepath)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")
        self._record(filepath, epoch)

    def _write(self, filepath: str) -> None:
        if self.save_weights_only:
            atomic_write(filepath, lambda p: self.model.save_weights(p, overwrite=True))
        else:
            with plain_learning_rate(self.model):  # Loadable without keras_dist.
                atomic_write(filepath, lambda p: self.model.save(p, overwrite=True))

    def _record(self, filepath: str, epoch: int) -> None:
        filepath = os.path.abspath(filepath)
        if filepath in self._kept:
            self._kept.remove(filepath)
        self._kept.append(filepath)
        self._epochs[os.path.basename(filepath)] = int(epoch)
        if self.max_to_keep is not None:
            while len(self._kept) > self.max_to_keep:
                old = self._kept.pop(0)
                if os.path.exists(old):
                    os.remove(old)
        self._write_index(done=False)

    def _write_index(self, *, done: bool) -> None:
        """The `checkpoint` index: newest last, each file's epoch, `done`.

        `done` is true once `fit` has ended (the evaluator's stop marker).
        """
        if not is_chief() or not self._kept:
            return
        names = [
            os.path.basename(p)
            for p in self._kept
            if os.path.dirname(p) == self.directory
        ]
        state = {
            "latest": os.path.basename(self._kept[-1]),
            "all": names,
            "epochs": {name: self._epochs[name] for name in names},
            "done": done,
        }
        atomic_write(
            os.path.join(self.directory, STATE_FILE),
            lambda p: _write_json(p, state),
        )


def _write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def _indexed_latest(state_path: str) -> str | None:
    """The `latest` entry of a `checkpoint` index; None (with a warning if the
    file exists but cannot be read) otherwise."""
    if not os.path.exists(state_path):
        return None
    try:
        with open(state_path) as f:
            latest = json.load(f).get("latest")
        if latest is not None and not isinstance(latest, str):
            raise ValueError(f'"latest" is {latest!r}, not a file name')
    except (OSError, ValueError, AttributeError) as error:
        warnings.warn(
            f"The checkpoint index {state_path} cannot be read ({error}); using "
            "the newest checkpoint file in its directory instead. Delete the "
            "index (ModelCheckpoint writes a new one at its next save).",
            stacklevel=3,
        )
        return None
    return latest


def latest_checkpoint(directory) -> str | None:
    """The newest checkpoint in `directory`, or None if there is none.

    Reads the `checkpoint` file `ModelCheckpoint` keeps; without one (or
    with one that cannot be read: a warning), picks the most recently
    modified `.weights.h5`/`.keras` file (ignoring temporary files of
    interrupted writes).
    """
    directory = os.fspath(directory)
    state_path = os.path.join(directory, STATE_FILE)
    latest = _indexed_latest(state_path)
    if latest and os.path.exists(os.path.join(directory, latest)):
        return os.path.join(directory, latest)
    if not os.path.isdir(directory):
        return None
    candidates = [
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if name.endswith(_SUFFIXES) and not name.startswith(".tmp-")
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (os.path.getmtime(p), p))
