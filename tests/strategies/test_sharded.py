"""Sharded variables: ParameterServerStrategy and MirroredStrategy(shard_variables).

The model's Dense kernels (6, 16) and (16, 3), its bias and BatchNormalization
vectors (16,) have a dimension divisible by 8; the last bias (3,) does not.
Sharded runs must give the numbers of one device on a partial last batch
(37 rows, batch 10), and each device must hold 1/8 of a sharded variable.
"""

import functools
import json

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.strategies._base import strategy_of_model
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    mirrored,
)
from tests._strategies import pick
from tests.cluster import _workload

MODEL = {"batch_norm": True}
STRATEGIES = pick("one_device", "parameter_server", "fsdp", "mirrored", "zero1")
SHARDED = ["parameter_server", "fsdp"]


@functools.cache
def _run(name: str):
    strategy = STRATEGIES[name]()
    model = build_in_scope(strategy, initial_weights(**MODEL), **MODEL)
    x, y, sw = make_data(37, seed=0)
    history = model.fit(
        x, y, sample_weight=sw, batch_size=10, epochs=2, shuffle=False, verbose=0
    )
    xt, yt, _ = make_data(23, seed=2)
    evaluated = model.evaluate(xt, yt, batch_size=10, verbose=0)
    predicted = model.predict(xt, batch_size=10, verbose=0)
    return model, history.history, evaluated, predicted


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_strategy_matches_one_device(name):
    _, history, evaluated, predicted = _run(name)
    model_1, history_1, evaluated_1, predicted_1 = _run("one_device")
    assert_history_close(history_1, history)
    np.testing.assert_allclose(evaluated, evaluated_1, rtol=1e-5, atol=1e-6)
    assert predicted.shape == (23, 3)
    np.testing.assert_allclose(predicted, predicted_1, rtol=1e-5, atol=1e-6)
    assert_weights_close(model_1.get_weights(), _run(name)[0].get_weights())


def _expected_shard_shape(shape):
    divisible = [i for i, d in enumerate(shape) if d % 8 == 0]
    if not divisible:
        return shape
    axis = max(divisible, key=lambda i: (shape[i], -i))
    return tuple(d // 8 if i == axis else d for i, d in enumerate(shape))


@pytest.mark.parametrize("name", SHARDED)
def test_each_device_holds_one_eighth_of_a_sharded_variable(name):
    model = _run(name)[0]
    variables = [*model.weights, *model.optimizer.variables]
    sharded = 0
    for v in variables:
        shards = v.value.addressable_shards
        assert len(shards) == 8
        expected = _expected_shard_shape(tuple(v.shape))
        assert [s.data.shape for s in shards] == [expected] * 8, v.path
        sharded += expected != tuple(v.shape)
    # 3 kernels/biases + 4 BatchNormalization vectors, and 2 Adam slots each
    # of the 5 trainable ones.
    assert sharded == 3 + 4 + 2 * 5
    kernel = model.layers[0].kernel
    assert [s.data.shape for s in kernel.value.addressable_shards] == [(6, 2)] * 8


@pytest.mark.parametrize("name", SHARDED)
def test_optimizer_slots_follow_their_variable(name):
    model = _run(name)[0]
    optimizer = model.optimizer
    for v in model.trainable_variables:
        for slot in ("momentum", "velocity"):
            path = f"{optimizer.name}/{v.path.replace('/', '_')}_{slot}"
            found = [s for s in optimizer.variables if s.path == path]
            assert len(found) == 1, path
            assert found[0].value.sharding == v.value.sharding, path


def _small_model(strategy):
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3),
            ]
        )
        compile_model(model)
        model.optimizer.build(model.trainable_variables)
    return model


def _rows(report, model) -> dict:
    """The report's rows by short names: kernel_0, bias_1_velocity, iteration."""
    names = {}
    for i, layer in enumerate(model.layers):
        for kind in ("kernel", "bias"):
            path = getattr(layer, kind).path
            names[path] = f"{kind}_{i}"
            for slot in ("momentum", "velocity"):
                slot_path = f"{model.optimizer.name}/{path.replace('/', '_')}_{slot}"
                names[slot_path] = f"{kind}_{i}_{slot}"
    names[model.optimizer.iterations.path] = "iteration"
    return {names[v.path]: v for v in report.variables if v.path in names}


def test_memory_report_numbers_by_hand():
    strategy = kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.FixedShardsPartitioner(8)
    )
    model = _small_model(strategy)
    report = strategy.memory_report(model)
    # kernel (6, 16): 384 bytes, 48 per device; bias (16,): 64, 8; kernel
    # (16, 3): 192, 24; bias (3,): 12, replicated.
    assert report.weight_bytes == 384 + 64 + 192 + 12
    assert report.weight_bytes_per_device == 48 + 8 + 24 + 12
    # Adam: iteration and learning_rate (4 bytes each, replicated scalars),
    # then a momentum and a velocity per weight, laid out as the weight.
    assert report.optimizer_bytes == 4 + 4 + 2 * 652
    assert report.optimizer_bytes_per_device == 4 + 4 + 2 * 92
    rows = _rows(report, model)
    assert (rows["kernel_0"].axis, rows["kernel_0"].parts) == (1, 8)
    assert rows["kernel_1"].axis == 0
    assert rows["bias_1"].reason == "no dimension divisible by 8"
    assert rows["iteration"].reason == "scalar"
    assert rows["kernel_0_velocity"].bytes_per_device == 48
    text = str(report)
    assert "92 bytes per device (of 652)" in text
    assert "replicated: no dimension divisible by 8" in text


def test_memory_report_of_replicated_and_small_variables():
    strategy = kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.MinSizePartitioner(max_shards=8)
    )
    report = strategy.memory_report(_small_model(strategy))
    assert report.weight_bytes_per_device == report.weight_bytes == 652
    assert {v.reason for v in report.variables if v.kind == "weight"} == {
        "MinSizePartitioner asks for 1 shard"
    }
    mirrored_report = mirrored(8).memory_report(_small_model(mirrored(8)))
    assert mirrored_report.optimizer_bytes_per_device == 8 + 2 * 652
    assert mirrored_report.variables[0].reason == (
        "MirroredStrategy replicates variables"
    )


def test_min_size_partitioner_shards_large_variables():
    strategy = kd.ParameterServerStrategy(
        variable_partitioner=kd.partitioners.MinSizePartitioner(
            min_shard_bytes=100, max_shards=8
        )
    )
    model = _small_model(strategy)
    rows = _rows(strategy.memory_report(model), model)
    assert rows["kernel_0"].parts == 8  # 384 bytes: 4 shards asked.
    assert rows["bias_0"].reason == "MinSizePartitioner asks for 1 shard"


def test_fixed_shards_must_divide_the_mesh():
    with pytest.raises(ValueError, match=r"FixedShardsPartitioner\(num_shards=3\)"):
        kd.ParameterServerStrategy(
            variable_partitioner=kd.partitioners.FixedShardsPartitioner(3)
        )


def test_bad_arguments():
    with pytest.raises(TypeError, match="variable_partitioner=8"):
        kd.ParameterServerStrategy(variable_partitioner=8)
    with pytest.raises(TypeError, match="shard_variables='yes'"):
        kd.MirroredStrategy(shard_variables="yes")


def test_parameter_server_tasks_are_refused_with_the_fix(monkeypatch):
    """tf's `ps` tasks have no JAX counterpart: every host runs as a worker."""
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "KERAS_DIST_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    config = {
        "cluster": {
            "chief": ["localhost:1"],
            "worker": ["localhost:2"],
            "ps": ["localhost:3"],
        },
        "task": {"type": "chief", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(kd.errors.ClusterConfigError) as error:
        kd.ParameterServerStrategy(
            variable_partitioner=kd.partitioners.FixedShardsPartitioner(8)
        )
    message = str(error.value)
    assert message.startswith("ParameterServerStrategy trains synchronously")
    assert "\"ps\": ['localhost:3']" in message
    assert 'remove the "ps" entries from TF_CONFIG' in message


def test_one_process_cluster_resolver_keeps_the_local_devices():
    resolver = kd.cluster.SimpleClusterResolver("localhost:1234", 1, 0)
    strategy = kd.ParameterServerStrategy(cluster_resolver=resolver)
    assert strategy.num_replicas_in_sync == 8
    assert strategy.cluster_resolver.num_processes == 1


@pytest.mark.parametrize("option", ["shard_variables", "shard_optimizer_state"])
def test_multi_worker_mirrored_takes_the_sharding_options(monkeypatch, option):
    """One process: MultiWorkerMirroredStrategy(option) == MirroredStrategy(option)."""
    for name in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "KERAS_DIST_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    strategy = kd.MultiWorkerMirroredStrategy(**{option: True})
    assert getattr(strategy, option)
    model = build_in_scope(strategy, initial_weights(**MODEL), **MODEL)
    x, y, sw = make_data(37, seed=0)
    model.fit(x, y, sample_weight=sw, batch_size=10, epochs=2, shuffle=False, verbose=0)
    reference = _run("fsdp" if option == "shard_variables" else "zero1")[0]
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
    kernel = model.optimizer.variables[2]  # the first kernel's first Adam moment
    assert kernel.shape == (6, 16)
    assert [s.data.shape for s in kernel.value.addressable_shards] == [(6, 2)] * 8
    with pytest.raises(TypeError, match="shard_optimizer_state=1"):
        kd.MultiWorkerMirroredStrategy(shard_optimizer_state=1)


def test_zero1_is_bit_identical_to_mirrored():
    """ZeRO-1: the replicated computation with the slots split: the same bits
    (the gradients are all-reduced whole before the split update)."""
    model, history, evaluated, predicted = _run("zero1")
    ref_model, ref_history, ref_evaluated, ref_predicted = _run("mirrored")
    # JAX 0.11+'s XLA:CPU compiles the split update with other instructions
    # than the whole one: an element may differ in its last bit there.
    ulps = 0 if jax.__version__.startswith("0.10.") else 2
    for a, b in zip(ref_model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_max_ulp(b, a, maxulp=ulps)
    for key, values in ref_history.items():
        np.testing.assert_array_max_ulp(
            np.float32(history[key]), np.float32(values), maxulp=ulps
        )
    np.testing.assert_array_max_ulp(
        np.float32(evaluated), np.float32(ref_evaluated), maxulp=ulps
    )
    np.testing.assert_array_max_ulp(predicted, ref_predicted, maxulp=ulps)
    one_device = _run("one_device")
    assert_history_close(one_device[1], history)
    assert_weights_close(one_device[0].get_weights(), model.get_weights())


def test_zero1_splits_the_slots_and_keeps_the_weights_whole():
    model = _run("zero1")[0]
    for v in model.weights:
        assert [s.data.shape for s in v.value.addressable_shards] == [
            tuple(v.shape)
        ] * 8, v.path
    slots = [v for v in model.optimizer.variables if v.shape]
    assert len(slots) == 2 * 6  # Adam's two moments of the 6 trainable weights.
    for v in slots:
        expected = _expected_shard_shape(tuple(v.shape))
        assert [s.data.shape for s in v.value.addressable_shards] == [expected] * 8
    report = strategy_of_model(model).memory_report(model)
    assert report.optimizer_bytes_per_device < report.optimizer_bytes
    assert report.weight_bytes_per_device == report.weight_bytes


@functools.cache
def _custom_loop(name: str) -> dict:
    return _workload.custom_loop_run(STRATEGIES[name]())


@pytest.mark.parametrize("name", [*SHARDED, "zero1"])
def test_custom_loop_with_split_state_matches_one_device(name):
    """`strategy.run` gets split weights and slots whole (gathered in the step),
    never as a batch: bias (16,) is split along axis 0, a batch's layout."""
    expected, got = _custom_loop("one_device"), _custom_loop(name)
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5)
    assert got["correct"] == expected["correct"]
    assert_weights_close(expected["weights"], got["weights"])


@pytest.mark.parametrize("name", SHARDED)
def test_run_sees_a_split_variable_whole(name):
    strategy = STRATEGIES[name]()
    with strategy.scope():
        bias = keras.Variable(np.arange(16, dtype="float32"))
    assert bias.value.addressable_shards[0].data.shape == (2,)
    out = strategy.run(lambda b: b.sum() + 0.0 * b, args=(bias.value,))
    np.testing.assert_array_equal(np.asarray(out), np.full(16, 120.0))


def test_zero1_slots_split_when_the_optimizer_is_built_outside_the_scope():
    strategy = STRATEGIES["zero1"]()
    model = build_in_scope(strategy, initial_weights(**MODEL), **MODEL)
    model.optimizer.build(model.trainable_variables)  # no scope open
    kernel_moment = model.optimizer.variables[2]
    assert kernel_moment.shape == (6, 16)
    shards = kernel_moment.value.addressable_shards
    assert [s.data.shape for s in shards] == [(6, 2)] * 8
