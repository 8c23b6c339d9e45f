"""A roll call of every process before `jax.distributed.initialize`.

JAX's coordination service aborts process 0 (SIGABRT, a C++ stack) when a
peer never registers, and a peer when the coordinator never answers. So,
on the coordinator's port, before JAX listens there, process 0 waits for a
line `keras_dist <process_id> <num_processes>` from every other process,
within the timeout, and answers `go` once all are there; on timeout it
answers `abort <reason>` and raises a `ClusterTimeoutError` naming the
processes that never came. Only then does JAX start (every peer is alive).
"""

import contextlib
import socket
import time

from keras_dist.cluster._resolver import ClusterResolver, parse_address
from keras_dist.errors import ClusterTimeoutError, ProcessMismatchError

__all__ = ["roll_call"]

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
        _gather(port, resolver, start + timeout, timeout)
    else:
        _report(host.strip("[]"), port, resolver, start + timeout, timeout)
    return max(1.0, timeout - (time.monotonic() - start))


def _listen(port: int) -> socket.socket:
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False
        )
    return socket.create_server(("", port))


def _gather(port: int, resolver: ClusterResolver, deadline: float, timeout: float):
    """Process 0: collects every peer's hello, then answers all of them."""
    peers: dict[int, socket.socket] = {}
    expected = set(range(1, resolver.num_processes))
    with _listen(port) as server:
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
        words = connection.makefile("r").readline(200).split()
    except OSError:
        words = []
    if len(words) != 3 or words[0] != _HELLO or not words[1].isdigit():
        connection.close()  # Not one of ours (e.g. a port probe).
        return
    process, count = int(words[1]), words[2]
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
    hello = f"{_HELLO} {resolver.process_id} {resolver.num_processes}\n"
    try:
        with connection:
            connection.sendall(hello.encode())
            connection.settimeout(max(0.1, deadline - time.monotonic()))
            answer = connection.makefile("r").readline(1000).strip()
    except OSError as error:  # Includes the timeout.
        answer = f"abort no answer within {timeout:g} s ({error})"
    if answer == "go":
        return
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
