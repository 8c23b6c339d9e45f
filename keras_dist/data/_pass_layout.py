"""What a device-resident pass lays out when it starts (`_resident.py`).

A `ResidentPass` that may read ahead reads all its index batches at its
first batch and lays out, at once, what its steps then name with kept step
numbers (`Strategy.step_numbers`), so that a step transfers nothing:

- over a copied dataset: its leading full batches' indices, as one table
  (`Strategy.shard_steps`); a step number names a row of it;
- over blocks (a dataset read only in its order): nothing; a step number
  names a block, and the pass must be those blocks, in order;
- over rows split over the replicas (shuffled): every batch of the pass, as
  blocks in the pass's order (`Strategy.exchange_rows`), the leading full
  batches as one array and each batch after them (a partial last batch,
  padded) as its own.
"""

import dataclasses
from typing import Any

import numpy as np

from keras_dist.data._partial_batch import round_up
from keras_dist.data._resident_data import ResidentData
from keras_dist.data._target import InputTarget

__all__ = ["PassLayout", "lay_out_pass", "not_blocks"]


@dataclasses.dataclass
class PassLayout:
    """What a pass's step numbers name.

    Attributes:
        arrays: the arrays a step takes from: the dataset (a copy, or
            blocks), or the pass's own blocks (split rows).
        blocked: a step number names a block of `arrays`, not a row of
            `table`.
        table: over a copy, the leading full batches' indices laid out as
            one table; otherwise None.
        steps: the batches named by step numbers (the leading full ones).
        rest: over split rows, the batches after them, each laid out as
            `(blocks, real rows or None)`; otherwise None (each is laid out
            from its indices when read).
    """

    arrays: list | None
    blocked: bool
    table: Any = None
    steps: int = 0
    rest: list | None = None


def lay_out_pass(
    strategy: InputTarget, resident: ResidentData, batches: list[np.ndarray]
) -> PassLayout:
    """Lays a pass of `batches` (Keras's index batches) out on the devices."""
    replicas = strategy.num_replicas_in_sync
    size = len(batches[0]) if batches else 0
    steps = 0
    if size and size % replicas == 0:
        steps = next((i for i, b in enumerate(batches) if len(b) != size), len(batches))
    if resident.replica_rows is not None:
        return _exchanged(strategy, resident, batches, steps)
    blocked = resident.block_rows is not None
    layout = PassLayout(resident.arrays, blocked, steps=steps)
    if not steps:
        return layout  # Every batch padded: laid out one by one.
    table = np.stack(batches[:steps])
    if not blocked:
        layout.table = strategy.shard_steps(table)
        return layout
    in_order = np.array_equal(table.ravel(), np.arange(table.size))
    if not (in_order and size == resident.block_rows):
        order = "" if in_order else " out of order"
        raise not_blocks(
            resident.block_rows, f"this pass reads batches of {size} rows{order}"
        )
    return layout


def _exchanged(
    strategy: InputTarget,
    resident: ResidentData,
    batches: list[np.ndarray],
    steps: int,
) -> PassLayout:
    """Every batch of the pass, laid out from the split rows at once."""
    replicas = strategy.num_replicas_in_sync
    groups = [np.stack(batches[:steps])] if steps else []
    real = []
    for indices in batches[steps:]:
        padded = round_up(len(indices), replicas)
        pad = np.full(padded - len(indices), -1, np.int32)
        groups.append(np.concatenate([indices, pad])[None])
        real.append(len(indices) if padded != len(indices) else None)
    if not groups:
        return PassLayout(None, True)
    laid = strategy.exchange_rows(resident.arrays, resident.replica_rows, groups)
    arrays = None
    if steps:
        arrays, laid = laid[0], laid[1:]
    return PassLayout(
        arrays, True, steps=steps, rest=list(zip(laid, real, strict=True))
    )


def not_blocks(block_rows: int, what: str) -> RuntimeError:
    """A pass that blocks laid out for passes in order cannot serve (a bug)."""
    return RuntimeError(
        "keras_dist laid this dataset out for passes in its order, as blocks "
        f"of {block_rows} rows, but {what}. Please report it; pass "
        "`kd.InputOptions(device_resident=False)` meanwhile."
    )
