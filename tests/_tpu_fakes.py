"""Fake TPU devices: what `jax.devices()` reports on each TPU generation.

Modeled on JAX's own `MockTpuDevice` / `mock_tpu_devices` in
jax-ml/jax tests/mesh_utils_test.py: the same attributes and the same ids
(x-minor over the whole slice: `id = core + cores * (x + X * (y + Y * (z + Z
* slice)))`). One difference: JAX's mock always puts 2x2 chips on a host;
here the host's block of chips is a parameter, because a v5e-8/v6e-8 VM
holds all 8 chips (4x2) on one host and a v2-8/v3-8 its 4 chips.
"""

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class FakeTpuDevice:
    id: int
    platform: str
    device_kind: str
    process_index: int
    coords: Sequence[int]
    core_on_chip: int
    slice_index: int = 0


def fake_tpu_devices(
    x: int,
    y: int,
    z: int,
    kind: str,
    *,
    cores_per_chip: int = 1,
    host: tuple[int, int, int] | None = None,
    num_slices: int = 1,
) -> list[FakeTpuDevice]:
    """The devices of `num_slices` slices of x*y*z chips, hosts of `host` chips.

    `host=None`: one host per slice holds all its chips.
    """
    hx, hy, hz = host or (x, y, z)
    nx, ny, nz = x // hx, y // hy, z // hz
    devices = []
    for s in range(num_slices):
        for k in range(z):
            for j in range(y):
                for i in range(x):
                    process = i // hx + nx * (j // hy + ny * (k // hz + nz * s))
                    for core in range(cores_per_chip):
                        chip = i + x * (j + y * (k + z * s))
                        devices.append(
                            FakeTpuDevice(
                                id=core + cores_per_chip * chip,
                                platform="tpu",
                                device_kind=kind,
                                process_index=process,
                                coords=(i, j, k),
                                core_on_chip=core,
                                slice_index=s,
                            )
                        )
    return sorted(devices, key=lambda d: d.id)


def ids(devices) -> list[int]:
    return [d.id for d in devices]
