"""Keras's saving walk and file store, for writing Keras's files from a snapshot.

`model.save_weights` and `model.save` walk the model (`_save_state`) and
read every variable while they write the file. keras_dist's Keras-file
engine (`keras_dist/_checkpoint/keras_files.py`) splits that walk from the
writing, with these private parts of Keras's `saving_lib`:

- `record(model, with_config)`: the same walk into a store that records
  what each saveable gives it (its variables, or values a layer computes
  from them, e.g. a LoRA-merged kernel); with `with_config`, the model's
  config and metadata JSON and its assets too. A walk that found only
  variables is `reusable` at later steps of the same `fit` (Keras's walk
  takes host time and creates reference objects, Keras's serialization
  reads the learning rate on the host: a wait for every step dispatched).
  The config does not change while `fit` runs; the learning rate it holds
  is the one at the walk, and the optimizer's variables saved beside it
  hold the current one, which a loaded model gets.
- `write_snapshot(snapshot, path)`, on any thread: the records replayed
  into Keras's own `H5IOStore` (h5py writes the bytes): the `.weights.h5`
  file `save_weights` writes, or, inside Keras's zip layout with the JSON
  and assets, the `.keras` file `save` writes. Both load with Keras alone.
- `model_files(model)`: the JSON and assets `keras.callbacks.OrbaxCheckpoint`
  saves beside the state.

Imports nothing of keras_dist.
"""

import contextlib
import functools
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field

import jax
import keras
import numpy as np
from keras.src.saving.saving_lib import (
    _ASSETS_DIRNAME,
    _CONFIG_FILENAME,
    _METADATA_FILENAME,
    _VARS_FNAME_H5,
    DiskIOStore,
    H5IOStore,
    _save_assets_to_dict,
    _save_state,
    _serialize_model_as_json,
    _write_to_zip_recursively,
)

__all__ = [
    "Snapshot",
    "model_files",
    "record",
    "reusable",
    "write_snapshot",
]


class _RecordingStore(H5IOStore):
    """`H5IOStore`'s write interface, keeping entries instead of writing them.

    (A subclass: `_save_state` accepts only Keras's store types.)
    """

    def __init__(self):  # No file: nothing of H5IOStore's own state.
        self.mode = "w"
        self.entries: list[tuple[str, dict | None, dict]] = []
        self._current: dict = {}

    def __bool__(self):
        return True

    def make(self, path, metadata=None):
        self._current = {}
        self.entries.append((path, metadata, self._current))
        return self

    def __setitem__(self, key, value):
        self._current[key] = value

    def __getitem__(self, key):
        return self._current[key]

    def __contains__(self, key):
        return key in self._current

    def __len__(self):
        return len(self._current)

    def keys(self):
        return self._current.keys()

    def close(self):
        pass


@dataclass
class Snapshot:
    """A model's saved state, frozen: device copies or host arrays.

    `to_host()` (on any thread) waits for the device copies and brings them
    to host memory; `write_snapshot` calls it.
    """

    entries: list  # [(path, metadata, {key: array})], in Keras's order.
    config_json: str | None = None
    metadata_json: str | None = None
    assets_dir: str | None = None  # A temporary directory.
    nbytes: int = field(default=0)
    owns_assets: bool = True  # `release` removes `assets_dir`.

    def values(self) -> list:
        return [v for _, _, group in self.entries for v in group.values()]

    def to_host(self) -> None:
        for v in self.values():
            if isinstance(v, jax.Array):
                v.copy_to_host_async()
        for _, _, group in self.entries:
            for key, value in group.items():
                group[key] = np.asarray(value)

    def release(self) -> None:
        self.entries = []  # Frees the device copies.
        if self.assets_dir is not None and self.owns_assets:
            shutil.rmtree(self.assets_dir, ignore_errors=True)
            self.assets_dir = None


def record(model, *, with_config: bool) -> Snapshot:
    """Keras's saving walk of `model`, values as its saveables give them.

    The result's entries hold variables (or values a layer computed); pass
    it to `snapshot` to freeze them. A record whose entries are all
    variables can be frozen again at a later step (`reusable`).
    """
    store = _RecordingStore()
    assets = None
    config_json = metadata_json = None
    if with_config:
        config_json, metadata_json = _serialize_model_as_json(model)
        assets = DiskIOStore(_ASSETS_DIRNAME, mode="w")
    try:
        with _optimizers_saving_variables(model):
            _save_state(
                model,
                weights_store=store,
                assets_store=assets,
                inner_path="",
                visited_saveables=set(),
            )
    except BaseException:
        if assets is not None:
            assets.close()
        raise
    _optimizer_variables(model, store.entries)
    assets_dir = None
    if assets is not None:  # Keep the files the walk wrote (Keras's temp dir).
        assets_dir = tempfile.mkdtemp(prefix="keras_dist-assets-")
        if any(os.scandir(assets.working_dir)):
            shutil.copytree(assets.working_dir, assets_dir, dirs_exist_ok=True)
        assets.close()
    return Snapshot(
        entries=store.entries,
        config_json=config_json,
        metadata_json=metadata_json,
        assets_dir=assets_dir,
    )


def _store_variables(optimizer, store) -> None:
    """Keras's `save_own_variables` of an optimizer (keys `str(i)` for
    `optimizer.variables[i]`), storing the variables, not host copies."""
    for i, variable in enumerate(optimizer.variables):
        store[str(i)] = variable


@contextlib.contextmanager
def _optimizers_saving_variables(model):
    """During the walk, `model`'s optimizers (and a wrapped inner one) that
    keep Keras's own `save_own_variables` store their variables.

    Keras's stores `variable.numpy()`: a host copy of the whole optimizer
    state on the training thread, waiting for the step computing it (and
    for the copy of every array; `python benchmarks/checkpointing.py`
    measures a save's block on that thread).
    The walk only records where each value goes; the values are frozen
    after it. An optimizer that defines its own `save_own_variables` is
    left as it is (`_optimizer_variables` maps its values back).
    """
    base = keras.optimizers.Optimizer.save_own_variables
    patched, seen = [], set()
    optimizer = getattr(model, "optimizer", None)
    while (
        isinstance(optimizer, keras.optimizers.Optimizer) and id(optimizer) not in seen
    ):
        seen.add(id(optimizer))
        if type(optimizer).save_own_variables is base:
            # (Past Keras's attribute tracking; removed below.)
            object.__setattr__(
                optimizer,
                "save_own_variables",
                functools.partial(_store_variables, optimizer),
            )
            patched.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    try:
        yield
    finally:
        for optimizer in patched:
            object.__delattr__(optimizer, "save_own_variables")


def _optimizer_variables(model, entries: list) -> None:
    """The optimizer's entry back to its variables.

    Keras's optimizer saves `variable.numpy()` under `"optimizer"`, key `i`
    for `optimizer.variables[i]`: the variables let a later save reuse the
    walk (and freeze them without waiting for the step computing them).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    variables = list(optimizer.variables)
    for path, _, group in entries:
        if path != "optimizer":
            continue
        for key, value in group.items():
            i = int(key) if key.isdigit() else -1
            if 0 <= i < len(variables) and tuple(np.shape(value)) == tuple(
                variables[i].shape
            ):
                group[key] = variables[i]


def reusable(recorded: Snapshot) -> bool:
    """Whether every recorded value is a variable (the walk can be kept)."""
    return all(
        isinstance(v, keras.Variable)
        for _, _, group in recorded.entries
        for v in group.values()
    )


def _replay(snap: Snapshot, store) -> None:
    for path, metadata, values in snap.entries:
        entry = store.make(path, metadata=metadata)
        for key, value in values.items():
            entry[key] = value


def write_snapshot(snap: Snapshot, path: str) -> None:
    """Writes `snap` to `path` through Keras's `H5IOStore`: a `.weights.h5`
    file, or (recorded with the config) a `.keras` zip."""
    snap.to_host()
    if snap.config_json is None:
        store = H5IOStore(path, mode="w")
        try:
            _replay(snap, store)
        finally:
            store.close()
        return
    with open(path, "wb") as f, zipfile.ZipFile(f, "w") as zf:
        if snap.metadata_json is None:  # Recorded with the config, always.
            raise ValueError(f"Cannot write {path}: the snapshot has no metadata.")
        with zf.open(_METADATA_FILENAME, "w") as meta:
            meta.write(snap.metadata_json.encode())
        with zf.open(_CONFIG_FILENAME, "w") as config:
            config.write(snap.config_json.encode())
        store = H5IOStore(_VARS_FNAME_H5, archive=zf, mode="w")
        try:
            _replay(snap, store)
        finally:
            store.close()
        if snap.assets_dir is not None and any(os.scandir(snap.assets_dir)):
            _write_to_zip_recursively(zf, snap.assets_dir, _ASSETS_DIRNAME)


def model_files(model) -> dict:
    """The checkpointables of `keras.callbacks.OrbaxCheckpoint` beside the
    state: `model_config` (Keras's JSON, as `model.save` writes it) and
    `assets` (the model's asset files), if it has any.

    Making them reads the optimizer's learning rate on the host, and with
    several processes Keras's walk for assets waits too: in a running `fit`
    a wait for every step dispatched so far. `ModelCheckpoint(sharded=True)`
    makes them once, when `fit` begins.
    """
    config_json, _ = _serialize_model_as_json(model)
    files: dict = {"model_config": {"config": config_json}}
    assets = _save_assets_to_dict(model)
    if assets is not None:
        files["assets"] = assets
    return files
