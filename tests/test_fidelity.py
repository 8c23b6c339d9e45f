"""The core test of the project: N devices give the numbers of one device.

For the same data, initial weights and global batch, `MirroredStrategy` on 2,
4 and 8 devices must reproduce `OneDeviceStrategy`'s per-epoch loss and
metrics, final weights, `evaluate` and `predict` to rtol 1e-5 (float32).
The data sizes are prime, so the last batch is partial (97 = 6 * 16 + 1: a
last batch of one sample, fewer than the replicas), and a global batch of 10
does not split over 4 or 8 replicas at all. The model has BatchNormalization
and Dropout, whose batch statistics and random masks must not see padding.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
    mirrored,
)
from tests.conftest import REPLICA_COUNTS

N_TRAIN, N_VAL, N_TEST = 97, 23, 31
MODEL = {"batch_norm": True, "dropout": 0.2}


def _datasets(kind: str, weighted: bool, batch_size: int):
    x, y, sw = make_data(N_TRAIN, seed=0)
    xv, yv, swv = make_data(N_VAL, seed=1)
    if kind == "numpy":
        train = {"x": x, "y": y, "sample_weight": sw if weighted else None}
        val = (xv, yv, swv) if weighted else (xv, yv)
        return train, val
    train_elems = (x, y, sw) if weighted else (x, y)
    val_elems = (xv, yv, swv) if weighted else (xv, yv)
    train = {"x": tf.data.Dataset.from_tensor_slices(train_elems).batch(batch_size)}
    val = tf.data.Dataset.from_tensor_slices(val_elems).batch(batch_size)
    return train, val


@functools.cache
def _run(n_devices: int, kind: str, weighted: bool, batch_size: int):
    strategy = kd.OneDeviceStrategy("cpu:0") if n_devices == 1 else mirrored(n_devices)
    model = build_in_scope(strategy, initial_weights(**MODEL), **MODEL)
    train, val = _datasets(kind, weighted, batch_size)
    keras.utils.set_random_seed(7)  # Same dropout masks in every run.
    fit_kwargs = {"batch_size": batch_size} if kind == "numpy" else {}
    history = model.fit(
        **train, validation_data=val, epochs=3, shuffle=False, verbose=0, **fit_kwargs
    )
    xt, yt, swt = make_data(N_TEST, seed=2)
    evaluated = model.evaluate(
        xt, yt, sample_weight=swt if weighted else None, batch_size=7, verbose=0
    )
    predicted = model.predict(xt, batch_size=9, verbose=0)
    return history.history, model.get_weights(), evaluated, predicted


# Input kind x sample weights x global batch x replicas, each value of each
# factor at least once and every replica count with a partial batch (97 rows:
# a last batch of 1 at batch 16, of 7 at batch 10), within the CI budget.
CASES = [
    ("numpy", False, 16, 8),
    ("numpy", True, 16, 2),
    ("numpy", True, 16, 8),
    ("tf.data", False, 16, 4),
    ("tf.data", True, 16, 8),
    ("numpy", True, 10, 2),
    ("numpy", True, 10, 4),
    # A global batch smaller than the replica count trains as on one device.
    ("numpy", True, 5, 8),
]


@pytest.mark.parametrize("kind, weighted, batch_size, n", CASES)
def test_mirrored_matches_one_device(kind, weighted, batch_size, n):
    ref_history, ref_weights, ref_eval, ref_pred = _run(1, kind, weighted, batch_size)
    history, weights, evaluated, predicted = _run(n, kind, weighted, batch_size)

    assert len(ref_history["loss"]) == 3
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history)
    # 60 steps of 5 rows on 8 replicas: BatchNormalization's moments of 5
    # rows, summed replica by replica, round otherwise than on one device;
    # its 1/sqrt(variance) of so few rows carries that into the weights, the
    # predictions and the epochs' losses: 2e-5 on the CPUs of earlier runs,
    # up to 1.2e-4 in a bias and 3.4e-5 in a loss of 1.64 on an AMD EPYC
    # (2026-12-04): XLA:CPU vectorizes the sums by the CPU's features
    # (without BatchNormalization: 3e-8, as with batches of at least a row a
    # replica).
    atol = 3e-4 if batch_size < n else None
    assert_history_close(ref_history, history, atol=atol or 1e-6)
    assert_weights_close(ref_weights, weights, atol=atol or 1e-6)
    np.testing.assert_allclose(evaluated, ref_eval, rtol=1e-5, atol=1e-6)
    assert predicted.shape == (N_TEST, 3)
    np.testing.assert_allclose(predicted, ref_pred, rtol=1e-5, atol=atol or 1e-5)


def test_training_actually_changes_the_weights():
    """Guards the test above against comparing two untrained models."""
    _, weights, _, _ = _run(1, "numpy", False, 16)
    initial = initial_weights(**MODEL)
    assert (
        max(np.abs(a - b).max() for a, b in zip(initial, weights, strict=True)) > 1e-3
    )


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_evaluate_counts_every_sample_once(n):
    """Loss and accuracy of evaluate equal the plain mean over the real rows."""
    x, y, sw = make_data(N_TEST, seed=3)
    model = build_in_scope(mirrored(n), initial_weights())
    logits = model.predict(x, batch_size=5, verbose=0)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    per_sample = -log_probs[np.arange(N_TEST), y]
    correct = (logits.argmax(axis=1) == y).astype("float64")

    result = model.evaluate(x, y, batch_size=4, return_dict=True, verbose=0)
    # Keras weights each batch's mean loss by its size: the overall mean.
    np.testing.assert_allclose(result["loss"], per_sample.mean(), rtol=1e-5)
    np.testing.assert_allclose(result["accuracy"], correct.mean(), rtol=1e-6)

    weighted = model.evaluate(
        x, y, sample_weight=sw, batch_size=4, return_dict=True, verbose=0
    )
    # The loss honours sample weights (sum of weighted losses / real rows);
    # compiled `metrics` do not (that is what `weighted_metrics` is for).
    np.testing.assert_allclose(
        weighted["loss"], (per_sample * sw).sum() / N_TEST, rtol=1e-5
    )
    np.testing.assert_allclose(weighted["accuracy"], correct.mean(), rtol=1e-6)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("size", [1, 5, 13])
def test_predict_returns_exactly_the_real_rows(n, size):
    x, _, _ = make_data(size, seed=4)
    weights = initial_weights()
    expected = build_in_scope(kd.OneDeviceStrategy("cpu:0"), weights).predict(
        x, verbose=0
    )
    model = build_in_scope(mirrored(n), weights)
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(x), expected, rtol=1e-6)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(3)
    np.testing.assert_allclose(model.predict(dataset, verbose=0), expected, rtol=1e-6)


@pytest.mark.parametrize("n", [4, 8])
def test_train_and_test_on_batch_with_a_partial_batch(n):
    x, y, sw = make_data(11, seed=5)
    weights = initial_weights()
    results = []
    for strategy in (kd.OneDeviceStrategy("cpu:0"), mirrored(n)):
        model = build_in_scope(strategy, weights)
        logs = [model.train_on_batch(x, y, sample_weight=sw) for _ in range(3)]
        results.append((logs, model.test_on_batch(x, y), model.get_weights()))
    (ref_logs, ref_test, ref_w), (logs, test, w) = results
    np.testing.assert_allclose(logs, ref_logs, rtol=1e-5)
    np.testing.assert_allclose(test, ref_test, rtol=1e-5)
    assert_weights_close(ref_w, w)


def test_validation_split_remainder_and_shuffle():
    """validation_split=0.1 of 97 leaves 10 validation rows; shuffle is seeded."""
    x, y, sw = make_data(N_TRAIN, seed=6)
    weights = initial_weights()
    histories = []
    for strategy in (kd.OneDeviceStrategy("cpu:0"), mirrored(8)):
        model = build_in_scope(strategy, weights)
        keras.utils.set_random_seed(11)
        history = model.fit(
            x,
            y,
            sample_weight=sw,
            batch_size=12,
            epochs=2,
            validation_split=0.1,
            shuffle=True,
            verbose=0,
        )
        histories.append((history.history, model.get_weights()))
    assert_history_close(histories[0][0], histories[1][0])
    assert_weights_close(histories[0][1], histories[1][1])


def test_steps_per_execution_with_a_partial_batch():
    x, y, _ = make_data(N_TRAIN, seed=7)
    weights = initial_weights()
    runs = []
    for strategy in (kd.OneDeviceStrategy("cpu:0"), mirrored(8)):
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(16, "relu"),
                    keras.layers.Dense(3),
                ]
            )
            model.set_weights(weights)
            model.compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=4,
            )
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history, model.get_weights(), model.predict(x, verbose=0)))
    assert_history_close(runs[0][0], runs[1][0])
    assert_weights_close(runs[0][1], runs[1][1])
    np.testing.assert_allclose(runs[1][2], runs[0][2], rtol=1e-5, atol=1e-6)
    assert runs[1][2].shape == (N_TRAIN, 3)


class _MeanSquaredModel(keras.Model):
    """A custom `compute_loss` that ignores sample weights: padding must not leak."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        return keras.ops.mean((y_pred - y) ** 2)


def test_custom_compute_loss_and_dict_inputs_stay_exact():
    rng = np.random.RandomState(8)
    x = rng.randn(29, 4).astype("float32")
    y = x @ rng.randn(4, 1).astype("float32")
    runs = []
    for strategy in (kd.OneDeviceStrategy("cpu:0"), mirrored(8)):
        keras.utils.set_random_seed(3)
        with strategy.scope():
            model = _MeanSquaredModel()
            model.compile(optimizer=keras.optimizers.SGD(0.1))
        history = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history["loss"], model.get_weights()))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    assert_weights_close(runs[0][1], runs[1][1])


def test_dict_inputs_with_a_partial_batch():
    rng = np.random.RandomState(9)
    xa, xb = rng.randn(19, 3).astype("float32"), rng.randn(19, 2).astype("float32")
    y = rng.randn(19, 1).astype("float32")
    outs = []
    for strategy in (kd.OneDeviceStrategy("cpu:0"), mirrored(4)):
        keras.utils.set_random_seed(5)
        with strategy.scope():
            a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
            out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
            model = keras.Model({"a": a, "b": b}, out)
            model.compile(optimizer="sgd", loss="mse")
        history = model.fit(
            {"a": xa, "b": xb}, y, batch_size=5, epochs=2, verbose=0, shuffle=False
        )
        outs.append(
            (history.history["loss"], model.predict({"a": xa, "b": xb}, verbose=0))
        )
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5)
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-6)
    assert outs[1][1].shape == (19, 1)
