"""mypy is clean on `keras_dist/` at the strictness `[tool.mypy]` in
pyproject.toml states, and the package ships its `py.typed` marker."""

import inspect
import pathlib
import subprocess
import sys
import tomllib

import pytest

import keras_dist

pytestmark = pytest.mark.source_checks  # No Keras code: once, on the main Keras.

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


def _public_modules() -> set[str]:
    """`keras_dist`, its public subpackages and the modules defining their names."""
    modules = set()
    pending = [keras_dist]
    while pending:
        namespace = pending.pop()
        modules.add(namespace.__name__)
        for name in namespace.__all__:
            value = getattr(namespace, name)
            if inspect.ismodule(value):
                pending.append(value)
                continue
            module = getattr(value, "__module__", None)
            if module and module.startswith("keras_dist"):
                modules.add(module)
    return modules


def test_public_modules_annotate_every_function():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = {
        module
        for override in config["overrides"]
        if override.get("disallow_untyped_defs")
        for module in override["module"]
    }
    missing = _public_modules() - strict
    assert not missing, (
        "Modules of the public API without disallow_untyped_defs in "
        f"pyproject.toml's [tool.mypy] overrides: {sorted(missing)}"
    )
