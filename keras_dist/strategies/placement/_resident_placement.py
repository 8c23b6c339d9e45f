"""Device-resident datasets on a strategy's mesh: placed once, taken in the step.

The placement side of `keras_dist/data/resident/_resident.py`: a dataset copied to
every device (`lay_out_dataset`), split over the replicas as blocks of
batches (`lay_out_blocks`), or split by rows (`lay_out_rows`) with each pass
laid out as blocks from them (`exchange_rows`, the program in
`_exchange.py`); the kept step numbers that name a step's batch
(`step_numbers`, `step_range`), and the take of a batch inside the step
(`take_rows`, with the device programs in `_take_rows.py`).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_dist.strategies.placement._exchange import exchange, plan_exchange
from keras_dist.strategies.placement._placement import Placement, _as_array, _place
from keras_dist.strategies.placement._take_rows import take_block, take_rows

__all__ = ["ResidentPlacement"]

# What a round of `exchange_rows` sends (and receives) a device, at most:
# about the batches a replica lays out in one round. Rounds bound the
# memory the exchange takes beyond its result; one round is the fastest.
_ROUND_BYTES = 64 * 2**20


class ResidentPlacement(Placement):
    """A `Placement` that also lays out device-resident datasets.

    What every `Strategy` owns as its `placement`.
    """

    def step_numbers(self, count: int) -> list[jax.Array]:
        """The int32 scalars `0 ... count - 1`, replicated over the mesh.

        Made once each and kept: a device-resident pass names each step's
        row of its index table with one, so that the step transfers nothing.
        """
        numbers = self._step_numbers
        while len(numbers) < count:
            numbers.append(jax.device_put(np.int32(len(numbers)), self._replicated))
        return numbers

    def step_range(self, start: int, count: int) -> jax.Array:
        """The int32 vector `start ... start + count - 1`, replicated; kept.

        A fused group of a device-resident pass names its N steps with one
        (rows of the pass's index table, or blocks of rows of a pass in
        order): one argument for N steps, not N scalars.
        """
        numbers = self._step_ranges.get((start, count))
        if numbers is None:
            numbers = jax.device_put(
                np.arange(start, start + count, dtype=np.int32), self._replicated
            )
            self._step_ranges[start, count] = numbers
        return numbers

    def lay_out_dataset(self, data: Any) -> Any:
        """Copies a whole dataset (a pytree of host arrays) to every device.

        For `take_rows`; one process only.
        """
        return jax.tree.map(lambda leaf: self.replicate(_as_array(leaf)), data)

    def lay_out_blocks(self, data: Any, batch_rows: int) -> tuple[Any, Any]:
        """Lays a dataset read in its order out as blocks split over the replicas.

        For a pass in the dataset's own order, batches of `batch_rows` rows
        (a multiple of `num_replicas_in_sync`): its full batches become one
        array `(steps, batch_rows, ...)` per leaf, split along the batch
        axis, so each device holds only its rows of every batch (not a copy
        of the dataset) and `take_rows(blocks, step, blocked=True)` takes a
        batch with no communication. One process only.

        Returns:
            `(blocks, tail)`: pytrees like `data`, the full batches as
            blocks, and the rows after them (fewer than `batch_rows`: a
            partial last batch) copied to every device, for `take_rows`.
        """
        if batch_rows % self.num_replicas_in_sync:
            raise ValueError(
                "`lay_out_blocks` splits each batch over the replicas. Received "
                f"batch_rows={batch_rows} for {self.num_replicas_in_sync} "
                "replicas; pass a multiple of the replica count."
            )

        def blocks(leaf):
            leaf = _as_array(leaf)
            steps = leaf.shape[0] // batch_rows
            full = leaf[: steps * batch_rows].reshape(
                steps, batch_rows, *leaf.shape[1:]
            )
            return _place(full, self._steps_sharding(full.ndim))

        def tail(leaf):
            leaf = _as_array(leaf)
            return self.replicate(leaf[leaf.shape[0] // batch_rows * batch_rows :])

        return jax.tree.map(blocks, data), jax.tree.map(tail, data)

    def lay_out_rows(self, data: Any) -> tuple[Any, int]:
        """Splits a dataset (a pytree of host arrays) over the replicas by rows.

        For a dataset `fit` shuffles: each pass lays its batches out from it
        with `exchange_rows`. Replica `r` holds rows `r * n ... (r + 1) * n
        - 1` (the last padded with zero rows). One process only.

        Returns:
            `(rows, n)`: a pytree like `data` of arrays split over the mesh
            along their first axis, and the rows `n` each replica holds.
        """
        replicas = self.num_replicas_in_sync
        count = max((np.shape(leaf)[0] for leaf in jax.tree.leaves(data)), default=0)
        n = max(1, -(-count // replicas))

        def split(leaf):
            leaf = _as_array(leaf)
            pad = n * replicas - leaf.shape[0]
            if pad:
                xp = np if isinstance(leaf, np.ndarray) else jnp
                zeros = xp.zeros((pad, *leaf.shape[1:]), leaf.dtype)
                leaf = xp.concatenate([leaf, zeros])
            return _place(leaf, self._data_sharding(leaf.ndim))

        return jax.tree.map(split, data), n

    def exchange_rows(
        self, rows: list, replica_rows: int, batches: list[np.ndarray]
    ) -> list[list[jax.Array]]:
        """Lays out groups of batches of rows `lay_out_rows` split, as blocks.

        One program (`_exchange.py`): each row moves once, with an
        `all_to_all` a round.

        Args:
            rows: the arrays `lay_out_rows` placed (flattened).
            replica_rows: the rows each replica holds (`lay_out_rows`).
            batches: groups of batches, each an int32 array `(count,
                batch_rows)` of row indices (-1: padding; `batch_rows` a
                multiple of `num_replicas_in_sync`).

        Returns:
            Per group, per array of `rows`: its batches as blocks `(count,
            batch_rows, ...)`, as `lay_out_blocks` lays them out (for
            `take_rows(..., blocked=True)`).
        """
        row_bytes = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in rows)
        plan = plan_exchange(
            batches,
            replica_rows,
            self.num_replicas_in_sync,
            round_rows=_ROUND_BYTES // max(row_bytes, 1),
        )
        send = _place(plan.send, self._data_sharding(plan.send.ndim))
        receive = _place(plan.receive, self._data_sharding(plan.receive.ndim))
        groups = exchange(self.mesh, rows, send, receive, plan.segments)
        self.pacer.after(groups)
        return groups

    def take_rows(self, dataset: list, indices, *, blocked: bool = False):
        """Rows `indices` of arrays `lay_out_dataset` placed, gathered on the devices.

        Args:
            dataset: arrays `lay_out_dataset` placed (or, with `blocked`,
                arrays of blocks `lay_out_blocks` placed).
            indices: int32 row indices laid out by `lay_out` (a multiple of
                `num_replicas_in_sync`); -1 gives a row of zeros (padding).
                With `blocked`: a replicated int32 step number. Inside a
                compiled step: traced values.
            blocked: `dataset` is blocks (`lay_out_blocks`) and `indices` a
                step number: that block, taken on each device.

        Returns:
            The global batches, laid out as `lay_out` lays out a batch.
        """
        if blocked:
            placed = take_block(self.mesh, dataset, indices)
        else:
            placed = take_rows(self.mesh, dataset, indices)
        if not isinstance(placed[0], jax.core.Tracer):
            self._remember_batches(placed)
        return placed
