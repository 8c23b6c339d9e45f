"""Device-resident input: a dataset laid out on the mesh once, batches by index.

For in-memory arrays given to `fit`/`evaluate`/`predict`, laying every batch
out from the host (`_pipeline.InputPass`: slice rows, pad, transfer) is the
per-step host work of a small model. When the strategy's
`input_options.device_resident` allows it (by default: when what a device
would hold takes at most `device_resident_budget` bytes;
`_resident_data.resident_layout`), the whole dataset is copied to every
device once instead (`Placement.lay_out_dataset`), and each step sends only the
step's row indices: inside the step, each replica gathers its rows of the
global batch from its own copy, with no communication (`Placement.take_rows`,
`_resident_batch.ResidentBatch`).

A dataset only ever read in its own order (`evaluate`, `predict`, the
validation data, `fit(shuffle=False)`) is not copied to every device: its
full batches are laid out as blocks split over the replicas
(`Placement.lay_out_blocks`), so each device holds 1/replicas of it, and a
step takes its block; the rows of a partial last batch, fewer than a batch,
are copied to every device and gathered as above.

A dataset `fit` shuffles (`shuffle=True`) whose copy is over the budget,
when asked for on the devices (`device_resident=True`), is not copied
either: its rows are split over the replicas (`Placement.lay_out_rows`), and at
its first batch a pass (an epoch) lays all its batches out from them at
once, in its order, as blocks (`Placement.exchange_rows`: one program, each
row moved once); each step then takes its block, as in order
(`_resident_data.resident_layout` chooses).

The indices are the ones Keras's own batching gives for the same call (the
same shuffle, the same NumPy random draws at the same moments; computed by
the seam that reads Keras's adapter), so the batches are, row for row, those
of the host path. A partial batch is padded as on the host path (index -1:
zero rows) and travels as a `PaddedBatch` that the step cuts.

**What a pass lays out when it starts.** A `ResidentPass` that may read
ahead reads all its index batches at its first batch and lays out, at once,
what its steps then name with kept step numbers (`Placement.step_numbers`),
so that a step transfers nothing:

- over a copied dataset: its leading full batches' indices, as one table
  (`Placement.lay_out_steps`); a step number names a row of it;
- over blocks (a dataset read only in its order): nothing; a step number
  names a block, and the pass must be those blocks, in order;
- over rows split over the replicas (shuffled): every batch of the pass, as
  blocks in the pass's order (`Placement.exchange_rows`), the leading full
  batches as one array and each batch after them (a partial last batch,
  padded) as its own.
"""

import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from keras_dist.data._batch_group import BatchGroup
from keras_dist.data._call import CallState
from keras_dist.data._partial_batch import round_up
from keras_dist.data._target import InputTarget
from keras_dist.data.resident._resident_batch import ResidentBatch, keras_form
from keras_dist.data.resident._resident_data import ResidentData

__all__ = ["KeptPass", "PassLayout", "ResidentPass", "lay_out_pass", "not_blocks"]


class ResidentPass:
    """One pass over a `ResidentData`: `ResidentBatch`es, gathered in the step.

    With `read_ahead`, the pass reads all its index batches when its first
    batch is asked for, and lays out at once what its steps then name with
    a number already on the devices (`Placement.step_numbers`), transferring
    nothing: a table of the full batches' indices, or blocks
    (`lay_out_pass`). Without it (Keras draws a batch's order
    when the batch is read: `shuffle="batch"`), each step transfers its own
    indices.

    Args:
        strategy: where the dataset lives.
        resident: the dataset.
        index_batches: the row indices of each batch of the pass (a `slice`
            or an integer array), in Keras's order.
        call: the running call (batch size, input timings), or None.
        read_ahead: whether `index_batches` may be read all at once.
        kept: for a call whose passes all read the same batches (data in
            its order), what its first pass read and laid out, for the next
            passes to take as they are (`KeptPass`); None otherwise.
    """

    def __init__(
        self,
        strategy: InputTarget,
        resident: ResidentData,
        index_batches: Iterator[Any],
        *,
        call: CallState | None,
        read_ahead: bool = False,
        kept: "KeptPass | None" = None,
    ):
        split = resident.replica_rows is not None
        if split and not read_ahead:
            raise RuntimeError(
                "keras_dist split this dataset over the replicas by rows, which "
                "needs each pass read ahead. Please report it; pass "
                "`kd.InputOptions(device_resident=False)` meanwhile."
            )
        self._strategy = strategy
        self._resident = resident
        self._indices: Iterator[np.ndarray] = (
            _as_indices(i, resident.rows) for i in index_batches
        )
        self._kept = kept if read_ahead else None
        self._call = call
        self._first = True
        self._read_ahead = read_ahead
        self._position = 0  # Batches taken so far.
        # What step numbers name; nothing until the pass is read ahead.
        self._layout = PassLayout(resident.arrays, resident.block_rows is not None)
        # Per step, only the indices change: what does not is read once.
        self._replicas = strategy.num_replicas_in_sync
        # (treedef, is_shared, shared) of a `BatchGroup`: of stacked indices,
        # and of rows of the table.
        self._group_form: _GroupForm | None = None
        self._table_form: _GroupForm | None = None

    def skip(self, count: int) -> int:
        """Passes over `count` batches (a resumed `fit`); returns how many."""
        return len(self._take(count))

    def __iter__(self) -> "ResidentPass":
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        position = self._position
        taken = self._take(1)
        if not taken:
            raise StopIteration
        batch = self._at(position, taken[0])
        self._record(start, len(taken[0]), 1)
        return keras_form(batch)

    def _at(self, position: int, indices: np.ndarray) -> ResidentBatch:
        """Batch `position` of the pass, whose rows are `indices`.

        A row of the pass's table (or block of rows) when it has one, named
        by a kept step number: nothing to transfer. Otherwise laid out from
        its indices.
        """
        layout = self._layout
        if position < layout.steps:
            return self._from_table(self._resident.step_numbers[position])
        if layout.rest is not None:  # Laid out with the table (split rows).
            blocks, num_real = layout.rest[position - layout.steps]
            first = self._resident.step_numbers[0]
            return ResidentBatch(
                blocks,
                None,
                self._resident.treedef,
                num_real,
                self._strategy.take_rows,
                first,
                True,
            )
        kept = self._kept
        if kept is None:
            return self._lay_out(indices)
        batch = kept.rest.get(position)
        if batch is None:  # The same at every pass: laid out once.
            batch = kept.rest[position] = self._lay_out(indices)
        return batch

    def _from_table(self, number: Any) -> ResidentBatch:
        """The batch a step number names: a row of the table, or a block."""
        layout = self._layout
        return ResidentBatch(
            layout.arrays,
            layout.table,
            self._resident.treedef,
            None,
            self._strategy.take_rows,
            number,
            layout.blocked,
        )

    def next_group(self, count: int) -> BatchGroup | list:
        """The next `count` batches, for one program (`steps_per_execution`).

        Full batches of one size: a `BatchGroup`, over rows of the pass's
        table (its varying leaf: a kept vector of the N step numbers,
        `Placement.step_range`), or, without a table, whose indices are laid
        out in one transfer (`Placement.lay_out_steps`). Otherwise (fewer
        batches left, a partial batch): the batches, as `next` gives them. As
        Keras's loop: `StopIteration` when not even one batch is left.
        """
        start = time.perf_counter()
        position = self._position
        group = self._take(count)
        if not group:
            raise StopIteration
        size = len(group[0])
        if len(group) == count and position + count <= self._layout.steps:
            # Rows of the pass's table: one vector of step numbers, kept.
            if self._table_form is None:
                self._table_form = _group_form(self._from_table(0))
            self._record(start, size, count)
            rows = self._strategy.step_range(position, count)
            return BatchGroup(*self._table_form, (rows,))
        uneven = size % self._replicas or self._layout.blocked
        if len(group) < count or uneven or any(len(i) != size for i in group):
            batches = [
                keras_form(self._at(position + i, indices))
                for i, indices in enumerate(group)
            ]
            self._record(start, size, len(group))
            return batches
        stacked = self._strategy.lay_out_steps(np.stack(group))
        if self._group_form is None:
            self._group_form = _group_form(self._batch(0, None))
        self._record(start, size, count)
        return BatchGroup(*self._group_form, (stacked,))

    def _take(self, count: int) -> list[np.ndarray]:
        """The next `count` index batches (fewer at the end of the pass)."""
        if self._read_ahead:
            self._read_ahead = False
            kept = self._kept
            if kept is not None and kept.layout is not None:
                self._indices = iter(kept.batches)
                self._layout = kept.layout
            else:
                batches = list(self._indices)
                self._indices = iter(batches)
                self._layout = lay_out_pass(self._strategy, self._resident, batches)
                if kept is not None:
                    kept.batches, kept.layout = batches, self._layout
        taken = list(itertools.islice(self._indices, count))
        self._position += len(taken)
        if not taken:
            self.close()
        return taken

    def _lay_out(self, indices: np.ndarray) -> ResidentBatch:
        size = len(indices)
        block_rows = self._resident.block_rows
        if block_rows is not None:  # Rows after the blocks: the tail's.
            first = len(self._resident.arrays[0]) * block_rows
            if size and indices.min() < first:
                raise not_blocks(
                    block_rows, f"a batch of {size} rows reads rows before row {first}"
                )
            indices = indices - first
        padded = round_up(size, self._replicas)
        if padded != size:
            indices = np.concatenate([indices, np.full(padded - size, -1, np.int32)])
        return self._batch(
            self._strategy.lay_out(indices), size if padded != size else None
        )

    def _batch(self, indices: Any, num_real: int | None) -> ResidentBatch:
        """A batch gathered by its `indices`: from the copy, or the blocks' tail."""
        resident = self._resident
        arrays = resident.tail if resident.block_rows is not None else resident.arrays
        return ResidentBatch(
            arrays, indices, resident.treedef, num_real, self._strategy.take_rows
        )

    def _record(self, start: float, size: int, batches: int) -> None:
        """`batches` batches of `size` rows were laid out since `start`.

        On the step loop's thread: producing them is also what it waited for.
        """
        if self._call is not None:
            if self._first:
                self._call.observe_batch_size(size)
            seconds = time.perf_counter() - start
            stats = self._call.input_stats
            stats.record(seconds, first=self._first, batches=batches)
            stats.record_wait(seconds, batches)
        self._first = False

    def close(self) -> None:
        """Lets go of the pass's own batches (as `InputPass.close`).

        A split dataset's pass laid its batches out (as much memory as the
        dataset): freed before the next pass lays out its own.
        """
        self._layout = PassLayout(None, self._layout.blocked)
        self._table_form = None


@dataclasses.dataclass
class KeptPass:
    """What the first pass of a call read and laid out, when every pass is alike.

    `evaluate`, `predict`, validation data and `fit(shuffle=False)` read the
    same index batches at every pass: the later passes of the call take the
    first one's indices, `PassLayout` and laid-out partial batch as they
    are, instead of reading, stacking, checking and transferring them again
    each epoch.
    """

    batches: list = dataclasses.field(default_factory=list)
    layout: "PassLayout | None" = None
    # The batches after the layout's steps (a partial last batch), laid
    # out, by their position in the pass.
    rest: dict = dataclasses.field(default_factory=dict)


# (treedef, is_shared, shared): the fields of a `BatchGroup` but `varying`.
_GroupForm = tuple[Any, tuple[bool, ...], tuple]


def _group_form(batch: ResidentBatch) -> _GroupForm:
    """The `BatchGroup` fields of groups of `batch`'s form whose last leaf varies."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, (True,) * (len(leaves) - 1) + (False,), tuple(leaves[:-1])


def _as_indices(indices: Any, rows: int) -> np.ndarray:
    if isinstance(indices, slice):
        return np.arange(*indices.indices(rows), dtype=np.int32)
    return np.asarray(indices, dtype=np.int32)


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
    numbers = resident.step_numbers
    if len(numbers) < max(steps, 1):  # The first pass: kept for the next ones.
        numbers[:] = strategy.step_numbers(max(steps, 1))
    if resident.replica_rows is not None:
        return _exchanged(strategy, resident, resident.replica_rows, batches, steps)
    block_rows = resident.block_rows
    layout = PassLayout(resident.arrays, block_rows is not None, steps=steps)
    if not steps:
        return layout  # Every batch padded: laid out one by one.
    table = np.stack(batches[:steps])
    if block_rows is None:
        layout.table = strategy.lay_out_steps(table)
        return layout
    in_order = np.array_equal(table.ravel(), np.arange(table.size))
    if not (in_order and size == block_rows):
        order = "" if in_order else " out of order"
        raise not_blocks(block_rows, f"this pass reads batches of {size} rows{order}")
    return layout


def _exchanged(
    strategy: InputTarget,
    resident: ResidentData,
    replica_rows: int,
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
    laid = strategy.exchange_rows(resident.arrays, replica_rows, groups)
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
