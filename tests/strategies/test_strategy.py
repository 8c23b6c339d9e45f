"""Strategy objects: properties, scope rules, placement of variables and data."""

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.data.host._pipeline import keras_batch
from keras_dist.errors import StrategyMismatchError
from tests._helpers import build_in_scope, initial_weights, make_data, mirrored
from tests.conftest import REPLICA_COUNTS

CPU = jax.local_devices(backend="cpu")


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_public_properties(n):
    strategy = mirrored(n)
    assert strategy.num_replicas_in_sync == n
    assert strategy.devices == tuple(CPU[:n])
    assert isinstance(strategy.mesh, jax.sharding.Mesh)
    assert strategy.mesh.axis_names == ("batch",)
    assert strategy.mesh.devices.shape == (n,)
    assert isinstance(strategy, keras.distribution.DataParallel)


def test_one_device_properties():
    strategy = kd.OneDeviceStrategy("/cpu:5")
    assert strategy.num_replicas_in_sync == 1
    assert strategy.devices == (CPU[5],)
    assert strategy.mesh.devices.shape == (1,)


def test_repr():
    assert repr(mirrored(2)) == (
        "MirroredStrategy(devices=[cpu:0, cpu:1], num_replicas_in_sync=2)"
    )
    assert repr(kd.MirroredStrategy()) == (
        "MirroredStrategy(devices=[cpu:0, cpu:1, ..., cpu:7], num_replicas_in_sync=8)"
    )
    assert repr(kd.OneDeviceStrategy("cpu:3")) == (
        "OneDeviceStrategy(devices=[cpu:3], num_replicas_in_sync=1)"
    )


def test_scope_sets_and_restores_the_distribution():
    strategy = mirrored(4)
    assert keras.distribution.distribution() is None
    with strategy.scope() as entered:
        assert entered is strategy
        assert keras.distribution.distribution() is strategy
        with strategy.scope():  # Re-entering the same strategy is fine.
            assert keras.distribution.distribution() is strategy
        assert keras.distribution.distribution() is strategy
    assert keras.distribution.distribution() is None


def test_nested_scopes_of_two_strategies_fail():
    outer, inner = mirrored(2), kd.OneDeviceStrategy("cpu:0")
    with outer.scope():
        with pytest.raises(StrategyMismatchError, match="Mixing two strategies"):
            with inner.scope():
                pass
        assert keras.distribution.distribution() is outer
    assert keras.distribution.distribution() is None


def test_strategy_after_a_global_distribution_fails():
    keras.distribution.set_distribution(mirrored(2))
    with pytest.raises(StrategyMismatchError, match="set_distribution") as info:
        with mirrored(4).scope():
            pass
    assert "MirroredStrategy(devices=[cpu:0, cpu:1, cpu:2, cpu:3]" in str(info.value)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_variables_and_optimizer_state_are_replicated(n):
    strategy = mirrored(n)
    model = build_in_scope(strategy, initial_weights())
    x, y, _ = make_data(64)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    variables = [*model.variables, *model.optimizer.variables, *model.metrics_variables]
    assert len(model.optimizer.variables) > 2  # Adam slots were created.
    for v in variables:
        sharding = v.value.sharding
        assert sharding.is_fully_replicated, v.path
        assert sharding.device_set == set(CPU[:n]), v.path


class _ShardingProbe(keras.layers.Layer):
    """Records how the batch entering the model is laid out over devices."""

    def __init__(self, record, **kwargs):
        super().__init__(**kwargs)
        self._record = record  # A callable: Keras would copy a list attribute.

    def call(self, x):
        shape = x.shape
        jax.debug.inspect_array_sharding(
            x, callback=lambda s: self._record(s.shard_shape(shape))
        )
        return x


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_fit_input_is_sharded_over_the_batch_axis(n):
    seen = []
    with mirrored(n).scope():
        model = keras.Sequential(
            [keras.Input((6,)), _ShardingProbe(seen.append), keras.layers.Dense(3)]
        )
        model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((64, 6), "float32")
    model.fit(x, np.zeros((64, 3), "float32"), batch_size=32, verbose=0)
    assert (32 // n, 6) in seen


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_batches_become_global_arrays_split_over_replicas(n):
    strategy = mirrored(n)
    x, y, sw = make_data(32)
    x_dev, y_dev, sw_dev = keras_batch(strategy.placement, (x, y, sw))
    for host, dev in ((x, x_dev), (y, y_dev), (sw, sw_dev)):
        assert dev.shape == host.shape
        assert {s.data.shape[0] for s in dev.addressable_shards} == {32 // n}
        assert {s.device for s in dev.addressable_shards} == set(CPU[:n])
        np.testing.assert_array_equal(np.asarray(dev), host)


@pytest.mark.parametrize(
    "make",
    [lambda: kd.OneDeviceStrategy("cpu:0"), lambda: mirrored(8)],
    ids=["one_device", "mirrored8"],
)
def test_fit_compiles_its_train_step_once(make, caplog):
    """3 epochs (metrics reset each epoch), 40 rows in batches of 10: one
    compilation, as plain Keras. On a one-device mesh a variable assigned
    eagerly used to keep a single-device sharding while the step returns a
    NamedSharding: two more compilations in every fit."""
    x, y, _ = make_data(40)
    model = build_in_scope(make(), initial_weights())
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        model.fit(x, y, batch_size=10, epochs=3, verbose=0)
    compiled = [r for r in caplog.records if "Compiling jit(train_step)" in r.message]
    assert len(compiled) == 1


@pytest.mark.parametrize(
    "make",
    [lambda: kd.OneDeviceStrategy("cpu:0"), lambda: mirrored(8)],
    ids=["one_device", "mirrored8"],
)
def test_host_scalars_assigned_keep_the_layout_and_compile_once(make, caplog):
    """A Python number or NumPy scalar assigned to a scalar variable (a
    metric's reset, a learning rate set each epoch) lands in the variable's
    layout with its value; a new value does not compile again."""
    strategy = make()
    with strategy.scope():
        rate = keras.Variable(0.5, dtype="float32")
        count = keras.Variable(0, dtype="int32")
    layouts = (rate.value.sharding, count.value.sharding)
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        for i, value in enumerate(np.linspace(1e-3, 1e-2, 12)):
            rate.assign(float(value) if i % 2 else np.float32(value))
            count.assign(i)
            assert float(rate.value) == np.float32(value)
            assert int(count.value) == i
            assert (rate.value.sharding, count.value.sharding) == layouts
    compiled = [r for r in caplog.records if "Compiling" in r.message]
    # One placing program per dtype (float32, int32); none per value.
    assert len(compiled) <= 2, [r.message for r in compiled]


def test_input_machinery_moved_to_the_placement_with_a_deprecation():
    strategy = kd.MirroredStrategy()
    rows = np.arange(16, dtype=np.float32).reshape(8, 2)
    with pytest.warns(
        DeprecationWarning,
        match=r"`strategy.shard` is input machinery and moved to "
        r"`strategy.placement.lay_out`",
    ):
        laid_out = strategy.shard(rows)
    np.testing.assert_array_equal(np.asarray(laid_out), rows)
    assert laid_out.sharding == strategy.placement.lay_out(rows).sharding
    assert strategy.placement.num_replicas_in_sync == 8
    assert strategy.placement.input_options is strategy.input_options
