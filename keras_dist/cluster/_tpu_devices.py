"""Finding the TPU: JAX's TPU devices, the hosts of a pod, and what hides them.

Two things take a TPU away from JAX without JAX saying why in terms a
tf.distribute user recognizes: another framework in the same process (the
full `tensorflow` package loads libtpu and claims the chips; `tensorflow-cpu`
does not) and another process on the VM (a second notebook kernel). The
error raised here names what was found instead, and the fix.
"""

import importlib.metadata
import sys

import jax

from keras_dist._private_api import _jax_private
from keras_dist.errors import TPUNotFoundError

__all__ = ["cloud_tpu_hosts", "full_tensorflow", "visible_tpu_devices"]

# Distributions that install the `tensorflow` module with TPU support.
_FULL_TENSORFLOW = ("tensorflow", "tensorflow-tpu", "tf-nightly", "tf-nightly-tpu")
# keras-dist's `tpu` extra, as pip can install it (the index does not serve
# keras-dist): JAX with libtpu, in keras_dist's range.
_INSTALL = 'pip install "jax[tpu]>=0.10,<0.13"'
_FALLBACK = (
    "To use a TPU when there is one and the local devices otherwise, catch the "
    "error as the tf.distribute tutorials do:\n\n"
    "    try:\n"
    "        strategy = kd.TPUStrategy(kd.cluster.TPUClusterResolver())\n"
    "    except ValueError:\n"
    "        strategy = kd.MirroredStrategy()"
)


def full_tensorflow() -> str | None:
    """`"tensorflow 2.x"` if a TPU-capable TensorFlow is imported in this process.

    `tensorflow-cpu` (what keras_dist needs for `tf.data`) gives `None`.
    """
    if sys.modules.get("tensorflow") is None:  # Not imported, or blocked.
        return None
    for name in _FULL_TENSORFLOW:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cloud_tpu_hosts() -> tuple[int, int | None] | None:
    """`(hosts, this host's index)` of a Cloud TPU slice or pod, else `None`.

    Read the way `jax.distributed.initialize()` reads it (the TPU VM's
    metadata server, or the GKE variables), without starting the TPU: a pod
    must join its cluster before JAX touches any device.
    """
    return _jax_private.cloud_tpu_hosts()


def visible_tpu_devices(*, tpu: str | None = None) -> tuple:
    """Every TPU device JAX sees (all hosts once the cluster is joined).

    Args:
        tpu: the user's `tpu` argument, quoted in the error.

    Raises:
        TPUNotFoundError: (a `ValueError`) if JAX has no TPU, naming what it
            has instead and the fix.
    """
    try:
        devices = tuple(jax.devices("tpu"))
    except RuntimeError as error:  # No TPU backend, or it failed to start.
        raise not_found_error(tpu, reason=str(error)) from None
    if not devices:
        raise not_found_error(tpu, reason="the TPU backend has no devices")
    return devices


def not_found_error(tpu: str | None, *, reason: str) -> TPUNotFoundError:
    """The error for "no TPU here": what JAX found, why, and what to do."""
    busy = any(word in reason.lower() for word in ("in use", "busy"))
    reason = reason.strip().splitlines()[0][:300] if reason.strip() else "unknown"
    message = (
        f"No TPU is visible to JAX: it found {_platform_found()}; the TPU "
        f"backend says: {reason}. Received: tpu={tpu!r}. On Colab choose "
        "Runtime > Change runtime type > TPU; on Kaggle the TPU VM accelerator; "
        f"on a Cloud TPU VM install JAX's TPU support: {_INSTALL}."
    )
    tensorflow = full_tensorflow()
    if tensorflow is not None:
        message += (
            f" A full TensorFlow ({tensorflow}) is loaded in this process: on a "
            "TPU VM it claims the TPU before JAX can. keras_dist uses TensorFlow "
            "only for tf.data, which the CPU build runs: pip uninstall -y "
            "tensorflow && pip install tensorflow-cpu, then restart Python."
        )
    if busy:
        message += (
            " Only one process can hold a TPU: stop the other Python process "
            "using it (another notebook kernel, a TensorFlow program)."
        )
    return TPUNotFoundError(f"{message} {_FALLBACK}")


def _platform_found() -> str:
    try:
        devices = jax.devices()
    except RuntimeError:
        return "no device"
    count = f"{len(devices)} device{'s' if len(devices) > 1 else ''}"
    return f"platform {devices[0].platform!r} ({count})"
