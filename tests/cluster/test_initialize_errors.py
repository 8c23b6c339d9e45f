"""`kd.cluster.initialize` fails with named errors, within its timeout, never aborts."""

import pathlib
import subprocess
import sys
import time

import pytest

import keras_dist as kd
from keras_dist.launch import free_port
from tests._processes import tf_config_env

SCRIPT = pathlib.Path(__file__).with_name("join_script.py")


def _start(port, count, process, timeout=10):
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(port), str(count), str(process), timeout],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process, limit=90):
    try:
        out, err = process.communicate(timeout=limit)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, out, err


@pytest.mark.parametrize(
    "timeout, kind, message",
    [
        ("3", TypeError, "timeout='3' of type str"),
        (True, TypeError, "timeout=True"),
        (0, ValueError, "positive, finite number of seconds. Received: timeout=0"),
        (float("inf"), ValueError, "Received: timeout=inf"),
    ],
)
def test_bad_timeout(timeout, kind, message):
    with pytest.raises(kind, match=message):
        kd.cluster.initialize(timeout=timeout)


@pytest.mark.slow
@pytest.mark.processes
def test_process_0_names_the_peer_that_never_starts():
    start = time.monotonic()
    code, _, err = _finish(_start(free_port(), 2, 0, "10"))
    assert code == 1, err[-2000:]  # A Python exception, not SIGABRT (-6).
    assert "ClusterTimeoutError: Process(es) [1] of 2 did not join within 10 s" in err
    assert "Check failure stack trace" not in err
    assert time.monotonic() - start < 60


@pytest.mark.slow
@pytest.mark.processes
def test_processes_that_disagree_on_the_count_are_refused():
    port = free_port()
    coordinator, peer = _start(port, 2, 0, "20"), _start(port, 3, 1, "20")
    (code0, _, err0), (code1, _, err1) = _finish(coordinator), _finish(peer)
    assert (code0, code1) == (1, 1), err0[-2000:] + err1[-2000:]
    assert "ProcessMismatchError: The cluster is described differently" in err0
    assert "process 1 was started with num_processes=3" in err0
    assert "(process 0) gave up on the cluster: process 1 was started" in err1


@pytest.mark.slow
@pytest.mark.processes
def test_a_two_process_cluster_joins():
    port = free_port()
    processes = [_start(port, 2, rank, "60") for rank in (1, 0)]
    results = [_finish(p) for p in processes]
    # (A string, shown whole: a list's repr is cut in the middle by pytest.)
    said = "\n".join(f"process {1 - i}: {r[2][-3000:]}" for i, r in enumerate(results))
    assert [r[0] for r in results] == [0, 0], said
    assert "joined 1 of 2" in results[0][1] and "joined 0 of 2" in results[1][1]


def _tf_config_process(workers: list[str], index: int) -> subprocess.Popen:
    """psum_script.py as a scheduler starts it: its TF_CONFIG, one device."""
    environ = tf_config_env(workers, index)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT.with_name("psum_script.py"))],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.processes
def test_a_process_of_another_job_on_the_coordinators_port_is_told_apart():
    """Two jobs by TF_CONFIG on ports chosen by hand; a process of a third
    description (another cluster, the same coordinator address, as a copied
    TF_CONFIG gives) reaches job 1's coordinator while it waits for its
    peer: that process gets the error naming the port and both jobs, job 1
    never sees it and trains, and job 2 on its own port too."""
    first = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    second = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    chief = _tf_config_process(first, 0)
    job_2 = [_tf_config_process(second, rank) for rank in (0, 1)]
    stray = _tf_config_process([first[0], f"127.0.0.1:{free_port()}"], 1)
    code, _, err = _finish(stray)
    assert code == 1, err[-3000:]
    port = first[0].rsplit(":", 1)[1]
    assert (
        f"ClusterConfigError: The coordinator's port {port} on 127.0.0.1 belongs "
        "to another job (tf_config-"
    ) in err
    assert "this process is of job tf_config-" in err
    assert "Two jobs on one host need two ports" in err
    peer = _tf_config_process(first, 1)
    for rank, process in enumerate([chief, peer]):
        code, out, err = _finish(process)
        assert code == 0, err[-3000:]
        assert f"rank {rank} of 2: 2 devices, sum 3" in out
    for rank, process in enumerate(job_2):
        code, out, err = _finish(process)
        assert code == 0, err[-3000:]
        assert f"rank {rank} of 2: 2 devices, sum 3" in out
