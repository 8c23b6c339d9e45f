"""Starting keras_dist processes for the multi-process tests: by hand (each
its TF_CONFIG, as a scheduler starts them) or under `keras-dist-run`."""

import json
import os
import pathlib
import subprocess
import sys

from tests._xla import xla_flags

CLUSTER = pathlib.Path(__file__).parent / "cluster"


def tf_config_env(workers: list[str], index: int) -> dict[str, str]:
    """The environment of worker `index` of `workers` as a scheduler starts
    it: this one's less the tests' own cluster settings, its TF_CONFIG, one
    CPU device."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KD_", "XLA_", "KERAS_DIST_", "TF_CONFIG"))
    }
    environ.update(
        TF_CPP_MIN_LOG_LEVEL="3",
        XLA_FLAGS=xla_flags(devices=1),
        TF_CONFIG=json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        ),
    )
    return environ


def by_hand(
    script, env=None, timeout=120, args=(), prefix=(), wait_for=(0, 1)
) -> list[tuple[int, str, str]]:
    """2 processes of `script` (with `args`), one CPU device each, started
    as a scheduler starts them (each its TF_CONFIG, no launcher), each
    command after `prefix`: each one's (status, stdout, stderr); none
    outlives the call. Once the processes in `wait_for` ended, the other is
    SIGKILLed (e.g. one that stopped itself)."""
    from keras_dist.launch import free_port

    workers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    processes = []
    for index in (0, 1):
        environ = tf_config_env(workers, index)
        environ.update(env or {})  # May change the two above.
        processes.append(
            subprocess.Popen(
                [*prefix, sys.executable, str(script), *map(str, args)],
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = {i: processes[i].communicate(timeout=timeout) for i in wait_for}
        for i, p in enumerate(processes):
            if i not in outputs:
                p.kill()
                outputs[i] = p.communicate(timeout=30)
        outputs = [outputs[i] for i in range(len(processes))]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, *out) for p, out in zip(processes, outputs, strict=True)]


def process_env(env=None, **extra) -> dict[str, str]:
    """The environment of a process the tests start, as a user's shell has
    it: this one's less the tests' own settings (`KD_*`, `XLA_*`), with the
    tests' XLA flags (`tests/_xla.py`; no device count: the launcher's
    `--devices-per-process` or the script sets it), TensorFlow quiet, then
    `env` and `extra`."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KD_", "XLA_"))}
    environ.update(TF_CPP_MIN_LOG_LEVEL="3", XLA_FLAGS=xla_flags())
    environ.update(env or {})
    environ.update(extra)
    return environ


def launch(script, *args, n=2, devices=4, timeout=400, env=None, flags=()):
    environ = process_env(env)
    command = [sys.executable, "-m", "keras_dist_run", "-n", str(n)]
    command += ["--devices-per-process", str(devices), *flags]
    command += [str(script), *map(str, args)]
    return subprocess.run(
        command,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
