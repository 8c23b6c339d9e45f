"""SIGKILL at random moments of a 2-process run that saves every step.

A chain of `KILL_TRIALS` trials (2 in CI, 20 with `KD_KILL_TRIALS=20`) on
one work directory: each launch of `kill_script.py` (2 processes x 4 CPU
devices) resumes from the newest committed backup, runs
until it has committed a newer one, and one of its processes (chosen at
random) is SIGKILLed a random 0-0.3 s later, in the middle of the next saves,
and the other one a random 0-0.3 s after it. After each kill the newest indexed
`.weights.h5` is never a temporary file and loads; the last launch runs to
the end, and its weights equal an uninterrupted 2-process run's that saved
nothing, bit for bit.
The one-process trials: tests/callbacks/test_backup_and_restore.py.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import KILL_TRIALS, committed_backup_step, make_model
from tests._processes import CLUSTER as HERE
from tests._processes import launch, process_env

pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.kill_trials]

SCRIPT = HERE / "kill_script.py"


def _start(workdir):
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2"]
    command += ["--devices-per-process", "4", str(SCRIPT), str(workdir)]
    environ = process_env(KD_STEP_SECONDS="0.05")
    return subprocess.Popen(
        command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _stop(launcher, workdir) -> None:
    """SIGKILLs the ranks this launcher started (the launcher then exits)."""
    for rank in (0, 1):
        path = workdir / f"pid_{rank}"
        if path.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(path.read_text()), signal.SIGKILL)
    if launcher.poll() is None:
        launcher.terminate()  # Forwarded to ranks not yet started.


def _kill_one_trial(workdir, draw: random.Random) -> int:
    """Launches, waits for a newer committed backup, SIGKILLs a random rank."""
    backup = workdir / "backup"
    before = committed_backup_step(backup)
    for rank in (0, 1):
        (workdir / f"pid_{rank}").unlink(missing_ok=True)
    launcher, killed = _start(workdir), False
    try:
        deadline = time.monotonic() + 180
        while committed_backup_step(backup) <= before or not all(
            (workdir / f"pid_{r}").exists() for r in (0, 1)
        ):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no newer backup within 180 s"
            time.sleep(0.01)
        time.sleep(draw.uniform(0.0, 0.3))  # A save every step: mid-save, often.
        victim = draw.randrange(2)
        os.kill(int((workdir / f"pid_{victim}").read_text()), signal.SIGKILL)
        killed = True
        # Its peer, stuck in a collective with the dead process, would wait
        # for the launcher's SIGKILL after a 10 s grace (test_launch.py tests
        # that): here it is SIGKILLed itself a random 0-0.3 s later, in the
        # middle of its own writes.
        time.sleep(draw.uniform(0.0, 0.3))
        with contextlib.suppress(ProcessLookupError):
            os.kill(int((workdir / f"pid_{1 - victim}").read_text()), signal.SIGKILL)
    finally:
        if not killed:  # A failed wait: end this test's run, leave no process.
            _stop(launcher, workdir)
        _, stderr = launcher.communicate(timeout=120)
    # The launcher exits with the status of the process it sees end first:
    # the killed one (137), or its peer, failing in a collective (1).
    assert launcher.returncode in (1, 128 + signal.SIGKILL), stderr[-3000:]
    return committed_backup_step(backup)


# 20 trials: ~22 launches of 2 processes, 250 s in CI's run, more than the
# default 600 s per test on a slower machine.
@pytest.mark.timeout(1800)
def test_random_kills_then_the_run_ends_bit_identical(tmp_path):
    (tmp_path / "reference").mkdir()
    # The reference saves nothing: the chain of kills and resumes must equal
    # a run that was never interrupted nor saved.
    environ = {"KD_STEP_SECONDS": "0", "KD_SAVE": "0"}
    reference = launch(SCRIPT, tmp_path / "reference", env=environ)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = json.loads((tmp_path / "reference" / "weights_0.json").read_text())

    workdir, draw, steps = tmp_path / "killed", random.Random(29), []
    workdir.mkdir()
    for _ in range(KILL_TRIALS):
        steps.append(_kill_one_trial(workdir, draw))
        latest = kd.callbacks.latest_checkpoint(workdir / "ckpts")
        assert latest is not None
        assert not os.path.basename(latest).startswith(".tmp-")
        make_model().load_weights(latest)  # Complete: it loads.
    assert steps == sorted(steps) and steps[-1] < 84, steps  # Killed before the end.

    final = launch(SCRIPT, workdir)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "BackupAndRestore: resuming at epoch" in final.stdout
    for rank in (0, 1):
        weights = json.loads((workdir / f"weights_{rank}.json").read_text())
        for got, want in zip(weights, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
