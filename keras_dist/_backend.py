"""Make sure Keras runs on JAX before anything else is imported."""

import os
import re
import sys
import warnings
from typing import Any

from keras_dist._private_api import _jax_private


def ensure_jax_backend() -> None:
    """Selects the JAX backend if Keras is not loaded yet; fails if it is not JAX.

    Raises:
        ImportError: if `KERAS_BACKEND` names another backend, or Keras was
            already imported with one.
    """
    requested = os.environ.get("KERAS_BACKEND", "").strip()
    if requested and requested != "jax":
        # Before Keras imports that backend (a ModuleNotFoundError of
        # tensorflow or torch otherwise, or Keras on the wrong backend).
        raise ImportError(
            "keras_dist runs Keras on the JAX backend, but the environment "
            f"sets KERAS_BACKEND={requested!r}. Unset it or set it to jax: "
            "`KERAS_BACKEND=jax python train.py`, or in a notebook "
            "`os.environ['KERAS_BACKEND'] = 'jax'` before the first "
            "`import keras` (restart the kernel if Keras is loaded already)."
        )
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"  # Over ~/.keras/keras.json's.
    import keras

    backend = keras.backend.backend()
    if backend != "jax":
        raise ImportError(
            "keras_dist runs Keras on the JAX backend, but Keras was imported "
            f"before keras_dist with backend={backend!r} (from "
            "~/.keras/keras.json or KERAS_BACKEND at that time). Import "
            "keras_dist before keras, or set KERAS_BACKEND=jax in the "
            "environment, e.g. `KERAS_BACKEND=jax python train.py`."
        )


# XLA:CPU runs each program of several devices by scheduling one launch per
# device on its client's thread pool, and a launch waits there (holding its
# thread) while its device already has 32 programs in flight. The pool has
# max(CPU cores, devices) threads and a collective needs one per device at
# once: with 8 virtual devices on 2 cores, the launches of the next program
# can hold the threads the running collective needs, and XLA aborts the
# process 40 s later ("Expected 8 threads to join the rendezvous, but only 7
# of them arrived"). One dispatching thread holds at most one launch per
# device, so devices * 3 threads leave a whole collective's worth free with
# a second dispatching thread too.
THREADS_PER_CPU_DEVICE = 3
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def backend_started() -> bool:
    """Whether JAX has started its backends (it then knows the cluster, if any)."""
    return _jax_private.backends_started()


def jax_option(name: str) -> Any:
    """The value of a `jax.config` option (attributes it makes at run time)."""
    import jax

    return getattr(jax.config, name)


def cpu_devices_requested() -> int:
    """The CPU devices JAX will make: `XLA_FLAGS` or `jax_num_cpu_devices`."""
    configured = jax_option("jax_num_cpu_devices")
    if configured and configured > 0:
        return int(configured)
    found = _DEVICE_COUNT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 1


def warn_missing_cpu_devices(found: int) -> None:
    """Warns, naming the fix, when `XLA_FLAGS` asks for more CPU devices
    than JAX made (`found`): JAX reads it once, when it starts, so it was
    set after (a notebook's cells run out of order)."""
    flags = _DEVICE_COUNT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))
    if not flags or int(flags[-1]) <= found or jax_option("jax_num_cpu_devices") > 0:
        return
    asked = int(flags[-1])
    warnings.warn(
        f"XLA_FLAGS asks for {asked} CPU devices "
        f"(--xla_force_host_platform_device_count={asked}), but JAX has {found}: "
        "it started before XLA_FLAGS was set, and reads it only when it starts. "
        "Set XLA_FLAGS before the first JAX or Keras computation (in a "
        "notebook: in the first cell, then restart the kernel and run it "
        "first).",
        UserWarning,
        stacklevel=4,
    )


def available_cores() -> int:
    """The cores this process may use (XLA's default pool size)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # macOS, Windows.


def cpu_client_threads(devices: int) -> int:
    """The threads XLA:CPU's client pool gets for `devices` devices."""
    for name in ("PJRT_NPROC", "NPROC"):  # Read by XLA when the client starts.
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return max(int(value), devices)
    return max(available_cores(), devices)


def size_cpu_thread_pool() -> None:
    """Before JAX starts: enough client threads for several CPU devices.

    Sets `PJRT_NPROC` (read by XLA when its CPU client starts) to
    `THREADS_PER_CPU_DEVICE` threads a device, where fewer would start;
    a value the user set (`PJRT_NPROC` or `NPROC`) is kept.
    """
    if "PJRT_NPROC" in os.environ or "NPROC" in os.environ:
        return
    if backend_started():
        return
    devices = cpu_devices_requested()
    wanted = THREADS_PER_CPU_DEVICE * devices
    if devices > 1 and cpu_client_threads(devices) < wanted:
        os.environ["PJRT_NPROC"] = str(wanted)
