"""BackupAndRestore interrupted by an exception and resumed in one process.

Endless inputs read `steps_per_epoch` steps an epoch: a fit on a repeated
tf.data pipeline (tf's multi-worker tutorial) or on an infinite generator,
interrupted mid-epoch 2 and run again with the same backup directory,
replays its input by steps (never waiting for the end of an endless pass)
and ends bit-identical to an uninterrupted fit. Here the interruption is an
exception inside the process; the kill of a real process and its restart
are tested with the finite pipeline read by `steps_per_epoch` in
test_backup_and_restore.py (the replay code is the same for all three
inputs).

A backup written by another model is refused with the shapes that differ.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests._helpers import InterruptAt, mirrored, resume_model

ROWS, BATCH, STEPS_PER_EPOCH, EPOCHS = 61, 8, 5, 4
INTERRUPT_AT = 7  # Mid-epoch 2: its step 2.


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 6).astype("float32")
    return x, (x @ rng.randn(6, 3)).argmax(1).astype("int32")


def _input(kind):
    if kind == "numpy":
        x, y = _data()
        return {"x": x, "y": y, "batch_size": BATCH}
    x, y = _data()
    if kind == "repeat":
        shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=3)
        return {"x": shuffled.batch(BATCH).repeat(), "steps_per_epoch": STEPS_PER_EPOCH}

    def endless():
        draw = np.random.RandomState(5)
        while True:
            rows = draw.randint(0, ROWS, size=BATCH)
            yield x[rows], y[rows]

    return {"x": endless(), "steps_per_epoch": STEPS_PER_EPOCH}


def _fit(kind, callbacks, width=16):
    keras.utils.set_random_seed(42)
    with mirrored(8).scope():
        model = resume_model(width)
    history = model.fit(epochs=EPOCHS, verbose=0, callbacks=callbacks, **_input(kind))
    return model, history.history


@pytest.mark.parametrize("kind", ["repeat", "generator"])
def test_an_interrupted_fit_resumes_bit_exact(tmp_path, capsys, kind):
    backup = tmp_path / "backup"
    expected, expected_history = _fit(kind, [])
    with pytest.raises(RuntimeError, match=f"interrupted at step {INTERRUPT_AT}"):
        _fit(
            kind,
            [kd.callbacks.BackupAndRestore(backup, save_freq=1),
             InterruptAt(INTERRUPT_AT)],
        )  # fmt: skip
    resumed, history = _fit(kind, [kd.callbacks.BackupAndRestore(backup)])
    assert "resuming at epoch 2, step 2" in capsys.readouterr().out
    for a, b in zip(expected.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)  # Bit-identical.
    assert history["loss"][-1] == expected_history["loss"][-1]
    assert not backup.exists()  # Deleted once the fit completed.


def test_a_backup_of_another_model_is_refused(tmp_path):
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        _fit(
            "numpy",
            [kd.callbacks.BackupAndRestore(backup, save_freq=1), InterruptAt(5)],
        )
    # (Keras numbers the names of a process's second model.)
    with pytest.raises(
        kd.errors.IncompatibleBackupError,
        match=r"variable '[\w/]*dense[\w]*/kernel' has shape \(6, 32\) but the "
        r"backup's '[\w/]*dense[\w]*/kernel' has shape \(6, 16\)\. Resume with",
    ):
        _fit("numpy", [kd.callbacks.BackupAndRestore(backup)], width=32)


@pytest.mark.parametrize("shard_variables", [False, True], ids=["mirrored", "fsdp"])
def test_a_backup_in_orbaxs_default_array_format_still_restores(
    tmp_path, monkeypatch, shard_variables
):
    # Backups written before keras_dist's own array handler (Orbax's
    # default: a sharding file per array, replica-parallel slices) restore
    # exactly with it.
    from orbax.checkpoint._src.serialization import type_handler_registry

    from keras_dist.callbacks import _backup_store

    def build():
        strategy = kd.MirroredStrategy(shard_variables=shard_variables)
        with strategy.scope():
            model = resume_model(16)
        model.optimizer.build(model.trainable_variables)
        return model

    written = build()
    x, y = _data()
    written.fit(x, y, batch_size=8, epochs=1, verbose=0)
    monkeypatch.setattr(
        _backup_store,
        "backup_type_handlers",
        lambda: type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY,
    )
    old = _backup_store.BackupStore(str(tmp_path), async_save=False)
    old.save(written, 7, {"epoch": 1})
    old.close()
    files = [name for _, _, names in os.walk(tmp_path / "7") for name in names]
    assert any("sharding" in name for name in files)  # Orbax's default format.
    monkeypatch.undo()
    restored = build()
    store = _backup_store.BackupStore(str(tmp_path), async_save=False)
    assert store.restore(restored)["epoch"] == 1
    store.close()
    state = [*written.variables, *written.optimizer.variables]
    got = [*restored.variables, *restored.optimizer.variables]
    assert int(np.asarray(written.optimizer.iterations.value)) > 0
    for a, b in zip(state, got, strict=True):
        np.testing.assert_array_equal(np.asarray(b.value), np.asarray(a.value))
