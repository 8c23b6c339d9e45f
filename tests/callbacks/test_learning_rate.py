"""PrintLR, LearningRateScheduler and LearningRateWarmup under a strategy."""

import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest

import keras_dist as kd
from tests._helpers import (
    assert_weights_close,
    compile_model,
    initial_weights,
    make_data,
    make_model,
    mirrored,
)

X = np.random.RandomState(0).randn(40, 6).astype("float32")
Y = (X[:, 0] > 0).astype("int32")
STEPS = 5  # 40 rows / global batch 8.


def _fit(model, epochs, *callbacks, batch_size=8):
    return model.fit(
        X, Y, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=list(callbacks)
    )


def decay(epoch):  # The seeds' schedule.
    if epoch < 3:
        return 1e-3
    elif epoch < 7:
        return 1e-4
    return 1e-5


def _model(strategy, optimizer=None):
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile(
            optimizer=optimizer or keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def _lr_per_step(model):
    """Records the rate each step used (read from the optimizer after it)."""
    rates = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            from keras_dist._seams import sync_state
            from keras_dist.callbacks._lr_control import current_learning_rate

            sync_state(self.model)
            rates.append(current_learning_rate(self.model.optimizer))

    return rates, Record()


def test_seed_schedule_and_printed_rates(capsys):
    model = _model(mirrored(8))
    history = model.fit(
        X,
        Y,
        batch_size=8,
        epochs=9,
        verbose=0,
        callbacks=[kd.callbacks.LearningRateScheduler(decay), kd.callbacks.PrintLR()],
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert lines == [
        "Learning rate for epoch 1 is 0.001",
        "Learning rate for epoch 2 is 0.001",
        "Learning rate for epoch 3 is 0.001",
        "Learning rate for epoch 4 is 1e-04",
        "Learning rate for epoch 5 is 1e-04",
        "Learning rate for epoch 6 is 1e-04",
        "Learning rate for epoch 7 is 1e-04",
        "Learning rate for epoch 8 is 1e-05",
        "Learning rate for epoch 9 is 1e-05",
    ]
    np.testing.assert_allclose(
        history.history["learning_rate"], [decay(e) for e in range(9)], rtol=1e-6
    )


def test_the_rate_is_really_used():
    """One SGD step with lr=0 leaves weights alone; lr from the schedule moves them."""
    model = _model(mirrored(4), keras.optimizers.SGD(0.5))
    before = model.get_weights()
    model.fit(
        X,
        Y,
        batch_size=40,
        epochs=1,
        verbose=0,
        callbacks=[kd.callbacks.LearningRateScheduler(lambda e: 0.0)],
    )
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    model.fit(
        X,
        Y,
        batch_size=40,
        epochs=1,
        verbose=0,
        callbacks=[kd.callbacks.LearningRateScheduler(lambda e: 0.1)],
    )
    assert any(
        np.abs(a - b).max() > 1e-4
        for a, b in zip(before, model.get_weights(), strict=True)
    )


def test_schedule_with_current_rate_argument():
    model = _model(mirrored(2), keras.optimizers.SGD(0.1))
    history = model.fit(
        X,
        Y,
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[kd.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)],
    )
    np.testing.assert_allclose(history.history["learning_rate"], [0.05, 0.025, 0.0125])


@pytest.mark.parametrize("kind", ["optax", "keras"])
def test_per_step_traceable_schedule_on_a_schedule_built_optimizer(kind, capsys):
    schedule = (
        optax.linear_schedule(1.0, 0.0, 10)
        if kind == "optax"
        else keras.optimizers.schedules.PolynomialDecay(1.0, 10, 0.0)
    )
    # Keras's own LearningRateScheduler raises TypeError on such an optimizer.
    optimizer = keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 5, 0.5)
    )
    model = _model(mirrored(8), optimizer)
    rates, record = _lr_per_step(model)
    _fit(
        model,
        2,
        kd.callbacks.LearningRateScheduler(schedule, per="step"),
        kd.callbacks.PrintLR(),
        record,
    )
    np.testing.assert_allclose(rates, [1 - s / 10 for s in range(10)], atol=1e-6)
    out = capsys.readouterr().out
    assert "Learning rate for epoch 1 is 0.6" in out
    assert "Learning rate for epoch 2 is 0.1" in out


def test_per_step_python_schedule():
    model = _model(mirrored(2), keras.optimizers.SGD(0.1))
    rates, record = _lr_per_step(model)
    _fit(
        model,
        2,
        kd.callbacks.LearningRateScheduler(
            lambda step: 0.1 if step < 7 else 0.01, per="step"
        ),
        record,
    )
    np.testing.assert_allclose(rates, [0.1] * 7 + [0.01] * 3, rtol=1e-6)


def test_no_recompilation_per_change():
    model = _model(mirrored(4), keras.optimizers.SGD(0.1))
    traces = []
    original = type(model).train_step

    def counting(self, state, data):
        traces.append(1)
        return original(self, state, data)

    model.train_step = counting.__get__(model)
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=6,
        verbose=0,
        callbacks=[kd.callbacks.LearningRateScheduler(lambda e: 0.1 / (e + 1))],
    )
    assert len(traces) == 1


def test_warmup_linear_scaling_rule(capsys):
    model = _model(mirrored(8), keras.optimizers.SGD(0.1))
    rates, record = _lr_per_step(model)
    _fit(
        model,
        3,
        kd.callbacks.LearningRateWarmup(0.1, warmup_epochs=1),
        record,
        kd.callbacks.PrintLR(),
    )
    # 8 replicas: target 0.8, reached by a per-step ramp over 1 epoch (5 steps).
    np.testing.assert_allclose(
        rates[:5], [0.1 + 0.7 * s / 5 for s in range(5)], rtol=1e-5
    )
    np.testing.assert_allclose(rates[5:], [0.8] * 10, rtol=1e-6)
    assert "Learning rate for epoch 3 is 0.8" in capsys.readouterr().out


def test_warmup_with_base_batch_size_sqrt_and_a_scheduler_after():
    model = _model(mirrored(4), keras.optimizers.SGD(0.1))
    rates, record = _lr_per_step(model)
    _fit(
        model,
        3,
        kd.callbacks.LearningRateWarmup(
            0.1, warmup_epochs=1, scale="sqrt", base_batch_size=2
        ),
        kd.callbacks.LearningRateScheduler(
            lambda epoch, lr: lr if epoch < 2 else lr / 10
        ),
        record,
    )
    target = 0.1 * np.sqrt(8 / 2)
    np.testing.assert_allclose(
        rates[:5], [0.1 + (target - 0.1) * s / 5 for s in range(5)], rtol=1e-5
    )
    np.testing.assert_allclose(rates[5:10], [target] * 5, rtol=1e-5)
    np.testing.assert_allclose(rates[10:], [target / 10] * 5, rtol=1e-5)


def test_bad_input():
    with pytest.raises(TypeError, match=r"Received: schedule=0\.1"):
        kd.callbacks.LearningRateScheduler(0.1)
    with pytest.raises(ValueError, match="Received: per='batch'"):
        kd.callbacks.LearningRateScheduler(decay, per="batch")
    with pytest.raises(ValueError, match=r"Received: warmup_epochs=-1"):
        kd.callbacks.LearningRateWarmup(0.1, warmup_epochs=-1)
    with pytest.raises(ValueError, match="Received: scale='cubic'"):
        kd.callbacks.LearningRateWarmup(0.1, scale="cubic")
    with pytest.raises(ValueError, match="base_batch_size=0"):
        kd.callbacks.LearningRateWarmup(0.1, base_batch_size=0)
    for bad, error, text in [
        (lambda e: "fast", TypeError, "must return a number"),
        (lambda e: float("nan"), ValueError, "Received: nan"),
        (lambda e: -0.1, ValueError, "Received: -0.1"),
    ]:
        model = _model(mirrored(2))
        with pytest.raises(error, match=text) as info:
            model.fit(
                X,
                Y,
                batch_size=8,
                epochs=1,
                verbose=0,
                callbacks=[kd.callbacks.LearningRateScheduler(bad)],
            )
        assert "at epoch 0" in str(info.value)
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)  # Still usable.


def test_print_lr_with_a_schedule_built_optimizer(capsys):
    schedule = keras.optimizers.schedules.ExponentialDecay(
        0.1, decay_steps=5, decay_rate=0.5
    )
    model = _model(mirrored(8), keras.optimizers.SGD(schedule))
    history = model.fit(
        X, Y, batch_size=8, epochs=2, verbose=0, callbacks=[kd.callbacks.PrintLR()]
    )
    # The last step of epoch 1 is step 4, of epoch 2 step 9.
    expected = [float(schedule(4)), float(schedule(9))]
    np.testing.assert_allclose(history.history["learning_rate"], expected, rtol=1e-6)
    out = capsys.readouterr().out
    assert f"Learning rate for epoch 2 is {np.float32(expected[1])!s}" in out


BAD_STEP = 7  # Mid second epoch: 5 steps an epoch.


def _traceable(kind):
    """Positive before BAD_STEP, then negative or NaN; each a traceable kind."""
    if kind == "negative":
        return lambda step: jnp.where(step < BAD_STEP, 0.01, -0.1)
    if kind == "nan":
        return lambda step: jnp.where(step < BAD_STEP, 0.01, jnp.nan)
    if kind == "cond":  # Takes no arrays (lax.cond): checked under jax.vmap.
        return lambda step: jax.lax.cond(step < BAD_STEP, lambda: 0.01, lambda: -0.1)
    # Neither arrays nor vmap: checked one host call per step.
    return lambda step: jax.pure_callback(
        lambda s: np.float32(0.01 if s < BAD_STEP else -0.1),
        jax.ShapeDtypeStruct((), jnp.float32),
        step,
    )


def _lr_model(steps_per_execution=1):
    weights = initial_weights()
    with mirrored(8).scope():
        model = make_model()
        model.set_weights(weights)
        compile_model(model)
        if steps_per_execution > 1:
            model.compile(
                optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=steps_per_execution,
            )
    return model


@pytest.mark.parametrize(
    ("kind", "steps_per_execution", "received"),
    [
        ("negative", 1, "-0.1"),
        ("nan", 1, "nan"),
        ("negative", 3, "-0.1"),
        ("cond", 1, "-0.1"),
        ("callback", 1, "-0.1"),
    ],
)
def test_per_step_compiled_schedule_checked_before_the_bad_epoch(
    kind, steps_per_execution, received
):
    x, y, _ = make_data(40)
    schedule = _traceable(kind)

    def fit(model, epochs):
        scheduler = kd.callbacks.LearningRateScheduler(schedule, per="step")
        assert scheduler._in_step
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[scheduler],
        )

    reference = _lr_model(steps_per_execution)
    fit(reference, 1)  # Steps 0-4 only: all fine.
    model = _lr_model(steps_per_execution)
    with pytest.raises(ValueError, match="non-negative learning rate") as info:
        fit(model, 3)
    assert f"`schedule` at step {BAD_STEP} " in str(info.value)
    assert f"Received: {received}." in str(info.value)
    # The second epoch (steps 5-9) did not train at all.
    assert int(np.asarray(model.optimizer.iterations.value)) == STEPS
    assert_weights_close(reference.get_weights(), model.get_weights(), 0, 0)


def test_per_step_compiled_schedule_with_unknown_epoch_length():
    """A generator's epoch length is unknown: raises just before the bad step."""
    x, y, _ = make_data(80)

    def batches(count):
        for i in range(count):
            yield x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

    def fit(model, count, schedule):
        model.fit(
            batches(count),
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[kd.callbacks.LearningRateScheduler(schedule, per="step")],
        )

    # Keras calls on_train_batch_begin once more before it finds the data
    # ended, so the reference's schedule is 0.01 throughout (as at steps 0-6).
    reference = _lr_model()
    fit(reference, BAD_STEP, lambda step: jnp.full_like(step, 0.01))
    model = _lr_model()
    with pytest.raises(ValueError, match=f"at step {BAD_STEP} .*Received: -0.1"):
        fit(model, 10, _traceable("negative"))
    assert int(np.asarray(model.optimizer.iterations.value)) == BAD_STEP
    assert_weights_close(reference.get_weights(), model.get_weights(), 0, 0)


def test_per_step_python_schedule_going_negative_names_the_step():
    def schedule(step):  # Not traceable (`if`, `math`): set on the host per step.
        if step < BAD_STEP:
            return 0.01 * math.cos(step / 100)
        return -0.1

    scheduler = kd.callbacks.LearningRateScheduler(schedule, per="step")
    assert not scheduler._in_step
    model = _model(mirrored(8))
    with pytest.raises(ValueError, match=r"Received: -0\.1\.") as info:
        _fit(model, 3, scheduler)
    assert f"`schedule` at step {BAD_STEP} must return" in str(info.value)
    assert int(np.asarray(model.optimizer.iterations.value)) == BAD_STEP
