"""CentralStorageStrategy: compute on 8 devices, variables in host memory.

Every run must give the numbers of one device (37 rows, batch 10: a partial
last batch; sample weights; BatchNormalization) in every execution mode, and
leave every model and optimizer variable in `"pinned_host"` memory. Keras
code that reads or writes variables outside the steps keeps working.
"""

import functools

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    small_model,
)

MODEL = {"batch_norm": True}
MODES = {
    "jit": {},
    "run_eagerly": {"run_eagerly": True},
    "no_jit_compile": {"jit_compile": False},
    "steps_per_execution": {"steps_per_execution": 3},
}
HOST = "pinned_host"


def _central():
    return kd.CentralStorageStrategy([f"cpu:{i}" for i in range(8)])


def _state(model) -> list:
    return [*model.variables, *model.optimizer.variables]


@functools.cache
def _run(name: str, mode: str):
    strategy = _central() if name == "central" else kd.OneDeviceStrategy("cpu:0")
    model = build_in_scope(strategy, initial_weights(**MODEL), **MODEL)
    model.compile(
        optimizer="adam",
        loss=model.loss,
        metrics=["accuracy"],
        **MODES[mode],
    )
    x, y, sw = make_data(37, seed=0)
    history = model.fit(
        x, y, sample_weight=sw, batch_size=10, epochs=2, shuffle=False, verbose=0
    )
    kinds_after_fit = {v.value.sharding.memory_kind for v in _state(model)}
    xt, yt, swt = make_data(23, seed=2)
    evaluated = model.evaluate(xt, yt, sample_weight=swt, batch_size=10, verbose=0)
    predicted = model.predict(xt, batch_size=10, verbose=0)
    return model, history.history, evaluated, predicted, kinds_after_fit


@pytest.mark.parametrize("mode", list(MODES))
def test_fit_evaluate_predict_match_one_device(mode):
    model, history, evaluated, predicted, kinds = _run("central", mode)
    # The reference: the jitted one-device run (every mode must equal it).
    model_1, history_1, evaluated_1, predicted_1, _ = _run("one_device", "jit")
    assert_history_close(history_1, history)
    np.testing.assert_allclose(evaluated, evaluated_1, rtol=1e-5, atol=1e-6)
    assert predicted.shape == (23, 3)
    np.testing.assert_allclose(predicted, predicted_1, rtol=1e-5, atol=1e-6)
    assert_weights_close(model_1.get_weights(), model.get_weights())
    assert_weights_close(
        [v.numpy() for v in model_1.optimizer.variables],
        [v.numpy() for v in model.optimizer.variables],
    )
    # Every model and optimizer variable (and metric) lives in host memory,
    # after fit and after evaluate/predict.
    assert kinds == {HOST}
    state = [*_state(model), *model.metrics_variables]
    assert {v.value.sharding.memory_kind for v in state} == {HOST}
    assert all(len(v.value.addressable_shards) == 8 for v in state)


def test_keras_reads_and_writes_variables_outside_the_steps():
    strategy = _central()
    weights = initial_weights(**MODEL)
    x, y, sw = make_data(37, seed=0)
    seen_lr = []
    read_lr = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen_lr.append(
            float(model.optimizer.learning_rate)
        )
    )
    model = build_in_scope(strategy, weights, **MODEL)
    with strategy.scope():
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5)
        compile_model(model, optimizer=keras.optimizers.Adam(schedule))
        model.optimizer.build(model.trainable_variables)
    assert {v.value.sharding.memory_kind for v in _state(model)} == {HOST}
    model.fit(
        x, y, sample_weight=sw, batch_size=10, epochs=2, verbose=0, callbacks=[read_lr]
    )
    # 4 steps per epoch: lr = 1e-2 * 0.5 ** (steps / 4), read eagerly.
    np.testing.assert_allclose(seen_lr, [5e-3, 2.5e-3], rtol=1e-6)
    assert int(model.optimizer.iterations) == 8
    # get_weights / set_weights / assign round-trip, values stay in host memory.
    trained = model.get_weights()
    model.set_weights(weights)
    assert_weights_close(weights, model.get_weights(), rtol=0, atol=0)
    kernel = model.layers[0].kernel
    kernel.assign(trained[0])
    np.testing.assert_array_equal(kernel.numpy(), trained[0])
    model.optimizer.iterations.assign_add(1)
    assert int(model.optimizer.iterations) == 9
    assert {v.value.sharding.memory_kind for v in _state(model)} == {HOST}
    # Metrics: results read and reset eagerly.
    model.evaluate(x, y, batch_size=10, verbose=0)
    assert float(model.metrics[0].result()) > 0
    model.reset_metrics()
    assert float(model.metrics[0].result()) == 0
    # The model traced by a user's jit reads the host weights on the devices.
    jitted = jax.jit(lambda a: model(a, training=False))(x)
    np.testing.assert_allclose(
        jitted, model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
    assert model.predict_on_batch(x[:16]).shape == (16, 3)
    assert len(model.train_on_batch(x[:16], y[:16])) == 3


def test_weights_and_keras_files_round_trip_in_the_scope(tmp_path):
    strategy = _central()
    model, *_ = _run("central", "jit")
    x, _, _ = make_data(23, seed=2)
    expected = model.predict(x, batch_size=10, verbose=0)

    model.save_weights(tmp_path / "m.weights.h5")
    fresh = build_in_scope(strategy, initial_weights(**MODEL), **MODEL)
    with strategy.scope():
        fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(tmp_path / "m.weights.h5")
    _assert_same_state_in_host_memory(model, fresh)

    model.save(tmp_path / "m.keras")
    with strategy.scope():
        loaded = keras.saving.load_model(tmp_path / "m.keras")
    _assert_same_state_in_host_memory(model, loaded)
    np.testing.assert_allclose(
        loaded.predict(x, batch_size=10, verbose=0), expected, rtol=1e-6
    )


def _assert_same_state_in_host_memory(model, other) -> None:
    expected = [v.numpy() for v in _state(model)]
    assert_weights_close(expected, [v.numpy() for v in _state(other)], 0, 0)
    assert {v.value.sharding.memory_kind for v in _state(other)} == {HOST}


def test_custom_training_loop_with_run_matches_one_device():
    results = [_custom_loop(s) for s in (kd.OneDeviceStrategy("cpu:0"), _central())]
    (losses_1, weights_1, _), (losses, weights, kinds) = results
    np.testing.assert_allclose(losses, losses_1, rtol=1e-5)
    assert_weights_close(weights_1, weights)
    assert kinds == {HOST}


def _custom_loop(strategy):
    x, y, _ = make_data(37, seed=0)
    batches = [(x[i : i + 10], y[i : i + 10]) for i in range(0, 37, 10)]
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(3)]
        )
        model.set_weights(initial_weights()[:4])
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )

    def train_step(state, inputs):
        features, labels = inputs
        trainable, non_trainable, opt_vars = state

        def loss_fn(trainable):
            logits, _ = model.stateless_call(trainable, non_trainable, features)
            return kd.losses.compute_average_loss(loss_object(labels, logits))

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    losses = []
    for _ in range(2):
        for inputs in strategy.experimental_distribute_dataset(batches):
            per_replica, state = strategy.run(train_step, args=(state, inputs))
            losses.append(float(strategy.reduce("sum", per_replica, axis=None)))
    for variable, value in zip(model.trainable_variables, state[0], strict=True):
        variable.assign(value)
    kinds = {v.value.sharding.memory_kind for v in model.trainable_variables}
    return losses, model.get_weights(), kinds


def test_memory_report_counts_host_memory_apart():
    strategy = _central()
    report = strategy.memory_report(small_model(strategy))
    # Weights: kernel (6, 16) 384 bytes, bias (16,) 64, kernel (16, 3) 192,
    # bias (3,) 12. Adam: iteration and learning_rate (4 bytes each), then a
    # momentum and a velocity per weight. All whole in each device's host
    # memory, none in device memory.
    assert report.weight_bytes == 652
    assert report.optimizer_bytes == 4 + 4 + 2 * 652
    assert report.weight_bytes_per_device == 0
    assert report.optimizer_bytes_per_device == 0
    assert report.host_bytes_per_device == 652 + 8 + 2 * 652 == 1964
    assert report.host_bytes == 8 * 1964
    assert {v.memory_kind for v in report.variables} == {HOST}
    assert all(v.bytes_per_device == v.nbytes for v in report.variables)
    text = str(report)
    assert "host memory:     1964 bytes per device (15712 in all)" in text
    assert "weights:         0 bytes per device (of 652)" in text
    kernel_row = next(line for line in text.splitlines() if "(6, 16)" in line)
    assert kernel_row.split()[4:7] == ["384", "384", HOST]  # bytes, per device

    one = kd.CentralStorageStrategy(["cpu:0"])
    report = one.memory_report(small_model(one))
    assert report.weight_bytes_per_device == 652
    assert report.optimizer_bytes_per_device == 8 + 2 * 652
    assert report.host_bytes_per_device == report.host_bytes == 0
    assert {v.memory_kind for v in report.variables} == {"device"}
    assert "host memory" not in str(report)


def test_one_compute_device_keeps_parameters_on_it():
    # tf's rule: one compute device and no parameter_device -> that device.
    strategy = kd.CentralStorageStrategy(["cpu:3"])
    assert strategy.parameter_device == "cpu:3"
    assert strategy.parameter_memory_kind == "device"
    model = build_in_scope(strategy, initial_weights())
    x, y, _ = make_data(37, seed=0)
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    for v in _state(model):
        assert v.value.sharding.memory_kind == "device", v.path
        assert v.value.sharding.device_set == {jax.devices()[3]}


def test_parameter_device_cpu_means_host_memory():
    strategy = kd.CentralStorageStrategy(["cpu:0", "cpu:1"], parameter_device="/cpu:0")
    assert (strategy.parameter_device, strategy.parameter_memory_kind) == (
        "cpu:0",
        HOST,
    )
    # One CPU computing: its device memory is the host's already.
    one_cpu = kd.CentralStorageStrategy(["cpu:2"], parameter_device="cpu:0")
    assert (one_cpu.parameter_device, one_cpu.parameter_memory_kind) == (
        "cpu:2",
        "device",
    )
    default = kd.CentralStorageStrategy()
    assert default.compute_devices == tuple(jax.local_devices())
    assert (default.parameter_device, default.parameter_memory_kind) == (
        "cpu:0",
        HOST,
    )
    model = build_in_scope(strategy, initial_weights())
    x, y, _ = make_data(37, seed=0)
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert {v.value.sharding.memory_kind for v in _state(model)} == {HOST}


def test_bad_parameter_device_is_refused():
    with pytest.raises(kd.errors.DeviceNotFoundError) as error:
        kd.CentralStorageStrategy(parameter_device="gpu:0")
    message = str(error.value)
    assert "`parameter_device` is not visible to this process" in message
    assert "Received: parameter_device='gpu:0'" in message
    assert "Visible devices: ['cpu:0', 'cpu:1'," in message
    assert 'parameter_device="cpu:0"' in message
    with pytest.raises(kd.errors.DeviceNotFoundError, match="parameter_device='cpu:8'"):
        kd.CentralStorageStrategy(parameter_device="cpu:8")
    with pytest.raises(ValueError, match="`parameter_device` is not a device spec"):
        kd.CentralStorageStrategy(parameter_device="host")
    with pytest.raises(TypeError, match=r"compute_devices=\['cpu:0'\]"):
        kd.CentralStorageStrategy(compute_devices="cpu:0")
