"""Rows of a dataset laid out on the mesh, gathered on the devices by index.

A device-resident dataset (`keras_dist/data/_resident.py`) is laid out once
with its rows split over the replicas: replica `r` holds rows
`r * m ... (r + 1) * m - 1`. A step's global batch is the rows named by an
index vector, which every device receives whole (a few bytes a row). Each
device takes the requested rows it holds, zeros elsewhere, and one
reduce-scatter over the batch axis gives every replica its share of the
batch: replica `r` gets batch rows `r * b ... (r + 1) * b - 1`, the layout of
`shard`. Each value is the sum of itself and zeros, so the batch is exactly
the rows, bit for bit. An index of -1 (or any index outside the dataset)
gives a row of zeros: the padding of a partial batch.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

__all__ = ["take_rows"]

_AXIS = "batch"


def take_rows(
    mesh: Mesh, dataset: Sequence[jax.Array], indices: jax.Array
) -> list[jax.Array]:
    """The rows `indices` of each array of `dataset`, split over `mesh`.

    Args:
        mesh: the 1-D mesh (axis `"batch"`) the arrays are split over.
        dataset: arrays split along their first axis over `mesh`.
        indices: int32 row indices, a multiple of the mesh size in length.
    """
    return _taker(mesh)(list(dataset), indices)


@functools.cache
def _taker(mesh: Mesh) -> Callable:
    mapped = jax.shard_map(
        _take_local,
        mesh=mesh,
        in_specs=(PartitionSpec(_AXIS), PartitionSpec()),
        out_specs=PartitionSpec(_AXIS),
    )
    return jax.jit(mapped)


def _take_local(shards: list, indices) -> list:
    replica = jax.lax.axis_index(_AXIS)
    return [_take_one(shard, indices, replica) for shard in shards]


def _take_one(shard, indices, replica):
    rows = shard.shape[0]
    local = indices - replica * rows
    inside = (local >= 0) & (local < rows)
    taken = jnp.take(shard, jnp.clip(local, 0, rows - 1), axis=0)
    inside = inside.reshape((-1,) + (1,) * (shard.ndim - 1))
    dtype = taken.dtype
    if dtype == jnp.bool_:  # psum adds numbers: bools travel as uint8.
        taken = taken.astype(jnp.uint8)
    taken = jnp.where(inside, taken, jnp.zeros((), taken.dtype))
    summed = jax.lax.psum_scatter(taken, _AXIS, scatter_dimension=0, tiled=True)
    return summed.astype(dtype)
