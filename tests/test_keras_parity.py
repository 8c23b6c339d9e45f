"""A call under a strategy equals the same call with no strategy (Keras's own).

Every fit/evaluate/predict option a Keras user has — execution modes
(`run_eagerly`, `jit_compile=False`, `steps_per_execution`), `class_weight`,
`sample_weight`, `validation_freq`, `initial_epoch`, `shuffle="batch"`,
callbacks that stop training, `*_on_batch`, Python generators — on 37 rows in
global batches of 10 (a partial last batch of 7 that splits over 8 replicas
only with padding), with BatchNormalization. The reference is plain Keras in
the same mode. `steps_per_execution`, `class_weight`, `sample_weight`,
`validation_freq` and `initial_epoch` are also run under every strategy
(OneDevice, Mirrored, ParameterServer, FSDP, ZeRO-1, MultiWorkerMirrored in
one process, CentralStorage).
"""

import functools
import threading

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    CLASSES,
    assert_history_close,
    assert_weights_close,
    make_data,
    make_model,
    mirrored,
)
from tests._strategies import pick

X, Y, SW = make_data(37)
XV, YV, _ = make_data(13, seed=1)
B = 10
MODES = {
    "jit": {},
    "run_eagerly": {"run_eagerly": True},
    "jit_compile=False": {"jit_compile": False},
    "steps_per_execution=3": {"steps_per_execution": 3},
}


def _model(strategy, mode: dict, weights=None):
    keras.utils.set_random_seed(7)
    scope = strategy.scope() if strategy is not None else _nullscope()
    with scope:
        model = make_model(batch_norm=True)
        if weights is not None:
            model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **mode,
        )
    return model


class _nullscope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _run(strategy, mode, fit_kwargs, *, weights):
    model = _model(strategy, mode, weights)
    keras.utils.set_random_seed(3)  # Same shuffling in both runs.
    fit_kwargs = {"epochs": 2, **fit_kwargs}
    history = model.fit(X, Y, batch_size=B, verbose=0, **fit_kwargs)
    evaluation = model.evaluate(XV, YV, batch_size=8, verbose=0, return_dict=True)
    predictions = model.predict(X[:5], batch_size=8, verbose=0)
    return model, history.history, evaluation, predictions


def _weights():
    keras.utils.set_random_seed(1234)
    return make_model(batch_norm=True).get_weights()


def _strategies():
    return {"one_device": kd.OneDeviceStrategy("cpu:0"), "mirrored8": mirrored(8)}


EVERY_STRATEGY = {
    **pick("one_device", "mirrored", "parameter_server", "fsdp", "zero1"),
    "multi_worker": lambda: kd.MultiWorkerMirroredStrategy(),
    **pick("central_storage"),
}
# What would make MultiWorkerMirroredStrategy join a cluster.
CLUSTER_VARS = (
    "TF_CONFIG",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "KERAS_DIST_COORDINATOR",
    "KERAS_DIST_NUM_PROCESSES",
    "KERAS_DIST_PROCESS_ID",
)


@functools.cache
def _jitted_keras():
    """Plain Keras, compiled: what every mode under a strategy must give."""
    model, history, evaluation, predictions = _run(
        None, {}, {"shuffle": False}, weights=_weights()
    )
    return model.get_weights(), history, evaluation, predictions


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("which", ["one_device", "mirrored8"])
def test_every_execution_mode_equals_keras(mode, which):
    weights = _weights()
    same_mode = _run(None, MODES[mode], {"shuffle": False}, weights=weights)
    model, *got = _run(
        _strategies()[which], MODES[mode], {"shuffle": False}, weights=weights
    )
    assert got[2].shape == (5, CLASSES)  # No padded row comes back.
    references = {
        "keras-same-mode": (same_mode[0].get_weights(), *same_mode[1:]),
        "keras-jitted": _jitted_keras(),
    }
    for ref_weights, history, evaluation, predictions in references.values():
        assert_history_close(history, got[0])
        assert_weights_close(ref_weights, model.get_weights())
        np.testing.assert_allclose(
            [got[1][k] for k in sorted(got[1])],
            [evaluation[k] for k in sorted(evaluation)],
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(got[2], predictions, rtol=1e-5, atol=1e-6)


ONLY_MIRRORED = ["shuffle=batch", "shuffle=True", "validation_split"]
OPTIONS = {
    "class_weight": {"class_weight": {0: 0.5, 1: 2.0, 2: 1.0}},
    "sample_weight": {"sample_weight": SW},
    "validation_freq": {"validation_data": (XV, YV), "validation_freq": 2},
    "initial_epoch": {"initial_epoch": 1},
    "shuffle=batch": {"shuffle": "batch"},
    "shuffle=True": {"shuffle": True},
    "validation_split": {"validation_split": 0.3},
}


@pytest.mark.parametrize("option", ONLY_MIRRORED)
def test_fit_options_equal_keras(option):
    weights = _weights()
    ref = _run(None, {}, OPTIONS[option], weights=weights)
    got = _run(mirrored(8), {}, OPTIONS[option], weights=weights)
    assert_history_close(ref[1], got[1])
    assert_weights_close(ref[0].get_weights(), got[0].get_weights())


# Two runs per strategy cover the five options (class_weight and
# sample_weight exclude each other): steps_per_execution=3 (executions of 3
# steps and 1), validation every 2nd epoch, and 2 epochs from initial_epoch=1.
COMBINED = {
    "steps_per_execution,class_weight,validation_freq,initial_epoch": (
        {"steps_per_execution": 3},
        {
            **OPTIONS["class_weight"],
            **OPTIONS["validation_freq"],
            "initial_epoch": 1,
            "epochs": 3,
        },
    ),
    "steps_per_execution,sample_weight": (
        {"steps_per_execution": 3},
        OPTIONS["sample_weight"],
    ),
}


@functools.cache
def _keras_with(options: str):
    mode, fit_kwargs = COMBINED[options]
    model, *results = _run(None, mode, fit_kwargs, weights=_weights())
    return model.get_weights(), *results


@pytest.mark.parametrize("options", list(COMBINED))
@pytest.mark.parametrize("which", list(EVERY_STRATEGY))
def test_fit_options_equal_keras_under_every_strategy(which, options, monkeypatch):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    mode, fit_kwargs = COMBINED[options]
    model, history, evaluation, predictions = _run(
        EVERY_STRATEGY[which](), mode, fit_kwargs, weights=_weights()
    )
    ref_weights, ref_history, ref_evaluation, ref_predictions = _keras_with(options)
    if "initial_epoch" in fit_kwargs:
        assert len(history["loss"]) == 2 and len(history["val_loss"]) == 1
    assert_history_close(ref_history, history)
    assert_weights_close(ref_weights, model.get_weights())
    assert evaluation == pytest.approx(ref_evaluation, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(predictions, ref_predictions, rtol=1e-5, atol=1e-6)


class _StopAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            self.model.stop_training = True


@pytest.mark.parametrize("mode", ["jit", "run_eagerly"])
def test_a_callback_that_stops_training_stops_at_the_same_step(mode):
    weights = _weights()
    models = []
    for strategy in (None, mirrored(8)):
        model = _model(strategy, MODES[mode], weights)
        model.fit(
            X, Y, batch_size=B, epochs=3, shuffle=False, verbose=0,
            callbacks=[_StopAt(1)],
        )  # fmt: skip
        models.append(model)
    assert int(models[1].optimizer.iterations.value) == 2
    assert_weights_close(models[0].get_weights(), models[1].get_weights())


@pytest.mark.parametrize("mode", list(MODES))
def test_on_batch_methods_equal_keras(mode):
    weights = _weights()
    results = []
    for strategy in (None, mirrored(8)):
        options = MODES[mode]
        if strategy is None:
            # One batch is one step either way; Keras's nightly crashes in its
            # own `train_on_batch` with steps_per_execution > 1 (it slices
            # the missing sample weights of its super-batch loop).
            options = {k: v for k, v in options.items() if k != "steps_per_execution"}
        model = _model(strategy, options, weights)
        train = model.train_on_batch(X[:7], Y[:7], return_dict=True)
        test = model.test_on_batch(X[7:12], Y[7:12], return_dict=True)
        out = model.predict_on_batch(X[:5])
        results.append((train, test, out, model.get_weights()))
    (rt, re, ro, rw), (gt, ge, go, gw) = results
    assert go.shape == (5, CLASSES)
    for ref, got in ((rt, gt), (re, ge)):
        np.testing.assert_allclose(
            [got[k] for k in sorted(got)], [ref[k] for k in sorted(ref)], rtol=1e-5
        )
    np.testing.assert_allclose(go, ro, rtol=1e-5, atol=1e-6)
    assert_weights_close(rw, gw)


def _six_batches(x, y=None):
    """A finite generator of 6 batches (the last one partial)."""
    for i in range(6):
        rows = slice(i * 7, min((i + 1) * 7, 40))
        yield (x[rows],) if y is None else (x[rows], y[rows])


@pytest.mark.parametrize("which", ["none", "one_device", "mirrored8"])
def test_a_generator_is_read_whole_on_the_first_call(which):
    x, y, _ = make_data(40, seed=2)
    strategy = None if which == "none" else _strategies()[which]
    model = _model(strategy, {}, _weights())
    model.fit(_six_batches(x, y), epochs=1, verbose=0)
    assert int(model.optimizer.iterations.value) == 6  # Every batch trained.
    fresh = _model(strategy, {}, _weights())
    evaluation = fresh.evaluate(_six_batches(x, y), verbose=0, return_dict=True)
    expected = fresh.evaluate(x, y, batch_size=7, verbose=0, return_dict=True)
    assert evaluation == pytest.approx(expected, rel=1e-5)
    predictions = _model(strategy, {}, _weights()).predict(_six_batches(x), verbose=0)
    assert predictions.shape == (40, CLASSES)
    np.testing.assert_allclose(
        predictions, fresh.predict(x, batch_size=7, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_no_thread_outlives_its_pass():
    """Passes that end early (the build pass, steps_per_epoch shorter than
    the data, a callback that stops training) leave no prefetch thread."""
    start = threading.active_count()
    model = _model(mirrored(8), {}, _weights())
    model.fit(X, Y, batch_size=B, epochs=2, steps_per_epoch=2, verbose=0)
    model.fit(X, Y, batch_size=B, epochs=3, verbose=0, callbacks=[_StopAt(0)])
    model.evaluate(X, Y, batch_size=B, steps=1, verbose=0)
    model.predict(X, batch_size=B, steps=1, verbose=0)
    assert threading.active_count() == start
    names = [t.name for t in threading.enumerate()]
    assert "keras_dist-prefetch" not in names
