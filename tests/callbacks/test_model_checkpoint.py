"""ModelCheckpoint (chief-only, atomic, max_to_keep), latest_checkpoint, save/load."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
    mirrored,
)

X, Y, _ = make_data(45)


def _fit(model, epochs, *callbacks, **kwargs):
    return model.fit(
        X,
        Y,
        batch_size=8,
        epochs=epochs,
        verbose=0,
        callbacks=list(callbacks),
        **kwargs,
    )


def test_seed_prefix_files_and_latest_checkpoint(tmp_path):
    strategy = mirrored(8)
    model = build_in_scope(strategy, initial_weights())
    prefix = os.path.join(tmp_path, "ckpt_{epoch}")  # The seeds' tf-style prefix.
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[kd.callbacks.ModelCheckpoint(prefix, save_weights_only=True)],
    )
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "checkpoint",
        "ckpt_1.weights.h5",
        "ckpt_2.weights.h5",
        "ckpt_3.weights.h5",
    ]
    latest = kd.callbacks.latest_checkpoint(tmp_path)
    assert latest == os.path.join(tmp_path, "ckpt_3.weights.h5")
    trained = model.get_weights()
    fresh = build_in_scope(strategy, initial_weights())
    fresh.load_weights(latest)
    assert_weights_close(trained, fresh.get_weights(), rtol=0, atol=0)
    assert kd.callbacks.latest_checkpoint(tmp_path / "missing") is None


def test_full_model_best_only_and_max_to_keep(tmp_path):
    model = build_in_scope(mirrored(4), initial_weights())
    xv, yv, _ = make_data(16, seed=3)
    ckpt = kd.callbacks.ModelCheckpoint(
        tmp_path / "model_{epoch:02d}_{val_loss:.3f}.keras",
        monitor="val_loss",
        save_best_only=True,
        max_to_keep=2,
    )
    history = model.fit(
        X,
        Y,
        batch_size=8,
        epochs=5,
        validation_data=(xv, yv),
        verbose=0,
        callbacks=[ckpt],
    )
    kept = sorted(n for n in os.listdir(tmp_path) if n.endswith(".keras"))
    assert len(kept) <= 2
    best_epoch = int(np.argmin(history.history["val_loss"])) + 1
    state = json.loads((tmp_path / "checkpoint").read_text())
    assert state["latest"].startswith(f"model_{best_epoch:02d}_")
    loaded = keras.models.load_model(kd.callbacks.latest_checkpoint(tmp_path))
    assert isinstance(loaded, keras.Sequential)


def test_integer_save_freq(tmp_path):
    model = build_in_scope(mirrored(2), initial_weights())
    _fit(
        model,
        2,
        kd.callbacks.ModelCheckpoint(
            tmp_path / "s_{epoch}_{batch}.weights.h5",
            save_weights_only=True,
            save_freq=4,
        ),
    )
    # 6 steps per epoch (45 / 8): saves after steps 4, 8 (=epoch 2 batch 2), 12.
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".h5")) == [
        "s_1_4.weights.h5",
        "s_2_2.weights.h5",
        "s_2_6.weights.h5",
    ]


def test_only_the_chief_writes(tmp_path, monkeypatch):
    from keras_dist.callbacks import _model_checkpoint

    monkeypatch.setattr(_model_checkpoint, "_is_chief", lambda: False)
    model = build_in_scope(mirrored(2), initial_weights())
    _fit(
        model,
        2,
        kd.callbacks.ModelCheckpoint(
            tmp_path / "c_{epoch}.weights.h5", save_weights_only=True
        ),
    )
    assert os.listdir(tmp_path) == []


def test_a_crash_mid_write_leaves_the_previous_file(tmp_path):
    """Kill the process (SIGKILL) while it writes: the old checkpoint survives."""
    target = tmp_path / "model.weights.h5"
    script = textwrap.dedent(f"""
        import os, signal
        os.environ["KERAS_BACKEND"] = "jax"
        import keras, keras_dist as kd
        from keras_dist._checkpoint import keras_files as _files
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(512)])
        _files.atomic_write({str(target)!r}, lambda p: model.save_weights(p))
        def dying_write(path):
            with open(path, "wb") as f:
                f.write(b"half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        _files.atomic_write({str(target)!r}, dying_write)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], timeout=120, capture_output=True, text=True
    )
    assert result.returncode == -9, result.stderr[-2000:]
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(512)])
    model.load_weights(target)  # Intact: the rename never happened.
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert len(leftovers) == 1  # The torn temporary file, never the target.
    assert kd.callbacks.latest_checkpoint(tmp_path) == str(target)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.weights\.h5.*ckpt\.keras"):
        kd.callbacks.ModelCheckpoint(tmp_path / "ckpt.keras", save_weights_only=True)
    with pytest.raises(ValueError, match=r"must end in \.keras or \.h5.*ckpt\.txt"):
        kd.callbacks.ModelCheckpoint(tmp_path / "ckpt.txt")
    with pytest.raises(ValueError, match="max_to_keep=0"):
        kd.callbacks.ModelCheckpoint(tmp_path / "c.keras", max_to_keep=0)
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("a file where the directory should be")
    with pytest.raises(
        PermissionError, match=r"writable directory.*Received: filepath="
    ):
        kd.callbacks.ModelCheckpoint(blocked / "ckpt_{epoch}.keras")


def test_save_and_load_with_and_without_scope(tmp_path):
    """The seeds: save .keras, load without scope (1 device) and inside (replicated)."""
    strategy = mirrored(8)
    model = build_in_scope(strategy, initial_weights())
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    expected = model.evaluate(X, Y, verbose=0)
    path = str(tmp_path / "my_model.keras")
    model.save(path)
    model.save_weights(str(tmp_path / "w.weights.h5"))

    unreplicated = keras.models.load_model(path)
    kernel = unreplicated.layers[0].kernel.value
    assert len(kernel.sharding.device_set) == 1
    np.testing.assert_allclose(
        unreplicated.evaluate(X, Y, verbose=0), expected, rtol=1e-5
    )

    with strategy.scope():
        replicated = keras.models.load_model(path)
        np.testing.assert_allclose(
            replicated.evaluate(X, Y, verbose=0), expected, rtol=1e-5
        )
    kernel = replicated.layers[0].kernel.value
    assert kernel.sharding.device_set == set(strategy.devices)
    assert kernel.sharding.is_fully_replicated

    weights_only = build_in_scope(strategy, initial_weights())
    weights_only.load_weights(str(tmp_path / "w.weights.h5"))
    np.testing.assert_allclose(
        weights_only.evaluate(X, Y, verbose=0), expected, rtol=1e-5
    )


def test_keras_tensorboard_and_csvlogger_work_under_a_strategy(tmp_path):
    model = build_in_scope(mirrored(8), initial_weights())
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=2,
        validation_split=0.2,
        verbose=0,
        callbacks=[
            keras.callbacks.TensorBoard(log_dir=str(tmp_path / "logs")),
            keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        ],
    )
    rows = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert rows[0].split(",")[0] == "epoch" and len(rows) == 3
    events = [
        f
        for _, _, files in os.walk(tmp_path / "logs")
        for f in files
        if "tfevents" in f
    ]
    assert len(events) >= 2  # train and validation writers.


def test_full_checkpoints_load_without_keras_dist(tmp_path):
    """A .keras written mid-training under an LR schedule loads in plain Keras."""
    model = build_in_scope(mirrored(4), initial_weights())
    _fit(
        model,
        2,
        kd.callbacks.LearningRateScheduler(lambda e: 0.01 / (e + 1)),
        kd.callbacks.ModelCheckpoint(tmp_path / "m_{epoch}.keras"),
    )
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["KERAS_BACKEND"] = "jax"
        import keras
        model = keras.models.load_model({str(tmp_path / "m_2.keras")!r})
        assert "keras_dist" not in sys.modules
        print(float(model.optimizer.learning_rate))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert abs(float(result.stdout.strip()) - 0.005) < 1e-6
    # After fit the optimizer is plain again: its config has a float rate.
    assert model.optimizer.get_config()["learning_rate"] == pytest.approx(0.005)
