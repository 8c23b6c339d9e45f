"""A device-resident dataset: laid out on the mesh once (`_resident.py` reads it).

Three layouts (`resident_layout` chooses, by how the dataset is read, the
strategy's `InputOptions` and the dataset's size):
- `BLOCKS`, read only in its own order: its full batches split over the
  replicas as blocks and the rows after them copied to every device
  (`Placement.lay_out_blocks`); each step takes its block.
- `COPY`, shuffled, when a copy on every device fits the budget (or when
  asked for, `device_resident=True`, and only a copy serves): copied to
  every device (`Placement.lay_out_dataset`); each step gathers its rows from
  its copy.
- `ROWS`, shuffled by `fit` (`shuffle=True`), too big to copy, and asked
  for (`device_resident=True`): its rows split over the replicas
  (`Placement.lay_out_rows`); each pass lays its batches out from them once as
  blocks (`Placement.exchange_rows`), and each step takes its block.
The budget (`InputOptions.device_resident_budget`) is what one device's
memory may hold: the dataset for a copy, its share (1/replicas) split; CPU
devices share the host's memory, which holds all their parts (a copy on
each: replicas times the dataset).
"""

import dataclasses
from typing import Any

import jax

from keras_dist.data._input_context import InputOptions
from keras_dist.data._partial_batch import batch_size_of
from keras_dist.data._target import InputTarget

__all__ = [
    "BLOCKS",
    "COPY",
    "DEFAULT_BUDGET",
    "ROWS",
    "ResidentData",
    "budget",
    "lay_out_resident",
    "resident_layout",
]

BLOCKS, COPY, ROWS = "blocks", "copy", "rows"
# The budget where the devices report no free memory (CPU devices).
DEFAULT_BUDGET = 256 * 2**20


def budget(options: InputOptions, devices) -> int:
    """The bytes of a dataset one device may hold: `options`'s, or (None) a
    quarter of the free memory of the device with the least, as the
    backend reports it (`memory_stats()`); `DEFAULT_BUDGET` where a device
    reports none."""
    if options.device_resident_budget is not None:
        return options.device_resident_budget
    free = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return DEFAULT_BUDGET
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return max(min(free), 0) // 4 if free else DEFAULT_BUDGET


@dataclasses.dataclass(frozen=True)
class ResidentData:
    """A dataset laid out on the mesh: its arrays, structure and real rows.

    With `block_rows`, `arrays` are the full batches of `block_rows` rows as
    blocks split over the replicas (`Placement.lay_out_blocks`), and `tail` the
    rows after them, on every device. With `replica_rows`, `arrays` are the
    dataset split over the replicas by rows, `replica_rows` each
    (`Placement.lay_out_rows`). Otherwise `arrays` is the dataset on every
    device.
    """

    arrays: list
    treedef: Any
    rows: int
    tail: list | None = None
    block_rows: int | None = None
    replica_rows: int | None = None
    # The step numbers `0 ... steps - 1` on every device, made by the first
    # pass (`_resident.lay_out_pass`) and kept for the next ones.
    step_numbers: list = dataclasses.field(default_factory=list)


def resident_layout(
    options: InputOptions,
    total_bytes: int,
    replicas: int,
    *,
    in_order: bool,
    splittable: bool,
    devices: tuple = (),
) -> str | None:
    """How a dataset of `total_bytes` is laid out on the devices, or None.

    Args:
        options: the strategy's input options.
        total_bytes: the dataset's bytes on the devices.
        replicas: the replica count.
        in_order: every pass reads it in its order, in full batches of a
            multiple of `replicas` rows (then: `BLOCKS`).
        splittable: `fit` shuffles it whole each pass (`shuffle=True`), in
            batches of a multiple of `replicas` rows (then `ROWS` when
            `device_resident=True` and a copy is over the budget).
        devices: the devices the data goes to (their free memory sets a
            budget of None). CPU devices share one memory (the host's RAM),
            which then holds every device's part: a copy costs `replicas`
            times the dataset, blocks the dataset.

    Returns:
        `BLOCKS`, `COPY` or `ROWS`; None: not on the devices (the host
        path): with `device_resident=None`, when what a device would hold
        is over the budget (a copy, or blocks' share), and with
        `device_resident=False`.
    """
    if options.device_resident is False:
        return None
    forced = options.device_resident is True
    limit = budget(options, devices)
    replicas = max(replicas, 1)
    if devices and all(d.platform == "cpu" for d in devices):
        share, copy = total_bytes, total_bytes * replicas
    else:
        share, copy = -(-total_bytes // replicas), total_bytes
    if in_order:
        return BLOCKS if forced or share <= limit else None
    if copy <= limit:
        return COPY
    if not forced:
        # Measured on CPU devices, the host path beat the split layout for
        # data no device can hold whole (`_exchange.py`): on request only.
        return None
    return ROWS if splittable else COPY


def lay_out_resident(
    strategy: InputTarget,
    data: Any,
    layout: str = COPY,
    *,
    block_rows: int | None = None,
) -> ResidentData:
    """Lays `data` (a pytree of host arrays, rows first) out on the devices.

    `COPY`: to every device. `BLOCKS` (a dataset read only in order, in
    batches of `block_rows` rows, a multiple of the replica count): blocks
    of its full batches split over the replicas, and its remaining rows to
    every device. `ROWS` (a dataset `fit` shuffles): split over the
    replicas by rows.
    """
    rows = batch_size_of(data) or 0
    if layout == ROWS:
        split, replica_rows = strategy.lay_out_rows(data)
        arrays, treedef = jax.tree.flatten(split)
        return ResidentData(arrays, treedef, rows, replica_rows=replica_rows)
    if layout == COPY:
        arrays, treedef = jax.tree.flatten(strategy.lay_out_dataset(data))
        return ResidentData(arrays, treedef, rows)
    if block_rows is None:
        raise ValueError(f"The {layout} layout needs `block_rows`.")
    blocks, tail = strategy.lay_out_blocks(data, block_rows)
    arrays, treedef = jax.tree.flatten(blocks)
    return ResidentData(arrays, treedef, rows, jax.tree.leaves(tail), block_rows)
