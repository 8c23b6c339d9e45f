"""SIGTERM to one of 2 real processes: both save at the same run and exit."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests._helpers import assert_weights_close, mirrored
from tests.cluster.test_multi_worker import HERE, launch
from tests.failure_handling import _loop

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _launch_and_preempt_rank_1(workdir, *, after: str, timeout=120):
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2"]
    command += ["--devices-per-process", "2", str(HERE / "preemption_script.py")]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KD_", "XLA_"))}
    environ.update(TF_CPP_MIN_LOG_LEVEL="3", KD_STEP_SECONDS="0.2")
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
    code, out, err = _launch_and_preempt_rank_1(tmp_path, after="[1] run 4")
    assert code == 42, out[-2000:] + err[-3000:]
    saved = re.findall(r"\[(\d)\] rank \d saved at run (\d+)", out)
    assert sorted(rank for rank, _ in saved) == ["0", "1"], out[-2000:]
    runs = {int(run) for _, run in saved}
    assert len(runs) == 1, saved  # The same run on both processes.
    (run,) = runs
    assert 4 <= run < _loop.STEPS
    assert not (tmp_path / "weights_0.json").exists()

    goodput = tmp_path / "goodput.json"
    again = launch(
        HERE / "preemption_script.py", tmp_path, devices=2, timeout=120,
        flags=("--goodput", str(goodput)),
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[0] rank 0 starts at run {run}" in again.stdout
    assert f"[1] rank 1 starts at run {run}" in again.stdout
    # A custom loop's goodput: its `handler.run` calls are the steps, from
    # the restored run on.
    report = json.loads(goodput.read_text())
    assert report["attempts"] == [
        {"failed": False, "steps": _loop.STEPS - run, "lost_steps": 0}
    ]
    assert report["seconds"]["productive"] > 0
    assert "keras-dist-run: goodput " in again.stderr
    expected = _loop.train(mirrored(4))
    for rank in (0, 1):
        weights = json.loads((tmp_path / f"weights_{rank}.json").read_text())
        assert_weights_close(expected, weights)
