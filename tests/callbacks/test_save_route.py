"""Each checkpoint callback's save runs through at most 4 keras_dist files.

The one save pipeline (issue 48): a save is the callback, the pipeline, and
the library's writer behind one store (`_keras_compat/_saving.py` for Keras's
`.weights.h5` / `.keras`, `_checkpoint/orbax_store.py` for Orbax). Measured
with a profiler on every thread, from the hook that saves to the write
committed, at a steady-state save (the second of a `fit`).

Not counted: the two seams Keras's own objects run through for every
variable in the process, whoever calls: `_keras_compat/_variables.py`
(`Variable.value` and `assign`: a save reads each variable, and Keras's
`Callback.model` assigns them in `model.jax_state_sync()`) and
`_keras_compat/_loop.py` (`Layer.__setattr__`). They are named here, so a
save route that uses them otherwise still shows.
"""

import os
import sys
import threading

import keras
import numpy as np
import pytest

import keras_dist as kd

PACKAGE = os.path.dirname(kd.__file__)
# Run by Keras's own objects for every variable (see above).
GLOBAL_SEAMS = {"_keras_compat/_variables.py", "_keras_compat/_loop.py"}


class _Recorder:
    def __init__(self):
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE):
                self.files.add(os.path.relpath(name, PACKAGE))


def _route(callback_type, wait, **kwargs) -> set[str]:
    """keras_dist's files entered by the save at the second epoch's end."""
    recorder = _Recorder()

    class Measured(callback_type):
        def on_epoch_end(self, epoch, logs=None):
            if epoch != 1:
                return super().on_epoch_end(epoch, logs)
            recorder.on = True
            try:
                super().on_epoch_end(epoch, logs)
                wait(self)
            finally:
                recorder.on = False

    keras.utils.set_random_seed(0)
    with kd.MirroredStrategy().scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    y = x[:, :1]
    threading.setprofile(recorder)
    sys.setprofile(recorder)
    try:
        model.fit(
            x, y, batch_size=16, epochs=3, verbose=0, callbacks=[Measured(**kwargs)]
        )
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return recorder.files


def _checkpoint_wait(callback):
    callback.wait()


def _backup_wait(callback):
    callback._open_store().wait()


@pytest.mark.parametrize(
    "callback_type, arguments, wait",
    [
        (
            kd.callbacks.ModelCheckpoint,
            {"filepath": "{dir}/ckpt_{{epoch}}.weights.h5", "save_weights_only": True},
            _checkpoint_wait,
        ),
        (
            kd.callbacks.ModelCheckpoint,
            {"filepath": "{dir}/ckpt_{{epoch}}.keras"},
            _checkpoint_wait,
        ),
        (
            kd.callbacks.ModelCheckpoint,
            {"filepath": "{dir}/sharded", "sharded": True},
            _checkpoint_wait,
        ),
        (
            kd.callbacks.BackupAndRestore,
            {"backup_dir": "{dir}/backup", "delete_checkpoint": False},
            _backup_wait,
        ),
    ],
    ids=["weights_h5", "keras", "sharded", "backup"],
)
def test_a_save_enters_at_most_four_keras_dist_files(
    tmp_path, callback_type, arguments, wait
):
    kwargs = {
        k: v.format(dir=tmp_path) if isinstance(v, str) else v
        for k, v in arguments.items()
    }
    files = _route(callback_type, wait, **kwargs)
    route = sorted(files - GLOBAL_SEAMS)
    own = "_checkpoint/" + (
        "backup_and_restore.py"
        if callback_type is kd.callbacks.BackupAndRestore
        else "model_checkpoint.py"
    )
    assert own in route and "_checkpoint/pipeline.py" in route, route
    assert len(route) <= 4, ", ".join(route)
