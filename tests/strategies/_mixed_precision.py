"""Shared by the mixed-precision tests: strategies, runs, tolerances, helpers.

`mixed_bfloat16` and `mixed_float16` with `keras.optimizers.LossScaleOptimizer`
(explicit, and the one `compile(auto_scale_loss=True)` adds under
`mixed_float16`). The float16 runs start at a loss scale of 2**18, where the
scaled gradients overflow float16: the first steps are skipped and the scale
halved until they fit, then it grows every 2 finite steps. 37 rows at batch
10 (a partial last batch), a BatchNormalization model, Adam(1e-2).

Tolerances against one device (measured on 8 CPU devices, 8 steps):
float16 weights within rtol 1e-3, atol 1e-4 (Adam's step is 1e-2), outputs
(float16 sums of terms near 1, ulp 2**-11 = 4.9e-4) rtol 1e-3, atol 1e-3;
bfloat16 (8-bit mantissa: one ulp is 2**-8 = 0.4%, and the summation order
over replicas differs) weights within rtol 1e-2, atol 1e-3, outputs
(bfloat16 values near 2, ulp 0.0156) rtol 1e-2, atol 1e-2; losses and
metrics within the rtol. The loss scale, its step counter and `iterations`
are equal, batch by batch.
"""

import functools

import keras
import numpy as np
import pytest

from tests._helpers import initial_weights, make_data, make_model
from tests._strategies import pick

MODEL = {"batch_norm": True}
STRATEGIES = pick(
    "one_device", "mirrored", "parameter_server", "fsdp", "zero1", "central_storage"
)
DISTRIBUTED = [name for name in STRATEGIES if name != "one_device"]

# policy, optimizer: "lso" = an explicit LossScaleOptimizer, "auto" = the
# one compile(auto_scale_loss=True) wraps around Adam under mixed_float16.
RUNS = {
    "bfloat16_lso": ("mixed_bfloat16", "lso"),
    "float16_lso_overflow": ("mixed_float16", "lso"),
    "float16_auto_scale_loss": ("mixed_float16", "auto"),
}
TOLERANCE = {  # rtol, atol of weights, atol of outputs
    "mixed_bfloat16": (1e-2, 1e-3, 1e-2),
    "mixed_float16": (1e-3, 1e-4, 1e-3),
}
X, Y, SW = make_data(37, seed=0)
XT, YT, _ = make_data(23, seed=2)


@pytest.fixture(autouse=True)
def float32_policy_after():
    """A leaked global policy would make every later model of the worker mixed."""
    yield
    keras.mixed_precision.set_global_policy("float32")


class ScaleRecorder(keras.callbacks.Callback):
    """The loss scale, its step counter and `iterations` after every batch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(scale_state(self.model.optimizer))


def scale_state(optimizer) -> tuple[float, int, int]:
    return (
        float(np.asarray(optimizer.dynamic_scale.value)),
        int(np.asarray(optimizer.step_counter.value)),
        int(np.asarray(optimizer.iterations.value)),
    )


def _optimizer(policy: str, kind: str):
    adam = keras.optimizers.Adam(1e-2)
    if kind == "auto":
        return adam
    initial = 2.0**18 if policy == "mixed_float16" else 2.0**15
    return keras.optimizers.LossScaleOptimizer(
        adam, initial_scale=initial, dynamic_growth_steps=2
    )


def build(strategy, run: str) -> keras.Model:
    """The model of `run` compiled under `strategy` (the policy is reset after)."""
    policy, kind = RUNS[run]
    weights = initial_weights(**MODEL)
    keras.mixed_precision.set_global_policy(policy)
    try:
        with strategy.scope():
            model = make_model(**MODEL)
            model.set_weights(weights)
            model.compile(
                optimizer=_optimizer(policy, kind),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def fit(model, epochs: int, *callbacks, initial_epoch: int = 0):
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


@functools.cache
def run(name: str, run: str):
    """fit (2 epochs), evaluate, predict: model, history, scales, results."""
    model = build(STRATEGIES[name](), run)
    recorder = ScaleRecorder()
    history = fit(model, 2, recorder)
    evaluated = model.evaluate(XT, YT, batch_size=10, verbose=0)
    predicted = model.predict(XT, batch_size=10, verbose=0)
    return model, history.history, recorder.seen, evaluated, predicted


def assert_matches_one_device(name: str, run_name: str) -> None:
    rtol, weights_atol, outputs_atol = TOLERANCE[RUNS[run_name][0]]
    model_1, history_1, seen_1, evaluated_1, predicted_1 = run("one_device", run_name)
    model, history, seen, evaluated, predicted = run(name, run_name)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert seen == seen_1  # The same scale, counter and iterations each batch.
    for key in history_1:
        np.testing.assert_allclose(history[key], history_1[key], rtol=rtol, err_msg=key)
    np.testing.assert_allclose(evaluated, evaluated_1, rtol=rtol, atol=outputs_atol)
    assert predicted.shape == (23, 3)
    assert predicted.dtype == predicted_1.dtype
    np.testing.assert_allclose(
        predicted.astype("float32"),
        predicted_1.astype("float32"),
        rtol=rtol,
        atol=outputs_atol,
    )
    for i, (a, b) in enumerate(
        zip(model.get_weights(), model_1.get_weights(), strict=True)
    ):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=weights_atol, err_msg=str(i))
    assert_same_scale_state(model_1.optimizer, model.optimizer)


def assert_same_scale_state(expected, actual) -> None:
    """dynamic_scale, step_counter and iterations: equal."""
    assert scale_state(actual) == scale_state(expected)
