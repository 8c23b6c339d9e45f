"""ModelCheckpoint keys that cannot be filled fail before any epoch is lost.

Keras 3.15: `{epok}` or `{val_loss}` without validation data raise a
`KeyError` after epoch 1 has trained; a misspelled `monitor` with
`save_best_only=True` and an explicit `mode` only warns and saves every epoch
as the best (with `mode="auto"` Keras refuses names it does not know).
"""

import os

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import make_data, mirrored, small_model

X, Y, _ = make_data(24)


class _Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.trained = 0

    def on_epoch_end(self, epoch, logs=None):
        self.trained += 1


@pytest.mark.parametrize(
    "name, validation, expected",
    [
        ("ckpt_{epok}.keras", False, "{epok}"),
        ("ckpt_{val_loss:.2f}.keras", False, "validation_data="),
        ("ckpt_{acc}.keras", True, "'val_accuracy'"),
    ],
)
def test_unknown_filepath_key_fails_before_epoch_1(
    tmp_path, name, validation, expected
):
    model = small_model(mirrored(2))
    ckpt = kd.callbacks.ModelCheckpoint(str(tmp_path / name))
    counter = _Epochs()
    extra = {"validation_data": (X, Y)} if validation else {}
    with pytest.raises(ValueError) as info:
        model.fit(X, Y, epochs=2, callbacks=[counter, ckpt], verbose=0, **extra)
    message = str(info.value)
    assert "Received: filepath=" in message and expected in message, message
    assert "Available keys: ['epoch', 'batch', 'learning_rate', 'loss'" in message
    assert counter.trained == 0
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".keras")]


def test_known_keys_save(tmp_path):
    model = small_model(mirrored(2))
    path = str(tmp_path / "ckpt_{epoch:02d}_{val_loss:.2f}_{accuracy:.2f}.keras")
    model.fit(
        X,
        Y,
        epochs=2,
        validation_data=(X, Y),
        callbacks=[kd.callbacks.ModelCheckpoint(path)],
        verbose=0,
    )
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".keras")]) == 2


def test_misspelled_monitor_fails_at_the_first_epoch_end(tmp_path):
    model = small_model(mirrored(2))
    ckpt = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "best.weights.h5"),
        save_weights_only=True,
        save_best_only=True,
        monitor="val_los",
        mode="min",  # With "auto", Keras refuses an unknown name itself.
    )
    counter = _Epochs()
    with pytest.raises(ValueError) as info:
        model.fit(
            X, Y, epochs=3, validation_data=(X, Y), callbacks=[ckpt, counter], verbose=0
        )
    message = str(info.value)
    assert "Received: monitor='val_los'" in message
    assert "'val_loss'" in message and "'accuracy'" in message
    assert counter.trained == 0  # Refused at the end of epoch 1, before epoch 2.
    assert not os.path.exists(tmp_path / "best.weights.h5")


def test_val_monitor_on_an_epoch_without_validation_is_fine(tmp_path):
    """`validation_freq=2`: epoch 1 has no `val_loss`; Keras skips, so do we."""
    model = small_model(mirrored(2))
    path = tmp_path / "best.weights.h5"
    ckpt = kd.callbacks.ModelCheckpoint(
        str(path), save_weights_only=True, save_best_only=True, monitor="val_loss"
    )
    model.fit(
        X,
        Y,
        epochs=2,
        validation_data=(X, Y),
        validation_freq=2,
        callbacks=[ckpt],
        verbose=0,
    )
    assert path.exists() and np.isfinite(ckpt.best)
