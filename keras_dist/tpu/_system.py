"""`initialize_tpu_system` and the `Topology` it returns, as in `tf.tpu.experimental`.

JAX starts the TPU itself on first use, so "initializing" here means: find
the TPU, join the hosts of a pod into one JAX cluster, and describe what was
found. Calling it is optional (`TPUStrategy` does the same) but gives
tf scripts their `topology` and fails early, with the fix, without a TPU.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from keras_dist.cluster._tpu_resolver import TPUClusterResolver, joined

__all__ = ["Topology", "initialize_tpu_system"]

Coordinates = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class Topology:
    """The shape of a TPU system, as `tf.tpu.experimental.Topology`.

    Example:

    ```python
    topology = kd.tpu.initialize_tpu_system(kd.cluster.TPUClusterResolver())
    print(topology.device_kind, topology.mesh_shape, topology.num_tasks)
    ```

    Attributes:
        device_kind: JAX's name of the TPU generation, e.g. `"TPU v5 lite"`
            (v5e), `"TPU v6 lite"` (v6e), `"TPU v4"`, `"TPU v3"`.
        mesh_shape: `(x, y, z, cores_per_chip)` of one slice: chips along
            each axis of the interconnect, and devices per chip (2 on v2/v3,
            1 on v4 and later, whose two cores form one "megacore" device).
        num_tasks: hosts (JAX processes) of the system.
        num_tpus_per_task: TPU devices per host.
        num_slices: slices joined over the data-center network (multislice).
        device_coordinates: per host (by process index), per device (by
            id): `(x, y, z, core)`.
    """

    device_kind: str
    mesh_shape: Coordinates
    num_tasks: int
    num_tpus_per_task: int
    num_slices: int = 1
    device_coordinates: tuple[tuple[Coordinates, ...], ...] = dataclasses.field(
        default=(), repr=False
    )

    @property
    def cores_per_chip(self) -> int:
        """Devices per chip: 2 on v2/v3, 1 on v4 and later."""
        return self.mesh_shape[3]

    @property
    def num_chips(self) -> int:
        """Chips of all slices."""
        x, y, z, _ = self.mesh_shape
        return x * y * z * self.num_slices

    @property
    def num_devices(self) -> int:
        """TPU devices of all hosts: the replicas of a `TPUStrategy`."""
        return self.num_tasks * self.num_tpus_per_task

    @classmethod
    def from_devices(cls, devices: Sequence[Any]) -> "Topology":
        """Describes the TPU devices given (TPU `jax.Device`s, or fakes with
        `device_kind`, `coords`, `core_on_chip`, `process_index`, `slice_index`).

        Raises:
            ValueError: for no devices, or hosts with different device counts.
        """
        if not devices:
            raise ValueError("`devices` must hold at least one TPU device.")
        tasks: dict[int, list] = {}
        for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
            tasks.setdefault(d.process_index, []).append(d)
        counts = {process: len(local) for process, local in tasks.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                "Every TPU host must have the same number of devices. Received: "
                f"devices per host {counts}. Pass all the devices of the system."
            )
        places = [(*d.coords, d.core_on_chip) for d in devices]
        shape = tuple(
            max(p[i] for p in places) - min(p[i] for p in places) + 1 for i in range(4)
        )
        return cls(
            device_kind=devices[0].device_kind,
            mesh_shape=shape,
            num_tasks=len(tasks),
            num_tpus_per_task=len(devices) // len(tasks),
            num_slices=len({getattr(d, "slice_index", 0) or 0 for d in devices}),
            device_coordinates=tuple(
                tuple((*d.coords, d.core_on_chip) for d in local)
                for local in tasks.values()
            ),
        )

    def __str__(self) -> str:
        x, y, z, cores = self.mesh_shape
        chips = f"{_plural(x * y * z, 'chip')} ({x}x{y}x{z})"
        if self.num_slices > 1:
            chips = f"{self.num_slices} slices of {chips}"
        return (
            f"{self.device_kind}: {chips}, {_plural(cores, 'device')} per chip, "
            f"{_plural(self.num_devices, 'device')} on "
            f"{_plural(self.num_tasks, 'host')}"
        )


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def initialize_tpu_system(resolver: TPUClusterResolver | None = None) -> Topology:
    """Finds the TPU, joins a pod's hosts, and returns its `Topology`.

    `tf.tpu.experimental.initialize_tpu_system`'s counterpart. JAX starts
    the TPU on first use; this joins the hosts of a pod slice into one JAX
    cluster (every host must run the program) and describes the system.

    Example:

    ```python
    resolver = kd.cluster.TPUClusterResolver()
    topology = kd.tpu.initialize_tpu_system(resolver)
    print(topology)  # TPU v5 lite: 8 chips (4x2x1), 1 device per chip, ...
    strategy = kd.TPUStrategy(resolver)
    ```

    Args:
        resolver: a `kd.cluster.TPUClusterResolver`; defaults to a new one.

    Returns:
        The `Topology` of every TPU device of the cluster.

    Raises:
        keras_dist.errors.TPUNotFoundError: (a `ValueError`) without a TPU.
        TypeError: if `resolver` is not a `TPUClusterResolver`.
    """
    resolver = joined(
        resolver,
        argument="resolver",
        example="kd.tpu.initialize_tpu_system(kd.cluster.TPUClusterResolver())",
    )
    return Topology.from_devices(resolver.devices)
