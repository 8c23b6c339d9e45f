"""Layouts that fit the shape they are handed: `keras.distribution`'s hooks.

Keras's `DataParallel.get_data_layout(shape)` splits the first dimension over
`"batch"` whatever its size, so `keras.distribution.distribute_tensor` fails
on a batch the replicas do not divide (3 prompts on 8 replicas: JAX's
`IndivisibleError`). Libraries call these hooks themselves, outside `fit`
(keras-hub's `CausalLM.generate` lays its prompts out with
`get_data_layout(prompts.shape)`), where keras_dist's padding never runs.

keras_dist's hooks give a layout that works for the shape: a dimension whose
size the mesh axes named for it do not divide is kept whole on every device of
those axes (replicated over them). Every device then computes on all rows of
that dimension: the same numbers as one device, never an error; the work the
axis would have split is repeated instead (at most `num_replicas` rows, for a
batch that does not divide: a `fit`, `evaluate` or `predict` pads instead).
"""

from collections.abc import Sequence
from typing import Any

import keras

from keras_dist.strategies.devices._mesh import BATCH_AXIS

__all__ = ["data_layout", "fit_layout", "fitted_axes"]


def fitted_axes(
    axes: Sequence[Any], shape: Sequence[Any], sizes: dict[str, int]
) -> tuple:
    """`axes` (one mesh axis, tuple of axes or None per dimension) for `shape`.

    An axis whose mesh size does not divide its dimension becomes None; a
    dimension of unknown size (None, while Keras builds a model symbolically)
    keeps its axis. Axes shorter than the shape are padded with None (JAX's
    reading of a short `PartitionSpec`).

    Raises:
        ValueError: if `axes` has more entries than `shape` has dimensions.
    """
    axes = tuple(axes)
    if len(axes) > len(shape):
        raise ValueError(
            f"A layout with {len(axes)} axes {axes} cannot lay out a tensor of "
            f"shape {tuple(shape)}. Give one mesh axis (or None) per dimension "
            "of the tensors the `layout_map` rule matches."
        )
    axes += (None,) * (len(shape) - len(axes))
    return tuple(
        axis if dim is None or int(dim) % _parts(axis, sizes) == 0 else None
        for dim, axis in zip(shape, axes, strict=True)
    )


def data_layout(
    device_mesh: keras.distribution.DeviceMesh, shape: Sequence[Any]
) -> keras.distribution.TensorLayout:
    """A batch of `shape` split over `"batch"` on its first dimension, when the
    replicas divide it; else whole on every replica."""
    axes = (BATCH_AXIS,) if len(shape) else ()
    sizes = dict(zip(device_mesh.axis_names, device_mesh.shape, strict=True))
    return keras.distribution.TensorLayout(fitted_axes(axes, shape, sizes), device_mesh)


def fit_layout(
    layout: keras.distribution.TensorLayout, shape: Sequence[Any]
) -> keras.distribution.TensorLayout:
    """`layout` for a tensor of `shape`: itself when it already fits."""
    mesh = layout.device_mesh
    if mesh is None:  # Not yet given a mesh: Keras's own error, if any.
        return layout
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    axes = fitted_axes(layout.axes, shape, sizes)
    if axes == tuple(layout.axes):
        return layout
    return keras.distribution.TensorLayout(axes, mesh)


def _parts(axis: Any, sizes: dict[str, int]) -> int:
    parts = 1
    for name in axis if isinstance(axis, tuple) else (axis,):
        if name is not None:
            parts *= int(sizes[name])
    return parts
