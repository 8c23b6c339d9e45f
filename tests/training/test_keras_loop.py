"""Keras's per-step loop without no-op work (`_seams/_trainer.py`).

Under a strategy, batch-callback dispatches that no callback overrides are
skipped, and the state between steps is stored without Keras's tracking
proxies. What users see must not change: every hook a callback overrides
(also the legacy `on_batch_begin/end` aliases, and validation's test hooks
inside `fit`) gets Keras's calls with Keras's batch numbers and logs, and a
callback that reads the weights mid-epoch reads the step's weights. Without
a strategy Keras's loop is untouched.
"""

import keras
import numpy as np
import pytest
from keras.src.callbacks.callback_list import CallbackList
from keras.src.utils.tracking import TrackedDict

from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
    mirrored,
)

ROWS, BATCH = 40, 8  # 5 steps an epoch.
HOOKS = (
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_batch_begin",
    "on_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


def _model(strategy):
    weights = initial_weights()
    if strategy is not None:
        return build_in_scope(strategy, weights)
    model = compile_model(make_model())
    model.set_weights(weights)
    return model


def _run(model, callbacks, kinds=("train", "test", "predict")):
    """The calls whose loops dispatch the hooks of `kinds`, with `callbacks`.

    "test" hooks run in `evaluate` and in `fit`'s validation.
    """
    x, y, _ = make_data(ROWS)
    if "train" in kinds or "test" in kinds:
        validation = (x[:16], y[:16]) if "test" in kinds else None
        model.fit(
            x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
            validation_data=validation, callbacks=callbacks,
        )  # fmt: skip
    if "test" in kinds:
        model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=callbacks)
    if "predict" in kinds:
        model.predict(x, batch_size=BATCH, verbose=0, callbacks=callbacks)


def _recorder(hook: str) -> keras.callbacks.Callback:
    """A callback that overrides only `hook` and records its calls."""

    def record(self, batch, logs=None):
        logs = dict(logs or {})
        if "outputs" in logs:
            logs["outputs"] = np.asarray(logs["outputs"])
        self.calls.append((batch, logs))

    callback = type(f"Record_{hook}", (keras.callbacks.Callback,), {hook: record})()
    callback.calls = []
    return callback


@pytest.mark.parametrize("hook", HOOKS)
def test_an_overridden_hook_gets_keras_calls(hook):
    calls = {}
    for name, strategy in (("keras", None), ("mirrored", mirrored(8))):
        recorder = _recorder(hook)
        kind = "predict" if "predict" in hook else "test" if "test" in hook else "train"
        _run(_model(strategy), [recorder], kinds=(kind,))
        calls[name] = recorder.calls
    expected, actual = calls["keras"], calls["mirrored"]
    assert expected
    assert [b for b, _ in actual] == [b for b, _ in expected]
    for (_, want), (_, got) in zip(expected, actual, strict=True):
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


def _count_dispatches(monkeypatch) -> dict[str, int]:
    """Counts the calls of Keras's own batch-end workers (sync or async)."""
    counts = dict.fromkeys(("train", "test", "predict"), 0)
    for kind in counts:
        name = f"_on_{kind}_batch_end"
        original = getattr(CallbackList, name)

        def counting(self, batch, logs=None, kind=kind, original=original):
            counts[kind] += 1
            return original(self, batch, logs)

        monkeypatch.setattr(CallbackList, name, counting)
    return counts


@pytest.mark.parametrize("strategy", [None, "mirrored"])
def test_no_op_batch_hooks_are_dispatched_only_without_a_strategy(
    monkeypatch, strategy
):
    counts = _count_dispatches(monkeypatch)
    _run(_model(mirrored(8) if strategy else None), [keras.callbacks.History()])
    if strategy is None:  # Keras: 2 x 5 train steps, 2 x 2 validation + 5 test.
        assert counts == {"train": 10, "test": 9, "predict": 5}
    else:
        assert counts == {"train": 0, "test": 0, "predict": 0}


def test_a_progress_bar_still_gets_every_step(monkeypatch, capsys):
    counts = _count_dispatches(monkeypatch)
    x, y, _ = make_data(ROWS)
    _model(mirrored(8)).fit(x, y, batch_size=BATCH, epochs=1, verbose=1)
    assert counts["train"] == 5
    assert "5/5" in capsys.readouterr().out


class _ReadsState(keras.callbacks.Callback):
    """At batch 2 of epoch 1: the stored state's type and the weights."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 2:
            self.state_type = type(self.model._jax_state)
            self.weights = self.model.get_weights()  # Syncs the state.


def test_state_between_steps_is_untracked_and_syncs():
    x, y, _ = make_data(ROWS)
    read = {}
    for name, strategy in (("keras", None), ("mirrored", mirrored(8))):
        reader = _ReadsState()
        model = _model(strategy)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[reader])  # fmt: skip
        read[name] = reader
    assert read["keras"].state_type is TrackedDict  # Keras's own, unchanged.
    assert read["mirrored"].state_type is dict
    assert_weights_close(read["keras"].weights, read["mirrored"].weights)
