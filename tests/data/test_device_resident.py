"""Device-resident input: in-memory arrays laid out on the mesh once.

With `kd.InputOptions(device_resident=True)` each step's batch is gathered on
the devices from Keras's row indices; the numbers must be those of the host
path (`device_resident=False`) and of plain Keras, for every shuffle mode,
partial batches (37 rows, 8 replicas: batch 8, whose full batches are laid
out as one table a pass, or, read in order, as blocks over the replicas;
and batch 10, every batch padded), sample weights, validation_split,
steps_per_execution, eager steps and a resumed fit.
"""

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    InterruptAt,
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    compile_model,
    make_model,
    mirrored,
)
from tests._strategies import STRATEGIES
from tests.data._resident_cases import (
    SW,
    WEIGHTS,
    ResidentSpy,
    X,
    Y,
    resident_options,
)


def _model(resident, **compile_kwargs):
    if resident is None:
        model = compile_model(make_model())
        model.set_weights(WEIGHTS)
    else:
        strategy = mirrored(8)
        strategy.input_options = resident_options(resident)
        model = build_in_scope(strategy, WEIGHTS)
    if compile_kwargs:
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


def _run(resident, shuffle, spy=None, batch_size=8, **compile_kwargs):
    """fit (3 epochs, validation_split), evaluate and predict: all results."""
    keras.utils.set_random_seed(7)
    model = _model(resident, **compile_kwargs)
    callbacks = [spy] if spy else []
    history = model.fit(
        X,
        Y,
        sample_weight=SW,
        batch_size=batch_size,
        epochs=3,
        shuffle=shuffle,
        validation_split=0.2,
        callbacks=callbacks,
        verbose=0,
    ).history
    scores = model.evaluate(X, Y, batch_size=batch_size, callbacks=callbacks, verbose=0)
    outputs = model.predict(X, batch_size=batch_size, callbacks=callbacks, verbose=0)
    return history, scores, outputs, model.get_weights()


def _assert_same(expected, actual):
    assert_history_close(expected[0], actual[0])
    np.testing.assert_allclose(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(actual[2], expected[2], rtol=1e-5, atol=1e-6)
    assert_weights_close(expected[3], actual[3])


@pytest.mark.parametrize(
    "resident, shuffle, batch_size",
    [
        (True, False, 8),  # Blocks.
        (True, True, 8),  # Copied.
        ("split", True, 8),  # Split by rows.
        (True, "batch", 8),  # Copied.
        (True, True, 10),  # Copied: 10 rows do not split over 8 replicas.
        ("split", True, 10),
    ],
)
def test_resident_equals_host_path_and_keras(resident, shuffle, batch_size):
    spy = ResidentSpy()
    resident = _run(resident, shuffle, spy, batch_size)
    # The training and the validation split, then one dataset per call.
    assert spy.counts == {"fit": 2, "evaluate": 1, "predict": 1}
    host = _run(False, shuffle, batch_size=batch_size)
    for got, want in zip(resident, host, strict=True):  # Bit-identical.
        np.testing.assert_equal(got, want)
    _assert_same(_run(None, shuffle, batch_size=batch_size), resident)


class _Transfers:
    """Counts a strategy's index transfers: one batch (`lay_out`) or many.

    And its pass layouts from rows split over the replicas (`exchange_rows`).
    """

    def __init__(self, strategy):
        self.counts = {"lay_out": 0, "lay_out_steps": 0, "exchange_rows": 0}
        target = strategy.placement  # What the input pipeline lays out with.
        for name in self.counts:
            setattr(target, name, self._counting(name, getattr(target, name)))

    def _counting(self, name, method):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize(
    "resident, shuffle, want",
    [
        # A pass: its full batches in one table; the partial batch alone.
        # (Before the first epoch, Keras reads one batch of a pass of its
        # own to build the model's metrics: one more pass.)
        (True, True, {"lay_out": 3, "lay_out_steps": 4, "exchange_rows": 0}),
        # Split by rows: a pass lays all its batches out from the rows at
        # once; no indices to transfer.
        ("split", True, {"lay_out": 0, "lay_out_steps": 0, "exchange_rows": 4}),
        # In the dataset's order: no table; a step number names a block.
        # Every pass reads the same batches: the partial one is laid out
        # once, at the first epoch, and kept for the others.
        (True, False, {"lay_out": 1, "lay_out_steps": 0, "exchange_rows": 0}),
        # Keras draws each batch's order as it reads it: one by one.
        (True, "batch", {"lay_out": 16, "lay_out_steps": 0, "exchange_rows": 0}),
    ],
)
def test_a_pass_lays_out_its_indices_once(resident, shuffle, want):
    strategy = mirrored(8)
    strategy.input_options = resident_options(resident)
    model = build_in_scope(strategy, WEIGHTS)
    transfers = _Transfers(strategy)
    model.fit(X, Y, batch_size=8, epochs=3, shuffle=shuffle, verbose=0)
    assert transfers.counts == want  # 37 rows: 4 batches of 8 and 1 of 5.
    # One step number a full batch of a table, made once and kept.
    assert len(strategy.placement._step_numbers) == (0 if shuffle == "batch" else 4)


def test_passes_in_order_take_the_first_pass_as_laid_out(monkeypatch):
    """Every pass of a call in order reads the same batches: laid out once."""
    from keras_dist.data.resident import _resident

    laid_out = []
    original = _resident.lay_out_pass

    def counted(strategy, resident, batches):
        laid_out.append(len(batches))
        return original(strategy, resident, batches)

    monkeypatch.setattr(_resident, "lay_out_pass", counted)
    histories = []
    for resident in (True, False):  # Device-resident, then the host path.
        keras.utils.set_random_seed(7)
        strategy = mirrored(8)
        strategy.input_options = resident_options(resident)
        model = build_in_scope(strategy, WEIGHTS)
        fit = model.fit(X, Y, batch_size=8, epochs=4, shuffle=False, verbose=0)
        histories.append(fit.history)
        if resident:
            # 37 rows: 5 batches a pass; Keras's build pass and 4 epochs.
            assert laid_out == [5]
            model.evaluate(X, Y, batch_size=8, verbose=0)
            assert laid_out == [5, 5]  # A call of its own: its own pass.
    assert len(histories[0]["loss"]) == 4
    for key in histories[1]:  # Bit-identical to the host path.
        np.testing.assert_equal(histories[0][key], histories[1][key])


@pytest.mark.parametrize(
    "resident, want",
    [
        (True, {"lay_out": 3, "lay_out_steps": 4, "exchange_rows": 0}),
        ("split", {"lay_out": 0, "lay_out_steps": 0, "exchange_rows": 4}),
    ],
)
def test_a_fused_group_names_its_table_rows_with_one_kept_vector(resident, want):
    strategy = mirrored(8)
    strategy.input_options = resident_options(resident)
    with strategy.scope():
        model = make_model()
        model.set_weights(WEIGHTS)
        compile_model(model, steps_per_execution=2)
    transfers = _Transfers(strategy)
    model.fit(X, Y, batch_size=8, epochs=3, shuffle=True, verbose=0)
    # 4 full batches a pass: groups at table rows (or blocks) 0-1 and 2-3,
    # then the partial batch alone. Each group's rows are one argument,
    # made once.
    assert transfers.counts == want
    ranges = strategy.placement._step_ranges
    assert sorted(ranges) == [(0, 2), (2, 2)]
    np.testing.assert_array_equal(np.asarray(ranges[2, 2]), [2, 3])
    assert ranges[2, 2].dtype == np.int32
    assert ranges[2, 2].sharding.is_fully_replicated


@pytest.mark.parametrize(
    "resident, shuffle",
    [(True, True), ("split", True), (True, False), (True, "batch")],
    ids=["copied", "split", "blocks", "batch-copied"],
)
def test_jax_array_inputs_equal_numpy_inputs(resident, shuffle):
    def run(x, y):
        keras.utils.set_random_seed(3)
        model = _model(resident)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=shuffle, verbose=0)
        scores = model.evaluate(x, y, batch_size=8, verbose=0)
        return history.history, scores, model.predict(x, batch_size=8, verbose=0)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("batch",))
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # One committed to a device, one on every device of the mesh.
    on_devices = run(jax.device_put(X, jax.devices()[3]), jax.device_put(Y, everywhere))
    for got, want in zip(on_devices, run(X, Y), strict=True):
        np.testing.assert_equal(got, want)


@pytest.mark.parametrize("resident", [True, "split"])
@pytest.mark.parametrize(
    "mode",
    [{"steps_per_execution": 3}, {"run_eagerly": True}, {"jit_compile": False}],
    ids=str,
)
def test_resident_execution_modes_equal_keras(mode, resident):
    spy = ResidentSpy()
    resident = _run(resident, True, spy, **mode)
    assert spy.counts["fit"] == 2
    _assert_same(_run(None, True, **mode), resident)


@pytest.mark.parametrize("resident", [True, "split"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_equals_keras(name, resident):
    # Split state (FSDP, ZeRO-1, PS) and state in host memory (CentralStorage);
    # batch 8: 4 full batches from the pass's index table, then 5 rows padded.
    def fit(strategy):
        keras.utils.set_random_seed(3)
        if strategy is None:
            model = compile_model(make_model())
            model.set_weights(WEIGHTS)
        else:
            strategy.input_options = resident_options(resident)
            model = build_in_scope(strategy, WEIGHTS)
        history = model.fit(
            X, Y, batch_size=8, epochs=2, shuffle=True, verbose=0
        ).history
        return history, model.get_weights()

    expected, got = fit(None), fit(STRATEGIES[name]())
    assert_history_close(expected[0], got[0])
    assert_weights_close(expected[1], got[1])


def test_inputs_without_targets():
    # fit(x) alone: Keras's batches are bare arrays, not tuples.
    class OwnLoss(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, *args, **kwargs):
            return keras.ops.mean(y_pred**2)

    def fit(strategy):
        keras.utils.set_random_seed(5)
        model = OwnLoss(make_model().layers)
        model.set_weights(WEIGHTS)
        if strategy is None:
            model.compile("sgd")
            return model.fit(X, batch_size=10, verbose=0).history["loss"]
        strategy.input_options = kd.InputOptions(device_resident=True)
        with strategy.scope():
            model.compile("sgd")
            return model.fit(X, batch_size=10, verbose=0).history["loss"]

    np.testing.assert_allclose(fit(mirrored(8)), fit(None), rtol=1e-5)


def test_input_options_are_checked():
    with pytest.raises(ValueError, match="device_resident_budget=-1"):
        kd.InputOptions(device_resident_budget=-1)
    with pytest.raises(ValueError, match="device_resident='yes'"):
        kd.InputOptions(device_resident="yes")
    with pytest.raises(TypeError, match=r"input_options=\{'device_resident'"):
        mirrored(2).input_options = {"device_resident": True}


def _resumable_fit(model, *callbacks, shuffle=True):
    keras.utils.set_random_seed(11)
    return model.fit(
        X,
        Y,
        batch_size=8,
        epochs=3,
        shuffle=shuffle,
        callbacks=list(callbacks),
        verbose=0,
    )


@pytest.mark.parametrize(
    "resident, shuffle",
    [(True, True), ("split", True), (True, False)],
    ids=["copied", "split", "blocks"],
)
def test_backup_and_restore_resumes_exactly(tmp_path, capsys, resident, shuffle):
    backup = kd.callbacks.BackupAndRestore(tmp_path, save_freq=1)
    with pytest.raises(RuntimeError, match="interrupted at step 7"):
        _resumable_fit(_model(resident), backup, InterruptAt(7), shuffle=shuffle)
    spy = ResidentSpy()
    model = _model(resident)
    history = _resumable_fit(
        model, kd.callbacks.BackupAndRestore(tmp_path), spy, shuffle=shuffle
    ).history
    assert "resuming at epoch 2, step 2" in capsys.readouterr().out
    assert spy.counts["fit"] == 1
    expected = _model(resident)
    expected_history = _resumable_fit(expected, shuffle=shuffle).history
    np.testing.assert_equal(model.get_weights(), expected.get_weights())
    assert history["loss"] == expected_history["loss"][1:]


def _assert_fit_on_devices_equals_keras(resident, seed, **fit_kwargs):
    """`fit` of `X, Y` on the devices gives Keras's history and weights."""

    def fit(resident, callbacks=()):
        keras.utils.set_random_seed(seed)
        model = _model(resident)
        history = model.fit(
            X, Y, batch_size=8, callbacks=list(callbacks), verbose=0, **fit_kwargs
        ).history
        return history, model.get_weights()

    spy = ResidentSpy()
    got = fit(resident, [spy])
    assert spy.counts["fit"] == 1  # On the devices.
    expected = fit(None)
    assert_history_close(expected[0], got[0])
    assert_weights_close(expected[1], got[1])


@pytest.mark.parametrize("resident", [True, "split"])
@pytest.mark.parametrize("steps_per_epoch", [3, 7])  # Part of a pass; past it.
@pytest.mark.parametrize("shuffle", [True, False])
def test_steps_per_epoch_equals_keras(resident, steps_per_epoch, shuffle):
    # 37 rows, batches of 8: 5 a pass. Keras's epochs then cut across its
    # passes (and runs out of data at 7 steps an epoch, as Keras does).
    _assert_fit_on_devices_equals_keras(
        resident, 5, epochs=3, steps_per_epoch=steps_per_epoch, shuffle=shuffle
    )


@pytest.mark.parametrize("resident", [True, "split"])
def test_class_weight_equals_keras(resident):
    # Keras turns `class_weight` into per-row sample weights of the arrays.
    _assert_fit_on_devices_equals_keras(
        resident, 9, epochs=2, class_weight={0: 0.5, 1: 2.0, 2: 1.0}
    )
