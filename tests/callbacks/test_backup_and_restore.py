"""BackupAndRestore: a run killed at any step, restarted, equals an uninterrupted one.

Each run is a real separate process (tests/callbacks/resume_script.py):
shuffled NumPy data, Dropout, a partial last batch, validation_split, 8
replicas; killed with SIGKILL or SIGTERM at a chosen global step.
"""

import json
import os
import pathlib
import random
import subprocess
import sys
import time

import numpy as np
import pytest

import keras_dist as kd
from tests import _helpers, _storage
from tests._xla import xla_flags

SCRIPT = pathlib.Path(__file__).with_name("resume_script.py")
pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _run(out_dir, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KD_")}
    environ["XLA_FLAGS"] = xla_flags()  # The script adds its devices.
    environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    environ.update({k: str(v) for k, v in env.items()})
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _result(out_dir):
    weights = np.load(os.path.join(out_dir, "weights.npz"))
    history = json.loads(pathlib.Path(out_dir, "history.json").read_text())
    return [
        weights[k] for k in sorted(weights, key=lambda k: int(k.split("_")[1]))
    ], history


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = _run(out)
    assert result.returncode == 0, result.stderr[-3000:]
    return _result(out)


def _assert_same(reference, out_dir, epochs_resumed, rtol=0.0, atol=0.0):
    ref_weights, ref_history = reference
    weights, history = _result(out_dir)
    for a, b in zip(ref_weights, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol)
    for key, values in history.items():
        np.testing.assert_allclose(
            values,
            ref_history[key][-epochs_resumed:],
            rtol=max(rtol, 1e-7),
            err_msg=key,
        )


def test_sigterm_saves_and_exits_cleanly(reference, tmp_path):
    backup = tmp_path / "backup"
    preempted = _run(
        tmp_path / "out",
        KD_BACKUP=backup,
        KD_KILL_AT=9,
        KD_SIGNAL="TERM",
        KD_SAVE_FREQ="epoch",
    )
    assert preempted.returncode == 0, preempted.stderr[-3000:]
    # SIGTERM arrives after step 9 was handled: saved at the next boundary, 10.
    assert "preempted (SIGTERM); saved at epoch 2, step 3" in preempted.stdout
    assert "DONE" not in preempted.stdout
    resumed = _run(tmp_path / "out", KD_BACKUP=backup, KD_SAVE_FREQ="epoch")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at epoch 2, step 3" in resumed.stdout
    _assert_same(reference, tmp_path / "out", 3)


# 54 training rows / batch 8 = 7 steps per epoch: step 14 ends epoch 2 (the
# boundary case). Mid-epoch resumes after a kill: the other tests here, and
# with 2 processes tests/cluster/test_faults.py.
def test_sigkill_then_a_restart_past_a_torn_backup_is_exact(reference, tmp_path):
    """SIGKILLed after step 15 (backups every step, the newest 2 kept), the
    newest backup torn: the restart says so, resumes from step 14 (the start
    of epoch 3) and ends equal to an uninterrupted run; the backups are
    deleted at the end (`delete_checkpoint=True`)."""
    backup = tmp_path / "backup"
    killed = _run(tmp_path / "out", KD_BACKUP=backup, KD_KILL_AT=15, KD_SIGNAL="KILL")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "out" / "weights.npz").exists()
    assert sorted(os.listdir(backup)) == ["14", "15"]
    for root, _, files in os.walk(backup / "15"):
        for name in files:  # Tear every file of the newest backup.
            path = pathlib.Path(root, name)
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])
    resumed = _run(tmp_path / "out", KD_BACKUP=backup)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "backup of step 15" in resumed.stderr
        and "trying the previous one" in resumed.stderr
    )
    assert "resuming at epoch 3, step 0" in resumed.stdout
    _assert_same(reference, tmp_path / "out", 2)
    assert not backup.exists()


def test_sigkill_then_a_restart_from_a_bucket_is_exact(reference, tmp_path):
    """The backup on `gs://` (a real fake-gcs-server, `tests/_storage.py`):
    SIGKILLed after step 10 (backups every step), the restart resumes from
    the bucket and ends bit for bit as an uninterrupted run; nothing is
    left in the bucket (`delete_checkpoint=True`)."""
    backup = f"{_storage.bucket('gs')}/backup"
    killed = _run(tmp_path / "out", KD_BACKUP=backup, KD_KILL_AT=10, KD_SIGNAL="KILL")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert {p.split("/")[0] for p in _storage.listing(backup)} == {"9", "10"}
    resumed = _run(tmp_path / "out", KD_BACKUP=backup)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at epoch 2, step 3" in resumed.stdout
    _assert_same(reference, tmp_path / "out", 3)
    assert _storage.listing(backup) == []


def test_resume_on_another_number_of_replicas(reference, tmp_path):
    backup = tmp_path / "backup"
    assert (
        _run(
            tmp_path / "out", KD_BACKUP=backup, KD_KILL_AT=10, KD_SIGNAL="KILL"
        ).returncode
        == -9
    )
    resumed = _run(tmp_path / "out", KD_BACKUP=backup, KD_REPLICAS=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(backup of 8 replicas)" in resumed.stdout
    _assert_same(reference, tmp_path / "out", 3, rtol=1e-5, atol=1e-6)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="Received: save_freq=0"):
        kd.callbacks.BackupAndRestore(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match="Received: save_freq='batch'"):
        kd.callbacks.BackupAndRestore(tmp_path, save_freq="batch")
    with pytest.raises(ValueError, match="Received: backup_dir=''"):
        kd.callbacks.BackupAndRestore("")
    with pytest.raises(ValueError, match="Received: local_save_freq=0"):
        kd.callbacks.BackupAndRestore(
            tmp_path, local_dir=tmp_path / "l", local_save_freq=0
        )
    with pytest.raises(ValueError, match="`local_dir` must be another directory"):
        kd.callbacks.BackupAndRestore(tmp_path / "b", local_dir=tmp_path / "b")
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(PermissionError, match="Received: backup_dir="):
        kd.callbacks.BackupAndRestore(blocked / "backup")


# A finite tf.data read `steps_per_epoch` steps an epoch (the dataset's one
# iterator kept across epochs, as Keras does): the restart replays by steps
# and lands on the batches an uninterrupted run trains on. Step 7 is mid-epoch
# 3 of 3-step epochs of an 8-batch dataset, in the dataset's second pass.
# Here under plain Keras (keras_dist's callback, no strategy); under a
# strategy the same replay is interrupted in one process
# (test_backup_and_restore_in_process.py, bit-identical; endless inputs too)
# and a process of 2 is killed (tests/cluster/test_faults.py).
def test_kill_and_restart_with_steps_per_epoch_is_exact(tmp_path):
    env = {"KD_INPUT": "finite-spe", "KD_PLAIN": "1"}
    reference_run = _run(tmp_path / "reference", **env)
    assert reference_run.returncode == 0, reference_run.stderr[-3000:]
    backup = tmp_path / "backup"
    killed = _run(
        tmp_path / "out", **env, KD_BACKUP=backup, KD_KILL_AT=7, KD_SIGNAL="KILL"
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _run(tmp_path / "out", **env, KD_BACKUP=backup)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at epoch" in resumed.stdout
    ref_weights, _ = _result(tmp_path / "reference")
    weights, _ = _result(tmp_path / "out")
    for a, b in zip(ref_weights, weights, strict=True):
        np.testing.assert_array_equal(b, a)  # Bit-identical.


def test_a_one_shot_generator_is_refused_before_training(tmp_path):
    """Read to its end in epoch 0, it cannot be replayed for a later epoch."""
    backup = tmp_path / "backup"
    killed = _run(
        tmp_path / "out", KD_INPUT="one-shot", KD_BACKUP=backup, KD_KILL_AT=9,
        KD_SIGNAL="KILL",
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _run(tmp_path / "out", KD_INPUT="one-shot", KD_BACKUP=backup)
    assert resumed.returncode != 0
    assert "IncompatibleBackupError" in resumed.stderr
    assert "Python generator" in resumed.stderr
    assert "steps_per_epoch" in resumed.stderr
    assert "Received: x of type generator" in resumed.stderr
    assert backup.exists()  # The backup is kept for a fixed program.
    assert not (tmp_path / "out" / "weights.npz").exists()


_FAILING_FIT = """
import os, signal, sys, tempfile
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np
import keras_dist as kd

import contextlib
plain = sys.argv[1] == "plain"
scope = contextlib.nullcontext() if plain else kd.MirroredStrategy().scope()
with scope:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")

class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("boom")

try:
    model.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=8, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(tempfile.mkdtemp()), Fail()])
except RuntimeError:
    print("FIT RAISED", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("STILL ALIVE", flush=True)
"""


@pytest.mark.parametrize("plain", ["plain", "mirrored"])
def test_sigterm_after_a_failed_fit_terminates_the_process(plain):
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environ["XLA_FLAGS"] = xla_flags()  # The script adds its devices.
    result = subprocess.run(
        [sys.executable, "-c", _FAILING_FIT, plain],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "FIT RAISED" in result.stdout, result.stderr[-3000:]
    assert "STILL ALIVE" not in result.stdout
    assert result.returncode == -15


# 20 trials: 22 runs of one process, 124 s alone on 2 cores (20 separate
# trials, each a killed run and a whole resumed one: 284 s).
@pytest.mark.kill_trials
@pytest.mark.timeout(1200)
def test_random_kills_during_async_saves_then_the_run_ends_bit_identical(
    tmp_path,
):
    """`KILL_TRIALS` SIGKILLs (2 in CI) at random moments while asynchronous
    saves run (every step: BackupAndRestore and ModelCheckpoint files),
    chained on one run: each launch resumes from the newest committed
    backup, commits a newer one and is killed a random 0-0.3 s later. After
    each kill the newest indexed checkpoint file is never a temporary one and
    loads; the last launch runs to the end and equals an uninterrupted run
    bit for bit (every resume of the chain exact)."""
    epochs = {"KD_EPOCHS": 12}  # 84 steps: up to 20 kills, a few steps apart.
    reference_run = _run(tmp_path / "reference", **epochs)
    assert reference_run.returncode == 0, reference_run.stderr[-3000:]
    backup, ckpts, out = tmp_path / "backup", tmp_path / "ckpts", tmp_path / "out"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KD_")}
    environ["XLA_FLAGS"] = xla_flags()  # The script adds its devices.
    environ.update(
        TF_CPP_MIN_LOG_LEVEL="3", KD_BACKUP=str(backup), KD_ASYNC="1",
        KD_MC=str(ckpts), KD_EPOCHS="12", KD_STEP_SECONDS="0.05",
    )  # fmt: skip
    draw, steps = random.Random(29), []
    for _ in range(_helpers.KILL_TRIALS):
        before = _helpers.committed_backup_step(backup)
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(out)], env=environ,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while _helpers.committed_backup_step(backup) <= before:
                assert process.poll() is None, process.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "no newer backup within 240 s"
                time.sleep(0.01)
            time.sleep(draw.uniform(0.0, 0.3))  # A save every step: mid-save, often.
            process.kill()
        finally:
            process.communicate(timeout=60)
        assert process.returncode == -9, "the run ended before the kill"
        steps.append(_helpers.committed_backup_step(backup))
        latest = kd.callbacks.latest_checkpoint(ckpts)
        if latest is None:  # Only if the first file was still being written.
            assert len(steps) == 1, steps
            continue
        # Never a temporary file of an interrupted write; complete: it loads.
        assert not os.path.basename(latest).startswith(".tmp-")
        _helpers.resume_model().load_weights(latest)
    assert steps == sorted(steps) and steps[-1] < 84, steps  # Killed before the end.
    resumed = _run(out, KD_BACKUP=backup, KD_ASYNC=1, **epochs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # From the newest committed backup (7 steps an epoch), never a torn one.
    epoch, step = divmod(steps[-1], 7)
    assert f"resuming at epoch {epoch + 1}, step {step}" in resumed.stdout
    _assert_same(_result(tmp_path / "reference"), out, 12 - epoch)
    assert not backup.exists()  # delete_checkpoint=True after completion.


def test_a_background_write_failure_raises_on_the_training_thread(tmp_path):
    script = SCRIPT.with_name("async_failure_script.py")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KD_")}
    environ["XLA_FLAGS"] = xla_flags()  # The script adds its devices.
    environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "backup")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    raised = next(x for x in lines if x.startswith("raised "))
    assert raised.startswith("raised CheckpointWriteError: BackupAndRestore:")
    assert (
        f"writing the backup of step 6 to {tmp_path / 'backup' / '6'} failed" in raised
    )
    assert "File too large" in raised or "EFBIG" in raised or "too large" in raised
    assert f"The previous backup in {tmp_path / 'backup'} is intact." in raised
    assert lines[-1] == "restored step 4: weights equal the model's at step 4: True"
