"""Cluster resolvers: TF_CONFIG, SLURM, explicit, keras-dist-run, auto-detection."""

import json
import socket
import threading

import pytest

import keras_dist as kd
from keras_dist.cluster._environment import first_host
from keras_dist.cluster._rendezvous import roll_call
from keras_dist.errors import ClusterConfigError

WORKERS = {"worker": ["host1:12345", "host2:12345", "host3:2222"]}


def _tf(cluster, task=None, **kwargs):
    config = {"cluster": cluster}
    if task is not None:
        config["task"] = task
    return kd.cluster.TFConfigClusterResolver(tf_config=json.dumps(config), **kwargs)


def test_workers_only():
    r = _tf(WORKERS, {"type": "worker", "index": 2})
    assert (r.coordinator_address, r.num_processes, r.process_id) == (
        "host1:12345",
        3,
        2,
    )
    assert not r.is_chief and r.source == "TF_CONFIG"
    assert _tf(WORKERS, {"type": "worker", "index": 0}).is_chief


def test_chief_is_process_zero_and_the_coordinator():
    cluster = {"chief": ["boss:1000"], **WORKERS}
    chief = _tf(cluster, {"type": "chief", "index": 0})
    assert (chief.process_id, chief.is_chief, chief.coordinator_address) == (
        0,
        True,
        "boss:1000",
    )
    worker = _tf(cluster, {"type": "worker", "index": 0})
    assert (worker.process_id, worker.is_chief, worker.num_processes) == (1, False, 4)


def test_evaluator_and_ps_take_no_training_process():
    cluster = {**WORKERS, "evaluator": ["eval:1"], "ps": ["ps0:1", "ps1:1"]}
    evaluator = _tf(cluster, {"type": "evaluator", "index": 0})
    assert evaluator.process_id is None and evaluator.num_processes == 3
    assert evaluator.has_parameter_servers


def test_task_overrides_and_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": WORKERS}))
    r = kd.cluster.TFConfigClusterResolver(task_type="worker", task_id=1)
    assert r.process_id == 1
    assert kd.cluster.resolve(r) is r


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", r"not valid JSON .*Received: '\{not json'"),
        ('["worker"]', "must be a JSON object"),
        (
            json.dumps({"task": {"type": "worker", "index": 0}}),
            'needs a non-empty "cluster"',
        ),
        (
            json.dumps({"cluster": WORKERS}),
            r'needs a "task" object.*Received: task=null',
        ),
        (
            json.dumps({"cluster": {"master": ["a:1"]}, "task": {"type": "master"}}),
            r"unknown task type 'master'.*\"master\"",
        ),
        (
            json.dumps({"cluster": WORKERS, "task": {"type": "chief", "index": 0}}),
            r"task type 'chief' is not in the cluster",
        ),
        (
            json.dumps({"cluster": WORKERS, "task": {"type": "worker", "index": 3}}),
            r"task index 3 is out of range.*3 'worker' task",
        ),
        (
            json.dumps(
                {"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker"}}
            ),
            r"lists the address 'a:1' twice: as worker:0 and as worker:1",
        ),
        (
            json.dumps({"cluster": {"worker": ["a:http"]}, "task": {"type": "worker"}}),
            r"cluster\['worker'\]\[0\] has a port that is not a number.*'http'",
        ),
        (
            json.dumps({"cluster": {"worker": ["a"]}, "task": {"type": "worker"}}),
            r"must be \"host:port\".*Received: 'a'",
        ),
        (
            json.dumps({"cluster": {"worker": []}, "task": {"type": "worker"}}),
            "non-empty list",
        ),
        (
            json.dumps(
                {"cluster": {"ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}
            ),
            'no "chief" or "worker" task',
        ),
    ],
)
def test_bad_tf_config(text, message):
    with pytest.raises(ClusterConfigError, match=message):
        kd.cluster.TFConfigClusterResolver(tf_config=text)


def test_simple_resolver():
    r = kd.cluster.SimpleClusterResolver("10.0.0.1:1234", 4, 3)
    assert (r.num_processes, r.process_id, r.is_chief) == (4, 3, False)
    with pytest.raises(ClusterConfigError, match="process_id=4"):
        kd.cluster.SimpleClusterResolver("10.0.0.1:1234", 4, 4)
    with pytest.raises(ClusterConfigError, match="num_processes=0"):
        kd.cluster.SimpleClusterResolver("10.0.0.1:1234", 0, 0)
    with pytest.raises(ClusterConfigError, match=r"port that is not a number.*99999"):
        kd.cluster.SimpleClusterResolver("10.0.0.1:99999", 2, 0)


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node001", "node001"),
        ("gpu[003-005,9]", "gpu003"),
        ("a[1],b[2-3]", "a1"),
        ("c1,c2", "c1"),
    ],
)
def test_slurm_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_resolver(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "trn[07-10]")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = kd.cluster.resolve()
    assert (r.source, r.coordinator_address, r.process_id, r.num_processes) == (
        "SLURM",
        "trn07:12345",
        2,
        4,
    )
    assert (
        kd.cluster.SlurmClusterResolver(port=2000).coordinator_address == "trn07:2000"
    )
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID is not set"):
        kd.cluster.SlurmClusterResolver()


def test_a_slurm_jobs_port_comes_from_its_job_unless_one_is_given(monkeypatch):
    """Jobs sharing a node get different ports, as JAX derives them."""
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[0-1]")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("KERAS_DIST_PORT", raising=False)
    addresses = {}
    for job in ("4101", "4102"):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        addresses[job] = kd.cluster.SlurmClusterResolver().coordinator_address
    assert addresses == {"4101": "node0:61445", "4102": "node0:61446"}
    monkeypatch.setenv("KERAS_DIST_PORT", "23456")
    assert kd.cluster.SlurmClusterResolver().coordinator_address == "node0:23456"
    assert kd.cluster.SlurmClusterResolver(port=2000).coordinator_address == (
        "node0:2000"
    )


def test_the_batch_script_of_a_slurm_job_is_told_to_use_srun(monkeypatch):
    """`python train.py` in the batch script (SLURM_PROCID=0, the job's task
    count, no step): an error at once, not a wait for tasks never started."""
    for name in ("TF_CONFIG", "SLURM_STEP_ID", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4101")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[0-1]")
    with pytest.raises(ClusterConfigError) as raised:
        kd.cluster.resolve()
    assert str(raised.value) == (
        "This process runs in SLURM job 4101's batch script, not as one of its 2 "
        "tasks (SLURM_STEP_ID is not set): nothing else would join it. Start the "
        "tasks with `srun`, e.g. `srun python train.py` in the batch script (one "
        "process per task; srun sets each task's SLURM_PROCID)."
    )


def test_resolution_order(monkeypatch):
    for name in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "KERAS_DIST_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    assert kd.cluster.resolve().source == "single process"
    monkeypatch.setenv("KERAS_DIST_COORDINATOR", "127.0.0.1:5000")
    monkeypatch.setenv("KERAS_DIST_NUM_PROCESSES", "2")
    monkeypatch.setenv("KERAS_DIST_PROCESS_ID", "1")
    assert kd.cluster.resolve().source == "keras-dist-run"
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    assert kd.cluster.resolve().source == "SLURM"
    monkeypatch.setenv(
        "TF_CONFIG",
        json.dumps({"cluster": WORKERS, "task": {"type": "worker", "index": 1}}),
    )
    assert kd.cluster.resolve().source == "TF_CONFIG"
    with pytest.raises(TypeError, match="ClusterResolver"):
        kd.cluster.resolve("host:1")


def test_single_process_initialize_does_nothing(monkeypatch):
    for name in ("TF_CONFIG", "SLURM_PROCID", "KERAS_DIST_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    from keras_dist.cluster import _initialize

    monkeypatch.setattr(_initialize, "_STATE", {})
    r = kd.cluster.initialize()
    assert r.num_processes == 1 and r.is_chief
    assert not kd.cluster.is_initialized()


def _answering(reply: bytes):
    """A server on a free loopback port that reads a line and sends `reply`
    (what another job's JAX coordinator, gRPC, sends first)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        with server, server.accept()[0] as connection:
            connection.recv(300)
            connection.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def test_a_peer_reaching_something_else_on_the_port_is_told_so():
    """Not a decode error: the port, what answered and how to fix it."""
    port = _answering(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\xfe\xff")
    resolver = kd.cluster.SimpleClusterResolver(f"127.0.0.1:{port}", 2, 1)
    with pytest.raises(
        ClusterConfigError,
        match=rf"Something other than a keras_dist coordinator answers on port "
        rf"{port} of 127\.0\.0\.1 .*answered b'\\x00.*Give this job its own port",
    ):
        roll_call(resolver, timeout=10)


def test_a_coordinator_port_held_by_another_program_is_named():
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    resolver = kd.cluster.SimpleClusterResolver(f"127.0.0.1:{port}", 2, 0)
    with (
        busy,
        pytest.raises(
            ClusterConfigError,
            match=rf"Process 0 cannot listen on the coordinator's port {port} .*"
            "another job's coordinator on this host",
        ),
    ):
        roll_call(resolver, timeout=10)
