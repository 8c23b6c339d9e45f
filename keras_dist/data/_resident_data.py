"""A device-resident dataset: laid out on the mesh once (`_resident.py` reads it).

Three layouts, by how the dataset is read:
- only in its own order: its full batches split over the replicas as blocks
  and the rows after them copied to every device (`Strategy.place_blocks`);
- shuffled by `fit` (`shuffle=True`): its rows split over the replicas
  (`Strategy.place_rows`), each pass's batches laid out from them once
  (`Strategy.exchange_rows`);
- shuffled batch by batch as Keras reads it (`shuffle="batch"`): copied to
  every device (`Strategy.place_dataset`).
`wants_resident` decides by the strategy's `InputOptions` and the dataset's
size.
"""

import dataclasses
from typing import Any

import jax

from keras_dist.data._input_context import InputOptions
from keras_dist.data._partial_batch import batch_size_of
from keras_dist.data._target import InputTarget

__all__ = ["ResidentData", "lay_out_resident", "wants_resident"]


@dataclasses.dataclass(frozen=True)
class ResidentData:
    """A dataset laid out on the mesh: its arrays, structure and real rows.

    With `block_rows`, `arrays` are the full batches of `block_rows` rows as
    blocks split over the replicas (`Strategy.place_blocks`), and `tail` the
    rows after them, on every device. With `replica_rows`, `arrays` are the
    dataset split over the replicas by rows, `replica_rows` each
    (`Strategy.place_rows`). Otherwise `arrays` is the dataset on every
    device.
    """

    arrays: list
    treedef: Any
    rows: int
    tail: list | None = None
    block_rows: int | None = None
    replica_rows: int | None = None


def wants_resident(options: InputOptions, total_bytes: int) -> bool:
    """Whether a dataset of `total_bytes` goes to the devices under `options`."""
    if options.device_resident is not None:
        return options.device_resident
    return total_bytes <= options.device_resident_budget


def lay_out_resident(
    strategy: InputTarget,
    data: Any,
    *,
    block_rows: int | None = None,
    split_rows: bool = False,
) -> ResidentData:
    """Copies `data` (a pytree of host arrays, rows first) to the devices.

    To every device; or, with `block_rows` (a dataset read only in order,
    in batches of `block_rows` rows, a multiple of the replica count), as
    blocks of its full batches split over the replicas, and its remaining
    rows to every device; or, with `split_rows` (a dataset `fit` shuffles),
    split over the replicas by rows.
    """
    rows = batch_size_of(data) or 0
    if split_rows:
        split, replica_rows = strategy.place_rows(data)
        arrays, treedef = jax.tree.flatten(split)
        return ResidentData(arrays, treedef, rows, replica_rows=replica_rows)
    if block_rows is None:
        arrays, treedef = jax.tree.flatten(strategy.place_dataset(data))
        return ResidentData(arrays, treedef, rows)
    blocks, tail = strategy.place_blocks(data, block_rows)
    arrays, treedef = jax.tree.flatten(blocks)
    return ResidentData(arrays, treedef, rows, jax.tree.leaves(tail), block_rows)
