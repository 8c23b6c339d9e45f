"""Checkpoints of sharded variables: written, loaded and resharded across strategies.

Strategies that split state: ParameterServerStrategy (FixedShardsPartitioner(8))
and MirroredStrategy(shard_variables=True) split weights and slots, ZeRO-1
(`shard_optimizer_state=True`) only the slots. A checkpoint written under one
loads under any other (Mirrored, OneDevice, plain Keras, another split) with
exactly the same values, laid out as the loading strategy lays variables out;
training continued from it ends where an uninterrupted run does. The model:
Dense (6, 16) and (16, 3) kernels and the (16,) bias split over 8 devices, the
(3,) bias stays whole. 37 rows, batch 10: a partial last batch.
"""

import functools

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    InterruptAt,
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
)
from tests._strategies import pick

STRATEGIES = pick("parameter_server", "fsdp", "zero1", "mirrored", "one_device")
SPLIT = ["parameter_server", "fsdp", "zero1"]
X, Y, SW = make_data(37, seed=0)


def _fit(model, epochs, *callbacks, initial_epoch=0):
    return model.fit(
        X,
        Y,
        sample_weight=SW,
        batch_size=10,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def _new_model(name):
    return build_in_scope(STRATEGIES[name](), initial_weights())


@functools.cache
def _uninterrupted(name, epochs):
    model = _new_model(name)
    history = _fit(model, epochs).history
    return _state(model), history


def _built(model):
    """`model` with its optimizer's variables: `load_weights` fills them too."""
    model.optimizer.build(model.trainable_variables)
    return model


def _state(model) -> list[np.ndarray]:
    """Weights, then the optimizer's variables (step, rate, slots)."""
    return [np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]]


def _assert_equal(expected, actual):
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        np.testing.assert_array_equal(a, e, err_msg=f"variable {i}")


def _part_shape(shape):
    divisible = [i for i, d in enumerate(shape) if d % 8 == 0]
    if not divisible:
        return shape
    axis = max(divisible, key=lambda i: (shape[i], -i))
    return tuple(d // 8 if i == axis else d for i, d in enumerate(shape))


def _assert_laid_out_by(name, model):
    """Split parts of 1/8 where `name` splits, whole elsewhere."""
    splits_weights = name in ("parameter_server", "fsdp")
    splits_slots = name in SPLIT
    slots = [v for v in model.optimizer.variables if v.shape] if model.optimizer else []
    for variables, split in ((model.weights, splits_weights), (slots, splits_slots)):
        for v in variables:
            shape = tuple(v.shape)
            shards = v.value.addressable_shards
            expected = _part_shape(shape) if split else shape
            devices = 1 if name == "one_device" else 8
            assert [s.data.shape for s in shards] == [expected] * devices, v.path


@pytest.mark.parametrize("name", SPLIT)
def test_model_checkpoints_during_a_split_fit_load_back(tmp_path, name):
    model = _new_model(name)
    _fit(
        model,
        2,
        keras.callbacks.ModelCheckpoint(str(tmp_path / "keras_{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(
            str(tmp_path / "keras_{epoch}.weights.h5"), save_weights_only=True
        ),
        kd.callbacks.ModelCheckpoint(tmp_path / "kd_{epoch}.keras"),
        kd.callbacks.ModelCheckpoint(
            tmp_path / "kd_{epoch}.weights.h5", save_weights_only=True
        ),
    )
    trained = _state(model)
    for prefix in ("keras", "kd"):
        full = tmp_path / f"{prefix}_2.keras"
        with STRATEGIES[name]().scope() as strategy:
            same = keras.saving.load_model(full)
            same_weights = _built(build_in_scope(strategy, initial_weights()))
            same_weights.load_weights(tmp_path / f"{prefix}_2.weights.h5")
        _assert_equal(trained, _state(same))
        _assert_laid_out_by(name, same)
        _assert_equal(trained, _state(same_weights))
        _assert_laid_out_by(name, same_weights)
        with kd.OneDeviceStrategy("cpu:0").scope():
            one = keras.saving.load_model(full)
        plain = keras.saving.load_model(full)
        plain_weights = _built(compile_model(make_model()))
        plain_weights.load_weights(tmp_path / f"{prefix}_2.weights.h5")
        for loaded in (one, plain):
            _assert_equal(trained, _state(loaded))
            assert len(loaded.layers[0].kernel.value.sharding.device_set) == 1
        _assert_equal(trained, _state(plain_weights))


# Each chain: a split strategy → Mirrored → OneDevice → another split one.
CHAINS = [
    ("parameter_server", "fsdp"),
    ("fsdp", "zero1"),
    ("zero1", "parameter_server"),
]


@pytest.mark.parametrize("first, last", CHAINS)
def test_save_and_load_reshards_across_strategies(tmp_path, first, last):
    model = _new_model(first)
    _fit(model, 1)
    saved = _state(model)
    path = tmp_path / f"{first}.keras"
    model.save(path)
    model.save_weights(tmp_path / "w.weights.h5")
    for name in ("mirrored", "one_device", last):
        with STRATEGIES[name]().scope() as strategy:
            model = keras.saving.load_model(path)
            weights_only = _built(build_in_scope(strategy, initial_weights()))
            weights_only.load_weights(tmp_path / "w.weights.h5")
        _assert_equal(saved, _state(model))  # Weights and optimizer state.
        _assert_laid_out_by(name, model)
        _assert_equal(saved, _state(weights_only))
        _assert_laid_out_by(name, weights_only)
        path = tmp_path / f"{name}.keras"
        model.save(path)
    # Continued under `last`: where 2 uninterrupted epochs end.
    history = _fit(model, 2, initial_epoch=1).history
    expected, expected_history = _uninterrupted("one_device", 2)
    assert_weights_close(expected, _state(model))
    np.testing.assert_allclose(
        history["loss"], expected_history["loss"][1:], rtol=1e-5, atol=1e-6
    )


def _interrupted_then_resumed(backup_dir, writer, reader, capsys):
    """3 epochs of 4 steps; stopped after step 6 (epoch 2, step 2), resumed."""
    with pytest.raises(RuntimeError, match="interrupted at step 6"):
        _fit(
            _new_model(writer),
            3,
            kd.callbacks.BackupAndRestore(backup_dir, save_freq=2),
            InterruptAt(6),
        )
    model = _new_model(reader)
    history = _fit(model, 3, kd.callbacks.BackupAndRestore(backup_dir)).history
    assert "resuming at epoch 2, step 2 (backup of" in capsys.readouterr().out
    return model, history


@pytest.mark.parametrize("name", SPLIT)
def test_backup_and_restore_resumes_a_split_fit_exactly(tmp_path, capsys, name):
    model, history = _interrupted_then_resumed(tmp_path / "b", name, name, capsys)
    expected, expected_history = _uninterrupted(name, 3)
    _assert_equal(expected, _state(model))  # Bit-identical.
    _assert_laid_out_by(name, model)
    for key, values in history.items():
        assert values == expected_history[key][1:], key


@pytest.mark.parametrize(
    "writer, reader",
    [
        ("fsdp", "mirrored"),
        ("fsdp", "one_device"),
        ("one_device", "fsdp"),
    ],
)
def test_backup_restored_under_another_strategy(tmp_path, capsys, writer, reader):
    model, history = _interrupted_then_resumed(tmp_path / "b", writer, reader, capsys)
    expected, expected_history = _uninterrupted("one_device", 3)
    assert_weights_close(expected, _state(model))
    _assert_laid_out_by(reader, model)
    np.testing.assert_allclose(
        history["loss"], expected_history["loss"][1:], rtol=1e-5, atol=1e-6
    )
