"""The loss-scale state survives checkpoints: ModelCheckpoint and BackupAndRestore.

mixed_float16 with a LossScaleOptimizer that overflows at first (the scale
starts at 2**18): after epoch 1 the scale was halved 3 times and grown
again. A `.keras` file or `.weights.h5` of that moment, loaded under the same
strategy, gives an optimizer with the same `dynamic_scale`, `step_counter`
and `iterations`, and training continued from it ends where the
uninterrupted run does (equal bits). BackupAndRestore: a `fit` stopped
mid-epoch (after a skipped step) resumes with the scale state of the backup
and ends where the uninterrupted run does.
"""

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests.strategies._mixed_precision import (
    STRATEGIES,
    ScaleRecorder,
    assert_same_scale_state,
    build,
    fit,
    float32_policy_after,  # noqa: F401 (autouse fixture)
    run,
    scale_state,
)

RUN = "float16_lso_overflow"


def _assert_equal_weights(expected, actual):
    for i, (e, a) in enumerate(
        zip(expected.get_weights(), actual.get_weights(), strict=True)
    ):
        np.testing.assert_array_equal(a, e, err_msg=f"weight {i}")


@pytest.mark.parametrize("name", ["mirrored", "parameter_server"])
def test_model_checkpoint_round_trips_the_loss_scale(tmp_path, name):
    model = build(STRATEGIES[name](), RUN)
    recorder = ScaleRecorder()
    fit(
        model,
        1,
        recorder,
        keras.callbacks.ModelCheckpoint(str(tmp_path / "keras_{epoch}.keras")),
        kd.callbacks.ModelCheckpoint(
            tmp_path / "kd_{epoch}.weights.h5", save_weights_only=True
        ),
    )
    after_epoch_1 = scale_state(model.optimizer)
    assert after_epoch_1 == recorder.seen[-1]
    assert after_epoch_1[0] != 2.0**18 and after_epoch_1[2] > 0  # Moved on.
    with STRATEGIES[name]().scope():
        loaded = keras.saving.load_model(tmp_path / "keras_1.keras")
    weights_only = build(STRATEGIES[name](), RUN)
    weights_only.optimizer.build(weights_only.trainable_variables)
    weights_only.load_weights(tmp_path / "kd_1.weights.h5")
    expected, _, seen, _, _ = run(name, RUN)
    for restored in (loaded, weights_only):
        assert isinstance(restored.optimizer, keras.optimizers.LossScaleOptimizer)
        assert restored.layers[0].compute_dtype == "float16"
        assert_same_scale_state(model.optimizer, restored.optimizer)
        _assert_equal_weights(model, restored)
        recorder = ScaleRecorder()
        fit(restored, 2, recorder, initial_epoch=1)
        assert recorder.seen == seen[4:]  # Epoch 2's scales, batch by batch.
        assert_same_scale_state(expected.optimizer, restored.optimizer)
        _assert_equal_weights(expected, restored)


class _Interrupt(keras.callbacks.Callback):
    """Raises after `at` batches of the `fit` (as a crash would, mid-epoch),
    once the callbacks before it handled batch `at`'s end: at the next
    batch's begin (where keras_dist's checkpoint callbacks handle it)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.batches = at, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.batches == self.at:
            raise RuntimeError(f"interrupted after {self.at} batches")
        self.batches += 1


@pytest.mark.parametrize("name", ["fsdp", "zero1"])
def test_backup_and_restore_resumes_the_loss_scale(tmp_path, capsys, name):
    """Stopped after batch 7 of 8 (epoch 2, step 3), then resumed.

    Batch 7 overflows: skipped, `iterations` stays 3 as after batch 6. The
    backups are numbered by the steps run, counted on the host (1..7, so a
    save never reads the step counter), not by the applied steps the inner
    optimizer counts; the resumed run must start from batch 7's halved
    scale, the newest backup.
    """
    backup = kd.callbacks.BackupAndRestore(tmp_path / "b", save_freq=1)
    interrupted = build(STRATEGIES[name](), RUN)
    with pytest.raises(RuntimeError, match="interrupted after 7 batches"):
        fit(interrupted, 2, backup, _Interrupt(7))
    at_backup = scale_state(interrupted.optimizer)
    # Numbered by the steps run, 1..7: the newest two are kept.
    assert sorted(int(d.name) for d in (tmp_path / "b").iterdir()) == [6, 7]
    resumed = build(STRATEGIES[name](), RUN)
    recorder = ScaleRecorder()
    history = fit(resumed, 2, kd.callbacks.BackupAndRestore(tmp_path / "b"), recorder)
    assert "resuming at epoch 2, step 3 (backup of" in capsys.readouterr().out
    expected, expected_history, seen, _, _ = run(name, RUN)
    assert seen[5][2] == seen[6][2]  # Batch 7 was skipped...
    assert seen[6] == at_backup != seen[5]  # ... and halved the scale.
    assert recorder.seen == seen[7:]  # The last batch.
    assert_same_scale_state(expected.optimizer, resumed.optimizer)
    _assert_equal_weights(expected, resumed)
    assert history.history["loss"] == expected_history["loss"][1:]
