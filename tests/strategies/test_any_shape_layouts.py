"""`keras.distribution`'s public hooks give layouts that work for any shape.

Libraries call a distribution's hooks themselves, outside `fit` (keras-hub's
`CausalLM.generate`: `get_data_layout(shape)`, then
`keras.distribution.distribute_tensor`). Each hook of every strategy is
handed leading sizes 1 ... 2N+1 (N: the replicas) on 1-D and 2-D meshes:
the layout it gives lays the value out (eagerly and inside `jax.jit`) with
the value unchanged, and splits it whenever the mesh divides it.
"""

import jax
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests._strategies import STRATEGIES

MESHES = {
    **STRATEGIES,
    "model_parallel_2": lambda: kd.MirroredStrategy(model_parallel=2),
    "model_parallel_4": lambda: kd.MirroredStrategy(model_parallel=4),
    "model_parallel_8": lambda: kd.MirroredStrategy(model_parallel=8),
    "model_parallel_4_fsdp": lambda: kd.MirroredStrategy(
        model_parallel=4, shard_variables=True
    ),
}


def _sizes(strategy):
    return range(1, 2 * strategy.num_replicas_in_sync + 2)


def _value(rows, width=6):
    return np.arange(rows * width, dtype="float32").reshape(rows, width)


def _assert_laid_out(array, value, layout):
    np.testing.assert_array_equal(np.asarray(array), value)
    assert array.sharding.is_equivalent_to(layout.backend_layout, value.ndim)


@pytest.mark.parametrize("name", MESHES)
def test_get_data_layout_splits_what_divides_and_keeps_the_rest_whole(name):
    strategy = MESHES[name]()
    replicas = strategy.num_replicas_in_sync
    for rows in _sizes(strategy):
        value = _value(rows)
        layout = strategy.get_data_layout(value.shape)
        split = rows % replicas == 0
        assert tuple(layout.axes) == (("batch" if split else None), None), rows
        assert layout.device_mesh is strategy.device_mesh
        # Eagerly, as keras-hub's `generate` does it ...
        eager = keras.distribution.distribute_tensor(value, layout)
        _assert_laid_out(eager, value, layout)
        parts = {s.data.shape[0] for s in eager.addressable_shards}
        assert parts == {rows // replicas if split else rows}
        # ... and inside a compiled function.
        traced = jax.jit(
            lambda x, layout=layout: keras.distribution.distribute_tensor(x, layout)
        )(value)
        np.testing.assert_array_equal(np.asarray(traced), value)


@pytest.mark.parametrize("shape", [(), (5,), (3, 2, 7)])
def test_get_data_layout_takes_any_rank(shape):
    strategy = kd.MirroredStrategy(model_parallel=2)
    value = np.ones(shape, "float32")
    layout = strategy.get_data_layout(shape)
    assert len(layout.axes) == len(shape)
    _assert_laid_out(keras.distribution.distribute_tensor(value, layout), value, layout)


@pytest.mark.parametrize("name", MESHES)
def test_get_variable_layout_for_every_leading_size(name):
    strategy = MESHES[name]()
    for rows in _sizes(strategy):
        with strategy.scope():
            variable = keras.Variable(_value(rows), name=f"v{rows}")
        layout = strategy.get_variable_layout(variable)
        _assert_laid_out(variable.value, _value(rows), layout)
        # Keras's own path for a new value: assign it through the layout.
        variable.assign(_value(rows) + 1)
        np.testing.assert_array_equal(np.asarray(variable.value), _value(rows) + 1)


def _output_rules(strategy):
    """A layout map with rules for layer outputs on `strategy`'s mesh."""
    layout_map = keras.distribution.LayoutMap(strategy.device_mesh)
    layout_map["dense/output"] = ("batch", "model")
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/bias"] = ("model",)
    return layout_map


@pytest.mark.parametrize("model_parallel", [2, 4, 8])
def test_get_tensor_layout_rules_fit_every_output_size(model_parallel):
    base = kd.MirroredStrategy(model_parallel=model_parallel)
    strategy = kd.MirroredStrategy(layout_map=_output_rules(base))
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.set_weights(reference.get_weights())
    layout = strategy.get_tensor_layout("dense/output")
    assert tuple(layout.axes) == ("batch", "model")
    replicas = strategy.num_replicas_in_sync
    for rows in _sizes(strategy):
        x = _value(rows, 4)
        want = np.asarray(reference(x))
        with strategy.scope():  # The rule applies while the strategy is current.
            eager = model(x)  # 3 columns never divide "model": kept whole.
            traced = jax.jit(lambda x: model(x))(x)
            laid_out = keras.distribution.distribute_tensor(x[:, :3], layout)
        np.testing.assert_allclose(np.asarray(eager), want, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(traced), want, rtol=1e-6)
        split = rows % replicas == 0
        parts = {s.data.shape for s in laid_out.addressable_shards}
        assert parts == {(rows // replicas if split else rows, 3)}


def test_a_tensor_layout_rule_with_too_many_axes_names_the_shapes():
    strategy = kd.MirroredStrategy(model_parallel=2)
    layout = keras.distribution.TensorLayout(
        ("batch", None, "model"), strategy.device_mesh
    )
    with (
        strategy.scope(),
        pytest.raises(
            ValueError,
            match=r"A layout with 3 axes \('batch', None, 'model'\) cannot lay out "
            r"a tensor of shape \(4, 2\)\. Give one mesh axis",
        ),
    ):
        keras.distribution.distribute_tensor(np.ones((4, 2)), layout)


def test_without_a_strategy_distribute_tensor_is_keras_own():
    """Keras's `DataParallel` keeps its own behaviour: the seam is inert."""
    distribution = keras.distribution.DataParallel()
    layout = distribution.get_data_layout((3, 2))
    with pytest.raises(ValueError, match="3"):
        keras.distribution.distribute_tensor(np.ones((3, 2)), layout)


@pytest.mark.parametrize("name", ["mirrored", "model_parallel_4"])
def test_distribute_dataset_keeps_every_batch_whatever_its_size(name):
    """One process: the dataset itself, every row of every batch size.

    The Keras nightly dropped the hook (its adapters shard datasets
    themselves): a strategy then has none either, as Keras's own.
    """
    strategy = MESHES[name]()
    if not hasattr(keras.distribution.DataParallel, "distribute_dataset"):
        assert not hasattr(strategy, "distribute_dataset")
        return
    for rows in _sizes(strategy):
        dataset = tf.data.Dataset.from_tensor_slices(_value(2 * rows + 1)).batch(rows)
        distributed = strategy.distribute_dataset(dataset)
        got = np.concatenate([np.asarray(b) for b in distributed])
        np.testing.assert_array_equal(got, _value(2 * rows + 1))
