"""keras-dist-run and initialize with real local processes (gloo on CPU)."""

import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import keras_dist as kd
from keras_dist.launch import free_port
from tests._processes import by_hand, process_env

SCRIPT = pathlib.Path(__file__).with_name("psum_script.py")
pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _launch(*args, env=None, timeout=120):
    environ = process_env(env)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist_run", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result, time.monotonic() - start


def test_two_processes_form_one_cluster():
    result, _ = _launch("-n", "2", "--devices-per-process", "4", str(SCRIPT))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # Every process sees 8 devices and the global sum 4 x 1 + 4 x 2.
    assert (
        "[0] rank 0 of 2: 8 devices, sum 12, chief True, source keras-dist-run" in out
    )
    assert (
        "[1] rank 1 of 2: 8 devices, sum 12, chief False, source keras-dist-run" in out
    )
    assert "[0] keras_dist: joining as process 0 of 2" in result.stderr
    # Gloo's connection lines are dropped (--verbose relays them).
    assert "[Gloo]" not in result.stdout + result.stderr


ROOT = pathlib.Path(__file__).resolve().parents[2]
JOIN = (
    "import keras_dist as kd; s = kd.MultiWorkerMirroredStrategy(); "
    "print('joined', s.process_id, 'of', s.num_processes)"
)


@pytest.mark.parametrize(
    "command",
    [
        ["python", "-c", JOIN],  # Any executable on PATH, arguments passed on.
        ["--no-python", sys.executable, "-c", JOIN],
        ["-m", "tests.cluster.psum_script"],  # A module, as `python -m`.
    ],
    ids=["python -c", "--no-python", "-m"],
)
def test_the_launcher_runs_any_command(command):
    # `python` is the one running the tests (its folder first on PATH).
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    environ = process_env(PATH=path)
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist_run", "-n", "2", "--verbose", *command],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(ROOT),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    if command[0] == "-m":
        assert "[1] rank 1 of 2:" in result.stdout
        # --verbose relays Gloo's connection lines (the psum connects).
        assert "] [Gloo] Rank " in result.stdout + result.stderr
    else:
        for rank in (0, 1):
            assert f"[{rank}] joined {rank} of 2" in result.stdout


def test_processes_started_by_hand_with_tf_config_form_one_cluster():
    """As on real hosts: 2 processes, one CPU device each, each with its
    TF_CONFIG (no launcher), join and sum over both devices."""
    results = by_hand(SCRIPT)
    for index, (code, out, err) in enumerate(results):
        assert code == 0, out[-2000:] + err[-3000:]
        # (Without the launcher, Gloo's connection lines come first.)
        assert out.strip().splitlines()[-1] == (
            f"rank {index} of 2: 2 devices, sum 3, chief {index == 0}, source TF_CONFIG"
        )


def test_a_failing_process_stops_the_others_quickly():
    # Rank 1 raises; rank 0 ignores SIGTERM and sleeps: it must be SIGKILLed.
    start = time.monotonic()
    result, elapsed = _launch(
        "-n",
        "2",
        "--devices-per-process",
        "2",
        str(SCRIPT),
        env={"KD_FAIL_RANK": "1", "KD_HANG_RANK": "0"},
    )
    assert result.returncode == 1
    # Its exception, as the process recorded it for the launcher.
    assert re.search(
        r"keras-dist-run: process 1 failed with RuntimeError: failing on purpose "
        r"\(.+\.py:\d+\); stopping the other 1\.",
        result.stderr,
    ), result.stderr[-3000:]
    assert "[1] RuntimeError: failing on purpose" in result.stderr
    failed_at = result.stdout.count("rank 1 of 2")  # It did run before failing.
    assert failed_at == 1
    assert elapsed < 60 and time.monotonic() - start < 60  # ~10 s start + 10 s grace.


def test_a_process_that_ends_without_joining_is_named_at_once():
    """Process 1 ends without joining; process 0 waits for it in
    `kd.cluster.initialize` (60 s): the launcher names process 1 and stops
    process 0 as soon as it sees both."""
    code = textwrap.dedent("""
        import os, keras_dist as kd
        if os.environ["KERAS_DIST_PROCESS_ID"] == "0":
            kd.cluster.initialize(timeout=60)
        print("returned")
    """)
    result, elapsed = _launch(
        "-n", "2", "--devices-per-process", "1", "--no-python", sys.executable,
        "-c", code,
    )  # fmt: skip
    assert result.returncode == 1
    assert "[1] returned" in result.stdout and "[0] returned" not in result.stdout
    assert (
        "keras-dist-run: process 1 finished without joining the cluster: it ran "
        "alone, a one-process program, not process 1 of 2." in result.stderr
    )
    assert (
        "keras-dist-run: process 0 waits to join the cluster with process 1, which "
        "finished without joining it; stopping the other 1." in result.stderr
    )
    assert elapsed < 40  # Not the 60 s of process 0's wait.


def test_a_one_process_strategy_under_the_launcher_says_it_trains_alone():
    """`kd.MirroredStrategy()` started with `-n 2`: each process warns at
    once that it trains alone; the launcher names both at their end."""
    code = "import keras_dist as kd\ns = kd.MirroredStrategy()\nprint('ok')"
    result, _ = _launch(
        "-n", "2", "--devices-per-process", "2", "--no-python", sys.executable,
        "-c", code,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (
            f"[{rank}] <string>:2: UserWarning: MirroredStrategy trains on this "
            f"process's 2 device(s) alone, but this process is {rank} of 2 "
            "(keras-dist-run): each of the 2 processes would train a model of its "
            "own and write its own files. To train them as one, create "
            "`kd.MultiWorkerMirroredStrategy()` instead" in result.stderr
        )
        assert (
            f"keras-dist-run: process {rank} finished without joining the cluster"
            in result.stderr
        )


def test_unreachable_coordinator_fails_within_the_timeout():
    port = free_port()
    script = textwrap.dedent(f"""
        import keras_dist as kd
        r = kd.cluster.SimpleClusterResolver("127.0.0.1:{port}", 2, 1)
        kd.cluster.initialize(r, timeout=5)
    """)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "ClusterTimeoutError" in result.stderr
    assert f"coordinator 127.0.0.1:{port}" in result.stderr
    assert "within 5 s" in result.stderr
    assert elapsed < 60


def test_the_processes_run_keras_on_jax_unless_the_environment_says_otherwise(
    tmp_path,
):
    # A script may import Keras before keras_dist (examples/ do): without a
    # backend in the environment Keras would pick ~/.keras/keras.json's or
    # TensorFlow. The launcher itself imports neither.
    script = tmp_path / "backend.py"
    script.write_text("import os\nprint('backend', os.environ['KERAS_BACKEND'])\n")
    environ = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    command = [sys.executable, "-m", "keras_dist_run", "-n", "2", str(script)]
    for backend, expected in [(None, "jax"), ("tensorflow", "tensorflow")]:
        env = environ if backend is None else {**environ, "KERAS_BACKEND": backend}
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr[-2000:]
        for rank in (0, 1):
            assert f"[{rank}] backend {expected}" in result.stdout


def test_launcher_bad_arguments(tmp_path):
    result, _ = _launch("-n", "0", str(SCRIPT))
    assert result.returncode == 2
    assert "argument -n/--num-processes: must be >= 1. Received: 0" in result.stderr
    result, _ = _launch("-n", "2", str(tmp_path / "missing.py"))
    assert result.returncode == 2
    assert "is neither a file nor on PATH. Give a Python script" in result.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    """keras-dist-run itself (the console script), quickly: it starts nothing."""
    command = [sys.executable, "-m", "keras_dist_run", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_launcher_cli_first_day_mistakes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    bare = _cli()  # No arguments: the whole help, with its examples.
    assert bare.returncode == 2
    assert "examples:" in bare.stderr and "keras-dist-run -n 2 train.py" in bare.stderr
    assert "how many processes to start" in bare.stderr  # -n has help.
    version = _cli("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"keras-dist-run (keras-dist {kd.__version__})"
    # The old module path runs the same launcher (the tests start clusters
    # with `-m keras_dist_run`, which imports neither Keras nor JAX).
    old_path = subprocess.run(
        [sys.executable, "-m", "keras_dist.launch", "--version"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert old_path.returncode == 0, old_path.stderr[-2000:]
    assert old_path.stdout.strip() == version.stdout.strip()
    for args, message in [
        (["--port", "99999"], "argument --port: 99999 is not a TCP port: use 1-65535"),
        (["--port", "http"], "argument --port: expected a TCP port number"),
        (["-n", "two"], "argument -n/--num-processes: expected a whole number"),
        (["--devices-per-process", "0"], "--devices-per-process: must be >= 1"),
        (["--preemption-grace", "-1"], "--preemption-grace: must be >= 0"),
        (
            ["--goodput", "az://runs/goodput.json"],
            "--goodput: no library writes az:// here. Received: --goodput "
            "az://runs/goodput.json. Give a local path, gs://... (gcsfs) or "
            "s3://... (s3fs).",
        ),
    ]:
        result = _cli(*(["-n", "2"] if "-n" not in args else []), *args, str(script))
        assert result.returncode == 2, args
        assert message in result.stderr, (args, result.stderr)
        assert "never run" not in result.stdout  # Refused before any process.


def test_a_port_in_use_is_refused_before_any_process_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = _cli("-n", "2", "--port", str(port), str(script))
    assert result.returncode == 2
    assert f"argument --port: 127.0.0.1:{port} cannot be used" in result.stderr
    assert "leave --port out for a free one" in result.stderr
    assert "never run" not in result.stdout
