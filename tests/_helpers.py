"""Shared data, models and runners for the tests."""

import os

import keras
import numpy as np

import keras_dist as kd

FEATURES = 6
CLASSES = 3
# The random-kill chains (tests/cluster/test_kill_trials.py and
# tests/callbacks/test_backup_and_restore.py): 2 kills each in CI (within its
# 40 minutes: the many-trial figures are the restarts soak's,
# benchmarks/restarts.py, committed); `KD_KILL_TRIALS=20 python -m pytest -m
# kill_trials` runs the longer chains of 20.
KILL_TRIALS = int(os.environ.get("KD_KILL_TRIALS", "2"))


def committed_backup_step(backup) -> int:
    """The newest committed backup step in `backup` (a pathlib.Path; Orbax's
    step directories), or -1."""
    if not backup.exists():
        return -1
    return max((int(n) for n in os.listdir(backup) if n.isdigit()), default=-1)


def make_data(n: int, seed: int = 0):
    """A classification problem with `n` samples (x, y, sample_weight)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype("float32")
    logits = x @ rng.randn(FEATURES, CLASSES)
    y = logits.argmax(axis=1).astype("int32")
    sample_weight = rng.uniform(0.1, 2.0, size=n).astype("float32")
    return x, y, sample_weight


def make_model(
    *, batch_norm: bool = False, dropout: float = 0.0, conv: bool = False
) -> keras.Model:
    layers = [keras.Input((FEATURES,))]
    if conv:  # The features as a sequence, through a 1-D convolution.
        layers += [
            keras.layers.Reshape((FEATURES, 1)),
            keras.layers.Conv1D(4, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
        ]
    layers.append(keras.layers.Dense(16, activation="relu"))
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(CLASSES))
    return keras.Sequential(layers)


def compile_model(
    model: keras.Model, optimizer="adam", *, steps_per_execution: int = 1
) -> keras.Model:
    model.compile(
        optimizer=optimizer,
        steps_per_execution=steps_per_execution,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            "accuracy",
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True),
        ],
    )
    return model


def resume_model(width: int = 16, metrics=()) -> keras.Model:
    """Dense(6 -> width, relu), Dropout(0.3), Dense(3); compiled in the scope."""
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def small_model(strategy: kd.Strategy) -> keras.Model:
    """Dense(6 -> 16) and Dense(16 -> 3), compiled, Adam built, in the scope."""
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        compile_model(model)
        model.optimizer.build(model.trainable_variables)
    return model


def initial_weights(**model_kwargs) -> list[np.ndarray]:
    keras.utils.set_random_seed(1234)
    return make_model(**model_kwargs).get_weights()


def build_in_scope(strategy: kd.Strategy, weights, **model_kwargs) -> keras.Model:
    with strategy.scope():
        model = make_model(**model_kwargs)
        model.set_weights(weights)
        compile_model(model)
    return model


def mirrored(n: int) -> kd.MirroredStrategy:
    return kd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def assert_weights_close(expected, actual, rtol=1e-5, atol=1e-6):
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"weight {i}")


def assert_history_close(expected: dict, actual: dict, rtol=1e-5, atol=1e-6):
    assert sorted(expected) == sorted(actual)
    for key in expected:
        np.testing.assert_allclose(
            actual[key], expected[key], rtol=rtol, atol=atol, err_msg=key
        )


class InterruptAt(keras.callbacks.Callback):
    """Raises after global step `at` (as a crash would, mid-epoch), once the
    callbacks before it handled that step's end: at the next step's begin,
    where keras_dist's checkpoint callbacks handle it."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_batch_begin(self, batch, logs=None):
        if int(np.asarray(self.model.optimizer.iterations.value)) == self.at:
            raise RuntimeError(f"interrupted at step {self.at}")


def h5_datasets(path) -> dict:
    """Every dataset of an HDF5 file (a `.weights.h5`), by its path in the file."""
    import h5py

    found: dict = {}
    with h5py.File(path) as f:
        f.visititems(
            lambda name, o: (
                found.__setitem__(name, o[()]) if isinstance(o, h5py.Dataset) else None
            )
        )
    return found
