"""`kd.cluster.initialize` fails with named errors, within its timeout, never aborts."""

import pathlib
import subprocess
import sys
import time

import pytest

import keras_dist as kd
from keras_dist.launch import free_port

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
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert "joined 1 of 2" in results[0][1] and "joined 0 of 2" in results[1][1]
