"""Split variables are created and loaded part by part, never whole on one device.

Keras computes an initializer's value whole on the default device and then
`device_put`s it to the variable's layout: a device-to-device transfer that
`jax.transfer_guard_device_to_device("disallow_explicit")` refuses (plain
`"disallow"` lets explicit `device_put`s through, so it would see nothing).
Every variable of these models splits over the 8 devices (all dimensions are
multiples of 8), so building or loading one under the guard proves no
variable was ever whole on one device. Loaded NumPy values go host → device,
which the guard allows. The initial values are Keras's own.
"""

import contextlib

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist._private_api._releases import find
from keras_dist._private_api._state import originals

# Keras 3.15 names it `core.JaxVariable`; the nightly `ops.core.Variable`.
JaxVariable = find("keras.src.backend.jax.core.JaxVariable")

STRATEGIES = {
    "parameter_server": lambda: kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.FixedShardsPartitioner(8)
    ),
    "fsdp": lambda: kd.MirroredStrategy(shard_variables=True),
}
NO_DEVICE_TO_DEVICE = "disallow_explicit"


def _model(**dense_kwargs):
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", **dense_kwargs),
            keras.layers.Dense(64, kernel_initializer="orthogonal"),
            keras.layers.Dense(
                8,
                kernel_initializer=keras.initializers.RandomNormal(stddev=0.3),
                bias_initializer=keras.initializers.Constant(0.25),
            ),
        ]
    )


def _assert_split_in_eight(model):
    for v in model.weights:
        shards = v.value.addressable_shards
        whole = tuple(v.shape)
        axis = max(range(len(whole)), key=lambda i: (whole[i], -i))
        part = tuple(d // 8 if i == axis else d for i, d in enumerate(whole))
        assert [s.data.shape for s in shards] == [part] * 8, v.path


def _keras_initial_weights():
    keras.utils.set_random_seed(11)
    return _model().get_weights()


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_created_split_with_the_numbers_of_keras(name):
    expected = _keras_initial_weights()
    strategy = STRATEGIES[name]()
    keras.utils.set_random_seed(11)
    with jax.transfer_guard_device_to_device(NO_DEVICE_TO_DEVICE):
        with strategy.scope():
            model = _model()
    _assert_split_in_eight(model)
    for e, a, v in zip(expected, model.get_weights(), model.weights, strict=True):
        # Bit-equal but for RandomNormal's `x * stddev + mean`, fused when
        # compiled (one rounding less).
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7, err_msg=v.path)
    np.testing.assert_array_equal(model.get_weights()[0], expected[0])  # Glorot.
    np.testing.assert_array_equal(model.get_weights()[2], expected[2])  # Orthogonal.


def test_keras_path_trips_the_guard(monkeypatch):
    """Without the seam the same build copies whole values between devices."""
    monkeypatch.setattr(
        JaxVariable,
        "_initialize_with_initializer",
        originals["JaxVariable._initialize_with_initializer"],
    )
    strategy = STRATEGIES["fsdp"]()
    with pytest.raises(Exception, match="Disallowed device-to-device transfer"):
        with jax.transfer_guard_device_to_device(NO_DEVICE_TO_DEVICE):
            with strategy.scope():
                _model()


def test_keras_assign_trips_the_guard(tmp_path, monkeypatch):
    """Without the seam a loaded value goes whole to one device first."""
    _model().save_weights(tmp_path / "m.weights.h5")
    with STRATEGIES["fsdp"]().scope():
        model = _model()
    monkeypatch.setattr(keras.Variable, "assign", originals["Variable.assign"])
    with pytest.raises(ValueError, match="Disallowed device-to-device transfer"):
        with jax.transfer_guard_device_to_device(NO_DEVICE_TO_DEVICE):
            model.load_weights(tmp_path / "m.weights.h5")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_load_model_and_load_weights_split_on_load(tmp_path, name):
    keras.utils.set_random_seed(5)
    source = _model()  # Not compiled: the file holds only split variables.
    source.save(tmp_path / "m.keras")
    source.save_weights(tmp_path / "m.weights.h5")
    strategy = STRATEGIES[name]()
    with jax.transfer_guard_device_to_device(NO_DEVICE_TO_DEVICE):
        with strategy.scope():
            loaded = keras.saving.load_model(tmp_path / "m.keras")
            rebuilt = _model()
            rebuilt.load_weights(tmp_path / "m.weights.h5")
    for model in (loaded, rebuilt):
        _assert_split_in_eight(model)
        for e, a in zip(source.get_weights(), model.get_weights(), strict=True):
            np.testing.assert_array_equal(a, e)


class _NumpyInitializer(keras.initializers.Initializer):
    """Not traceable: NumPy on the value it draws."""

    def __call__(self, shape, dtype=None):
        drawn = keras.random.uniform(shape, seed=7, dtype=dtype)
        return np.asarray(drawn) * 2.0 - 1.0


class _SeedGeneratorInitializer(keras.initializers.Initializer):
    """Traceable, but advances a SeedGenerator: Keras's path must do that."""

    def __init__(self, generator):
        self.generator = generator

    def __call__(self, shape, dtype=None):
        return keras.random.normal(shape, seed=self.generator, dtype=dtype)


def _custom_weights(make_scope):
    keras.utils.set_random_seed(3)
    with make_scope():
        generator = keras.random.SeedGenerator(9)
        layers = [
            keras.layers.Dense(16, kernel_initializer=_NumpyInitializer()),
            keras.layers.Dense(
                16, kernel_initializer=_SeedGeneratorInitializer(generator)
            ),
            keras.layers.Dense(
                16, kernel_initializer=_SeedGeneratorInitializer(generator)
            ),
            keras.layers.Dense(
                8, kernel_initializer=lambda shape, dtype=None: keras.ops.ones(shape)
            ),
        ]
        model = keras.Sequential([keras.Input((8,)), *layers])
    return model, np.asarray(generator.state.value)


def test_custom_initializers_give_keras_numbers():
    expected, expected_state = _custom_weights(contextlib.nullcontext)
    strategy = STRATEGIES["fsdp"]()
    model, state = _custom_weights(strategy.scope)
    np.testing.assert_array_equal(state, expected_state)
    _assert_split_in_eight(model)
    for e, a in zip(expected.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, e)


def test_replicated_variables_keep_keras_path():
    strategy = kd.MirroredStrategy()
    keras.utils.set_random_seed(11)
    with strategy.scope():
        model = _model()
    for v in model.weights:
        assert v.value.sharding.is_fully_replicated
    for e, a in zip(_keras_initial_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, e)
