"""Running the docs' and examples' Python as a user would: a fresh process,
without the tests' XLA_FLAGS and backend, on the install a page names."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT = 300


def run(args, env_extra=None):
    """Runs Python in a fresh process, without the tests' XLA_FLAGS/backend;
    its stdout."""
    return run_with_stderr(args, env_extra)[0]


def run_with_stderr(args, env_extra=None) -> tuple[str, str]:
    """`run`'s stdout, and its stderr."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(env_extra or {})
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, result.stderr


def as_installed(page: pathlib.Path) -> dict[str, str]:
    """The environment that runs `page`'s code on exactly the install it
    names first (a guide's "Install, in a checkout of keras_dist: `pip
    install -e ...`", README's demo command): the test extra's other
    packages (TensorFlow, TFDS, ...) refused at import, as where they are not
    installed (tests/as_installed/)."""
    line = next(
        (line for line in page.read_text().splitlines() if "pip install -e " in line),
        None,
    )
    assert line, f"{page.name} does not say what to install"
    extras = re.search(r'pip install -e "?\.(?:\[([\w,]*)\])?"?', line)
    return {
        "PYTHONPATH": str(ROOT / "tests" / "as_installed"),
        "KD_AS_INSTALLED": extras.group(1) or "",
        "KD_INSTALLED_ALONE": ",".join(re.findall(r'--no-deps "([\w-]+)==', line)),
    }


def assert_quiet(stderr: str) -> None:
    """No line another library prints that a user can do nothing about."""
    noise = [
        line
        for line in stderr.splitlines()
        if "WARNING:absl" in line or "[Gloo]" in line
    ]
    assert noise == [], noise[:5]


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
