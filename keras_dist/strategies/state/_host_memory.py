"""State in host memory: a layout whose arrays live in a device's host memory.

JAX gives each device several memory spaces (`device.addressable_memories()`):
`"device"` (HBM on a GPU/TPU, the default) and `"pinned_host"` (page-locked
host RAM that the device reads by DMA), among others. A
`NamedSharding(..., memory_kind="pinned_host")` array is laid out like any
other, but its bytes sit in host memory.

Eager JAX ops refuse to mix memory spaces (`memory_space of all inputs passed
to 'dot_general' must be the same`), so a step cannot compute on host arrays
directly: compiled steps move the state into device memory as their first
operation and give their new state back in host memory (the step's
`out_shardings`); eager steps do the same with `jax.device_put` around the
call (`_seams/_trainer.py` connects both to Keras's trainer).
"""

from typing import Any

import jax
import keras
from jax.sharding import NamedSharding, PartitionSpec

from keras_dist.strategies.devices._lay_out import lay_out

__all__ = ["DEVICE", "HOST", "MemoryLayout", "host_memory_kind", "move"]

DEVICE = "device"
HOST = "pinned_host"


class MemoryLayout(keras.distribution.TensorLayout):
    """A `keras.distribution.TensorLayout` in a given memory of the devices.

    Keras turns a variable's layout into a `jax.sharding.NamedSharding`
    through `backend_layout`; this one adds the memory kind.

    Args:
        axes: the mesh axis of each dimension (`None`: not split).
        device_mesh: the `keras.distribution.DeviceMesh`.
        memory_kind: a JAX memory kind of the mesh's devices, e.g.
            `"pinned_host"`.
    """

    def __init__(self, axes, device_mesh, *, memory_kind: str):
        super().__init__(axes, device_mesh)
        self._memory_kind = memory_kind
        self._sharding: NamedSharding | None = None

    @property
    def memory_kind(self) -> str:
        return self._memory_kind

    @property
    def backend_layout(self) -> NamedSharding:
        if self._sharding is None:
            self._sharding = NamedSharding(
                self.device_mesh.backend_mesh,
                PartitionSpec(*self.axes),
                memory_kind=self._memory_kind,
            )
        return self._sharding

    def __repr__(self) -> str:
        return (
            f"<MemoryLayout axes={self.axes}, memory_kind={self._memory_kind!r}, "
            f"device_mesh={self.device_mesh}>"
        )


def host_memory_kind(devices) -> str | None:
    """`"pinned_host"` when every device has that memory, else `None`."""
    for device in devices:
        kinds = {memory.kind for memory in device.addressable_memories()}
        if HOST not in kinds:
            return None
    return HOST


def move(state: Any, sharding: NamedSharding) -> Any:
    """Every array of `state` laid out by `sharding` (inside `jit` too)."""
    return jax.tree.map(lambda x: lay_out(x, sharding), state)
