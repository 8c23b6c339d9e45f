"""mypy is clean on `keras_dist/` at the strictness `[tool.mypy]` in
pyproject.toml states, and the package ships its `py.typed` marker."""

import pathlib
import subprocess
import sys

import keras_dist

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_py_typed_marker():
    assert (pathlib.Path(keras_dist.__file__).parent / "py.typed").is_file()


def test_mypy(tmp_path):
    # The configuration (files, strictness) is pyproject.toml's; a cache of
    # its own, so that parallel runs (pytest-xdist) do not share one.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Success" in result.stdout, output
