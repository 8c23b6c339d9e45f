"""BackupAndRestore interrupted by an exception and resumed in one process.

Inputs read `steps_per_epoch` steps an epoch: a fit on a repeated tf.data
pipeline (tf's multi-worker tutorial), on an infinite generator or on a
finite tf.data read in several epochs, interrupted mid-epoch and run again
with the same backup directory, replays its input by steps (never waiting
for the end of an endless pass) and ends bit-identical to an uninterrupted
fit. Here the interruption is an exception inside the process; the kill of
a real process and its restart are tested with the finite pipeline in
test_backup_and_restore.py (plain Keras, one process) and
tests/cluster/test_faults.py (2 processes; the replay code is the same for
all three inputs).

A backup written by another model is refused with the shapes that differ.
"""

import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests._helpers import InterruptAt, mirrored, resume_model

ROWS, BATCH, STEPS_PER_EPOCH, EPOCHS = 61, 8, 5, 4
INTERRUPT_AT = 7  # Mid-epoch 2: its step 2.


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 6).astype("float32")
    return x, (x @ rng.randn(6, 3)).argmax(1).astype("int32")


def _input(kind):
    if kind == "numpy":
        x, y = _data()
        return {"x": x, "y": y, "batch_size": BATCH}
    x, y = _data()
    if kind in ("repeat", "finite-spe"):
        shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=3)
        if kind == "finite-spe":  # 8 batches, 3 an epoch: Keras keeps one iterator.
            return {"x": shuffled.batch(BATCH), "steps_per_epoch": 3}
        return {"x": shuffled.batch(BATCH).repeat(), "steps_per_epoch": STEPS_PER_EPOCH}

    def endless():
        draw = np.random.RandomState(5)
        while True:
            rows = draw.randint(0, ROWS, size=BATCH)
            yield x[rows], y[rows]

    return {"x": endless(), "steps_per_epoch": STEPS_PER_EPOCH}


def _fit(kind, callbacks, width=16):
    keras.utils.set_random_seed(42)
    with mirrored(8).scope():
        model = resume_model(width)
    history = model.fit(epochs=EPOCHS, verbose=0, callbacks=callbacks, **_input(kind))
    return model, history.history


# A finite tf.data read `steps_per_epoch` steps an epoch (the dataset's one
# iterator kept across epochs, as Keras does): step 7 is mid-epoch 3 of 3-step
# epochs of an 8-batch dataset, in the dataset's second pass.
@pytest.mark.parametrize(
    "kind, resumed_at",
    [("repeat", "epoch 2, step 2"), ("generator", "epoch 2, step 2"),
     ("finite-spe", "epoch 3, step 1")],
)  # fmt: skip
def test_an_interrupted_fit_resumes_bit_exact(tmp_path, capsys, kind, resumed_at):
    backup = tmp_path / "backup"
    expected, expected_history = _fit(kind, [])
    with pytest.raises(RuntimeError, match=f"interrupted at step {INTERRUPT_AT}"):
        _fit(
            kind,
            [kd.callbacks.BackupAndRestore(backup, save_freq=1),
             InterruptAt(INTERRUPT_AT)],
        )  # fmt: skip
    resumed, history = _fit(kind, [kd.callbacks.BackupAndRestore(backup)])
    assert f"resuming at {resumed_at}" in capsys.readouterr().out
    for a, b in zip(expected.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)  # Bit-identical.
    assert history["loss"][-1] == expected_history["loss"][-1]
    assert not backup.exists()  # Deleted once the fit completed.


@pytest.mark.parametrize("shard_variables", [False, True], ids=["mirrored", "fsdp"])
def test_an_interrupted_fit_resumes_from_the_local_tier(
    tmp_path, capsys, shard_variables
):
    # Backups at each epoch's end (8 steps), the local tier every 2 steps:
    # interrupted at step 7, the local save of step 6 is the newest.
    def fit(callbacks):
        keras.utils.set_random_seed(42)
        strategy = kd.MirroredStrategy(
            [f"cpu:{i}" for i in range(8)], shard_variables=shard_variables
        )
        with strategy.scope():
            model = resume_model(16)
        model.fit(epochs=EPOCHS, verbose=0, callbacks=callbacks, **_input("numpy"))
        return model

    def backup():
        return kd.callbacks.BackupAndRestore(
            tmp_path / "backup", local_dir=tmp_path / "local", local_save_freq=2
        )

    expected = fit([])
    with pytest.raises(RuntimeError, match=f"interrupted at step {INTERRUPT_AT}"):
        fit([backup(), InterruptAt(INTERRUPT_AT)])
    assert sorted(p.name for p in (tmp_path / "local" / "process_0").iterdir()) == [
        "4",
        "6",
    ]  # The newest 2.
    resumed = fit([backup()])
    assert (
        "resuming at epoch 1, step 6 (the local tier's step 6, every process its "
        "own; backup of 8 replicas)" in capsys.readouterr().out
    )
    for a, b in zip(expected.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)  # Bit-identical.
    assert not any((tmp_path / "local").rglob("*/*"))  # Deleted at the end.


def test_a_backup_of_another_model_is_refused(tmp_path):
    backup = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted at step 5"):
        _fit(
            "numpy",
            [kd.callbacks.BackupAndRestore(backup, save_freq=1), InterruptAt(5)],
        )
    # (Keras numbers the names of a process's second model.)
    with pytest.raises(
        kd.errors.IncompatibleBackupError,
        match=r"variable '[\w/]*dense[\w]*/kernel' has shape \(6, 32\) but the "
        r"backup's '[\w/]*dense[\w]*/kernel' has shape \(6, 16\)\. Resume with",
    ):
        _fit("numpy", [kd.callbacks.BackupAndRestore(backup)], width=32)


def _built(shard_variables=False, devices=8):
    strategy = kd.MirroredStrategy(
        [f"cpu:{i}" for i in range(devices)], shard_variables=shard_variables
    )
    with strategy.scope():
        model = resume_model(16)
    model.optimizer.build(model.trainable_variables)
    return model


def _trained(shard_variables=False):
    model = _built(shard_variables)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert int(np.asarray(model.optimizer.iterations.value)) > 0
    return model


def _assert_same_state(expected, got):
    state = [*expected.variables, *expected.optimizer.variables]
    restored = [*got.variables, *got.optimizer.variables]
    for a, b in zip(state, restored, strict=True):
        np.testing.assert_array_equal(np.asarray(b.value), np.asarray(a.value))


def _write_orbax_pytree_backup(directory, model, number, meta):
    """A backup as keras_dist 0.1.0 wrote it with several processes: Orbax's
    v0 PyTree item `state` beside `meta`."""
    import orbax.checkpoint as ocp

    groups = {
        "trainable": model.trainable_variables,
        "non_trainable": model.non_trainable_variables,
        "optimizer": model.optimizer.variables,
        "metrics": model.metrics_variables,
    }
    manager = ocp.CheckpointManager(
        str(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False, create=True
        ),
        item_handlers={
            "state": ocp.PyTreeCheckpointHandler(use_compression=False),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    state = {name: [v.value for v in vs] for name, vs in groups.items()}
    manager.save(
        number,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)
        ),
    )
    manager.close()


def _store(directory, async_save=False):
    from keras_dist._checkpoint.pipeline import OrbaxSaves

    return OrbaxSaves(
        str(directory),
        owner="BackupAndRestore",
        what="backup",
        async_save=async_save,
        max_to_keep=2,
    )


@pytest.mark.parametrize("written_by", ["orbax_v0_state", "raw_arrays"])
def test_a_backup_of_keras_dist_0_1_is_refused_naming_its_format(tmp_path, written_by):
    """keras_dist 0.1.0's backups (several processes: Orbax's v0 `state`
    item; one process: its own raw-arrays format) are refused before
    training, naming the format and what to do; the backup is kept."""
    if written_by == "orbax_v0_state":
        _write_orbax_pytree_backup(tmp_path, _trained(), 7, {"epoch": 1})
    else:
        (tmp_path / "7" / "arrays").mkdir(parents=True)
        (tmp_path / "7" / "arrays" / "index.json").write_text(
            '{"format": "keras_dist.raw_arrays/1", "groups": {}}'
        )
    with pytest.raises(
        kd.errors.IncompatibleBackupError,
        match=r"a format of keras_dist 0\.1 .*keras_dist\.raw_arrays/1.*since 0\.2\.0 "
        r"it writes keras_dist\.orbax/2 .*delete the directory",
    ):
        _store(tmp_path)
    assert (tmp_path / "7").is_dir()


def test_a_backup_of_another_format_is_refused_naming_who_wrote_it(tmp_path):
    """Each backup records its format and the keras_dist that wrote it; a
    format this keras_dist does not read (a newer one) is refused, named."""
    store = _store(tmp_path)
    store.save(_trained(), 3, meta={"epoch": 1})
    store.close()
    records = [p for p in (tmp_path / "3" / "keras_dist").rglob("*") if p.is_file()]
    (record,) = [p for p in records if b'"paths"' in p.read_bytes()]
    saved = json.loads(record.read_text())
    assert saved["format"] == "keras_dist.orbax/2"
    assert saved["written_by"] == f"keras_dist {kd.__version__}"
    saved.update(format="keras_dist.orbax/3", written_by="keras_dist 0.9.0")
    record.write_text(json.dumps(saved))
    with pytest.raises(
        kd.errors.IncompatibleBackupError,
        match=r"in the format keras_dist\.orbax/3, written by keras_dist 0\.9\.0; "
        rf"this keras_dist {re.escape(kd.__version__)} reads keras_dist\.orbax/2\.",
    ):
        _store(tmp_path).store.restore(_built(False, 8))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("shard_variables", [False, True], ids=["mirrored", "fsdp"])
def test_one_process_backups_restore_onto_any_layout(
    tmp_path, shard_variables, async_save
):
    """A backup is Orbax's, in Keras's `OrbaxCheckpoint` layout (each
    process writes the parts it holds); it restores onto 8 devices split or
    replicated, 4 devices, 1 device, bit-exact."""
    written = _trained(shard_variables)
    store = _store(tmp_path, async_save)
    store.save(written, 3, meta={"epoch": 1})
    store.close()
    assert (tmp_path / "3" / "pytree").is_dir()
    for target, devices in [(False, 8), (True, 8), (True, 4), (False, 1)]:
        restored = _built(target, devices)
        store = _store(tmp_path)
        meta = store.store.restore(restored)
        store.close()
        assert meta["epoch"] == 1
        _assert_same_state(written, restored)
        kernel = restored.trainable_variables[0].value
        assert len(kernel.sharding.device_set) == devices


def test_a_torn_backup_is_skipped_for_the_previous_one(tmp_path):
    first = _trained()
    store = _store(tmp_path)
    store.save(first, 1, meta={"epoch": 1})
    x, y = _data()
    first.fit(x, y, batch_size=8, epochs=1, verbose=0)
    store.save(first, 2, meta={"epoch": 2})
    store.close()
    data = max(
        (f for f in (tmp_path / "2" / "pytree").rglob("*") if f.is_file()),
        key=lambda f: f.stat().st_size,
    )
    data.write_bytes(data.read_bytes()[:100])  # Torn after its commit.
    restored = _built()
    store = _store(tmp_path)
    with pytest.warns(UserWarning, match="the backup of step 2 .* cannot be read"):
        assert store.store.restore(restored)["epoch"] == 1
    store.close()
    assert not np.array_equal(
        np.asarray(restored.trainable_variables[0].value),
        np.asarray(first.trainable_variables[0].value),
    )
