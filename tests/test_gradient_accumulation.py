"""`gradient_accumulation_steps` under a strategy means what Keras documents.

Accumulation 2 at batch 16 gives the weights, `optimizer.iterations` and
learning rates of batch 32 without accumulation (64 rows: a multiple of 32),
with and without learning-rate schedules, for SGD, Adam and AdamW (weight
decay, clipping) and EMA, on one device, 8 replicas, FSDP, ZeRO-1 and
ParameterServerStrategy, in every execution mode. Plain Keras (no strategy)
runs a schedule per micro-step and ends far from batch 32. With a partial
last micro-batch and with BatchNormalization (which sees micro-batches), the
reference is plain Keras with the same accumulation and no schedule.
"""

import contextlib
import functools

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import assert_weights_close, make_data, make_model, mirrored
from tests._strategies import pick

X, Y, _ = make_data(64)
SCHEDULES = {
    "piecewise": lambda: keras.optimizers.schedules.PiecewiseConstantDecay(
        [1], [1.0, 0.05]
    ),
    "cosine": lambda: keras.optimizers.schedules.CosineDecay(0.05, 4),
}
OPTIMIZERS = {
    "sgd_schedule": lambda acc: keras.optimizers.SGD(
        SCHEDULES["piecewise"](), gradient_accumulation_steps=acc
    ),
    "sgd": lambda acc: keras.optimizers.SGD(
        0.1, momentum=0.5, gradient_accumulation_steps=acc
    ),
    "adam": lambda acc: keras.optimizers.Adam(0.01, gradient_accumulation_steps=acc),
    "adamw_schedule_clip": lambda acc: keras.optimizers.AdamW(
        SCHEDULES["cosine"](),
        weight_decay=0.1,
        global_clipnorm=0.5,
        gradient_accumulation_steps=acc,
    ),
    "sgd_ema": lambda acc: keras.optimizers.SGD(
        0.1,
        use_ema=True,
        ema_momentum=0.5,
        ema_overwrite_frequency=3,
        gradient_accumulation_steps=acc,
    ),
}
STRATEGIES = pick("one_device", "mirrored", "fsdp", "zero1", "parameter_server")
MODES = {
    "jit": {},
    "run_eagerly": {"run_eagerly": True},
    "jit_compile=False": {"jit_compile": False},
    "steps_per_execution=2": {"steps_per_execution": 2},
}


def _fit(strategy, optimizer, *, batch, x=X, y=Y, mode=None, callbacks=(), **model):
    keras.utils.set_random_seed(1234)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        net = make_model(**model)
        net.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **(mode or {}),
        )
    history = net.fit(
        x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
        callbacks=list(callbacks),
    )  # fmt: skip
    return net, history.history


def _iterations(net) -> int:
    return int(np.asarray(net.optimizer.iterations))


@functools.cache
def _batch_32(name: str):
    """Plain Keras at batch 32 without accumulation: the reference."""
    net, history = _fit(None, OPTIMIZERS[name](None), batch=32)
    return net.get_weights(), _iterations(net), history["loss"]


def _assert_equals_batch_32(net, history, name: str) -> None:
    weights, iterations, loss = _batch_32(name)
    assert _iterations(net) == iterations == 4
    assert_weights_close(weights, net.get_weights())
    np.testing.assert_allclose(history["loss"], loss, rtol=1e-5)


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_accumulating_2_batches_of_16_equals_batch_32(name):
    net, history = _fit(mirrored(8), OPTIMIZERS[name](2), batch=16)
    _assert_equals_batch_32(net, history, name)


@pytest.mark.parametrize(
    ("which", "name"),
    [
        ("fsdp", "sgd_schedule"),
        ("fsdp", "adam"),
        ("zero1", "sgd_schedule"),
        ("zero1", "adam"),
        ("parameter_server", "adamw_schedule_clip"),
    ],
)
def test_accumulation_with_split_state_equals_batch_32(which, name):
    net, history = _fit(STRATEGIES[which](), OPTIMIZERS[name](2), batch=16)
    _assert_equals_batch_32(net, history, name)


@pytest.mark.parametrize(
    ("which", "mode"),
    [("one_device", mode) for mode in MODES]
    # (mirrored, jit): test_accumulating_2_batches_of_16_equals_batch_32.
    + [("mirrored", mode) for mode in MODES if mode != "jit"],
)
def test_every_execution_mode(which, mode):
    net, history = _fit(
        STRATEGIES[which](), OPTIMIZERS["sgd_schedule"](2), batch=16, mode=MODES[mode]
    )
    _assert_equals_batch_32(net, history, "sgd_schedule")


def test_plain_keras_runs_the_schedule_per_micro_step():
    """The failure the strategy fixes: Keras alone is far from batch 32."""
    net, _ = _fit(None, OPTIMIZERS["sgd_schedule"](2), batch=16)
    weights, iterations, _ = _batch_32("sgd_schedule")
    assert _iterations(net) == iterations
    assert _max_difference(weights, net.get_weights()) > 0.05
    # The same call under a strategy matches: test_accumulating_2_batches_...


_UPDATES = []  # One entry per variable update computed (run, not traced).


class _CountingSGD(keras.optimizers.SGD):
    """SGD that counts the variable updates it computes."""

    def update_step(self, gradient, variable, learning_rate):
        jax.debug.callback(lambda: _UPDATES.append(1))
        super().update_step(gradient, variable, learning_rate)


def test_the_update_is_computed_once_per_n_micro_batches():
    counts = {}
    for which in ("none", "mirrored"):
        _UPDATES.clear()
        strategy = None if which == "none" else mirrored(8)
        optimizer = _CountingSGD(gradient_accumulation_steps=2)
        net, _ = _fit(strategy, optimizer, batch=16)
        jax.effects_barrier()
        counts[which] = len(_UPDATES) // len(net.trainable_variables)
    # 8 micro-batches: Keras computes (and discards) 8 updates, keras_dist 4.
    assert counts == {"none": 8, "mirrored": 4}


@pytest.mark.parametrize("which", ["zero1", "fsdp", "parameter_server", "mirrored"])
def test_accumulators_are_laid_out_like_optimizer_state(which):
    with STRATEGIES[which]().scope():
        net = make_model()
        optimizer = OPTIMIZERS["adam"](2)
        optimizer.build(net.trainable_variables)
    accumulators = optimizer._accumulated_gradients
    assert [tuple(a.shape) for a in accumulators] == [(6, 16), (16,), (16, 3), (3,)]
    for accumulator, momentum in zip(accumulators, optimizer._momentums, strict=True):
        shards = [s.data.shape for s in accumulator.value.addressable_shards]
        assert shards == [s.data.shape for s in momentum.value.addressable_shards]
    kernel = [s.data.shape for s in accumulators[0].value.addressable_shards]
    assert kernel == [(6, 16) if which == "mirrored" else (6, 2)] * 8


def test_learning_rate_callbacks_see_updates():
    """PrintLR logs, a per-step LearningRateScheduler and
    `optimizer.learning_rate` count updates, as at batch 32."""

    def per_step(step):
        return 0.2 / (1.0 + step)

    runs = []
    for strategy, acc, batch in ((None, None, 32), (mirrored(8), 2, 16)):
        net, history = _fit(
            strategy, OPTIMIZERS["sgd_schedule"](acc), batch=batch,
            callbacks=[kd.callbacks.PrintLR()],
        )  # fmt: skip
        scheduled = _fit(
            strategy, OPTIMIZERS["sgd"](acc), batch=batch,
            callbacks=[kd.callbacks.LearningRateScheduler(per_step, per="step")],
        )[0]  # fmt: skip
        rate = float(np.asarray(net.optimizer.learning_rate))
        runs.append((history["learning_rate"], rate, scheduled.get_weights()))
    (ref_logged, ref_rate, ref_weights), (logged, rate, weights) = runs
    assert logged == ref_logged == pytest.approx([1.0, 0.05])
    assert rate == ref_rate == pytest.approx(0.05)
    assert_weights_close(ref_weights, weights)


@pytest.mark.parametrize("mode", ["jit", "steps_per_execution=2"])
def test_a_partial_last_micro_batch_weighs_like_a_full_one(mode):
    """40 rows at batch 16: micro-batches of 16, 16, 8 per epoch. The mean
    gradient of the 8 rows counts as much as one of 16 rows (Keras's rule),
    so the run equals plain Keras with the same accumulation."""
    x, y, _ = make_data(40, seed=3)
    ref, ref_history = _fit(
        None, OPTIMIZERS["adam"](2), batch=16, x=x, y=y, mode=MODES[mode]
    )
    net, history = _fit(
        mirrored(8), OPTIMIZERS["adam"](2), batch=16, x=x, y=y, mode=MODES[mode]
    )
    assert _iterations(net) == _iterations(ref) == 3  # 6 micro-batches.
    assert_weights_close(ref.get_weights(), net.get_weights())
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)


def test_batch_normalization_sees_micro_batches():
    """BN normalizes with the moments of each micro-batch of 16 rows: the
    run equals plain Keras with the same accumulation (no schedule), and its
    moving statistics differ from batch 32's."""
    ref, _ = _fit(None, OPTIMIZERS["sgd"](2), batch=16, batch_norm=True)
    net, _ = _fit(mirrored(8), OPTIMIZERS["sgd"](2), batch=16, batch_norm=True)
    assert _iterations(net) == 4
    assert_weights_close(ref.get_weights(), net.get_weights())
    batch_32, _ = _fit(None, OPTIMIZERS["sgd"](None), batch=32, batch_norm=True)
    moving_mean = 4  # Dense kernel, bias, BN gamma, beta, moving mean, ...
    assert (
        _max_difference(
            [batch_32.get_weights()[moving_mean]], [net.get_weights()[moving_mean]]
        )
        > 1e-3
    )


class _StopAfter(keras.callbacks.Callback):
    """Raises after `micro_steps` micro-batches (as a crash would)."""

    def __init__(self, micro_steps: int):
        super().__init__()
        self.micro_steps, self.seen = micro_steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.micro_steps:
            raise RuntimeError(f"stopped after {self.seen}")


@pytest.mark.parametrize("name", ["one_device", "zero1"])
def test_backup_and_restore_resumes_between_micro_batches(tmp_path, name):
    """Stopped after micro-batch 5 (one gradient accumulated, 2 updates made),
    resumed from the backup: the accumulators come back, the end is exact."""
    optimizer = OPTIMIZERS["sgd_schedule"]
    expected, _ = _fit(STRATEGIES[name](), optimizer(2), batch=16)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="stopped after 5"):
        _fit(
            STRATEGIES[name](),
            optimizer(2),
            batch=16,
            callbacks=[
                kd.callbacks.BackupAndRestore(backup, save_freq=1),
                _StopAfter(5),
            ],
        )
    net, _ = _fit(
        STRATEGIES[name](),
        optimizer(2),
        batch=16,
        callbacks=[kd.callbacks.BackupAndRestore(backup, save_freq=1)],
    )
    assert _iterations(net) == _iterations(expected) == 4
    for a, b in zip(expected.get_weights(), net.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
