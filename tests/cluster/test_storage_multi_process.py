"""Where 2 real processes keep their backups: a bucket both reach, or a path
each sees on its own disk (started by hand, TF_CONFIG, one device each).

Two hosts that share no disk: each process in its own mount namespace,
with its own tmpfs mounted at the same path (as `/scratch` is a local disk
on many clusters), which is what a host's own disk is to the other host.
"""

import json
import shutil
import subprocess

import numpy as np
import pytest

import keras_dist as kd
from tests import _storage
from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
)
from tests._processes import CLUSTER, by_hand
from tests.callbacks._sidecar import XV, YV, evaluator_model

SCRIPT = CLUSTER / "storage_script.py"
pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _own_disk(path) -> tuple:
    """The command prefix that runs a process in its own mount namespace
    with a tmpfs of its own at `path`."""
    if shutil.which("unshare") is None:
        pytest.fail("util-linux's `unshare` is needed (a host's own disk)")
    mount = f'mount -t tmpfs keras_dist-host "{path}" && exec "$@"'
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh")


def test_a_backup_dir_on_each_hosts_own_disk_is_one_clear_error_on_every_process(
    tmp_path,
):
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    out.mkdir()
    probe = subprocess.run(
        [*_own_disk(scratch), "true"], capture_output=True, text=True, timeout=30
    )
    assert probe.returncode == 0, f"cannot mount a private tmpfs: {probe.stderr}"
    # Process 1 raises 3 s after process 0, whose end (it hosts JAX's
    # coordination service) must not abort process 1 before it reports.
    args = (out, scratch / "backup", scratch / "ckpts", 3)
    results = by_hand(SCRIPT, args=args, prefix=_own_disk(scratch), timeout=120)
    for rank, (status, stdout, stderr) in enumerate(results):
        # The user's path: the error uncaught, on every process (none
        # aborted by JAX when process 0, the coordination service, ends).
        assert status == 1, stdout[-2000:] + stderr[-3000:]
        assert "ProcessMismatchError: BackupAndRestore: `backup_dir`" in stderr
        error = json.loads((out / f"error_{rank}.json").read_text())
        assert error["type"] == "ProcessMismatchError"
        assert error["message"].startswith(
            "BackupAndRestore: `backup_dir` must be one folder every process "
            "sees, but process 1 (host "
        )
        assert f"wrote in {str(scratch / 'backup')!r}" in error["message"]
        assert "Put `backup_dir` on storage every host mounts" in error["message"]
        assert error["seconds"] < 60
    assert not list(scratch.iterdir())  # Nothing written on the shared view.


def test_two_processes_back_up_and_checkpoint_on_a_bucket(tmp_path):
    """Orbax's backup (both processes write, the chief commits) and the
    chief's Keras files on `gs://` (a real fake-gcs-server): the run equals
    one device's."""
    root = _storage.bucket("gs")
    args = (tmp_path, f"{root}/backup", f"{root}/ckpts")
    results = by_hand(SCRIPT, args=args, env=_storage.emulators(), timeout=180)
    for status, stdout, stderr in results:
        assert status == 0, stdout[-2000:] + stderr[-3000:]
    x, y, _ = make_data(40)
    reference = build_in_scope(kd.OneDeviceStrategy("cpu:0"), initial_weights())
    reference.fit(x, y, batch_size=8, epochs=3, verbose=0)
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(reference.get_weights(), weights)
    listed = _storage.listing(root)
    assert [p for p in listed if p.startswith("ckpts/")] == [
        "ckpts/checkpoint",
        *(f"ckpts/ckpt_{e}.weights.h5" for e in (1, 2, 3)),
        "ckpts/final.keras",
        "ckpts/final.weights.h5",
    ]
    for rank in (0, 1):  # `load_weights` and `load_model`: equal.
        assert json.loads((tmp_path / f"reloaded_{rank}.json").read_text()) == [
            True,
            True,
        ]
    # The newest 2 backups (epochs of 5 steps), each committed.
    assert {"backup/10/commit_success.txt", "backup/15/commit_success.txt"} <= set(
        listed
    )
    assert not [p for p in listed if p.startswith("backup/5/")]
    restored = build_in_scope(kd.OneDeviceStrategy("cpu:0"), initial_weights())
    kd.callbacks.load_checkpoint(restored, f"{root}/ckpts/ckpt_3.weights.h5")
    assert_weights_close(reference.get_weights(), restored.get_weights())
    # An evaluator job reads what the 2 processes' chief wrote on the
    # bucket, and stops at the index's `done`.
    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(),
        (XV, YV),
        f"{root}/ckpts",
        idle_timeout=30,
        poll_interval=0.05,
    )
    evaluator.start()
    names = [r["checkpoint"] for r in evaluator.history]
    assert names == [f"{root}/ckpts/ckpt_{e}.weights.h5" for e in (1, 2, 3)]
    expected = restored.evaluate(XV, YV, verbose=0, return_dict=True)
    for name, value in expected.items():
        np.testing.assert_allclose(
            evaluator.history[-1]["metrics"][name], value, rtol=1e-5
        )
