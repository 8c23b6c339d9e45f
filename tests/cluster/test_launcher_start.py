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


@pytest.mark.parametrize(
    "lines, relayed",
    [
        (
            [
                "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
                "connected peer ranks is : 1\n"
            ],
            [],
        ),
        # Written piece by piece by several threads at once: cut and run
        # together, a count on a line of its own (a 2 x 4 cluster's, in CI).
        (
            [
                "[Gloo] Rank 6 is connected to 7[Gloo] Rank 7 is connected to 7 peer "
                "ranks. Expected number of connected peer ranks is : 7\n",
                " peer ranks. Expected number of connected peer ranks is : 7\n",
                "7\n",
                "[Gloo] Rank 3 is connected to 7 peer ranks. [Gloo] Rank 2Expected "
                "number of connected peer ranks is :  is connected to 77\n",
                "Epoch 1/3\n",
            ],
            ["Epoch 1/3\n"],
        ),
        # A number alone is the program's unless Gloo's line precedes it.
        (["7\n", "Epoch 1/3\n", "12\n"], ["7\n", "Epoch 1/3\n", "12\n"]),
        (["my peer ranks are 3 and 4\n"], ["my peer ranks are 3 and 4\n"]),
        (
            ["[Gloo] failed to connect to 127.0.0.1:1234\n"],
            ["[Gloo] failed to connect to 127.0.0.1:1234\n"],
        ),
    ],
    ids=["a whole line", "interleaved", "numbers", "words", "a Gloo error"],
)
def test_only_gloos_connection_lines_are_dropped(lines, relayed):
    import io

    import keras_dist_run

    quiet, verbose = io.StringIO(), io.StringIO()
    keras_dist_run._pump(0, io.StringIO("".join(lines)), quiet, verbose=False)
    keras_dist_run._pump(0, io.StringIO("".join(lines)), verbose, verbose=True)
    assert quiet.getvalue() == "".join(f"[0] {line}" for line in relayed)
    assert verbose.getvalue() == "".join(f"[0] {line}" for line in lines)


def test_a_failed_process_is_named_and_the_group_restarted_within_seconds(tmp_path):
    """The launcher's supervision (start, relay, name the failed process,
    stop the others, restart the group) on commands that import nothing:
    the fast tier's test of `keras_dist_run` (tests/cluster/test_launch.py
    and test_restarts.py run it with real JAX clusters)."""
    marker = tmp_path / "failed_once"
    script = (
        f'if [ "$KERAS_DIST_PROCESS_ID" = 1 ] && [ ! -e {marker} ]; then '
        f"touch {marker}; echo failing; exit 3; fi; "
        'echo "done $KERAS_DIST_PROCESS_ID of $KERAS_DIST_NUM_PROCESSES"'
    )
    launcher = [sys.executable, "-m", "keras_dist_run", "-n", "2", "--no-python"]
    once, elapsed = _run([*launcher, "sh", "-c", script])
    assert once.returncode == 3, once.stderr
    assert "[1] failing" in once.stdout
    assert once.stderr.splitlines()[-1] == (
        "keras-dist-run: process 1 exited with status 3 before joining; "
        "exiting with status 3."
    )
    marker.unlink()
    again, elapsed = _run([*launcher, "--max-restarts", "1", "sh", "-c", script])
    assert again.returncode == 0, again.stderr
    assert (
        "keras-dist-run: process 1 exited with status 3 before joining; "
        "restarting all 2 (restart 1 of 1)." in again.stderr
    )
    assert "[0] done 0 of 2" in again.stdout and "[1] done 1 of 2" in again.stdout
    assert elapsed < 30, elapsed


def test_a_failure_with_no_other_process_running_says_so():
    """Not "stopping the other 0": one process, failed."""
    launcher = [sys.executable, "-m", "keras_dist_run", "-n", "1", "--no-python"]
    result, _ = _run([*launcher, "sh", "-c", "exit 3"])
    assert result.returncode == 3, result.stderr
    assert (
        "keras-dist-run: process 0 exited with status 3; no other was running."
        in result.stderr
    ), result.stderr
    assert "stopping the other 0" not in result.stderr
