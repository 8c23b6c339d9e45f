"""Leftovers of interrupted runs: temporary files, partial backups, a torn index."""

import os
import time

import keras
import pytest

import keras_dist as kd
from keras_dist._checkpoint.keras_files import remove_stale_temps
from tests._helpers import make_data, mirrored, small_model

X, Y, _ = make_data(16)


def _fit(model, *callbacks):
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=list(callbacks))


def _old_file(path, text="partial"):
    path.write_text(text)
    then = time.time() - 3600
    os.utime(path, (then, then))
    return path


def test_model_checkpoint_removes_stale_temps_of_its_own_naming(tmp_path):
    stale = _old_file(tmp_path / ".tmp-0123456789ab-ckpt_1.weights.h5")
    stale_index = _old_file(tmp_path / ".tmp-00000000abcd-checkpoint")
    others = [
        _old_file(tmp_path / ".tmp-notours-ckpt.weights.h5"),  # Not our pattern.
        _old_file(tmp_path / "notes.txt"),
        _old_file(tmp_path / ".tmp-0123456789AB-upper.weights.h5"),
    ]
    fresh = tmp_path / ".tmp-fedcba987654-inflight.weights.h5"
    fresh.write_text("being written by this process")  # Newer than the process.
    model = small_model(mirrored(2))
    callback = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt_{epoch}.weights.h5"), save_weights_only=True
    )
    _fit(model, callback)
    assert not stale.exists() and not stale_index.exists()
    assert all(path.exists() for path in others) and fresh.exists()
    assert (tmp_path / "ckpt_1.weights.h5").exists()
    assert remove_stale_temps(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("index", ["{not json", '["a list"]', '{"latest": 3}', ""])
def test_a_corrupt_index_warns_and_falls_back_to_the_newest_file(tmp_path, index):
    for epoch, age in ((1, 20), (2, 10)):
        path = tmp_path / f"ckpt_{epoch}.weights.h5"
        path.write_text("w")
        os.utime(path, (time.time() - age, time.time() - age))
    (tmp_path / "checkpoint").write_text(index)
    with pytest.warns(UserWarning, match="checkpoint index .* cannot be read"):
        latest = kd.callbacks.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "ckpt_2.weights.h5")


def test_an_interrupted_orbax_backup_is_removed_at_the_next_start(tmp_path):
    backup = tmp_path / "backup"
    partial = backup / "7.orbax-checkpoint-tmp-1700000000000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "shard").write_bytes(b"\0" * 1024)
    seen = []

    class Look(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # After the first backup.
            seen.append(sorted(os.listdir(backup)))

    model = small_model(mirrored(2))
    # Synchronous: `Look` lists the folder right after the save.
    _fit(model, kd.callbacks.BackupAndRestore(str(backup), async_save=False), Look())
    assert not partial.exists()
    assert seen == [["2"]]  # The new backup (after 2 steps) only.
