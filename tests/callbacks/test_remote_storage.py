"""Checkpoints on a bucket: `gs://` against a real fake-gcs-server, `s3://`
against moto's S3 server, through the real clients (gcsfs, s3fs,
tensorstore), one process; started by `tests/_storage.py`.

Each test also lists its working directory (a temporary one): a URL is
never written as a local folder, and the local temporary files of the
uploads and downloads are gone afterwards. A SIGKILLed run resumed from a
bucket: `test_backup_and_restore.py`; 2 processes on a bucket:
`tests/cluster/test_saving_multi_process.py`.
"""

import json
import os
import sys
import tempfile

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests import _storage
from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    initial_weights,
    mirrored,
)
from tests.callbacks._sidecar import XV, YV, X, Y, evaluator_model
from tests.failure_handling import _loop

SCHEMES = ["gs", "s3"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The test's working directory; after it, nothing there (no `gs:` or
    `s3:` folder), and nothing left of the uploads' and downloads' local
    files in the temporary directory (this test's own)."""
    work, scratch = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    scratch.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    yield work
    assert sorted(os.listdir(work)) == []
    assert sorted(os.listdir(scratch)) == []


def _fit(strategy, callbacks, epochs=3) -> keras.Model:
    model = build_in_scope(strategy, initial_weights())
    model.fit(X, Y, batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_checkpoint_keeps_indexes_and_loads_from_a_bucket(scheme, workdir):
    root = _storage.bucket(scheme)
    checkpoint = kd.callbacks.ModelCheckpoint(
        f"{root}/run/ckpt_{{epoch}}", save_weights_only=True, max_to_keep=2
    )
    model = _fit(mirrored(4), [checkpoint])
    # The keep policy deleted epoch 1's file; the index names the rest.
    assert _storage.listing(root) == [
        "run/checkpoint",
        "run/ckpt_2.weights.h5",
        "run/ckpt_3.weights.h5",
    ]
    index = json.loads(_storage.read(f"{root}/run/checkpoint"))
    assert index["all"] == ["ckpt_2.weights.h5", "ckpt_3.weights.h5"]
    assert index["epochs"] == {"ckpt_2.weights.h5": 1, "ckpt_3.weights.h5": 2}
    latest = kd.callbacks.latest_checkpoint(f"{root}/run")
    assert latest == f"{root}/run/ckpt_3.weights.h5"
    restored = build_in_scope(mirrored(4), initial_weights())
    kd.callbacks.load_checkpoint(restored, latest)
    assert_weights_close(model.get_weights(), restored.get_weights(), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["weights", "model"])
def test_save_and_load_under_a_strategy_on_a_bucket(scheme, kind, workdir):
    """`model.save_weights`/`model.save` and `load_weights`/`load_model`,
    Keras's own calls, under a strategy: the file Keras writes, uploaded
    whole; read from a local copy."""
    root = _storage.bucket(scheme)
    strategy = mirrored(4)
    model = _fit(strategy, [], epochs=1)
    if kind == "weights":
        model.save_weights(f"{root}/w.weights.h5")
        loaded = build_in_scope(strategy, initial_weights())
        loaded.load_weights(f"{root}/w.weights.h5")
        expected = ["w.weights.h5"]
    else:
        model.save(f"{root}/m.keras")
        with strategy.scope():
            loaded = keras.saving.load_model(f"{root}/m.keras")
        expected = ["m.keras"]
        assert loaded.optimizer.iterations.numpy() == model.optimizer.iterations.numpy()
    assert _storage.listing(root) == expected
    assert_weights_close(model.get_weights(), loaded.get_weights(), rtol=0, atol=0)
    np.testing.assert_array_equal(
        loaded.predict(XV, verbose=0), model.predict(XV, verbose=0)
    )


class _StopAfterEpoch2(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt


def _interrupted(root: str) -> None:
    """Keras's own `ModelCheckpoint` and `BackupAndRestore` in `root`, under
    a strategy: `fit` stopped after its second epoch."""
    checkpoint = keras.callbacks.ModelCheckpoint(
        f"{root}/ckpts/ckpt_{{epoch}}.weights.h5", save_weights_only=True
    )
    backup = keras.callbacks.BackupAndRestore(f"{root}/backup")
    with pytest.raises(KeyboardInterrupt):
        _fit(mirrored(4), [checkpoint, backup, _StopAfterEpoch2()])


def _resumed(root: str) -> keras.Model:
    return _fit(mirrored(4), [keras.callbacks.BackupAndRestore(f"{root}/backup")])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_keras_own_callbacks_write_a_bucket_under_a_strategy(scheme, workdir, tmp_path):
    """`keras.callbacks.ModelCheckpoint` and `keras.callbacks.BackupAndRestore`
    (Keras's, whose file calls go to TensorFlow's gfile): under a strategy,
    on the bucket through keras_dist's path layer; the resumed `fit` ends as
    the same callbacks' on a local disk, bit for bit."""
    root = _storage.bucket(scheme)
    on_disk = str(tmp_path / "disk")
    _interrupted(on_disk)
    on_disk_resumed = _resumed(on_disk)
    _interrupted(root)
    assert _storage.listing(root) == [
        "backup/latest.weights.h5",
        "backup/training_metadata.json",
        "ckpts/ckpt_1.weights.h5",
        "ckpts/ckpt_2.weights.h5",
    ]
    metadata = json.loads(_storage.read(f"{root}/backup/training_metadata.json"))
    assert metadata == {"epoch": 2, "batch": 0}  # Resume at the third epoch.
    resumed = _resumed(root)
    assert_weights_close(
        on_disk_resumed.get_weights(), resumed.get_weights(), rtol=0, atol=0
    )
    assert _storage.listing(root) == [  # Keras's `delete_checkpoint=True`.
        "ckpts/ckpt_1.weights.h5",
        "ckpts/ckpt_2.weights.h5",
    ]
    from_disk, from_bucket = (
        build_in_scope(mirrored(4), initial_weights()) for _ in range(2)
    )
    from_disk.load_weights(f"{on_disk}/ckpts/ckpt_2.weights.h5")
    from_bucket.load_weights(f"{root}/ckpts/ckpt_2.weights.h5")
    assert_weights_close(
        from_disk.get_weights(), from_bucket.get_weights(), rtol=0, atol=0
    )


def test_backup_and_restore_on_gs_resumes_where_it_stopped(workdir):
    """Orbax writes the backup on `gs://` itself (tensorstore), a step
    committed by its `commit_success.txt`; an interrupted `fit` resumes from
    it and ends with the uninterrupted run's weights."""
    root = _storage.bucket("gs")
    uninterrupted = _fit(mirrored(4), [], epochs=3).get_weights()

    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    backup = f"{root}/backup"
    with pytest.raises(KeyboardInterrupt):
        _fit(mirrored(4), [kd.callbacks.BackupAndRestore(backup), Stop()])
    # The newest 2 kept (2 epochs of 6 steps), each committed.
    assert {p.split("/")[0] for p in _storage.listing(backup)} == {"6", "12"}
    assert {"6/commit_success.txt", "12/commit_success.txt"} <= set(
        _storage.listing(backup)
    )
    resumed = _fit(mirrored(4), [kd.callbacks.BackupAndRestore(backup)])
    assert_weights_close(uninterrupted, resumed.get_weights())
    assert _storage.listing(root) == []  # `delete_checkpoint=True`.


def test_sharded_model_checkpoint_on_gs_loads_onto_another_mesh(workdir):
    root = _storage.bucket("gs")
    checkpoint = kd.callbacks.ModelCheckpoint(f"{root}/sharded", sharded=True)
    model = _fit(kd.MirroredStrategy(), [checkpoint], epochs=2)
    assert kd.callbacks.latest_checkpoint(f"{root}/sharded") == f"{root}/sharded"
    restored = build_in_scope(mirrored(2), initial_weights())
    kd.callbacks.load_checkpoint(restored, f"{root}/sharded")
    assert_weights_close(model.get_weights(), restored.get_weights(), rtol=0, atol=0)


def test_sidecar_evaluator_reads_the_checkpoints_of_a_bucket(workdir):
    root = _storage.bucket("gs")
    checkpoint = kd.callbacks.ModelCheckpoint(
        f"{root}/ckpt_{{epoch}}", save_weights_only=True
    )
    _fit(mirrored(4), [checkpoint])
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(), (XV, YV), root, idle_timeout=30, poll_interval=0.05
    )
    evaluator.start()  # Stops on the index's `done`.
    names = [r["checkpoint"] for r in evaluator.history]
    assert names == [f"{root}/ckpt_{e}.weights.h5" for e in (1, 2, 3)]
    for record in evaluator.history:
        local = evaluator_model()
        kd.callbacks.load_checkpoint(local, record["checkpoint"])
        expected = local.evaluate(XV, YV, verbose=0, return_dict=True)
        for name, value in expected.items():
            np.testing.assert_allclose(record["metrics"][name], value, rtol=1e-6)
    best = min(evaluator.history, key=lambda r: r["metrics"]["loss"])
    assert {"best/best.json", "best/best.weights.h5"} <= set(_storage.listing(root))
    summary = json.loads(_storage.read(f"{root}/best/best.json"))
    assert summary["checkpoint"] == best["checkpoint"]
    kept, source = evaluator_model(), evaluator_model()
    kd.callbacks.load_checkpoint(kept, f"{root}/best/best.weights.h5")
    kd.callbacks.load_checkpoint(source, best["checkpoint"])
    assert_weights_close(source.get_weights(), kept.get_weights(), rtol=0, atol=0)


def test_preemption_handler_saves_to_gs_and_a_restart_resumes_exactly(workdir):
    root = _storage.bucket("gs")
    uninterrupted = _loop.train(mirrored(4))
    with pytest.raises(SystemExit):
        _loop.train(mirrored(4), _loop.handler_in(f"{root}/preempt"), kill_at=5)
    resumed_at = []

    def make(model):
        handler = _loop.handler_in(f"{root}/preempt")(model)
        resumed_at.append(handler.total_run_calls)
        return handler

    weights = _loop.train(mirrored(4), make)
    assert resumed_at == [5]
    assert_weights_close(uninterrupted, weights)


def test_urls_it_does_not_write_are_refused_at_construction(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _storage.emulators()
    with pytest.raises(
        ValueError,
        match=r"`filepath` names `az://` storage.*"
        r"Received: filepath='az://c/ckpt.keras'",
    ):
        kd.callbacks.ModelCheckpoint("az://c/ckpt.keras")
    with pytest.raises(ValueError, match=r"`backup_dir` names `hdfs://` storage"):
        kd.callbacks.BackupAndRestore("hdfs://namenode/backup")
    # Orbax has no S3 store: refused, naming what works.
    with pytest.raises(
        ValueError,
        match=r"`backup_dir` is an `s3://` URL, where "
        r"Orbax.*has no store.*Use `gs://`",
    ):
        kd.callbacks.BackupAndRestore(f"{_storage.bucket('s3')}/backup")
    with pytest.raises(ValueError, match=r"`filepath` is an `s3://` URL"):
        kd.callbacks.ModelCheckpoint("s3://b/sharded", sharded=True)
    with pytest.raises(ValueError, match=r"`checkpoint_dir` is an `s3://` URL"):
        kd.PreemptionCheckpointHandler(None, keras.Sequential(), "s3://b/p")
    # Each host's own tier is never a URL.
    with pytest.raises(ValueError, match=r"`local_dir` is each host's own storage"):
        kd.callbacks.BackupAndRestore(
            f"{_storage.bucket('gs')}/b", local_dir="gs://b/local"
        )
    # A client library that is not installed: named, with the extra.
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(
        ValueError,
        match=r"served by the `s3fs` package, which is "
        r"not installed.*`pip install s3fs`",
    ):
        kd.callbacks.ModelCheckpoint("s3://b/ckpt.weights.h5", save_weights_only=True)
    assert os.listdir(tmp_path) == []


def test_a_bucket_that_does_not_exist_is_refused_before_training(workdir):
    _storage.emulators()
    with pytest.raises(
        PermissionError,
        match=r"`filepath` must be in a writable "
        r"directory.*gs://kd-no-such-bucket",
    ):
        kd.callbacks.ModelCheckpoint(
            "gs://kd-no-such-bucket/ckpt.weights.h5", save_weights_only=True
        )


def test_the_checkpoints_guide_example_writes_to_a_bucket(workdir, capsys):
    """The "Where checkpoints go" block, its bucket the emulator's."""
    from tests._docs import ROOT, python_blocks

    guide = ROOT / "docs" / "guides" / "checkpoints.md"
    block = next(b for b in python_blocks(guide) if "gs://my-bucket" in b)
    root = _storage.bucket("gs")
    exec(block.replace("gs://my-bucket", root), {})
    assert capsys.readouterr().out.strip() == f"{root}/run1/ckpt_3.weights.h5"
    assert _storage.listing(root) == [
        "run1/checkpoint",
        "run1/ckpt_2.weights.h5",
        "run1/ckpt_3.weights.h5",
        "run1/final.keras",
    ]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc: Linux"
)
def test_the_gcs_emulator_ends_with_the_process_that_started_it(tmp_path):
    """A test process killed (an xdist worker at the end of a starved run)
    skips `atexit`: its fake-gcs-server must end all the same, not run on
    after CI (it did: CI10, CI13)."""
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "start.py"
    script.write_text(
        f"import os, sys\nsys.path.insert(0, {root!r})\nfrom tests import _storage\n"
        "print(_storage._fake_gcs_server(), flush=True)\nos._exit(0)\n"
    )
    parent = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert parent.returncode == 0, parent.stderr[-2000:]
    url = parent.stdout.split()[-1]

    def running() -> bool:
        """A live process serving `url` (this process's own server has
        another)."""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().split(b"\0")
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if url.encode() in command and state != "Z":
                return True
        return False

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running():
        time.sleep(0.1)
    assert not running(), f"the fake-gcs-server at {url} still runs"
