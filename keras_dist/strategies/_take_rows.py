"""Rows of a dataset copied to every device, gathered on the devices by index.

A device-resident dataset (`keras_dist/data/_resident.py`) is copied once to
every device of the mesh. A step's global batch is the rows named by an index
vector; replica `r` receives its share of the vector (a few bytes a row) and
takes its rows from its own copy: batch rows `r * b ... (r + 1) * b - 1`, the
layout of `shard`, with no communication between devices. An index of -1
gives a row of zeros: the padding of a partial batch.

The gather has no collective on purpose: on a CPU with virtual devices, a
second program with a collective in flight next to the step's all-reduce was
seen to deadlock XLA's rendezvous (a layout with rows split over the
replicas needs one).
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

__all__ = ["take_rows"]

_AXIS = "batch"


def take_rows(mesh: Mesh, dataset: Sequence[jax.Array], indices) -> list[jax.Array]:
    """The rows `indices` of each array of `dataset`, split over `mesh`.

    Args:
        mesh: the 1-D mesh (axis `"batch"`).
        dataset: arrays replicated on every device of `mesh`.
        indices: int32 row indices, a multiple of the mesh size in length.
    """
    return _taker(mesh)(list(dataset), indices)


@functools.cache
def _taker(mesh: Mesh) -> Callable:
    mapped = jax.shard_map(
        _take_local,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(_AXIS)),
        out_specs=PartitionSpec(_AXIS),
    )
    return jax.jit(mapped)


def _take_local(dataset: list, indices) -> list:
    return [_take_one(array, indices) for array in dataset]


def _take_one(array, indices):
    taken = jnp.take(array, jnp.maximum(indices, 0), axis=0)
    real = (indices >= 0).reshape((-1,) + (1,) * (array.ndim - 1))
    return jnp.where(real, taken, jnp.zeros((), taken.dtype))
