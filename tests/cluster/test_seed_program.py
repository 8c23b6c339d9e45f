"""The seeds' Keras program (`examples/keras_tutorial.py`) on
`kd.MultiWorkerMirroredStrategy()`, the strategy line the only change.

2 processes x 2 devices (the same strategy at one device a process, 2 x
1: tests/cluster/test_multi_worker.py and the examples' runs): Keras's own
`TensorBoard`, keras_dist's `ModelCheckpoint`, `LearningRateScheduler` and
`PrintLR`, then `load_weights(latest_checkpoint)`, `model.save` and
`load_model` on every process. With Keras's own `BackupAndRestore` added, a
run whose process 1 is SIGKILLed resumes to the weights of one that was not.
"""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from tests._helpers import h5_datasets
from tests._processes import process_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.processes]
STRATEGY = "strategy = kd.MirroredStrategy()"


def program(folder: pathlib.Path, *, backup: bool = False) -> pathlib.Path:
    """The tutorial with its strategy line changed; with `backup`, Keras's
    `BackupAndRestore` added (and, for the test, a seed and the callback
    that kills process `KD_KILL_RANK`)."""
    text = (ROOT / "examples" / "keras_tutorial.py").read_text()
    assert text.count(STRATEGY) == 1
    text = text.replace(STRATEGY, "strategy = kd.MultiWorkerMirroredStrategy()")
    if backup:
        text = text.replace(
            "import keras_dist as kd\n",
            "import keras_dist as kd\nfrom tests.cluster._kill import kill_at_epoch\n"
            "keras.utils.set_random_seed(7)\n",
        )
        assert text.count("callbacks = [\n") == 1
        text = text.replace(
            "callbacks = [\n",
            'callbacks = [\n    keras.callbacks.BackupAndRestore("./backup"),\n'
            "    *kill_at_epoch(),\n",
        )
    path = folder / "keras_tutorial_multi_worker.py"
    path.write_text(text)
    return path


def run(script, workdir, *, devices: int, env=None, timeout=400):
    environ = process_env(env, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2"]
    command += ["--devices-per-process", str(devices), str(script)]
    command += ["--mock", "--epochs", "5", "--workdir", str(workdir)]
    return subprocess.run(
        command, env=environ, capture_output=True, text=True, timeout=timeout
    )


def _assert_it_ran(result, workdir, *, devices: int) -> None:
    """The tutorial's output on every process, the chief's files once."""
    out = result.stdout
    assert result.returncode == 0, out[-2000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}] Number of devices: {2 * devices}" in out
        # fit returned once the chief's checkpoints were all there.
        files = [f"ckpt_{e}.weights.h5" for e in range(1, 6)]
        assert f"[{rank}] {sorted(['checkpoint', *files])}" in out
    for epoch, rate in [(1, "0.001"), (3, "0.001"), (4, "1e-04"), (5, "1e-04")]:
        assert f"[0] Learning rate for epoch {epoch} is {rate}" in out
    evals = re.findall(r"^\[\d\] Eval loss: ([\d.]+), Eval [Aa]ccuracy", out, re.M)
    assert len(evals) == 6  # Checkpoint, loaded without and with the scope; x 2.
    np.testing.assert_allclose([float(e) for e in evals], float(evals[0]), rtol=1e-5)
    # The chief writes: one set of files, one TensorBoard run.
    names = sorted(os.listdir(workdir / "training_checkpoints"))
    assert names == sorted(["checkpoint", *files])
    assert (workdir / "my_model.keras").is_file()


def test_a_killed_run_resumes_from_keras_backup_and_restore(tmp_path):
    """2 x 2: the 256 mock examples are one global batch an epoch, so the
    run's numbers do not depend on the order tf.data shuffles them in, which
    a restarted program does not replay (with 2 batches an epoch, 2 x 1, the
    resumed epochs see other batches and end 1e-3 away, as on tf.keras)."""
    script = program(tmp_path, backup=True)
    reference = run(script, tmp_path / "reference", devices=2)
    _assert_it_ran(reference, tmp_path / "reference", devices=2)
    workdir = tmp_path / "killed"
    env = {"KD_KILL_RANK": "1", "KD_KILL_EPOCH": "2"}
    first = run(script, workdir, devices=2, env=env)
    assert first.returncode == 137, first.stdout[-2000:] + first.stderr[-3000:]
    assert "process 1 was killed by SIGKILL" in first.stderr
    assert (workdir / "killed").read_text() == "2"
    assert not (workdir / "my_model.keras").exists()
    second = run(script, workdir, devices=2, env=env)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    # Keras's BackupAndRestore resumes after the 2 epochs backed up.
    assert "[0] Epoch 1/5" not in second.stdout
    assert "[0] Epoch 3/5" in second.stdout
    final = "training_checkpoints/ckpt_5.weights.h5"
    expected = h5_datasets(tmp_path / "reference" / final)
    got = h5_datasets(workdir / final)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
