"""Every input type in model.fit / evaluate / predict: N devices == 1 device.

37 samples in global batches of 10: a partial last batch, and batches that
split over neither 4 nor 8 replicas. `validation_data` uses the same type.
"""

import itertools

import grain
import keras
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_dist as kd
from tests._helpers import assert_history_close, assert_weights_close, mirrored

B = 10
RNG = np.random.RandomState(0)
X = RNG.randn(37, 6).astype("float32")
Y = (X @ RNG.randn(6, 3)).argmax(1).astype("int32")
XV, YV = X[:17] * 0.5, Y[:17]
STEPS = {"train": 4, "val": 2}  # Only generators need them (they never end).


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // B)

    def __getitem__(self, i):
        x = self.x[i * B : (i + 1) * B]
        return x if self.y is None else (x, self.y[i * B : (i + 1) * B])


def _generator(x, y=None):
    for i in itertools.cycle(range(0, len(x), B)):
        yield (x[i : i + B],) if y is None else (x[i : i + B], y[i : i + B])


def _grain(x, y=None, iterable=False):
    records = list(x) if y is None else list(zip(x, y, strict=True))
    dataset = grain.MapDataset.source(records)
    if iterable:
        dataset = dataset.to_iter_dataset()
    return dataset.batch(B)


MAKERS = {
    "numpy": None,
    "tf.data": lambda x, y=None: tf.data.Dataset.from_tensor_slices(
        x if y is None else (x, y)
    ).batch(B),
    "tf.data-unknown-batch": lambda x, y=None: (
        tf.data.Dataset.from_tensor_slices(x if y is None else (x, y))
        .batch(B)
        .filter(lambda *args: True)
    ),
    "PyDataset": lambda x, y=None: _Batches(x, y),
    "PyDataset-workers": lambda x, y=None: _Batches(x, y, workers=2),
    "generator": _generator,
    "grain.MapDataset": _grain,
    "grain.IterDataset": lambda x, y=None: _grain(x, y, iterable=True),
}


def _run(strategy, kind):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    make = MAKERS[kind]
    steps = kind == "generator"
    if make is None:
        history = model.fit(
            X,
            Y,
            batch_size=B,
            epochs=2,
            validation_data=(XV, YV),
            shuffle=False,
            verbose=0,
        )
        evaluated = model.evaluate(X, Y, batch_size=B, verbose=0)
        predicted = model.predict(X, batch_size=B, verbose=0)
    else:
        history = model.fit(
            make(X, Y),
            epochs=2,
            validation_data=make(XV, YV),
            shuffle=False,
            verbose=0,
            steps_per_epoch=STEPS["train"] if steps else None,
            validation_steps=STEPS["val"] if steps else None,
        )
        evaluated = model.evaluate(
            make(X, Y), verbose=0, steps=STEPS["train"] if steps else None
        )
        predicted = model.predict(
            make(X), verbose=0, steps=STEPS["train"] if steps else None
        )
    return history.history, model.get_weights(), evaluated, predicted


@pytest.mark.parametrize("kind", list(MAKERS))
def test_input_type_matches_one_device(kind):
    ref_history, ref_weights, ref_eval, ref_pred = _run(
        kd.OneDeviceStrategy("cpu:0"), kind
    )
    history, weights, evaluated, predicted = _run(mirrored(8), kind)
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history)
    assert_history_close(ref_history, history)
    assert_weights_close(ref_weights, weights)
    np.testing.assert_allclose(evaluated, ref_eval, rtol=1e-5, atol=1e-6)
    assert predicted.shape == (37, 3)  # Exactly the real rows.
    np.testing.assert_allclose(predicted, ref_pred, rtol=1e-5, atol=1e-6)


def test_tfds_mock_data_matches_one_device():
    def load(split):
        dataset = tfds.load("mnist", split=split, as_supervised=True)
        return dataset.map(lambda img, label: (tf.cast(img, "float32") / 255.0, label))

    results = []
    with tfds.testing.mock_data(
        num_examples=37, policy=tfds.testing.MockPolicy.USE_CODE
    ):
        for strategy in (kd.OneDeviceStrategy("cpu:0"), mirrored(4)):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = keras.Sequential(
                    [
                        keras.Input((28, 28, 1)),
                        keras.layers.Conv2D(4, 3, activation="relu"),
                        keras.layers.MaxPooling2D(),
                        keras.layers.Flatten(),
                        keras.layers.Dense(10),
                    ]
                )
                model.compile(
                    optimizer="adam",
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                )
            train, test = load("train").batch(B), load("test").batch(B)
            history = model.fit(train, validation_data=test, epochs=2, verbose=0)
            results.append(
                (
                    history.history,
                    model.get_weights(),
                    model.evaluate(test, verbose=0),
                    model.predict(test.map(lambda img, label: img), verbose=0),
                )
            )
    (h1, w1, e1, p1), (h4, w4, e4, p4) = results
    assert_history_close(h1, h4)
    assert_weights_close(w1, w4)
    np.testing.assert_allclose(e4, e1, rtol=1e-5)
    assert p4.shape == (37, 10)
    np.testing.assert_allclose(p4, p1, rtol=1e-5, atol=1e-6)


class _Changing(keras.utils.PyDataset):
    """Batch 2 comes out with another rank (a bug in the pipeline)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x = X[i * B : (i + 1) * B]
        return (x[..., None] if i == 2 else x), Y[i * B : (i + 1) * B]


def test_pydataset_whose_batches_change_rank_mid_epoch():
    with mirrored(8).scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError) as info:
        model.fit(_Changing(), epochs=1, shuffle=False, verbose=0)
    message = str(info.value)
    assert "Batch 2 of the PyDataset input does not match batch 0" in message
    assert "shape (10, 6, 1)" in message
    model.fit(_Batches(X, Y), epochs=1, verbose=0)  # The model is still usable.


def test_grain_dataset_whose_batches_change_dtype_mid_epoch():
    records = [(x, y) for x, y in zip(X, Y, strict=True)]
    dataset = (
        grain.MapDataset.source(records)
        .batch(B)
        .map(lambda b: (b[0].astype("float64") if b[0].shape[0] < B else b[0], b[1]))
    )
    with mirrored(8).scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"Batch 3 of the GrainDataset input.*float64"):
        model.fit(dataset, epochs=1, verbose=0)
