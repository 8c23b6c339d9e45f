"""Saves are numbered on the host: a save never reads the step counter.

Reading `optimizer.iterations` on the host waits for every step `fit` has
dispatched ahead of the devices. `BackupAndRestore` and `ModelCheckpoint`
read it once, when `fit` begins, and count the steps they see after that;
each save's number must still be the optimizer's step count in the state it
holds, in every execution mode and across a resume.
"""

import os

import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist._checkpoint import orbax_store
from keras_dist.callbacks import _backup_and_restore, _model_checkpoint
from tests._helpers import InterruptAt

MODES = {
    "default": {},
    "steps_per_execution": {"steps_per_execution": 3},
    "run_eagerly": {"run_eagerly": True},
    "no_jit": {"jit_compile": False},
}


def _data(n=40):
    rng = np.random.default_rng(0)
    return rng.random((n, 6), dtype=np.float32), rng.random((n, 1), dtype=np.float32)


def _model(strategy, **compile_kwargs):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(1)]
        )
        model.compile(optimizer="adam", loss="mse", **compile_kwargs)
    return model


@pytest.fixture
def recorded(monkeypatch):
    """Each Orbax write's number and the optimizer step count it holds, and
    how often the callbacks read the step counter."""
    seen = {"backups": [], "sharded": [], "reads": 0, "configs": 0}
    start = orbax_store.OrbaxStore.save

    def started(self, step, payload):
        # A backup's record holds where training stood; a sharded one's not.
        kind = "backups" if "meta" in payload[orbax_store.ORDER] else "sharded"
        (optimizer,) = payload["pytree"]["optimizer_variables"].values()
        seen[kind].append((step, int(np.asarray(optimizer["iteration"]))))
        return start(self, step, payload)

    def counted(original):
        def read(optimizer):
            seen["reads"] += 1
            return original(optimizer)

        return read

    files = _model_checkpoint.model_files

    def config(model):
        seen["configs"] += 1
        return files(model)

    monkeypatch.setattr(_model_checkpoint, "model_files", config)
    monkeypatch.setattr(orbax_store.OrbaxStore, "save", started)
    for module in (_backup_and_restore, _model_checkpoint):
        monkeypatch.setattr(module, "step_counter", counted(module.step_counter))
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_each_save_is_numbered_by_the_step_count_it_holds(tmp_path, recorded, mode):
    strategy = kd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    model = _model(strategy, **MODES[mode])
    x, y = _data()
    callbacks = [
        kd.callbacks.BackupAndRestore(
            tmp_path / "backup", save_freq=2, delete_checkpoint=False
        ),
        kd.callbacks.ModelCheckpoint(
            str(tmp_path / "sharded"), sharded=True, save_freq=2, max_to_keep=None
        ),
    ]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    assert int(np.asarray(model.optimizer.iterations)) == 10
    # Backups every 2 steps or more since the last, at an execution's end
    # (every 3 steps, then the epoch's last 2, with steps_per_execution), and
    # at each epoch's end; checkpoints as Keras's ModelCheckpoint counts
    # batches (an integer `save_freq` does not save at epoch ends).
    spe = mode == "steps_per_execution"
    backups = [3, 5, 8, 10] if spe else [2, 4, 5, 7, 9, 10]
    sharded = [3, 5, 8, 10] if spe else [2, 4, 6, 8, 10]
    assert [number for number, _ in recorded["backups"]] == backups
    assert [step for step, _ in recorded["sharded"]] == sharded
    for number, held in recorded["backups"] + recorded["sharded"]:
        assert number == held
    assert sorted(int(n) for n in os.listdir(tmp_path / "sharded")) == sharded
    # Once each, when `fit` began: never in a save. The same for Keras's
    # model JSON and assets of the sharded checkpoints (making them waits).
    assert recorded["reads"] == 2
    assert recorded["configs"] == 1


def test_numbers_go_on_from_a_resumed_backup(tmp_path, recorded):
    strategy = kd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    x, y = _data()
    backup = tmp_path / "backup"

    def fit(extra):
        model = _model(strategy)
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[
                kd.callbacks.BackupAndRestore(backup, save_freq=1),
                *extra,
            ],
        )
        return model

    with pytest.raises(RuntimeError, match="interrupted at step 7"):
        fit([InterruptAt(7)])  # Stops after the backup of step 7.
    assert recorded["backups"][-1] == (7, 7)
    recorded["backups"].clear()
    model = fit([])
    assert int(np.asarray(model.optimizer.iterations)) == 15
    numbers = [number for number, _ in recorded["backups"]]
    assert numbers == list(range(8, 16))  # 8..15, each its step count.
    assert all(number == held for number, held in recorded["backups"])
