"""A roll call of every process before `jax.distributed.initialize`.

JAX's coordination service aborts process 0 (SIGABRT, a C++ stack) when a
peer never registers, and a peer when the coordinator never answers. So,
on the coordinator's address and port, before JAX listens there, process 0
waits for a line `keras_dist <process_id> <num_processes> <job>` from every
other process, within the timeout, and answers `go` once all are there; on
timeout it answers `abort <reason>` and raises a `ClusterTimeoutError`
naming the processes that never came. Only then does JAX start (every peer
is alive).

`<job>` (`job_identity`) tells jobs apart where they share a node: the
SLURM job and step, the launcher's run, the TF_CONFIG cluster. A process of
another job (or anything else answering on the port) gets a
`ClusterConfigError` naming the port and both jobs; the job it reached goes
on waiting for its own processes.
"""

import contextlib
import errno
import hashlib
import ipaddress
import json
import os
import socket
import time

from keras_dist.cluster._resolver import ClusterResolver, parse_address
from keras_dist.errors import (
    ClusterConfigError,
    ClusterTimeoutError,
    ProcessMismatchError,
)

__all__ = ["job_identity", "roll_call"]

_READ_SECONDS = 5.0
_HELLO = "keras_dist"


def roll_call(resolver: ClusterResolver, timeout: float) -> float:
    """Waits until every process of `resolver` is there; returns the time left.

    Raises:
        ClusterTimeoutError: naming the processes (or the coordinator) that
            did not answer within `timeout` seconds.
        ProcessMismatchError: if two processes claim the same process id, or
            the processes disagree on the number of processes.
    """
    start = time.monotonic()
    host, port = parse_address(resolver.coordinator_address, where="the coordinator")
    if resolver.process_id == 0:
        _gather(host.strip("[]"), port, resolver, start + timeout, timeout)
    else:
        _report(host.strip("[]"), port, resolver, start + timeout, timeout)
    return max(1.0, timeout - (time.monotonic() - start))


def job_identity(resolver: ClusterResolver) -> str:
    """What every process of one job shares and another job does not (one
    word): its SLURM job and step, its keras-dist-run run, a digest of its
    TF_CONFIG cluster; an explicit resolver's processes: `explicit`."""
    env = os.environ
    if resolver.source == "SLURM" and env.get("SLURM_JOB_ID"):
        return f"slurm-job-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
    if resolver.source == "keras-dist-run" and env.get("KERAS_DIST_RUN_STATE"):
        run = env["KERAS_DIST_RUN_STATE"]
    elif resolver.source == "TF_CONFIG":
        run = json.dumps(resolver.cluster_spec, sort_keys=True)
    else:
        return "explicit"
    digest = hashlib.sha256(run.encode()).hexdigest()[:12]
    return f"{resolver.source.lower()}-{digest}"


def _bind_address(host: str) -> str:
    """The address process 0's roll call listens on: the coordinator's, so a
    job addressed at one interface is not reached through another; every
    interface where that address is not this host's, or where the name is
    this host's but resolves here to a loopback address (Debian's
    `127.0.1.1 hostname` line) that peers on other hosts cannot reach."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if host == "localhost":
        return host
    try:
        resolved = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return ""
    return "" if ipaddress.ip_address(resolved).is_loopback else resolved


def _listen(host: str, port: int, resolver: ClusterResolver) -> socket.socket:
    address = _bind_address(host)
    try:
        try:
            if address:
                return socket.create_server((address, port))
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL:  # Not this host's address.
                raise
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", port),
                family=socket.AF_INET6,
                dualstack_ipv6=True,
                reuse_port=False,
            )
        return socket.create_server(("", port))
    except OSError as error:
        raise ClusterConfigError(
            f"Process 0 cannot listen on the coordinator's port {port} ({error}): "
            "another program, perhaps another job's coordinator on this host, "
            f"holds it. This process is {resolver.describe()}. Give this job "
            "another port: in TF_CONFIG, `keras-dist-run --port`, or "
            "$KERAS_DIST_PORT (a SLURM job's default port is derived from its "
            "job id)."
        ) from error


def _gather(
    host: str, port: int, resolver: ClusterResolver, deadline: float, timeout: float
):
    """Process 0: collects every peer's hello, then answers all of them."""
    peers: dict[int, socket.socket] = {}
    expected = set(range(1, resolver.num_processes))
    with _listen(host, port, resolver) as server:
        try:
            while set(peers) != expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(expected - set(peers))
                    _answer(peers, f"abort processes {missing} never came")
                    raise ClusterTimeoutError(
                        f"Process(es) {missing} of {resolver.num_processes} did not "
                        f"join within {timeout:g} s (this is process 0, the "
                        f"coordinator {resolver.coordinator_address}). Start every "
                        "process with the same cluster description, check their "
                        "logs, or raise `timeout`."
                    )
                server.settimeout(min(left, 1.0))
                with contextlib.suppress(TimeoutError):
                    connection, _ = server.accept()
                    _welcome(connection, peers, resolver)
        except BaseException:
            for connection in peers.values():
                connection.close()
            raise
        _answer(peers, "go")
        for connection in peers.values():  # Peers close first: no TIME_WAIT here.
            with contextlib.suppress(OSError), connection:
                connection.settimeout(_READ_SECONDS)
                connection.recv(1)


def _welcome(connection: socket.socket, peers: dict, resolver: ClusterResolver):
    connection.settimeout(_READ_SECONDS)
    try:
        line = connection.makefile("rb").readline(300)
    except OSError:
        line = b""
    words = line.decode("utf-8", errors="replace").split()
    if len(words) != 4 or words[0] != _HELLO or not words[1].isdigit():
        connection.close()  # Not one of ours (e.g. a port probe).
        return
    process, count, job = int(words[1]), words[2], words[3]
    if job != job_identity(resolver):  # Another job's process: told, let go.
        with contextlib.suppress(OSError), connection:
            connection.sendall(f"other-job {job_identity(resolver)}\n".encode())
        return
    problem = None
    if count != str(resolver.num_processes):
        problem = (
            f"process {process} was started with num_processes={count}, process 0 "
            f"with num_processes={resolver.num_processes}"
        )
    elif process in peers or not 0 < process < resolver.num_processes:
        problem = f"two processes (or one out of range) claim process_id={process}"
    if problem is not None:
        _answer({**peers, process: connection}, f"abort {problem}")
        raise ProcessMismatchError(
            f"The cluster is described differently by its processes: {problem}. "
            "Start every process with the same cluster description and its own "
            "process id."
        )
    peers[process] = connection


def _answer(peers: dict, line: str) -> None:
    for connection in peers.values():
        with contextlib.suppress(OSError):
            connection.sendall(f"{line}\n".encode())


def _report(host: str, port: int, resolver, deadline: float, timeout: float):
    """A peer: says hello to process 0, then waits for its answer."""
    connection = _connect(host, port, resolver, deadline, timeout)
    job = job_identity(resolver)
    hello = f"{_HELLO} {resolver.process_id} {resolver.num_processes} {job}\n"
    try:
        with connection:
            connection.sendall(hello.encode())
            connection.settimeout(max(0.1, deadline - time.monotonic()))
            line = connection.makefile("rb").readline(1000)
    except OSError as error:  # Includes the timeout.
        line = f"abort no answer within {timeout:g} s ({error})".encode()
    answer = line.decode("utf-8", errors="replace").strip()
    if answer == "go":
        return
    if answer.startswith("other-job "):
        raise ClusterConfigError(
            f"The coordinator's port {port} on {host} belongs to another job "
            f"({answer.split()[1]}); this process is of job {job}: "
            f"{resolver.describe()}. Two jobs on one host need two ports: give "
            "this job its own (in TF_CONFIG, `keras-dist-run --port`, or "
            "$KERAS_DIST_PORT)."
        )
    if line and not answer.startswith("abort"):
        raise ClusterConfigError(
            f"Something other than a keras_dist coordinator answers on port "
            f"{port} of {host} (perhaps another job's, already training): it "
            f"answered {line[:40]!r}. This process is of job {job}: "
            f"{resolver.describe()}. Give this job its own port (in TF_CONFIG, "
            "`keras-dist-run --port`, or $KERAS_DIST_PORT)."
        )
    reason = answer.removeprefix("abort ") or "it closed the connection"
    raise ClusterTimeoutError(
        f"The coordinator {resolver.coordinator_address} (process 0) gave up on "
        f"the cluster: {reason}. This process is {resolver.describe()}. Start "
        "every process with the same cluster description."
    )


def _connect(host: str, port: int, resolver, deadline: float, timeout: float):
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((host, port), timeout=1.0)
        except OSError as error:
            last_error = error
            time.sleep(0.2)
    raise ClusterTimeoutError(
        f"The coordinator {resolver.coordinator_address} did not answer within "
        f"{timeout:g} s ({last_error}); this process is {resolver.describe()}. "
        "Start process 0 first (or together), check the address and port, and "
        "that no firewall blocks it."
    )
