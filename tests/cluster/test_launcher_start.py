"""`keras-dist-run` parses its arguments before anything heavy is imported."""

import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(command):
    start = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    return result, time.monotonic() - start


def test_the_launcher_module_imports_neither_jax_nor_keras():
    probe = (
        "import sys, keras_dist_run; "
        "print(sorted(m for m in ('jax', 'keras', 'keras_dist') if m in sys.modules))"
    )
    result, _ = _run([sys.executable, "-c", probe])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "keras_dist_run", "--bogus"],
        pytest.param(
            [shutil.which("keras-dist-run") or "keras-dist-run", "--bogus"],
            marks=pytest.mark.skipif(
                shutil.which("keras-dist-run") is None,
                reason="keras-dist-run is not installed",
            ),
        ),
    ],
    ids=["python -m keras_dist_run", "keras-dist-run"],
)
def test_a_usage_error_exits_with_2_within_a_second(command):
    result, elapsed = _run(command)
    assert result.returncode == 2
    assert "keras-dist-run: error: the following arguments are required" in (
        result.stderr
    )
    assert elapsed < 1.5, elapsed
