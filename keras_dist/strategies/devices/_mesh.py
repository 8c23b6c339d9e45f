"""A strategy's device mesh: `("batch",)`, or `("batch", "model")`.

Data parallelism alone is a 1-D mesh over every device, the axis `"batch"`.
With `model_parallel=k` (or a `keras.distribution.LayoutMap`, whose mesh
then decides the shape) the mesh is 2-D, `("batch", "model")` of shape
`(N / k, k)`: a *replica* is a row of k devices that hold one model between
them (as tf.distribute's TPU model parallelism had cores per replica), and a
global batch is split over the rows only.

Devices go into the mesh in the order the strategy resolved them (TPU
strategies: topology order), row by row, so the k devices of a replica are
neighbours: the model axis, whose collectives run every layer, takes the
fastest links, and with several processes it stays inside each process
(hosts talk over the slower network on `"batch"` only).
"""

from collections.abc import Sequence
from typing import Any

import jax
import keras
import numpy as np

__all__ = [
    "BATCH_AXIS",
    "MODEL_AXIS",
    "build_device_mesh",
    "check_model_parallel",
    "made_layout_map",
]

# The mesh axis the global batch is split along (Keras's `DataParallel` name).
BATCH_AXIS = "batch"
MODEL_AXIS = "model"


def check_model_parallel(model_parallel: Any, layout_map: Any) -> None:
    """Checks the two options alone, before a strategy joins a cluster.

    Raises:
        TypeError: if `model_parallel` is not an int or `layout_map` not a
            `keras.distribution.LayoutMap`.
        ValueError: if `model_parallel` is below 1.
    """
    if isinstance(model_parallel, bool) or not isinstance(
        model_parallel, (int, np.integer)
    ):
        raise TypeError(
            "`model_parallel` must be a positive int: the devices that hold "
            f"one model between them. Received: model_parallel={model_parallel!r}."
        )
    if model_parallel < 1:
        raise ValueError(
            "`model_parallel` must be at least 1 (1: data parallelism only). "
            f"Received: model_parallel={model_parallel}."
        )
    if layout_map is not None and not (
        isinstance(layout_map, keras.distribution.LayoutMap) or callable(layout_map)
    ):
        raise TypeError(
            "`layout_map` must be a `keras.distribution.LayoutMap`, or a function "
            "that makes one from the strategy's `DeviceMesh` (e.g. "
            "`keras_hub.models.GemmaBackbone.get_layout_map`). "
            f"Received: layout_map={layout_map!r}."
        )


def build_device_mesh(
    devices: Sequence[jax.Device],
    *,
    model_parallel: int = 1,
    layout_map: "keras.distribution.LayoutMap | None" = None,
) -> keras.distribution.DeviceMesh:
    """The strategy's `keras.distribution.DeviceMesh` over `devices`.

    Args:
        devices: the strategy's devices, in order (all processes).
        model_parallel: devices per replica (the `"model"` axis); 1 gives
            the 1-D mesh `("batch",)`.
        layout_map: a `LayoutMap` whose mesh is the strategy's: its shape
            decides the replicas; its devices must be `devices`. (A function
            making one is called later, with the mesh `model_parallel` gives.)

    Raises:
        ValueError: if `model_parallel` does not divide the devices (or each
            process's devices), or the layout map's mesh does not fit.
    """
    check_model_parallel(model_parallel, layout_map)
    devices = list(devices)
    if isinstance(layout_map, keras.distribution.LayoutMap):
        return _mesh_of_layout_map(devices, model_parallel, layout_map)
    if layout_map is not None and model_parallel == 1:
        raise ValueError(
            "A `layout_map` function needs the size of the model axis to make "
            "the mesh it is given. Received: model_parallel=1 with "
            f"layout_map={layout_map!r}. Pass `model_parallel=k` (the devices "
            "per replica), or a `LayoutMap` made on your own mesh."
        )
    count = len(devices)
    if model_parallel == 1:
        return keras.distribution.DeviceMesh(
            shape=(count,), axis_names=[BATCH_AXIS], devices=np.array(devices)
        )
    if count % model_parallel:
        raise ValueError(
            f"`model_parallel` must divide the number of devices ({count}). "
            f"Received: model_parallel={model_parallel}. Use a divisor of "
            f"{count}, e.g. {_divisors(count)}."
        )
    by_process: dict[int, int] = {}
    for device in devices:
        by_process[device.process_index] = by_process.get(device.process_index, 0) + 1
    local = min(by_process.values())
    if len(by_process) > 1 and any(n % model_parallel for n in by_process.values()):
        fix = (
            f"Use a divisor of {local}."
            if local > 1
            else "Start one process per host with all its devices (e.g. "
            "`srun --ntasks-per-node=1`, `keras-dist-run --devices-per-process "
            f"{model_parallel}`), or use model_parallel=1."
        )
        raise ValueError(
            "`model_parallel` must divide each process's devices: the model "
            "axis has to stay inside a host, where a replica's devices share "
            "fast links (it runs collectives every layer). Received: "
            f"model_parallel={model_parallel} with {local} device"
            f"{'s' if local > 1 else ''} per process. {fix}"
        )
    grid = np.array(devices, dtype=object).reshape(
        count // model_parallel, model_parallel
    )
    return keras.distribution.DeviceMesh(
        shape=grid.shape, axis_names=[BATCH_AXIS, MODEL_AXIS], devices=grid
    )


def made_layout_map(
    make: Any, device_mesh: keras.distribution.DeviceMesh
) -> keras.distribution.LayoutMap:
    """`make(device_mesh)`, checked to be a `LayoutMap` on that mesh.

    Raises:
        TypeError: if the function returns something else.
    """
    layout_map = make(device_mesh)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise TypeError(
            "The `layout_map` function must return a `keras.distribution."
            f"LayoutMap` for the mesh it is given. {make!r} returned "
            f"{layout_map!r}."
        )
    return layout_map


def _mesh_of_layout_map(
    devices: list, model_parallel: int, layout_map: keras.distribution.LayoutMap
) -> keras.distribution.DeviceMesh:
    mesh = layout_map.device_mesh
    names = tuple(mesh.axis_names)
    if names != (BATCH_AXIS, MODEL_AXIS):
        raise ValueError(
            "The mesh of `layout_map` must have the axes "
            f'("{BATCH_AXIS}", "{MODEL_AXIS}"), in that order. Received axis_names='
            f"{names}. Build it with `keras.distribution.DeviceMesh(shape, "
            f'axis_names=("{BATCH_AXIS}", "{MODEL_AXIS}"), devices=...)`, or pass '
            "`model_parallel=k` and take `strategy.device_mesh` for keras-hub's "
            "`get_layout_map`."
        )
    grid = np.asarray(mesh.devices)
    if not all(isinstance(d, jax.Device) for d in grid.flat):
        grid = np.array(
            [_as_jax_device(d, devices) for d in grid.flat], dtype=object
        ).reshape(grid.shape)
    if sorted(d.id for d in grid.flat) != sorted(d.id for d in devices):
        raise ValueError(
            "The mesh of `layout_map` must be over the strategy's devices. "
            f"Received a mesh of {grid.size} devices for a strategy of "
            f"{len(devices)}. Make the layout map from `strategy.device_mesh`, or "
            "give the strategy the mesh's devices."
        )
    if model_parallel not in (1, grid.shape[1]):
        raise ValueError(
            "`model_parallel` and the mesh of `layout_map` disagree. Received: "
            f"model_parallel={model_parallel} and a mesh of shape {grid.shape}. "
            "Pass one of them (the layout map's mesh decides the shape)."
        )
    return keras.distribution.DeviceMesh(
        shape=grid.shape, axis_names=list(names), devices=grid
    )


def _as_jax_device(device: Any, devices: list) -> jax.Device:
    """A Keras device string (`"cpu:3"`) of a mesh as one of `devices`."""
    name = str(device).lower()
    for candidate in devices:
        if name in (f"{candidate.platform}:{candidate.id}", str(candidate).lower()):
            return candidate
    raise ValueError(
        f"The mesh of `layout_map` names a device the strategy does not have: "
        f"{device!r}. Make the layout map from `strategy.device_mesh`."
    )


def _divisors(count: int) -> list[int]:
    return [d for d in range(1, count + 1) if count % d == 0]
