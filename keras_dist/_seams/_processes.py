"""Seam 4: fit/evaluate/predict over several processes.

At the start of each call every process checks (through the coordination
service, with a timeout) that the others made the same call — same method,
global batch sizes, epochs, steps, model variables and in-memory data shapes —
so a mismatch is an error naming the processes instead of a hang in a
collective. `fit` also gives every process the chief's NumPy random state, so
Keras shuffles NumPy inputs identically everywhere (each process then keeps
its rows of the same global batches). Non-chief processes print nothing and
do not run the logging callbacks (progress bar, CSVLogger, TensorBoard,
RemoteMonitor): the chief writes for all. Keras's own `ModelCheckpoint` and
`BackupAndRestore` run on every process, but on the others as followers
(`_follower`): their saves take part in the chief's (the save seam makes
them one save, which the chief writes), their other files (directories, a
backup's JSON, its deletion at the end) go to a scratch directory, and a
`BackupAndRestore` restores from the chief's backup once the chief has
replaced a torn one (`_BackupReadable`). `predict` gathers its outputs on
every process.
"""

import contextlib
import copy
import hashlib
import json
import os
import shutil
import tempfile
import weakref
import zlib
from typing import Any, cast

import jax
import keras
import numpy as np

from keras_dist._private_api._wrapped import marked
from keras_dist.cluster import _sync
from keras_dist.errors import ProcessMismatchError

__all__ = ["local_device_scope", "prepare_call"]

_CHECKED_ARGS = (
    "batch_size",
    "epochs",
    "steps_per_epoch",
    "validation_steps",
    "validation_batch_size",
    "validation_freq",
    "initial_epoch",
    "steps",
)
_CHIEF_ONLY_CALLBACKS = (
    keras.callbacks.ProgbarLogger,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.RemoteMonitor,
)
# Keras's callbacks that save the model and write files of their own.
_FOLLOWED_CALLBACKS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
)
# Keras's callbacks that write no files, or whose library coordinates every
# process itself (`OrbaxCheckpoint`): every process runs them as they are.
_EVERY_PROCESS_CALLBACKS = (
    keras.callbacks.EarlyStopping,
    keras.callbacks.History,
    keras.callbacks.LambdaCallback,
    keras.callbacks.LearningRateScheduler,
    keras.callbacks.OrbaxCheckpoint,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.SwapEMAWeights,
    keras.callbacks.TerminateOnNaN,
)


def rule_of(kind: type) -> str | None:
    """How a Keras callback class runs with several processes: `"chief"`
    (only the chief runs it), `"follower"` (the others follow the chief's
    saves, `_follower`) or `"every"`; None for a class no rule names."""
    if issubclass(kind, _CHIEF_ONLY_CALLBACKS):
        return "chief"
    if issubclass(kind, _FOLLOWED_CALLBACKS):
        return "follower"
    if issubclass(kind, _EVERY_PROCESS_CALLBACKS):
        return "every"
    return None


def _shape(value):
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    if shape is not None:
        return [type(value).__name__, list(shape)]
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _shape(v) for k, v in sorted(value.items())}
    return type(value).__name__


def _model_digest(model) -> str:
    text = json.dumps([[v.path, list(v.shape), str(v.dtype)] for v in model.variables])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _weights_digest(model) -> str:
    """Checksum of this process's copy of every built replicated variable.

    A split variable is left out: each process holds other parts of it.
    """
    crc = 0
    for v in model.variables:
        value = getattr(v, "_value", None)
        if isinstance(value, jax.Array) and value.sharding.is_fully_replicated:
            local = np.asarray(value.addressable_shards[0].data)
            crc = zlib.crc32(
                # numpy declares `ndarray.__buffer__` for Python >= 3.12 only.
                np.ascontiguousarray(local).view(np.uint8),  # type: ignore[arg-type]
                crc,
            )
    return f"{crc:08x}"


def _describe_call(method: str, model, arguments: dict) -> dict:
    call: dict[str, Any] = {"method": method, "model": _model_digest(model)}
    if method == "fit":
        call["weights"] = _weights_digest(model)
    for name in _CHECKED_ARGS:
        if name in arguments:
            value = arguments[name]
            call[name] = (
                value if isinstance(value, (int, str, type(None))) else str(value)
            )
    for name in ("x", "y", "sample_weight"):
        if name in arguments:
            call[f"{name}_shape"] = _shape(arguments[name])
    return call


def prepare_call(method: str, model, arguments: dict) -> None:
    """Cross-process check of the call; chief-only logging; same shuffling.

    `arguments` are the bound arguments of `fit/evaluate/predict`; they are
    changed in place for non-chief processes.

    Raises:
        ProcessMismatchError: if the processes made different calls (names
            them; a `ValueError`).
    """
    call = _describe_call(method, model, arguments)
    everyone = _sync.allgather(
        f"call-{method}",
        call,
        rule=(
            f"Call `model.{method}` on every process, not only on the chief: "
            "keras_dist runs it over all of them (only the chief prints and "
            "writes files)."
        ),
    )
    different = sorted(
        key for key in call if any(other.get(key) != call[key] for other in everyone)
    )
    if different:
        found = "; ".join(
            f"process {p}: "
            + ", ".join(f"{key}={other.get(key)!r}" for key in different)
            for p, other in enumerate(everyone)
        )
        raise ProcessMismatchError(
            f"The processes called `model.{method}` differently ({found}). With "
            "several processes every process must run the same program: the "
            "same model, the same global `batch_size`, epochs and steps, and the "
            "same full dataset (keras_dist splits each global batch over the "
            "processes). `model` differs when the architectures differ; "
            "`weights` when the initial values differ (seed every process alike "
            "with `keras.utils.set_random_seed`, or create the strategy before "
            "seeding: it agrees on a seed)."
        )
    if method == "fit":
        # The global generator's (MT19937): the legacy tuple form.
        state = cast(tuple, np.random.get_state(legacy=True))
        chief_state = _sync.broadcast_from_chief(
            "numpy-random-state",
            [state[0], state[1].tolist(), int(state[2]), int(state[3]), state[4]],
        )
        if jax.process_index() != 0:
            name, keys, pos, has_gauss, cached = chief_state
            np.random.set_state(
                (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            )
    callbacks = arguments.get("callbacks")
    # (fit's own evaluate passes its CallbackList, already filtered.)
    if jax.process_index() != 0:
        if "verbose" in arguments or method in ("fit", "evaluate", "predict"):
            arguments["verbose"] = 0
        if isinstance(callbacks, (list, tuple)) and callbacks:
            arguments["callbacks"] = [
                _follower(c) if _followed(c) else c
                for c in callbacks
                if not isinstance(c, _CHIEF_ONLY_CALLBACKS)
            ]
    elif isinstance(callbacks, (list, tuple)) and callbacks:
        arguments["callbacks"] = [
            kept
            for c in callbacks
            for kept in (
                (_BackupReadable(c), c) if _restores_from_a_backup(c) else (c,)
            )
        ]


def _restores_from_a_backup(callback) -> bool:
    return _followed(callback) and isinstance(
        callback, keras.callbacks.BackupAndRestore
    )


class _ReadingModel:
    """What Keras's `BackupAndRestore` reads a backup through, on the chief
    before training: `load_weights` reads every array of the file, into no
    model, and raises Keras's `OSError` where the file is torn."""

    built = True
    optimizer = None

    def load_weights(self, filepath, *args, **kwargs):
        import h5py  # type: ignore[import-untyped]

        def read(name, item):
            if isinstance(item, h5py.Dataset):
                item[()]

        with h5py.File(filepath, "r") as f:
            f.visititems(read)


class _BackupReadable(keras.callbacks.Callback):
    """On the chief, just before a Keras `BackupAndRestore` (`backup`) whose
    followers restore from the same files: Keras's own `on_train_begin`
    first runs on a copy of it over a model that only reads (`_ReadingModel`),
    so a torn backup is replaced by the previous one (Keras's repair: copies
    of files) before any process reads it; then every process is told to go
    on. Without it the follower, reading the backup while the chief copied
    over it, failed part-way through the load, whose transfers are
    collectives of every process: the chief waited in one for ever."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup

    def on_train_begin(self, logs=None):
        probe = copy.copy(self.backup)
        probe.set_model(_ReadingModel())
        # Its one job is Keras's repair; the callback itself runs next and
        # raises what it raises (a subclass's hook may want more of a model).
        with contextlib.suppress(Exception):
            probe.on_train_begin(logs)
        _sync.allgather("backup-readable", None)


def _followed(callback) -> bool:
    """Keras's own file-writing callback (keras_dist's are safe as they are)."""
    return isinstance(callback, _FOLLOWED_CALLBACKS) and not type(
        callback
    ).__module__.startswith("keras_dist.")


def _follower(callback):
    """On a process other than the chief: `callback` as the chief runs it,
    its own files written into a scratch directory (removed with it).

    Its saves (`model.save_weights`, `model.save`) take part in the chief's:
    the save seam makes every process's call one save, the chief's file. A
    `BackupAndRestore` follower restores from the chief's backup when
    training begins, as the chief does.
    """
    scratch = tempfile.mkdtemp(prefix="keras_dist-follower-")
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        kind = type(callback)
        if kind.__init__ is not keras.callbacks.BackupAndRestore.__init__:
            kind = keras.callbacks.BackupAndRestore
        follower = kind(
            os.path.join(scratch, "backup"),
            save_freq=callback.save_freq,
            double_checkpoint=callback.double_checkpoint,
            delete_checkpoint=callback.delete_checkpoint,
        )

        def on_train_begin(logs=None):
            # Once the chief has replaced a torn backup (`_BackupReadable`).
            _sync.allgather("backup-readable", None)
            callback.set_model(follower.model)
            callback.on_train_begin(logs)  # Reads the chief's backup.

        follower.on_train_begin = on_train_begin
    else:
        follower = copy.copy(callback)
        path = os.fspath(callback.filepath)
        follower.filepath = os.path.join(
            scratch, os.path.splitdrive(path)[1].lstrip(os.sep)
        )
        follower.verbose = 0
    _mirror_state(follower, callback, scratch)
    weakref.finalize(follower, shutil.rmtree, scratch, True)
    return follower


def _mirror_state(follower, callback, scratch: str) -> None:
    """After each of the follower's hooks, `callback` (the user's object on
    this process) holds the state Keras's own keeps: epoch and batch
    counters, the best value so far (a `BackupAndRestore`'s epoch,
    `ModelCheckpoint.best`), as the chief's object does. Not the follower's
    paths (into `scratch`), model or verbosity."""

    def state():
        return {
            key: value
            for key, value in vars(follower).items()
            if key not in ("_model", "model", "verbose")
            and not callable(value)
            and not (isinstance(value, str) and value.startswith(scratch))
        }

    for name in dir(type(follower)):
        # (Not a hook set on the follower itself: a `BackupAndRestore`
        # follower's `on_train_begin` is the user's object's own. Nor one
        # the callback does not override: wrapping Keras's no-op batch hook
        # would turn off Keras's asynchronous dispatch of batch hooks; the
        # ones it overrides already run each batch, and `BackupAndRestore`'s
        # batch counter must follow a fit interrupted mid-epoch.)
        if (
            not name.startswith("on_")
            or name in vars(follower)
            or getattr(type(follower), name)
            is getattr(keras.callbacks.Callback, name, None)
        ):
            continue
        hook = getattr(follower, name)

        def mirrored(*args, _hook=hook, **kwargs):
            result = _hook(*args, **kwargs)
            vars(callback).update(state())
            return result

        setattr(follower, name, mirrored)


def local_device_scope(original):
    """Keras's `device_scope` (what `keras.device` opens): with several
    processes, `"cpu:0"` is this process's first CPU, as `/cpu:0` is each
    worker's own on tf.distribute, not JAX's global device 0 (process 0's,
    whose arrays this process can neither write nor read: a `PyDataset`
    making its batches under `keras.device("cpu:0")` failed on every other
    process). A `jax.Device`, or an index past this process's devices, is
    Keras's."""

    def device_scope(device_name):
        if isinstance(device_name, str) and jax.process_count() > 1:
            kind, _, index = device_name.lower().partition(":")
            try:
                local = jax.local_devices(backend=kind)
            except RuntimeError:  # No such backend: Keras says so.
                local = []
            if (index or "0").isdigit() and int(index or 0) < len(local):
                return original(local[int(index or 0)])
        return original(device_name)

    return marked(device_scope, original)
