"""Checkpoint callbacks do not make `fit` wait for every step.

Keras runs `on_train_batch_end` hooks on a background thread (the loop goes
on dispatching steps) unless a callback defines one without `async_safe`:
then each step's logs are read on the training thread, a wait for the step.
keras_dist's `ModelCheckpoint` and `BackupAndRestore` act at an execution's
end from the next execution's begin (or the epoch's end) instead, with the
same state, and save what Keras's `ModelCheckpoint` saves.
"""

import os
import threading

import keras
import numpy as np
import pytest

import keras_dist as kd


class _Probe(keras.callbacks.Callback):
    """Records where Keras ran its `on_train_batch_end`: async or on the loop."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.on_main_thread: list[bool] = []

    def on_train_batch_end(self, batch, logs=None):
        self.on_main_thread.append(
            threading.current_thread() is threading.main_thread()
        )


def _data(n=56):
    rng = np.random.default_rng(0)
    return rng.random((n, 6), dtype=np.float32), rng.random((n, 1), dtype=np.float32)


def _model(**compile_kwargs):
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse", **compile_kwargs)
    return model


def _fit(callbacks, strategy=None, epochs=2, **compile_kwargs):
    x, y = _data()
    if strategy is None:
        model = _model(**compile_kwargs)
    else:
        with strategy.scope():
            model = _model(**compile_kwargs)
    probe = _Probe()
    model.fit(
        x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[probe, *callbacks]
    )
    return model, probe


SAVERS = {
    "backup_every_epoch": lambda d: kd.callbacks.BackupAndRestore(d / "b"),
    "backup_every_3_steps": lambda d: kd.callbacks.BackupAndRestore(
        d / "b", save_freq=3
    ),
    "checkpoint_every_epoch": lambda d: kd.callbacks.ModelCheckpoint(
        str(d / "m.keras")
    ),
    "checkpoint_every_2_steps": lambda d: kd.callbacks.ModelCheckpoint(
        str(d / "m-{epoch}-{batch}.weights.h5"), save_weights_only=True, save_freq=2
    ),
    "checkpoint_sync": lambda d: kd.callbacks.ModelCheckpoint(
        str(d / "m.weights.h5"), save_weights_only=True, save_freq=2, async_save=False
    ),
    "checkpoint_sharded": lambda d: kd.callbacks.ModelCheckpoint(
        str(d / "sharded"), sharded=True, save_freq=3
    ),
}


@pytest.mark.parametrize("name", sorted(SAVERS))
def test_savers_keep_keras_background_batch_hooks(tmp_path, name):
    _, probe = _fit([SAVERS[name](tmp_path)], strategy=kd.MirroredStrategy())
    assert len(probe.on_main_thread) == 14
    assert not any(probe.on_main_thread), (
        "Keras ran batch hooks on the loop: fit waited each step"
    )


def test_keras_own_checkpoint_makes_fit_wait_each_step(tmp_path):
    """The control: the probe tells the two apart."""
    _, probe = _fit([keras.callbacks.ModelCheckpoint(str(tmp_path / "k.keras"))])
    assert probe.on_main_thread == [True] * 14


# With `save_best_only` and an integer `save_freq` the hook stays too, but
# Keras 3.15's own `ModelCheckpoint` fails there before its first epoch ends
# (its `monitor_op` is set at the first `on_epoch_end`): nothing to compare.
@pytest.mark.parametrize("filepath, kwargs", [("m-{epoch}-{loss:.6f}.weights.h5", {})])
def test_logs_in_the_name_or_the_decision_keep_the_per_step_hook(
    tmp_path, filepath, kwargs
):
    ours = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "kd" / filepath), save_weights_only=True, save_freq=2, **kwargs
    )
    theirs = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "keras" / filepath),
        save_weights_only=True,
        save_freq=2,
        **kwargs,
    )
    os.makedirs(tmp_path / "keras")
    _, probe = _fit([ours])
    assert probe.on_main_thread == [True] * 14  # The step's logs, each step.
    _fit([theirs])
    names = sorted(os.listdir(tmp_path / "kd"))
    assert [n for n in names if n != "checkpoint"] == sorted(
        os.listdir(tmp_path / "keras")
    )


@pytest.mark.parametrize(
    "compile_kwargs",
    [{}, {"steps_per_execution": 3}, {"run_eagerly": True}, {"jit_compile": False}],
    ids=["default", "steps_per_execution_3", "run_eagerly", "no_jit"],
)
def test_step_saves_hold_what_keras_saves_at_those_steps(tmp_path, compile_kwargs):
    """Same files as Keras's `ModelCheckpoint`, each with the same weights."""
    pattern = "w-{epoch}-{batch}.weights.h5"
    os.makedirs(tmp_path / "keras")
    _fit(
        [
            keras.callbacks.ModelCheckpoint(
                str(tmp_path / "keras" / pattern), save_weights_only=True, save_freq=3
            )
        ],
        **compile_kwargs,
    )
    _fit(
        [
            kd.callbacks.ModelCheckpoint(
                str(tmp_path / "kd" / pattern), save_weights_only=True, save_freq=3
            )
        ],
        **compile_kwargs,
    )
    expected = sorted(os.listdir(tmp_path / "keras"))
    assert len(expected) >= 4
    assert [
        n for n in sorted(os.listdir(tmp_path / "kd")) if n != "checkpoint"
    ] == expected
    for name in expected:
        a, b = _model(), _model()
        a.load_weights(tmp_path / "keras" / name)
        b.load_weights(tmp_path / "kd" / name)
        for va, vb in zip(a.get_weights(), b.get_weights(), strict=True):
            np.testing.assert_array_equal(va, vb, err_msg=name)


def test_backup_mid_epoch_holds_the_state_after_its_step(tmp_path):
    """A backup every 3 steps holds the weights after step 3: the state
    `on_train_batch_begin` of step 4 sees is the state step 3 left."""

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 4:  # After the backup at step 3 (batch index 2).
                raise RuntimeError("stop")

    x, y = _data()
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = _model()
    backup = kd.callbacks.BackupAndRestore(tmp_path / "b", save_freq=3)
    with pytest.raises(RuntimeError, match="stop"):
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[backup, StopAt()],
        )
    reference = _model()
    reference.fit(x[:24], y[:24], batch_size=8, epochs=1, verbose=0, shuffle=False)
    with strategy.scope():
        resumed = _model()
    # One more step from the backup, then compare with 4 uninterrupted steps.
    resumed.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        steps_per_epoch=4,
        verbose=0,
        shuffle=False,
        callbacks=[kd.callbacks.BackupAndRestore(tmp_path / "b")],
    )
    reference.fit(x[24:32], y[24:32], batch_size=8, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(reference.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
