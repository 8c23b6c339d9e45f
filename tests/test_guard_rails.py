"""Misuse either works correctly or fails with an error that teaches the fix."""

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.errors import StrategyMismatchError
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
    mirrored,
)

X, Y, SW = make_data(45)


def _reference(weights):
    model = build_in_scope(kd.OneDeviceStrategy("cpu:0"), weights)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return history.history, model.get_weights()


def test_fit_inside_and_outside_the_scope_agree():
    weights = initial_weights()
    inside = build_in_scope(mirrored(8), weights)
    with _scope_of(inside):
        h_in = inside.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    outside = build_in_scope(mirrored(8), weights)
    h_out = outside.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_history_close(h_in.history, h_out.history)
    assert_weights_close(inside.get_weights(), outside.get_weights())


def _scope_of(model):
    from keras_dist.strategies._base import strategy_of_variable

    return strategy_of_variable(model.trainable_variables[0]).scope()


def test_model_built_outside_the_scope_is_moved_onto_the_strategy():
    weights = initial_weights()
    ref_history, ref_weights = _reference(weights)

    model = make_model()  # No scope: variables on the default device.
    model.set_weights(weights)
    compile_model(model)  # Optimizer created outside too.
    strategy = mirrored(8)
    with strategy.scope():
        history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_history_close(ref_history, history.history)
    assert_weights_close(ref_weights, model.get_weights())
    for v in [*model.variables, *model.optimizer.variables]:
        assert v.value.sharding.device_set == set(strategy.devices), v.path
        assert v.value.sharding.is_fully_replicated
    # The model now belongs to the strategy: fit outside the scope stays on it.
    model.fit(X, Y, batch_size=8, verbose=0)
    assert model.layers[0].kernel.value.sharding.device_set == set(strategy.devices)


def test_model_trained_before_entering_the_scope():
    weights = initial_weights()
    model = make_model()
    model.set_weights(weights)
    compile_model(model)
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 1 device.
    with mirrored(4).scope():
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)

    reference = make_model()
    reference.set_weights(weights)
    compile_model(reference)
    reference.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), model.get_weights())


def test_model_of_another_strategy_is_refused():
    model = build_in_scope(mirrored(2), initial_weights())
    with mirrored(8).scope():
        with pytest.raises(StrategyMismatchError) as info:
            model.fit(X, Y, batch_size=8, verbose=0)
    message = str(info.value)
    # Built inside a scope, as users are told: the fix is not "build it in a
    # scope" but to run it under its own strategy, or copy it to a new model.
    assert "a model belongs to the strategy it was built in" in message
    assert "call it outside any `strategy.scope()`" in message
    assert "new_model.set_weights(model.get_weights())" in message
    assert "MirroredStrategy(devices=[cpu:0, cpu:1]" in message
    assert "kernel" in message
    # The two ways out the message gives both work.
    model.fit(X, Y, batch_size=8, verbose=0)
    with mirrored(8).scope():
        new_model = make_model()
        compile_model(new_model)
    new_model.set_weights(model.get_weights())
    new_model.fit(X, Y, batch_size=8, verbose=0)


def test_same_devices_different_strategy_object_is_fine():
    model = build_in_scope(mirrored(4), initial_weights())
    with mirrored(4).scope():
        model.fit(X, Y, batch_size=8, verbose=0)


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_failed_call_leaves_the_model_usable(method):
    weights = initial_weights()
    model = build_in_scope(mirrored(8), weights)
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    trained = model.get_weights()
    bad_x = np.zeros((10, 4), "float32")  # Wrong feature count.
    with pytest.raises(ValueError):
        if method == "evaluate":
            model.evaluate(bad_x, np.zeros(10, "int32"), verbose=0)
        else:
            model.predict(bad_x, verbose=0)
    assert_weights_close(trained, model.get_weights(), rtol=0, atol=0)
    # Every later call works and gives the numbers of an untouched model.
    loss = model.evaluate(X, Y, verbose=0, return_dict=True)["loss"]
    assert np.isfinite(loss)
    twin = build_in_scope(mirrored(8), trained)
    np.testing.assert_allclose(
        loss, twin.evaluate(X, Y, verbose=0, return_dict=True)["loss"], rtol=1e-6
    )
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)


def test_failed_fit_leaves_the_model_usable():
    model = build_in_scope(mirrored(8), initial_weights())
    before = model.get_weights()
    with pytest.raises(ValueError):
        model.fit(np.zeros((10, 4), "float32"), np.zeros(10, "int32"), verbose=0)
    assert_weights_close(before, model.get_weights(), rtol=0, atol=0)
    model.fit(X, Y, batch_size=8, verbose=0)


@pytest.mark.parametrize("value", [0, -8, 2.5, True, "64"])
@pytest.mark.parametrize("method", ["fit", "evaluate", "predict"])
def test_bad_batch_size(method, value):
    model = build_in_scope(mirrored(8), initial_weights())
    args = (X,) if method == "predict" else (X, Y)
    with pytest.raises(ValueError) as info:
        getattr(model, method)(*args, batch_size=value, verbose=0)
    message = str(info.value)
    assert f"Received: batch_size={value!r}" in message
    fix = "Pass an int: batch_size=64." if value == "64" else "batch_size=256"
    assert "8 replicas" in message and fix in message


def test_bad_validation_batch_size():
    model = build_in_scope(mirrored(2), initial_weights())
    with pytest.raises(ValueError, match=r"Received: validation_batch_size=0"):
        model.fit(X, Y, validation_split=0.2, validation_batch_size=0, verbose=0)


def test_plain_keras_is_untouched_without_a_strategy():
    """Outside keras_dist, Keras behaves as Keras (same numbers, no checks)."""
    weights = initial_weights()
    model = make_model()
    model.set_weights(weights)
    compile_model(model)
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    ref_history, ref_weights = _reference(weights)
    assert_history_close(ref_history, history.history)
    assert_weights_close(ref_weights, model.get_weights())
    assert keras.distribution.distribution() is None
