"""Lost workers, restarts and mismatched processes, with real 2-process clusters."""

import json
import time

import pytest

import keras_dist as kd
from tests._helpers import assert_weights_close
from tests.cluster import _workload
from tests.cluster.test_multi_worker import HERE, launch

pytestmark = pytest.mark.slow


def test_a_killed_worker_stops_the_cluster_and_a_restart_resumes(tmp_path):
    # Rank 1 SIGKILLs itself after 11 of 21 steps (backups every 3 steps).
    env = {"KD_KILL_RANK": "1", "KD_KILL_AT": "11"}
    first = launch(HERE / "fault_script.py", tmp_path, env=env)
    ended = time.time()
    killed_at = float((tmp_path / "killed").read_text())
    assert first.returncode == 137, first.stderr[-3000:]
    assert "keras-dist-run: process 1 was killed by SIGKILL; stopping the other 1." in (
        first.stderr
    )
    assert ended - killed_at < 30
    assert not (tmp_path / "weights_0.json").exists()

    # The same command again: resumes from the last backup (step 3 of epoch 2).
    second = launch(HERE / "fault_script.py", tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[0] BackupAndRestore: resuming at epoch 2, step 3" in second.stdout
    expected = _workload.backup_run(
        kd.OneDeviceStrategy("cpu:0"), str(tmp_path / "reference")
    )
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(expected, weights)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (
            "batch",
            "The processes called `model.fit` differently (process 0: "
            "batch_size=32; process 1: batch_size=16)",
        ),
        (
            "model",
            "The processes create different variables (process 0: "
            "'sequential/dense/kernel' of shape (6, 16) and dtype float32; "
            "process 1: 'sequential/dense/kernel' of shape (6, 32)",
        ),
    ],
)
def test_processes_that_disagree_fail_fast_with_a_clear_error(kind, message):
    start = time.monotonic()
    result = launch(HERE / "mismatch_script.py", env={"KD_MISMATCH": kind}, devices=2)
    assert result.returncode == 1, result.stderr[-3000:]
    assert message in result.stderr
    assert "no error" not in result.stdout
    assert time.monotonic() - start < 90
