"""Who is named when a process freezes, in-process: the launcher's `Watch`
over heartbeat files, and the peers' `PeerWatch` over JAX's key-value store
(the multi-process runs: `test_faults.py` by TF_CONFIG, `test_slurm.py`
under SLURM, `test_restarts.py` under the launcher)."""

import json
import os
import socket
import time

import pytest

from keras_dist.cluster import _heartbeat
from keras_dist.cluster._heartbeat import PeerWatch
from keras_dist.errors import ClusterConfigError
from keras_dist_run._health import HUNG, Watch


def _beat(folder, rank, age, progress, step, host="node0"):
    path = os.path.join(folder, f"heartbeat_{rank}")
    with open(path, "w") as f:
        json.dump(
            {"progress": progress, "step": step, "in_call": True, "host": host}, f
        )
    then = time.time() - age
    os.utime(path, (then, then))


@pytest.mark.parametrize("stopped", [None, 0, 1])
def test_a_hang_names_the_process_whose_heartbeat_is_silent_too(tmp_path, stopped):
    """`--hang-timeout 30` fires before `--heartbeat-timeout 60`: with a
    process's heartbeat 40 s old (SIGSTOPped), that process is named as
    frozen, not "no process made progress" (what every process's fresh
    heartbeat with no progress means)."""
    for rank in (0, 1):
        _beat(tmp_path, rank, 40 if rank == stopped else 0, 420, 420, f"node{rank}")
    watch = Watch(str(tmp_path), 2, heartbeat_timeout=60, hang_timeout=30)
    assert watch.hung([0, 1]) is None  # The progress seen for the first time.
    watch._progress_since -= 31
    watch._next_read = 0
    failure = watch.hung([0, 1])
    if stopped is None:
        assert failure.line == "no process made progress for 31 s at step 420 (a hang)"
    else:
        assert failure.rank == stopped and failure.code == HUNG
        assert failure.line == (
            f"process {stopped} (node{stopped}) stopped answering at step 420 "
            "(no heartbeat for 40 s)"
        )


class _Store:
    """JAX's key-value store's calls that `PeerWatch` makes, on a dict (the
    real store: the multi-process tests named above)."""

    def __init__(self):
        self.values = {}
        self.answering = True

    def _check(self):
        if not self.answering:
            raise RuntimeError("DEADLINE_EXCEEDED: the coordination service")

    def key_value_set(self, key, value, allow_overwrite=False):
        self._check()
        self.values[key] = value

    def key_value_try_get(self, key):
        self._check()
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]

    def key_value_dir_get(self, prefix):
        self._check()
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _watch(store, process, timeout=10.0):
    watch = PeerWatch(store, process, 2, timeout)
    watch.exchange()
    return watch


def test_a_silent_peer_is_named_with_its_host_and_step():
    store = _Store()
    store.values["keras_dist/beat/1"] = json.dumps(
        {"sequence": 7, "host": "node1", "step": 41}
    )
    watch = _watch(store, 0)
    now = time.monotonic()
    assert watch.verdict(now + 9) is None
    _heartbeat.PROGRESS.step, before = 42, _heartbeat.PROGRESS.step
    try:
        status, line = watch.verdict(now + 12)
    finally:
        _heartbeat.PROGRESS.step = before
    assert status == 75
    assert line == (
        "process 1 (node1) stopped answering at step 42 (no heartbeat for 12 s); "
        "this process (process 0) exits 75 (restart the job: it resumes from its "
        "last backup)"
    )
    # A new beat: not silent.
    store.values["keras_dist/beat/1"] = json.dumps({"sequence": 8, "host": "node1"})
    watch.exchange()
    assert watch.verdict(time.monotonic() + 9) is None


def test_a_peer_that_ended_is_not_silent():
    store = _Store()
    store.values["keras_dist/exited/1"] = "finished its program"
    watch = _watch(store, 0)
    assert watch.verdict(time.monotonic() + 30) is None


def test_a_store_that_stops_answering_names_process_0():
    store = _Store()
    watch = _watch(store, 1)
    store.values["keras_dist/beat/0"] = json.dumps({"sequence": 1, "host": "n0"})
    watch.exchange()
    store.answering = False
    with pytest.raises(RuntimeError):
        watch.exchange()
    status, line = watch.verdict(time.monotonic() + 11)
    assert status == 75 and line.startswith("process 0 (n0) stopped answering")


def test_a_peers_own_error_ends_this_process_with_1_after_a_grace():
    store = _Store()
    store.values["keras_dist/exited/1"] = "failed with ValueError at step 5 on node1"
    watch = _watch(store, 0)
    now = time.monotonic()
    assert watch.verdict(now + 1) is None  # Its own hook may speak first.
    assert watch.verdict(now + 4) == (
        1,
        "process 1 failed with ValueError at step 5 on node1; this process "
        "(process 0) exits 1 too: a bug is not something a restart fixes",
    )
    store.values["keras_dist/exited/1"] = "lost a peer"
    assert _watch(store, 0).verdict(now + 4) is None


@pytest.mark.parametrize("text", ["-1", "soon", "inf"])
def test_a_bad_heartbeat_timeout_is_named(monkeypatch, text):
    monkeypatch.setenv("KERAS_DIST_HEARTBEAT_TIMEOUT", text)
    with pytest.raises(
        ClusterConfigError, match=f"KERAS_DIST_HEARTBEAT_TIMEOUT='{text}'"
    ):
        _heartbeat.timeout_from_environment()


def test_the_heartbeat_timeout_defaults_to_the_launchers(monkeypatch):
    monkeypatch.delenv("KERAS_DIST_HEARTBEAT_TIMEOUT", raising=False)
    assert _heartbeat.timeout_from_environment() == 60
    monkeypatch.setenv("KERAS_DIST_HEARTBEAT_TIMEOUT", "0")
    assert _heartbeat.timeout_from_environment() == 0
    assert socket.gethostname() == _heartbeat.HOST


class _SlowStore(_Store):
    """Each call takes `seconds`, with the GIL released (as JAX's do)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.in_flight = seconds, 0

    def key_value_set(self, key, value, allow_overwrite=False):
        self.in_flight += 1
        time.sleep(self.seconds)
        self.in_flight -= 1
        super().key_value_set(key, value, allow_overwrite)


def test_closing_waits_for_the_store_call_in_flight():
    """At exit (`close`, registered with atexit to run before JAX shuts its
    client down) no watch thread is left inside a call of the client: one
    returning into the finalizing interpreter aborted a process that had
    finished its program. A call that does not end is waited for `within`
    seconds at most."""
    store = _SlowStore(0.5)
    watch = PeerWatch(store, 0, 2, 10.0)
    watch.start()
    deadline = time.monotonic() + 5
    while not store.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.in_flight == 1
    watch.close()
    assert store.in_flight == 0
    assert not any(thread.is_alive() for thread in watch.threads)
    stuck = PeerWatch(_SlowStore(30), 0, 2, 10.0)
    stuck.start()
    time.sleep(0.1)
    began = time.monotonic()
    stuck.close(within=0.5)
    assert time.monotonic() - began < 2
