"""ruff (format + lint, configured in pyproject.toml) is clean."""

import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.source_checks  # No Keras code: once, on the main Keras.

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _ruff(*args):
    exe = shutil.which("ruff") or pytest.fail(
        "ruff is not installed: pip install -e '.[test]'"
    )
    return subprocess.run(
        [exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_lint():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_python_version():
    assert sys.version_info >= (3, 11)
