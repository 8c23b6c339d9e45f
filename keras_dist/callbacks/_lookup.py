"""Finding and loading what `ModelCheckpoint` wrote: `latest_checkpoint`,
`load_checkpoint`."""

import json
import os
import warnings

import keras

from keras_dist._checkpoint import storage
from keras_dist._checkpoint.keras_files import SUFFIXES
from keras_dist._checkpoint.orbax_store import committed_steps, restore
from keras_dist._checkpoint.pipeline import STATE_FILE

__all__ = ["latest_checkpoint", "load_checkpoint"]


def _indexed_latest(state_path: str) -> str | None:
    """The `latest` entry of a `checkpoint` index; None (with a warning if the
    file exists but cannot be read) otherwise."""
    if not storage.exists(state_path):
        return None
    try:
        latest = json.loads(storage.read_text(state_path)).get("latest")
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


def latest_checkpoint(directory: "str | os.PathLike") -> str | None:
    """The newest checkpoint in `directory`, or None if there is none.

    For a directory of Orbax checkpoints (`ModelCheckpoint(sharded=True)`,
    `keras.callbacks.OrbaxCheckpoint`), the directory itself:
    `model.load_weights` and `keras.models.load_model` read its newest
    committed step. (Keras matches the saved state by the model's and
    layers' names: load into a model built as the one that saved, e.g. the
    same script in a new process.)

    Reads the `checkpoint` file `ModelCheckpoint` keeps; without one (or
    with one that cannot be read: a warning), picks the most recently
    modified `.weights.h5`/`.keras` file (ignoring temporary files of
    interrupted writes).

    Example:

    ```python
    model.fit(x, y, epochs=3, callbacks=[
        kd.callbacks.ModelCheckpoint("ckpts/ckpt_{epoch}", save_weights_only=True)
    ])
    path = kd.callbacks.latest_checkpoint("ckpts")  # "ckpts/ckpt_3.weights.h5"
    model.load_weights(path)
    ```
    """
    directory = storage.served(directory, argument="directory")
    if committed_steps(directory):
        # `ModelCheckpoint(sharded=True)` or keras.callbacks.OrbaxCheckpoint:
        # Keras's loaders take the directory and read its newest step (they
        # do not recognise a step's own directory).
        return directory
    state_path = storage.join(directory, STATE_FILE)
    latest = _indexed_latest(state_path)
    if latest and storage.exists(storage.join(directory, latest)):
        return storage.join(directory, latest)
    candidates = checkpoint_files(directory)
    return candidates[-1] if candidates else None


def checkpoint_files(directory: str) -> list[str]:
    """The checkpoint files of `directory`, oldest first (by modification
    time), without the temporary files of interrupted writes."""
    paths = [
        storage.join(directory, name)
        for name in storage.listdir(directory)
        if name.endswith(SUFFIXES) and not name.startswith(".tmp-")
    ]
    return sorted(paths, key=lambda p: (storage.mtime(p), p))


def load_checkpoint(model: keras.Model, path: "str | os.PathLike") -> None:
    """Loads a checkpoint `ModelCheckpoint` (or Keras) wrote into `model`.

    A `.weights.h5` / `.keras` file loads as `model.load_weights` loads it.
    A directory of Orbax checkpoints (`ModelCheckpoint(sharded=True)`,
    `keras.callbacks.OrbaxCheckpoint`) loads its newest step (or the step
    directory given): weights, and the optimizer's and metrics' state when
    the checkpoint has them, each read straight into the layout of the
    variable it goes to, on any mesh, number of processes or one device. A
    `ModelCheckpoint(sharded=True)` checkpoint records its variables' order,
    so the model's and layers' names need not match the saving run's (Keras's
    own loaders match by name).

    Example:

    ```python
    kd.callbacks.load_checkpoint(model, kd.callbacks.latest_checkpoint("ckpts"))
    ```

    Raises:
        ValueError: the checkpoint does not fit the model.
        FileNotFoundError: `path` does not exist.
    """
    path = storage.served(path, argument="path")
    if not storage.exists(path):
        raise FileNotFoundError(
            f"`path` must name a checkpoint file or directory. Received: "
            f"path={path!r}, which does not exist."
        )
    if storage.isdir(path):
        restore(model, path)
    else:
        with storage.download(path) as local:
            model.load_weights(local)
