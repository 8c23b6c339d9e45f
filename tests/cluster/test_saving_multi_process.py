"""Saves every process calls, and saves only the chief calls, over 2 processes.

`model.save_weights`, `model.save` and `keras.saving.save_model` three times
in a row on every process (2 x 2 replicated, 2 x 1 with FSDP and ZeRO-1
state split across the processes), Keras's own `ModelCheckpoint` and
`BackupAndRestore` in `fit`; and `if strategy.is_chief: model.save(...)` /
`model.predict(...)`, which end in an error naming process 1 at once.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tests._helpers import h5_datasets
from tests._processes import process_env

HERE = pathlib.Path(__file__).parent
pytestmark = [pytest.mark.slow, pytest.mark.processes]


def launch(workdir, mode, strategy, *, devices, timeout=300):
    environ = process_env()
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2"]
    command += ["--devices-per-process", str(devices)]
    command += [str(HERE / "saving_script.py"), str(workdir), mode, strategy]
    return subprocess.run(
        command, env=environ, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "strategy, devices", [("mirrored", 2), ("fsdp", 1), ("zero1", 1)]
)
def test_every_process_saves_once_and_finds_the_file_complete(
    tmp_path, strategy, devices
):
    result = launch(tmp_path, "every", strategy, devices=devices)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    first, second = (
        json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)
    )
    for got in (first, second):
        # Right after each call returned, on each process: there, loadable,
        # equal to the model (weights and optimizer state).
        assert got["saved"] == {key: [True] * 3 for key in first["saved"]}
    assert first["loss"] == second["loss"] and len(first["loss"]) == 3
    # Keras's OrbaxCheckpoint: every process takes part, Orbax commits.
    assert first["orbax"] == second["orbax"] != []
    for step in first["orbax"]:
        assert (tmp_path / "orbax" / step / "commit_success.txt").is_file()
    assert first["weights"] == second["weights"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "final.weights.h5",
        "final_model.keras",
        "final_save_model.keras",
        "keras_backup",
        "keras_ckpt",
        "orbax",
        "result_0.json",
        "result_1.json",
    ]
    # Keras's own callbacks: one file set, no temporary files left.
    assert sorted(os.listdir(tmp_path / "keras_ckpt")) == [
        "m_1.keras",
        "m_2.keras",
        "m_3.keras",
        "w_1.weights.h5",
        "w_2.weights.h5",
        "w_3.weights.h5",
    ]
    assert sorted(os.listdir(tmp_path / "keras_backup")) == [
        "latest.weights.h5",
        "training_metadata.json",
    ]
    final = [np.asarray(w, dtype="float32") for w in first["weights"]]
    # The last epoch's weights file holds the final weights (and Keras's
    # optimizer state beside them).
    saved = {
        a.tobytes()
        for a in h5_datasets(tmp_path / "keras_ckpt" / "w_3.weights.h5").values()
    }
    assert all(w.tobytes() in saved for w in final)


@pytest.mark.parametrize(
    "mode, strategy, call",
    [
        ("chief_save", "fsdp", "model.save"),
        ("chief_save", "zero1", "model.save"),
        ("chief_predict", "mirrored", "model.predict"),
    ],
)
def test_a_call_only_the_chief_makes_names_the_others_at_once(
    tmp_path, mode, strategy, call
):
    start = time.monotonic()
    result = launch(tmp_path, mode, strategy, devices=2, timeout=120)
    assert time.monotonic() - start < 60
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-3000:]
    assert "chief: ProcessMismatchError after" in result.stdout
    assert (
        "which not every process reached: process 1 finished its program "
        "without reaching it." in result.stdout
    )
    assert f"Call `{call}` on every process" in result.stdout
    assert "Check failure stack trace" not in result.stderr
    assert not (tmp_path / "chief.keras").exists()
