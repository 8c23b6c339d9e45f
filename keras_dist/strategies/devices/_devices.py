"""Turn what a tf.distribute user types into JAX devices.

Accepted forms: `"gpu:0"`, `"/gpu:0"`, `"/GPU:0"`, `"/device:GPU:0"`,
`"/job:localhost/replica:0/task:0/device:GPU:0"`, `"cpu:3"`, `"tpu:1"`,
and `jax.Device` objects. The index is the position among this process's
devices of that kind, as in TensorFlow.
"""

import re
from collections.abc import Iterable, Sequence

import jax

from keras_dist._backend import warn_missing_cpu_devices
from keras_dist.errors import DeviceNotFoundError

_DEVICE_RE = re.compile(
    r"^(?:/job:[\w-]+)?(?:/replica:\d+)?(?:/task:\d+)?"
    r"(?:/?device:|/)?(?P<kind>[A-Za-z]+):(?P<index>\d+)$"
)
_KIND_TO_PLATFORM = {
    "cpu": "cpu",
    "gpu": "gpu",
    "cuda": "gpu",
    "rocm": "gpu",
    "tpu": "tpu",
}
_FORMS = (
    '"gpu:0", "/gpu:0", "/GPU:0", '
    '"/job:localhost/replica:0/task:0/device:GPU:0", "cpu:3"'
)


def visible_devices() -> list[str]:
    """Names of every device this process can see, e.g. `["cpu:0", "cpu:1"]`."""
    names: list[str] = []
    for platform in ("cpu", "gpu", "tpu"):
        names.extend(f"{platform}:{i}" for i in range(len(_local_devices(platform))))
    return names


def _local_devices(platform: str) -> list[jax.Device]:
    try:
        return jax.local_devices(backend=platform)
    except RuntimeError:  # The backend is not present in this installation.
        return []


def resolve_device(
    device: "str | jax.Device", *, argument: str = "device"
) -> jax.Device:
    """Returns the `jax.Device` for one device spec.

    Args:
        device: a device string in any tf.distribute form, or a `jax.Device`.
        argument: the name of the argument, used in error messages.

    Raises:
        TypeError: if `device` is neither a string nor a `jax.Device`.
        ValueError: if the string is not a device spec.
        DeviceNotFoundError: if the device does not exist in this process.
    """
    if isinstance(device, jax.Device):
        if device.process_index != jax.process_index():
            raise DeviceNotFoundError(
                f"`{argument}` must be a device of this process "
                f"(process {jax.process_index()}). Received: {argument}={device!r} "
                f"of process {device.process_index}."
            )
        return device
    if not isinstance(device, str):
        raise TypeError(
            f'`{argument}` must be a device string such as "gpu:0" or a '
            f"`jax.Device`. Received: {argument}={device!r} of type "
            f"{type(device).__name__}."
        )
    match = _DEVICE_RE.match(device.strip())
    kind = match and _KIND_TO_PLATFORM.get(match["kind"].lower())
    if not match or kind is None:
        raise ValueError(
            f"`{argument}` is not a device spec. Received: {argument}={device!r}. "
            f"Expected one of the forms {_FORMS}. Visible devices: "
            f"{visible_devices()}."
        )
    index = int(match["index"])
    candidates = _local_devices(kind)
    if index >= len(candidates):
        raise DeviceNotFoundError(
            f"Device {device!r} is not visible to this process. Received: "
            f"{argument}={device!r}. Visible devices: {visible_devices()}. "
            "Pick one of those, or pass `devices=None` to use all of them."
        )
    return candidates[index]


def resolve_devices(
    devices: "Iterable[str | jax.Device] | None", *, argument: str = "devices"
) -> tuple[jax.Device, ...]:
    """Returns the devices of a strategy; `None` means every local device.

    `None` selects the local devices of JAX's default backend: all GPUs or
    TPUs when present, otherwise the CPU devices, like `MirroredStrategy()`.

    Raises:
        TypeError: if `devices` is a single string instead of a list.
        ValueError: if the list is empty, has duplicates or mixes platforms.
        DeviceNotFoundError: if an entry does not exist in this process.
    """
    if devices is None:
        found = tuple(jax.local_devices())
        if all(d.platform == "cpu" for d in found):
            warn_missing_cpu_devices(len(found))
        return found
    if isinstance(devices, (str, jax.Device)):
        raise TypeError(
            f"`{argument}` must be a list of devices. Received: "
            f"{argument}={devices!r}. Wrap it in a list: "
            f"{argument}=[{devices!r}]."
        )
    specs: Sequence = list(devices)
    if not specs:
        raise ValueError(
            f"`{argument}` must name at least one device. Received: "
            f"{argument}=[]. Pass `devices=None` to use every local device "
            f"({visible_devices()})."
        )
    resolved = tuple(resolve_device(d, argument=argument) for d in specs)
    seen: dict[jax.Device, object] = {}
    for spec, dev in zip(specs, resolved, strict=True):
        if dev in seen:
            raise ValueError(
                f"`{argument}` names the same device twice: {seen[dev]!r} and "
                f"{spec!r} are both {dev}. Received: {argument}={specs!r}. "
                "Each replica needs its own device; remove the duplicate."
            )
        seen[dev] = spec
    platforms = {d.platform for d in resolved}
    if len(platforms) > 1:
        raise ValueError(
            f"`{argument}` mixes device kinds {sorted(platforms)}. Received: "
            f"{argument}={specs!r}. All replicas must run on one kind of device."
        )
    return resolved


def device_name(device: jax.Device) -> str:
    """`"cpu:3"`-style name of a device, as accepted by `resolve_device`."""
    local = _local_devices(device.platform)
    index = local.index(device) if device in local else device.id
    return f"{device.platform}:{index}"
