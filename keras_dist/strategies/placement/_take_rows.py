"""Rows of a device-resident dataset, taken on the devices by index or by block.

A device-resident dataset (`keras_dist/data/resident/_resident.py`) that `fit`
shuffles and a device can hold is copied once to every device of the mesh
(one too big to copy is split by rows, and each pass laid out as blocks:
`_exchange.py`). A step's global batch
is the rows named by an index vector; replica `r` receives its share of the
vector (a few bytes a row) and takes its rows from its own copy: batch rows
`r * b ... (r + 1) * b - 1`, the layout of `lay_out`, with no communication
between devices. An index of -1 gives a row of zeros: the padding of a
partial batch. On CPU devices a shuffled step, gathering, is slower than
one in order, which slices a block (`python
benchmarks/single_vs_mirrored.py --configs B,BS` measures it: BS against B).

A dataset read only in its own order (`evaluate`, `predict`, the validation
data, `fit(shuffle=False)`) is not copied to every device: its full batches
are laid out as blocks `(steps, batch, ...)` split over the replicas along
the batch axis (`ResidentPlacement.lay_out_blocks`), each device holding only its rows
of every batch — 1/replicas of the dataset — and `take_block` indexes the
step's block on each device, with no communication either.

Neither take has a collective: a step's gather from rows split over the
replicas would need one in every step (an `all_to_all` of the batch's rows
next to the gradients' all-reduce); the split layout pays for one per pass
instead (`_exchange.py`).
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

__all__ = ["take_block", "take_rows"]

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


def take_block(mesh: Mesh, blocks: Sequence[jax.Array], step) -> list:
    """Batch `step` of each array of `blocks`, split over `mesh`.

    Args:
        mesh: the 1-D mesh (axis `"batch"`).
        blocks: arrays `(steps, batch, ...)` split over `mesh` along their
            second axis (`ResidentPlacement.lay_out_blocks`).
        step: an int32 scalar, replicated (inside a step: traced).
    """
    return _block_taker(mesh)(list(blocks), step)


@functools.cache
def _block_taker(mesh: Mesh) -> Callable:
    def take_local(blocks: list, step) -> list:
        return [jax.lax.dynamic_index_in_dim(a, step, keepdims=False) for a in blocks]

    mapped = jax.shard_map(
        take_local,
        mesh=mesh,
        in_specs=(PartitionSpec(None, _AXIS), PartitionSpec()),
        out_specs=PartitionSpec(_AXIS),
    )
    return jax.jit(mapped)


def _take_local(dataset: list, indices) -> list:
    return [_take_one(array, indices) for array in dataset]


def _take_one(array, indices):
    taken = jnp.take(array, jnp.maximum(indices, 0), axis=0)
    real = (indices >= 0).reshape((-1,) + (1,) * (array.ndim - 1))
    return jnp.where(real, taken, jnp.zeros((), taken.dtype))
