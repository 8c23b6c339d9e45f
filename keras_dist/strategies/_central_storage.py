"""`CentralStorageStrategy`: compute replicated, variables in host memory."""

import functools
import warnings
from collections.abc import Sequence

import jax

from keras_dist.errors import DeviceNotFoundError
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._devices import (
    device_name,
    resolve_device,
    resolve_devices,
    visible_devices,
)
from keras_dist.strategies.state import _host_memory
from keras_dist.strategies.state._state_layout import HostMemoryStateLayout

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(Strategy):
    """Synchronous training on the local devices, variables kept in host memory.

    Like `tf.distribute.experimental.CentralStorageStrategy`: the computation
    is replicated on every compute device, each global batch is split over
    them, and the variables and the optimizer state are stored centrally
    rather than on the devices: with several compute devices, in host
    memory. `model.fit/evaluate/predict`, the replica API (`run`, `reduce`,
    ...) and callbacks work as with `MirroredStrategy`, with the numbers of
    one device.

    Example:

    ```python
    strategy = keras_dist.CentralStorageStrategy()   # every local GPU/TPU, else CPU
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64)                   # 64 = global batch
    strategy.memory_report(model)                    # memory kind of each variable
    ```

    Kept from tf: the signature; compute replicated on `compute_devices`
    (default: every GPU/TPU, else the CPU); tf's rule for the parameters:
    with exactly one compute device and no `parameter_device`, they stay on
    that device (device memory, nothing offloaded), otherwise they are kept
    off the accelerators; `parameter_device="cpu:0"` means host memory.

    What differs, because JAX runs one SPMD program over a mesh rather than
    one graph per device: there is no separate parameter-server device that
    replicas read from and write to. "Central" is host memory: each variable
    is one replicated JAX array of memory kind `"pinned_host"` (the host
    memory space of each compute device; on CPU these are the same RAM).
    Each compiled step copies the state into device memory first,
    computes (gradients are all-reduced over the devices, as in
    `MirroredStrategy`) and writes the new state back to host memory as its
    outputs, so device memory holds the state only while a step runs.
    Reading or assigning variables (`get_weights`, `set_weights`, saving,
    callbacks) works as usual; eager JAX operations that mix a variable's
    host array with device arrays are refused by JAX, so a variable is read
    in device memory where it joins a computation (`model(x)`, `kernel[0]`,
    Keras's ops) and as stored where it is read directly. On
    a platform without pinned host memory the variables stay in device
    memory, with a warning. The parameters cannot be put on one accelerator
    of several: `parameter_device` is a CPU device or the one compute device.

    Args:
        compute_devices: the devices to replicate the computation over, as
            strings (`"gpu:0"`, `"/gpu:1"`, `"cpu:3"`) or `jax.Device`s.
            Defaults to `None`: every device of JAX's default backend in this
            process.
        parameter_device: where the variables live: a CPU device (`"cpu:0"`,
            `"/cpu:0"`): host memory (with a single CPU compute device, its
            own memory, which is host RAM); or the single compute device: its
            device memory. Defaults to `None`: the compute device when there
            is exactly one, else host memory.

    Raises:
        ValueError: if `compute_devices` is empty, has duplicates or mixes
            kinds, or `parameter_device` is an accelerator that is not the
            single compute device.
        keras_dist.errors.DeviceNotFoundError: if a device is not visible.
    """

    def __init__(
        self,
        compute_devices: Sequence["str | jax.Device"] | None = None,
        parameter_device: "str | jax.Device | None" = None,
    ):
        devices = resolve_devices(compute_devices, argument="compute_devices")
        place = _parameter_place(parameter_device, devices)
        self._parameter_device, self._memory_kind = place
        super().__init__(
            devices,
            state_layout=functools.partial(
                HostMemoryStateLayout, memory_kind=self._memory_kind
            ),
        )

    @property
    def compute_devices(self) -> tuple[jax.Device, ...]:
        """The devices the computation is replicated on."""
        return self.devices

    @property
    def parameter_device(self) -> str:
        """Where the variables live: `"cpu:0"` (host memory) or the device."""
        return self._parameter_device

    @property
    def parameter_memory_kind(self) -> str:
        """The JAX memory kind of the variables: `"pinned_host"` or `"device"`."""
        return self._memory_kind


def _parameter_place(
    parameter_device: "str | jax.Device | None", devices: Sequence[jax.Device]
) -> tuple[str, str]:
    """(name of the parameter device, memory kind of the variables): tf's rule."""
    if parameter_device is None:
        if len(devices) == 1:
            return device_name(devices[0]), _host_memory.DEVICE
        return _host_place(devices, "cpu:0")
    try:
        device = resolve_device(parameter_device, argument="parameter_device")
    except DeviceNotFoundError as error:
        raise DeviceNotFoundError(
            f"`parameter_device` is not visible to this process. Received: "
            f"parameter_device={parameter_device!r}. Visible devices: "
            f"{visible_devices()}. Pass a CPU device (`parameter_device="
            '"cpu:0"`: host memory) or `parameter_device=None`.'
        ) from error
    if device.platform == "cpu":
        if len(devices) == 1 and devices[0].platform == "cpu":
            # One CPU computes: its device memory is host RAM already (and
            # XLA:CPU aborts one-device programs with pinned_host outputs).
            return device_name(devices[0]), _host_memory.DEVICE
        return _host_place(devices, device_name(device))
    if len(devices) == 1 and device == devices[0]:
        return device_name(device), _host_memory.DEVICE
    raise ValueError(
        "`parameter_device` must be a CPU device (host memory) or the single "
        "compute device: in one SPMD program a variable lives in every "
        "compute device's memory or in host memory, not on one accelerator "
        f"that the others read. Received: parameter_device={parameter_device!r}, "
        f"compute_devices={[device_name(d) for d in devices]}. Pass "
        '`parameter_device="cpu:0"` or `parameter_device=None`.'
    )


def _host_place(devices: Sequence[jax.Device], name: str) -> tuple[str, str]:
    kind = _host_memory.host_memory_kind(devices)
    if kind is None:
        warnings.warn(
            f"The devices {[device_name(d) for d in devices]} have no "
            f"{_host_memory.HOST!r} memory: CentralStorageStrategy keeps the "
            "variables in device memory (replicated, as MirroredStrategy).",
            stacklevel=3,
        )
        return device_name(devices[0]), _host_memory.DEVICE
    return name, kind
