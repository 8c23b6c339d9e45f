"""Each checkpoint callback's save runs callback -> pipeline -> engine, downward.

The one save pipeline (issues 48 and 62): a save is the callback
(`callbacks/`), the pipeline (`_checkpoint/pipeline.py`), and one engine a
format (`_checkpoint/keras_files.py` for Keras's `.weights.h5` / `.keras`,
`_checkpoint/orbax_store.py` for Orbax), which take their snapshot with
`_checkpoint/freeze.py`, touch files and folders (local or on a bucket)
through `_checkpoint/storage.py`, and reach Keras's private saving code only through
the fence's ground floor (`_private_api/`). Measured with a profiler on
every thread, from the hook that saves to the write committed, at a
steady-state save (the second of a `fit`): every call from one keras_dist
file into another runs down that order (the layout table of
`docs/design.md` between rooms, the order above inside the checkpoint
wing), so no file is entered again from below, and the save enters at most
8 keras_dist files.

Not counted: the two seams Keras's own objects run through for every
variable in the process, whoever calls: `_seams/_variables.py`
(`Variable.value` and `assign`: a save reads each variable, and Keras's
`Callback.model` assigns them in `model.jax_state_sync()`) and
`_seams/_trainer.py` (`Layer.__setattr__`). They are named here, so a
save route that uses them otherwise still shows.
"""

import gc
import os
import pathlib
import sys
import threading

import keras
import numpy as np
import pytest

import keras_dist as kd

PACKAGE = os.path.dirname(kd.__file__)
# Run by Keras's own objects for every variable (see above).
GLOBAL_SEAMS = {"_seams/_variables.py", "_seams/_trainer.py"}


# Keras's `ModelCheckpoint._save_model` calls the method a subclass
# overrides (`_private_api/_hooks.py` turns it into the public hook): the
# call a hook exists for, not a climb.
HOOKS = {("_private_api/_hooks.py", "callbacks/_model_checkpoint.py")}
# The checkpoint wing's files, top to bottom (one room in the layout table).
WING = (
    "_checkpoint/pipeline.py",
    ("_checkpoint/keras_files.py", "_checkpoint/orbax_store.py"),
    # The snapshot, and the path layer every file operation goes through.
    ("_checkpoint/freeze.py", "_checkpoint/storage.py"),
)


def _floors() -> dict[str, int]:
    from tests._layout import floors

    return floors()


def _rank(file: str, floors: dict[str, int]) -> tuple[int, int]:
    """Where a file of keras_dist stands: its room's floor, then its place
    in the wing (lower is further down)."""
    from tests._layout import room_of

    floor = floors[room_of(pathlib.PurePath("keras_dist", file), floors)]
    for place, names in enumerate(WING):
        if file in ((names,) if isinstance(names, str) else names):
            return floor, len(WING) - place
    return floor, len(WING) + 1


class _Recorder:
    def __init__(self):
        self.on = False
        self.files: set[str] = set()
        self.calls: set[tuple[str, str]] = set()  # (caller, callee) files.

    def __call__(self, frame, event, arg):
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE):
                callee = os.path.relpath(name, PACKAGE)
                self.files.add(callee)
                caller = frame.f_back.f_code.co_filename if frame.f_back else ""
                if caller.startswith(PACKAGE):
                    self.calls.add((os.path.relpath(caller, PACKAGE), callee))


def _route(callback_type, wait, **kwargs) -> _Recorder:
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
    return recorder


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
def test_a_save_runs_callback_pipeline_engine_downward(
    tmp_path, callback_type, arguments, wait
):
    kwargs = {
        k: v.format(dir=tmp_path) if isinstance(v, str) else v
        for k, v in arguments.items()
    }
    recorded = _route(callback_type, wait, **kwargs)
    route = sorted(recorded.files - GLOBAL_SEAMS)
    own = "callbacks/" + (
        "_backup_and_restore.py"
        if callback_type is kd.callbacks.BackupAndRestore
        else "_model_checkpoint.py"
    )
    engine = "_checkpoint/" + (
        "keras_files.py"
        if "sharded" not in str(kwargs) and "backup" not in str(kwargs)
        else "orbax_store.py"
    )
    assert {own, "_checkpoint/pipeline.py", engine} <= set(route), route
    floors = _floors()
    upward = sorted(
        f"{caller} -> {callee}"
        for caller, callee in recorded.calls - HOOKS
        if caller != callee
        and not {caller, callee} & GLOBAL_SEAMS
        and _rank(callee, floors) > _rank(caller, floors)
    )
    assert upward == [], "\n".join(upward)
    # Inside a room (the callbacks' `StepEnd`), one way only.
    calls = recorded.calls - HOOKS
    both_ways = {(a, b) for a, b in calls if a != b and (b, a) in calls}
    assert both_ways == set()
    assert len(route) <= 8, ", ".join(route)


# Every save route, and what writes its bytes ---------------------------------


class _Calls:
    """The functions entered on every thread: keras_dist's as (file,
    function), and whether Keras's saving code and Orbax were entered."""

    def __init__(self):
        self.ours: set[tuple[str, str]] = set()
        self.libraries: set[str] = set()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            self.ours.add((os.path.relpath(name, PACKAGE), frame.f_code.co_name))
        elif name.endswith(
            f"{os.sep}keras{os.sep}src{os.sep}saving{os.sep}saving_lib.py"
        ):
            self.libraries.add("keras saving")
        elif f"{os.sep}orbax{os.sep}" in name:
            self.libraries.add("orbax")
        elif f"{os.sep}h5py{os.sep}" in name:
            self.libraries.add("h5py")


def _fitted():
    with kd.MirroredStrategy().scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(1)]
        )
        model.compile(optimizer="adam", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
    return model, x, x[:, :1]


def _fit_with(callback):
    model, x, y = _fitted()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])


def _custom_loop_preempted(directory, local_dir=None):
    model, x, y = _fitted()
    handler = kd.PreemptionCheckpointHandler(
        None,
        model,
        directory,
        # Told of a preemption at the first run: it saves, and trains on.
        kd.TerminationConfig(termination_watcher_fn=lambda: True, exit_fn=lambda: None),
        local_dir=local_dir,
    )
    handler.run(model.train_on_batch, x[:16], y[:16])
    handler.close()


_KERAS_FILE = {("_checkpoint/keras_files.py", "atomic_write")}
_ORBAX = {("_checkpoint/orbax_store.py", "save")}
_LOCAL = {("_checkpoint/local_tier.py", "save_async")}
_TWO_TIERS = {("_checkpoint/pipeline.py", "save")} | {
    ("_checkpoint/pipeline.py", "restore")
}
ROUTES = {
    "kd ModelCheckpoint .weights.h5": (
        lambda d: _fit_with(
            kd.callbacks.ModelCheckpoint(
                f"{d}/c_{{epoch}}.weights.h5", save_weights_only=True
            )
        ),
        _KERAS_FILE,
    ),
    "kd ModelCheckpoint .keras": (
        lambda d: _fit_with(kd.callbacks.ModelCheckpoint(f"{d}/c_{{epoch}}.keras")),
        _KERAS_FILE,
    ),
    "kd ModelCheckpoint sharded": (
        lambda d: _fit_with(kd.callbacks.ModelCheckpoint(f"{d}/s", sharded=True)),
        _ORBAX,
    ),
    "keras ModelCheckpoint": (
        lambda d: _fit_with(keras.callbacks.ModelCheckpoint(f"{d}/c_{{epoch}}.keras")),
        _KERAS_FILE | {("_checkpoint/pipeline.py", "save_once")},
    ),
    "keras BackupAndRestore": (
        lambda d: _fit_with(
            keras.callbacks.BackupAndRestore(f"{d}/b", delete_checkpoint=False)
        ),
        _KERAS_FILE | {("_checkpoint/pipeline.py", "save_once")},
    ),
    "model.save_weights": (
        lambda d: _fitted()[0].save_weights(f"{d}/w.weights.h5"),
        _KERAS_FILE | {("_checkpoint/pipeline.py", "save_once")},
    ),
    "keras.saving.save_model": (
        lambda d: keras.saving.save_model(_fitted()[0], f"{d}/m.keras"),
        _KERAS_FILE | {("_checkpoint/pipeline.py", "save_once")},
    ),
    "kd BackupAndRestore": (
        lambda d: _fit_with(
            kd.callbacks.BackupAndRestore(f"{d}/b", delete_checkpoint=False)
        ),
        _ORBAX | _TWO_TIERS,
    ),
    "kd BackupAndRestore, local tier": (
        lambda d: _fit_with(
            kd.callbacks.BackupAndRestore(
                f"{d}/b",
                local_dir=f"{d}/local",
                local_save_freq=2,
                delete_checkpoint=False,
            )
        ),
        _ORBAX | _LOCAL | _TWO_TIERS,
    ),
    "PreemptionCheckpointHandler, local tier": (
        lambda d: _custom_loop_preempted(f"{d}/p", local_dir=f"{d}/local"),
        _ORBAX | _TWO_TIERS,
    ),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_save_route_is_the_pipelines_with_two_byte_writers(tmp_path, route):
    """Each way a user saves under a strategy enters the pipeline
    (`_checkpoint/pipeline.py`): Keras's files are committed by one function
    (`keras_files.atomic_write`) and written by Keras's saving code (h5py
    for `.weights.h5`), everything else by Orbax (the persistent tier and
    sharded checkpoints through `OrbaxStore.save`, the local tier through
    Orbax's manager): the two byte-writers, one a route."""
    save, expected = ROUTES[route]
    # An earlier test's garbage (an Orbax manager, say) finalized now, not by
    # a collection that falls inside the profiled save (CI20 saw Orbax there).
    gc.collect()
    calls = _Calls()
    threading.setprofile(calls)
    sys.setprofile(calls)
    try:
        save(tmp_path)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert expected <= calls.ours, sorted(expected - calls.ours)
    assert any(file == "_checkpoint/pipeline.py" for file, _ in calls.ours)
    if expected & (_ORBAX | _LOCAL):  # Keras's JSON and assets, if any, in it.
        assert "orbax" in calls.libraries
        assert "h5py" not in calls.libraries
    else:
        assert {"keras saving", "h5py"} <= calls.libraries
        assert "orbax" not in calls.libraries
    assert os.listdir(tmp_path)  # Written.
