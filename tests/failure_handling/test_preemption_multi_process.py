"""SIGTERM to one of 2 real processes: both save at the same run and exit."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests import _storage
from tests._helpers import assert_weights_close, mirrored
from tests._processes import CLUSTER as HERE
from tests._processes import launch, process_env
from tests.failure_handling import _loop

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _launch_and_preempt_rank_1(workdir, *, after: str, timeout=120, env=None):
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2"]
    command += ["--devices-per-process", "2", str(HERE / "preemption_script.py")]
    environ = process_env({"KD_STEP_SECONDS": "0.2", **(env or {})})
    process = subprocess.Popen(
        [*command, str(workdir)],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.strip() == after:  # Only rank 1 is told.
                pid = int((workdir / "pid_1").read_text())
                os.kill(pid, signal.SIGTERM)
        stderr = process.stderr.read()
        process.wait()
    finally:
        timer.cancel()
    return process.returncode, "".join(lines), stderr


def test_sigterm_to_one_process_saves_both_at_one_run_and_resumes(tmp_path):
    """Both processes save on a bucket (`gs://`, a real fake-gcs-server: the
    handler's `checkpoint_dir`, and the launcher's `--goodput` report)."""
    root = _storage.bucket("gs")
    env = {**_storage.emulators(), "KD_CHECKPOINT_DIR": f"{root}/ckpt"}
    code, out, err = _launch_and_preempt_rank_1(tmp_path, after="[1] run 4", env=env)
    assert code == 42, out[-2000:] + err[-3000:]
    saved = re.findall(r"\[(\d)\] rank \d saved at run (\d+)", out)
    assert sorted(rank for rank, _ in saved) == ["0", "1"], out[-2000:]
    runs = {int(run) for _, run in saved}
    assert len(runs) == 1, saved  # The same run on both processes.
    (run,) = runs
    assert 4 <= run < _loop.STEPS
    assert not (tmp_path / "weights_0.json").exists()
    assert f"ckpt/{run}/commit_success.txt" in _storage.listing(root)
    assert not (tmp_path / "ckpt").exists()  # Nothing local.

    # Steps long enough for the heartbeat (four times a second) to see them.
    again = launch(
        HERE / "preemption_script.py", tmp_path, devices=2, timeout=120,
        flags=("--goodput", f"{root}/goodput.json"),
        env={**env, "KD_STEP_SECONDS": "0.2"},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[0] rank 0 starts at run {run}" in again.stdout
    assert f"[1] rank 1 starts at run {run}" in again.stdout
    # A custom loop's goodput: its `handler.run` calls are the steps, from
    # the restored run on.
    report = json.loads(_storage.read(f"{root}/goodput.json"))
    assert report["attempts"] == [
        {"failed": False, "steps": _loop.STEPS - run, "lost_steps": 0}
    ]
    assert report["seconds"]["productive"] > 0
    assert "keras-dist-run: goodput " in again.stderr
    expected = _loop.train(mirrored(4))
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(expected, weights)


def test_a_killed_process_resumes_the_custom_loop_from_the_local_tier(tmp_path):
    # A local tier every 2 runs; process 1 SIGKILLed during run 8, once the
    # local save of run 6 is on both processes' storage (that of run 8 is
    # not made yet): no preemption notice, no persistent checkpoint. The
    # launcher restarts both; the handlers restore run 6, every process its
    # own parts, and finish with the weights of an uninterrupted loop.
    env = {"KD_LOCAL": "2", "KD_KILL_RANK": "1", "KD_KILL_RUN": "8"}
    result = launch(
        HERE / "preemption_script.py", tmp_path, devices=2, timeout=180, env=env,
        flags=("--max-restarts", "1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "process 1 was killed by SIGKILL" in result.stderr
    assert "[0] rank 0 starts at run 6" in result.stdout, result.stdout[-3000:]
    assert "[1] rank 1 starts at run 6" in result.stdout
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    expected = _loop.train(mirrored(4))
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(expected, weights)
