"""The order of TPU devices along a strategy's 1-D `"batch"` mesh.

JAX's `mesh_utils` knows each TPU generation's network: it lays a 1-D mesh
along the physical ring of a tray (v2/v3: `_TRAY_RING_ORDER`, two cores per
chip; v5e/v6e: `_V5E_TRAY_RING_ORDER`; v4i: `_TRAY_2x2_RING_ORDER`) and
along the torus axes elsewhere (v4/v5p, one device per chip). keras_dist
adds one rule on top: each host's devices stay together, host after host,
slice after slice — `create_hybrid_device_mesh` with the hosts as granules.
The input pipeline gives each process one contiguous block of rows of every
global batch (`Placement.process_rows`), which a mesh interleaving the hosts
(`create_device_mesh` over a whole v4 pod slice does) would not allow. On
one host this is exactly `create_device_mesh((n,), devices)`; with one host
per slice, exactly `create_hybrid_device_mesh((n,), (slices,), devices)`.
"""

import warnings
from collections.abc import Sequence
from typing import Any

from jax.experimental import mesh_utils

__all__ = ["tpu_device_order"]


def tpu_device_order(devices: Sequence[Any], model_parallel: int = 1) -> list:
    """TPU devices in topology order for a 1-D data-parallel mesh, or, with
    `model_parallel=k`, row by row for a 2-D `(n / k, k)` mesh whose model
    axis JAX lays along the fastest links (each k devices in a row share a
    host).

    Works on any objects with the attributes of a TPU `jax.Device`: `id`,
    `platform`, `device_kind`, `coords`, `core_on_chip`, `process_index`
    and `slice_index` (fake devices in tests). The input order does not
    matter.

    Args:
        devices: every device of the TPU system (all hosts, all slices).
        model_parallel: devices per replica (a divisor of each host's
            devices; `build_device_mesh` checks it). Defaults to 1.

    Returns:
        The same devices, reordered: slice by slice, host by host, and within
        a host along the order JAX's `mesh_utils.create_device_mesh` gives.
        If JAX cannot place the devices (an incomplete slice), a warning and
        the order `(slice, host, id)`, which trains identically, only with
        slower collectives.

    Raises:
        ValueError: for no devices, non-TPU devices, several device kinds, or
            hosts with different numbers of devices.
    """
    devices = sorted(
        devices, key=lambda d: (_slice(d), d.process_index, d.id)
    )  # JAX's ring orders for v2/v3 assume `jax.devices()`'s id order.
    _check(devices)
    processes = {d.process_index for d in devices}
    granule = "process_index" if len(processes) > 1 else "slice_index"
    counts = _group_sizes(devices, granule)
    try:
        k = model_parallel if counts[0] % model_parallel == 0 else 1
        per_granule = (counts[0] // k, k) if k > 1 else (counts[0],)
        if len(counts) == 1:
            mesh = mesh_utils.create_device_mesh(per_granule, devices)
        else:
            mesh = mesh_utils.create_hybrid_device_mesh(
                per_granule,
                (len(counts), 1) if k > 1 else (len(counts),),
                devices,
                process_is_granule=granule == "process_index",
                should_sort_granules_by_key=False,  # Already (slice, host) order.
            )
    except (AssertionError, NotImplementedError, ValueError) as error:
        warnings.warn(
            f"keras_dist could not order the {len(devices)} "
            f"{devices[0].device_kind} devices by topology ({error}); using "
            "their ids' order. Training is the same; collectives may be slower.",
            RuntimeWarning,
            stacklevel=2,
        )
        return devices
    return list(mesh.flat)


def _slice(device) -> int:
    return getattr(device, "slice_index", 0) or 0


def _group_sizes(devices: list, granule: str) -> list[int]:
    sizes: dict[int, int] = {}
    for d in devices:
        key = d.process_index if granule == "process_index" else _slice(d)
        sizes[key] = sizes.get(key, 0) + 1
    if len(set(sizes.values())) > 1:
        name = "host" if granule == "process_index" else "slice"
        raise ValueError(
            f"Every TPU {name} must have the same number of devices. Received: "
            f"devices per {name} {sizes}. Pass all the devices of the TPU system."
        )
    return list(sizes.values())


def _check(devices: list) -> None:
    if not devices:
        raise ValueError("`devices` must hold at least one TPU device. Received: [].")
    platforms = sorted({d.platform for d in devices})
    if platforms != ["tpu"]:
        raise ValueError(
            f"`devices` must all be TPU devices. Received: platforms {platforms}. "
            "Order other devices with `kd.MirroredStrategy(devices)`."
        )
    kinds = sorted({d.device_kind for d in devices})
    if len(kinds) > 1:
        raise ValueError(
            f"`devices` mix TPU generations {kinds}. Received: {len(devices)} "
            "devices. A strategy runs on one kind of TPU."
        )
