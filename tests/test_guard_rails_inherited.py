"""Mistakes Keras 3.15 on JAX lets through are refused at the call, with the fix.

Each case states what plain Keras does. The checks run for plain Keras
models too (the entry-point seam sees every call once keras_dist is
imported): "plain" below is a model built outside any strategy. Inputs whose
batches are only seen while reading (tf.data datasets, generators) are
checked by the input pipeline, i.e. under a strategy.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests._helpers import (
    CLASSES,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
    mirrored,
)

X, Y, _ = make_data(20)
WHERE = ["plain", "mirrored"]


def _model(where, *, optimizer="adam"):
    if where == "plain":
        model = make_model()
        compile_model(model, optimizer=optimizer)
        return model
    strategy = mirrored(4)
    with strategy.scope():
        model = make_model()
        compile_model(model, optimizer=optimizer)
    return model


def _raises(error, *fragments):
    @contextlib.contextmanager
    def check():
        with pytest.raises(error) as info:
            yield
        for fragment in fragments:
            assert fragment in str(info.value), str(info.value)

    return check()


# Counts ----------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(
    "argument, value, fix",
    [
        # Keras: TypeError '>' not supported between instances of 'str' and 'int'.
        ("epochs", "2", "Pass an int: epochs=2."),
        # Keras: TypeError 'float' object cannot be interpreted as an integer.
        ("epochs", 2.0, "Pass an int: epochs=2."),
        ("epochs", -1, "For example epochs=1."),  # Keras: trains nothing.
        ("steps_per_epoch", 0, "steps_per_epoch=1"),  # Keras: read as None.
        ("steps_per_epoch", -1, "steps_per_epoch=1"),  # Keras: StopIteration.
        ("steps_per_epoch", 2.5, "steps_per_epoch=1"),
        ("validation_freq", 0, "validation_freq=1"),  # Keras: ZeroDivisionError.
        ("initial_epoch", -1, "initial_epoch=1"),  # Keras: one epoch more.
        ("batch_size", "32", "batch_size="),  # Keras: TypeError int / str.
    ],
)
def test_bad_counts_in_fit(where, argument, value, fix):
    model = _model(where)
    before = model.get_weights()
    with _raises(ValueError, f"Received: {argument}={value!r}", fix):
        model.fit(X, Y, verbose=0, **{"epochs": 1, argument: value})
    np.testing.assert_array_equal(before[0], model.get_weights()[0])


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_zero_steps_in_evaluate_and_predict(where, method):
    """Keras: `steps=0` is read as "until the data runs out"."""
    model = _model(where)
    args = (X,) if method == "predict" else (X, Y)
    with _raises(ValueError, "`steps` must be an integer >= 1", "Received: steps=0"):
        getattr(model, method)(*args, steps=0, verbose=0)


def test_integral_counts_of_numpy_type_are_accepted():
    model = _model("mirrored")
    history = model.fit(X, Y, epochs=np.int64(2), batch_size=np.int32(8), verbose=0)
    assert len(history.history["loss"]) == 2


# Empty inputs ----------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_zero_rows(where, method):
    """Keras: fit/evaluate StopIteration; predict UnboundLocalError."""
    model = _model(where)
    args = (X[:0],) if method == "predict" else (X[:0], Y[:0])
    with _raises(ValueError, "`x` has no rows", "Received: x of shape (0, 6)"):
        getattr(model, method)(*args, verbose=0)


@pytest.mark.parametrize("where", WHERE)
def test_empty_dataset_of_known_cardinality(where):
    model = _model(where)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).take(0)
    with _raises(ValueError, "`x` is an empty dataset", "cardinality 0"):
        model.fit(data, verbose=0)


def test_empty_validation_data():
    model = _model("mirrored")
    with _raises(ValueError, "`validation_data` has no rows"):
        model.fit(X, Y, validation_data=(X[:0], Y[:0]), verbose=0)


@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_empty_dataset_seen_only_when_read(method):
    """A `filter` hides the emptiness from the cardinality: the pipeline sees it."""
    model = _model("mirrored")
    data = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: y > 99)
    data = data.batch(8)
    if method == "predict":
        data = data.map(lambda x, y: x)
    with _raises(ValueError, "has no batches", f"`{method}` needs at least one"):
        getattr(model, method)(data, verbose=0)


# Targets ---------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("labels", [Y + CLASSES, -Y - 1])
def test_sparse_labels_outside_the_output(where, labels):
    """Keras: loss 0.0 on labels >= 3, nothing learned, no error."""
    model = _model(where)
    with _raises(ValueError, "class indices in [0, 3)", "Dense(", "Received: y"):
        model.fit(X, labels, verbose=0)


def test_sparse_labels_checked_in_every_batch_of_a_dataset():
    model = _model("mirrored")
    labels = Y.copy()
    labels[-1] = 7  # In the last batch only.
    data = tf.data.Dataset.from_tensor_slices((X, labels)).batch(8)
    with _raises(ValueError, "batch 2 of the input", "labels from 0 to 7"):
        model.fit(data, verbose=0)


def test_ignore_class_is_allowed():
    model = make_model()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(ignore_class=-1))
    labels = Y.copy()
    labels[:3] = -1
    model.fit(X, labels, verbose=0)
    with _raises(ValueError, "labels from -2 to 1"):
        model.fit(X, labels - 1, verbose=0)


@pytest.mark.parametrize("where", WHERE)
def test_class_weight_key_outside_the_output(where):
    """Keras: the key never matches; its class (say 2) silently weighs 1.0."""
    model = _model(where)
    with _raises(ValueError, "class_weight={0: 1.0, 1: 1.0, 3: 5.0}", "key 3"):
        model.fit(X, Y, class_weight={0: 1.0, 1: 1.0, 3: 5.0}, verbose=0)


def test_class_weight_key_absent_from_y_warns():
    """Legal in Keras (unlisted classes weigh 1.0), so a warning, not an error."""
    model = _model("mirrored")
    y = np.minimum(Y, 1)  # Classes 0 and 1 only.
    with pytest.warns(UserWarning, match=r"names classes \[2\].*classes \[1\]"):
        model.fit(X, y, class_weight={0: 1.0, 2: 4.0}, verbose=0)


@pytest.mark.parametrize("where", WHERE)
def test_fit_without_targets(where):
    """Keras: ValueError None is not a valid value for jnp.array (in the step)."""
    model = _model(where)
    with _raises(ValueError, "called with `x` only", "Received: y=None"):
        model.fit(X, verbose=0)


def test_dataset_without_targets():
    model = _model("mirrored")
    data = tf.data.Dataset.from_tensor_slices(X).batch(8)
    with _raises(ValueError, "first batch of `fit`'s input holds none"):
        model.fit(data, verbose=0)


def test_model_with_its_own_loss_needs_no_targets():
    class OwnLoss(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, *args, **kwargs):
            return keras.ops.mean(y_pred**2)

    model = OwnLoss(make_model().layers)
    model.compile("sgd", loss="mse")
    with mirrored(2).scope():
        model.fit(X, verbose=0)


# Optimizer -------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
def test_compiled_without_an_optimizer(where):
    """Keras: AttributeError 'NoneType' object has no attribute 'variables'."""
    model = _model(where, optimizer=None)
    with _raises(ValueError, "optimizer=None", "optimizer='adam'"):
        model.fit(X, Y, verbose=0)
    assert np.isfinite(model.evaluate(X, Y, verbose=0)[0])  # Still evaluates.


def test_correct_calls_still_train():
    model = build_in_scope(mirrored(4), initial_weights())
    history = model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
