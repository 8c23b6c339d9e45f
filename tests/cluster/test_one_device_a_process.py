"""The multi-host example with one device a process, as most GPU clusters run.

`keras-dist-run -n 4 --devices-per-process 1` trains
`examples/multi_worker_digits.py` to the end, to the checkpoint of as many
replicas in fewer processes (2 x 2). (TF_CONFIG clusters of
processes started by hand: tests/cluster/test_faults.py.)
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests._helpers import h5_datasets

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multi_worker_digits.py"
ARGS = ["--epochs", "2", "--seed", "3"]
pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _environ() -> dict:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KD_", "XLA_", "KERAS_DIST_", "TF_CONFIG"))
    }
    environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return environ


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`launched(n, devices)`: the example's final checkpoint under
    keras-dist-run, arrays by name; each layout run once for the module."""
    runs: dict = {}

    def run(n: int, devices: int) -> dict:
        if (n, devices) not in runs:
            workdir = tmp_path_factory.mktemp(f"launched_{n}x{devices}")
            runs[n, devices] = _launch(n, devices, str(workdir))
        return runs[n, devices]

    return run


def _launch(n: int, devices: int, workdir: str) -> dict:
    command = [sys.executable, "-m", "keras_dist_run", "-n", str(n)]
    command += ["--devices-per-process", str(devices), str(EXAMPLE), *ARGS]
    command += ["--workdir", workdir]
    result = subprocess.run(
        command,
        env=_environ(),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=str(ROOT / "examples"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for rank in range(n):
        assert f"[{rank}] process {rank}: test accuracy" in result.stdout
    return _checkpoint(workdir)


def _checkpoint(workdir: str) -> dict:
    return h5_datasets(pathlib.Path(workdir) / "checkpoints" / "ckpt_2.weights.h5")


def _assert_same(expected: dict, got: dict) -> None:
    assert sorted(got) == sorted(expected) and len(got) == 20
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


# 4 x 1 against 2 x 2 (2 x 1, one device a process with 2 processes: the
# full MultiWorkerMirroredStrategy script in test_multi_worker.py, the split
# state in test_sharded_multi_process.py[2x1]; this example under the
# launcher with 2 processes: tests/test_docs.py, the multi-host guide's
# command).
@pytest.mark.parametrize("one_device, fewer", [((4, 1), (2, 2))], ids=["4x1"])
def test_one_device_a_process_trains_as_many_replicas_in_fewer_processes(
    launched, one_device, fewer
):
    _assert_same(launched(*fewer), launched(*one_device))
