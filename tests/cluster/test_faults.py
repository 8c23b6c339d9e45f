"""Lost workers, restarts and mismatched processes, with real 2-process clusters."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import keras_dist as kd
from tests._helpers import assert_weights_close
from tests._processes import CLUSTER as HERE
from tests._processes import by_hand, launch, process_env
from tests.cluster import _workload

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def test_a_killed_worker_stops_the_cluster_and_a_restart_resumes(tmp_path):
    # Rank 1 SIGKILLs itself after 11 of 21 steps (backups every 3 steps).
    env = {"KD_KILL_RANK": "1", "KD_KILL_AT": "11"}
    first = launch(HERE / "fault_script.py", tmp_path, env=env)
    ended = time.time()
    killed_at = float((tmp_path / "killed").read_text())
    assert first.returncode == 137, first.stderr[-3000:]
    stopped = re.search(
        r"keras-dist-run: process 1 was killed by SIGKILL at step (\d+); "
        r"stopping the other 1\.",
        first.stderr,
    )
    # The step the survivor waits in (it may have begun step 12).
    assert stopped and 9 <= int(stopped[1]) <= 12, first.stderr[-3000:]
    # Without --max-restarts the cause is also the launcher's last word.
    assert first.stderr.strip().splitlines()[-1] == (
        f"keras-dist-run: process 1 was killed by SIGKILL at step {stopped[1]}; "
        "exiting with status 137."
    )
    assert ended - killed_at < 30
    assert not (tmp_path / "weights_0.json").exists()

    # The same command again resumes from the last backup (step 3 of epoch 2);
    # SIGTERM to the launcher after step 13 is a preemption: all processes
    # agree on a step, back up there and exit.
    slow = {**env, "KD_STEP_SECONDS": "0.25"}
    second = _preempt(HERE / "fault_script.py", tmp_path, slow, after="[0] step 13")
    assert second.returncode == 128 + signal.SIGTERM, second.stderr[-3000:]
    assert "[0] BackupAndRestore: resuming at epoch 2, step 3" in second.stdout
    saved = re.search(
        r"\[0\] BackupAndRestore: preempted \(SIGTERM\); "
        r"saved at epoch (\d), step (\d)",
        second.stdout,
    )
    assert saved, second.stdout[-3000:]

    # Once more: resumes after the preemption and finishes.
    third = launch(HERE / "fault_script.py", tmp_path, env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    epoch, step = int(saved[1]), int(saved[2])  # Epochs from 1; steps done in it.
    if step == 7:  # The end of an epoch resumes at the next one.
        epoch, step = epoch + 1, 0
    assert f"[0] BackupAndRestore: resuming at epoch {epoch}, step {step}" in (
        third.stdout
    )
    expected = _workload.backup_run(
        kd.OneDeviceStrategy("cpu:0"), str(tmp_path / "reference")
    )
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(expected, weights)


# The endless inputs ("repeat", "generator") are replayed by the same code
# with one process (tests/callbacks/test_backup_and_restore.py, killed and
# restarted too); here the input Keras keeps across epochs, on 2 processes.
# 2 x 1: one device a process, as most GPU clusters run (2 x 4 resumes
# mid-epoch in the test above and in tests/cluster/test_kill_trials.py).
@pytest.mark.parametrize("devices", [1])
@pytest.mark.parametrize("kind", ["finite-spe"])
def test_a_restart_with_steps_per_epoch_resumes_exactly(tmp_path, kind, devices):
    """Rank 1 is killed mid-epoch 2 (step 7 of 5-step epochs; with
    "finite-spe" mid-epoch 3, in the dataset's second pass); the restart
    replays by steps (never waiting for the end of an endless input) and ends
    with the weights of an uninterrupted one-device run."""
    env = {"KD_KILL_RANK": "1", "KD_KILL_AT": "7", "KD_INPUT": kind}
    first = launch(HERE / "fault_script.py", tmp_path, env=env, devices=devices)
    assert first.returncode == 137, first.stderr[-3000:]
    second = launch(HERE / "fault_script.py", tmp_path, env=env, devices=devices)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[0] BackupAndRestore: resuming at epoch" in second.stdout
    expected = _workload.backup_run(
        kd.OneDeviceStrategy("cpu:0"), str(tmp_path / "reference"), kind=kind
    )
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(expected, weights)


def _preempt(script, workdir, env, *, after: str, timeout=300):
    """Runs the launcher and sends it SIGTERM once a line `after` is printed."""
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2"]
    command += ["--devices-per-process", "4", str(script), str(workdir)]
    environ = process_env(env)
    process = subprocess.Popen(
        command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            if line.strip() == after:
                process.send_signal(signal.SIGTERM)
        stderr = process.stderr.read()
        process.wait()
    finally:
        timer.cancel()
    return subprocess.CompletedProcess(
        command, process.returncode, "".join(lines), stderr
    )


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
    assert f"ProcessMismatchError: {message}" in result.stderr
    assert "no error" not in result.stdout
    assert time.monotonic() - start < 90


def test_a_process_that_loses_a_peer_exits_with_the_restart_code(tmp_path):
    """As a scheduler starts them (TF_CONFIG, no launcher; one device a
    process): process 1 is SIGKILLed between two sums; process 0's next sum
    fails and it exits with `kd.cluster.RESTART_EXIT_CODE` (75: restart the
    group), not 1 (its own error: `test_launch.py`), within seconds."""
    (chief, _, said), (peer, _, peers) = by_hand(
        HERE / "psum_script.py", env={"KD_LOOP_KILL_RANK": "1"}, timeout=180
    )
    assert peer == -signal.SIGKILL, peers[-2000:]
    assert chief == kd.cluster.RESTART_EXIT_CODE == 75, said[-3000:]
    assert "Gloo all-reduce failed" in said  # The error, shown as raised.


def test_a_frozen_peer_is_named_by_the_other_without_a_launcher(tmp_path):
    """As a scheduler starts them (TF_CONFIG, no launcher): process 1
    SIGSTOPs itself after step 5. Process 0, blocked in the next step's sum,
    names it from the heartbeat the processes keep in JAX's key-value store
    - process, host, step, seconds silent: the launcher's line - and exits
    75 (restart the job) after `$KERAS_DIST_HEARTBEAT_TIMEOUT` (5 s here),
    not aborted by JAX's coordination service (SIGABRT, a C++ stack)."""
    started = time.monotonic()
    (chief, _, said), _ = by_hand(
        HERE / "fault_script.py",
        args=[tmp_path],
        env={
            "KD_KILL_RANK": "1",
            "KD_KILL_AT": "5",
            "KD_FAULT": "stop",
            "KERAS_DIST_HEARTBEAT_TIMEOUT": "5",
        },
        timeout=180,
        wait_for=(0,),
    )
    assert chief == kd.cluster.RESTART_EXIT_CODE, said[-3000:]
    line = re.search(
        r"keras_dist: process 1 \((\S+)\) stopped answering at step ([0-9]+) "
        r"\(no heartbeat for ([0-9]+) s\); this process \(process 0\) exits 75",
        said,
    )
    assert line, said[-3000:]
    assert line[1] == socket.gethostname()
    assert 5 <= int(line[2]) <= 6 and 5 <= int(line[3]) <= 7
    assert "Terminating process" not in said and "Check failure" not in said
    assert time.monotonic() - started < 120


def test_a_peers_own_error_ends_every_process_with_status_1(tmp_path):
    """Process 1 raises a ValueError at step 5 (a bug): it exits 1, and so
    does process 0, which only lost it (not 75: a scheduler reading the
    highest status of the job's tasks must not retry a bug), naming it."""
    (chief, _, said), (peer, _, peers) = by_hand(
        HERE / "fault_script.py",
        args=[tmp_path],
        env={"KD_KILL_RANK": "1", "KD_KILL_AT": "5", "KD_FAULT": "raise"},
        timeout=180,
    )
    assert peer == 1 and "ValueError: a bad batch at step 5" in peers, peers[-3000:]
    assert chief == 1, said[-3000:]
    assert "Terminating process" not in said
